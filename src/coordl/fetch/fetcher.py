"""The fetcher: raw encoded bytes of samples from the node's MinIO cache first, then storage;
and the node's decoded tier, whose images it serves and fills.

:class:`Fetcher` is the only way the rest of coordl gets sample bytes. Only storage
reads admit items into the cache, and caching never changes which samples are
read, only where their bytes come from. With the partitioned cache, another node's
cache sits between the local one and storage (:meth:`Fetcher.from_peer`); bytes from
peers are not admitted, so every node keeps the part it filled from storage.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, fields

import numpy as np

from coordl.errors import DatasetChangedError, SampleError
from coordl.fetch import disk, samples
from coordl.fetch.cache import NodeCache
from coordl.fetch.disk import entries
from coordl.index import Index
from coordl.threads import Signal

__all__ = ["FetchCounters", "Fetcher"]


@dataclass
class FetchCounters:
    """Where one process's bytes came from since the counters were reset."""

    cache_hits: int = 0
    cache_hit_bytes: int = 0
    storage_reads: int = 0
    storage_bytes: int = 0
    storage_ns: int = 0  # time spent in storage reads, summed over threads
    admitted: int = 0
    peer_reads: int = 0  # samples received from other nodes' caches
    peer_bytes: int = 0
    peer_ns: int = 0  # time spent in peer requests, summed over threads
    decoded_hits: int = 0  # samples served as decoded images from the node's decoded tier
    decoded_hit_bytes: int = 0
    decoded_admitted: int = 0  # images this process decoded and put into the decoded tier
    disk_reads: int = 0  # samples read from the node's local-storage tier
    disk_bytes: int = 0
    disk_ns: int = 0  # time spent reading it, summed over threads
    disk_admitted: int = 0  # samples read from storage that this process handed to the tier's writer
    disk_repaired: int = 0  # of those, samples whose entry was damaged (cut, flipped): written again
    disk_replaced: int = 0  # of those, samples whose entry held another version (stale): replaced

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


class _Pace:
    """Storage reads' time, less their thread's waits for a CPU, against the thread's time on a CPU,
    averaged over recent calls: how long a read takes, on idle cores, per CPU second it costs."""

    MIN_FILES = 16  # a call of fewer files is not measured (it would cost more than it tells)
    WEIGHT = 0.2  # of the latest call in the running averages

    def __init__(self):
        self._wall = self._busy = 0.0
        self._lock = threading.Lock()

    def add(self, wall_ns: int, busy_ns: int) -> None:
        """``wall_ns``: a call's time less its waits for a CPU; ``busy_ns``: its time on a CPU."""
        with self._lock:
            if self._busy == 0:
                self._wall, self._busy = float(wall_ns), float(max(busy_ns, 1))
            else:
                w = self.WEIGHT
                self._wall += w * (wall_ns - self._wall)
                self._busy += w * (max(busy_ns, 1) - self._busy)

    def ratio(self) -> float | None:
        return self._wall / self._busy if self._busy else None


def _schedstat() -> tuple[int, int]:
    """This thread's time spent runnable, waiting for a CPU, and how many times it got one
    (``/proc/thread-self/schedstat``'s second and third fields; zeros where there is none)."""
    try:
        with open("/proc/thread-self/schedstat", "rb") as f:
            _, waited, runs = f.read().split()[:3]
        return int(waited), int(runs)
    except (OSError, ValueError):
        return 0, 0


def _stamp() -> tuple[int, int, int]:
    """The wall clock, and at the same instant this thread's time on a CPU and its time spent
    runnable, waiting for one. What a read's wall time has beyond the two, it spent waiting for
    the storage (or for the GIL, while another thread holds it).

    The kernel adds a wait to the thread's total only when the thread gets a CPU again, so a
    thread preempted between reading the total and the clock would count that wait in one and
    not the other (a busy machine preempts at exactly such system calls): the clock is read
    between two readings of the total that saw no preemption in between."""
    for _ in range(4):
        waited, runs = _schedstat()
        wall, cpu = time.perf_counter_ns(), time.thread_time_ns()
        waited2, runs2 = _schedstat()
        if runs2 == runs:
            break
    return wall, cpu, waited2


class Fetcher:
    """Reads sample bytes through the cache.

    Args:
        index: the dataset.
        cache: the node's MinIO cache, or None to read storage only.
        drop_page_cache: advise the kernel to drop storage-read pages from the page cache.
        decoded: the node's decoded tier (:class:`~coordl.fetch.decoded.DecodedTier`), or None.
    """

    def __init__(self, index: Index, cache: NodeCache | None, *, drop_page_cache: bool, decoded=None, disk=None):
        self.index = index
        self.cache = cache
        self.decoded = decoded
        self.disk = disk  # the node's local-storage tier (coordl.fetch.disk.DiskTier), or None
        self.drop_page_cache = drop_page_cache
        self.counters = FetchCounters()
        self.closing = Signal()  # set when the loader closes: reads still waiting for a store end at once
        self._lock = threading.Lock()
        self._pace = _Pace()

    def reset_counters(self) -> FetchCounters:
        """Returns the counters so far and starts new ones."""
        with self._lock:
            old, self.counters = self.counters, FetchCounters()
        return old

    def cached(self, ids: np.ndarray) -> np.ndarray:
        """A mask of the ids whose bytes are in the node's cache right now."""
        if self.cache is None:
            return np.zeros(len(ids), dtype=bool)
        return self.cache.ready_mask(ids)

    def hits(self, ids: np.ndarray) -> list[np.ndarray]:
        """Read-only views of the bytes of ``ids``, which must all be in the cache (:meth:`cached`)."""
        if not len(ids):
            return []
        out = self.cache.views(ids)
        with self._lock:
            self.counters.cache_hits += len(ids)
            self.counters.cache_hit_bytes += int(self.index.sizes[ids].sum())
        return out

    # -- the decoded tier ----------------------------------------------------------------------
    def decoded_ready(self, ids: np.ndarray) -> np.ndarray:
        """A mask of the ids whose decoded images are in the node's decoded tier right now."""
        if self.decoded is None:
            return np.zeros(len(ids), dtype=bool)
        return self.decoded.ready_mask(ids)

    def all_decoded(self, ids: np.ndarray | None = None) -> bool:
        """Whether every sample of ``ids`` (default: of the dataset) is in the node's decoded tier
        now, and so stays (the tier never evicts): a pass over them needs no decoder."""
        if self.decoded is None:
            return False
        ids = np.arange(len(self.index), dtype=np.int64) if ids is None else np.asarray(ids, dtype=np.int64)
        return bool(len(ids)) and bool(self.decoded.ready_mask(ids).all())

    def decoded_images(self, ids: np.ndarray) -> list[np.ndarray]:
        """Read-only ``(H, W, 3)`` views of the decoded images of ``ids`` (all in the tier)."""
        if not len(ids):
            return []
        out = self.decoded.images(ids)
        with self._lock:
            self.counters.decoded_hits += len(ids)
            self.counters.decoded_hit_bytes += sum(a.nbytes for a in out)
        return out

    def claim(self, ids: np.ndarray) -> np.ndarray:
        """Claims the distinct ``ids`` for this process to decode into the decoded tier: a mask of
        those it got (none once the tier is full). Each claim ends in :meth:`fill` or :meth:`abort`."""
        return self.decoded.claim_many(ids)

    def fill(self, ids: np.ndarray, images: list[np.ndarray]) -> None:
        """Puts the decoded images of claimed ``ids`` into the decoded tier (those that fit)."""
        published = self.decoded.fill_many(ids, images)
        with self._lock:
            self.counters.decoded_admitted += int(np.count_nonzero(published))

    def abort(self, ids: np.ndarray) -> None:
        """Gives up this process's claims among ``ids`` (others' are left alone)."""
        if self.decoded is not None and len(ids):
            self.decoded.abort_claims(ids)

    def release(self) -> None:
        """Gives up every claim this process still holds (a pass ended before decoding them)."""
        if self.decoded is not None:
            self.decoded.release_claims()

    def gather(self, ids: np.ndarray) -> tuple[list[np.ndarray | None], dict[int, SampleError]]:
        """The bytes of ``ids`` in order (a sample may repeat): views of the cached ones, and one
        :meth:`read` of the others.

        Returns:
            the bytes of each of ``ids`` (None for one that could not be read), and the failures
            by sample.

        Raises:
            DatasetChangedError: a file's size is not the index's: the index is stale.
        """
        ids = np.asarray(ids, dtype=np.int64)
        hit = self.cached(ids)
        misses = np.unique(ids[~hit])  # a padded batch may repeat a sample: read once
        data, errors = self.read(misses) if len(misses) else ([], {})
        return self.merge(ids, hit, dict(zip(misses.tolist(), data))), errors

    def merge(
        self, ids: np.ndarray, hit: np.ndarray, got: dict, decoded: np.ndarray | None = None
    ) -> list[np.ndarray | None]:
        """A batch's bytes in order: views of the cached samples (``hit``, counted as hits), the
        decoded tier's images of the ``decoded`` ones (counted too), and ``got[i]`` (bytes read
        elsewhere, None for a failure) for the others."""
        out: list[np.ndarray | None] = [None] * len(ids)
        where = np.flatnonzero(hit)
        for k, view in zip(where.tolist(), self.hits(ids[where])):
            out[k] = view
        rest = ~hit
        if decoded is not None:
            where = np.flatnonzero(decoded)
            for k, image in zip(where.tolist(), self.decoded_images(ids[where])):
                out[k] = image
            rest &= ~decoded
        where = np.flatnonzero(rest)
        for k, i in zip(where.tolist(), ids[where].tolist()):
            out[k] = got[i]
        return out

    def fetch(self, i: int) -> np.ndarray:
        """The raw bytes of sample ``i`` (a read-only view when it comes from the cache).

        Raises:
            SampleError: the file cannot be read (its path and index are attached).
            DatasetChangedError: the file's size is not the index's: the index is stale.
        """
        (data,), errors = self.gather(np.array([i], dtype=np.int64))
        if errors:
            raise errors[int(i)]
        return data

    def concurrency(self) -> float | None:
        """How many storage reads to run at once to keep the CPU busy while the storage answers:
        the ratio of recent reads' time to the time their thread was on a CPU (1 for the page
        cache; ~10 for NVMe's latency; more for network storage). Their time leaves out their
        thread's waits for a CPU, so busy cores do not change the answer: the storage's latency is
        what it was. None until there are reads to judge by."""
        return self._pace.ratio()

    def _from_disk(self, ids, names, stamps, sizes, slots) -> np.ndarray:
        """Reads what the local-storage tier holds of ``ids`` into ``slots``: what was found for each
        (:mod:`coordl.fetch.disk.entries`: ``GOOD`` for those read, ``ABSENT``, ``STALE``, ``DAMAGED``)."""
        present = self.disk.present(names)
        found = np.full(len(ids), entries.ABSENT, dtype=np.uint8)
        if not present.any():
            return found
        where = np.flatnonzero(present)
        t0 = time.perf_counter_ns()
        found[where] = self.disk.read_into(
            [names[k] for k in where], [stamps[k] for k in where], sizes[where], [slots[k] for k in where]
        )
        dt = time.perf_counter_ns() - t0
        got = found == entries.GOOD
        with self._lock:
            c = self.counters
            c.disk_ns += dt
            c.disk_reads += int(got.sum())
            c.disk_bytes += int(sizes[got].sum())
        return found

    def from_peer(self, client, node: int, ids: np.ndarray) -> dict[int, np.ndarray]:
        """The bytes of those of ``ids`` that ``node`` delivers (see :class:`~coordl.fetch.peer_client.PeerClient`)."""
        t0 = time.perf_counter_ns()
        got = client.fetch(node, ids)
        dt = time.perf_counter_ns() - t0
        with self._lock:
            c = self.counters
            c.peer_ns += dt
            c.peer_reads += len(got)
            c.peer_bytes += sum(len(v) for v in got.values())
        return got

    def on_disk(self, ids: np.ndarray) -> np.ndarray:
        """A mask of the ids that the node's local-storage tier has an entry for."""
        if self.disk is None or not len(ids):
            return np.zeros(len(ids), dtype=bool)
        return self.disk.present(disk.keys(self.index, ids)[0])

    def read(
        self, ids: np.ndarray, admit: np.ndarray | None = None
    ) -> tuple[list[np.ndarray | None], dict[int, SampleError]]:
        """Reads the samples ``ids`` (distinct) from the node's local-storage tier where it holds them,
        else from storage, admitting into the cache those it takes; what storage delivered is handed to
        the local-storage tier's writer.

        Admitted samples are read straight into their cache slots and returned as read-only
        views of them; the others are read into one buffer for them all. ``admit`` (a mask)
        limits admission to some of ``ids`` (those bound for the decoded tier stay out).

        Returns:
            the bytes of each of ``ids`` (None for one that failed), and the failures by sample.

        Raises:
            DatasetChangedError: a file's size (an object's size or ETag) is not the index's: the
                index is stale (the other samples are read and published first).
            StoreError: the object store refused the job's credentials (nothing is published).
        """
        ids = np.asarray(ids, dtype=np.int64)
        sizes = self.index.sizes[ids]
        slots: list = [None] * len(ids)
        if self.cache is not None:
            where = np.arange(len(ids)) if admit is None else np.flatnonzero(admit)
            for k, slot in zip(where.tolist(), self.cache.reserve_many(ids[where])):
                slots[k] = slot
        in_cache = np.array([v is not None for v in slots], dtype=bool)
        data: list[np.ndarray | None] = [None] * len(ids)
        outside = np.flatnonzero(~in_cache)
        if len(outside):
            ends = np.cumsum(sizes[outside])
            buffer = np.empty(int(ends[-1]), dtype=np.uint8)
            for k, a, b in zip(outside.tolist(), [0, *ends[:-1].tolist()], ends.tolist()):
                data[k] = buffer[a:b]
                slots[k] = [data[k]]
        found = np.full(len(ids), entries.ABSENT, dtype=np.uint8)  # what the local-storage tier held
        names = stamps = None
        if self.disk is not None:
            names, stamps = disk.keys(self.index, ids)
            found = self._from_disk(ids, names, stamps, sizes, slots)
        local = found == entries.GOOD  # read from the local-storage tier
        store = np.flatnonzero(~local)
        paced = len(store) >= _Pace.MIN_FILES
        w0, c0, q0 = _stamp() if paced else (0, 0, 0)
        t0 = time.perf_counter_ns()
        try:
            failed = {}
            if len(store):
                got = samples.read_many(
                    self.index, ids[store], [slots[k] for k in store], drop_page_cache=self.drop_page_cache,
                    stop=self.closing,
                )  # fmt: skip
                failed = {int(store[j]): e for j, e in got.items()}
        except BaseException:
            if in_cache.any():
                self.cache.abort_many(ids[in_cache])
            raise
        dt = time.perf_counter_ns() - t0
        if paced:
            w1, c1, q1 = _stamp()
            self._pace.add((w1 - w0) - (q1 - q0), c1 - c0)
        ok = np.ones(len(ids), dtype=bool)
        ok[list(failed)] = False
        admitted = np.flatnonzero(in_cache & ok)
        if len(admitted):
            self.cache.publish_many(ids[admitted])
            for k, view in zip(admitted.tolist(), self.cache.views(ids[admitted])):
                data[k] = view
        aborted = np.flatnonzero(in_cache & ~ok)
        if len(aborted):
            self.cache.abort_many(ids[aborted])  # their bytes stay theirs, for the next read
        errors: dict[int, SampleError] = {}
        changed = None
        for k, e in failed.items():
            i = int(ids[k])
            data[k] = None
            if isinstance(e, DatasetChangedError):
                changed = changed or e
            else:
                path = self.index.paths[i]
                errors[i] = SampleError(f"cannot read sample {i} ({path}): {e.strerror or e}", path=path, index=i)
                errors[i].__cause__ = e
        stored = ok & ~local
        filling = self.disk is not None and self.disk.filling
        if filling and stored.any():
            # A stale or damaged entry is replaced by the bytes just read (moved aside first).
            where = np.flatnonzero(stored).tolist()
            again = [bool(found[k] != entries.ABSENT) for k in where]
            self.disk.put([names[k] for k in where], [stamps[k] for k in where], [data[k] for k in where], again)
        with self._lock:
            c = self.counters
            c.storage_ns += dt
            c.storage_reads += int(stored.sum())
            c.storage_bytes += int(sizes[stored].sum())
            c.admitted += len(admitted)
            if filling:
                c.disk_admitted += int(stored.sum())
                c.disk_repaired += int((stored & (found == entries.DAMAGED)).sum())
                c.disk_replaced += int((stored & (found == entries.STALE)).sum())
        if changed is not None:
            self.index.forget_saved()  # so that the restart the error asks for rescans the tree
            raise changed
        return data, errors
