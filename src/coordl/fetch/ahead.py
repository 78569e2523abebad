"""Fetches the raw bytes of the next few batches ahead of pre-processing.

Cache hits are views taken in the calling thread; misses are read by a thread
pool, so storage always has work queued while earlier batches are decoded. With the
partitioned cache, the misses another node holds go to that node in one request per
batch (on a pool of their own); whatever it does not deliver is read from storage.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from coordl.accounting import BusyClock
from coordl.errors import SampleError
from coordl.fetch.fetcher import Fetcher

__all__ = ["FetchAhead", "RawBatch", "Stopped"]

log = logging.getLogger(__name__)

MIN_PART = 8  # files: fewer per task and the task costs more than its reads


@dataclass
class RawBatch:
    """Encoded samples of one batch, in delivery order."""

    ids: np.ndarray  # int64 positions in the index
    data: list[np.ndarray]  # raw bytes per sample
    labels: np.ndarray  # int64
    epoch: int | None = None  # the epoch whose random draws augment it, when not the pass's


class FetchAhead:
    """Iterates :class:`RawBatch` es of ``batches`` in order, fetching ``depth`` batches ahead.

    Args:
        fetcher: where bytes come from.
        batches: sample ids of each batch, in delivery order.
        labels: label of every sample of the index.
        pool: threads that read misses.
        threads: the pool's threads: the most reads of one batch's misses run at once.
        depth: batches in flight ahead of the one being returned.
        on_error: ``"raise"`` or ``"skip"`` for samples that cannot be read.
        stop: when set, iteration ends early.
        peers: the partitioned cache (:class:`~coordl.fetch.peer.PeerGroup`), or None.
        peer_pool: threads that wait for peers' answers.
    """

    def __init__(
        self,
        fetcher: Fetcher,
        batches: list[np.ndarray],
        labels: np.ndarray,
        pool: cf.ThreadPoolExecutor,
        *,
        threads: int,
        depth: int,
        on_error: str,
        stop: threading.Event,
        peers=None,
        peer_pool: cf.ThreadPoolExecutor | None = None,
    ):
        self.fetcher = fetcher
        self.batches = batches
        self.labels = labels
        self.pool = pool
        self.threads = max(1, threads)
        self.depth = max(1, depth)
        self.on_error = on_error
        self.stop = stop
        self.peers = peers
        self.peer_pool = peer_pool
        self.waiting = BusyClock()  # runs while the caller waits for storage
        self.skipped: list[tuple[int, str, str]] = []

    def __iter__(self) -> Iterator[RawBatch]:
        inflight: deque[_Pending] = deque()
        nxt = 0
        try:
            for _ in range(len(self.batches)):
                while nxt < len(self.batches) and len(inflight) <= self.depth:
                    inflight.append(self._submit(self.batches[nxt]))
                    nxt += 1
                batch = self._collect(inflight.popleft())
                if self.stop.is_set():
                    return
                yield batch
        finally:
            for pending in inflight:
                for _, future in pending.reads:
                    future.cancel()

    def collect(self, ids: np.ndarray) -> RawBatch:
        """Fetches one batch now (misses in parallel on the pool), outside the look-ahead."""
        return self._collect(self._submit(ids))

    def _submit(self, ids: np.ndarray) -> _Pending:
        hit = self.fetcher.cached(ids)
        misses = np.unique(ids[~hit])  # a padded batch may repeat a sample: read once
        reads = []
        if self.peers is not None and len(misses):
            nodes = self.peers.remote(misses)
            for node in np.unique(nodes[nodes >= 0]).tolist():
                wanted = misses[nodes == node]
                reads.append((wanted, self.peer_pool.submit(self._from_peer, node, wanted)))
            misses = misses[nodes < 0]
        for part in self._parts(misses):
            reads.append((part, self.pool.submit(self.fetcher.read, part)))
        return _Pending(ids, hit, reads)

    def _parts(self, misses: np.ndarray) -> list[np.ndarray]:
        """A batch's misses cut into parts, each read by one task of the pool, in order.

        As many parts as reads should run at once (:meth:`Fetcher.concurrency`), of at least
        :data:`MIN_PART` files each: one from the page cache, where more would only contend for
        the CPU and the GIL (and while nothing is known); more, up to every thread of the pool,
        as the storage's latency dominates.
        """
        if not len(misses):
            return []
        want = self.fetcher.concurrency() or 1.0
        parts = min(self.threads, max(1, round(want)))
        parts = max(1, min(parts, len(misses) // MIN_PART))
        return np.array_split(misses, parts)

    def _from_peer(self, node: int, ids: np.ndarray) -> tuple[list, dict]:
        """Asks ``node`` for ``ids``; what it does not deliver is read from storage."""
        got = self.fetcher.from_peer(self.peers.client, node, ids)
        data = [got.get(i) for i in ids.tolist()]
        rest = np.array([k for k, v in enumerate(data) if v is None], dtype=np.int64)
        errors = {}
        if len(rest):
            read, errors = self.fetcher.read(ids[rest])
            for k, v in zip(rest.tolist(), read):
                data[k] = v
        return data, errors

    def _collect(self, pending: _Pending) -> RawBatch:
        ids, hit = pending.ids, pending.hit
        got: dict[int, np.ndarray | None] = {}
        errors: dict[int, SampleError] = {}
        for part, future in pending.reads:
            data, failed = self._result(future)
            got.update(zip(part.tolist(), data))
            errors.update(failed)
        out: list[np.ndarray | None] = [None] * len(ids)
        where = np.flatnonzero(hit)
        for k, view in zip(where.tolist(), self.fetcher.hits(ids[where])):
            out[k] = view
        where = np.flatnonzero(~hit)
        for k, i in zip(where.tolist(), ids[where].tolist()):
            out[k] = got[i]
        if errors:
            keep = []
            for k, i in enumerate(ids.tolist()):
                if out[k] is not None:
                    keep.append(k)
                    continue
                e = errors[i]
                if self.on_error != "skip":
                    raise e
                log.warning("coordl: skipping sample %d (%s): %s", i, e.path, e)
                self.skipped.append((i, e.path, str(e)))
            ids = ids[keep]
            out = [out[k] for k in keep]
        ids = np.ascontiguousarray(ids, dtype=np.int64)  # DALI takes only dense arrays
        return RawBatch(ids, out, self.labels[ids])

    def _result(self, future: cf.Future):
        if future.done():
            return future.result()
        self.waiting.enter()
        try:
            while True:
                try:
                    return future.result(timeout=0.1)
                except cf.TimeoutError:
                    if self.stop.is_set():
                        raise Stopped() from None
        finally:
            self.waiting.leave()

    @property
    def wait_s(self) -> float:
        """Seconds the caller has waited for storage."""
        return self.waiting.total()


@dataclass
class _Pending:
    """A batch whose misses are being read: its ids, which were cached, and the reads of the rest
    (each a part of the misses and the future of its bytes and failures)."""

    ids: np.ndarray
    hit: np.ndarray
    reads: list[tuple[np.ndarray, cf.Future]]


class Stopped(Exception):
    """The consumer went away while a read was outstanding."""
