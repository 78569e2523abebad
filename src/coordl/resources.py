"""What a loader's passes share: the index, the node's cache, the fetcher, thread pools, peers, the pipeline.

:class:`Resources` is a plain holder with public attributes; passes receive it (never the
loader). :class:`CacheSpec` says how to attach to a node's cache, so the loader, the torch
backend's worker processes and DS-Analyzer open caches the same way.
"""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass

import numpy as np

from coordl import lifecycle
from coordl.fetch.cache import NodeCache
from coordl.fetch.decoded import DecodedTier
from coordl.fetch.fetcher import Fetcher
from coordl.index import Index
from coordl.shm import names, reaper
from coordl.threads import DaemonPool

__all__ = ["CacheSpec", "Resources", "reap_once"]

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


class Resources:
    """The collaborators of a loader's passes, opened once and closed once.

    Attributes:
        index: the dataset.
        cache_spec: how to attach to the node's cache (None: no cache).
        budget: the cache budget asked for, in bytes.
        cache: this process's attachment to the node's cache, or None.
        decoded: this process's attachment to the node's decoded tier, or None.
        fetcher: bytes of samples through the cache.
        io_threads: threads of ``pool`` (0: no pool).
        pool: threads reading misses from storage (DALI backend); daemon threads, so that the
            interpreter's exit never waits for them before ``atexit`` closes the loader.
        peer_pool: threads waiting for other nodes' caches (daemon threads too).
        peers: the partitioned cache (:class:`~coordl.fetch.peer.PeerGroup`), or None.
        prep: the DALI pipeline runner (:class:`~coordl.prep.dali.DaliPrep`), made on the first pass.
        dataloader: the torch backend's ``DataLoader`` over this cache, made on the first pass.
        lender: the resources whose pool and pipeline these borrow (DS-Analyzer's private cache), or None.
    """

    def __init__(
        self,
        index: Index,
        cache_spec: CacheSpec | None,
        budget: int,
        *,
        decoded_spec: CacheSpec | None = None,
        io_threads: int = 0,
        lender: Resources | None = None,
    ):
        self.index = index
        self.cache_spec = cache_spec
        self.budget = budget
        self.cache = cache_spec.open(index.sizes) if cache_spec is not None else None
        try:
            self.decoded = decoded_spec.open(index.sizes) if decoded_spec is not None else None
        except BaseException:
            if self.cache is not None:
                self.cache.close()
            raise
        self.fetcher = Fetcher(index, self.cache, drop_page_cache=self.cache is not None, decoded=self.decoded)
        self.lender = lender  # whose pools and pipeline these resources borrow
        if lender is None:
            self.io_threads = io_threads
            self.pool = (
                DaemonPool(io_threads, thread_name_prefix="coordl-io", initializer=lifecycle.quiet_thread)
                if io_threads
                else None
            )
        else:
            self.io_threads, self.pool = lender.io_threads, lender.pool
        self.peer_pool: DaemonPool | None = None
        self.peers = None
        self.prep = None
        self.dataloader = None
        self.closed = False

    def private(self, budget: int, name: str) -> Resources:
        """Resources with a cold cache of ``budget`` bytes of their own (DS-Analyzer), borrowing
        these resources' thread pool and pipeline."""
        spec = CacheSpec.for_dataset(self.index, budget, private=name) if budget > 0 else None
        return Resources(self.index, spec, budget, lender=self)

    def close(self) -> None:
        """Stops the workers, the threads and the pipeline it owns, and leaves the cache. Idempotent."""
        if self.closed:
            return
        self.closed = True
        self.fetcher.closing.set()  # requests still waiting for an object store give up now
        if self.dataloader is not None:
            it = getattr(self.dataloader, "_iterator", None)  # persistent workers
            shutdown = getattr(it, "_shutdown_workers", None)
            if shutdown is not None:
                shutdown()
            self.dataloader = None
        if self.lender is None:
            if self.peer_pool is not None:
                self.peer_pool.shutdown(wait=True, cancel_futures=True)
            if self.pool is not None:
                self.pool.shutdown(wait=True, cancel_futures=True)
            if self.peers is not None:
                self.peers.close()
            if self.prep is not None:
                self.prep.close()
        if self.decoded is not None:
            self.decoded.close()
        if self.cache is not None:
            self.cache.close()
