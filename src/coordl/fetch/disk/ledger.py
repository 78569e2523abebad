"""The local tier's ledger: what the tier takes on disk, its budget, and the room its writers have
reserved, shared by every process using the tier (the file ``ledger``, changed under a lock).

**What it counts.** ``used`` is what the tier's entries and entry folders take on disk: each
entry's blocks (``st_blocks``: its header and bytes, rounded up to the file system's blocks) as
measured once it is written, and each entry folder's blocks as measured when it is made; not the
samples' bytes. ``coordl cache verify --disk`` counts them again from the folder: ``du -B1`` of
the entry folders.

**Budget and floor.** Before writing an entry, a writer reserves its header and bytes rounded up
to the file system's block (:func:`footprint`), and gets them only when both hold:

- ``used + reserved + n <= budget``, when the tier has a budget in bytes (``Disk(size)``, see
  :meth:`Ledger.open`); ``"auto"`` has no bound of its own: the floor alone bounds it;
- ``f_bavail - reserved - n >= floor``: the file system keeps its floor free, as ``statvfs`` says
  at that moment (what other programs wrote meanwhile, a checkpoint, counts). The floor is
  ``Disk(keep_free)``: by default the larger of :data:`FLOOR_FRACTION` of the file system and
  :data:`FLOOR_MIN` (:func:`floor`).

**Reservations of dead writers.** Each writing process holds a *slot* of the ledger, the record of
its reservations in flight, and proves itself alive by an open-file-description lock on the slot's
bytes (``F_OFD_SETLK``): the kernel drops it when the process ends, whatever killed it, in any pid
namespace. A refused reservation first releases the slots whose lock nobody holds, a process that
takes a slot releases what its last holder left, and a process that opens the tier alone releases
them all. A writer killed between reserving and publishing thus holds its bytes until then, never
for good. The ledger's own lock is such a lock too, on the header's bytes (never ``flock``, which
some file systems map onto the same locks).

**The order of a write**: reserve the estimate; write the file aside; move the reservation into
``used`` as the file's measured blocks (:meth:`Ledger.commit`); link the file into place (taken back
if another process published first). A writer killed between the commit and the link leaves
``used`` one entry too high (never too low: the budget holds) until ``coordl cache verify``.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import struct
from dataclasses import dataclass
from typing import NamedTuple

__all__ = ["FLOOR_FRACTION", "FLOOR_MIN", "HEAD", "SLOT", "SLOTS", "Ledger", "Usage", "floor", "footprint"]

MAGIC = b"coordltl"
VERSION = 2
# The header: magic, version, slots, used (bytes the entries and entry folders take on disk), budget
# (bytes; 0: "auto", no bound but the floor), reserved (by writers, not yet written: the slots' sum).
HEAD = struct.Struct("<8sIIqqq24x")  # 64 bytes
SLOT = struct.Struct("<qq")  # a writer's reservations in flight, and its pid (to show)
SLOTS = 1024  # processes writing into one tier at once (ranks, their workers, other jobs)
SIZE = HEAD.size + SLOTS * SLOT.size
FLOOR_FRACTION = 0.05  # of the tier's file system kept free by Disk(keep_free="auto"), and at least
FLOOR_MIN = 1 << 30  # 1 GiB: room for a checkpoint on a small file system
_FLOCK = "hhqqi4x"  # struct flock: l_type, l_whence, l_start, l_len, l_pid (0 for OFD locks)


@dataclass
class _Head:
    magic: bytes = b""
    version: int = 0
    slots: int = 0
    used: int = 0
    budget: int = 0
    reserved: int = 0

    @property
    def valid(self) -> bool:
        return self.magic == MAGIC and self.version == VERSION and self.slots == SLOTS


class Usage(NamedTuple):
    """What a tier takes on disk (``used``), its budget in bytes (0: ``"auto"``), and the bytes
    writers have reserved and not yet written."""

    used: int
    budget: int
    reserved: int


def footprint(nbytes: int, block: int) -> int:
    """``nbytes`` rounded up to the file system's ``block``: what a file of them takes on disk."""
    return -(-nbytes // block) * block


def floor(keep_free, vfs: os.statvfs_result) -> int:
    """The bytes a tier leaves free on the file system ``vfs`` (``statvfs``) for ``keep_free``:
    ``"auto"`` (the larger of :data:`FLOOR_FRACTION` of it and :data:`FLOOR_MIN`), a float fraction of
    it, or bytes."""
    total = vfs.f_blocks * vfs.f_frsize
    if keep_free == "auto":
        return max(int(FLOOR_FRACTION * total), FLOOR_MIN)
    return int(keep_free * total) if isinstance(keep_free, float) else int(keep_free)


class Ledger:
    """This process's handle on a tier's ledger (the file descriptor ``fd``, opened read-write)."""

    def __init__(self, fd: int):
        self.fd = fd
        self.slot: int | None = None  # the slot this process holds, once it writes
        self._mine = 0  # what this process has reserved (its slot's bytes: only this process changes them)

    # -- opening ----------------------------------------------------------------------------------
    def open(self, size, *, alone: bool, recount) -> None:
        """Makes the ledger when it is new (or of another version: ``recount()`` then gives what the
        folder takes) and sets the budget: a process alone with the tier sets it to its ``size``
        (``"auto"`` or bytes); one that shares it lowers it to its ``size`` when that is smaller,
        and leaves it otherwise. Alone, it also releases every reservation (their writers are gone)."""
        wanted = 0 if size == "auto" else int(size)
        with self.locked():
            h = self._head()
            if not h.valid:
                h = self._fresh(wanted)
                h.used = recount()
            if alone:
                h.reserved = 0
                os.pwrite(self.fd, bytes(SLOTS * SLOT.size), HEAD.size)
            if alone or (wanted and (h.budget == 0 or wanted < h.budget)):
                h.budget = wanted
            self._put(h)

    def claim(self) -> tuple[int | None, bool]:
        """Takes a free slot for this process's reservations: its number (None when all are held),
        and whether its last holder left reservations (then its files in ``tmp/`` are dead too)."""
        for k in range(SLOTS):
            try:
                _lock(self.fd, fcntl.F_OFD_SETLK, fcntl.F_WRLCK, _slot_at(k), SLOT.size)
            except OSError as e:
                if e.errno in (errno.EAGAIN, errno.EACCES):
                    continue  # a live process's
                raise
            with self.locked():
                h = self._head()
                left = self._slot(k)
                h.reserved = max(0, h.reserved - left)
                self._set_slot(k, 0)
                self._put(h)
            self.slot, self._mine = k, 0
            return k, left > 0
        return None, False

    # -- reserving and accounting -----------------------------------------------------------------
    def reserve(self, n: int, keep_free) -> tuple[str | None, list[int]]:
        """Reserves ``n`` bytes for this process's slot: None when granted, else why not (the
        budget, or the floor of ``keep_free``); and the slots of dead writers it released."""
        with self.locked():
            h = self._head()
            why = self._refusal(h, n, keep_free)
            dead = []
            if why is not None:
                dead = self._release_dead(h)
                if dead:
                    why = self._refusal(h, n, keep_free)
            if why is None:
                h.reserved += n
                self._mine += n
                self._set_slot(self.slot, self._mine)
            self._put(h)
        return why, dead

    def commit(self, n: int, actual: int) -> None:
        """Moves a reservation of ``n`` bytes into ``used`` as ``actual`` bytes (its file's blocks)."""
        with self.locked():
            h = self._head()
            h.reserved = max(0, h.reserved - n)
            h.used += actual
            self._mine = max(0, self._mine - n)
            self._set_slot(self.slot, self._mine)
            self._put(h)

    def cancel(self, n: int) -> None:
        """Gives back a reservation of ``n`` bytes that was not written."""
        with self.locked():
            h = self._head()
            h.reserved = max(0, h.reserved - n)
            self._mine = max(0, self._mine - n)
            self._set_slot(self.slot, self._mine)
            self._put(h)

    def add(self, n: int) -> None:
        """Adds ``n`` bytes (negative: takes them away) to ``used``: folders made, entries removed."""
        if n:
            with self.locked():
                h = self._head()
                h.used = max(0, h.used + n)
                self._put(h)

    def usage(self) -> Usage:
        with self.locked():
            h = self._head()
        return Usage(h.used, h.budget, h.reserved)

    def room(self, keep_free) -> int:
        """What the tier may hold now: ``used`` and what the budget and the floor leave."""
        u = self.usage()
        vfs = os.fstatvfs(self.fd)
        free = max(0, vfs.f_bavail * vfs.f_frsize - u.reserved - floor(keep_free, vfs))
        return min(u.used + free, u.budget) if u.budget else u.used + free

    def reconcile(self, used: int) -> tuple[Usage | None, list[tuple[int, int, int]]]:
        """Sets ``used`` and releases every reservation (``coordl cache verify``, alone with the
        tier): what the ledger said before (None: it was unreadable, and is made again), and the
        slots that held reservations (slot, bytes, pid)."""
        with self.locked():
            h = self._head()
            before = Usage(h.used, h.budget, h.reserved) if h.valid else None
            if before is None:
                h = self._fresh(0)
            held = [(k, n, pid) for k, (n, pid) in enumerate(self._slots()) if n]
            h.used, h.reserved = used, 0
            os.pwrite(self.fd, bytes(SLOTS * SLOT.size), HEAD.size)
            self._put(h)
        return before, held

    # -- the file ---------------------------------------------------------------------------------
    @contextlib.contextmanager
    def locked(self):
        """Holds the ledger's lock (an open-file-description lock on the header's bytes)."""
        _lock(self.fd, fcntl.F_OFD_SETLKW, fcntl.F_WRLCK, 0, HEAD.size)
        try:
            yield
        finally:
            _lock(self.fd, fcntl.F_OFD_SETLK, fcntl.F_UNLCK, 0, HEAD.size)

    def _head(self) -> _Head:
        raw = os.pread(self.fd, HEAD.size, 0)
        if len(raw) < HEAD.size:
            return _Head()  # new, or of the first version (16 bytes): made again
        return _Head(*HEAD.unpack(raw))

    def _fresh(self, budget: int):
        """A new ledger of ``budget``, its slots empty."""
        os.ftruncate(self.fd, 0)
        os.ftruncate(self.fd, SIZE)
        return _Head(MAGIC, VERSION, SLOTS, 0, budget, 0)

    def _put(self, h: _Head) -> None:
        os.pwrite(self.fd, HEAD.pack(h.magic, h.version, h.slots, h.used, h.budget, h.reserved), 0)

    def _slot(self, k: int) -> int:
        return SLOT.unpack(os.pread(self.fd, SLOT.size, _slot_at(k)))[0]

    def _set_slot(self, k: int, n: int) -> None:
        os.pwrite(self.fd, SLOT.pack(n, os.getpid() if n else 0), _slot_at(k))

    def _slots(self) -> list[tuple[int, int]]:
        return list(SLOT.iter_unpack(os.pread(self.fd, SLOTS * SLOT.size, HEAD.size).ljust(SLOTS * SLOT.size, b"\0")))

    def _refusal(self, h, n: int, keep_free) -> str | None:
        if h.budget and h.used + h.reserved + n > h.budget:
            return f"it holds its budget of {h.budget} bytes"
        vfs = os.fstatvfs(self.fd)
        keep = floor(keep_free, vfs)
        if vfs.f_bavail * vfs.f_frsize - h.reserved - n < keep:
            return f"its file system would have less than the {keep} bytes free that it keeps (Disk(keep_free))"
        return None

    def _release_dead(self, h) -> list[int]:
        """Releases the reservations of slots whose lock no process holds: their numbers."""
        dead = []
        for k, (n, _) in enumerate(self._slots()):
            if n and k != self.slot and not _held(self.fd, k):
                h.reserved = max(0, h.reserved - n)
                self._set_slot(k, 0)
                dead.append(k)
        return dead


def _slot_at(k: int) -> int:
    return HEAD.size + k * SLOT.size


def _lock(fd: int, cmd: int, kind: int, start: int, length: int) -> bytes:
    return fcntl.fcntl(fd, cmd, struct.pack(_FLOCK, kind, os.SEEK_SET, start, length, 0))


def _held(fd: int, k: int) -> bool:
    """Whether a process (another open file description) holds slot ``k``'s lock."""
    got = _lock(fd, fcntl.F_OFD_GETLK, fcntl.F_WRLCK, _slot_at(k), SLOT.size)
    return struct.unpack(_FLOCK, got)[0] != fcntl.F_UNLCK
