"""Fetches the raw bytes of the next few batches ahead of pre-processing.

Cache hits are views taken in the calling thread; misses are read by a thread
pool (:meth:`Fetcher.read <coordl.fetch.fetcher.Fetcher.read>`, which walks the tiers under
memory), so storage always has work queued while earlier batches are decoded. With the
partitioned cache, the misses another node holds are read on a pool of their own, one read
per node and batch; what that node does not deliver is read further down the chain.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import logging
import threading
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from coordl.accounting import BusyClock
from coordl.errors import SampleError
from coordl.fetch.fetcher import Fetcher

__all__ = ["DECODED", "DECODE_KEEP", "ENCODED", "FetchAhead", "RawBatch", "Stopped"]

log = logging.getLogger(__name__)

MIN_PART = 8  # files: fewer per task and the task costs more than its reads


#: How a sample reaches pre-processing (:attr:`RawBatch.kind`): its encoded bytes; its encoded
#: bytes, to be decoded whole and put into the node's decoded tier (this process claimed it);
#: its decoded image, from the decoded tier.
ENCODED, DECODE_KEEP, DECODED = 0, 1, 2


@dataclass
class RawBatch:
    """The samples of one batch, in delivery order: encoded bytes, or decoded images from the
    decoded tier (``kind``)."""

    ids: np.ndarray  # int64 positions in the index
    data: list[np.ndarray]  # raw bytes per sample, or a decoded (H, W, 3) image
    labels: np.ndarray  # int64
    epoch: int | None = None  # the epoch whose random draws augment it, when not the pass's
    kind: np.ndarray | None = None  # ENCODED, DECODE_KEEP or DECODED per sample (None: all ENCODED)
    number: int = -1  # which batch of its pass it is: it travels with the batch through prep

    def kinds(self) -> np.ndarray:
        return self.kind if self.kind is not None else np.zeros(len(self.ids), dtype=np.int8)

    def subset(self, keep: list[int]) -> RawBatch:
        """The batch without the samples not in ``keep`` (positions)."""
        kind = self.kind[keep] if self.kind is not None else None
        return dataclasses.replace(
            self, ids=self.ids[keep], data=[self.data[k] for k in keep], labels=self.labels[keep], kind=kind
        )


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
                    inflight.append(self.submit(self.batches[nxt], nxt))
                    nxt += 1
                batch = self.receive(inflight.popleft())
                if self.stop.is_set():
                    return
                yield batch
        finally:
            for pending in inflight:
                for _, future in pending.reads:
                    future.cancel()

    def collect(self, ids: np.ndarray, number: int = -1) -> RawBatch:
        """Fetches one batch now (misses in parallel on the pool), outside the look-ahead."""
        return self.receive(self.submit(ids, number))

    def submit(self, ids: np.ndarray, number: int) -> _Pending:
        """Starts fetching one batch (hits now, misses on the pools); :meth:`receive` waits for it."""
        fetcher = self.fetcher
        kind = None
        decoded = np.zeros(len(ids), dtype=bool)
        claimed = np.zeros(0, dtype=np.int64)
        if fetcher.decoded is not None:
            decoded = fetcher.decoded_ready(ids)
            rest = np.unique(ids[~decoded])
            claimed = rest[fetcher.claim(rest)] if len(rest) else rest
            kind = np.full(len(ids), ENCODED, dtype=np.int8)
            kind[decoded] = DECODED
            kind[np.isin(ids, claimed)] = DECODE_KEEP
        hit = fetcher.cached(ids) & ~decoded
        misses = np.unique(ids[~hit & ~decoded])  # a padded batch may repeat a sample: read once
        # Bytes bound for the decoded tier are not admitted into the encoded one as well.
        admit = (lambda part: ~np.isin(part, claimed)) if len(claimed) else (lambda part: None)
        reads = []
        if self.peers is not None and len(misses):
            # Those another node holds: one read a node, on the peers' pool (its chain asks the
            # local tier first, unless Disk(peers_first=True)).
            nodes = self.peers.remote(misses)
            for node in np.unique(nodes[nodes >= 0]).tolist():
                wanted = misses[nodes == node]
                reads.append((wanted, self.peer_pool.submit(fetcher.read, wanted, admit(wanted), self.peers)))
            misses = misses[nodes < 0]
        for part in self._parts(misses):
            reads.append((part, self.pool.submit(fetcher.read, part, admit(part))))  # no node holds these
        return _Pending(ids, hit, reads, kind, number)

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

    def receive(self, pending: _Pending) -> RawBatch:
        """The batch :meth:`submit` started, once its reads are done (skipping or raising as
        ``on_error`` says for samples that cannot be read)."""
        ids, hit = pending.ids, pending.hit
        got: dict[int, np.ndarray | None] = {}
        errors: dict[int, SampleError] = {}
        for part, future in pending.reads:
            data, failed = self._result(future)
            got.update(zip(part.tolist(), data))
            errors.update(failed)
        kind = pending.kind
        out = self.fetcher.merge(ids, hit, got, None if kind is None else kind == DECODED)
        if errors:
            if kind is not None:
                self.fetcher.abort(np.array(sorted(errors), dtype=np.int64))  # their claims, if any
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
            kind = kind[keep] if kind is not None else None
        ids = np.ascontiguousarray(ids, dtype=np.int64)  # DALI takes only dense arrays
        return RawBatch(ids, out, self.labels[ids], kind=kind, number=pending.number)

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
    """A batch whose misses are being read: its ids, which were cached, the reads of the rest
    (each a part of the misses and the future of its bytes and failures), and its kinds."""

    ids: np.ndarray
    hit: np.ndarray
    reads: list[tuple[np.ndarray, cf.Future]]
    kind: np.ndarray | None = None  # how each sample reaches pre-processing (RawBatch.kind)
    number: int = -1  # RawBatch.number


class Stopped(Exception):
    """The consumer went away while a read was outstanding."""
