"""The cache under a memory limit: planned within the room the limit leaves, stopped before the kernel kills.

Shared memory is charged to the memory cgroup of the process that writes it and cannot be
reclaimed, so a cache sized from /dev/shm alone gets a container or a Slurm job killed. The
budget's rules are tested with given limits; the cache's stop with a limit that shrinks as
it fills; and the whole loader in a real v1 memory cgroup (root only) whose limit leaves room
for part of the dataset, as in the issue "Container and cluster reality".
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pytest

from coordl.fetch.budget import resolve_budget
from coordl.fetch.cache import NodeCache
from coordl.fetch.chunks import headroom
from coordl.index import Index
from coordl.shm import limits, names
from coordl.shm.limits import Level

MiB, GiB = 1 << 20, 1 << 30
PHOTOS = Path(__file__).resolve().parents[2] / "shared" / "photos"


def chunk_bytes_in(directory) -> int:
    return sum(
        os.stat(os.path.join(directory, e)).st_size
        for e in os.listdir(directory)
        if (p := names.parse_name(e)) is not None and p[1] == "chunk"
    )


# -- the budget --------------------------------------------------------------------------------
def test_explicit_budget_past_the_memory_room_shrinks_with_a_warning_naming_the_limit(isolated, memory_limit):
    level = Level("cgroup /job (v2)", GiB, 600 * MiB)  # room: 1 GiB - 600 MiB - 256 MiB = 168 MiB
    assert level.room == 168 * MiB
    memory_limit(level)
    for request in (1.0, "1GB", 10**9):
        with pytest.warns(RuntimeWarning, match="does not fit in the memory limit") as rec:
            assert resolve_budget(request, 10**9, str(isolated)) == 168 * MiB
        msg = str(rec[0].message)
        assert "cgroup /job (v2)" in msg and "1.1 GB" in msg and "629.1 MB in use" in msg and "--memory" in msg
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # what fits in the room is taken as asked
        assert resolve_budget("100MiB", 10**9, str(isolated)) == 100 * MiB
        memory_limit(None)  # no limit can be read: only /dev/shm bounds the budget
        assert resolve_budget(1.0, 10**9, str(isolated)) == 10**9  # limits ignored
        memory_limit(Level("x", GiB, GiB))
        assert resolve_budget(0, 10**9, str(isolated)) == 0


def test_auto_never_plans_past_the_room_and_says_so(isolated, caplog, memory_limit):
    d = str(isolated)
    memory_limit(Level("cgroup /job (v1)", GiB, 600 * MiB))
    with caplog.at_level(logging.WARNING, logger="coordl"):
        assert resolve_budget("auto", 10**9, d) == 168 * MiB
    assert "cache budget of 176.2 MB for a dataset of 1.0 GB" in caplog.text and "cgroup /job (v1)" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="coordl"):
        assert resolve_budget("auto", 100 * MiB, d) == 100 * MiB  # fits: as before, silently
        assert caplog.text == ""
        memory_limit(Level("cgroup /tiny (v2)", 300 * MiB, 100 * MiB))
        assert resolve_budget("auto", 10**9, d) == 0
    assert "no room for a cache within the memory limit of 314.6 MB (cgroup /tiny (v2)" in caplog.text


def test_the_smaller_of_shm_and_memory_decides_and_only_it_is_named(isolated, memory_limit):
    d = str(isolated)
    space = os.statvfs(d)
    usable = space.f_bavail * space.f_frsize - headroom(space.f_blocks * space.f_frsize)
    memory_limit(Level("cgroup /big (v2)", 4 * usable, 0))  # more room than /dev/shm has
    with pytest.warns(RuntimeWarning, match=f"does not fit in {d}") as rec:
        got = resolve_budget(10 * usable, 10 * usable, d)
    assert abs(got - usable) < 64 * MiB and len(rec) == 1 and "memory limit" not in str(rec[0].message)
    assert 0 < resolve_budget("auto", 10 * usable, d) <= usable // 2 + 64 * MiB


# -- the cache stops growing before the limit -----------------------------------------------------
def test_cache_stops_growing_when_the_memory_room_runs_out(isolated, cache_layout, memory_limit):
    """Each chunk is charged to the cgroup: the limit here leaves room for three of them."""
    d = str(isolated)
    base = Level("cgroup /fake (v2)", limits.MIN_MARGIN + 3500, 0)
    calls = []

    def memory():  # what the kernel would say: the chunks made so far are in use
        calls.append(1)
        return Level(base.name, base.limit, chunk_bytes_in(d))

    sizes = np.full(40, 100)
    cache_layout(1000)
    memory_limit(memory)
    cache = NodeCache("00c0ffee00c0ffee", sizes, 4000, directory=d)
    try:
        with warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter("always")
            admitted = []
            for _round in range(3):
                for i in range(len(sizes)):
                    views = cache.reserve_many([i])[0]
                    if views is not None:
                        for v in views:
                            v[:] = i
                        cache.publish_many([i])
                        admitted.append(i)
        assert admitted == list(range(30))  # three chunks of 1000 bytes, then nothing more
        assert chunk_bytes_in(d) == 3000 and cache.resident_bytes == 3000 < cache.budget
        msgs = [str(w.message) for w in rec if w.category is RuntimeWarning]
        assert len(msgs) == 1, msgs  # said once
        assert "stopped growing at 3.0 KB of its 4.0 KB budget because the memory limit" in msgs[0]
        assert "cgroup /fake (v2)" in msgs[0] and "is near" in msgs[0]
        assert len(calls) == 4  # checked once per chunk, not per sample
        assert all(cache.get(i).tolist() == [i] * 100 for i in admitted)  # what was admitted stays
    finally:
        cache.close()


def reserved_bytes_in(directory) -> int:
    """Bytes the chunk files hold in memory (their blocks), not their sizes: chunks are sparse."""
    return sum(
        os.stat(os.path.join(directory, e)).st_blocks * 512
        for e in os.listdir(directory)
        if (p := names.parse_name(e)) is not None and p[1] == "chunk"
    )


def test_memory_is_reserved_and_checked_a_slice_at_a_time(isolated, cache_layout, memory_limit):
    """Chunks are files of their full size that take memory only as slices are reserved; the
    limit is checked once a slice, and the cache overshoots the room by less than a slice."""
    d = str(isolated)
    chunk, piece = 64 << 10, 16 << 10
    checks = []

    def memory():  # the limit leaves room for three slices and a bit (the slices reserved so far are in use)
        checks.append(reserved_bytes_in(d))
        return Level("cgroup /fake (v1)", limits.MIN_MARGIN + 3 * piece + 848, reserved_bytes_in(d))

    sizes = np.full(64, 4000)
    cache_layout(chunk, piece)
    memory_limit(memory)
    cache = NodeCache("00c0ffee00c0ffee", sizes, 10**6, directory=d)
    try:
        with warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter("always")
            admitted = []
            for i in range(len(sizes)):
                views = cache.reserve_many([i])[0]
                if views is not None:
                    for v in views:
                        v[:] = i % 251
                    cache.publish_many([i])
                    admitted.append(i)
                    assert reserved_bytes_in(d) == -(-4000 * len(admitted) // piece) * piece  # whole slices, in order
                    assert chunk_bytes_in(d) == chunk  # one chunk file, full size, sparse
        assert admitted == list(range(12))  # 3 slices of 16 KiB hold 12 items of 4000 bytes
        assert checks == [0, piece, 2 * piece, 3 * piece]  # once a slice, never per sample
        msgs = [str(w.message) for w in rec if w.category is RuntimeWarning]
        assert len(msgs) == 1 and "stopped growing at 48.0 KB of its 1.0 MB budget because the memory limit" in msgs[0]
        assert all(cache.get(i).tolist() == [i % 251] * 4000 for i in admitted)
    finally:
        cache.close()


# -- the loader in a real memory cgroup -------------------------------------------------------------
def memory_cgroup_root() -> Path:
    """This process's v1 memory cgroup folder; skips where there is none or we are not root."""
    if os.geteuid() != 0:
        pytest.skip("making a memory cgroup needs root")
    path = limits.parse_proc_cgroup(Path("/proc/self/cgroup").read_text()).get(1)
    mounts = [m for m in limits.parse_mountinfo(Path("/proc/self/mountinfo").read_text()) if m.version == 1]
    dirs = limits.cgroup_dirs(path, mounts[0]) if path is not None and mounts else []
    if not dirs or not Path(dirs[0][1], "memory.limit_in_bytes").exists():
        pytest.skip("no v1 memory cgroup here (cgroup v2 only, or no memory controller)")
    return Path(dirs[0][1])


class Cgroup:
    """A fresh v1 memory cgroup; ``remove()`` waits for its processes to be gone."""

    def __init__(self, parent: Path, name: str, limit: int | None):
        self.path = parent / name
        self.path.mkdir()
        if limit is not None:
            (self.path / "memory.limit_in_bytes").write_text(f"{limit}\n")

    def read(self, knob: str) -> str:
        return (self.path / knob).read_text()

    def remove(self) -> None:
        deadline = time.monotonic() + 10
        while self.path.exists():
            try:
                self.path.rmdir()
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)


# The child moves itself into the cgroup before it imports anything big, makes the loader,
# and runs its epochs; it reports ids per epoch, stats, warnings and its peak RSS.
CHILD = r"""
import json, logging, os, sys, warnings
open(os.path.join(sys.argv[1], "cgroup.procs"), "w").write(str(os.getpid()))
import numpy as np
import coordl

root, cache, epochs = sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4])
said = []
class Keep(logging.Handler):
    def emit(self, record):
        said.append(record.getMessage())
logging.getLogger("coordl").addHandler(Keep(logging.WARNING))
out = {"epochs": []}
with warnings.catch_warnings(record=True) as rec:
    warnings.simplefilter("always")
    with coordl.CoordLoader(root, batch_size=16, pipeline=coordl.ImageNetTrain(size=64), cache=cache, shuffle=True,
                            device_id=None, prep=2, fetch=coordl.Fetch(threads=2), return_index=True) as loader:
        n = len(loader.index)
        out["budget"] = loader.node_cache.budget if loader.node_cache is not None else 0
        for epoch in range(epochs):
            loader.set_epoch(epoch)
            ids = np.concatenate([batch[2].numpy() for batch in loader])
            s = loader.stats()
            out["epochs"].append({"exactly_once": bool(len(ids) == n and np.array_equal(np.sort(ids), np.arange(n))),
                                  "cache_items": s["cache_items"], "cache_bytes": s["cache_bytes"],
                                  "storage_reads": s["storage_reads"], "cache_hits": s["cache_hits"]})
said += [str(w.message) for w in rec if issubclass(w.category, RuntimeWarning)]
out["messages"] = said
status = open("/proc/self/status").read()
out["peak_rss"] = int(next(l.split()[1] for l in status.splitlines() if l.startswith("VmHWM:"))) * 1024
print("RESULT" + json.dumps(out))
"""


@pytest.fixture(scope="module")
def big_dataset(tmp_path_factory) -> Path:
    """About 510 MB of real JPEGs: 64 ImageNet-like images (cropped from photographs where
    ../shared/photos exists) in 8 classes, each written 70 times under new names. Large beside
    the loader's own memory, so that a cache of all of it would not fit under the test's limit."""
    from coordl.tools.datagen import make_dataset

    seed = tmp_path_factory.mktemp("seed") / "train"
    make_dataset(seed, num_images=64, num_classes=8, photos_dir=PHOTOS if PHOTOS.is_dir() else None, progress=False)
    root = tmp_path_factory.mktemp("big") / "train"
    for src in sorted(seed.rglob("*.JPEG")):
        (root / src.parent.name).mkdir(parents=True, exist_ok=True)
        for k in range(70):
            shutil.copyfile(src, root / src.parent.name / f"{src.stem}_{k:02d}.JPEG")
    return root


def run_in_cgroup(parent: Path, name: str, limit: int | None, root: Path, cache, epochs: int) -> dict:
    cg = Cgroup(parent, f"coordl-test-{os.getpid()}-{name}", limit)
    try:
        cmd = [sys.executable, "-c", CHILD, str(cg.path), str(root), json.dumps(cache), str(epochs)]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
        oom = dict(line.split() for line in cg.read("memory.oom_control").splitlines())
        out = json.loads(r.stdout.split("RESULT", 1)[1]) if "RESULT" in r.stdout else {}
        out.update(
            returncode=r.returncode,
            stderr=r.stderr[-3000:],
            limit=limit,
            oom_kill=int(oom.get("oom_kill", 0)),
            failcnt=int(cg.read("memory.failcnt")),
            max_usage=int(cg.read("memory.max_usage_in_bytes")),
        )
        return out
    finally:
        cg.remove()


def test_loader_in_a_memory_cgroup_caches_what_fits_and_is_never_killed(big_dataset, isolated):
    parent = memory_cgroup_root()
    index = Index.scan(big_dataset)
    n, total = len(index), index.total_bytes
    own = run_in_cgroup(parent, "own", None, big_dataset, 0, 1)
    assert own["returncode"] == 0, own["stderr"]
    # The scenario: the loader's own memory x1.2 + 64 MiB, and room for 30% of the dataset. Its own
    # memory is what the cgroup was charged for it, which the limit counts: not its RSS, which also counts
    # library pages charged to whoever read them first, and swings with the machine (384-507 MB for a
    # charge of 228-236 MB, on two runs of this test; at 507 the limit had room for the whole dataset).
    limit = int(own["max_usage"] * 1.2) + 64 * MiB + int(0.3 * total)
    # A cache of the whole dataset would take the child past the limit.
    assert own["max_usage"] + total > limit, f"the limit leaves room for the whole dataset: {own}"
    for cache in ("auto", 1.0):
        r = run_in_cgroup(parent, str(cache), limit, big_dataset, cache, 2)
        facts = {k: v for k, v in r.items() if k != "stderr"}
        assert r["returncode"] == 0, f"cache={cache}: exit {r['returncode']} (-9: killed) {facts}\n{r['stderr']}"
        assert r["oom_kill"] == 0 and r["max_usage"] <= limit, facts
        assert any("memory limit" in m for m in r["messages"]), facts  # the warning names the limit
        assert r["budget"] < total, facts  # planned within the room: never the whole dataset
        assert [e["exactly_once"] for e in r["epochs"]] == [True, True], facts
        second = r["epochs"][1]
        assert 0 < second["cache_items"] < n and second["cache_bytes"] <= r["budget"], facts
        assert second["cache_hits"] == second["cache_items"] and second["storage_reads"] == n - second["cache_items"]
    assert os.listdir(isolated) == []


def test_cache_ls_shows_the_memory_limit_of_its_cgroup(isolated):
    parent = memory_cgroup_root()
    cg = Cgroup(parent, f"coordl-test-{os.getpid()}-ls", 3 * GiB)
    try:
        code = (
            "import os, sys; open(os.path.join(sys.argv[1], 'cgroup.procs'), 'w').write(str(os.getpid()));"
            "from coordl.cli import main; sys.exit(main(['cache', 'ls']))"
        )
        r = subprocess.run([sys.executable, "-c", code, str(cg.path)], capture_output=True, text=True, check=False)
    finally:
        cg.remove()
    assert r.returncode == 0, r.stderr
    line = r.stdout.splitlines()[-1]
    assert line.startswith("memory limit: 3.2 GB (cgroup ") and f"{cg.path.name} (v1))" in line, line
    assert "MB in use; a cache may take" in line and "(322.1 MB kept free)" in line, line
