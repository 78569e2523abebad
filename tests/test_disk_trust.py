"""The local-storage tier (``Cache(disk=...)``) on a shared machine and on a disk it shares: a folder
another local user made first (or took over) is never read, written or followed, and the run goes on
from the store with the tensors of a run without the tier; damaged entries are rewritten in the epoch
that finds them; the ledger counts what the tier takes on disk, keeps the floor a checkpoint needs,
follows ``Disk(size)``, and releases what killed writers reserved.

The second user is a child run with ``setpriv`` as uid 23456 (no passwd entry needed), working in a
world-writable sticky folder like ``/tmp``; the trainer is this test's user. The store is the S3
server on localhost, which counts every GET."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("moto")

import coordl
from coordl import CoordLoader, ImageNetTrain
from coordl.fetch import disk
from coordl.fetch.disk import entries
from coordl.index import Index

HERE = Path(__file__).resolve().parent
N = 120  # samples in tiny_dataset
BUCKET = "coordl-trust"
OTHER = 23456  # the other local user
_baseline: dict = {}


@pytest.fixture(scope="module")
def server(s3_server):
    s3_server.create_bucket(BUCKET)
    return s3_server


@pytest.fixture
def root(server, s3_tree, tiny_dataset) -> str:
    """A fresh prefix holding the tiny dataset, and this process talking to the server."""
    return s3_tree(BUCKET, tiny_dataset)


@pytest.fixture
def scratch():
    """A folder every local user can write in, sticky like /tmp (inside one only root may change)."""
    base = Path(tempfile.mkdtemp(prefix="coordl-shared-", dir="/tmp"))
    base.chmod(0o755)
    shared = base / "scratch"
    shared.mkdir()
    shared.chmod(0o1777)
    yield shared
    shutil.rmtree(base)


def as_other(command: str) -> None:
    """Runs a shell command as the other local user."""
    subprocess.run(
        ["setpriv", f"--reuid={OTHER}", f"--regid={OTHER}", "--clear-groups", "sh", "-c", command], check=True
    )


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE.parent / "src"), os.environ.get("PYTHONPATH", "")]))


TRAIN = """
import hashlib, json, sys, warnings
import coordl
data, where = sys.argv[1], sys.argv[2]
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    with coordl.CoordLoader(data, batch_size=16, pipeline=coordl.ImageNetTrain(size=16), device_id=None,
                            return_index=True, seed=3, prep=1, shuffle=True,
                            cache=coordl.Cache(size=0, disk=None if where == "-" else where)) as loader:
        digests = {}
        for x, _, i in loader:
            for image, sample in zip(x, i.tolist()):
                digests[sample] = hashlib.sha256(image.numpy().tobytes()).hexdigest()
        s = loader.stats()
        tier = loader.disk_tier is not None
print(json.dumps({"digests": digests, "disk_reads": s["disk_reads"], "storage_reads": s["storage_reads"],
                  "tier": tier, "warnings": [str(w.message) for w in caught]}))
"""


def _train(data: str, where: str, timeout: float = 120) -> dict:
    """One epoch in a child process (a hang fails the test at ``timeout``): each sample's tensor digest,
    the tier's and the store's reads, whether the tier was used, the warnings."""
    p = subprocess.run([sys.executable, "-c", TRAIN, data, where], env=_env(), capture_output=True, text=True,
                       timeout=timeout)  # fmt: skip
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def _uncached(data: str) -> dict:
    """The digests of a run without the tier (the same for every prefix: the pixels depend on the
    seed, the epoch and the sample's bytes)."""
    if "digests" not in _baseline:
        _baseline["digests"] = _train(data, "-")["digests"]
    return _baseline["digests"]


def _foreign_warnings(out: dict) -> list[str]:
    return [w for w in out["warnings"] if "is not this user's" in w]


TIER = f"coordl-disk-{os.getuid()}"


@pytest.mark.parametrize("plant", ["folder", "ledger-link", "both-links"])
def test_a_folder_another_user_made_first_is_never_read_written_or_followed(root, scratch, tmp_path, plant):
    """The other user makes ``<path>/coordl-disk-<uid>`` first (mode 0777): empty; with ``ledger`` a
    link to a file of the trainer's (the trainer overwrote its first bytes); with ``ledger`` and
    ``users`` both links to one file (the trainer hung in its constructor, an flock on one file
    twice). The run finishes from the store with an uncached run's tensors, with one warning naming
    the files and their owner; the file the links point at is unchanged."""
    mine = tmp_path / "checkpoint.pt"  # the trainer's own file, which the other user cannot even read
    mine.write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    before = mine.read_bytes()
    planted = scratch / TIER
    links = {"folder": [], "ledger-link": ["ledger"], "both-links": ["ledger", "users"]}[plant]
    as_other(f"mkdir -m 0777 {planted}" + "".join(f" && ln -s {mine} {planted}/{name}" for name in links))
    out = _train(root, str(scratch))
    assert out["tier"] is False and out["disk_reads"] == 0 and out["storage_reads"] == N
    assert out["digests"] == _uncached(root)
    [warning] = _foreign_warnings(out)
    assert f"{planted} (a folder of uid {OTHER}, mode 0777)" in warning and "rm -rf" in warning
    for name in links:
        assert f"{planted}/{name} (a symbolic link of uid {OTHER}, mode 0777, to {mine})" in warning
    assert mine.read_bytes() == before  # never written through the link
    assert sorted(os.listdir(planted)) == sorted(links)  # nothing made inside
    assert planted.stat().st_uid == OTHER and stat.S_IMODE(planted.stat().st_mode) == 0o777


@pytest.mark.parametrize("change", ["chown", "chmod"])
def test_a_tier_another_user_took_over_or_opened_up_is_not_read(root, scratch, change):
    """A tier the trainer filled, then owned by another user (``chown -R``) or opened to group and
    others (``chmod 0755``): the next run reads nothing from it (its entries could be anyone's), goes
    on from the store with an uncached run's tensors, and says so once; ``coordl cache clean --disk``
    and ``verify --disk`` leave it as it is."""
    first = _train(root, str(scratch))
    assert first["tier"] is True and first["storage_reads"] == N and not _foreign_warnings(first)
    tier = scratch / TIER
    held = sorted(p.relative_to(tier) for p in tier.rglob("*"))
    command = ["chown", "-R", f"{OTHER}:{OTHER}", str(tier)] if change == "chown" else ["chmod", "0755", str(tier)]
    subprocess.run(command, check=True)
    out = _train(root, str(scratch))
    assert out["tier"] is False and out["disk_reads"] == 0 and out["storage_reads"] == N
    assert out["digests"] == first["digests"] == _uncached(root)
    [warning] = _foreign_warnings(out)
    mode = "0700" if change == "chown" else "0755"
    owner = OTHER if change == "chown" else os.getuid()
    assert f"{tier} (a folder of uid {owner}" in warning and f"mode {mode})" in warning
    for command in ("clean", "verify"):
        p = subprocess.run([sys.executable, "-m", "coordl.cli", "cache", command, "--disk", str(scratch)],
                           env=_env(), capture_output=True, text=True)  # fmt: skip
        assert p.returncode == 1 and p.stderr.startswith(f"coordl cache {command}: error: the local tier at {tier} ")
        assert "is not this user's" in p.stderr and p.stdout == "", (command, p.stdout, p.stderr)
    assert sorted(p.relative_to(tier) for p in tier.rglob("*")) == held


def _loader(data, where, *, memory=0, **disk_args):
    return CoordLoader(
        data,
        batch_size=16,
        pipeline=ImageNetTrain(size=16),
        device_id=None,
        return_index=True,
        seed=3,
        cache=coordl.Cache(size=memory, disk=coordl.Disk(where, **disk_args)),
        prep=1,
        shuffle=True,
    )


def _epoch(loader) -> list[int]:
    return [i for _, _, ids in loader for i in ids.tolist()]


def _on_disk(where) -> int:
    """What the tier's entry folders under ``where`` take on disk: ``du -B1`` of its ``ab/`` folders."""
    tops = sorted(str(p) for p in Path(disk.tier_folder(where)).glob("??"))
    out = subprocess.run(["du", "-s", "-B1", "-c", *tops], capture_output=True, check=True) if tops else None
    return int(out.stdout.split()[-2]) if tops else 0


def _entry(where, path: str) -> Path:
    return Path(disk.tier_folder(where)) / entries.entry_name(path)


def test_damaged_entries_are_rewritten_in_the_epoch_that_finds_them(root, server, tmp_path, caplog):
    """A bit flipped in an entry's bytes, an entry cut inside its header and one cut in its payload: the
    epoch that finds them reads the three from the store (exactly those GETs), rewrites them with the
    store's bytes and counts 3 repairs, without a warning; the next epoch reads every sample from the
    tier (0 GETs); the ledger counts what the folder takes, as du does."""
    with _loader(root, tmp_path) as loader:
        _epoch(loader)
    index = Index.scan(root)
    flipped, cut_head, cut_body = (index.paths[k] for k in (7, 42, 99))
    p = _entry(tmp_path, flipped)
    raw = bytearray(p.read_bytes())
    raw[disk.HEADER.itemsize + 100] ^= 0x10
    p.write_bytes(bytes(raw))
    p = _entry(tmp_path, cut_head)
    p.write_bytes(p.read_bytes()[:40])
    p = _entry(tmp_path, cut_body)
    p.write_bytes(p.read_bytes()[: disk.HEADER.itemsize + 500])
    server.reset()
    with caplog.at_level("WARNING", logger="coordl"), _loader(root, tmp_path) as loader:
        assert sorted(_epoch(loader)) == list(range(N))
        s = loader.stats()
        gets = sorted(path for _, path, status, _ in server.requests("GET") if status == 200 and "?" not in path)
        assert gets == sorted(f"/{BUCKET}/{p.split(f's3://{BUCKET}/', 1)[1]}" for p in (flipped, cut_head, cut_body))
        assert s["storage_reads"] == 3 and s["disk_reads"] == N - 3
        assert s["disk_repaired"] == 3 and s["disk_replaced"] == 0 and s["disk_admitted"] == 3
        server.reset()
        loader.set_epoch(1)
        assert sorted(_epoch(loader)) == list(range(N))
        s = loader.stats()
        assert server.count("GET") == 0 and s["storage_reads"] == 0 and s["disk_reads"] == N
        assert s["disk_repaired"] == 0
    assert not [r for r in caplog.records if r.levelname == "WARNING"], caplog.text
    client = server.client()
    for path in (flipped, cut_head, cut_body):
        body = client.get_object(Bucket=BUCKET, Key=path.split(f"s3://{BUCKET}/", 1)[1])["Body"].read()
        assert _entry(tmp_path, path).read_bytes()[disk.HEADER.itemsize :] == body  # the store's bytes
    assert disk.describe(tmp_path).used == _on_disk(tmp_path)


def test_a_replaced_entry_is_counted_and_its_blocks_leave_the_ledger(root, server, tmp_path):
    """An object replaced in the store by a larger one (two blocks on disk instead of one): the next run
    reads it once from the store, counts one replacement, and the ledger takes the old entry's blocks
    out and the new one's in: it counts what the folder takes, as du does."""
    with _loader(root, tmp_path) as loader:
        _epoch(loader)
    before = disk.describe(tmp_path).used
    assert before == _on_disk(tmp_path)
    index = Index.scan(root)
    key = index.paths[40].split(f"s3://{BUCKET}/", 1)[1]
    body = server.client().get_object(Bucket=BUCKET, Key=key)["Body"].read()
    server.put(BUCKET, key, body + b"\0" * 5000)  # a JPEG with trailing bytes: another ETag, another size
    block = os.statvfs(tmp_path).f_frsize
    old_blocks = _entry(tmp_path, index.paths[40]).stat().st_blocks * 512
    relisted = Index.scan(root, rebuild=True)
    server.reset()
    with _loader(relisted, tmp_path) as loader:
        _epoch(loader)
        s = loader.stats()
    assert s["storage_reads"] == 1 and s["disk_replaced"] == 1 and s["disk_repaired"] == 0
    new_blocks = _entry(tmp_path, index.paths[40]).stat().st_blocks * 512
    assert new_blocks > old_blocks and new_blocks == -(-(len(body) + 5000 + disk.HEADER.itemsize) // block) * block
    assert disk.describe(tmp_path).used == _on_disk(tmp_path) == before - old_blocks + new_blocks
    server.reset()
    with _loader(relisted, tmp_path) as loader:
        _epoch(loader)
        assert loader.stats()["disk_replaced"] == 0
    assert server.count("GET") == 0


def test_a_smaller_disk_size_lowers_the_budget_of_a_tier_in_use(root, tmp_path):
    """A loader with ``Disk(size="10MB")`` makes the tier; a second one with a smaller size lowers the
    budget of the tier the first still uses (it was ignored); a larger one leaves it; a loader alone
    with the tier sets it, to ``"auto"`` too."""
    with _loader(root, tmp_path, size="10MB") as first:
        assert disk.describe(tmp_path).budget == 10_000_000
        with _loader(root, tmp_path, size=100_000) as smaller:
            assert disk.describe(tmp_path).budget == 100_000
            assert smaller.stats()["disk_cache_budget"] <= 100_000 and first.stats()["disk_cache_budget"] <= 100_000
        with _loader(root, tmp_path, size="1GB"):
            assert disk.describe(tmp_path).budget == 100_000  # shared: only lowered
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _epoch(first)
        [full] = [str(w.message) for w in caught if "stops filling" in str(w.message)]
        assert "it holds its budget of 100000 bytes" in full
        assert disk.describe(tmp_path).used <= 100_000
    with _loader(root, tmp_path):
        assert disk.describe(tmp_path).budget == 0  # alone: "auto", bounded by the floor only


def test_a_tier_in_a_folder_that_does_not_exist_is_an_error(root, tmp_path):
    """A mistyped or unmounted ``Disk(path)`` is refused, and nothing is made there."""
    missing = tmp_path / "nvme0" / "scratch"
    inside = "the local tier is made inside an existing folder this user can write in"
    with pytest.raises(ValueError, match=f"does not exist on .*: {inside}"):
        _loader(root, missing)
    assert not (tmp_path / "nvme0").exists()
    (tmp_path / "a-file").write_bytes(b"x")
    with pytest.raises(ValueError, match="is not a folder on"):
        _loader(root, tmp_path / "a-file")


HOLD = """
import sys, time
from coordl.fetch.disk import folder, ledger
opened = folder.open_folder(folder.tier_folder(sys.argv[1]), create=True)
book = ledger.Ledger(opened.ledger)
slot, _ = book.claim()
print(book.reserve(int(sys.argv[2]), 0), flush=True)
time.sleep(600)  # killed here, holding its reservation
"""


def test_a_killed_writer_s_reservation_is_released(tmp_path):
    """A writer killed between reserving and publishing (here: a process that reserves, then is killed)
    leaves its reservation in the ledger; the next reservation that it would stop releases it, since
    no process holds its slot's lock any more."""
    tier = disk.DiskTier(disk.tier_folder(tmp_path), 200_000, keep_free=0)
    try:
        small = np.arange(1000, dtype=np.uint8)  # this process takes its slot first
        tier.put(["s3://b/small.jpg"], [disk.stamp("s3://b/small.jpg", 1000, "e")], [small])
        assert tier.flush(10) and tier.written == 1
        child = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path), "150000"], env=_env(),
                                 stdout=subprocess.PIPE, text=True)  # fmt: skip
        try:
            assert child.stdout.readline().strip() == "(None, [])"
        finally:
            child.kill()
            child.wait()
            child.stdout.close()
        assert disk.describe(tmp_path).reserved == 150_000
        data = np.arange(100_000, dtype=np.uint8)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            tier.put(["s3://b/x.jpg"], [disk.stamp("s3://b/x.jpg", 100_000, "e")], [data])
            assert tier.flush(10)
        assert not [w for w in caught if "stops filling" in str(w.message)]
        assert tier.written == 2 and disk.describe(tmp_path).reserved == 0
        assert disk.describe(tmp_path).used == _on_disk(tmp_path)
    finally:
        tier.close()


CHECKPOINT = """
import os, sys, time
path, total, chunk = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
while not os.path.exists(path + ".go"):
    time.sleep(0.01)
with open(path, "wb") as f:
    for _ in range(total // chunk):
        f.write(os.urandom(chunk))
        f.flush()
        os.fsync(f.fileno())
        time.sleep(0.01)
print(os.path.getsize(path), flush=True)
"""

WRITER = """
import os, sys, time
import coordl
data, where, keep, go = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
loader = coordl.CoordLoader(data, batch_size=8, pipeline=coordl.ImageNetTrain(size=16), device_id=None, seed=3,
                            cache=coordl.Cache(size=0, disk=coordl.Disk(where, keep_free=keep)), prep=1, shuffle=True)
for epoch in range(2):
    loader.set_epoch(epoch)
    for k, _ in enumerate(loader):
        print("epoch", epoch, "batch", k, flush=True)
        if epoch == 1 and k == 5:
            time.sleep(600)  # killed here, mid-epoch
    while not os.path.exists(go):  # epoch 1 once the checkpoint is written
        time.sleep(0.01)
"""


def test_the_tier_leaves_its_floor_to_a_checkpoint_and_verify_makes_the_ledger_du_s(root, tmp_path):
    """A tier on a small tmpfs (768 KiB) beside a "checkpoint" of 512 KiB written in chunks while a loader
    fills the tier, with ``Disk(keep_free=512 KiB)``: the checkpoint is written whole (without the floor
    the tier took the room: ENOSPC); the tier stops at its floor with one warning. The loader is killed
    (``kill -9``) mid-epoch; ``coordl cache verify --disk`` then makes the ledger exactly what ``du -B1``
    counts of the entry folders, and a second verify finds the tier clean."""
    mount = tmp_path / "small"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=768k", "tmpfs", str(mount)], check=True)
    checkpoint, keep = mount / "checkpoint.pt", 512 * 1024
    try:
        saver = subprocess.Popen([sys.executable, "-c", CHECKPOINT, str(checkpoint), str(keep), str(16 * 1024)],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
        go = tmp_path / "epoch-1.go"
        writer = subprocess.Popen([sys.executable, "-c", WRITER, root, str(mount), str(keep), str(go)], env=_env(),
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
        try:
            for line in writer.stdout:
                if line.startswith("epoch 0 batch 2"):
                    (mount / "checkpoint.pt.go").touch()  # the checkpoint starts as the tier fills
                    saved, err = saver.communicate(timeout=60)
                    assert saver.returncode == 0, err  # no ENOSPC
                    assert int(saved) == keep == checkpoint.stat().st_size
                    go.touch()
                if line.startswith("epoch 1 batch 5"):
                    break
            assert go.exists(), "the writer ended before its second epoch"
        finally:
            for p in (writer, saver):
                p.kill()
                p.wait()
            err = writer.stderr.read()
            writer.stdout.close()
            writer.stderr.close()
        stops = [line for line in err.splitlines() if "stops filling" in line]
        assert len(stops) == 1 and f"less than the {keep} bytes free that it keeps" in stops[0], err[-3000:]
        held = disk.describe(mount)
        folder_takes = _on_disk(mount)
        count = sum(1 for p in Path(disk.tier_folder(mount)).rglob("*") if p.is_file() and len(p.name) == 32)
        assert 0 < count < N and abs(held.used - folder_takes) <= 4096 * count
        verify = subprocess.run([sys.executable, "-m", "coordl.cli", "cache", "verify", "--disk", str(mount)],
                                env=_env(), capture_output=True, text=True)  # fmt: skip
        assert verify.returncode in (0, 1) and f"{count} entries whole" in verify.stdout, verify.stdout + verify.stderr
        assert disk.describe(mount).used == _on_disk(mount) and disk.describe(mount).reserved == 0
        again = subprocess.run([sys.executable, "-m", "coordl.cli", "cache", "verify", "--disk", str(mount)],
                               env=_env(), capture_output=True, text=True)  # fmt: skip
        assert again.returncode == 0 and "the tier was clean" in again.stdout, again.stdout
    finally:
        subprocess.run(["umount", str(mount)], check=True)
