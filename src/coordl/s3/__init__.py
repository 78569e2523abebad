"""Datasets in an S3-compatible object store: ``s3://bucket/prefix`` roots behind the node's cache.

- :mod:`~coordl.s3.url`: pure: what an ``s3://`` URL names (bucket, key).
- :mod:`~coordl.s3.client`: this process's clients and their settings, from the standard AWS
  configuration (environment, profiles, instance roles; ``AWS_ENDPOINT_URL`` for MinIO or Ceph),
  and what a store's refusal means (:func:`~coordl.s3.client.classify`).
- :mod:`~coordl.s3.listing`: the index of a prefix by ImageFolder's rules over keys, and the
  sizes and ETags of a list of URLs (boto3: the control plane).
- :mod:`~coordl.s3.reads`: the only code that reads objects: many GETs in flight, each checked
  against the index's size and ETag, into the caller's buffers (obstore: the data plane).

The index (:mod:`coordl.index`) lists through :mod:`~coordl.s3.listing`; the fetcher reads through
:mod:`coordl.fetch.samples`, which sends an object store's samples to :mod:`~coordl.s3.reads`.
Everything above them (the cache, peers, HP groups, both backends, resume, DS-Analyzer) sees
sample ids and bytes, as with local files. Needs ``pip install coordl[s3]`` (boto3, obstore).
"""
