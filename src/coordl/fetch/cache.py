"""The node's cache: raw encoded samples in shared memory, admitted until full, never evicted (the
MinIO policy of the CoorDL paper).

One cache per dataset per node, shared by every process that opens it (ranks,
workers, other jobs). Layout, all in the shm directory under the dataset's
fingerprint (see :mod:`coordl.shm.names`):

- ``table``: a :data:`HEADER` then one :data:`ENTRY` per sample of the index.
- ``chunk.<k>``: the data, a logical byte space ``[0, budget)`` cut into chunks of
  ``chunk_bytes`` (:data:`DEFAULT_CHUNK_BYTES`), reserved ``slice_bytes``
  (:data:`DEFAULT_SLICE_BYTES`) at a time as it fills (:mod:`coordl.fetch.chunks`). An item
  occupies ``[offset, offset + length)`` of that space, possibly across a chunk boundary,
  so that no byte of the budget is wasted; it is handed out only once all of its bytes
  are reserved, so no write ever touches an unreserved page (a ``SIGBUS`` on a full tmpfs).

An entry goes ``EMPTY -> WRITING -> READY`` and never back from ``READY``: a
published item is immutable and readers only look at ``READY`` entries, so no
reader sees a half-written item. Allocation and state changes happen under a
``flock`` on the table. An entry left ``WRITING`` by a killed process keeps its
reserved bytes; whoever next attaches alone resets it to ``EMPTY`` and the next
storage read of that sample refills the same bytes.

The cache takes memory only as it fills, a slice at a time, and checks before each slice
that the shm filesystem keeps its headroom and that the tightest memory limit keeps its
margin (:mod:`coordl.fetch.chunks`). When either runs short the cache stops growing
(``full``) and further misses are read from storage without being admitted. Slices are
small so that the check follows the processes' own memory while it still grows (a
pipeline's first batches) and the cache overshoots by at most one slice.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import mmap
import os

import numpy as np

from coordl.errors import SharedMemoryError, StaleStateError
from coordl.fetch.chunks import Chunks, close_maps
from coordl.shm import group, own, segment
from coordl.threads import OwnedLock

__all__ = ["ENTRY", "HEADER", "NodeCache", "table_bytes"]

log = logging.getLogger(__name__)

MAGIC = b"COORDLC1"
VERSION = 2  # 2: chunks are sparse and reserved a slice at a time (slice_bytes)
HEADER = np.dtype(
    [
        ("magic", "S8"),
        ("version", "<u4"),
        ("full", "<u4"),
        ("num_items", "<u8"),
        ("budget", "<u8"),
        ("chunk_bytes", "<u8"),
        ("slice_bytes", "<u8"),  # reserved (and checked against the limits) this much at a time
        ("alloc", "<u8"),  # next free byte of the logical space
        ("num_chunks", "<u8"),
        ("resident_bytes", "<u8"),  # bytes of READY items
        ("resident_items", "<u8"),
        ("dataset", "S32"),  # the index fingerprint, checked on attach
    ]
)
HEADER_BYTES = 128
ENTRY = np.dtype([("offset", "<u8"), ("length", "<u4"), ("state", "<u4")])
EMPTY, WRITING, READY = 0, 1, 2
NO_OFFSET = np.uint64(2**64 - 1)
# A new cache's layout, recorded in its header (attaching processes follow the header); read at
# construction, so a test patches these to get small chunks.
DEFAULT_CHUNK_BYTES = 64 << 20
DEFAULT_SLICE_BYTES = 8 << 20
assert HEADER.itemsize <= HEADER_BYTES and ENTRY.itemsize == 16


def table_bytes(num_items: int, entry_bytes: int = ENTRY.itemsize) -> int:
    """Shared memory taken by the cache table of ``num_items`` samples, in whole pages."""
    page = mmap.PAGESIZE
    return -(-(HEADER_BYTES + num_items * entry_bytes) // page) * page


class NodeCache:
    """A node-wide cache of one dataset's raw samples (the MinIO policy: no eviction).

    Args:
        fingerprint: names the shared segments (the loader derives it from the dataset and the user).
        sizes: bytes of every sample, in index order.
        budget: bytes the cache may hold (see :func:`~coordl.fetch.budget.resolve_budget`). Used only by
            the process that creates the cache; later processes use the existing one.
        keep: keep the segments after the last user leaves, so the next run starts warm.
        directory: the shm directory.
        dataset: the index fingerprint, recorded in and checked against the table.
        min_size: the smallest item there can be (default: the smallest of ``sizes``); once less
            than this is left of the budget, the cache is full.

    The creator lays the cache out in chunks of :data:`DEFAULT_CHUNK_BYTES`, reserved
    :data:`DEFAULT_SLICE_BYTES` at a time (recorded in the table's header, which later processes
    follow). Before each slice is reserved, the tightest memory limit
    (:func:`coordl.shm.limits.tightest`) is read again: a slice that would take more than the
    room the limit leaves is not reserved, and the cache stops growing, so that the kernel never
    kills the job.

    Raises:
        ForeignFileError: a file at one of the cache's names is not this user's own private file
            (:mod:`coordl.shm.own`); nothing of the cache was read, and the caller goes on without it.
    """

    MAGIC = MAGIC
    ENTRY_DTYPE = ENTRY  # a subclass may add fields after these three

    def __init__(
        self,
        fingerprint: str,
        sizes: np.ndarray,
        budget: int,
        *,
        keep: bool = False,
        directory: str,
        dataset: str | None = None,
        min_size: int | None = None,
    ):
        self.fingerprint = fingerprint
        self.dataset = dataset or fingerprint
        self.directory = directory
        self._index_sizes = np.asarray(sizes, dtype=np.uint64)
        self._num = len(self._index_sizes)
        self._sizes = self._index_sizes  # the table's own lengths once it is mapped
        if min_size is None:
            min_size = int(self._index_sizes.min()) if self._num else 1
        self._min_size = max(1, int(min_size))
        self._keep = keep
        self._tlock = OwnedLock()  # see coordl.threads.OwnedLock: closing on SIGTERM
        self._table_fd: int | None = None
        self._table: mmap.mmap | None = None
        self._data: Chunks | None = None  # the chunks, mapped once the table is
        self._header = None
        self._final = (0, 0, 0)
        self._pid = os.getpid()  # a forked child's copy must not use or release this attachment
        self._group = group.Membership(fingerprint, directory)
        # Read when called, not bound as defaults: the module's constants are the one place they are set.
        chunk, piece = DEFAULT_CHUNK_BYTES, min(DEFAULT_SLICE_BYTES, DEFAULT_CHUNK_BYTES)
        self._group.join(lambda alone: self._setup(alone, budget, chunk, piece))

    # -- attach ----------------------------------------------------------------------
    def _setup(self, alone: bool, budget: int, chunk_bytes: int, slice_bytes: int) -> None:
        path = self._group.path("table")
        size = HEADER_BYTES + self._num * self.ENTRY_DTYPE.itemsize
        fd, created = own.open_or_create(path)
        try:
            if not created and not self._valid(fd, size):
                if not alone:
                    raise StaleStateError(
                        f"{path} belongs to another version or another index of this dataset and "
                        "is in use; close the other jobs or run `coordl cache clean`"
                    )
                log.warning("coordl: replacing stale cache state in %s", path)
                os.close(fd)
                group.remove_group(self.fingerprint, self.directory, keep_locks=True)
                fd = own.create_exclusive(path)
                created = True
            if created:
                self._create_table(fd, size, budget, chunk_bytes, slice_bytes)
            else:
                self._map_table(fd, size)
                if alone:
                    self._recover()
        except BaseException:
            self._unmap()
            self._table_fd = None
            with contextlib.suppress(OSError):
                os.close(fd)
            raise
        self._table_fd = fd
        if self._keep:
            os.close(own.open_or_create(self._group.path("keep"))[0])

    def _create_table(self, fd: int, size: int, budget: int, chunk_bytes: int, slice_bytes: int) -> None:
        try:
            segment.reserve(fd, size)
        except OSError as e:
            if e.errno == errno.ENOSPC:
                raise SharedMemoryError(
                    f"no space in {self.directory} for the cache table ({size} bytes); "
                    "free it up, enlarge it, or pass cache=0"
                ) from None
            raise
        self._map_table(fd, size)
        h = self._header
        h["version"] = VERSION
        h["num_items"] = self._num
        h["budget"] = budget
        h["chunk_bytes"] = chunk_bytes
        h["slice_bytes"] = slice_bytes
        h["dataset"] = self.dataset.encode()
        self._entries["offset"] = NO_OFFSET
        self._entries["length"] = self._index_sizes
        # Magic last: a table without it was not finished and is replaced.
        h["magic"] = self.MAGIC

    def _valid(self, fd: int, size: int) -> bool:
        if os.fstat(fd).st_size != size:
            return False
        head = np.frombuffer(os.pread(fd, HEADER.itemsize, 0), dtype=HEADER)[0]
        return (
            head["magic"] == self.MAGIC
            and head["version"] == VERSION
            and head["num_items"] == self._num
            and head["dataset"] == self.dataset.encode()
        )

    def _map_table(self, fd: int, size: int) -> None:
        self._table_fd = fd
        self._table = segment.map_fd(fd, size)
        self._header = np.frombuffer(self._table, dtype=HEADER, count=1)[0]
        entries = np.frombuffer(self._table, dtype=self.ENTRY_DTYPE, offset=HEADER_BYTES)
        self._entries = entries
        self._state = entries["state"]
        self._offset = entries["offset"]
        self._sizes = entries["length"]  # shared: the decoded tier writes an item's length when it has one
        self._data = Chunks(self._header, lambda k: self._group.path("chunk", k), self.directory)

    def _recover(self) -> None:
        """Alone on attach: undo what killed processes left half-done."""
        stale = np.flatnonzero(self._state == WRITING)
        if len(stale):
            log.info("coordl: reclaiming %d cache entries left half-written by a dead process", len(stale))
            self._state[stale] = EMPTY
        # A chunk file past num_chunks is one whose creator died before recording it (the group was
        # joined: no file at its names is another user's).
        k = int(self._header["num_chunks"])
        while os.path.lexists(self._group.path("chunk", k)) and own.foreign(self._group.path("chunk", k)) is None:
            os.unlink(self._group.path("chunk", k))
            k += 1

    # -- reading ---------------------------------------------------------------------
    @property
    def keep(self) -> bool:
        """Whether the segments outlive the last user (``Cache(keep=True)``)."""
        return self._keep

    @property
    def budget(self) -> int:
        return int(self._header["budget"]) if self._header is not None else self._final[0]

    @property
    def resident_bytes(self) -> int:
        """Bytes of the samples in the cache (as last seen, after :meth:`close`)."""
        return int(self._header["resident_bytes"]) if self._header is not None else self._final[1]

    @property
    def resident_items(self) -> int:
        return int(self._header["resident_items"]) if self._header is not None else self._final[2]

    def ready_mask(self, ids: np.ndarray) -> np.ndarray:
        """Which of ``ids`` are published in the cache (vectorised, no locks)."""
        return self._state[ids] == READY

    def get(self, i: int) -> np.ndarray | None:
        """The raw bytes of sample ``i`` as a read-only uint8 array, or None on a miss."""
        if self._state[i] != READY:
            return None
        return self.views(np.array([i]))[0]

    def views(self, ids: np.ndarray) -> list[np.ndarray]:
        """Read-only uint8 arrays of the bytes of ``ids``, which must all be published
        (:meth:`ready_mask`): a view into shared memory each, a copy only for the rare item
        that spans two chunks."""
        return self._data.views(self._offset[ids].astype(np.int64), self._sizes[ids].astype(np.int64))

    # -- writing ---------------------------------------------------------------------
    @contextlib.contextmanager
    def _locked(self):
        if os.getpid() != self._pid:
            # flock belongs to the open file, which a forked child shares: no mutual exclusion.
            raise RuntimeError("a NodeCache attachment was inherited by a forked process; attach a new one there")
        with self._tlock:
            fcntl.flock(self._table_fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(self._table_fd, fcntl.LOCK_UN)

    def reserve_many(self, ids: np.ndarray) -> list[list[np.ndarray] | None]:
        """Claims the samples ``ids`` (distinct) for writing, under one lock: for each, writable
        views of its bytes, or None when it is cached or being written already, or does not fit
        in the budget (the caller then reads it from storage without caching it). After filling
        the views, call :meth:`publish_many` (or :meth:`abort_many` for those that failed).

        Bytes are handed out in the order of ``ids``, consecutively, until the budget or the room
        runs out; an entry that owns bytes already (aborted, reclaimed) reuses them.
        """
        ids = np.asarray(ids, dtype=np.int64)
        out: list[list[np.ndarray] | None] = [None] * len(ids)
        empty = np.flatnonzero(self._state[ids] == EMPTY)
        h = self._header
        if not len(empty) or (h["full"] and (self._offset[ids[empty]] == NO_OFFSET).all()):
            return out
        with self._locked():
            empty = empty[self._state[ids[empty]] == EMPTY]
            owns = self._offset[ids[empty]] != NO_OFFSET
            granted = [empty[owns]]
            new = empty[~owns]
            if len(new) and not h["full"]:
                granted.append(self._allocate_many(ids, new))
            granted = np.concatenate(granted)
            self._state[ids[granted]] = WRITING
            offsets = self._offset[ids[granted]].tolist()
        sizes = self._sizes[ids[granted]].tolist()
        for k, offset, size in zip(granted.tolist(), offsets, sizes):
            out[k] = self._data.writable(offset, size)
        return out

    def _allocate_many(self, ids: np.ndarray, new: np.ndarray) -> np.ndarray:
        """Gives bytes to ``ids[new]`` (entries without any), consecutively from ``alloc``, as
        many as fit; returns the positions in ``ids`` that got them. Under the lock."""
        h = self._header
        start = int(h["alloc"])
        ends = start + np.cumsum(self._sizes[ids[new]].astype(np.int64))
        fit = int(np.searchsorted(ends, self.budget, side="right"))
        if fit:
            reached = self._data.reserve_until(int(ends[fit - 1]))
            fit = int(np.searchsorted(ends[:fit], reached, side="right"))
        if fit:
            self._offset[ids[new[:fit]]] = np.concatenate(([start], ends[: fit - 1]))
            h["alloc"] = int(ends[fit - 1])
        granted = [new[:fit]]
        # Past the first that did not fit, smaller ones may still: one at a time (near the budget's end).
        for k in new[fit:].tolist():
            if h["full"]:
                break
            offset = self._allocate(int(self._sizes[ids[k]]))
            if offset is not None:
                self._offset[ids[k]] = offset
                granted.append(np.array([k]))
        return np.concatenate(granted)

    def _allocate(self, size: int) -> int | None:
        h = self._header
        start = int(h["alloc"])
        end = start + size
        if end > self.budget:
            if self.budget - start < self._min_size:
                h["full"] = 1
            return None
        if self._data.reserve_until(end) < end:
            h["full"] = 1
            return None
        h["alloc"] = end
        return start

    def publish_many(self, ids: np.ndarray) -> None:
        """Marks the samples ``ids`` (distinct, fully written) readable by everyone, under one lock."""
        if not len(ids):
            return
        with self._locked():
            self._state[ids] = READY
            self._header["resident_bytes"] += int(self._sizes[ids].sum())
            self._header["resident_items"] += len(ids)

    def abort_many(self, ids: np.ndarray) -> None:
        """Gives up writing the samples ``ids``; their reserved bytes stay reserved for them."""
        if not len(ids):
            return
        with self._locked():
            self._state[ids] = EMPTY

    # -- leaving ---------------------------------------------------------------------
    def close(self) -> None:
        """Detaches; the last process to leave removes the segments unless ``keep`` was asked."""
        if self._table_fd is None:
            return
        fd, self._table_fd = self._table_fd, None
        self._final = (self.budget, self.resident_bytes, self.resident_items)
        self._unmap()
        os.close(fd)
        if os.getpid() != self._pid:
            self._group.forget()  # the parent's attachment: its lock is the parent's to release
            return
        # The last process to leave decides: Cache(keep=True) keeps the segments (and the marker).
        self._group.leave(remove_if_last=not self._keep)

    def _unmap(self) -> None:
        self._state = self._offset = self._entries = self._header = None
        self._sizes = self._index_sizes
        maps = self._data.close() if self._data is not None else []
        if self._table is not None:
            maps.append(self._table)
        self._data = self._table = None
        close_maps(maps)

    def __del__(self):
        with contextlib.suppress(Exception):
            self.close()
