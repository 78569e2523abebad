"""Datasets in tar shards (WebDataset's format): the index, reads, the loader on top, bad shards.

Shards are real tars written by Python's ``tarfile`` and by the ``webdataset`` package's
``ShardWriter``, holding the JPEGs of ``tiny_dataset`` in its index's order, so that a loader over
the shards and one over the folder deliver the same samples in the same order, bit for bit.
"""

from __future__ import annotations

import io
import json
import os
import tarfile
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import coordl
from coordl import CoordLoader, Index, ShardError, tars
from coordl.fetch import samples
from coordl.fetch.storage import read_ranges
from coordl.tars.format import S3_WINDOW, STREAM_AFTER

RECIPE = coordl.ImageNetTrain(size=16)
PER_SHARD = 50  # samples per shard: 120 samples make shards of 50, 50 and 20


def _members(index: Index, i: int, key: str) -> list[tuple[str, bytes]]:
    data = Path(index.paths[i]).read_bytes()
    return [(f"{key}.jpg", data), (f"{key}.cls", str(int(index.labels[i])).encode())]


def write_tars(folder: Index, out: Path, per_shard: int = PER_SHARD, members=_members, fmt=tarfile.GNU_FORMAT):
    """Shards ``shard-000000.tar``, ... in ``out`` of ``folder``'s samples, in its order (keys
    ``s000000``, ...), written by ``tarfile``; returns their brace pattern."""
    out.mkdir(parents=True, exist_ok=True)
    n = -(-len(folder) // per_shard)
    for s in range(n):
        with tarfile.open(out / f"shard-{s:06d}.tar", "w", format=fmt) as tf:
            for i in range(s * per_shard, min(len(folder), (s + 1) * per_shard)):
                for name, data in members(folder, i, f"s{i:06d}"):
                    info = tarfile.TarInfo(name)
                    info.size, info.mtime = len(data), 1_700_000_000
                    tf.addfile(info, io.BytesIO(data))
    return str(out / f"shard-{{000000..{n - 1:06d}}}.tar")


@pytest.fixture(scope="module")
def folder(tiny_dataset) -> Index:
    return Index.scan(tiny_dataset, index_dir="")


@pytest.fixture(scope="module")
def shards(folder, tmp_path_factory) -> str:
    return write_tars(folder, tmp_path_factory.mktemp("tars"))


# -- which shards -----------------------------------------------------------------------------
def test_patterns_folders_and_lists_name_the_shards(shards, tmp_path):
    d = os.path.dirname(shards)
    names = [f"{d}/shard-{s:06d}.tar" for s in range(3)]
    assert tars.expand(shards) == names
    assert tars.expand(d) == names  # a folder: its .tar files, sorted
    assert tars.expand("/x/a-{08..11}.tar") == ["/x/a-08.tar", "/x/a-09.tar", "/x/a-10.tar", "/x/a-11.tar"]
    assert tars.expand("/x/{a,b}-{1..2}.tar") == ["/x/a-1.tar", "/x/a-2.tar", "/x/b-1.tar", "/x/b-2.tar"]
    assert tars.is_tar_data(shards) and tars.is_tar_data(d) and tars.is_tar_data(names)
    assert not tars.is_tar_data([(names[0], 0)])  # (path, label) pairs are files
    (tmp_path / "c0").mkdir()
    (tmp_path / "x.tar").write_bytes(b"")
    assert not tars.is_tar_data(str(tmp_path))  # a folder with class folders is an ImageFolder
    with pytest.raises(FileNotFoundError, match="no .tar shard found"):
        Index.from_tars(str(tmp_path / "c0"), index_dir="")


# -- the index ----------------------------------------------------------------------------------
def test_the_index_holds_each_sample_s_image_label_and_place(folder, shards):
    index = Index.from_tars(shards, index_dir="")
    assert len(index) == len(folder) and index.shards is not None
    np.testing.assert_array_equal(index.labels, folder.labels)
    np.testing.assert_array_equal(index.sizes, folder.sizes)
    d = os.path.dirname(shards)
    assert index.paths[0] == f"{d}/shard-000000.tar:s000000.jpg"
    assert index.paths[119] == f"{d}/shard-000002.tar:s000119.jpg"
    assert list(index.shards.files) == tars.expand(shards)
    assert index.shards.of.tolist() == [i // PER_SHARD for i in range(len(folder))]
    for i in (0, 49, 50, 119):  # the image's bytes are where the index says
        assert samples.read(index, i).tobytes() == Path(folder.paths[i]).read_bytes()
    # The same shards give the same fingerprint; another order of them, another one.
    assert Index.from_tars(shards, index_dir="").fingerprint == index.fingerprint
    assert Index.from_tars(tars.expand(shards)[::-1], index_dir="").fingerprint != index.fingerprint


def test_long_names_pax_and_ustar_shards_are_read_as_tarfile_reads_them(folder, tmp_path):
    def long(index, i, key):
        return [(f"{'d' * 120}/{key}.jpg", Path(index.paths[i]).read_bytes()), (f"{'d' * 120}/{key}.cls", b"7\n")]

    for fmt in (tarfile.GNU_FORMAT, tarfile.PAX_FORMAT):
        pattern = write_tars(folder, tmp_path / str(fmt), 40, long, fmt)
        index = Index.from_tars(pattern, index_dir="")
        assert len(index) == len(folder) and set(index.labels.tolist()) == {7}
        with tarfile.open(tars.expand(pattern)[0]) as tf:
            expect = [(m.name, m.offset_data, m.size) for m in tf.getmembers() if m.name.endswith(".jpg")]
        got = [(index.paths[i].split(":", 1)[1], int(index.shards.offsets[i]), int(index.sizes[i])) for i in range(40)]
        assert got == expect


def test_a_label_function_gets_the_other_members(folder, tmp_path):
    def members(index, i, key):
        return [(f"{key}.jpg", Path(index.paths[i]).read_bytes()), (f"{key}.json", b'{"y": %d}' % (i % 5))]

    pattern = write_tars(folder, tmp_path / "json", 60, members)
    import json

    index = Index.from_tars(pattern, label=lambda m: json.loads(m["json"])["y"], index_dir=str(tmp_path / "ix"))
    assert index.labels.tolist() == [i % 5 for i in range(len(folder))]
    assert index.saved_path is None  # nothing names the function


def test_the_saved_index_is_reused_until_a_shard_changes(shards, tmp_path, caplog):
    d = tmp_path / "copy"
    d.mkdir()
    for f in tars.expand(shards):
        (d / os.path.basename(f)).write_bytes(Path(f).read_bytes())
    ix = str(tmp_path / "ix")
    first = Index.from_tars(str(d), index_dir=ix)
    assert first.saved_path and os.path.exists(first.saved_path)
    again = Index.from_tars(str(d), index_dir=ix)
    assert again.fingerprint == first.fingerprint and not again.labels.flags.writeable  # mapped from the file
    np.testing.assert_array_equal(again.shards.offsets, first.shards.offsets)
    last = d / "shard-000002.tar"
    with tarfile.open(last, "a") as tf:  # a sample more: its size and time change
        info = tarfile.TarInfo("s999999.jpg")
        data = Path(tars.expand(shards)[0]).read_bytes()[512:1024]
        info.size = len(data)
        tf.addfile(info, io.BytesIO(data))
        info = tarfile.TarInfo("s999999.cls")
        info.size = 1
        tf.addfile(info, io.BytesIO(b"1"))
    os.utime(last, ns=(time.time_ns(), time.time_ns()))
    with caplog.at_level("INFO", logger="coordl"):
        changed = Index.from_tars(str(d), index_dir=ix)
    assert len(changed) == len(first) + 1 and "changed since the index was saved" in caplog.text


# -- the loader on top ----------------------------------------------------------------------------
def _epochs(loader, epochs):
    out = []
    for e in range(epochs):
        loader.set_epoch(e)
        ids, images = [], []
        for x, _, i in loader:
            ids += i.tolist()
            images.append(x.clone())
        stats = loader.stats()
        out.append((ids, torch.cat(images), stats))
    return out


def _against_the_folder(data: str, tiny_dataset, labels=None):
    """Two epochs of a cached loader over ``data`` checked against a folder loader's, and their stats
    and the dataset's bytes."""
    kw = dict(batch_size=16, pipeline=RECIPE, device_id=None, shuffle=True, seed=3, return_index=True, prep=1)
    with CoordLoader(data, cache="64MB", **kw) as a:
        if labels is not None:
            assert a.index.labels.tolist() == labels
        got = _epochs(a, 2)
        total = a.index.total_bytes
    with CoordLoader(str(tiny_dataset), cache=0, **kw) as b:
        want = _epochs(b, 2)
    for (ids, x, _), (ids_f, x_f, _) in zip(got, want):
        assert sorted(ids) == list(range(120)) and ids == ids_f  # exactly once, in the same order
        assert torch.equal(x, x_f)  # bit-equal: the same bytes, the same draws
    return got, total


def test_a_loader_over_the_shards_delivers_what_it_delivers_over_the_folder(tiny_dataset, shards, isolated):
    got, total = _against_the_folder(shards, tiny_dataset)
    # The cache holds every sample: the first epoch reads each image's bytes once, the next nothing.
    assert got[0][2]["storage_bytes"] == total and got[0][2]["cache_bytes"] == total
    assert got[1][2]["storage_bytes"] == 0 and got[1][2]["cache_hit_bytes"] == total


def test_each_later_epoch_reads_exactly_the_uncached_samples_bytes(shards, isolated):
    with CoordLoader(shards, batch_size=16, pipeline=RECIPE, device_id=None, cache="20KB", prep=1) as loader:
        loader.set_epoch(0)
        for _ in loader:
            pass
        first = loader.stats()["storage_bytes"]
        cached = loader.stats()["cache_bytes"]
        loader.set_epoch(1)
        for _ in loader:
            pass
        second = loader.stats()["storage_bytes"]
        assert first == loader.index.total_bytes and 0 < cached < first
        assert second == first - cached and loader.stats()["cache_hit_bytes"] == cached


# -- bad shards -------------------------------------------------------------------------------------
def _tar(path: Path, members: list[tuple[str, bytes]]) -> Path:
    with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as tf:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return path


def test_bad_shards_are_named_with_their_member(folder, tmp_path):
    jpg = Path(folder.paths[0]).read_bytes()
    good = [("a.jpg", jpg), ("a.cls", b"1"), ("b.jpg", jpg), ("b.cls", b"2")]
    truncated = _tar(tmp_path / "truncated.tar", good)
    os.truncate(truncated, 512 + len(jpg) // 2)
    with pytest.raises(ShardError, match=r"truncated.tar ends inside member a.jpg .* truncated"):
        Index.from_tars(str(truncated), index_dir="")
    no_image = _tar(tmp_path / "noimage.tar", [("a.jpg", jpg), ("a.cls", b"1"), ("b.txt", b"x"), ("b.cls", b"2")])
    with pytest.raises(ShardError, match=r"noimage.tar: sample b has no image member \(b.txt, b.cls\)"):
        Index.from_tars(str(no_image), index_dir="")
    repeats = _tar(
        tmp_path / "repeats.tar", [("a.jpg", jpg), ("a.cls", b"1"), ("b.jpg", jpg), ("b.cls", b"2"), ("a.txt", b"x")]
    )
    with pytest.raises(ShardError, match=r"repeats.tar: key a repeats at member a.txt"):
        Index.from_tars(str(repeats), index_dir="")
    no_label = _tar(tmp_path / "nolabel.tar", [("a.jpg", jpg)])
    with pytest.raises(ShardError, match=r"nolabel.tar: sample a has no .cls member"):
        Index.from_tars(str(no_label), index_dir="")
    bad_label = _tar(tmp_path / "badlabel.tar", [("a.jpg", jpg), ("a.cls", b"cat")])
    with pytest.raises(ShardError, match=r"badlabel.tar: member a.cls is not an integer label"):
        Index.from_tars(str(bad_label), index_dir="")
    not_tar = tmp_path / "jpeg.tar"
    not_tar.write_bytes(jpg)
    with pytest.raises(ShardError, match=r"jpeg.tar is not a tar file"):
        Index.from_tars(str(not_tar), index_dir="")
    second = 512 + -(-len(jpg) // 512) * 512  # where a.cls's header is
    for field, value in ((0, b"x"), (124, b"7777777")):  # its name, then its size (now past the end)
        bad = _tar(tmp_path / f"damaged{field}.tar", good)
        with open(bad, "r+b") as f:
            f.seek(second + field)
            f.write(value)
        with pytest.raises(
            ShardError, match=rf"damaged{field}.tar has a damaged tar header at byte {second} \(after member a.jpg\)"
        ):
            Index.from_tars(str(bad), index_dir="")
    assert issubclass(ShardError, coordl.CoordlError) and issubclass(ShardError, ValueError)


def test_skip_leaves_out_a_sample_without_an_image_or_label(folder, tmp_path, isolated, caplog):
    jpg = Path(folder.paths[0]).read_bytes()
    shard = _tar(
        tmp_path / "mixed.tar",
        [("a.jpg", jpg), ("a.cls", b"1"), ("b.txt", b"x"), ("b.cls", b"2"), ("c.jpg", jpg), ("c.cls", b"3")],
    )
    with caplog.at_level("WARNING", logger="coordl"):
        loader = CoordLoader(str(shard), batch_size=2, pipeline=RECIPE, device_id=None, on_error="skip", cache=0)
    with loader:
        assert [p.split(":")[1] for p in loader.index.paths] == ["a.jpg", "c.jpg"]
        assert loader.index.labels.tolist() == [1, 3]
        assert sum(len(y) for _, y in loader) == 2
    assert "mixed.tar: sample b has no image member" in caplog.text


def test_a_shard_cut_after_indexing_fails_the_sample_that_lies_past_its_end(folder, shards, tmp_path):
    d = tmp_path / "cut"
    d.mkdir()
    for f in tars.expand(shards):
        (d / os.path.basename(f)).write_bytes(Path(f).read_bytes())
    index = Index.from_tars(str(d), index_dir="")
    os.truncate(d / "shard-000000.tar", int(index.shards.offsets[49]) + 10)
    buffers = [[np.empty(int(index.sizes[i]), np.uint8)] for i in (0, 49)]
    files = index.shards.files.encoded(index.shards.of[[0, 49]])
    failed = read_ranges(
        files,
        index.shards.offsets[[0, 49]].tolist(),
        index.sizes[[0, 49]].tolist(),
        buffers,
        drop_page_cache=False,
        names=["s000000.jpg", "s000049.jpg"],
    )
    assert list(failed) == [1] and isinstance(failed[1], coordl.DatasetChangedError)
    assert "ends inside member s000049.jpg" in str(failed[1])
    assert buffers[0][0].tobytes() == Path(folder.paths[0]).read_bytes()


# -- the torch backend ------------------------------------------------------------------------------
def test_the_torch_backend_s_dataset_of_the_shards_gives_the_folder_s_items(tiny_dataset, shards, isolated):
    from coordl.datasets import ImageFolder, TarDataset
    from test_torch_backend import to_tensor

    ds = TarDataset(shards, transform=to_tensor, target_transform=lambda t: t + 10)
    ref = ImageFolder(str(tiny_dataset), transform=to_tensor, target_transform=lambda t: t + 10)
    assert len(ds) == len(ref) and ds.targets == ref.targets
    for i in (0, 77, 119):
        assert torch.equal(ds[i][0], ref[i][0]) and ds[i][1] == ref[i][1]
    kw = dict(batch_size=8, num_workers=2, shuffle=True, seed=5, return_index=True)
    with CoordLoader(ds, cache="64MB", **kw) as a, CoordLoader(ref, cache=0, **kw) as b:
        for e in range(2):
            a.set_epoch(e)
            b.set_epoch(e)
            got, want = list(a), list(b)
            assert sorted(int(i) for *_, ids in got for i in ids) == list(range(120))
            for (x, y, i), (xr, yr, ir) in zip(got, want, strict=True):
                assert torch.equal(i, ir) and torch.equal(y, yr) and torch.equal(x, xr)
        assert a.stats()["storage_bytes"] == 0  # the second epoch: every image in the cache


def shardwriter_shards(folder: Index, out: Path) -> list[Path]:
    """``folder``'s samples, in its order, as shards of 45 written by webdataset's ``ShardWriter``
    (``train-000000.tar`` to ``train-000002.tar`` in ``out``)."""
    import webdataset as wds

    out.mkdir()
    with wds.ShardWriter(str(out / "train-%06d.tar"), maxcount=45, verbose=0) as sink:
        for i in range(len(folder)):
            sink.write({"__key__": f"{i:06d}", "jpg": Path(folder.paths[i]).read_bytes(), "cls": int(folder.labels[i])})
    return sorted(out.glob("train-*.tar"))


def test_shards_written_by_webdataset_s_shardwriter(folder, tmp_path, isolated):
    out = tmp_path / "wds"
    shardwriter_shards(folder, out)
    index = Index.from_tars(str(out / "train-{000000..000002}.tar"), index_dir="")
    assert len(index) == len(folder) and index.labels.tolist() == folder.labels.tolist()
    with CoordLoader(str(out), batch_size=16, pipeline=RECIPE, device_id=None, return_index=True, cache=0) as a:
        ids = [i for *_, b in a for i in b.tolist()]
    assert ids == list(range(len(folder)))
    for i in (0, 44, 45, 119):
        assert samples.read(index, i).tobytes() == Path(folder.paths[i]).read_bytes()


def test_worker_processes_index_what_this_process_indexes_and_report_bad_shards(folder, tmp_path, monkeypatch):
    from coordl.tars import scan

    pattern = write_tars(folder, tmp_path / "many", 10)  # 12 shards
    monkeypatch.setattr(scan, "PARALLEL_SHARDS", 2)
    monkeypatch.setattr(scan.os, "sched_getaffinity", lambda _: set(range(4)))  # 4 workers, whatever the CPUs
    parallel = Index.from_tars(pattern, index_dir="")
    monkeypatch.setattr(scan, "PARALLEL_SHARDS", 100)
    here = Index.from_tars(pattern, index_dir="")
    assert parallel.fingerprint == here.fingerprint and len(parallel) == len(folder)
    monkeypatch.setattr(scan, "PARALLEL_SHARDS", 2)
    bad = tars.expand(pattern)[7]
    os.truncate(bad, 700)
    with pytest.raises(ShardError, match=r"shard-000007.tar ends inside member s000070.jpg"):
        Index.from_tars(pattern, index_dir="")
    os.unlink(bad)
    with pytest.raises(FileNotFoundError, match=r"shard .*shard-000007.tar does not exist"):
        Index.from_tars(pattern, index_dir="")


# -- s3:// shards, against a real S3-compatible server on localhost ---------------------------------
@pytest.fixture(scope="module")
def server(s3_server):
    s3_server.create_bucket("coordl-tars")
    return s3_server


_uploads = [0]


@pytest.fixture
def s3shards(server, shards, monkeypatch) -> str:
    """The shards in a fresh prefix of the server; the brace pattern of their URLs."""
    for k, v in server.env().items():
        monkeypatch.setenv(k, v)
    _uploads[0] += 1
    prefix = f"u{_uploads[0]}"
    for f in tars.expand(shards):
        server.put("coordl-tars", f"{prefix}/{os.path.basename(f)}", Path(f).read_bytes())
    server.reset()
    return f"s3://coordl-tars/{prefix}/shard-{{000000..000002}}.tar"


def test_s3_shards_are_indexed_as_local_ones_by_range_gets_or_one_stream_each(s3shards, shards, server, tmp_path):
    local = Index.from_tars(shards, index_dir="")
    moved = {}
    for stream in (False, True, None):
        server.reset()
        ix = Index.from_tars(s3shards, index_dir="", stream=stream)
        moved[stream] = ix, server.count("GET"), server.bytes_sent("GET")
    (by_range, range_gets, range_bytes), (streamed, stream_gets, stream_bytes) = moved[False], moved[True]
    chosen, chosen_gets, chosen_bytes = moved[None]
    for ix in (by_range, streamed, chosen):
        assert ix.in_store and ix.shards.etags is not None
        np.testing.assert_array_equal(ix.labels, local.labels)
        np.testing.assert_array_equal(ix.sizes, local.sizes)
        np.testing.assert_array_equal(ix.shards.offsets, local.shards.offsets)
        np.testing.assert_array_equal(ix.shards.of, local.shards.of)
        assert ix.paths[0] == s3shards.replace("{000000..000002}", "000000") + ":s000000.jpg"
    total = sum(os.path.getsize(f) for f in tars.expand(shards))
    assert stream_gets == 3 and stream_bytes == total  # one GET a shard, every byte
    # A GET of at most a window after each member larger than it (the test's images are smaller than a
    # window: with these, streaming moves fewer bytes; benchmarks/tars.py measures photographs).
    assert len(local) <= range_gets < 2 * len(local) and range_bytes <= range_gets * S3_WINDOW
    # Left to choose: with members this small, each shard's first STREAM_AFTER range GETs move more
    # than STREAM_AT of what they go past, so the rest of the shard is streamed by one GET.
    assert chosen_gets == 3 * (STREAM_AFTER + 1), chosen_gets
    assert chosen_bytes <= total + 3 * STREAM_AFTER * S3_WINDOW
    # The prefix of the shards names them too; a second start reuses the saved index after one listing.
    prefix = s3shards.rsplit("/", 1)[0] + "/"
    assert tars.is_tar_data(s3shards) and not tars.is_tar_data(prefix)  # a prefix is an ImageFolder's root
    ix = str(tmp_path / "ix")
    first = Index.from_tars(prefix, index_dir=ix)
    server.reset()
    again = Index.from_tars(prefix, index_dir=ix)
    assert again.fingerprint == first.fingerprint == by_range.fingerprint
    assert server.count("GET") == 0 and again.in_store


def test_s3_shards_of_large_members_are_indexed_by_range_gets_when_left_to_choose(server, tmp_path, monkeypatch):
    """Members of 100 KB (as photographs are): the range GETs move a few KB a sample, so the
    default keeps making them, reading a small part of each shard: one read at a shard's start and
    one after each image, whose window holds the .cls member and the next header."""
    for k, v in server.env().items():
        monkeypatch.setenv(k, v)
    rng = np.random.default_rng(5)

    def members(_, i, key):
        return [(f"{key}.jpg", rng.bytes(100_000 + 17 * i)), (f"{key}.cls", str(i % 3).encode())]

    pattern = write_tars(list(range(60)), tmp_path / "big", per_shard=30, members=members)
    for f in tars.expand(pattern):
        server.put("coordl-tars", f"big/{os.path.basename(f)}", Path(f).read_bytes())
    server.reset()
    index = Index.from_tars("s3://coordl-tars/big/shard-{000000..000001}.tar", index_dir="")
    reads, pread = [], os.pread
    with monkeypatch.context() as m:
        m.setattr(os, "pread", lambda fd, n, at: reads.append(at) or pread(fd, n, at))  # counted, still read
        local = Index.from_tars(pattern, index_dir="")
    assert len(reads) == 2 + 60, len(reads)  # the same reads on local shards
    np.testing.assert_array_equal(index.shards.offsets, local.shards.offsets)
    np.testing.assert_array_equal(index.labels, [i % 3 for i in range(60)])
    total = sum(os.path.getsize(f) for f in tars.expand(pattern))
    # a GET at each shard's start and after each image (its .cls member and the next header in it)
    assert server.count("GET") == 2 + 60, server.count("GET")
    assert server.bytes_sent("GET") <= 62 * S3_WINDOW < total / 20


def test_an_s3_shard_loader_delivers_the_local_one_s_tensors_with_merged_range_gets(s3shards, shards, server, isolated):
    kw = dict(batch_size=16, pipeline=RECIPE, device_id=None, shuffle=True, seed=3, return_index=True, prep=1)
    with CoordLoader(shards, cache=0, **kw) as a:
        want = _epochs(a, 1)
    index = Index.from_tars(s3shards, index_dir="")
    server.reset()
    with CoordLoader(index, cache="64MB", **kw) as b:
        got = _epochs(b, 2)
        total = b.index.total_bytes
    assert got[0][0] == want[0][0] and torch.equal(got[0][1], want[0][1])
    assert got[0][2]["storage_bytes"] == total and got[1][2]["storage_bytes"] == 0
    gets = server.count("GET")
    assert 0 < gets < len(index)  # members of a shard that lie close together: one range GET
    # What lies between merged members, at most MERGE_GAP bytes per merge, and nothing else.
    assert total <= server.bytes_sent("GET") <= total + (len(index) - gets) * samples.MERGE_GAP


def test_shardwriter_shards_on_s3_deliver_the_folder_s_tensors(folder, tiny_dataset, server, tmp_path, monkeypatch):
    for k, v in server.env().items():
        monkeypatch.setenv(k, v)
    for f in shardwriter_shards(folder, tmp_path / "wds"):
        server.put("coordl-tars", f"wds/{f.name}", f.read_bytes())
    url = "s3://coordl-tars/wds/train-{000000..000002}.tar"
    got, total = _against_the_folder(url, tiny_dataset, labels=folder.labels.tolist())
    assert got[0][2]["storage_bytes"] == total and got[1][2]["storage_bytes"] == 0
    assert got[1][2]["cache_hit_bytes"] == total


def test_a_replaced_s3_shard_fails_its_samples_reads(s3shards, server):
    index = Index.from_tars(s3shards, index_dir="")
    key = s3shards.split("coordl-tars/")[1].replace("{000000..000002}", "000001")
    data = bytearray(server.client().get_object(Bucket="coordl-tars", Key=key)["Body"].read())
    data[-600] ^= 1  # same size, another ETag
    server.put("coordl-tars", key, bytes(data))
    buffers = [[np.empty(int(index.sizes[i]), np.uint8)] for i in (0, 60)]
    failed = samples.read_many(index, np.array([0, 60]), buffers, drop_page_cache=False)
    assert list(failed) == [1] and isinstance(failed[1], coordl.DatasetChangedError), failed


def test_a_run_over_shards_resumed_at_another_world_size_gives_the_folder_run_s_images(tiny_dataset, shards, isolated):
    """2 ranks over the shards stop after 3 batches; 3 ranks resume from rank 0's state: the epoch's
    samples are delivered once beyond padding, each the image a single-rank run over the folder
    gives, and the next epoch is whole."""
    from collections import Counter

    from recording import take

    def loader(data, **kw):
        return CoordLoader(data, batch_size=8, pipeline=RECIPE, device_id=None, shuffle=True, seed=7, return_index=True,
                           prep=1, cache="16MB", **kw)  # fmt: skip

    reference: dict = {}
    with loader(str(tiny_dataset)) as whole:
        for e in (0, 1):
            whole.set_epoch(e)
            take(whole, reference, e)
    out: dict = {}
    before = [loader(shards, shard=coordl.Shard(rank=r, world_size=2)) for r in range(2)]
    try:
        first = [i for ld in before for i in take(ld, out, 0, limit=3)]
        state = json.loads(json.dumps(before[0].state_dict()))
    finally:
        for ld in before:
            ld.close()
    after = [loader(shards, shard=coordl.Shard(rank=r, world_size=3)) for r in range(3)]
    rest, nxt = [], []
    try:
        for ld in after:
            ld.load_state_dict(state)
            ld.set_epoch(0)
            rest += take(ld, out, 0)
            ld.set_epoch(1)
            nxt += take(ld, out, 1)
    finally:
        for ld in after:
            ld.close()
    counts = Counter(first + rest)
    assert set(counts) == set(range(120)) and sum(counts.values()) - 120 < 4 + 3
    assert set(nxt) == set(range(120))
    for key, image in out.items():
        assert torch.equal(image, reference[key]), f"sample {key[1]} of epoch {key[0]} differs from the folder's"


def test_hp_group_members_over_shards_share_one_prep_and_get_the_same_images(shards, isolated, procs):
    from test_hp_group import two_members

    outs = two_members(procs, shards, "tars", 2)
    assert sum(s["consumed_shared"] for o in outs for s in o["stats"]) >= 2 * 15
    np.testing.assert_allclose(outs[0]["sums"], outs[1]["sums"], rtol=1e-6)


def test_a_short_positioned_read_is_finished(tmp_path):
    from coordl.fetch import storage

    path = tmp_path / "f"
    payload = os.urandom(20_000)
    path.write_bytes(payload)
    views = [np.zeros(4000, np.uint8), np.zeros(6000, np.uint8)]  # the 10,000 bytes from byte 5,000
    fd = os.open(path, os.O_RDONLY)
    try:
        done = os.preadv(fd, [memoryview(views[0])[:2500]], 5000)  # a read that stopped early
        storage._rest_range(fd, str(path), 5000, 10_000, views, done, "m.jpg")
    finally:
        os.close(fd)
    assert bytes(np.concatenate(views)) == payload[5000:15000]


# -- the rest of coordl on top: peers, the decoded tier, the analyzer -------------------------------
def test_two_nodes_over_shards_serve_each_other_and_read_storage_only_in_the_first_epoch(shards, tmp_path):
    from test_peers import N, _logs, _records, _run_nodes

    out = tmp_path / "out"
    codes = _run_nodes(Path(shards), out, 2, ["--epochs", "3", "--cache", "0.6"])
    assert codes == [0, 0], _logs(out)
    recs = _records(out, 2)
    for epoch in range(3):
        seen = [i for r in recs for b in r["epochs"][epoch]["batches"] for i in b]
        assert sorted(seen) == list(range(N)), f"epoch {epoch} not exactly-once"
        stats = [r["epochs"][epoch]["stats"] for r in recs]
        if epoch == 0:
            assert sum(s["storage_reads"] for s in stats) == N and sum(s["peer_reads"] for s in stats) == 0
        else:  # each node's cache holds what it read; the other node's samples come from its peer
            assert [s["storage_reads"] for s in stats] == [0, 0], stats
            assert sum(s["cache_hits"] + s["peer_reads"] for s in stats) == N


def test_the_decoded_tier_over_shards_delivers_the_folder_s_tensors(tiny_dataset, shards, isolated):
    from test_decoded_loader import assert_same, epochs

    kw = dict(batch_size=16, pipeline=RECIPE, seed=3, device_id=None, prep=2, shuffle=True)
    with CoordLoader(str(tiny_dataset), **kw, cache=coordl.Cache(decoded=0)) as plain:
        want, _ = epochs(plain)
    with CoordLoader(shards, **kw, cache=coordl.Cache(size="1GB", decoded="1GB")) as tiered:
        got, stats = epochs(tiered)
    assert_same(want, got)
    assert stats[0]["decoded_admitted"] == 120 and stats[1]["decoded_hits"] == 120
    assert stats[1]["storage_reads"] == 0 and stats[1]["cache_hits"] == 0


def _resident(path: str, offset: int, size: int) -> list[bool]:
    """Whether each page of ``path`` that holds a byte of ``[offset, offset + size)`` is in the page
    cache (mincore(2) of a mapping of the file; a read would bring pages in)."""
    import ctypes
    import mmap

    page = mmap.PAGESIZE
    start = offset - offset % page
    length = offset + size - start
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) as m:
        vec = (ctypes.c_ubyte * -(-length // page))()
        addr = ctypes.addressof(ctypes.c_char.from_buffer(m)) + start
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        if libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(length), vec) != 0:
            raise OSError(ctypes.get_errno(), "mincore")
        out = [bool(v & 1) for v in vec]
    return out


def test_the_analyzer_drops_the_pages_of_the_samples_members_small_ones_too(shards):
    """The analyzer's cold phase (F) evicts the samples it will read, so that they come from the
    device: in tar shards, each one's member, even one that lies inside a page or two."""
    from coordl.analyze.probe import _drop_pages

    index = Index.from_tars(shards, index_dir="")
    os.sync()  # dirty pages are not dropped
    for path in index.shards.files:
        Path(path).read_bytes()
    where = [index.location(i) for i in range(len(index))]
    assert all(all(_resident(*w)) for w in where)
    assert min(w[2] for w in where) < 2 * os.sysconf("SC_PAGE_SIZE")  # members within two pages
    first = [i for i, w in enumerate(where) if w[0] == where[0][0]]  # the first shard's samples
    _drop_pages(index, np.array(first))
    assert not any(any(_resident(*where[i])) for i in first)
    assert all(all(_resident(*w)) for w in where if w[0] != where[0][0])  # the other shards' stay
