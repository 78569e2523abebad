"""The local-storage tier (``Cache(disk=...)``) under the node's memory cache, against a real
S3-compatible server on localhost that counts every GET (``coordl_testing.s3server``): the store
is read once per node, ever; the tier survives its processes, shares its entries, never holds a torn
sample, and stops filling when its disk is full."""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import textwrap
import warnings
from collections import Counter
from pathlib import Path

import pytest
import torch

pytest.importorskip("moto")

import coordl
from childproc import report, result
from coordl import CoordLoader, ImageNetTrain
from coordl.fetch import disk
from coordl.fetch.disk import entries
from coordl.index import Index

HERE = Path(__file__).resolve().parent
N = 120  # samples in tiny_dataset
BUCKET = "coordl-disk"
RECIPE = ImageNetTrain(size=16)
CTX = multiprocessing.get_context("spawn")


@pytest.fixture(scope="module")
def server(s3_server):
    s3_server.create_bucket(BUCKET)
    return s3_server


@pytest.fixture
def root(server, s3_tree, tiny_dataset) -> str:
    """A fresh prefix holding the tiny dataset, and this process talking to the server."""
    return s3_tree(BUCKET, tiny_dataset)


def _loader(data, folder, *, memory=0.25, **kw):
    tier = kw.pop("disk", None) or coordl.Disk(folder)
    return CoordLoader(
        data,
        batch_size=16,
        pipeline=RECIPE,
        device_id=None,
        return_index=True,
        seed=3,
        cache=coordl.Cache(size=memory, disk=tier),
        prep=1,
        shuffle=True,
        **kw,
    )


def _epoch(loader, images: dict | None = None, epoch: int = 0) -> list[int]:
    ids = []
    for x, _, i in loader:
        ids += i.tolist()
        if images is not None:
            for image, sample in zip(x, i.tolist()):
                images[(epoch, sample)] = image.clone()
    return ids


def test_the_store_is_read_once_and_later_epochs_read_the_rest_from_the_tier(root, server, tmp_path):
    with _loader(root, tmp_path) as loader:
        for epoch in range(3):
            server.reset()
            loader.set_epoch(epoch)
            seen = Counter(_epoch(loader))
            assert sorted(seen) == list(range(N)) and set(seen.values()) == {1}, f"epoch {epoch}"
            s = loader.stats()
            gets = server.count("GET")
            assert gets == s["storage_reads"]
            if epoch == 0:
                assert gets == N and s["disk_admitted"] == N
            else:
                # The memory cache holds a quarter; the tier serves exactly the rest; the store, nothing.
                assert gets == 0 and 0 < s["cache_items"] < N
                assert s["disk_reads"] == N - s["cache_hits"] == N - s["cache_items"]
                assert s["disk_bytes"] == loader.index.total_bytes - s["cache_bytes"]
        # Every sample once, the memory's too: its entry's blocks and the entry folders, as du counts them.
        assert _entries(tmp_path) == N and s["disk_cache_bytes"] == _on_disk(tmp_path)


def _entries(path) -> int:
    """The entries of the tier under ``path``."""
    return sum(1 for p in Path(disk.tier_folder(path)).rglob("*") if p.is_file() and len(p.name) == 32)


def _on_disk(path) -> int:
    """What the tier's entry folders under ``path`` take on disk (``du -B1`` of its ``ab/`` folders)."""
    tops = sorted(str(p) for p in Path(disk.tier_folder(path)).glob("??"))
    out = subprocess.run(["du", "-s", "-B1", "-c", *tops], capture_output=True, check=True) if tops else None
    return int(out.stdout.split()[-2]) if tops else 0


SECOND_JOB = """
import json, sys
import coordl
data, folder = sys.argv[1], sys.argv[2]
with coordl.CoordLoader(data, batch_size=16, pipeline=coordl.ImageNetTrain(size=16), device_id=None, seed=3,
                        cache=coordl.Cache(size=0.25, disk=folder), prep=1, shuffle=True) as loader:
    n = sum(len(y) for _, y in loader)
    s = loader.stats()
print(json.dumps({"samples": n, "storage_reads": s["storage_reads"], "disk_reads": s["disk_reads"]}))
"""


def _job(script: str, *args: str) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE.parent / "src"), os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_a_second_job_started_afterwards_gets_nothing_in_its_first_epoch(root, server, tmp_path):
    with _loader(root, tmp_path) as loader:
        assert len(_epoch(loader)) == N
    server.reset()
    out = _job(SECOND_JOB, root, str(tmp_path))
    assert out == {"samples": N, "storage_reads": 0, "disk_reads": N}  # a fresh memory cache: all from the tier
    assert server.count("GET") == 0


def test_a_tier_too_small_gets_exactly_the_samples_neither_tier_holds(root, server, tmp_path):
    # A quarter in memory, 40% of the samples on disk: some samples in neither. The budget counts what
    # entries take on disk: a block each here (small photos), and two new entry folders of a block each.
    budget = int(N * 0.4) * 3 * os.statvfs(tmp_path).f_frsize
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with _loader(root, tmp_path, disk=coordl.Disk(tmp_path, size=budget)) as loader:
            per_epoch = []
            for epoch in range(3):
                server.reset()
                loader.set_epoch(epoch)
                assert sorted(_epoch(loader)) == list(range(N))
                s = loader.stats()
                gets = server.count("GET")
                assert gets == s["storage_reads"] == N - s["cache_hits"] - s["disk_reads"]
                per_epoch.append((gets, s["disk_reads"]))
            assert s["disk_cache_bytes"] <= budget
    full = [w for w in caught if "stops filling" in str(w.message)]
    assert len(full) == 1 and f"holds its budget of {budget} bytes" in str(full[0].message)
    assert per_epoch[1] == per_epoch[2] and per_epoch[1][0] > 0 and per_epoch[1][1] > 0  # the same, every epoch


KILLED = """
import sys
import coordl
data, folder = sys.argv[1], sys.argv[2]
loader = coordl.CoordLoader(data, batch_size=16, pipeline=coordl.ImageNetTrain(size=16), device_id=None, seed=3,
                            cache=coordl.Cache(size=0, disk=folder), prep=1, shuffle=True)
for k, _ in enumerate(loader):
    print("batch", k, flush=True)
    if k == 3:
        sys.stdin.read()  # killed here, its writer thread writing
"""


def test_a_writer_killed_mid_epoch_leaves_no_sample_a_reader_could_take_torn(root, server, tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE.parent / "src"), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLED, root, str(tmp_path)], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        for line in proc.stdout:
            if line.startswith("batch 3"):
                break
    finally:
        proc.kill()
        proc.wait()
    folder = disk.tier_folder(tmp_path)
    # What a crash can leave besides: a file being written, and an entry damaged after it was published.
    (Path(folder) / "tmp" / "999999-1-1").write_bytes(b"half a sample")
    entries = sorted(p for p in Path(folder).rglob("*") if p.is_file() and len(p.name) == 32)
    assert entries, "the killed job published some samples"
    damaged = entries[0]
    damaged.write_bytes(damaged.read_bytes()[:-10] + b"\0" * 10)
    want, got = {}, {}
    with CoordLoader(
        root, batch_size=16, pipeline=RECIPE, device_id=None, return_index=True, seed=3, cache=0, prep=1, shuffle=True
    ) as plain:
        _epoch(plain, want)
    server.reset()
    with _loader(root, tmp_path, memory=0) as loader:
        _epoch(loader, got)
        s = loader.stats()
    assert want.keys() == got.keys()
    assert all(torch.equal(want[k], got[k]) for k in want), "a tensor differs from an uncached loader's"
    assert s["disk_reads"] == len(entries) - 1 and s["storage_reads"] == N - len(entries) + 1  # the damaged one
    assert os.listdir(Path(folder) / "tmp") == []  # the dead writers' files removed by the next process


def test_a_changed_object_is_fetched_again_and_its_entry_replaced(root, server, tmp_path):
    with _loader(root, tmp_path, memory=0) as loader:
        _epoch(loader)
    index = Index.scan(root)
    victim = index.paths[40]
    key = victim.split(f"s3://{BUCKET}/", 1)[1]
    body = server.client().get_object(Bucket=BUCKET, Key=key)["Body"].read()
    server.put(BUCKET, key, body[:-2] + bytes(reversed(body[-2:])))  # same size, another ETag
    relisted = Index.scan(root, rebuild=True)
    assert relisted.etags[40] != index.etags[40]
    server.reset()
    with _loader(relisted, tmp_path, memory=0) as loader:
        _epoch(loader)
        s = loader.stats()
    assert [p for _, p, status, _ in server.requests("GET") if status == 200] == [f"/{BUCKET}/{key}"]
    assert s["storage_reads"] == 1 and s["disk_reads"] == N - 1
    server.reset()
    with _loader(relisted, tmp_path, memory=0) as loader:
        _epoch(loader)
    assert server.count("GET") == 0  # the new version is the entry now


def test_a_full_disk_stops_the_filling_with_one_warning_and_the_run_goes_on(root, server, tmp_path):
    # The tier keeps a floor of free blocks (Disk(keep_free), tested with a checkpoint in test_disk_trust.py),
    # so the file system runs out of inodes here, with blocks to spare: ENOSPC all the same.
    mount = tmp_path / "small"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,nr_inodes=40", "tmpfs", str(mount)], check=True)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with _loader(root, mount, memory=0, disk=coordl.Disk(mount, size="1GB", keep_free=0)) as loader:
                for epoch in range(2):
                    loader.set_epoch(epoch)
                    assert sorted(_epoch(loader)) == list(range(N))
                s = loader.stats()
        full = [w for w in caught if "stops filling" in str(w.message)]
        assert len(full) == 1 and "the disk is full" in str(full[0].message)
        assert 0 < s["disk_reads"] < N and s["storage_reads"] == N - s["disk_reads"]
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def _fill(data, folder, start, q):
    def body():
        with CoordLoader(data, batch_size=16, pipeline=RECIPE, device_id=None, seed=5, prep=1, shuffle=True,
                         cache=coordl.Cache(size=0, disk=folder)) as loader:  # fmt: skip
            start.wait(30)
            return sum(len(y) for _, y in loader)

    report(q, body)


def test_two_processes_filling_one_tier_at_once_store_each_sample_once(root, server, tmp_path, procs):
    start, q = CTX.Barrier(2), CTX.Queue()
    for _ in range(2):
        procs(_fill, root, str(tmp_path), start, q)
    assert [result(q, 120) for _ in range(2)] == [N, N]
    folder = Path(disk.tier_folder(tmp_path))
    entries = [p for p in folder.rglob("*") if p.is_file() and len(p.name) == 32]
    index = Index.scan(root)
    assert len(entries) == N and sum(p.stat().st_size for p in entries) == index.total_bytes + N * disk.HEADER.itemsize
    assert disk.describe(tmp_path).used == _on_disk(tmp_path)  # the ledger counts each sample once, as du does
    assert os.listdir(folder / "tmp") == []


def test_a_local_dataset_on_another_device_is_served_by_the_tier_and_cleaned_by_the_command(tiny_dataset, tmp_path):
    # tiny_dataset lies on tmp's file system; a copy in /dev/shm (tmpfs) is "another device" here.
    remote = Path(os.environ["COORDL_SHM_DIR"]) / "other-device"
    subprocess.run(["cp", "-r", str(tiny_dataset), str(remote)], check=True)
    with _loader(str(remote), tmp_path, memory=0) as loader:
        _epoch(loader)
        first = loader.stats()
    with _loader(str(remote), tmp_path, memory=0) as loader:
        _epoch(loader)
        again = loader.stats()
        busy = subprocess.run(
            [sys.executable, "-m", "coordl.cli", "cache", "clean", "--disk", str(tmp_path)],
            capture_output=True,
            text=True,
        )
        assert busy.returncode == 1 and "a running process uses it" in busy.stdout
    subprocess.run(["rm", "-rf", str(remote)], check=True)
    assert first["storage_reads"] == N and again["storage_reads"] == 0 and again["disk_reads"] == N
    done = subprocess.run(
        [sys.executable, "-m", "coordl.cli", "cache", "clean", "--disk", str(tmp_path)], capture_output=True, text=True
    )
    assert done.returncode == 0 and "removed the local-storage tier" in done.stdout
    assert not Path(disk.tier_folder(tmp_path)).exists()


def test_a_tier_on_the_dataset_s_own_file_system_is_not_used(tiny_dataset, tmp_path):
    with pytest.warns(RuntimeWarning, match="is on the file system of the dataset's files"):
        loader = _loader(str(tiny_dataset), tiny_dataset.parent, memory=0)
    with loader:
        assert loader.disk_tier is None and len(_epoch(loader)) == N


def test_the_torch_backend_s_workers_fill_and_read_the_tier(root, server, tmp_path):
    script = textwrap.dedent(
        """
        import json, sys
        import numpy as np
        import coordl
        from coordl.datasets import ImageFolder
        ds = ImageFolder(sys.argv[1], transform=lambda im: np.asarray(im.resize((8, 8))))
        out = []
        for run in range(2):
            with coordl.CoordLoader(ds, batch_size=16, num_workers=2, cache=coordl.Cache(size=0, disk=sys.argv[2]),
                                    shuffle=True) as loader:
                n = sum(len(y) for _, y in loader)
                s = loader.stats()
            out.append([n, s["storage_reads"], s["disk_reads"]])
        print(json.dumps(out))
        """
    )
    assert _job(script, root, str(tmp_path)) == [[N, N, 0], [N, 0, N]]


def test_an_entry_whose_stamp_ends_in_a_nul_byte_is_read_back(tmp_path):
    # A numpy "S16" field drops trailing NULs: 1 sample in 256 was read as stale (found by a test above).
    import numpy as np

    tier = disk.DiskTier(disk.tier_folder(tmp_path))
    try:
        data = np.arange(100, dtype=np.uint8)
        stamp = b"\x07" * 15 + b"\x00"
        tier.put(["s3://b/x.jpg"], [stamp], [data])
        assert tier.flush(10)
        out = np.zeros(100, np.uint8)
        assert tier.read_into(["s3://b/x.jpg"], [stamp], [100], [[out]]).tolist() == [entries.GOOD]
        assert np.array_equal(out, data) and tier.written == 1
        assert tier.read_into(["s3://b/x.jpg"], [b"\x07" * 16], [100], [[out]]).tolist() == [entries.STALE]
    finally:
        tier.close()


def _two_nodes(data: Path, out: Path, tiers: Path, *args: str) -> list[list[dict]]:
    """Two epochs on two loopback nodes, each with a quarter of the dataset in memory (a fresh memory
    cache per job) and a tier of its own under ``tiers``, with DistributedSampler's shards (no
    locality-aware assignment); every rank's stats per epoch."""
    from test_peers import _logs, _records, _run_nodes

    common = ["--epochs", "2", "--cache", "0.25", "--locality", "0", "--disk", str(tiers)]
    codes = _run_nodes(data, out, 2, [*common, *args], loopback=True)
    assert codes == [0, 0], _logs(out)
    return [[r["epochs"][e]["stats"] for r in _records(out, 2)] for e in range(2)]


def test_two_nodes_read_their_own_tier_before_the_other_node_s_memory_unless_told_otherwise(tiny_dataset, tmp_path):
    """A first job without peers fills each node's tier with every sample its rank reads in two epochs; a
    second job, its memory caches empty, reads nothing from the store. In its second epoch a rank misses
    in memory samples that both its own tier and the other node's memory hold: with the tier first (the
    default) it reads them all from its tier and asks the other node for none; with
    Disk(peers_first=True) it asks the other node for those its memory holds."""
    remote = Path(os.environ["COORDL_SHM_DIR"]) / "remote"  # another file system than the tiers' (tmp)
    subprocess.run(["cp", "-r", str(tiny_dataset), str(remote)], check=True)
    try:
        runs = {}
        for first in (0, 1):
            tiers = tmp_path / f"tiers{first}"
            filled = _two_nodes(remote, tmp_path / f"fill{first}", tiers, "--peers", "off")
            assert sum(s["storage_reads"] for s in filled[0]) == N
            assert all(s["peer_reads"] == 0 for e in filled for s in e)
            runs[first] = _two_nodes(remote, tmp_path / f"out{first}", tiers, "--peers-first", str(first))
    finally:
        subprocess.run(["rm", "-rf", str(remote)], check=True)
    for first, epochs in runs.items():
        for e in epochs:
            for s in e:
                assert s["storage_reads"] == 0, (first, epochs)  # the tiers hold every sample the ranks read
                assert s["cache_hits"] + s["disk_reads"] + s["peer_reads"] == s["samples"], (first, epochs)
        # The first epoch's holder map (taken at its start) is empty: the tier serves, memory fills.
        assert all(s["peer_reads"] == 0 and s["disk_reads"] > 0 for s in epochs[0]), (first, epochs)
    # The tier first: nothing is asked of the other node; the other node's memory first: it serves some.
    assert all(s["peer_reads"] == 0 for s in runs[0][1]), runs[0]
    assert all(s["peer_reads"] > 0 for s in runs[1][1]), runs[1]


def test_samples_a_node_receives_from_peers_reach_its_local_tier(tiny_dataset, tmp_path):
    """A node's tier keeps what the other node's memory sends it, as it keeps what the store sends:
    in a job's second epoch every sample a rank takes from a peer or the store goes to its tier's
    writer, so a second job, peers off and its memory empty, reads none of the two epochs' samples
    from the store."""
    remote = Path(os.environ["COORDL_SHM_DIR"]) / "remote"  # another file system than the tiers' (tmp)
    subprocess.run(["cp", "-r", str(tiny_dataset), str(remote)], check=True)
    try:
        tiers = tmp_path / "tiers"
        first = _two_nodes(remote, tmp_path / "first", tiers)
        again = _two_nodes(remote, tmp_path / "again", tiers, "--peers", "off")
    finally:
        subprocess.run(["rm", "-rf", str(remote)], check=True)
    assert sum(s["storage_reads"] for s in first[0]) == N and all(s["peer_reads"] == 0 for s in first[0])
    assert all(s["peer_reads"] > 0 for s in first[1]), first  # the other node's memory served some...
    for s in first[1]:  # ...and they went to the tier, with what the store sent
        assert s["disk_admitted"] == s["storage_reads"] + s["peer_reads"], first
    for e in again:
        for s in e:
            assert s["storage_reads"] == 0 and s["cache_hits"] + s["disk_reads"] == s["samples"], again
