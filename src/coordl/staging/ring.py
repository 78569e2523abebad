"""The ring protocol over a staging area's shared records: join a pass, claim a batch, release lazily.

Batch ``q`` lives in slot ``q % S``. Two counters bound the ring: ``released``
(``R``: every batch before it is gone) and ``frontier`` (``F``: the next batch
nobody has claimed), ``R <= F <= R + S``. A batch is needed while an enrolled member
has ``start <= q`` and ``cursor <= q``; its slot is held while a member's ``held`` bit
for it is set. Every method of :class:`Ring` that changes a record runs under
:class:`Mutex`; the caller takes it.
"""

from __future__ import annotations

import fcntl
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from coordl import lifecycle
from coordl.shm import own
from coordl.staging.layout import CLAIMED, EMPTY, ERROR, READY, TODO, records

__all__ = ["PARKED_PROBE_S", "SLOWER", "Claim", "Mutex", "Ring", "Taken"]

#: How much slower per sample a member a whole ring behind must train to be detached.
SLOWER = 1.25
#: After SIGTERM, how long the closing thread waits for the mutex of a group before it takes it to
#: be held by the parked main thread (:meth:`Mutex.held_by_parked`).
PARKED_PROBE_S = 0.1


@dataclass(frozen=True)
class Claim:
    """The right to produce batch ``q`` into slot ``q % S``."""

    q: int
    token: int


@dataclass
class Taken:
    """A batch handed to a consumer. ``error`` is set for a batch that could not be made."""

    q: int
    slot: int
    n: int
    error: str | None = None
    error_path: str = ""


class Mutex:
    """A lock across processes (``flock`` on the ``mutex`` file) and across this process's threads.

    Nobody of this process goes on without it (unlike :class:`~coordl.threads.OwnedLock`): when
    SIGTERM parked the main thread inside (:func:`coordl.lifecycle.parked`), perhaps half way through
    an edit of the shared records that it never finishes, a thread that waits for it waits until the
    process ends. The closing thread asks :meth:`held_by_parked` instead of waiting, and then
    :meth:`freeze` keeps every other process out until this one has ended."""

    def __init__(self, path: str):
        self._fd, _ = own.open_or_create(path)  # this user's own file, or a ForeignFileError
        self._local = threading.Lock()
        self._owner: int | None = None  # the ident of the thread inside, once it is
        self._frozen = False

    def __enter__(self):
        self._local.acquire()
        self._owner = threading.get_ident()
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
        except BaseException:
            self._owner = None
            self._local.release()
            raise
        return self

    def __exit__(self, *exc):
        self._owner = None
        if not self._frozen:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        self._local.release()

    def try_enter(self) -> bool:
        """Enters unless a thread of this process is inside (then the caller defers)."""
        if not self._local.acquire(blocking=False):
            return False
        self._owner = threading.get_ident()
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
        except BaseException:
            self._owner = None
            self._local.release()
            raise
        return True

    def held_by_parked(self) -> bool:
        """Whether the main thread, parked by SIGTERM, is inside: it never leaves, and what it was
        changing stays as it left it. The main thread may have been stopped between taking the lock
        and saying so: a lock that stays taken for :data:`PARKED_PROBE_S` while the main thread is
        parked is taken to be its (the threads of coordl hold it for microseconds)."""
        main = threading.main_thread().ident
        if not lifecycle.parked(main):
            return False
        if self._owner == main:
            return True
        if self._local.acquire(timeout=PARKED_PROBE_S):
            self._local.release()
            return False
        return True

    def freeze(self) -> None:
        """Keeps every other process out of the records until this one has ended, for the closing
        on SIGTERM (:meth:`held_by_parked`): the ``flock`` is taken (it is this process's already,
        unless the main thread stopped before it had it) and never given back, no thread of this
        process that is inside gives it back, and none enters again. The kernel drops it with the
        process."""
        self._frozen = True  # a thread inside now leaves without unlocking the flock
        self._local.acquire(timeout=PARKED_PROBE_S)  # taken: nobody of this process was inside; kept
        fcntl.flock(self._fd, fcntl.LOCK_EX)

    def close(self):
        if not self._frozen:  # a frozen lock's descriptor lives as long as the process
            os.close(self._fd)


class Ring:
    """The header (``h``), member records (``m``) and slot records (``s``) of a ``stage``
    mapping, and the protocol that changes them."""

    def __init__(self, buf):
        self.h, self.m, self.s = records(buf)

    @property
    def slots(self) -> int:
        return int(self.h["slots"])

    @property
    def batches_per_pass(self) -> int:
        return int(self.h["nb"])

    def order_key(self, q: int) -> int:
        """The sampler epoch whose order batch ``q`` belongs to."""
        return int(self.h["epoch_offset"]) + q // self.batches_per_pass

    # -- members ---------------------------------------------------------------------------
    def add_member(self, k: int) -> None:
        m = self.m[k]
        m["state"], m["pid"], m["start"], m["cursor"] = 1, os.getpid(), -1, -1
        m["held"], m["iterating"], m["produced"], m["consumed"], m["detached"], m["pace"] = 0, 0, 0, 0, 0, 0.0
        m["idle_since"] = time.monotonic()

    def remove_member(self, k: int) -> int:
        """Clears member ``k``'s record; its claims go back to ``TODO``. Returns how many."""
        mine = (self.s["state"][: self.slots] == CLAIMED) & (self.s["producer"][: self.slots] == k)
        self.s["state"][: self.slots][mine] = TODO
        m = self.m[k]
        m["state"], m["start"], m["cursor"], m["held"], m["iterating"], m["detached"] = 0, -1, -1, 0, 0, 0
        return int(np.count_nonzero(mine))

    def enrolled(self) -> list[int]:
        m = self.m
        return np.flatnonzero((m["state"] == 1) & (m["start"] >= 0)).tolist()

    def enroll(self, me: int, epoch: int, *, may_rebase: bool, after: int | None = None) -> tuple[int, bool]:
        """Starts member ``me``'s next pass: see :meth:`StagingArea.enroll`."""
        nb = self.batches_per_pass
        h, m = self.h, self.m[me]
        others = [k for k in self.enrolled() if k != me]
        continues = int(m["start"]) >= 0 and int(m["cursor"]) % nb == 0
        if continues:
            start = int(m["cursor"])
        else:
            start = -(-int(h["released"]) // nb) * nb
            if after is not None:  # never a pass whose order this member had: its augmentation too
                start = max(start, (after + 1 - int(h["epoch_offset"])) * nb)
        if may_rebase and not others and self.order_key(start) != epoch and self._idle():
            # Alone and nothing in flight: the group follows this member's epoch, as a
            # plain loader would.
            self.s["state"][: self.slots] = EMPTY
            h["released"] = h["frontier"] = start
            h["epoch_offset"] = epoch - start // nb
        m["start"], m["cursor"], m["iterating"], m["detached"] = start, start, 1, 0
        return start, continues

    def laggards(self, me: int, q: int) -> list[int]:
        """The members that keep the ring full while member ``me`` waits for batch ``q``, which
        nobody can claim for want of a slot: iterating members whose next batch, or a batch whose
        tensor they still hold, is the oldest in the ring (they are a whole ring behind ``me``),
        and whose training is slower than both ``me``'s (:data:`SLOWER` times its pace per sample)
        and the group's producers (``make_pace``): they cannot keep up. A member that lags only for
        a moment (a pause, a slow first batch, a process starved of CPU while the producers are
        the bottleneck) trains faster than the group makes batches and is waited for."""
        pace = float(self.m[me]["pace"])
        if not self.full_for(q) or pace <= 0:
            return []
        h, S = self.h, self.slots
        released = int(h["released"])
        floor = max(SLOWER * pace, float(h["make_pace"]))
        bit = np.uint64(1 << (released % S))
        out = []
        for k in self.enrolled():
            m = self.m[k]
            behind = int(m["cursor"]) <= released or (m["held"] & bit) != 0
            if k != me and m["iterating"] and behind and float(m["pace"]) > floor:
                out.append(k)
        return out

    def made(self, q: int, n: int, now: float) -> None:
        """Batch ``q`` (``n`` samples) was made: the group's production pace takes it in. A batch
        took its producer ``now - claimed_at``; the attached members' producers run side by side."""
        slot = self.s[q % self.slots]
        producers = max(1, int(np.count_nonzero(self.m["state"] == 1)))
        if n <= 0:
            return
        took = (now - float(slot["claimed_at"])) / (n * producers)
        h = self.h
        h["make_pace"] = took if float(h["make_pace"]) <= 0 else 0.8 * float(h["make_pace"]) + 0.2 * took

    def full_for(self, q: int) -> bool:
        """Whether nobody can claim batch ``q`` for want of a slot; needs no lock (for polling)."""
        released, frontier = int(self.h["released"]), int(self.h["frontier"])
        return q >= frontier and frontier - released >= self.slots

    def detach(self, k: int) -> None:
        """Member ``k`` stops holding the group for the rest of its pass (it finishes it alone)."""
        m = self.m[k]
        m["detached"], m["start"], m["cursor"] = 1, -1, -1

    # -- release ---------------------------------------------------------------------------
    def _idle(self) -> bool:
        s = self.s[: self.slots]
        return not np.any(s["state"] == CLAIMED) and not np.any(self.m["held"][self.m["state"] == 1])

    def needed(self, q: int) -> bool:
        m = self.m
        live = (m["state"] == 1) & (m["start"] >= 0) & (m["start"] <= q) & (m["cursor"] <= q)
        return bool(np.any(live))

    def held(self, slot: int) -> bool:
        bit = np.uint64(1 << slot)
        return bool(np.any((self.m["held"] & bit) != 0))

    def try_release(self) -> None:
        """Advances ``released`` over every batch nobody needs or holds."""
        h, S = self.h, self.slots
        while int(h["released"]) < int(h["frontier"]):
            q = int(h["released"])
            s = q % S
            state = int(self.s[s]["state"])
            if state == CLAIMED or self.needed(q) or self.held(s):
                return
            self.s[s]["state"] = EMPTY
            h["released"] = q + 1

    def live_slots(self) -> int:
        """Slots being made, or made and still needed or held."""
        s = self.s[: self.slots]
        live = 0
        for k in range(self.slots):
            st = int(s[k]["state"])
            if st == CLAIMED or (st in (READY, ERROR) and (self.needed(int(s[k]["q"])) or self.held(k))):
                live += 1
        return live

    # -- claims ----------------------------------------------------------------------------
    def claim(self, me: int, make_room: Callable[[], None]) -> Claim | None:
        """Claims for member ``me`` the lowest ``TODO`` batch someone needs, else ``F`` if the
        ring has room; ``make_room`` may unenroll members when it has none. None: nothing to claim."""
        h, S, s_tab = self.h, self.slots, self.s
        enrolled = self.enrolled()
        if not enrolled:
            return None
        todo = [s for s in range(S) if s_tab[s]["state"] == TODO and self.needed(int(s_tab[s]["q"]))]
        if todo:
            s = min(todo, key=lambda s: int(s_tab[s]["q"]))
            return self._occupy(s, int(s_tab[s]["q"]), me)
        first = min(int(self.m[k]["start"]) for k in enrolled)
        if int(h["frontier"]) < first:
            self.try_release()
            if int(h["released"]) == int(h["frontier"]):
                h["released"] = h["frontier"] = first  # nobody needs the batches in between
        q = int(h["frontier"])
        if q - int(h["released"]) >= S:
            self.try_release()
            if q - int(h["released"]) >= S:
                make_room()
                self.try_release()
                if q - int(h["released"]) >= S:
                    return None
        if q < first:
            return None
        h["frontier"] = q + 1
        return self._occupy(q % S, q, me)

    def _occupy(self, s: int, q: int, me: int) -> Claim:
        h = self.h
        h["tokens"] += 1
        slot = self.s[s]
        slot["state"], slot["q"], slot["producer"] = CLAIMED, q, me
        slot["token"], slot["n"], slot["claimed_at"] = int(h["tokens"]), 0, time.monotonic()
        live = int(np.count_nonzero(self.s["state"][: self.slots] != EMPTY))
        h["live_peak"] = max(int(h["live_peak"]), live)
        return Claim(q, int(h["tokens"]))

    def valid(self, c: Claim) -> bool:
        """Whether ``c`` still holds (the group did not take it back from a member taken for dead)."""
        slot = self.s[c.q % self.slots]
        return int(slot["state"]) == CLAIMED and int(slot["q"]) == c.q and int(slot["token"]) == c.token

    def ready(self, q: int) -> bool:
        """Whether batch ``q`` is ready (or failed); needs no lock."""
        slot = self.s[q % self.slots]
        return int(slot["q"]) == q and int(slot["state"]) in (READY, ERROR)
