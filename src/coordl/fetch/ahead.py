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
        self.depth = max(1, depth)
        self.on_error = on_error
        self.stop = stop
        self.peers = peers
        self.peer_pool = peer_pool
        self.waiting = BusyClock()  # runs while the caller waits for storage
        self.skipped: list[tuple[int, str, str]] = []

    def __iter__(self) -> Iterator[RawBatch]:
        inflight: deque = deque()
        nxt = 0
        try:
            for _ in range(len(self.batches)):
                while nxt < len(self.batches) and len(inflight) <= self.depth:
                    inflight.append(self._submit(self.batches[nxt]))
                    nxt += 1
                batch = self._collect(*inflight.popleft())
                if self.stop.is_set():
                    return
                yield batch
        finally:
            for _, _, futures in inflight:
                for f in futures.values():
                    f.cancel()

    def collect(self, ids: np.ndarray) -> RawBatch:
        """Fetches one batch now (misses in parallel on the pool), outside the look-ahead."""
        return self._collect(*self._submit(ids))

    def _submit(self, ids: np.ndarray):
        hit = self.fetcher.cached(ids)
        misses = ids[~hit]
        futures = {}
        if self.peers is not None and len(misses):
            nodes = self.peers.remote(misses)
            for node in np.unique(nodes[nodes >= 0]).tolist():
                wanted = np.unique(misses[nodes == node])
                future = self.peer_pool.submit(self._from_peer, node, wanted)
                futures.update(dict.fromkeys(wanted.tolist(), future))
        for i in misses.tolist():
            if i not in futures:
                futures[i] = self.pool.submit(self.fetcher.fetch, i)
        return ids, hit, futures

    def _from_peer(self, node: int, ids: np.ndarray) -> dict[int, np.ndarray | cf.Future]:
        """Asks ``node`` for ``ids``; what it does not deliver is read from storage on the I/O pool."""
        got = self.fetcher.from_peer(self.peers.client, node, ids)
        rest = {i: self.pool.submit(self.fetcher.fetch, i) for i in ids.tolist() if i not in got}
        return {**got, **rest}

    def _collect(self, ids: np.ndarray, hit: np.ndarray, futures: dict) -> RawBatch:
        data, keep = [], []
        for k, i in enumerate(ids.tolist()):
            try:
                if hit[k]:
                    data.append(self.fetcher.fetch(i))
                else:
                    result = self._result(futures[i])
                    if isinstance(result, dict):  # a peer's answer: bytes, or a storage read of what it lacked
                        result = result[i] if isinstance(result[i], np.ndarray) else self._result(result[i])
                    data.append(result)
                keep.append(k)
            except SampleError as e:
                if self.on_error != "skip":
                    raise
                log.warning("coordl: skipping sample %d (%s): %s", i, e.path, e)
                self.skipped.append((i, e.path, str(e)))
        if len(keep) != len(ids):
            ids = ids[keep]
        ids = np.ascontiguousarray(ids, dtype=np.int64)  # DALI takes only dense arrays
        return RawBatch(ids, data, self.labels[ids])

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


class Stopped(Exception):
    """The consumer went away while a read was outstanding."""
