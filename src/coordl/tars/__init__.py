"""Datasets in tar shards, WebDataset's format: which shards, and the index of their samples.

A shard is a POSIX tar file (ustar, GNU or pax). A sample is WebDataset's group of consecutive
members whose names share a key: the member's path up to the first dot of its file name, so
``a/000123.jpg`` and ``a/000123.cls`` are the sample ``a/000123`` (members with no dot in their
file name, and directories, are not samples' members). A sample's image is its member with the
first extension of :data:`IMAGE_EXTENSIONS` it has (the ones DALI decodes); its label is the
integer, as text, of its ``.cls`` member, or what a function of its other members returns.

Indexing reads the tar headers and nothing else, except the members a label is made of: one
positioned read of :data:`WINDOW` bytes per member that is larger than the window (the window
after a member holds the next headers and small members). The index holds, per sample, its
shard, where its image's bytes start in the shard and how many there are, so a sample is one
positioned read (:func:`coordl.fetch.storage.read_ranges`). Its path, in messages and in DALI's
``source_info``, is ``<shard>:<member>``.
"""

from coordl.tars.format import IMAGE_EXTENSIONS, JSON, scan_shard
from coordl.tars.scan import index, made_from
from coordl.tars.shards import Shards, expand, is_tar_data, shard_list

__all__ = [
    "IMAGE_EXTENSIONS",
    "JSON",
    "Shards",
    "expand",
    "index",
    "is_tar_data",
    "made_from",
    "scan_shard",
    "shard_list",
]
