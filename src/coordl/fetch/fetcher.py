"""The fetcher: raw encoded bytes of samples from the node's MinIO cache first, then storage.

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
from coordl.fetch import storage
from coordl.fetch.cache import MinIOCache
from coordl.index import Index

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

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


class Fetcher:
    """Reads sample bytes through the cache.

    Args:
        index: the dataset.
        cache: the node's MinIO cache, or None to read storage only.
        drop_page_cache: advise the kernel to drop storage-read pages from the page cache.
    """

    def __init__(self, index: Index, cache: MinIOCache | None, *, drop_page_cache: bool):
        self.index = index
        self.cache = cache
        self.drop_page_cache = drop_page_cache
        self.counters = FetchCounters()
        self._lock = threading.Lock()

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

    def fetch(self, i: int) -> np.ndarray:
        """The raw bytes of sample ``i`` (a read-only view when it comes from the cache).

        Raises:
            SampleError: the file cannot be read (its path and index are attached).
            DatasetChangedError: the file's size is not the index's: the index is stale.
        """
        i = int(i)
        if self.cache is not None:
            hit = self.cache.get(i)
            if hit is not None:
                with self._lock:
                    self.counters.cache_hits += 1
                    self.counters.cache_hit_bytes += len(hit)
                return hit
        return self._from_storage(i)

    def from_peer(self, client, node: int, ids: np.ndarray) -> dict[int, np.ndarray]:
        """The bytes of those of ``ids`` that ``node`` delivers (see :class:`~coordl.fetch.peer.PeerClient`)."""
        t0 = time.perf_counter_ns()
        got = client.fetch(node, ids)
        dt = time.perf_counter_ns() - t0
        with self._lock:
            c = self.counters
            c.peer_ns += dt
            c.peer_reads += len(got)
            c.peer_bytes += sum(len(v) for v in got.values())
        return got

    def _from_storage(self, i: int) -> np.ndarray:
        path, size = self.index.paths[i], int(self.index.sizes[i])
        views = self.cache.reserve(i) if self.cache is not None else None
        t0 = time.perf_counter_ns()
        try:
            if views is None:
                data = storage.read(path, size, drop_page_cache=self.drop_page_cache)
                admitted = False
            else:
                storage.read_into(path, size, views, drop_page_cache=self.drop_page_cache)
                self.cache.publish(i)
                data = self.cache.get(i)
                admitted = True
        except BaseException as e:
            if views is not None:
                self.cache.abort(i)
            if isinstance(e, DatasetChangedError):
                self.index.forget_saved()  # so that the restart the error asks for rescans the tree
            if isinstance(e, OSError):
                raise SampleError(f"cannot read sample {i} ({path}): {e.strerror or e}", path=path, index=i) from e
            raise
        dt = time.perf_counter_ns() - t0
        with self._lock:
            c = self.counters
            c.storage_ns += dt
            c.storage_reads += 1
            c.storage_bytes += size
            c.admitted += admitted
        return data
