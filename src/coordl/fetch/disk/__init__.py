"""The node's local-storage tier: samples of a dataset that lies elsewhere (``s3://``, a network
file system, another device), kept in a folder on local storage once read, for every later epoch,
job and run of the node.

CoorDL's own architecture ("if the data resides on a remote storage service, it is cached in local
storage when first accessed"), under the MinIO policy: what enters stays, the tier is filled once,
and it is never evicted (``coordl cache clean --disk PATH`` empties it). It lies under the memory
cache: a sample the memory cache misses is read from here when it is here, else from another node's
memory or the store and then written here, off the training path, by this process's writer thread.

Layout of the folder ``<path>/coordl-disk-<uid>/`` (0700): one file per sample (0600), named by the
SHA-256 of the sample's path (``ab/cd/abcd...``), holding a header and the sample's bytes;
``ledger``, what the tier takes on disk, its budget and its writers' reservations; ``users``, which
every process using the tier holds a shared ``flock`` on (``coordl cache clean --disk`` and
``verify`` act only on a tier nobody holds; a process that gets it alone knows every other writer
is gone); ``tmp/``, files being written. Two datasets that read the same objects share their entries.

How the parts fit:

- :mod:`.folder`: where the tier lives and whose it is: made exclusively and privately, opened
  without following links, checked with ``fstat``; another user's folder turns the tier off.
- :mod:`.entries`: one sample's file: its name, header and the checks a reader makes.
- :mod:`.stamps`: which version of a sample an entry holds (:func:`stamp`, :func:`keys`).
- :mod:`.ledger`: what the tier takes on disk (blocks, not bytes), the budget, the floor it keeps
  free on its file system, and the reservations of live and dead writers.
- :mod:`.tier`: :class:`DiskTier`, a process's attachment: reads, and the writer that fills the tier
  and replaces damaged and stale entries.
- :mod:`.link`: :class:`~coordl.fetch.disk.link.DiskLink`, the tier as a link of the fetcher's chain
  (:mod:`coordl.fetch.chain`): what it reads, and what its writer takes (from the store and peers).
- :mod:`.opening`: :func:`spec_for` and :class:`DiskSpec`, how a loader and its workers open it.
- :mod:`.upkeep`: ``coordl cache ls / clean / verify --disk``.
"""

from coordl.fetch.disk.entries import HEADER
from coordl.fetch.disk.folder import ForeignFolderError, tier_folder
from coordl.fetch.disk.ledger import FLOOR_FRACTION, FLOOR_MIN, Usage
from coordl.fetch.disk.opening import DiskSpec, spec_for
from coordl.fetch.disk.stamps import keys, stamp
from coordl.fetch.disk.tier import DiskTier
from coordl.fetch.disk.upkeep import Report, describe, remove, verify

__all__ = [
    "FLOOR_FRACTION",
    "FLOOR_MIN",
    "HEADER",
    "DiskSpec",
    "DiskTier",
    "ForeignFolderError",
    "Report",
    "Usage",
    "describe",
    "keys",
    "remove",
    "spec_for",
    "stamp",
    "tier_folder",
    "verify",
]
