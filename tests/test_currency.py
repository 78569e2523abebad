"""Cached data only while it is current: a file rewritten in place (same size, later modification time)
or an object replaced under its key is never delivered from a tier that held the old bytes, in a later
run: the index's check at load finds it (a stat per file, one listing of an ``s3://`` prefix), the
sample is read from the store again and its entry replaced, ``stats()["index_changed"]`` counts it, and
the saved index is updated so that the run after finds nothing more.

Real files on a real tmpfs (another device than the local tier's folder), a real S3-compatible server
that counts every request (``coordl_testing.s3server``), and the torch backend with a decode that keeps
the raw bytes, so that what a run delivers is compared with the files' and objects' bytes exactly."""

from __future__ import annotations

import io
import json
import multiprocessing
import os
import shutil
import tarfile
import tempfile
from pathlib import Path

import pytest

pytest.importorskip("moto")

import coordl
from childproc import report, result
from coordl import CoordLoader
from coordl.datasets import ImageFolder, TarDataset
from coordl.index import Index
from coordl.shm import reaper

N = 120  # samples in tiny_dataset
BUCKET = "coordl-currency"
CTX = multiprocessing.get_context("spawn")


@pytest.fixture(scope="module")
def server(s3_server):
    s3_server.create_bucket(BUCKET)
    return s3_server


@pytest.fixture
def s3root(server, s3_tree, tiny_dataset) -> str:
    """A fresh prefix holding the tiny dataset, and this process talking to the server."""
    return s3_tree(BUCKET, tiny_dataset)


@pytest.fixture
def elsewhere(tiny_dataset):
    """A copy of the tiny dataset on a tmpfs: another device than ``tmp_path``'s, where the tier lies."""
    top = Path(tempfile.mkdtemp(prefix="coordl-currency-", dir="/dev/shm"))
    shutil.copytree(tiny_dataset, top / "train")
    yield top / "train"
    shutil.rmtree(top)


def raw(f) -> tuple[str, bytes]:
    """A decode that keeps a sample's bytes as they were delivered, with its path."""
    return f.name, f.read()


def keep(items):
    return items


def run(data, cache: coordl.Cache) -> tuple[dict[str, bytes], dict]:
    """One run (a loader made and closed) of one epoch: every delivered sample's bytes by path, and the stats."""
    dataset = TarDataset(data, decode=raw) if str(data).endswith(".tar") else ImageFolder(data, loader=raw)
    with CoordLoader(dataset, batch_size=16, collate_fn=keep, cache=cache) as loader:
        delivered = {path: body for batch in loader for (path, body), _ in batch}
        stats = loader.stats()
    return delivered, stats


def rewrite(path: Path, body: bytes, later_s: float = 5.0) -> None:
    """Writes ``body`` over the file in place (same inode: its folder's time does not change) and moves
    its modification time ``later_s`` seconds on (robust to any file system's timestamp granularity)."""
    folder = os.stat(path.parent).st_mtime_ns
    st = os.stat(path)
    with open(path, "r+b") as f:
        f.write(body)
        f.truncate(len(body))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + int(later_s * 1e9)))
    assert os.stat(path.parent).st_mtime_ns == folder


def files_of(root: Path) -> dict[str, bytes]:
    return {str(p): p.read_bytes() for p in sorted(root.rglob("*.jpg"))}


def test_a_file_rewritten_at_the_same_size_is_read_anew_and_its_tier_entry_replaced(elsewhere, tmp_path):
    tier = coordl.Cache(size=0, disk=coordl.Disk(tmp_path))
    first, s = run(elsewhere, tier)
    assert first == files_of(elsewhere) and s["storage_reads"] == N
    _, s = run(elsewhere, tier)
    assert s["disk_reads"] == N and s["storage_reads"] == 0  # the tier serves
    victim = elsewhere / "class_01" / "img_0003.jpg"
    old = victim.read_bytes()
    rewrite(victim, bytes(reversed(old)))

    again, s = run(elsewhere, tier)
    assert again == files_of(elsewhere) and again[str(victim)] != old  # the new bytes, exactly
    assert s["index_changed"] == 1 and s["storage_reads"] == 1 and s["disk_reads"] == N - 1
    assert s["disk_replaced"] == 1 and s["disk_repaired"] == 0  # its stale entry rewritten, counted as replaced
    third, s = run(elsewhere, tier)  # the saved index was updated, and the entry replaced
    assert third == files_of(elsewhere)
    assert s["index_changed"] == 0 and s["storage_reads"] == 0 and s["disk_reads"] == N


def test_an_object_replaced_under_its_key_is_read_anew_and_its_tier_entry_replaced(s3root, server, tmp_path):
    tier = coordl.Cache(size=0, disk=coordl.Disk(tmp_path))
    first, _ = run(s3root, tier)
    assert len(first) == N
    index = Index.scan(s3root)
    same, other = index.paths[7], index.paths[90]
    bodies = {url: server.client().get_object(Bucket=BUCKET, Key=_key(url))["Body"].read() for url in (same, other)}
    new = {same: bytes(reversed(bodies[same])), other: bodies[other] + b"\0" * 10}  # same size, and another size
    for url, body in new.items():
        server.put(BUCKET, _key(url), body)
    server.reset()

    again, s = run(s3root, tier)
    assert {url: again[url] for url in new} == new
    assert all(again[url] == body for url, body in first.items() if url not in new)
    assert s["index_changed"] == 2 and s["storage_reads"] == 2 and s["disk_reads"] == N - 2
    assert s["disk_replaced"] == 2 and s["disk_repaired"] == 0
    gets = [path for _, path, status, _ in server.requests("GET") if status == 200 and "list-type" not in path]
    assert sorted(gets) == sorted(f"/{BUCKET}/{_key(url)}" for url in new)
    server.reset()
    third, s = run(s3root, tier)
    assert third == again and s["index_changed"] == 0 and s["disk_reads"] == N
    assert server.count("GET") == 0  # objects: none; the check's listing is not an object request


def test_a_kept_memory_cache_never_delivers_a_file_rewritten_since(dataset_copy, isolated):
    kept = coordl.Cache(size=1.0, keep=True)
    try:
        first, s = run(dataset_copy, kept)
        assert first == files_of(dataset_copy) and s["storage_reads"] == N
        _, s = run(dataset_copy, kept)
        assert s["cache_hits"] == N and s["storage_reads"] == 0  # kept, and attached again
        victim = dataset_copy / "class_02" / "img_0011.jpg"
        old = victim.read_bytes()
        rewrite(victim, bytes(reversed(old)))

        again, s = run(dataset_copy, kept)
        assert again == files_of(dataset_copy) and again[str(victim)] != old
        assert s["index_changed"] == 1 and s["cache_hits"] == 0  # another version's cache: not attached
        third, s = run(dataset_copy, kept)
        assert third == again and s["index_changed"] == 0 and s["cache_hits"] == N
    finally:
        reaper.reap(str(isolated), include_kept=True)


def _shard(path: Path, members: dict[str, bytes]) -> None:
    with tarfile.open(path, "w") as tar:
        for name, body in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(body)
            tar.addfile(info, io.BytesIO(body))


def test_a_tar_shard_rewritten_with_members_of_the_same_sizes_is_read_anew(tiny_dataset, tmp_path):
    top = Path(tempfile.mkdtemp(prefix="coordl-currency-", dir="/dev/shm"))  # another device than the tier's
    try:
        images = sorted(tiny_dataset.rglob("*.jpg"))[:20]
        members = {
            f"s{k:03d}.{ext}": body
            for k, p in enumerate(images)
            for ext, body in (("jpg", p.read_bytes()), ("cls", b"1"))
        }
        shard = top / "shard-000.tar"
        _shard(shard, members)
        tier = coordl.Cache(size=0, disk=coordl.Disk(tmp_path))
        first, s = run(str(shard), tier)
        assert len(first) == 20 and s["storage_reads"] == 20
        st = os.stat(shard)
        members["s004.jpg"] = bytes(reversed(members["s004.jpg"]))  # the same sizes, the same offsets
        _shard(shard, members)
        os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 5_000_000_000))

        again, s = run(str(shard), tier)
        assert {p.rsplit(":", 1)[1]: body for p, body in again.items()} == {
            k: v for k, v in members.items() if k.endswith(".jpg")
        }
        # A changed shard is indexed again (its size and time), and every sample in it is another version.
        assert s["storage_reads"] == 20 and s["disk_reads"] == 0 and s["disk_replaced"] == 20
        _, s = run(str(shard), tier)
        assert s["storage_reads"] == 0 and s["disk_reads"] == 20
    finally:
        shutil.rmtree(top)


def test_a_touched_file_is_another_version_for_the_caches_and_the_same_dataset_for_a_resume(dataset_copy):
    first = Index.scan(dataset_copy)
    victim = Path(first.paths[3])
    rewrite(victim, victim.read_bytes())  # the same bytes, a later time
    again = Index.scan(dataset_copy)
    assert again.changed == 1 and again.mtimes[3] > first.mtimes[3]
    assert again.fingerprint == first.fingerprint and again.version != first.version
    assert Index.scan(dataset_copy).changed == 0 and Index.scan(dataset_copy).version == again.version


def test_a_file_gone_behind_an_unchanged_folder_time_makes_the_index_again(dataset_copy):
    first = Index.scan(dataset_copy)
    victim = Path(first.paths[10])
    folder = os.stat(victim.parent).st_mtime_ns
    victim.unlink()
    os.utime(victim.parent, ns=(folder, folder))  # the folder check alone would reuse the saved index
    again = Index.scan(dataset_copy)
    assert len(again) == N - 1 and str(victim) not in again.paths


def test_an_object_removed_lists_the_prefix_again_and_one_added_waits_for_a_rebuild(s3root, server, tiny_dataset):
    first = Index.scan(s3root)
    body = (tiny_dataset / "class_00" / "img_0000.jpg").read_bytes()
    server.put(BUCKET, _key(s3root) + "/class_00/zzz.jpg", body)
    kept = Index.scan(s3root)
    assert kept.changed == 0 and kept.fingerprint == first.fingerprint  # added keys wait for rebuild=True
    server.delete(BUCKET, _key(first.paths[5]))
    again = Index.scan(s3root)
    assert len(again) == N and first.paths[5] not in again.paths and f"{s3root}/class_00/zzz.jpg" in again.paths


def test_coco_images_rewritten_in_place_are_found_changed(tmp_path, tiny_dataset):
    images = tmp_path / "images"
    images.mkdir()
    entries, annotations = [], []
    for k, p in enumerate(sorted(tiny_dataset.rglob("*.jpg"))[:6]):
        shutil.copy(p, images / f"{k}.jpg")
        entries.append({"id": k, "file_name": f"{k}.jpg", "width": 48, "height": 40})
        annotations.append({"id": k, "image_id": k, "category_id": 1, "bbox": [1, 1, 10, 10], "iscrowd": 0})
    ann = tmp_path / "instances.json"
    ann.write_text(json.dumps({"images": entries, "annotations": annotations, "categories": [{"id": 1, "name": "a"}]}))
    first = Index.from_coco(images, ann)
    rewrite(images / "2.jpg", bytes(reversed((images / "2.jpg").read_bytes())))
    again = Index.from_coco(images, ann)
    assert again.changed == 1 and again.mtimes[2] > first.mtimes[2] and again.boxes is not None
    assert Index.from_coco(images, ann).changed == 0


def _scan_at_once(root: str, env: dict, start, q) -> None:
    os.environ.update(env)

    def body():
        start.wait(30)
        index = Index.scan(root)
        return [index.changed, index.version]

    report(q, body)


def test_processes_that_load_one_saved_index_at_once_check_it_once(s3root, server, procs):
    first = Index.scan(s3root)
    body = server.client().get_object(Bucket=BUCKET, Key=_key(first.paths[0]))["Body"].read()
    server.put(BUCKET, _key(first.paths[0]), bytes(reversed(body)))
    server.reset()
    server.latency_s = 1.0  # the check takes seconds: the others come while it runs, and wait for it
    start, q = CTX.Barrier(3), CTX.Queue()
    env = {k: os.environ[k] for k in ("COORDL_INDEX_DIR", *server.env())}
    for _ in range(3):
        procs(_scan_at_once, s3root, env, start, q)
    try:
        found = [result(q, 120) for _ in range(3)]
    finally:
        server.latency_s = 0.0
    assert all(f == found[0] for f in found) and found[0][0] == 1  # each says what the one check found
    lists = [p for _, p, _, _ in server.requests("GET") if "list-type" in p]
    assert len(lists) == 1 + 4  # one listing: the classes, then each of the 4 classes (a page each)


def _key(url: str) -> str:
    return url.split(f"s3://{BUCKET}/", 1)[1]
