"""The data of a node's cache: a logical byte space in chunk files, mapped, and reserved a slice at a
time within the shm filesystem's headroom and the memory limit's margin.

The space ``[0, budget)`` is cut into chunks of the header's ``chunk_bytes``, each a file
created at its full size, sparse, when the allocation first reaches it, and reserved with
``posix_fallocate`` a slice of ``slice_bytes`` at a time as it fills. Slices are reserved whole
and in order, so the reserved space always ends at the first slice boundary at or after the
header's ``alloc``; a byte is handed out only once reserved, so no write touches an unreserved
page (a ``SIGBUS`` on a full tmpfs).

Before each slice the shm filesystem must keep its :func:`headroom` free and the tightest memory
limit (:mod:`coordl.shm.limits`) its margin: shared memory counts against a container's or a
job's memory limit and cannot be reclaimed. When either runs short, the space is ``full`` and
the cache stops growing; so it does when another user made a file at the name of its next chunk
first (:mod:`coordl.shm.own`: that file is left alone). :class:`Chunks` holds the mappings; the
header fields it reads and advances (``chunk_bytes``, ``slice_bytes``, ``budget``, ``alloc``,
``num_chunks``, ``full``) live in the cache's shared table (:mod:`coordl.fetch.cache`), changed under its lock.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os

import numpy as np

from coordl.errors import warn
from coordl.shm import limits, own, segment
from coordl.units import format_bytes

__all__ = ["Chunks", "close_maps", "headroom", "memory_text"]


def headroom(total: int) -> int:
    """Bytes of the shm filesystem that coordl never takes, for PyTorch's and DALI's own use.

    10% of the filesystem, at least 64 MiB and at most 1 GiB.
    """
    return min(1 << 30, max(64 << 20, total // 10))


def memory_text(level: limits.Level) -> str:
    """A memory limit for messages: ``the memory limit of 631.2 MB (cgroup /a (v1): ...)``."""
    return (
        f"the memory limit of {format_bytes(level.limit)} ({level.name}: {format_bytes(level.used)} in use, "
        f"{format_bytes(level.margin)} kept free for the processes' own memory)"
    )


class Chunks:
    """One process's mappings of a cache's chunk files, and the reservation of their slices.

    Args:
        header: the cache table's shared header (a numpy record).
        path: ``path(k)`` is chunk ``k``'s file.
        directory: the shm directory (its free space is checked before each slice).
    """

    def __init__(self, header, path, directory: str):
        self.header = header
        self.path = path
        self.directory = directory
        self._maps: dict[int, mmap.mmap] = {}
        self._rw: dict[int, np.ndarray] = {}  # the chunks as arrays, writable and read-only
        self._ro: dict[int, np.ndarray] = {}
        self._warned_full = False

    # -- the bytes -------------------------------------------------------------------------
    def views(self, offsets: np.ndarray, lengths: np.ndarray) -> list[np.ndarray]:
        """Read-only uint8 arrays of the items at ``offsets`` (int64, with their ``lengths``): a
        view into shared memory each, a copy only for the rare item that spans two chunks."""
        step = int(self.header["chunk_bytes"])
        chunks, starts = np.divmod(offsets, step)
        ends = starts + lengths
        arrays = {k: self._array(k, writable=False) for k in np.unique(chunks).tolist()}
        out = [arrays[k][a:b] for k, a, b in zip(chunks.tolist(), starts.tolist(), ends.tolist())]
        for j in np.flatnonzero(ends > step).tolist():  # spans a chunk boundary: one copy
            parts = self.writable(int(offsets[j]), int(lengths[j]))
            out[j] = np.concatenate(parts)
            out[j].flags.writeable = False
        return out

    def writable(self, offset: int, length: int) -> list[np.ndarray]:
        """Writable views of ``[offset, offset + length)``: one per chunk it lies in."""
        step = int(self.header["chunk_bytes"])
        parts = []
        while length:
            k, start = divmod(offset, step)
            n = min(length, step - start)
            parts.append(self._array(k, writable=True)[start : start + n])
            offset += n
            length -= n
        return parts

    def _array(self, k: int, *, writable: bool) -> np.ndarray:
        """Chunk ``k`` as a uint8 array (made once per chunk and kind)."""
        arrays = self._rw if writable else self._ro
        a = arrays.get(k)
        if a is None:
            a = np.frombuffer(self._map(k), dtype=np.uint8)
            if not writable:
                a.flags.writeable = False
            arrays[k] = a
        return a

    def _map(self, k: int) -> mmap.mmap:
        m = self._maps.get(k)
        if m is None:
            fd = own.open_own(self.path(k))
            try:
                m = segment.map_fd(fd, self.size(k))
            finally:
                os.close(fd)
            self._maps[k] = m
        return m

    def size(self, k: int) -> int:
        """Bytes of chunk ``k`` (the last one ends at the budget)."""
        step = int(self.header["chunk_bytes"])
        return min(step, int(self.header["budget"]) - k * step)

    # -- the reservation: under the table's lock -------------------------------------------------
    def reserved(self) -> int:
        """End of the reserved logical space: the first slice boundary at or after ``alloc``."""
        step, piece = int(self.header["chunk_bytes"]), int(self.header["slice_bytes"])
        k, off = divmod(int(self.header["alloc"]), step)
        if off == 0:
            return k * step
        return k * step + min(-(-off // piece) * piece, self.size(k))

    def reserve_until(self, end: int) -> int:
        """Reserves slices (making chunks as they are reached) until ``[0, end)`` is all reserved,
        or the room runs out (then ``full`` is set); returns where the reserved space ends."""
        h = self.header
        step, piece = int(h["chunk_bytes"]), int(h["slice_bytes"])
        reserved = self.reserved()
        while reserved < end:
            k, off = divmod(reserved, step)
            n = min(piece, self.size(k) - off)
            if not self._room_for(n):
                h["full"] = 1
                break
            if k == int(h["num_chunks"]):
                if not self._create(k):
                    h["full"] = 1
                    break
                h["num_chunks"] += 1
            if not self._reserve_slice(k, off, n):
                h["full"] = 1
                break
            reserved += n
        return reserved

    def _room_for(self, n: int) -> bool:
        """Whether ``n`` more bytes leave the shm headroom and the memory limit's margin free."""
        space = segment.space(self.directory)
        if space.free - n < headroom(space.total):
            self._warn_full(f"only {format_bytes(space.free)} of {self.directory} is free")
            return False
        # The slice's pages are charged to this process's memory cgroup when reserved, and cannot
        # be reclaimed: a cgroup past its limit gets a process killed. A few small files read,
        # once a slice (8 MiB by default), never per sample.
        level = limits.tightest()
        if level is not None and n > level.room:
            self._warn_full(f"{memory_text(level)} is near")
            return False
        return True

    def _create(self, k: int) -> bool:
        """Makes chunk ``k``'s file at its full size, sparse: it takes no memory until reserved.
        False when another user made a file at its name first (left alone: the cache stops growing)."""
        path = self.path(k)
        try:
            try:
                fd = own.create_exclusive(path)
            except FileExistsError:
                # Ours, left by a creator that died before recording it; we hold the table lock.
                os.unlink(path)
                fd = own.create_exclusive(path)
        except own.ForeignFileError as e:
            found = "; ".join(map(str, e.found))
            self._warn_full(
                f"{found} is at the name of its next chunk (coordl leaves it alone; remove it with `rm` as its "
                "owner or root)"
            )
            return False
        try:
            size = self.size(k)
            os.ftruncate(fd, size)
            self._maps[k] = segment.map_fd(fd, size)
        finally:
            os.close(fd)
        return True

    def _reserve_slice(self, k: int, offset: int, n: int) -> bool:
        fd = own.open_own(self.path(k))
        try:
            segment.reserve(fd, n, offset=offset)
        except OSError as e:
            if e.errno != errno.ENOSPC:
                raise
            self._warn_full(f"{self.directory} is full")
            return False
        finally:
            os.close(fd)
        return True

    def _warn_full(self, why: str) -> None:
        if not self._warned_full:
            self._warned_full = True
            warn(
                f"coordl: the cache stopped growing at {format_bytes(int(self.header['alloc']))} of its "
                f"{format_bytes(int(self.header['budget']))} budget because {why}; further misses are read from "
                "storage."
            )

    def close(self) -> list[mmap.mmap]:
        """Forgets the mappings; returns them, for the cache to close with its table's."""
        maps = list(self._maps.values())
        self._maps.clear()
        self._rw.clear()
        self._ro.clear()
        return maps


def close_maps(maps: list[mmap.mmap]) -> None:
    """Closes mappings a caller may still view: such a mapping then lives until the view is dropped."""
    for m in maps:
        with contextlib.suppress(BufferError):
            m.close()
