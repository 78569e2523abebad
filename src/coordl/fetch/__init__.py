"""Raw encoded bytes for sample ids: the node's cache, then a peer's, then storage, and nothing else.

- :mod:`.storage` is the only code that reads the dataset's files.
- :mod:`.cache` is the node's MinIO cache (no eviction) over shared-memory segments.
- :mod:`.fetcher` reads one sample's bytes through the cache and counts where they came from.
- :mod:`.ahead` fetches the next few batches ahead of pre-processing, misses on a thread pool.
- :mod:`.peer`, :mod:`.peer_server` and :mod:`.wire` are the partitioned cache: clients and the
  per-pass group, servers, and their framing.
"""
