"""The MinIO cache: admission without eviction, shared between real processes, crash safety.

Everything here runs against real shared memory (the ``isolated`` fixture's folder
on /dev/shm, or a small tmpfs mounted by the test), real spawned processes and real
``SIGKILL``. The table is inspected through its declared binary layout
(:data:`coordl.fetch.cache.HEADER` / :data:`~coordl.fetch.cache.ENTRY`), never
through the cache's private attributes.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import queue
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import coordl
from childproc import report, result
from coordl.fetch import cache as cache_module
from coordl.fetch.budget import resolve_budget
from coordl.fetch.cache import (
    EMPTY,
    ENTRY,
    HEADER,
    HEADER_BYTES,
    READY,
    WRITING,
    NodeCache,
)
from coordl.fetch.chunks import headroom
from coordl.fetch.fetcher import Fetcher
from coordl.index import Index
from coordl.shm import names, reaper
from coordl.units import format_bytes, parse_bytes

CTX = multiprocessing.get_context("spawn")
FP = "00c0ffee00c0ffee"
WAIT = 30  # seconds a process waits for another before giving up (a hang is a failure, not a stall)


# -- helpers -----------------------------------------------------------------------------
def pattern(i: int, size: int) -> np.ndarray:
    """The bytes a synthetic test item ``i`` holds."""
    return np.random.default_rng(i).integers(0, 256, int(size), dtype=np.uint8)


def write_range(views, data: np.ndarray, start: int = 0, stop: int | None = None) -> None:
    """Writes ``data[start:stop]`` into the consecutive ``views`` of one reserved item."""
    stop = len(data) if stop is None else stop
    pos = 0
    for v in views:
        lo, hi = max(start, pos), min(stop, pos + len(v))
        if lo < hi:
            v[lo - pos : hi - pos] = data[lo:hi]
        pos += len(v)


def table(directory, fp: str):
    """(header, entries) of a cache table, read from its file through the declared layout."""
    raw = Path(directory, names.segment_name(fp, "table")).read_bytes()
    return np.frombuffer(raw, HEADER, count=1)[0].copy(), np.frombuffer(raw, ENTRY, offset=HEADER_BYTES).copy()


def group_entries(directory, fp: str) -> list[str]:
    return sorted(e for e in os.listdir(directory) if (p := names.parse_name(e)) is not None and p[0] == fp)


def chunk_sizes(directory) -> list[int]:
    """st_size of every cache data segment in the folder."""
    out = []
    for e in os.listdir(directory):
        p = names.parse_name(e)
        if p is not None and p[1] == "chunk":
            out.append(os.stat(os.path.join(directory, e)).st_size)
    return out


def file_bytes(index: Index, i: int) -> np.ndarray:
    return np.fromfile(index.paths[i], dtype=np.uint8)


@pytest.fixture
def closing():
    """Closes caches and loaders at teardown, also when an assertion failed."""
    things = []

    def register(x):
        things.append(x)
        return x

    yield register
    for x in reversed(things):
        x.close()


def kill9(p) -> None:
    os.kill(p.pid, signal.SIGKILL)
    p.join(WAIT)
    assert p.exitcode == -signal.SIGKILL


# -- 1. admission until the budget, never eviction ----------------------------------------
def test_reserve_publish_admits_until_budget_then_never_evicts(isolated, closing, cache_layout):
    rng = np.random.default_rng(1)
    sizes = rng.integers(100, 900, 60)
    chunk, budget = 1000, 9000  # items straddle chunk boundaries; about a third of the items fit
    cache_layout(chunk)
    cache = closing(NodeCache(FP, sizes, budget, directory=str(isolated)))
    assert cache.budget == budget
    admitted = []
    for i in range(len(sizes)):
        views = cache.reserve_many([i])[0]
        if views is None:
            continue
        assert sum(len(v) for v in views) == sizes[i]
        assert cache.get(i) is None  # reserved, not yet published
        write_range(views, pattern(i, sizes[i]))
        cache.publish_many([i])
        admitted.append(i)
        assert cache.resident_bytes <= budget
        assert sum(chunk_sizes(isolated)) <= budget
    assert 0 < len(admitted) < len(sizes)
    assert cache.resident_items == len(admitted)
    assert cache.resident_bytes == int(sizes[admitted].sum())
    head, entries = table(isolated, FP)
    assert head["alloc"] == cache.resident_bytes
    rejected = sorted(set(range(len(sizes))) - set(admitted))
    assert all(sizes[j] > budget - head["alloc"] for j in rejected)  # nothing left out that would still fit
    assert np.array_equal(np.flatnonzero(entries["state"] == READY), admitted)
    starts, ends = entries["offset"][admitted], entries["offset"][admitted] + entries["length"][admitted]
    spanning = [i for i, s, e in zip(admitted, starts, ends) if s // chunk != (e - 1) // chunk]
    assert spanning, "no item crosses a chunk boundary; the test does not cover it"
    assert len(chunk_sizes(isolated)) == -(-int(head["alloc"]) // chunk)

    for _round in range(20):  # later misses are never admitted and nothing is replaced
        for i in rng.permutation(len(sizes)):
            if i in set(admitted):
                assert cache.reserve_many([i])[0] is None  # published: immutable
                got = cache.get(i)
                assert got is not None and not got.flags.writeable
                assert np.array_equal(got, pattern(i, sizes[i]))
            else:
                assert cache.reserve_many([i])[0] is None and cache.get(i) is None
    assert cache.resident_items == len(admitted) and table(isolated, FP)[0]["alloc"] == head["alloc"]


def test_cache_marks_itself_full_when_not_even_the_smallest_item_fits(isolated, closing, cache_layout):
    sizes = np.full(30, 100)
    cache_layout(256)
    cache = closing(NodeCache(FP, sizes, 1000, directory=str(isolated)))
    for i in range(30):
        views = cache.reserve_many([i])[0]
        assert (views is None) == (i >= 10)
        if views is not None:
            write_range(views, pattern(i, 100))
            cache.publish_many([i])
    head, _ = table(isolated, FP)
    assert head["full"] == 1 and head["alloc"] == head["budget"] == cache.resident_bytes == 1000
    assert sorted(chunk_sizes(isolated)) == [232, 256, 256, 256]  # the last chunk ends at the budget
    assert all(np.array_equal(cache.get(i), pattern(i, 100)) for i in range(10))


def test_fetcher_fills_cache_to_budget_and_keeps_items_identical(tiny_dataset, isolated, closing, cache_layout):
    index = Index.scan(tiny_dataset)
    n, total = len(index), index.total_bytes
    budget = resolve_budget(0.3, total, str(isolated))
    assert budget == int(0.3 * total)
    cache_layout(4096)
    cache = closing(NodeCache(index.fingerprint, index.sizes, budget, directory=str(isolated)))
    fetcher = Fetcher(index, cache, drop_page_cache=True)
    expected = [file_bytes(index, i) for i in range(n)]
    rng = np.random.default_rng(0)

    for i in rng.permutation(n):  # first pass: every read comes from storage
        assert np.array_equal(fetcher.fetch(i), expected[i])
        assert cache.resident_bytes <= budget
    c = fetcher.reset_counters()
    assert (c.storage_reads, c.storage_bytes, c.cache_hits) == (n, total, 0)
    assert c.admitted == cache.resident_items > 0
    cached = np.flatnonzero(cache.ready_mask(np.arange(n)))
    resident = cache.resident_bytes
    assert resident == int(index.sizes[cached].sum()) <= budget
    assert sum(chunk_sizes(isolated)) <= budget
    fp = index.fingerprint
    _, entries = table(isolated, fp)
    offs, lens = entries["offset"][cached], entries["length"][cached]
    assert any(o // 4096 != (o + ln - 1) // 4096 for o, ln in zip(offs, lens)), "no item spans two chunks"

    for _epoch in range(6):  # later passes: the same items cached, byte-identical, nothing admitted
        for i in rng.permutation(n):
            got = fetcher.fetch(i)
            assert np.array_equal(got, expected[i])
        c = fetcher.reset_counters()
        assert c.admitted == 0
        assert c.cache_hits == len(cached) and c.cache_hit_bytes == resident
        assert c.storage_reads == n - len(cached) and c.storage_bytes == total - resident
        assert np.array_equal(np.flatnonzero(cache.ready_mask(np.arange(n))), cached)
        assert cache.resident_bytes == resident
    assert np.array_equal(table(isolated, fp)[1]["offset"][cached], offs)  # nothing moved


def test_entry_with_reserved_bytes_is_refilled_after_the_cache_is_full(dataset_copy, isolated, closing):
    index = Index.scan(dataset_copy)
    budget = int(index.sizes[:10].sum())  # items 0..9 fill the budget exactly
    cache = closing(NodeCache(index.fingerprint, index.sizes, budget, directory=str(isolated)))
    fetcher = Fetcher(index, cache, drop_page_cache=False)
    lost = Path(index.paths[0])
    content = lost.read_bytes()
    lost.unlink()  # a transient storage error while item 0 is being admitted
    with pytest.raises(Exception, match=str(lost.name)):
        fetcher.fetch(0)
    _, entries = table(isolated, index.fingerprint)
    assert entries["state"][0] == EMPTY and entries["offset"][0] == 0  # aborted, bytes kept for it
    for i in range(1, len(index)):
        fetcher.fetch(i)
    assert cache.resident_items == 9
    lost.write_bytes(content)  # storage is back
    fetcher.reset_counters()
    assert np.array_equal(fetcher.fetch(0), np.frombuffer(content, np.uint8))
    assert fetcher.counters.admitted == 1, "item 0 owns reserved bytes but was not admitted into them"
    assert cache.resident_bytes == budget


# -- 2. steady epochs read exactly the uncached items --------------------------------------
def test_loader_later_epochs_read_exactly_the_uncached_items(tiny_dataset, isolated, closing):
    import coordl

    index = Index.scan(tiny_dataset)
    n, total = len(index), index.total_bytes
    loader = closing(
        coordl.CoordLoader(
            tiny_dataset, 8, pipeline=coordl.ImageNetTrain(size=32), device_id=None, cache=0.5, shuffle=True
        )
    )
    per_epoch = []
    for epoch in range(3):
        samples = sum(len(labels) for _images, labels in loader)
        s = loader.stats()
        assert s["epoch"] == epoch and samples == s["samples"] == n
        assert s["cache_budget"] == int(0.5 * total) and 0 < s["cache_bytes"] <= s["cache_budget"]
        assert s["cache_items"] == loader.node_cache.resident_items
        per_epoch.append(s)
    first = per_epoch[0]
    assert (first["storage_reads"], first["storage_bytes"], first["cache_hits"]) == (n, total, 0)
    assert first["admitted"] == first["cache_items"]
    for s in per_epoch[1:]:
        assert s["cache_items"] == first["cache_items"] and s["cache_bytes"] == first["cache_bytes"]
        assert s["storage_reads"] == n - s["cache_items"]
        assert s["storage_bytes"] == total - s["cache_bytes"]
        assert s["cache_hits"] == s["cache_items"]
        assert s["admitted"] == 0
    assert sum(chunk_sizes(isolated)) <= first["cache_budget"]


# -- 3. several processes share one cache --------------------------------------------------
def _sharing_member(root, budget, k, attached, filled, done, q):
    def body():
        index = Index.scan(root)
        n = len(index)
        cache_module.DEFAULT_CHUNK_BYTES = 8192  # a spawned process: the parent's cache_layout does not reach it
        cache = NodeCache(index.fingerprint, index.sizes, budget, directory=names.shm_dir())
        try:
            fetcher = Fetcher(index, cache, drop_page_cache=True)
            expected = [np.fromfile(p, dtype=np.uint8) for p in index.paths]
            rng = np.random.default_rng(k)
            out = {}
            attached.wait(WAIT)
            if k == 0:  # one process fills the cache while the others wait
                for i in rng.permutation(n):
                    assert np.array_equal(fetcher.fetch(i), expected[i]), f"sample {i} differs"
                out["fill"] = fetcher.reset_counters().as_dict()
                filled.set()
            assert filled.wait(WAIT)
            fetcher.reset_counters()
            for i in rng.permutation(n):  # then all of them iterate at once
                assert np.array_equal(fetcher.fetch(i), expected[i]), f"sample {i} differs"
            out["shared"] = fetcher.reset_counters().as_dict()
            out["resident_items"], out["resident_bytes"] = cache.resident_items, cache.resident_bytes
            done.wait(WAIT)  # stay attached until the parent has measured the folder
            return out
        finally:
            cache.close()

    report(q, body)


def test_processes_share_one_cache_within_one_budget(tiny_dataset, isolated, procs):
    index = Index.scan(tiny_dataset)  # saved in COORDL_INDEX_DIR, which the children inherit
    n, total = len(index), index.total_bytes
    budget = resolve_budget(0.5, total, str(isolated))
    attached, done, filled, q = CTX.Barrier(4), CTX.Barrier(4), CTX.Event(), CTX.Queue()
    ps = [procs(_sharing_member, str(tiny_dataset), budget, k, attached, filled, done, q) for k in range(3)]
    attached.wait(WAIT)  # all three attached
    assert filled.wait(WAIT)
    head, entries = table(isolated, index.fingerprint)
    assert head["budget"] == budget
    # One copy of the data for the whole node, not one per process.
    assert sum(chunk_sizes(isolated)) <= budget
    on_disk = sum(os.stat(os.path.join(isolated, e)).st_blocks * 512 for e in os.listdir(isolated))
    assert on_disk <= budget + HEADER_BYTES + n * ENTRY.itemsize + 8 * 4096  # page rounding only
    done.wait(WAIT)
    reports = [result(q) for _ in ps]
    for p in ps:
        p.join(WAIT)
        assert p.exitcode == 0
    filler = next(r for r in reports if "fill" in r)
    cached, resident = filler["resident_items"], filler["resident_bytes"]
    assert filler["fill"]["storage_reads"] == n and filler["fill"]["admitted"] == cached > 0
    assert 0 < resident <= budget
    for r in reports:  # the other processes got the filler's items as hits
        assert (r["resident_items"], r["resident_bytes"]) == (cached, resident)
        s = r["shared"]
        assert s["admitted"] == 0
        assert s["cache_hits"] == cached and s["cache_hit_bytes"] == resident
        assert s["storage_reads"] == n - cached and s["storage_bytes"] == total - resident
    assert os.listdir(isolated) == []  # the last one out removed the group


# -- 4. a reader never sees a partial item -------------------------------------------------
def _half_writer(directory, sizes, budget, chunk, i, half, go_on, q):
    def body():
        cache_module.DEFAULT_CHUNK_BYTES = chunk  # a spawned process: the parent's cache_layout does not reach it
        cache = NodeCache(FP, sizes, budget, directory=directory)
        try:
            views = cache.reserve_many([i])[0]
            assert views is not None
            data = pattern(i, sizes[i])
            write_range(views, data, 0, len(data) // 2)
            half.set()
            assert go_on.wait(WAIT)
            write_range(views, data, len(data) // 2)
            cache.publish_many([i])
            return True
        finally:
            cache.close()

    report(q, body)


def test_reader_never_sees_half_written_item(isolated, procs, closing, cache_layout):
    sizes = np.array([700, 900, 5000, 300])
    i, chunk = 2, 2048  # item 2 spans three chunks
    cache_layout(chunk)
    reader = closing(NodeCache(FP, sizes, int(sizes.sum()), directory=str(isolated)))
    half, go_on, q = CTX.Event(), CTX.Event(), CTX.Queue()
    p = procs(_half_writer, str(isolated), sizes, int(sizes.sum()), chunk, i, half, go_on, q)
    assert half.wait(WAIT)
    assert reader.get(i) is None
    assert not reader.ready_mask(np.array([i]))[0]
    assert reader.reserve_many([i])[0] is None  # someone is writing it: not ours to write
    assert table(isolated, FP)[1]["state"][i] == WRITING
    assert reader.resident_items == 0
    go_on.set()
    assert result(q) is True
    p.join(WAIT)
    assert p.exitcode == 0
    got = reader.get(i)
    assert got is not None and np.array_equal(got, pattern(i, sizes[i]))
    assert reader.resident_items == 1 and reader.resident_bytes == sizes[i]


PAUSE_EVERY = 10  # every 10th item a writer reserves, it stops half-written until the reader has looked


def _racing_writer(directory, sizes, budget, chunk, k, start, mid, looked, q):
    def body():
        cache_module.DEFAULT_CHUNK_BYTES = chunk  # a spawned process: the parent's cache_layout does not reach it
        cache = NodeCache(FP, sizes, budget, directory=directory)
        try:
            order = np.random.default_rng(100 + k).permutation(len(sizes))
            written = []
            assert start.wait(WAIT) is not None
            for i in order:
                views = cache.reserve_many([int(i)])[0]
                if views is None:
                    continue
                data = pattern(int(i), sizes[i])
                step = max(1, len(data) // 8)
                for lo in range(0, len(data), step):  # in pieces, while the reader reads
                    write_range(views, data, lo, lo + step)
                    if lo == 0 and len(written) % PAUSE_EVERY == 0:
                        mid.put((k, int(i)))  # the reader looks at it now, in mid-write
                        assert looked.get(timeout=WAIT) == int(i)
                cache.publish_many([int(i)])
                written.append(int(i))
            return written
        finally:
            cache.close()

    report(q, body)


def test_concurrent_writers_and_a_reader_never_see_partial_items(isolated, procs, closing, cache_layout):
    rng = np.random.default_rng(7)
    sizes = rng.integers(200, 3000, 200)
    budget, chunk = int(sizes.sum() * 0.8), 4096
    cache_layout(chunk)
    reader = closing(NodeCache(FP, sizes, budget, directory=str(isolated)))
    expected = [pattern(i, s) for i, s in enumerate(sizes)]
    start, mid, q = CTX.Barrier(3), CTX.Queue(), CTX.Queue()
    looked = [CTX.Queue() for _ in range(2)]
    ps = [procs(_racing_writer, str(isolated), sizes, budget, chunk, k, start, mid, looked[k], q) for k in range(2)]
    start.wait(WAIT)
    checked, seen_mid = 0, set()
    deadline = time.monotonic() + WAIT  # a hang guard
    while any(p.is_alive() for p in ps) and time.monotonic() < deadline:
        with contextlib.suppress(queue.Empty):
            while True:  # the items a writer holds partly written for us
                k, i = mid.get_nowait()
                assert reader.get(i) is None, f"item {i} readable while partly written"
                assert not reader.ready_mask(np.array([i]))[0]
                seen_mid.add(i)
                looked[k].put(i)
        for i in rng.permutation(len(sizes)):
            got = reader.get(int(i))
            if got is None:
                continue
            assert np.array_equal(got, expected[i]), f"item {i} was readable before it was complete"
            checked += 1
    written = [result(q) for _ in ps]
    for p in ps:
        p.join(WAIT)
        assert p.exitcode == 0
    both = written[0] + written[1]
    assert len(both) == len(set(both)), "an item was admitted twice"
    # Each writer's 1st, 11th, 21st, ... item was seen missing in mid-write, and is complete now.
    assert seen_mid == {i for w in written for i in w[::PAUSE_EVERY]} and len(seen_mid) >= 2
    assert checked > 0
    assert reader.resident_items == len(both) and reader.resident_bytes == int(sizes[both].sum()) <= budget
    for i in range(len(sizes)):
        got = reader.get(i)
        assert (got is not None) == (i in both)
        if got is not None:
            assert np.array_equal(got, expected[i])


# -- 5. kill -9 in the middle of a write -----------------------------------------------------
def _killed_mid_write(root, budget, keep, fill, i, written, q):
    def body():
        index = Index.scan(root)
        cache_module.DEFAULT_CHUNK_BYTES = 4096  # a spawned process: the parent's cache_layout does not reach it
        cache = NodeCache(index.fingerprint, index.sizes, budget, keep=keep, directory=names.shm_dir())
        fetcher = Fetcher(index, cache, drop_page_cache=False)
        for j in fill:
            fetcher.fetch(j)
        views = cache.reserve_many([i])[0]
        assert views is not None
        garbage = np.full(int(index.sizes[i]), 0xAB, dtype=np.uint8)
        write_range(views, garbage, 0, len(garbage) // 2)
        return True

    report(q, body)
    written.set()
    time.sleep(3 * WAIT)  # killed here, cache still open, item i still WRITING


def test_kill9_mid_write_is_a_miss_while_others_are_attached(tiny_dataset, isolated, procs, cache_layout):
    index = Index.scan(tiny_dataset)
    n, victim = len(index), 10
    cache_layout(4096)
    cache = NodeCache(index.fingerprint, index.sizes, index.total_bytes, directory=str(isolated))
    try:
        written, q = CTX.Event(), CTX.Queue()
        p = procs(
            _killed_mid_write, str(tiny_dataset), index.total_bytes, False, list(range(victim)), victim, written, q
        )
        assert result(q) is True and written.wait(WAIT)
        kill9(p)
        assert cache.get(victim) is None
        assert table(isolated, index.fingerprint)[1]["state"][victim] == WRITING
        assert cache.reserve_many([victim])[0] is None  # not reclaimed while others are attached...
        fetcher = Fetcher(index, cache, drop_page_cache=False)
        assert np.array_equal(fetcher.fetch(victim), file_bytes(index, victim))  # ...but served from storage
        assert (fetcher.counters.storage_reads, fetcher.counters.admitted) == (1, 0)
        fetcher.reset_counters()
        for i in range(n):  # the rest of the cache works: the dead child's items and new admissions
            assert np.array_equal(fetcher.fetch(i), file_bytes(index, i))
        c = fetcher.reset_counters()
        assert c.cache_hits == victim and c.admitted == n - victim - 1
        assert cache.resident_items == n - 1
        for i in range(n):
            got = cache.get(i)
            assert (got is None) == (i == victim)
            if got is not None:
                assert np.array_equal(got, file_bytes(index, i))
    finally:
        cache.close()
    assert os.listdir(isolated) == []  # the killed child's membership died with it


def test_kill9_mid_write_is_reclaimed_by_the_next_lone_attach(tiny_dataset, isolated, procs, cache_layout):
    index = Index.scan(tiny_dataset)
    fp, victim, budget = index.fingerprint, 10, index.total_bytes
    cache_layout(4096)
    first = NodeCache(fp, index.sizes, budget, keep=True, directory=str(isolated))
    try:
        written, q = CTX.Event(), CTX.Queue()
        p = procs(_killed_mid_write, str(tiny_dataset), budget, False, list(range(victim)), victim, written, q)
        assert result(q) is True and written.wait(WAIT)
        kill9(p)
        fetcher = Fetcher(index, first, drop_page_cache=False)
        for i in range(victim + 1, victim + 20):
            fetcher.fetch(i)
    finally:
        first.close()  # last user leaves; keep=True: the segments stay
    try:
        kinds = {names.parse_name(e)[1] for e in group_entries(isolated, fp)}
        assert {"table", "chunk", "keep"} <= kinds
        head, entries = table(isolated, fp)
        assert entries["state"][victim] == WRITING
        offset, alloc, num_chunks = entries["offset"][victim], head["alloc"], head["num_chunks"]
        chunk_total = sum(chunk_sizes(isolated))

        again = NodeCache(fp, index.sizes, budget, keep=True, directory=str(isolated))  # alone
        try:
            head2, entries2 = table(isolated, fp)
            assert entries2["state"][victim] == EMPTY and entries2["offset"][victim] == offset
            assert again.get(victim) is None
            fetcher = Fetcher(index, again, drop_page_cache=False)
            assert np.array_equal(fetcher.fetch(victim), file_bytes(index, victim))
            assert fetcher.counters.admitted == 1
            got = again.get(victim)
            assert got is not None and np.array_equal(got, file_bytes(index, victim))
            head3, entries3 = table(isolated, fp)
            assert entries3["state"][victim] == READY and entries3["offset"][victim] == offset  # same bytes
            assert (head3["alloc"], head3["num_chunks"]) == (alloc, num_chunks)  # nothing new allocated
            assert sum(chunk_sizes(isolated)) == chunk_total
            for i in list(range(victim)) + list(range(victim + 1, victim + 20)):
                assert np.array_equal(again.get(i), file_bytes(index, i))
        finally:
            again.close()
        assert group_entries(isolated, fp)  # still kept warm
    finally:
        removed = reaper.reap(str(isolated), include_kept=True)
    assert [g.fingerprint for g in removed] == [fp]
    assert os.listdir(isolated) == []


def _attached_then_killed(root, q):
    def body():
        from coordl.fetch.spec import CacheSpec

        index = Index.scan(root)
        spec = CacheSpec.for_dataset(index, index.total_bytes)
        cache = spec.open(index.sizes)
        fetcher = Fetcher(index, cache, drop_page_cache=False)
        for j in range(5):
            fetcher.fetch(j)
        return spec.fingerprint

    report(q, body)
    time.sleep(3 * WAIT)  # killed here, the cache still attached


def test_a_later_loader_of_another_dataset_removes_a_dead_cache(tiny_dataset, dataset_copy, isolated, procs):
    """docs/guarantees.md, SIGKILL: a killed process's segments stay until the next loader on the
    machine opens a cache, which removes every cache no live process uses, not only its own."""
    q = CTX.Queue()
    p = procs(_attached_then_killed, str(tiny_dataset), q)
    dead = result(q)
    kill9(p)
    assert {names.parse_name(e)[1] for e in group_entries(isolated, dead)} >= {"table", "chunk"}
    loader = coordl.CoordLoader(dataset_copy, 8, pipeline=coordl.ImageNetTrain(size=32), device_id=None, cache=0.5)
    try:
        assert loader.node_cache is not None and loader.node_cache.fingerprint != dead
        assert group_entries(isolated, dead) == []  # dataset A's dead cache, reclaimed
        assert group_entries(isolated, loader.node_cache.fingerprint)  # dataset B's own, in use
    finally:
        loader.close()


# -- 6. a budget larger than the shared memory there is ---------------------------------------
@contextlib.contextmanager
def small_tmpfs(size: int):
    """A fresh tmpfs of ``size`` bytes; skips the test where mounting is not allowed."""
    mnt = tempfile.mkdtemp(prefix="coordl-tmpfs-")
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", mnt], capture_output=True, text=True
    )
    if r.returncode != 0:
        os.rmdir(mnt)
        pytest.skip(f"cannot mount a tmpfs to test a small /dev/shm (needs root): {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", mnt], check=False)
        os.rmdir(mnt)


def fill_up(path: str, leave: int = 0) -> int:
    """Writes a file until at most ``leave`` bytes of its filesystem are free; returns its size."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    written = 0
    try:
        block = bytes(1 << 16)
        while (free := os.statvfs(path).f_bavail * os.statvfs(path).f_frsize) > leave:
            try:
                written += os.write(fd, block[: max(4096, min(len(block), free - leave))])
            except OSError:
                break
    finally:
        os.close(fd)
    return written


def test_budget_larger_than_free_shm_is_shrunk_with_a_warning(isolated):
    with small_tmpfs(96 << 20) as mnt:
        total = os.statvfs(mnt).f_blocks * os.statvfs(mnt).f_frsize
        with pytest.warns(RuntimeWarning, match=mnt) as rec:
            budget = resolve_budget("40GB", 10**12, mnt)
        assert "does not fit" in str(rec[0].message)
        free = os.statvfs(mnt).f_bavail * os.statvfs(mnt).f_frsize
        assert 0 < budget == free - headroom(total)  # as much as fits, headroom left alone
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # what fits is taken as asked, silently
            assert resolve_budget("1MiB", 10**12, mnt) == 1 << 20
            assert resolve_budget("auto", 10**12, mnt) == budget // 2
    with small_tmpfs(16 << 20) as mnt:  # smaller than the headroom itself: no cache at all
        with pytest.warns(RuntimeWarning, match=mnt):
            assert resolve_budget(1 << 30, 10**12, mnt) == 0


def test_loader_on_tiny_shm_runs_without_a_cache(tiny_dataset, isolated, monkeypatch, closing):
    import coordl

    n = len(Index.scan(tiny_dataset))
    with small_tmpfs(16 << 20) as mnt:
        monkeypatch.setenv("COORDL_SHM_DIR", mnt)
        with pytest.warns(RuntimeWarning, match=mnt):
            loader = coordl.CoordLoader(
                tiny_dataset, 8, pipeline=coordl.ImageNetTrain(size=32), device_id=None, cache="40GB", shuffle=True
            )
        try:
            assert loader.node_cache is None
            assert sum(len(labels) for _, labels in loader) == n
            assert loader.stats()["storage_reads"] == n
            assert os.listdir(mnt) == []
        finally:
            loader.close()


def test_loader_shrinks_a_budget_that_does_not_fit_and_keeps_working(tiny_dataset, isolated, monkeypatch):
    import coordl

    index = Index.scan(tiny_dataset)
    with small_tmpfs((64 << 20) + (128 << 10)) as mnt:  # 128 KiB beyond the 64 MiB headroom: half the data
        monkeypatch.setenv("COORDL_SHM_DIR", mnt)
        vfs = os.statvfs(mnt)
        free, total = vfs.f_bavail * vfs.f_frsize, vfs.f_blocks * vfs.f_frsize
        with pytest.warns(RuntimeWarning, match=f"does not fit in {mnt}"):
            loader = coordl.CoordLoader(
                tiny_dataset, 8, pipeline=coordl.ImageNetTrain(size=32), device_id=None, cache="1GB", shuffle=True
            )
        try:
            assert 0 < loader.node_cache.budget <= free - headroom(total) < index.total_bytes
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)  # "stopped growing" is expected here
                for _epoch in range(2):
                    assert sum(len(labels) for _, labels in loader) == len(index)
            s = loader.stats()
            assert s["storage_reads"] == len(index) - s["cache_items"]
            assert sum(chunk_sizes(mnt)) <= loader.node_cache.budget
            vfs = os.statvfs(mnt)
            assert vfs.f_bavail * vfs.f_frsize >= headroom(total)  # the headroom stayed free
        finally:
            loader.close()
        assert os.listdir(mnt) == []


def test_shrunk_budget_is_actually_usable(tiny_dataset, isolated, monkeypatch):
    import coordl

    index = Index.scan(tiny_dataset)
    with small_tmpfs((64 << 20) + (128 << 10)) as mnt:  # 128 KiB beyond the 64 MiB headroom: half the data
        monkeypatch.setenv("COORDL_SHM_DIR", mnt)
        with warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter("always")
            loader = coordl.CoordLoader(
                tiny_dataset, 8, pipeline=coordl.ImageNetTrain(size=32), device_id=None, cache="1GB", shuffle=True
            )
            try:
                budget = loader.node_cache.budget
                for _ in loader:
                    pass
                s = loader.stats()
            finally:
                loader.close()
        messages = [str(w.message) for w in rec if issubclass(w.category, RuntimeWarning)]
        assert any("does not fit" in m and mnt in m for m in messages)  # shrunk, with a warning
        assert 0 < budget < index.total_bytes
        assert os.listdir(mnt) == []
        # Nothing else uses this tmpfs, so the shrunk budget must be usable.
        assert not [m for m in messages if "stopped growing" in m], messages
        assert s["cache_items"] > 0 and s["cache_bytes"] > budget // 2


FULL_SHM_CHILD = r"""
import json, os, sys, warnings
import numpy as np
import coordl
from coordl.fetch.fetcher import Fetcher
from unittest import mock
from coordl.fetch import cache as cache_module
from coordl.fetch.cache import NodeCache
sys.path.insert(0, {tests!r})
from test_cache import fill_up

root, mnt = {root!r}, os.environ["COORDL_SHM_DIR"]
out = {{}}
warnings.simplefilter("always")
index = coordl.Index.scan(root)
n = len(index)
expected = [np.fromfile(p, dtype=np.uint8) for p in index.paths]

# A: chunks already reserved, then the tmpfs is filled to the last byte from outside.
with mock.patch.object(cache_module, "DEFAULT_CHUNK_BYTES", 16384):  # A's cache only: B's loader lays out its own
    cache = NodeCache(index.fingerprint, index.sizes, index.total_bytes, directory=mnt)
f = Fetcher(index, cache, drop_page_cache=False)
with warnings.catch_warnings(record=True) as rec:
    warnings.simplefilter("always")
    for i in range(20):
        assert np.array_equal(f.fetch(i), expected[i])
    out["a_before"] = cache.resident_items
    fill_up(os.path.join(mnt, "filler"))
    out["a_free"] = os.statvfs(mnt).f_bavail
    for _ in range(2):
        for i in range(n):
            assert np.array_equal(f.fetch(i), expected[i]), i
out["a_warnings"] = [str(w.message) for w in rec if w.category is RuntimeWarning]
out["a_after"] = cache.resident_items
out["a_budget"] = cache.budget
out["a_resident_bytes"] = cache.resident_bytes
out["a_chunk_bytes"] = sum(os.stat(os.path.join(mnt, e)).st_size for e in os.listdir(mnt) if ".chunk." in e)
out["a_all_cached_ok"] = all(cache.get(i) is None or np.array_equal(cache.get(i), expected[i]) for i in range(n))
cache.close()
os.unlink(os.path.join(mnt, "filler"))

# B: the loader's cache exists, then the tmpfs is filled from outside before its first chunk.
with warnings.catch_warnings(record=True) as rec:
    warnings.simplefilter("always")
    loader = coordl.CoordLoader(
        root, 8, pipeline=coordl.ImageNetTrain(size=32), cache=1.0, device_id=None, shuffle=True
    )
    out["b_budget"] = loader.node_cache.budget
    fill_up(os.path.join(mnt, "filler"))
    stats = []
    for epoch in range(2):
        seen = sum(len(labels) for _, labels in loader)
        s = loader.stats()
        stats.append([seen, s["storage_reads"], s["cache_items"]])
    loader.close()
out["b_warnings"] = [str(w.message) for w in rec if w.category is RuntimeWarning]
out["b_stats"] = stats
os.unlink(os.path.join(mnt, "filler"))
out["left"] = os.listdir(mnt)
print("RESULT" + json.dumps(out))
"""


def test_full_shm_stops_the_cache_growing_without_sigbus(tiny_dataset, isolated, monkeypatch):
    index = Index.scan(tiny_dataset)
    n = len(index)
    with small_tmpfs(72 << 20) as mnt:  # 8 MiB beyond the headroom: the whole tiny dataset fits
        monkeypatch.setenv("COORDL_SHM_DIR", mnt)
        code = FULL_SHM_CHILD.format(tests=str(Path(__file__).parent), root=str(tiny_dataset))
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, f"child died with {r.returncode} (-7 is SIGBUS):\n{r.stderr[-4000:]}"
        out = json.loads(r.stdout.split("RESULT", 1)[1])
    assert out["a_free"] == 0  # really full
    assert out["a_before"] == 20
    # Items that fit in the chunks reserved before the tmpfs filled up were still written (no SIGBUS),
    # then the cache stopped growing with a warning and every miss came from storage.
    assert out["a_before"] < out["a_after"] < n
    assert any("stopped growing" in m and mnt in m for m in out["a_warnings"]), out["a_warnings"]
    assert out["a_all_cached_ok"]
    assert out["a_resident_bytes"] <= out["a_chunk_bytes"] <= out["a_budget"]
    assert any("stopped growing" in m for m in out["b_warnings"]), out["b_warnings"]
    assert out["b_budget"] == index.total_bytes
    assert out["b_stats"] == [[n, n, 0], [n, n, 0]]  # the loader kept working from storage
    assert out["left"] == []


def test_failed_open_on_full_shm_leaves_nothing(isolated):
    from coordl.errors import SharedMemoryError

    with small_tmpfs(1 << 20) as mnt:
        fill_up(os.path.join(mnt, "filler"))
        with pytest.raises(SharedMemoryError, match=mnt):
            NodeCache(FP, np.full(100, 1000), 50_000, directory=mnt)
        left = sorted(e for e in os.listdir(mnt) if e != "filler")
        reaper.reap(mnt, include_kept=True)
    assert left == []


# -- 8. close() removes everything; keep_cache keeps it warm -----------------------------------
def test_loader_close_leaves_nothing_and_keep_cache_starts_warm(tiny_dataset, isolated):
    import coordl

    n = len(Index.scan(tiny_dataset))
    kw = dict(pipeline=coordl.ImageNetTrain(size=32), device_id=None, cache=0.5, shuffle=True)
    with coordl.CoordLoader(tiny_dataset, 8, **kw) as loader:
        for _ in loader:
            pass
        assert {names.parse_name(e)[1] for e in os.listdir(isolated)} >= {"table", "chunk", "lock", "init"}
    assert os.listdir(isolated) == []

    with coordl.CoordLoader(tiny_dataset, 8, **{**kw, "cache": coordl.Cache(size=0.5, keep=True)}) as loader:
        for _ in loader:
            pass
        cached = loader.stats()["cache_items"]
        assert cached > 0
    kept = sorted(os.listdir(isolated))
    assert {names.parse_name(e)[1] for e in kept} >= {"table", "chunk", "keep"}
    try:
        assert reaper.reap(str(isolated)) == []  # kept groups survive a plain reap
        with coordl.CoordLoader(
            tiny_dataset, 8, **{**kw, "cache": coordl.Cache(size=0.5, keep=True)}
        ) as loader:  # the next run, kept again
            for _ in loader:
                pass
            s = loader.stats()
        assert s["epoch"] == 0 and s["cache_hits"] == cached > 0  # warm from the first epoch
        assert s["storage_reads"] == n - cached and s["admitted"] == 0
        assert sorted(os.listdir(isolated)) == kept
    finally:
        removed = reaper.reap(str(isolated), include_kept=True)
    assert len(removed) == 1 and removed[0].keep
    assert os.listdir(isolated) == []


# -- 9. byte sizes -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "text, expected",
    [
        ("40GB", 40 * 10**9),
        ("512MiB", 512 * 2**20),
        ("512 MiB", 512 * 2**20),
        ("1.5GB", 1_500_000_000),
        ("64k", 64 * 1024),
        ("2T", 2 * 2**40),
        ("1_000_000", 1_000_000),
        ("100", 100),
        ("100b", 100),
        ("0", 0),
        (123456, 123456),
        (0, 0),
    ],
)
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


def test_parse_bytes_fractions():
    assert parse_bytes(0.5, 1000) == 500
    assert parse_bytes(1.0, 1000) == 1000
    assert parse_bytes(0.0, 1000) == 0
    for bad in (1.5, -0.1):
        with pytest.raises(ValueError, match="fraction"):
            parse_bytes(bad, 1000)
    with pytest.raises(ValueError, match="fraction"):
        parse_bytes(0.5)  # no dataset size to take a fraction of


@pytest.mark.parametrize("bad", ["abc", "GB", "", "12 parsecs", "5%", "50 %", "1e9 apples"])
def test_parse_bytes_bad_strings_say_what_is_expected(bad):
    with pytest.raises(ValueError) as e:
        parse_bytes(bad)
    assert repr(bad) in str(e.value) or "fraction" in str(e.value)
    assert "40GB" in str(e.value) or "0.5" in str(e.value)


def test_parse_bytes_rejects_negative_strings():
    with pytest.raises(ValueError, match="negative"):
        parse_bytes("-1GB")


def test_parse_bytes_malformed_number_has_a_helpful_message():
    with pytest.raises(ValueError, match="40GB"):
        parse_bytes("1.2.3GB")


def test_parse_bytes_types():
    for b in (True, False):
        with pytest.raises(TypeError, match="bool"):
            parse_bytes(b)
    with pytest.raises(TypeError):
        parse_bytes(None)
    with pytest.raises(TypeError):
        parse_bytes([1])
    with pytest.raises(ValueError, match="negative"):
        parse_bytes(-1)


@given(n=st.integers(0, 10**6), unit=st.sampled_from(["b", "kb", "MB", "Gb", "kib", "MiB", "GiB", "k", "m", "g"]))
def test_parse_bytes_units_property(n, unit):
    mult = {
        "b": 1,
        "kb": 10**3,
        "mb": 10**6,
        "gb": 10**9,
        "kib": 2**10,
        "mib": 2**20,
        "gib": 2**30,
        "k": 2**10,
        "m": 2**20,
        "g": 2**30,
    }[unit.lower()]
    assert parse_bytes(f"{n}{unit}") == n * mult
    assert parse_bytes(f" {n} {unit.upper()} ") == n * mult


def test_format_bytes():
    assert [format_bytes(n) for n in (0, 999, 1000, 12_345_678, 2.5e12, 7e15)] == [
        "0 B",
        "999 B",
        "1.0 KB",
        "12.3 MB",
        "2.5 TB",
        "7000.0 TB",
    ]
    assert format_bytes(200_000, "MB") == "0.2 MB"  # a fixed unit, whatever the size
    assert format_bytes(512 << 20, "MiB", digits=0) == "512 MiB"
    assert format_bytes(1_234_567, "MB", digits=2, with_unit=False) == "1.23"  # a column headed MB


def test_resolve_budget(isolated):
    d = str(isolated)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # all of these fit in /dev/shm: no warning
        assert resolve_budget(0, 10**6, d) == 0
        assert resolve_budget("0", 10**6, d) == 0
        assert resolve_budget(0.0, 10**6, d) == 0
        assert resolve_budget(0, 10**6, "/nonexistent/coordl") == 0  # disabled: the folder is not even looked at
        assert resolve_budget(1000, 10**6, d) == 1000
        assert resolve_budget("1KB", 10**6, d) == 1000
        assert resolve_budget("1MiB", 10**9, d) == 2**20
        assert resolve_budget(0.25, 10**6, d) == 250_000
        assert resolve_budget("40GB", 10**6, d) == 10**6  # never more than the dataset
        assert 0 < resolve_budget("auto", 10**6, d) <= 10**6
        # "auto" is recognised once, by the option object: the budget sees the one spelling
        assert resolve_budget(coordl.Cache(size=" AUTO ").size, 10**6, d) == resolve_budget("auto", 10**6, d)
    with pytest.raises(TypeError):
        resolve_budget(True, 10**6, d)
    with pytest.raises(ValueError, match="40GB"):
        resolve_budget("lots", 10**6, d)
    from coordl.errors import SharedMemoryError

    with pytest.raises(SharedMemoryError, match="/nonexistent/coordl"):
        resolve_budget(1000, 10**6, "/nonexistent/coordl")


def test_the_last_process_to_leave_decides_whether_the_cache_is_kept(tiny_dataset, isolated):
    index = Index.scan(tiny_dataset)
    fp, d = index.fingerprint, str(isolated)
    kept = NodeCache(fp, index.sizes, 10_000, keep=True, directory=d)
    kept.close()
    assert "keep" in {names.parse_name(e)[1] for e in group_entries(isolated, fp)}
    plain = NodeCache(fp, index.sizes, 10_000, directory=d)  # a later run that does not ask to keep it
    assert os.path.exists(os.path.join(d, names.segment_name(fp, "table")))  # it started from the kept one
    plain.close()
    assert os.listdir(isolated) == []


def test_a_forked_child_cannot_use_or_release_its_parents_attachment(isolated):
    """flock belongs to the open file, which a fork shares: a child using the parent's
    attachment would not be excluded, and its close would drop the parent's membership."""
    cache = NodeCache(FP, np.array([10, 20]), 100, directory=str(isolated))
    try:
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child reports through its exit code
            code = 1
            try:
                cache.reserve_many([0])
            except RuntimeError as e:
                code = 0 if "forked process" in str(e) else 2
            cache.close()
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert os.listdir(isolated)  # the child's close removed nothing
        views = cache.reserve_many([0])[0]  # and the parent's attachment still works
        views[0][:] = 7
        cache.publish_many([0])
        assert cache.get(0).tolist() == [7] * 10
    finally:
        cache.close()
    assert os.listdir(isolated) == []
