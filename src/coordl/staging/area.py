"""The staging area of an HP group: ready batches in shared memory, made once, taken by every member.

Jobs of a hyper-parameter search on one machine that name the same ``hp_group``
attach to one staging area (per rank). The group runs one endless sequence of
staged batches of the group's unit (``batch_size`` samples, which the first member decides): batch
``q`` is batch ``q % NB`` of the group's pass ``q // NB`` (``NB`` per pass, the last
one partial), and pass ``g``'s order is the sampler's order for epoch ``epoch_offset + g``.
Every member consumes a contiguous run of whole passes, each batch once, and cuts its own
batches (of its own batch size) from them; any member produces any batch. A member that
falls a whole ring behind is detached: it finishes that pass alone.

Files (all ``coordl.<group fingerprint>.<kind>``, see :mod:`coordl.shm.names`):

- ``stage``: a header, the group's configuration (JSON), one record per member and
  one per slot (:mod:`coordl.staging.layout`);
- ``batches``: ``S`` slots of ``stride`` bytes (images, then labels and ids), reserved
  up front with ``posix_fallocate``: the staging memory bound;
- ``mutex``: every change of the shared records happens under an ``flock`` on it;
- ``member.<k>``: member ``k`` holds an exclusive ``flock`` on it while it lives, so
  a dead member is one whose file can be locked (:mod:`coordl.staging.liveness`).

A slot goes ``EMPTY -> CLAIMED`` (a member is producing it) ``-> READY`` (or
``ERROR``), and back to ``EMPTY`` only when it is released: when every enrolled member
has consumed it and nobody still holds a tensor that maps it (:mod:`coordl.staging.ring`,
:mod:`coordl.staging.holds`). Release is lazy (when a producer needs the slot), so a
member can still join a pass whose first batch is in the ring. The claim of a member
that dies goes back to ``TODO`` and the next producer makes it again.
"""

from __future__ import annotations

import contextlib
import json
import logging
import mmap
import os
import threading
import time

import numpy as np

from coordl import lifecycle
from coordl.errors import CoordlError
from coordl.options import AUTO
from coordl.shm import group, names
from coordl.staging import files
from coordl.staging.holds import Holds, cow_supported
from coordl.staging.layout import CLAIMED, ERROR, MAX_MEMBERS, READY, TODO, group_fingerprint, image_bytes
from coordl.staging.liveness import MemberLock, drop_idle, lock_path, reap_dead
from coordl.staging.ring import Claim, Mutex, Ring, Taken

__all__ = ["HEALTH_EVERY_S", "Claim", "StagingArea", "group_fingerprint"]

log = logging.getLogger(__name__)

# How often a member looks for dead members while its producer claims or its consumer waits for a
# batch: the others notice a death within 0.25 s (docs/guarantees.md), 0.05 s left for the poll's
# sleep and a busy machine's scheduling.
HEALTH_EVERY_S = 0.2


class StagingArea:
    """This process's attachment to an HP group's staging area.

    Args:
        name: the group's name (``hp_group``).
        rank: this process's rank; each rank of the jobs has its own area.
        config: what every member must agree on (JSON-able); a member whose config
            differs is refused with :class:`~coordl.errors.GroupConfigError`.
        batch_size: samples per staged batch (the group's unit; its first member decides).
        batches_per_pass: staged batches in one pass (epoch) of this rank, the last one partial.
        sample_shape, dtype: shape and torch dtype name of one staged image.
        epoch: the epoch a new group's first pass has.
        bound: staging memory in bytes (``"auto"``: 16 batches, at most 2 GiB, at
            least 4 batches); the group's first member decides.
        idle_timeout: seconds a member that is between epochs may hold the others up
            before it is dropped from the coming pass (it rejoins at the next one).
        directory: the shm directory.
    """

    def __init__(
        self,
        name: str,
        rank: int,
        config: dict,
        *,
        batch_size: int,
        batches_per_pass: int,
        sample_shape: tuple[int, ...],
        dtype: str,
        epoch: int,
        bound=AUTO,
        idle_timeout: float = 60.0,
        directory: str | None = None,
    ):
        if len(sample_shape) > 4:
            raise ValueError(f"staged samples have at most 4 dimensions, got shape {sample_shape}")
        self.name = name
        self.fingerprint = group_fingerprint(name, rank)
        self.directory = directory or names.shm_dir()
        self.idle_timeout = idle_timeout
        self._config = json.dumps(config, sort_keys=True)
        self._membership = group.Membership(self.fingerprint, self.directory)
        self._ctl: mmap.mmap | None = None
        self._ring: Ring | None = None
        self._data: mmap.mmap | None = None
        self._data_fd = -1
        self._mutex: Mutex | None = None
        self._me = -1
        self._me_lock: MemberLock | None = None
        self._holds: Holds | None = None
        self._closed = False
        self._parked_inside = False  # SIGTERM parked the main thread inside the mutex (parked_inside)
        self._last_health = 0.0
        self._img_bytes: int | None = None
        shape = tuple(sample_shape)
        spec = dict(batch_size=batch_size, nb=batches_per_pass, shape=shape, dtype=dtype, epoch=epoch, bound=bound)
        with lifecycle.making(self):  # SIGTERM in here: close() leaves the group
            self._membership.join(lambda alone: self._setup(alone, spec))
            try:
                self._mutex = Mutex(self._membership.path("mutex"))
                self._enter_member()
                self._holds = Holds(self._ring, self._me, self._mutex)
            except BaseException:
                self._detach()
                raise
        self.cow = cow_supported(self._data_fd)

    # -- setup -----------------------------------------------------------------------------
    def _setup(self, alone: bool, spec: dict) -> None:
        if alone:
            # Nobody else is attached: whatever is here was left by dead members. Start afresh.
            group.remove_group(self.fingerprint, self.directory, keep_locks=True)
            self._ctl, self._data_fd, self._data = files.create(self._membership, self._config, **spec)
        else:
            self._ctl, self._data_fd, self._data = files.attach(self._membership, self.name, self._config)
        self._ring = Ring(self._ctl)

    def _enter_member(self) -> None:
        with self._mutex:
            self._reap_dead()
            for k in range(MAX_MEMBERS):
                if self._ring.m[k]["state"] != 0:
                    continue
                lock = MemberLock.take(lock_path(self._membership, k))
                if lock is None:
                    continue  # a member that is still leaving
                self._me, self._me_lock = k, lock
                self._ring.add_member(k)
                return
        raise CoordlError(f"hp_group {self.name!r} already has {MAX_MEMBERS} members")

    # -- geometry --------------------------------------------------------------------------
    @property
    def attached(self) -> bool:
        """Whether this process is still attached (the shared records are mapped)."""
        return self._ring is not None

    @property
    def slots(self) -> int:
        return self._ring.slots

    @property
    def stride(self) -> int:
        return int(self._ring.h["stride"])

    @property
    def batches_per_pass(self) -> int:
        return self._ring.batches_per_pass

    @property
    def sample_shape(self) -> tuple[int, ...]:
        h = self._ring.h
        return tuple(int(x) for x in h["shape"][: int(h["ndim"])])

    @property
    def dtype(self) -> str:
        return self._ring.h["dtype"].item().decode()

    @property
    def images_bytes(self) -> int:
        """Bytes of a batch's images in a slot; its labels and then its ids follow them."""
        if self._img_bytes is None:
            self._img_bytes = image_bytes(int(self._ring.h["batch_size"]), self.sample_shape, self.dtype)
        return self._img_bytes

    @property
    def unit(self) -> int:
        """Samples per staged batch: the group's, decided by its first member."""
        return int(self._ring.h["batch_size"])

    @property
    def member(self) -> int:
        return self._me

    def set_pace(self, seconds_per_sample: float) -> None:
        """Publishes this member's training pace (one aligned 8-byte store: no lock needed)."""
        self._ring.m[self._me]["pace"] = seconds_per_sample

    @property
    def detached(self) -> bool:
        """Whether the group detached this member from its pass (it fell a whole ring behind)."""
        return int(self._ring.m[self._me]["detached"]) == 1

    def order_key(self, q: int) -> int:
        """The sampler epoch whose order batch ``q`` belongs to."""
        return self._ring.order_key(q)

    # -- membership of passes --------------------------------------------------------------
    def enroll(self, epoch: int, *, may_rebase: bool, after: int | None = None) -> tuple[int, bool]:
        """Starts this member's next pass; returns its first batch (it may lie in a coming
        pass) and whether it continues from its previous pass.

        A member that consumed the previous pass completely continues with the next one.
        Otherwise it joins the first pass whose first batch has not been released: the
        current one if the group is still at its start, else the next one. A member alone
        in the group with nothing in flight, whose passes so far all had the order of its own
        epochs (``may_rebase``), gets the order of ``epoch``, as a plain loader would.
        ``after``: the order (sampler epoch) of this member's last finished pass, when it does not
        continue from it (it finished it alone): it joins a pass of a later order.
        """
        with self._mutex:
            self._holds.apply_freed()
            self._reap_dead()
            return self._ring.enroll(self._me, epoch, may_rebase=may_rebase, after=after)

    def finish_pass(self, end: int) -> None:
        """This member is done with its pass, whose staged batches end before ``end`` (those it
        did not need, after its ``drop_last``, count as consumed); it stays enrolled for the next
        one unless it was detached."""
        self.release_all()
        with self._mutex:
            me = self._ring.m[self._me]
            if int(me["start"]) >= 0:
                me["cursor"] = max(int(me["cursor"]), end)
            me["iterating"], me["idle_since"] = 0, time.monotonic()
            self._ring.try_release()

    def abandon(self) -> None:
        """This member stops consuming (a pass left unfinished, or closing)."""
        if self.parked_inside:  # close() gives the member up: the others take its records back
            return
        self.release_all()
        with self._mutex:
            me = self._ring.m[self._me]
            me["start"], me["cursor"], me["iterating"] = -1, -1, 0

    # -- producing -------------------------------------------------------------------------
    def claim(self, *, block: bool, stop: threading.Event | None = None) -> Claim | None:
        """Claims the next batch the group needs. Blocks (when ``block``) until a slot is free;
        returns None if nothing can be claimed now (not blocking) or ``stop`` was set."""
        delay = 0.0005
        while True:
            with self._mutex:
                self._holds.apply_freed()
                self._health(force=False)
                c = self._ring.claim(self._me, self._drop_idle)
                if c is not None or not block:
                    return c
            if stop is not None and stop.wait(delay):
                return None
            delay = min(delay * 2, 0.01)

    def slot_view(self, c: Claim) -> memoryview:
        """The bytes of the claimed slot, to write the batch into before :meth:`publish`."""
        s = c.q % self.slots
        return memoryview(self._data)[s * self.stride : (s + 1) * self.stride]

    def publish(self, c: Claim, n: int) -> None:
        """Makes the claimed batch (``n`` samples written into its slot) visible to consumers."""
        with self._mutex:
            if not self._ring.valid(c):
                return  # the group reclaimed it (this member was taken for dead): drop it
            slot = self._ring.s[c.q % self.slots]
            self._ring.made(c.q, n, time.monotonic())
            slot["n"], slot["state"] = n, READY
            self._ring.m[self._me]["produced"] += 1

    def publish_error(self, c: Claim, message: str, path: str = "") -> None:
        """Marks the batch as failed: every member that reaches it raises with ``message``."""
        text = json.dumps({"message": message, "path": path}).encode()[: self.stride]
        with self._mutex:
            if not self._ring.valid(c):
                return
            s = c.q % self.slots
            self._data[s * self.stride : s * self.stride + len(text)] = text
            slot = self._ring.s[s]
            slot["n"], slot["state"] = len(text), ERROR

    def unclaim(self, c: Claim) -> None:
        """Gives a claimed batch back to the group (someone else makes it)."""
        with self._mutex:
            if self._ring.valid(c):
                self._ring.s[c.q % self.slots]["state"] = TODO

    # -- consuming -------------------------------------------------------------------------
    def ready(self, q: int) -> bool:
        """Whether batch ``q`` is ready (or failed), without locking: for polling."""
        return self._ring.ready(q)

    def take(self, q: int) -> Taken | None:
        """Takes ready batch ``q`` (this member's next): from now on it holds the slot until
        :meth:`private_images` 's mapping is freed or :meth:`release` is called. None: this
        member was detached (it finishes its pass alone)."""
        s = q % self.slots
        with self._mutex:
            me, slot = self._ring.m[self._me], self._ring.s[s]
            if int(me["detached"]):
                return None
            if int(me["cursor"]) != q:
                raise CoordlError(f"hp_group {self.name!r}: internal error: batch {q} taken out of order")
            if not self.ready(q):
                raise CoordlError(f"hp_group {self.name!r}: internal error: batch {q} is not ready")
            me["cursor"] = q + 1
            me["consumed"] += 1
            if int(slot["state"]) == ERROR:
                info = json.loads(bytes(self._data[s * self.stride : s * self.stride + int(slot["n"])]).decode())
                return Taken(q, s, 0, error=info["message"], error_path=info["path"])
            self._holds.hold(s, q)
            return Taken(q, s, int(slot["n"]))

    def produced_by_me(self, q: int) -> bool:
        slot = self._ring.s[q % self.slots]
        return int(slot["q"]) == q and int(slot["producer"]) == self._me

    def labels_ids(self, t: Taken) -> tuple[np.ndarray, np.ndarray]:
        """Copies of the labels and sample ids of a taken batch."""
        off = t.slot * self.stride + self.images_bytes
        bs = int(self._ring.h["batch_size"])
        labels = np.frombuffer(self._data, np.int64, t.n, off).copy()
        ids = np.frombuffer(self._data, np.int64, t.n, off + 8 * bs).copy()
        return labels, ids

    def shared_images(self, t: Taken) -> memoryview:
        """The image bytes of a taken batch in the shared mapping (copy them, then :meth:`release`)."""
        off = t.slot * self.stride
        return memoryview(self._data)[off : off + self.images_bytes]

    def private_images(self, t: Taken) -> mmap.mmap:
        """A copy-on-write private mapping of a taken batch's slot: zero-copy for the consumer,
        and writes to it stay private. The slot stays held until the mapping is freed."""
        return self._holds.map_private(self._data_fd, self.stride, t.slot, t.q)

    def release(self, t: Taken) -> None:
        """Releases a taken batch this member copied out."""
        with self._mutex:
            self._holds.release(t.slot, t.q)

    def release_older(self, q: int) -> None:
        """Releases every held batch before ``q``; one still referenced is first unshared
        (its pages copied into the private mapping), so the caller's tensor never changes."""
        with self._mutex:
            self._holds.release_where(lambda held_q: held_q < q)

    def release_all(self) -> None:
        if self.parked_inside:
            return
        with self._mutex:
            self._holds.release_where(lambda held_q: True)

    # -- health ----------------------------------------------------------------------------
    def health(self) -> None:
        """Reclaims what dead members hold and drops members idle too long; for waiters."""
        with self._mutex:
            self._holds.apply_freed()
            self._health(force=True)

    def _health(self, force: bool) -> None:
        now = time.monotonic()
        if not force and now - self._last_health < HEALTH_EVERY_S:
            return
        self._last_health = now
        self._reap_dead()

    def detach_laggards(self, q: int) -> list[int]:
        """Detaches the members a whole ring behind this one, which waits for batch ``q`` that
        nobody can claim (:meth:`Ring.laggards <coordl.staging.ring.Ring.laggards>`): they finish
        their pass alone and rejoin at a later one. Returns their pids. Takes the lock only when
        the ring is full: a consumer waiting for a batch being made costs the group nothing."""
        if not self._ring.full_for(q):
            return []
        with self._mutex:
            self._holds.apply_freed()
            ring = self._ring
            pids = []
            for k in ring.laggards(self._me, q):
                pids.append(int(ring.m[k]["pid"]))
                ring.detach(k)
            if pids:
                log.info(
                    "coordl: hp_group %r: member(s) pid %s fell %d staged batches behind; they finish this epoch "
                    "with their own prep and rejoin the group at a later one",
                    self.name,
                    pids,
                    self.slots,
                )
                ring.try_release()
            return pids

    def _reap_dead(self) -> None:
        reap_dead(self._ring, self._me, self._membership, self.name)

    def _drop_idle(self) -> None:
        drop_idle(self._ring, self._me, self.idle_timeout, self.name)

    def waiting_on(self, q: int) -> str:
        """Who batch ``q`` waits for, in words, for progress messages."""
        ring = self._ring
        slot = ring.s[q % self.slots]
        if int(slot["q"]) == q and int(slot["state"]) == CLAIMED:
            return f"member pid {int(ring.m[int(slot['producer'])]['pid'])} is making it"
        released = int(ring.h["released"])
        blockers = [int(ring.m[k]["pid"]) for k in ring.enrolled() if int(ring.m[k]["cursor"]) <= released]
        if blockers:
            return f"the staging area is full; the slowest member(s): pid {blockers}"
        return "nobody has claimed it yet"

    # -- stats -----------------------------------------------------------------------------
    def stats(self) -> dict:
        stride = self.stride
        return {
            "hp_members": int(np.count_nonzero(self._ring.m["state"] == 1)),
            "stage_batch": self.unit,
            "staging_bound": self.slots * stride,
            "staging_bytes": self._ring.live_slots() * stride,
            "staging_peak_bytes": int(self._ring.h["live_peak"]) * stride,
        }

    def position(self) -> tuple[int, int]:
        """The group's ``(released, frontier)`` counters."""
        return int(self._ring.h["released"]), int(self._ring.h["frontier"])

    # -- lifetime --------------------------------------------------------------------------
    @property
    def parked_inside(self) -> bool:
        """Whether SIGTERM parked the main thread inside the group's mutex, perhaps half way through
        an edit of the shared records that it never finishes (:meth:`Mutex.held_by_parked
        <coordl.staging.ring.Mutex.held_by_parked>`). Then no thread of this process enters the
        mutex again: :meth:`close` gives the member up, and the others take back its claims and
        slots as they do a killed member's."""
        if not self._parked_inside and self._mutex is not None and self._mutex.held_by_parked():
            self._parked_inside = True
        return self._parked_inside

    def close(self) -> None:
        """Leaves the group: claims go back, holds are unshared and released. Idempotent. While
        SIGTERM parks the main thread inside the group's mutex, it gives the member up instead
        (:meth:`_give_up`)."""
        if self._closed:
            return
        self._closed = True
        if self.parked_inside:
            self._give_up()
            return
        try:
            if self._me >= 0:  # a member of the ring (not so while SIGTERM stopped the joining earlier)
                with self._mutex:
                    if self._holds is not None:
                        self._holds.release_where(lambda held_q: True)
                    self._ring.remove_member(self._me)
                    self._ring.try_release()
        finally:
            self._detach()

    def _give_up(self) -> None:
        """The closing on SIGTERM while the parked main thread is inside the group's mutex: nothing
        of this process changes the shared records again, which stay as that thread left them, as
        after ``kill -9`` there. The mutex stays locked until the process ends
        (:meth:`Mutex.freeze <coordl.staging.ring.Mutex.freeze>`: the others wait, and no late
        write of this process's producers can reach a slot they took back), and the member's
        ``flock`` is released: once the process is gone, the others find the member dead at once
        and take back its claims and slots (:func:`~coordl.staging.liveness.reap_dead`). The
        mappings stay until the process ends (a producer may still be writing into its slot)."""
        self._mutex.freeze()
        if self._me_lock is not None:
            self._me_lock.release()
            self._me_lock = None
        if self._holds is not None:
            self._holds.close()
        self._membership.leave(remove_if_last=True)

    def _detach(self) -> None:
        if self._me_lock is not None:
            self._me_lock.release()
            self._me_lock = None
        if self._holds is not None:
            self._holds.close()
        if self._mutex is not None:
            self._mutex.close()
            self._mutex = None
        self._ring = None
        for mm in (self._data, self._ctl):
            if mm is not None:
                with contextlib.suppress(BufferError):
                    mm.close()
        self._data = self._ctl = None
        if self._data_fd >= 0:
            os.close(self._data_fd)
            self._data_fd = -1
        self._membership.leave(remove_if_last=True)
