"""What a loader's passes share: the index, the node's cache, the fetcher, thread pools, peers, the pipeline.

:class:`Resources` is a frozen record with public attributes, made complete when the first pass
starts; passes receive it (never the loader). :class:`CacheSpec` says how to attach to a node's
cache, so the loader, the torch backend's worker processes and DS-Analyzer open caches the same way.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import hashlib
import logging
import os
from dataclasses import dataclass

import numpy as np

from coordl import compat, lifecycle
from coordl.fetch.cache import NodeCache
from coordl.fetch.decoded import DecodedTier
from coordl.fetch.fetcher import Fetcher
from coordl.index import Index
from coordl.shm import names, reaper

__all__ = ["CacheSpec", "Resources", "reap_once", "thread_pool"]

log = logging.getLogger(__name__)

_reaped: set[str] = set()


def reap_once(directory: str) -> None:
    """Reclaims, once per process and directory, what crashed jobs left in the shm directory."""
    if directory in _reaped:
        return
    _reaped.add(directory)
    try:
        for g in reaper.reap(directory):
            log.info("coordl: removed %d bytes of shared memory left by a dead job (%s)", g.bytes, g.fingerprint)
    except OSError as e:  # an unreadable directory is reported when the cache is opened
        log.debug("coordl: reaping %s failed: %s", directory, e)


@dataclass(frozen=True)
class CacheSpec:
    """How to attach to one node-wide cache (picklable: worker processes attach by themselves)."""

    fingerprint: str
    budget: int
    keep: bool
    directory: str
    dataset: str
    tier: str = "encoded"  # or "decoded": the node's decoded images (a group of its own)

    @classmethod
    def for_dataset(
        cls,
        index: Index,
        budget: int,
        *,
        keep: bool = False,
        private: str = "",
        tier: str = "encoded",
        max_short_side: int | None = None,
    ) -> CacheSpec:
        """The cache of ``index`` for this user (segments are 0600, so two users get one each);
        ``private`` names a cache of its own (DS-Analyzer's cold runs); ``tier="decoded"`` the
        decoded tier beside it, of images capped at ``max_short_side`` when given (another tier:
        other pixels)."""
        key = f"{index.fingerprint}:{os.getuid()}" + (f":{private}" if private else "")
        key += ":decoded" if tier == "decoded" else ""
        key += f":max_short_side={max_short_side}" if tier == "decoded" and max_short_side else ""
        group = hashlib.sha256(key.encode()).hexdigest()[:16]
        return cls(group, int(budget), keep, names.shm_dir(), index.fingerprint, tier)

    def open(self, sizes: np.ndarray) -> NodeCache:
        """Attaches to the cache (creating it if this is its first user)."""
        reap_once(self.directory)
        if self.tier == "decoded":
            return DecodedTier(
                self.fingerprint,
                len(sizes),
                self.budget,
                keep=self.keep,
                directory=self.directory,
                dataset=self.dataset,
                min_size=int(sizes.min()) if len(sizes) else 1,
            )
        return NodeCache(
            self.fingerprint, sizes, self.budget, keep=self.keep, directory=self.directory, dataset=self.dataset
        )


@dataclass(frozen=True)
class Resources:
    """The collaborators of a loader's passes, made complete in one place when its first pass
    starts (the job's world is known then), and closed once.

    Attributes:
        index: the dataset.
        cache: this process's attachment to the node's cache, or None (the loader's: it closes it).
        decoded: this process's attachment to the node's decoded tier, or None (the loader's too).
        cache_spec: how the torch backend's worker processes attach to the node's cache (None: no cache).
        fetcher: bytes of samples through the cache.
        io_threads: threads of ``pool``.
        pool: threads reading misses from storage (DALI backend), or None.
        peers: the partitioned cache (:class:`~coordl.fetch.peer.PeerGroup`), or None.
        peer_pool: threads waiting for other nodes' caches, or None.
        prep: the DALI pipeline runner (:class:`~coordl.prep.dali.DaliPrep`), or None.
        dataloader: the torch backend's ``DataLoader`` over the node's cache, or None.
    """

    index: Index
    cache: NodeCache | None
    decoded: DecodedTier | None
    cache_spec: CacheSpec | None
    fetcher: Fetcher
    io_threads: int = 0
    pool: cf.ThreadPoolExecutor | None = None
    peers: object = None
    peer_pool: cf.ThreadPoolExecutor | None = None
    prep: object = None
    dataloader: object = None

    def with_cache(self, cache: NodeCache | None) -> Resources:
        """These resources over another cache (DS-Analyzer's cold, private one): the same pools and
        pipeline, a fetcher of its own, no decoded tier and no peers. Closing them is the caller's:
        its cache, not these resources."""
        fetcher = Fetcher(self.index, cache, drop_page_cache=cache is not None)
        return dataclasses.replace(self, cache=cache, decoded=None, fetcher=fetcher, peers=None)

    def close(self) -> None:
        """Stops the workers, threads and pipeline (the caches are the loader's). Idempotent."""
        self.fetcher.closing.set()  # requests still waiting for an object store give up now
        if self.dataloader is not None:
            compat.shutdown_dataloader_workers(self.dataloader)  # persistent workers
        for pool in (self.peer_pool, self.pool):
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=True)
        if self.peers is not None:
            self.peers.close()
        if self.prep is not None:
            self.prep.close()


def thread_pool(threads: int, name: str) -> cf.ThreadPoolExecutor:
    """A pool of ``threads`` threads named ``name``, which never take the process's signals."""
    return cf.ThreadPoolExecutor(threads, thread_name_prefix=name, initializer=lifecycle.quiet_thread)
