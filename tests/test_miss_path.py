"""The miss path: storage reads a batch at a time, straight into cache slots or one buffer.

Real files (some missing, grown or shrunk), real shared memory, a real thread pool: what a
batch's reads return, what they admit and account, and how they fail.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from coordl.errors import DatasetChangedError, SampleError
from coordl.fetch import storage
from coordl.fetch.ahead import FetchAhead
from coordl.fetch.cache import ENTRY, HEADER, HEADER_BYTES, READY, WRITING, NodeCache
from coordl.fetch.fetcher import Fetcher
from coordl.index import Index
from coordl.shm import names

FP = "00c0ffee00c0ffee"


def table(directory, fp: str):
    """(header, entries) of a cache table, read from its file through the declared layout."""
    raw = Path(directory, names.segment_name(fp, "table")).read_bytes()
    return np.frombuffer(raw, HEADER, count=1)[0].copy(), np.frombuffer(raw, ENTRY, offset=HEADER_BYTES).copy()


def contents(index: Index) -> list[bytes]:
    return [Path(p).read_bytes() for p in index.paths]


@pytest.fixture
def closing():
    things = []
    yield lambda x: things.append(x) or x
    for x in reversed(things):
        x.close()


# -- storage.read_many ------------------------------------------------------------------------
def test_read_many_reads_every_file_it_can_and_names_the_others(tmp_path):
    data = {name: os.urandom(n) for name, n in [("a", 5000), ("b", 0), ("c", 1), ("grown", 300), ("shrunk", 300)]}
    for name, b in data.items():
        (tmp_path / name).write_bytes(b)
    names_ = ["a", "missing", "b", "grown", "c", "shrunk"]
    sizes = [5000, 10, 0, 300, 1, 300]
    (tmp_path / "grown").write_bytes(data["grown"] + b"x")
    (tmp_path / "shrunk").write_bytes(data["shrunk"][:-1])
    buffers = [[np.zeros(n, np.uint8)] for n in sizes]
    halves = [np.zeros(2000, np.uint8), np.zeros(3000, np.uint8)]  # one file into two buffers
    buffers[0] = halves
    paths = [str(tmp_path / n).encode() if k % 2 else str(tmp_path / n) for k, n in enumerate(names_)]

    failed = storage.read_many(paths, sizes, buffers, drop_page_cache=True)

    assert sorted(failed) == [1, 3, 5]
    assert isinstance(failed[1], FileNotFoundError)
    assert isinstance(failed[3], DatasetChangedError)
    assert str(failed[3]).startswith(f"{tmp_path / 'grown'} is 301 bytes but the index says 300: the dataset changed")
    assert isinstance(failed[5], DatasetChangedError) and "is 299 bytes but the index says 300" in str(failed[5])
    assert bytes(np.concatenate(halves)) == data["a"]
    assert bytes(buffers[2][0]) == b"" and bytes(buffers[4][0]) == data["c"]


def test_a_short_read_is_finished(tmp_path):
    path = tmp_path / "f"
    payload = os.urandom(10_000)
    path.write_bytes(payload)
    views = [np.zeros(4000, np.uint8), np.zeros(6000, np.uint8)]
    fd = os.open(path, os.O_RDONLY)
    try:
        done = os.readv(fd, [memoryview(views[0])[:2500]])  # a read that stopped early
        storage._rest(fd, str(path), len(payload), views, done)
    finally:
        os.close(fd)
    assert bytes(np.concatenate(views)) == payload


# -- the cache, many items at a time ------------------------------------------------------
def test_reserve_many_hands_out_bytes_in_order_until_the_budget_then_fits_smaller_ones(isolated, closing, cache_layout):
    sizes = np.array([300, 200, 400, 100, 50, 250, 30, 20], dtype=np.int64)
    cache_layout(256)
    cache = closing(NodeCache(FP, sizes, 700, directory=str(isolated)))
    ids = np.array([0, 1, 2, 3, 4, 5, 6], dtype=np.int64)
    slots = cache.reserve_many(ids)
    got = [k for k, v in enumerate(slots) if v is not None]
    # 300 + 200 fit; 400 does not; then 100 and 50 still do (650), 250 does not, 30 does (680).
    assert got == [0, 1, 3, 4, 6]
    _, entries = table(isolated, FP)
    assert entries["offset"][[0, 1, 3, 4, 6]].tolist() == [0, 300, 500, 600, 650]
    assert (entries["state"][[0, 1, 3, 4, 6]] == WRITING).all()
    for k in got:
        assert sum(len(v) for v in slots[k]) == sizes[k]
        assert len(slots[k]) == (
            1 if entries["offset"][k] // 256 == (entries["offset"][k] + sizes[k] - 1) // 256 else 2
        )
        pos = 0
        for v in slots[k]:
            v[:] = (np.arange(pos, pos + len(v)) + k) % 251
            pos += len(v)
    assert cache.reserve_many(ids) == [None] * len(ids)  # being written: nobody else gets them

    cache.publish_many(np.array([0, 1, 4, 6]))
    cache.abort_many(np.array([3]))
    head, entries = table(isolated, FP)
    assert head["resident_bytes"] == 300 + 200 + 50 + 30 and head["resident_items"] == 4
    assert entries["state"][3] == 0 and entries["offset"][3] == 500  # aborted: its bytes stay its own
    views = cache.views(np.array([6, 0, 4, 1]))
    for k, v in zip([6, 0, 4, 1], views):
        assert not v.flags.writeable
        assert np.array_equal(v, (np.arange(sizes[k]) + k) % 251)
    again = cache.reserve_many(np.array([3, 7, 0]))  # 3 reuses its bytes; 20 more fit (700)
    assert again[2] is None and again[0] is not None and again[1] is not None
    assert table(isolated, FP)[1]["offset"][[3, 7]].tolist() == [500, 680]


# -- Fetcher.read -------------------------------------------------------------------------
def test_fetcher_read_admits_what_fits_and_accounts_exactly(tiny_dataset, isolated, closing, cache_layout):
    index = Index.scan(tiny_dataset)
    expected = contents(index)
    budget = int(index.sizes[:40].sum())
    cache_layout(8192)
    cache = closing(NodeCache(index.fingerprint, index.sizes, budget, directory=str(isolated)))
    fetcher = Fetcher(index, cache, drop_page_cache=True)
    order = np.random.default_rng(3).permutation(len(index))
    for part in np.array_split(order, 4):
        data, errors = fetcher.read(part)
        assert not errors
        assert [bytes(d) for d in data] == [expected[i] for i in part]
    c = fetcher.reset_counters()
    assert (c.storage_reads, c.storage_bytes, c.cache_hits) == (len(index), index.total_bytes, 0)
    cached = np.flatnonzero(cache.ready_mask(np.arange(len(index))))
    assert c.admitted == len(cached) == cache.resident_items > 0
    assert cache.resident_bytes == int(index.sizes[cached].sum()) <= budget
    # The admitted samples were read straight into their slots, in the order they were read.
    admitted_in_order = [i for i in order if i in set(cached.tolist())]
    offsets = table(isolated, index.fingerprint)[1]["offset"][admitted_in_order]
    assert np.all(np.diff(offsets.astype(np.int64)) > 0)
    hits = fetcher.hits(cached)
    assert [bytes(h) for h in hits] == [expected[i] for i in cached]
    c = fetcher.reset_counters()
    assert (c.cache_hits, c.cache_hit_bytes, c.storage_reads) == (len(cached), cache.resident_bytes, 0)


def test_a_failed_read_is_a_sample_error_and_the_rest_of_the_batch_is_read_and_admitted(
    dataset_copy, isolated, closing
):
    index = Index.scan(dataset_copy)
    expected = contents(index)
    cache = closing(NodeCache(index.fingerprint, index.sizes, index.total_bytes, directory=str(isolated)))
    fetcher = Fetcher(index, cache, drop_page_cache=False)
    lost = Path(index.paths[5])
    lost.unlink()
    ids = np.arange(10)
    data, errors = fetcher.read(ids)
    assert list(errors) == [5] and isinstance(errors[5], SampleError)
    assert errors[5].path == str(lost) and errors[5].index == 5 and "No such file" in str(errors[5])
    assert data[5] is None and all(bytes(data[k]) == expected[k] for k in range(10) if k != 5)
    _, entries = table(isolated, index.fingerprint)
    assert entries["state"][5] == 0 and (entries["state"][[0, 1, 2, 3, 4, 6, 7, 8, 9]] == READY).all()
    c = fetcher.counters
    assert c.storage_reads == 9 == c.admitted and c.storage_bytes == int(index.sizes[ids].sum() - index.sizes[5])


def test_a_changed_file_raises_after_the_others_are_published(dataset_copy, isolated, closing):
    index = Index.scan(dataset_copy)
    cache = closing(NodeCache(index.fingerprint, index.sizes, index.total_bytes, directory=str(isolated)))
    fetcher = Fetcher(index, cache, drop_page_cache=False)
    with open(index.paths[3], "ab") as f:
        f.write(b"more")
    with pytest.raises(DatasetChangedError, match="changed after it was indexed"):
        fetcher.read(np.arange(8))
    _, entries = table(isolated, index.fingerprint)
    assert entries["state"][3] == 0 and (entries["state"][[0, 1, 2, 4, 5, 6, 7]] == READY).all()
    assert not (entries["state"] == WRITING).any()


def test_reads_measure_how_many_should_run_at_once(tiny_dataset, isolated):
    index = Index.scan(tiny_dataset)
    contents(index)  # in the page cache
    fetcher = Fetcher(index, None, drop_page_cache=False)
    assert fetcher.concurrency() is None
    fetcher.read(np.arange(8))  # too few files to judge by
    assert fetcher.concurrency() is None
    for part in np.array_split(np.arange(len(index)), 4):
        fetcher.read(part)
    assert 0.5 < fetcher.concurrency() < 2, "reads from the page cache should not ask for more threads"


@pytest.fixture
def busy_cores():
    """One process spinning on each core for the test's duration, as on a training node."""
    spin = "print('spinning', flush=True)\nwhile True: pass"
    spinners = [
        subprocess.Popen([sys.executable, "-c", spin], stdout=subprocess.PIPE)
        for _ in range(len(os.sched_getaffinity(0)))
    ]
    try:
        for p in spinners:
            assert p.stdout.readline() == b"spinning\n"
        yield
    finally:
        for p in spinners:
            p.kill()
        for p in spinners:
            p.wait()


def test_a_busy_machine_does_not_change_how_many_reads_should_run_at_once(tiny_dataset, isolated, busy_cores):
    """Preempted at a system call, a thread waits for a CPU; that wait must count in the wall time
    and the busy time alike (the kernel adds it to the thread's total only once it runs again)."""
    index = Index.scan(tiny_dataset)
    contents(index)
    for _ in range(10):
        fetcher = Fetcher(index, None, drop_page_cache=False)
        for part in np.array_split(np.arange(len(index)), 4):
            fetcher.read(part)
        assert 0.5 < fetcher.concurrency() < 2, "reads from the page cache, on busy cores"


# -- FetchAhead ---------------------------------------------------------------------------
class CountingPool(cf.ThreadPoolExecutor):
    def __init__(self, n):
        super().__init__(n)
        self.tasks = []

    def submit(self, fn, *args, **kwargs):
        self.tasks.append(len(args[0]) if args else 0)
        return super().submit(fn, *args, **kwargs)


def test_a_batch_is_read_in_few_tasks_duplicates_once_failures_skipped_in_order(dataset_copy, isolated, closing):
    index = Index.scan(dataset_copy)
    expected = contents(index)
    cache = closing(NodeCache(index.fingerprint, index.sizes, index.total_bytes, directory=str(isolated)))
    fetcher = Fetcher(index, cache, drop_page_cache=False)
    Path(index.paths[7]).unlink()
    pool = CountingPool(4)
    try:
        batch = np.array([3, 7, 3, *range(10, 70)], dtype=np.int64)  # sample 3 twice (padding)
        ahead = FetchAhead(
            fetcher, [batch], index.labels, pool, threads=4, depth=1, on_error="skip", stop=threading.Event()
        )
        (raw,) = list(ahead)
        # Nothing known about the storage yet: one task for the batch's misses.
        assert pool.tasks == [62]  # 3 read once, 7 tried
        assert raw.ids.tolist() == [3, 3, *range(10, 70)]
        assert [bytes(d) for d in raw.data] == [expected[i] for i in raw.ids]
        assert raw.labels.tolist() == index.labels[raw.ids].tolist()
        assert [(i, p) for i, p, _ in ahead.skipped] == [(7, index.paths[7])]
        assert fetcher.counters.storage_reads == 61  # 3 once

        # From the page cache, reads do not wait: still one task; hits are views, no task.
        pool.tasks.clear()
        batch = np.arange(3, 120, dtype=np.int64)
        batch = batch[batch != 7]
        (raw,) = list(
            FetchAhead(
                fetcher, [batch], index.labels, pool, threads=4, depth=1, on_error="raise", stop=threading.Event()
            )
        )
        assert fetcher.concurrency() < 2
        assert pool.tasks == [len(batch) - 61]  # 3 and 10..69 were cached; the rest in one task
        assert [bytes(d) for d in raw.data] == [expected[i] for i in batch]
        with pytest.raises(SampleError, match=str(Path(index.paths[7]).name)):
            FetchAhead(
                fetcher, [], index.labels, pool, threads=4, depth=1, on_error="raise", stop=threading.Event()
            ).collect(np.arange(40))
    finally:
        pool.shutdown()


@pytest.mark.parametrize("cores", ["idle", "busy"])
def test_reads_that_wait_for_the_storage_spread_over_the_pool(tiny_dataset, isolated, monkeypatch, request, cores):
    if cores == "busy":
        request.getfixturevalue("busy_cores")
    index = Index.scan(tiny_dataset)
    real = storage.read_many

    def slow(paths, sizes, buffers, *, drop_page_cache):  # a device that answers each file in 2 ms
        failed = {}
        for k in range(len(paths)):
            time.sleep(0.002)
            one = real(paths[k : k + 1], sizes[k : k + 1], buffers[k : k + 1], drop_page_cache=drop_page_cache)
            if one:
                failed[k] = one[0]
        return failed

    monkeypatch.setattr(storage, "read_many", slow)
    fetcher = Fetcher(index, None, drop_page_cache=False)
    pool = CountingPool(4)
    try:
        batches = [np.arange(0, 40), np.arange(40, 80), np.arange(80, 120)]
        ahead = FetchAhead(
            fetcher, batches, index.labels, pool, threads=4, depth=0, on_error="raise", stop=threading.Event()
        )
        expected = contents(index)
        for raw in ahead:
            assert [bytes(d) for d in raw.data] == [expected[i] for i in raw.ids]
        assert fetcher.concurrency() > 4
        assert pool.tasks[0] == 40  # nothing known yet: one task
        assert pool.tasks[-4:] == [10, 10, 10, 10]  # the last batch over every thread, 10 files each
    finally:
        pool.shutdown()
