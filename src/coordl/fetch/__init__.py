"""Raw encoded bytes for sample ids: the node's tiers walked as a chain, and nothing else.

- :mod:`.chain` is the interface every tier answers (what it holds, a read into a job's buffers,
  what it admits) and one read's state; the memory cache's, the decoded tier's and the peers' links.
- :mod:`.fetcher` walks the chain for a batch's misses and counts where bytes came from
  (:mod:`.counters`).
- :mod:`.storage` is the only code that reads the dataset's files; :mod:`.samples` reads samples
  where the index says they are (files, ``s3://`` objects, tar shards); :mod:`.store` is that as
  the chain's last link, and the pace of its reads.
- :mod:`.cache` is the node's MinIO cache (no eviction) over shared-memory segments;
  :mod:`.decoded` its decoded images; :mod:`.disk` the local-storage tier under them.
- :mod:`.ahead` fetches the next few batches ahead of pre-processing, misses on a thread pool.
- :mod:`.peer`, :mod:`.peer_client`, :mod:`.peer_server` and :mod:`.wire` are the partitioned
  cache: the per-pass group, clients, servers, and their framing.
"""
