"""Which slots this member's batches still map: its held bits, copy-on-write mappings, and their release.

A consumer that takes a batch holds its slot (bit ``s`` of its ``held`` record), so the
ring does not reuse the slot under it. On the CPU the batch is handed over as a private
(copy-on-write) mapping of the slot; a ``weakref.finalize`` on the mapping clears the
hold when the tensor over it dies. A hold released while the mapping lives is first
unshared with ``MADV_POPULATE_WRITE``: the pages become the mapping's own, so the
caller's tensor never changes when the slot is reused.
"""

from __future__ import annotations

import collections
import mmap
import os
import weakref
from collections.abc import Callable

from coordl.staging.ring import Mutex, Ring

__all__ = ["MADV_POPULATE_WRITE", "Holds", "cow_supported"]

MADV_POPULATE_WRITE = 23  # Linux 5.14+: break copy-on-write sharing of a private mapping in place


def cow_supported(fd: int) -> bool:
    """Whether private mappings of ``fd`` can be unshared in place (``MADV_POPULATE_WRITE``, Linux 5.14+)."""
    try:
        mm = mmap.mmap(fd, mmap.PAGESIZE, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except OSError:
        return False
    try:
        mm.madvise(MADV_POPULATE_WRITE, 0, mmap.PAGESIZE)
        return True
    except (OSError, ValueError):
        return False
    finally:
        mm.close()


class Holds:
    """Member ``me``'s holds. Every method but :meth:`map_private` runs under ``mutex``,
    which the caller takes; a freed mapping takes it itself when it can, else its release
    waits for the next :meth:`apply_freed`."""

    def __init__(self, ring: Ring, me: int, mutex: Mutex):
        self._ring: Ring | None = ring
        self._me = me
        self._mutex = mutex
        self._held: dict[int, tuple[int, weakref.ref | None]] = {}  # slot -> (q, weakref to the mapping)
        self._freed: collections.deque = collections.deque()  # (slot, q) whose mappings were freed
        self._pid = os.getpid()

    def hold(self, slot: int, q: int) -> None:
        """Batch ``q``, in ``slot``, was taken: the slot stays until it is released."""
        me = self._ring.m[self._me]
        me["held"] = int(me["held"]) | (1 << slot)
        self._held[slot] = (q, None)

    def map_private(self, fd: int, stride: int, slot: int, q: int) -> mmap.mmap:
        """A copy-on-write private mapping of held ``slot`` (``stride`` bytes of ``fd``); the
        hold ends when the mapping is freed."""
        mm = mmap.mmap(fd, stride, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE, offset=slot * stride)
        self._held[slot] = (q, weakref.ref(mm))
        weakref.finalize(mm, self._on_freed, slot, q)
        return mm

    def _on_freed(self, slot: int, q: int) -> None:
        # Runs wherever the last reference died (maybe inside our own locked code): queue
        # the release and apply it now only if no thread of this process is in the mutex.
        # Not in a forked child, at its exit: the holds are the parent's (and the mutex's
        # flock, the same open file, would be released under the parent).
        if os.getpid() != self._pid:
            return
        self._freed.append((slot, q))
        if self._ring is None or not self._mutex.try_enter():
            return
        try:
            self.apply_freed()
        finally:
            self._mutex.__exit__(None, None, None)

    def apply_freed(self) -> None:
        """Releases the holds whose mappings were freed since the last call."""
        while self._freed:
            slot, q = self._freed.popleft()
            if self._held.get(slot, (None,))[0] == q:
                self._drop(slot)

    def _drop(self, slot: int) -> None:
        del self._held[slot]
        me = self._ring.m[self._me]
        me["held"] = int(me["held"]) & ~(1 << slot)

    def release(self, slot: int, q: int) -> None:
        """Releases the hold of batch ``q`` on ``slot``, if it still has it."""
        if self._held.get(slot, (None,))[0] == q:
            self._drop(slot)

    def release_where(self, pred: Callable[[int], bool]) -> None:
        """Releases every hold whose batch ``pred`` selects, unsharing a mapping still alive."""
        self.apply_freed()
        for slot, (held_q, ref) in list(self._held.items()):
            if not pred(held_q):
                continue
            mm = ref() if ref is not None else None
            if mm is not None:
                mm.madvise(MADV_POPULATE_WRITE)
            self._drop(slot)

    def close(self) -> None:
        """Forgets the records (the area is detaching); mappings freed later change nothing."""
        self._ring = None
