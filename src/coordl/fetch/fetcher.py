"""The fetcher: sample bytes through the node's tiers, walked as a chain (:mod:`coordl.fetch.chain`):
the memory cache, the decoded tier, the local-storage tier, the other nodes' caches, the store.

:class:`Fetcher` is the only way the rest of coordl gets sample bytes. A miss in memory walks the
links below it in the configured order (the local tier before the peers, unless
``Disk(peers_first=True)``), each reading what it holds of what is still missing; then each tier
admits what it keeps: the memory cache what the local tier and the store read (never a peer's
bytes, so every node keeps the part it filled from storage), the local tier what the store and the
peers delivered. Caching never changes which samples are read, only where their bytes come from.
"""

from __future__ import annotations

import threading

import numpy as np

from coordl.errors import DatasetChangedError, SampleError
from coordl.fetch.cache import NodeCache
from coordl.fetch.chain import DecodedLink, Job, MemoryLink, PeerLink
from coordl.fetch.counters import FetchCounters
from coordl.fetch.disk.link import DiskLink
from coordl.fetch.store import StoreLink
from coordl.index import Index
from coordl.threads import Signal

__all__ = ["FetchCounters", "Fetcher"]


class Fetcher:
    """Reads sample bytes through the node's tiers.

    Args:
        index: the dataset.
        cache: the node's MinIO cache, or None to read storage only.
        drop_page_cache: advise the kernel to drop storage-read pages from the page cache.
        decoded: the node's decoded tier (:class:`~coordl.fetch.decoded.DecodedTier`), or None.
        disk: the node's local-storage tier (:class:`~coordl.fetch.disk.DiskTier`), or None.
    """

    def __init__(self, index: Index, cache: NodeCache | None, *, drop_page_cache: bool, decoded=None, disk=None):
        self.index = index
        self.cache = cache
        self.decoded = decoded
        self.disk = disk
        self.drop_page_cache = drop_page_cache
        self.counters = FetchCounters()
        self.closing = Signal()  # set when the loader closes: reads still waiting for a store end at once
        self._lock = threading.Lock()
        self.memory = MemoryLink(cache)
        self.images = DecodedLink(decoded)
        self.store = StoreLink(index, drop_page_cache=drop_page_cache, stop=self.closing)
        self.local = DiskLink(disk, index) if disk is not None else None

    def chain(self, peers=None) -> list:
        """The links under the memory cache, in the order a miss asks them: the local tier, the other
        nodes' caches (``peers``, a :class:`~coordl.fetch.peer.PeerGroup`), the store; the peers
        before the local tier with ``Disk(peers_first=True)``."""
        links = [self.local] if self.local is not None else []
        if peers is not None:
            links.insert(0 if self.local is None or self.local.peers_first else 1, PeerLink(peers))
        return [*links, self.store]

    def _add(self, counters: FetchCounters) -> None:
        with self._lock:
            self.counters += counters

    def reset_counters(self) -> FetchCounters:
        """Returns the counters so far and starts new ones."""
        with self._lock:
            old, self.counters = self.counters, FetchCounters()
        return old

    def cached(self, ids: np.ndarray) -> np.ndarray:
        """A mask of the ids whose bytes are in the node's cache right now."""
        return self.memory.holds(ids)

    def hits(self, ids: np.ndarray) -> list[np.ndarray]:
        """Read-only views of the bytes of ``ids``, which must all be in the cache (:meth:`cached`)."""
        return self._views(self.memory, ids)

    def _views(self, link, ids: np.ndarray) -> list[np.ndarray]:
        if not len(ids):
            return []
        job = Job(self.index, ids)
        link.read_into(job, np.arange(len(ids)))
        self._add(job.counters)
        return job.data

    # -- the decoded tier ----------------------------------------------------------------------
    def decoded_ready(self, ids: np.ndarray) -> np.ndarray:
        """A mask of the ids whose decoded images are in the node's decoded tier right now."""
        return self.images.holds(ids)

    def all_decoded(self, ids: np.ndarray | None = None) -> bool:
        """Whether every sample of ``ids`` (default: of the dataset) is in the node's decoded tier
        now, and so stays (the tier never evicts): a pass over them needs no decoder."""
        if self.decoded is None:
            return False
        ids = np.arange(len(self.index), dtype=np.int64) if ids is None else np.asarray(ids, dtype=np.int64)
        return bool(len(ids)) and bool(self.decoded.ready_mask(ids).all())

    def decoded_images(self, ids: np.ndarray) -> list[np.ndarray]:
        """Read-only ``(H, W, 3)`` views of the decoded images of ``ids`` (all in the tier)."""
        return self._views(self.images, ids)

    def claim(self, ids: np.ndarray) -> np.ndarray:
        """Claims the distinct ``ids`` for this process to decode into the decoded tier: a mask of
        those it got (none once the tier is full). Each claim ends in :meth:`fill` or :meth:`abort`."""
        return self.decoded.claim_many(ids)

    def fill(self, ids: np.ndarray, images: list[np.ndarray]) -> None:
        """Puts the decoded images of claimed ``ids`` into the decoded tier (those that fit)."""
        counters = FetchCounters()
        self.images.fill(ids, images, counters)
        self._add(counters)

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
        return self.store.pace.ratio()

    def read(
        self, ids: np.ndarray, admit: np.ndarray | None = None, peers=None
    ) -> tuple[list[np.ndarray | None], dict[int, SampleError]]:
        """Reads the samples ``ids`` (distinct) that the memory cache missed, walking the chain below
        it (:meth:`chain`; ``peers``: the partitioned cache to ask, None: none).

        Each link reads what it holds of what is still missing; the memory cache reserves slots for
        what the local tier and the store read, so their bytes land in it, published and returned
        as read-only views; the others are read into one buffer. ``admit`` (a mask) limits the
        memory cache's admission to some of ``ids`` (those bound for the decoded tier stay out).

        Returns:
            the bytes of each of ``ids`` (None for one that failed), and the failures by sample.

        Raises:
            DatasetChangedError: a file's size (an object's size or ETag) is not the index's: the
                index is stale (the other samples are read and published first).
            StoreError: the object store refused the job's credentials (nothing is published).
        """
        job = Job(self.index, ids, admit)
        chain = self.chain(peers)
        try:
            for link in chain:
                ks = job.missing()
                job.asked[ks] |= link.code
                ks = ks[link.holds(job.ids[ks])] if len(ks) else ks
                if len(ks):
                    if link.cached:
                        self.memory.reserve(job, ks)
                    link.read_into(job, ks)
        except BaseException:
            self.memory.abort(job)
            raise
        for link in [self.memory, *chain]:  # memory first: the local tier keeps its views
            link.admit(job)
        self._add(job.counters)
        return self._outcome(job)

    def _outcome(self, job: Job) -> tuple[list[np.ndarray | None], dict[int, SampleError]]:
        """The job's bytes and its failures as :class:`SampleError`, or the stale index's error."""
        errors: dict[int, SampleError] = {}
        changed = None
        for k, e in job.failed.items():
            i = int(job.ids[k])
            if isinstance(e, DatasetChangedError):
                changed = changed or e
            else:
                path = self.index.paths[i]
                errors[i] = SampleError(f"cannot read sample {i} ({path}): {e.strerror or e}", path=path, index=i)
                errors[i].__cause__ = e
        if changed is not None:
            self.index.forget_saved()  # so that the restart the error asks for rescans the tree
            raise changed
        return [d if b else None for d, b in zip(job.data, job.by.tolist())], errors
