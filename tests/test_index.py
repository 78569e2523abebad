"""The index follows torchvision ImageFolder's rules, is saved, reused and rebuilt when the tree
changes; its paths are flat arrays that a forked worker reads without copying them."""

import gc
import multiprocessing
import os
import pickle
from pathlib import Path

import numpy as np
import pytest

import coordl.index
import coordl.saved
from coordl import indexfile
from coordl.index import IMG_EXTENSIONS, Index
from coordl.paths import PathTable


def reference_imagefolder(root):
    """torchvision's documented rules, written independently: classes are the sorted
    sub-folders; samples walk each class folder (os.walk, following links) in sorted
    order, files sorted, kept if their lower-cased name ends with an image extension."""
    classes = sorted(e.name for e in os.scandir(root) if e.is_dir())
    samples = []
    for label, cls in enumerate(classes):
        for dirpath, _, files in sorted(os.walk(os.path.join(root, cls), followlinks=True)):
            for f in sorted(files):
                if f.lower().endswith(IMG_EXTENSIONS):
                    samples.append((os.path.join(dirpath, f), label))
    return classes, samples


def test_scan_matches_imagefolder_rules(dataset_copy):
    root = dataset_copy
    (root / "class_01" / "nested" / "deeper").mkdir(parents=True)
    (root / "class_01" / "nested" / "deeper" / "x.JPEG").write_bytes((root / "class_00" / "img_0000.jpg").read_bytes())
    (root / "class_01" / "nested" / "a.png").write_bytes(b"not checked at scan time")
    (root / "class_02" / "notes.txt").write_text("ignored")
    (root / "class_03" / "B.Jpg").write_bytes(b"12345")
    (root / "loose.jpg").write_bytes(b"files in the root are not samples")
    classes, samples = reference_imagefolder(root)
    index = Index.scan(root)
    assert list(index.classes) == classes
    assert list(zip(index.paths, index.labels.tolist(), strict=True)) == samples
    assert index.sizes.tolist() == [os.path.getsize(p) for p, _ in samples]
    assert index.total_bytes == sum(index.sizes.tolist())


def test_saved_index_is_reused_without_listing_the_tree(dataset_copy, monkeypatch):
    first = Index.scan(dataset_copy)
    assert list(Path(os.environ["COORDL_INDEX_DIR"]).glob("index-*.idx"))

    def no_scan(*a, **k):
        raise AssertionError("the tree was listed again")

    monkeypatch.setattr(coordl.index, "_scan", no_scan)
    again = Index.scan(dataset_copy)
    assert again.fingerprint == first.fingerprint and again.paths == first.paths


def test_changed_tree_is_rescanned(dataset_copy):
    first = Index.scan(dataset_copy)
    extra = dataset_copy / "class_02" / "zzz_new.jpg"
    extra.write_bytes((dataset_copy / "class_00" / "img_0000.jpg").read_bytes())
    second = Index.scan(dataset_copy)
    assert str(extra) in second.paths and len(second) == len(first) + 1
    assert second.fingerprint != first.fingerprint
    (dataset_copy / "class_99").mkdir()
    (dataset_copy / "class_99" / "a.jpg").write_bytes(b"x")
    third = Index.scan(dataset_copy)
    assert third.classes[-1] == "class_99"


def test_clear_errors_name_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "missing")):
        Index.scan(tmp_path / "missing")
    (tmp_path / "flat").mkdir()
    (tmp_path / "flat" / "a.jpg").write_bytes(b"x")
    with pytest.raises(FileNotFoundError, match="no class folders"):
        Index.scan(tmp_path / "flat")
    (tmp_path / "t" / "good").mkdir(parents=True)
    (tmp_path / "t" / "good" / "a.jpg").write_bytes(b"x")
    (tmp_path / "t" / "empty").mkdir()
    (tmp_path / "t" / "textonly").mkdir()
    (tmp_path / "t" / "textonly" / "readme.txt").write_text("x")
    with pytest.raises(FileNotFoundError, match="empty, textonly"):
        Index.scan(tmp_path / "t")
    os.symlink(tmp_path / "nowhere.jpg", tmp_path / "t" / "good" / "broken.jpg")
    (tmp_path / "t" / "empty" / "a.jpg").write_bytes(b"x")
    (tmp_path / "t" / "textonly" / "a.jpg").write_bytes(b"x")
    with pytest.raises(FileNotFoundError, match="broken.jpg"):
        Index.scan(tmp_path / "t")


def test_from_list_keeps_order_and_checks_input(tiny_dataset, tmp_path):
    classes, samples = reference_imagefolder(tiny_dataset)
    pairs = list(reversed(samples[:10]))
    index = Index.from_list(pairs)
    assert list(index.paths) == [p for p, _ in pairs]
    assert index.labels.tolist() == [lab for _, lab in pairs]
    with pytest.raises(FileNotFoundError, match="nope.jpg"):
        Index.from_list([(tmp_path / "nope.jpg", 0)])
    with pytest.raises(ValueError, match="non-negative int"):
        Index.from_list([(samples[0][0], -1)])
    with pytest.raises(ValueError, match="empty"):
        Index.from_list([])
    with pytest.raises(ValueError, match="pairs"):
        Index.from_list(["just-a-path.jpg"])


def test_fingerprint_depends_on_content_not_on_object():
    a = Index.build(["/a", "/b"], [0, 1], [10, 20])
    assert a.fingerprint == Index.build(["/a", "/b"], np.array([0, 1]), [10, 20]).fingerprint
    assert a.fingerprint != Index.build(["/a", "/b"], [0, 1], [10, 21]).fingerprint
    assert a.fingerprint != Index.build(["/b", "/a"], [0, 1], [10, 20]).fingerprint


def test_fingerprint_is_the_same_as_version_1s():
    # Computed by coordl before the paths became a PathTable: caches and shm names stay valid.
    assert Index.build(["/a", "/b"], [0, 1], [10, 20]).fingerprint == "01feeedbe292d68f"
    assert Index.build(["/data/\u00fc/caf\udce9.jpg"], [3], [7]).fingerprint == "c4285ebe597f3b4e"
    with pytest.raises(ValueError, match="2 paths, 1 labels and 2 sizes"):
        Index.build(["/a", "/b"], [0], [10, 20])


def test_path_table_is_a_sequence_of_str():
    names = ["/d/a.jpg", "/d/\u00fc/b.jpg", "/d/caf\udce9.jpg", "", "/d/z.png"]  # \udce9: a non-UTF-8 byte
    t = PathTable.from_strings(names)
    assert len(t) == 5 and list(t) == names and t == names and t == tuple(names) and t != names[:4]
    assert [t[i] for i in range(-5, 5)] == names + names and t[np.int64(2)] == names[2]
    assert t[1:4] == names[1:4] and t[::-2] == names[::-2]
    assert "/d/z.png" in t and "/d/y.png" not in t and t.index("/d/z.png") == 4
    assert pickle.loads(pickle.dumps(t)) == t == PathTable.from_strings(names)
    assert len(PathTable.from_strings([])) == 0 and list(PathTable.from_strings([])) == []
    with pytest.raises(IndexError, match="out of range"):
        t[5]
    with pytest.raises(TypeError):
        t["0"]
    with pytest.raises(ValueError, match="NUL"):
        PathTable.from_strings(["/a", "/b\0c"])


def test_saved_index_is_mapped_and_holds_no_str_per_sample(dataset_copy):
    first = Index.scan(dataset_copy)
    again = Index.scan(dataset_copy)
    for index in (first, again):  # the scanning process maps the saved copy too
        assert isinstance(index.paths, PathTable) and not index.labels.flags.writeable
        assert index.fingerprint == Index.build(list(index.paths), index.labels, index.sizes).fingerprint
    assert again.paths == first.paths and again.sizes.tolist() == first.sizes.tolist()
    copy = pickle.loads(pickle.dumps(again))  # a spawned worker's
    assert copy.paths == again.paths and copy.fingerprint == again.fingerprint and copy.labels.flags.writeable


def test_saved_index_on_a_network_filesystem_is_read_not_mapped(dataset_copy, monkeypatch):
    first = Index.scan(dataset_copy)
    monkeypatch.setattr(indexfile, "is_local", lambda path: False)
    monkeypatch.setattr(coordl.index, "_scan", None)  # must not be called
    again = Index.scan(dataset_copy)
    assert again.paths == first.paths and again.fingerprint == first.fingerprint
    assert isinstance(again.paths.blob.base, bytes)


def test_local_filesystems_are_told_from_network_ones(tmp_path):
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text(
        "27 1 254:0 / / rw,relatime - ext4 /dev/vda rw\n"
        "40 27 0:50 / /home rw,relatime shared:1 - nfs4 server:/home rw\n"
        "41 40 0:51 / /home/me/fast\\040disk rw - xfs /dev/nvme0n1 rw\n"
        "42 27 0:52 / /scratch rw - lustre 10.0.0.1@tcp:/scratch rw\n"
    )
    local = [
        p
        for p in ("/var/tmp/x", "/home/me/.cache/x", "/home/me/fast disk/x", "/scratch/x", "/homework/x")
        if indexfile.is_local(p, str(mountinfo))
    ]
    assert local == ["/var/tmp/x", "/home/me/fast disk/x", "/homework/x"]


def test_old_and_damaged_saved_indexes_are_rescanned(dataset_copy, monkeypatch):
    first = Index.scan(dataset_copy)
    saved = Path(first.saved_path)
    old = saved.with_suffix(".npz")  # version 1's file of the same tree
    old.write_bytes(b"PK\x03\x04 an npz of version 1")
    scans = []
    real_scan = coordl.index._scan
    monkeypatch.setattr(coordl.index, "_scan", lambda *a: scans.append(1) or real_scan(*a))
    data = saved.read_bytes()
    head = np.frombuffer(data, indexfile.HEADER, count=1).copy()
    head["version"] = 1
    damaged = {
        "empty": b"",
        "short": data[:20],
        "truncated": data[: len(data) // 2],
        "not an index": b"\0" * len(data),
        "version 1": head.tobytes() + data[head.itemsize :],
        "metadata": data[:-3] + b"}}}",
    }
    for why, content in damaged.items():
        # Replaced, as coordl replaces it (a file rewritten in place under a process that maps
        # it makes the process's next read of it a SIGBUS).
        tmp = saved.with_suffix(".tmp")
        tmp.write_bytes(content)
        os.replace(tmp, saved)
        index = Index.scan(dataset_copy)
        assert index.fingerprint == first.fingerprint and index.paths == first.paths, why
        assert saved.read_bytes() == data, why  # rewritten whole
    assert len(scans) == len(damaged)
    assert not old.exists()  # removed by the first save of version 2


# -- memory: a forked worker that walks the index copies nothing ---------------------------------
N_SYNTHETIC = 300_000


def _synthetic(n: int) -> Index:
    paths = [f"/datasets/imagenet/train/n{i // 1281:08d}/n{i // 1281:08d}_{i}.JPEG" for i in range(n)]
    return Index.build(paths, np.arange(n) // 1281, 1000 + np.arange(n) % 5000)


def _memory() -> dict:
    """``uss`` (private clean + dirty) and ``dirty`` (private dirty) of this process, in bytes."""
    f = {}
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines()[1:]:
        key, value = line.split(":", 1)
        f[key] = int(value.split()[0]) * 1024
    return {"uss": f["Private_Clean"] + f["Private_Dirty"], "dirty": f["Private_Dirty"]}


def _walk(paths, sizes, out) -> None:
    gc.collect()
    before = _memory()
    total = 0
    for i in range(len(paths)):
        total += len(paths[i]) + int(sizes[i])
    after = _memory()
    out.send({k: after[k] - before[k] for k in after})


def _growth_of_a_forked_walk(paths, sizes) -> dict:
    """How much a forked child's private memory grows while it reads every path and size."""
    ctx = multiprocessing.get_context("fork")  # as DataLoader's workers on Linux
    r, w = ctx.Pipe(duplex=False)
    p = ctx.Process(target=_walk, args=(paths, sizes, w))
    p.start()
    w.close()
    try:
        return r.recv()
    finally:
        p.join(30)


def test_index_memory_the_rss_of_a_forked_worker_stays_flat_while_it_walks_the_index(tmp_path):
    index = _synthetic(N_SYNTHETIC)
    as_strings = list(index.paths)  # what the index held before: a str per sample
    grown = _growth_of_a_forked_walk(index.paths, index.sizes)
    assert grown["uss"] < 5e6, grown
    # The control, so that the bound means something: the same walk over a list of str writes
    # every str's reference count, and the child copies the pages (pytorch/pytorch#13246).
    control = _growth_of_a_forked_walk(as_strings, index.sizes)
    assert control["uss"] > 20e6, control
    # A saved index, mapped: the child maps the file's pages from the page cache (clean,
    # shared with every process that maps them) and copies none.
    path = str(tmp_path / f"index-x{indexfile.SUFFIX}")
    coordl.saved.save(index, [], path)
    assert indexfile.is_local(path)
    mapped, _ = coordl.saved.load(path, Index)
    assert mapped.fingerprint == index.fingerprint and len(mapped) == N_SYNTHETIC
    grown = _growth_of_a_forked_walk(mapped.paths, mapped.sizes)
    assert grown["dirty"] < 5e6, grown  # its clean pages are the page cache's, mapped
