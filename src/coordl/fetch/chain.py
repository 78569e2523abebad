"""The tiers as a chain: one read's state (:class:`Job`), the interface every tier answers
(:class:`Link`), and the links of the node's memory cache, its decoded tier and the other nodes.

A tier says which samples it holds (:meth:`Link.holds`), reads those it is given into a job's
buffers (:meth:`Link.read_into`, marking those it served), and once the walk is over keeps what
the other links served (:meth:`Link.admit`): the memory cache what the local tier and the store
read, the local tier what the peers and the store sent. :meth:`Fetcher.read
<coordl.fetch.fetcher.Fetcher.read>` walks the links under the memory cache in the configured
order: the local-storage tier (:class:`~coordl.fetch.disk.link.DiskLink`), the other nodes'
caches (:class:`PeerLink`), the store (:class:`~coordl.fetch.store.StoreLink`); the memory
cache reserves slots for what the disk and the store read, so that their bytes land in it.

The memory cache and the decoded tier serve views of shared memory: their ``read_into`` copies
nothing. The decoded tier's items are images, made by pre-processing: it admits them after
decoding (:meth:`DecodedLink.fill`), not from a walk.
"""

from __future__ import annotations

import time
from typing import Protocol

import numpy as np

from coordl.fetch.counters import FetchCounters

__all__ = [
    "DECODED",
    "DISK",
    "MEMORY",
    "PEERS",
    "STORE",
    "DecodedLink",
    "Job",
    "Link",
    "MemoryLink",
    "PeerLink",
    "copy_into",
]

#: Which link served a sample (:attr:`Job.by`); each is also its bit in :attr:`Job.asked`.
MEMORY, DECODED, DISK, PEERS, STORE = 1, 2, 4, 8, 16


class Job:
    """One read of the samples ``ids`` (distinct): where each one's bytes go and which link served it.

    Attributes:
        sizes: each sample's size (the index's).
        admit: which samples the memory cache may admit (those bound for the decoded tier stay out).
        buffers: per sample, the buffers its bytes are read into (a cache slot's views, or a slice of
            one buffer for the job), once a link is about to read it.
        slot: which buffers are a memory-cache slot (reserved: to be published or aborted).
        data: per sample, its bytes once served (None until then, and for a failure).
        by: the link that served each sample (0: none yet).
        asked: per sample, the bits of the links that were asked whether they hold it.
        found: what the local-storage tier found of each sample it read (ABSENT, GOOD, STALE, DAMAGED).
        failed: the store's failures, by position.
        counters: what this read adds to the fetcher's counters.
    """

    def __init__(self, index, ids: np.ndarray, admit: np.ndarray | None = None):
        self.ids = np.asarray(ids, dtype=np.int64)
        n = len(self.ids)
        self.sizes = index.sizes[self.ids]
        self.admit = np.ones(n, dtype=bool) if admit is None else np.asarray(admit, dtype=bool)
        self.buffers: list[list | None] = [None] * n
        self.slot = np.zeros(n, dtype=bool)
        self.data: list[np.ndarray | None] = [None] * n
        self.by = np.zeros(n, dtype=np.uint8)
        self.asked = np.zeros(n, dtype=np.uint8)
        self.found = np.zeros(n, dtype=np.uint8)  # the local-storage tier's finding (fetch.disk.entries; 0: ABSENT)
        self.failed: dict[int, Exception] = {}
        self.counters = FetchCounters()

    def missing(self) -> np.ndarray:
        """Positions of the samples no link has served yet."""
        return np.flatnonzero(self.by == 0)

    def served(self, ks: np.ndarray, link: int) -> None:
        self.by[ks] = link

    def into(self, ks: np.ndarray) -> list[list]:
        """The buffers of samples ``ks``: those without any get slices of one new buffer."""
        bare = [k for k in ks.tolist() if self.buffers[k] is None]
        if bare:
            ends = np.cumsum(self.sizes[bare])
            buffer = np.empty(int(ends[-1]), dtype=np.uint8)
            for k, a, b in zip(bare, [0, *ends[:-1].tolist()], ends.tolist()):
                self.data[k] = buffer[a:b]
                self.buffers[k] = [self.data[k]]
        return [self.buffers[k] for k in ks.tolist()]


class Link(Protocol):
    """One tier, as a link of the fetcher's chain."""

    code: int  # MEMORY, DECODED, DISK, PEERS or STORE
    cached: bool  # whether the memory cache admits the bytes this link reads

    def holds(self, ids: np.ndarray) -> np.ndarray:
        """A mask of the samples ``ids`` this tier holds now (checked again when read)."""

    def read_into(self, job: Job, ks: np.ndarray) -> None:
        """Reads the samples ``ks`` of ``job`` (positions), marking those it served."""

    def admit(self, job: Job) -> None:
        """Once the walk is over: keeps what the other links served, as this tier's policy says."""


class MemoryLink:
    """The node's MinIO cache (:class:`~coordl.fetch.cache.NodeCache`, or None: no cache)."""

    code, cached = MEMORY, False

    def __init__(self, cache):
        self.cache = cache

    def holds(self, ids: np.ndarray) -> np.ndarray:
        if self.cache is None:
            return np.zeros(len(ids), dtype=bool)
        return self.cache.ready_mask(ids)

    def read_into(self, job: Job, ks: np.ndarray) -> None:
        """Views of the cache's bytes, no copy (``ks`` must all be published)."""
        for k, view in zip(ks.tolist(), self.cache.views(job.ids[ks]) if len(ks) else []):
            job.data[k] = view
        job.served(ks, MEMORY)
        job.counters.cache_hits += len(ks)
        job.counters.cache_hit_bytes += int(job.sizes[ks].sum())

    def reserve(self, job: Job, ks: np.ndarray) -> None:
        """Reserves cache slots for the samples ``ks`` it may admit, to be read into."""
        ks = ks[job.admit[ks] & ~job.slot[ks]]
        if self.cache is None or not len(ks):
            return
        for k, slot in zip(ks.tolist(), self.cache.reserve_many(job.ids[ks])):
            if slot is not None:
                job.buffers[k], job.slot[k] = slot, True

    def admit(self, job: Job) -> None:
        """Publishes the slots whose samples were served, and views them; aborts the others
        (their bytes stay theirs, for the next read)."""
        if not job.slot.any():
            return
        done = np.flatnonzero(job.slot & (job.by != 0))
        if len(done):
            self.cache.publish_many(job.ids[done])
            for k, view in zip(done.tolist(), self.cache.views(job.ids[done])):
                job.data[k] = view
        self.abort(job, np.flatnonzero(job.slot & (job.by == 0)))
        job.counters.admitted += len(done)

    def abort(self, job: Job, ks: np.ndarray | None = None) -> None:
        """Gives up the slots of ``ks`` (default: every slot of the job)."""
        ks = np.flatnonzero(job.slot) if ks is None else ks
        if len(ks):
            self.cache.abort_many(job.ids[ks])
            job.slot[ks] = False


class DecodedLink:
    """The node's decoded tier (:class:`~coordl.fetch.decoded.DecodedTier`, or None): images."""

    code, cached = DECODED, False

    def __init__(self, tier):
        self.tier = tier

    def holds(self, ids: np.ndarray) -> np.ndarray:
        if self.tier is None:
            return np.zeros(len(ids), dtype=bool)
        return self.tier.ready_mask(ids)

    def read_into(self, job: Job, ks: np.ndarray) -> None:
        """Read-only ``(H, W, 3)`` views of the images of ``ks`` (all in the tier), no copy."""
        images = self.tier.images(job.ids[ks]) if len(ks) else []
        for k, image in zip(ks.tolist(), images):
            job.data[k] = image
        job.served(ks, DECODED)
        job.counters.decoded_hits += len(ks)
        job.counters.decoded_hit_bytes += sum(a.nbytes for a in images)

    def admit(self, job: Job) -> None:
        """Nothing from a walk: the tier holds images, which pre-processing makes (:meth:`fill`)."""

    def fill(self, ids: np.ndarray, images: list[np.ndarray], counters: FetchCounters) -> None:
        """Puts the decoded images of claimed ``ids`` into the tier (those that fit)."""
        counters.decoded_admitted += int(np.count_nonzero(self.tier.fill_many(ids, images)))


class PeerLink:
    """The other nodes' memory caches (a :class:`~coordl.fetch.peer.PeerGroup`). Their bytes are not
    admitted into this node's memory cache, so every node keeps the part it filled from the store."""

    code, cached = PEERS, False

    def __init__(self, group):
        self.group = group

    def holds(self, ids: np.ndarray) -> np.ndarray:
        return self.group.remote(ids) >= 0

    def read_into(self, job: Job, ks: np.ndarray) -> None:
        """Asks each node that holds some of ``ks`` for them, one request a node; what a node does
        not deliver is left to the links below."""
        nodes = self.group.remote(job.ids[ks])
        for node in np.unique(nodes[nodes >= 0]).tolist():
            mine = ks[nodes == node]
            t0 = time.perf_counter_ns()
            got = self.group.client.fetch(node, job.ids[mine])
            job.counters.peer_ns += time.perf_counter_ns() - t0
            for k, i in zip(mine.tolist(), job.ids[mine].tolist()):
                data = got.get(i)
                if data is None:
                    continue
                if job.slot[k]:  # a slot reserved before (a damaged local entry): filled, then published
                    copy_into(data, job.buffers[k])
                job.data[k] = data
                job.by[k] = PEERS
                job.counters.peer_reads += 1
                job.counters.peer_bytes += len(data)

    def admit(self, job: Job) -> None:
        """Nothing: a node serves only what it filled itself."""


def copy_into(src: np.ndarray, buffers: list) -> None:
    """Copies the uint8 array ``src`` into ``buffers``, one after the other."""
    at = 0
    for b in buffers:
        b = np.frombuffer(b, np.uint8) if not isinstance(b, np.ndarray) else b
        b[:] = src[at : at + len(b)]
        at += len(b)
