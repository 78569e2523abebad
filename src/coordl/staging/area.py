"""The staging area of an HP group: ready batches in shared memory, made once, taken by every member.

Jobs of a hyper-parameter search on one machine that name the same ``hp_group``
attach to one staging area (per rank). The group runs one endless sequence of
batches: batch ``q`` is batch ``q % NB`` of the group's pass ``q // NB`` (``NB``
batches per pass), and pass ``g``'s order is the sampler's order for epoch
``epoch_offset + g``. Every member consumes a contiguous run of whole passes, each
batch once; any member produces any batch.

Files (all ``coordl.<group fingerprint>.<kind>``, see :mod:`coordl.shm.names`):

- ``stage``: a header, the group's configuration (JSON), one record per member and
  one per slot;
- ``batches``: ``S`` slots of ``stride`` bytes (images, then labels and ids), reserved
  up front with ``posix_fallocate``: the staging memory bound;
- ``mutex``: every change of the shared records happens under an ``flock`` on it;
- ``member.<k>``: member ``k`` holds an exclusive ``flock`` on it while it lives, so
  a dead member is one whose file can be locked: liveness comes from the kernel.

Batch ``q`` lives in slot ``q % S``. Two counters bound the ring: ``released``
(``R``: every batch before it is gone) and ``frontier`` (``F``: the next batch
nobody has claimed), ``R <= F <= R + S``. A slot goes ``EMPTY -> CLAIMED`` (a
member is producing it) ``-> READY`` (or ``ERROR``), and back to ``EMPTY`` only
when it is released: when every enrolled member has consumed it and nobody still
holds a tensor that maps it. Release is lazy (when a producer needs the slot), so
a member can still join a pass whose first batch is in the ring. The claim of a
member that dies goes back to ``TODO`` and the next producer makes it again.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import mmap
import os
import threading
import time
import weakref
from dataclasses import dataclass

import numpy as np

from coordl.errors import CoordlError, GroupConfigError, SharedMemoryError
from coordl.shm import group, names, segment

__all__ = ["Claim", "StagingArea", "group_fingerprint"]

log = logging.getLogger(__name__)

MAGIC = 0x31474154535A4443  # "CDZSTAG1"
VERSION = 1
MAX_MEMBERS = 64
MAX_SLOTS = 64
MIN_SLOTS = 4
CONFIG_BYTES = 4096
HEADER_BYTES = 512
MADV_POPULATE_WRITE = 23  # Linux 5.14+: break copy-on-write sharing of a private mapping in place

HEADER = np.dtype(
    [
        ("magic", "<u8"),
        ("version", "<i8"),
        ("slots", "<i8"),
        ("stride", "<i8"),  # bytes per slot, a multiple of the page size
        ("batch_size", "<i8"),
        ("nb", "<i8"),  # batches per pass
        ("epoch_offset", "<i8"),
        ("released", "<i8"),
        ("frontier", "<i8"),
        ("tokens", "<i8"),
        ("live_peak", "<i8"),  # most slots ever live at once
        ("config_len", "<i8"),
        ("ndim", "<i8"),
        ("shape", "<i8", (4,)),
        ("dtype", "S16"),
    ]
)
MEMBER = np.dtype(
    [
        ("state", "<i8"),  # 0 free, 1 attached
        ("pid", "<i8"),
        ("start", "<i8"),  # first batch of the passes it consumes; -1: not enrolled
        ("cursor", "<i8"),  # next batch it consumes
        ("held", "<u8"),  # bit s: a tensor of this member maps slot s
        ("iterating", "<i8"),
        ("idle_since", "<f8"),  # CLOCK_MONOTONIC, system-wide
        ("produced", "<i8"),
        ("consumed", "<i8"),
    ]
)
SLOT = np.dtype(
    [
        ("state", "<i8"),
        ("q", "<i8"),
        ("producer", "<i8"),
        ("token", "<i8"),
        ("n", "<i8"),  # samples in the batch
        ("claimed_at", "<f8"),
    ]
)
EMPTY, CLAIMED, READY, ERROR, TODO = 0, 1, 2, 3, 4
assert HEADER.itemsize <= HEADER_BYTES


def group_fingerprint(name: str, rank: int) -> str:
    """The fingerprint of an HP group's files: per group name, user and rank."""
    return hashlib.sha256(f"hp-group:{name}:{os.getuid()}:{rank}".encode()).hexdigest()[:16]


def _page_round(n: int) -> int:
    return -(-n // mmap.PAGESIZE) * mmap.PAGESIZE


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


class _Mutex:
    """A lock across processes (``flock``) and across this process's threads."""

    def __init__(self, path: str):
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        self._local = threading.Lock()

    def __enter__(self):
        self._local.acquire()
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
        except BaseException:
            self._local.release()
            raise
        return self

    def __exit__(self, *exc):
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        self._local.release()

    def try_enter(self) -> bool:
        """Enters unless a thread of this process is inside (then the caller defers)."""
        if not self._local.acquire(blocking=False):
            return False
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
        except BaseException:
            self._local.release()
            raise
        return True

    def close(self):
        os.close(self._fd)


class StagingArea:
    """This process's attachment to an HP group's staging area.

    Args:
        name: the group's name (``hp_group``).
        rank: this process's rank; each rank of the jobs has its own area.
        config: what every member must agree on (JSON-able); a member whose config
            differs is refused with :class:`~coordl.errors.GroupConfigError`.
        batch_size: samples per batch.
        batches_per_pass: batches in one pass (epoch) of this rank.
        sample_shape, dtype: shape and torch dtype name of one staged image.
        epoch: the epoch a new group's first pass has.
        bound: staging memory in bytes (``"auto"``: 16 batches, at most 2 GiB, at
            least 4 batches); the group's first member decides.
        idle_timeout: seconds a member that is between epochs may hold the others up
            before it is dropped from the coming pass (it rejoins at the next one).
        directory: the shm directory.
    """

    def __init__(self, name: str, rank: int, config: dict, *, batch_size: int, batches_per_pass: int,
                 sample_shape: tuple[int, ...], dtype: str, epoch: int, bound="auto",
                 idle_timeout: float = 60.0, directory: str | None = None):  # fmt: skip
        if len(sample_shape) > 4:
            raise ValueError(f"staged samples have at most 4 dimensions, got shape {sample_shape}")
        self.name = name
        self.fingerprint = group_fingerprint(name, rank)
        self.directory = directory or names.shm_dir()
        self.idle_timeout = idle_timeout
        self._config = json.dumps(config, sort_keys=True)
        self._membership = group.Membership(self.fingerprint, self.directory)
        self._ctl: mmap.mmap | None = None
        self._data: mmap.mmap | None = None
        self._data_fd = -1
        self._me = -1
        self._me_fd = -1
        self._holds: dict[int, tuple[int, weakref.ref | None]] = {}  # slot -> (q, weakref to the mapping)
        self._freed: collections.deque = collections.deque()  # (slot, q) whose tensors were freed
        self._closed = False
        self._last_health = 0.0
        self._img_bytes: int | None = None
        layout = dict(batch_size=batch_size, nb=batches_per_pass, shape=tuple(sample_shape), dtype=dtype,
                      epoch=epoch, bound=bound)  # fmt: skip
        self._membership.join(lambda alone: self._setup(alone, layout))
        try:
            self._mutex = _Mutex(self._membership.path("mutex"))
            self._enter_member()
        except BaseException:
            self._detach()
            raise
        self.cow = _cow_supported(self._data_fd, self.stride)

    # -- setup -----------------------------------------------------------------------------
    def _setup(self, alone: bool, layout: dict) -> None:
        if alone:
            # Nobody else is attached: whatever is here was left by dead members. Start afresh.
            group.remove_group(self.fingerprint, self.directory, keep_locks=True)
            self._create(layout)
        else:
            self._attach()

    def _create(self, layout: dict) -> None:
        shape = layout["shape"]
        import torch  # for the dtype's size only

        itemsize = torch.empty((), dtype=getattr(torch, layout["dtype"])).element_size()
        images = layout["batch_size"] * int(np.prod(shape, dtype=np.int64)) * itemsize
        stride = _page_round(images + 16 * layout["batch_size"])
        slots = _slots_for(layout["bound"], stride, self.directory)
        config = self._config.encode()
        if len(config) > CONFIG_BYTES:
            raise ValueError("the hp_group configuration is too large to stage")
        ctl_bytes = _page_round(HEADER_BYTES + CONFIG_BYTES + MAX_MEMBERS * MEMBER.itemsize + MAX_SLOTS * SLOT.itemsize)
        fd = segment.create_exclusive(self._membership.path("stage"))
        try:
            segment.reserve(fd, ctl_bytes)
            ctl = segment.map_fd(fd, ctl_bytes)
        finally:
            os.close(fd)
        dfd = segment.create_exclusive(self._membership.path("batches"))
        try:
            segment.reserve(dfd, slots * stride)
        except OSError as e:
            os.close(dfd)
            ctl.close()
            if e.errno == errno.ENOSPC:
                raise SharedMemoryError(
                    f"no room for the hp_group staging area ({slots} batches of {stride} bytes) in "
                    f"{self.directory}; pass a smaller hp_staging or free shared memory"
                ) from None
            raise
        self._ctl, self._data_fd = ctl, dfd
        self._data = segment.map_fd(dfd, slots * stride)
        self._views()
        h = self._h
        h["version"], h["slots"], h["stride"] = VERSION, slots, stride
        h["batch_size"], h["nb"], h["epoch_offset"] = layout["batch_size"], layout["nb"], layout["epoch"]
        h["ndim"], h["dtype"] = len(shape), layout["dtype"].encode()
        h["shape"][: len(shape)] = shape
        h["config_len"] = len(config)
        self._ctl[HEADER_BYTES : HEADER_BYTES + len(config)] = config
        h["magic"] = MAGIC  # last: a header with the magic is complete

    def _attach(self) -> None:
        fd = segment.open_existing(self._membership.path("stage"))
        try:
            size = os.fstat(fd).st_size
            ctl = segment.map_fd(fd, size)
        finally:
            os.close(fd)
        self._ctl = ctl
        self._views()
        if int(self._h["magic"]) != MAGIC or int(self._h["version"]) != VERSION:
            raise CoordlError(f"hp_group {self.name!r}: its staging area was made by another coordl version")
        theirs = bytes(self._ctl[HEADER_BYTES : HEADER_BYTES + int(self._h["config_len"])]).decode()
        if theirs != self._config:
            raise GroupConfigError(_mismatch(self.name, json.loads(theirs), json.loads(self._config)))
        self._data_fd = segment.open_existing(self._membership.path("batches"))
        self._data = segment.map_fd(self._data_fd, int(self._h["slots"]) * int(self._h["stride"]))

    def _views(self) -> None:
        buf = self._ctl
        self._h = np.ndarray((), HEADER, buf, 0)
        off = HEADER_BYTES + CONFIG_BYTES
        self._m = np.ndarray((MAX_MEMBERS,), MEMBER, buf, off)
        self._s = np.ndarray((MAX_SLOTS,), SLOT, buf, off + MAX_MEMBERS * MEMBER.itemsize)

    def _enter_member(self) -> None:
        with self._mutex:
            self._reap_dead()
            for k in range(MAX_MEMBERS):
                if self._m[k]["state"] == 0:
                    fd = os.open(self._membership.path("member", k), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    except BlockingIOError:
                        os.close(fd)  # a member that is still leaving
                        continue
                    self._me, self._me_fd = k, fd
                    _forget_in_forked_children(self)
                    m = self._m[k]
                    m["state"], m["pid"], m["start"], m["cursor"] = 1, os.getpid(), -1, -1
                    m["held"], m["iterating"], m["produced"], m["consumed"] = 0, 0, 0, 0
                    m["idle_since"] = time.monotonic()
                    return
        raise CoordlError(f"hp_group {self.name!r} already has {MAX_MEMBERS} members")

    # -- geometry --------------------------------------------------------------------------
    @property
    def slots(self) -> int:
        return int(self._h["slots"])

    @property
    def stride(self) -> int:
        return int(self._h["stride"])

    @property
    def batches_per_pass(self) -> int:
        return int(self._h["nb"])

    @property
    def sample_shape(self) -> tuple[int, ...]:
        return tuple(int(x) for x in self._h["shape"][: int(self._h["ndim"])])

    @property
    def dtype(self) -> str:
        return self._h["dtype"].item().decode()

    @property
    def member(self) -> int:
        return self._me

    def order_key(self, q: int) -> int:
        """The sampler epoch whose order batch ``q`` belongs to."""
        return int(self._h["epoch_offset"]) + q // self.batches_per_pass

    # -- membership of passes --------------------------------------------------------------
    def enroll(self, epoch: int, *, may_rebase: bool) -> tuple[int, bool]:
        """Starts this member's next pass; returns its first batch (it may lie in a coming
        pass) and whether it continues from its previous pass.

        A member that consumed the previous pass completely continues with the next one.
        Otherwise it joins the first pass whose first batch has not been released: the
        current one if the group is still at its start, else the next one. A member alone
        in the group with nothing in flight, whose passes so far all had the order of its own
        epochs (``may_rebase``), gets the order of ``epoch``, as a plain loader would.
        """
        nb = self.batches_per_pass
        with self._mutex:
            self._apply_freed()
            self._reap_dead()
            h, me = self._h, self._m[self._me]
            others = [k for k in self._enrolled() if k != self._me]
            continues = int(me["start"]) >= 0 and int(me["cursor"]) % nb == 0
            if continues:
                start = int(me["cursor"])
            else:
                start = -(-int(h["released"]) // nb) * nb
            if may_rebase and not others and self.order_key(start) != epoch and self._idle_ring():
                # Alone and nothing in flight: the group follows this member's epoch, as a
                # plain loader would.
                self._s["state"][: self.slots] = EMPTY
                h["released"] = h["frontier"] = start
                h["epoch_offset"] = epoch - start // nb
            me["start"], me["cursor"], me["iterating"] = start, start, 1
            return start, continues

    def finish_pass(self) -> None:
        """This member consumed its pass; it stays enrolled for the next one."""
        self.release_all()
        with self._mutex:
            me = self._m[self._me]
            me["iterating"], me["idle_since"] = 0, time.monotonic()

    def abandon(self) -> None:
        """This member stops consuming (a pass left unfinished, or closing)."""
        self.release_all()
        with self._mutex:
            me = self._m[self._me]
            me["start"], me["cursor"], me["iterating"] = -1, -1, 0

    def _enrolled(self) -> list[int]:
        m = self._m
        return [k for k in range(MAX_MEMBERS) if m[k]["state"] == 1 and m[k]["start"] >= 0]

    def _idle_ring(self) -> bool:
        s = self._s[: self.slots]
        return not np.any(s["state"] == CLAIMED) and not np.any(self._m["held"][self._m["state"] == 1])

    def _needed(self, q: int) -> bool:
        m = self._m
        live = (m["state"] == 1) & (m["start"] >= 0) & (m["start"] <= q) & (m["cursor"] <= q)
        return bool(np.any(live))

    def _held(self, slot: int) -> bool:
        bit = np.uint64(1 << slot)
        return bool(np.any((self._m["held"] & bit) != 0))

    def _try_release(self) -> None:
        h, S = self._h, self.slots
        while int(h["released"]) < int(h["frontier"]):
            q = int(h["released"])
            s = q % S
            state = int(self._s[s]["state"])
            if state == CLAIMED or self._needed(q) or self._held(s):
                return
            self._s[s]["state"] = EMPTY
            h["released"] = q + 1

    # -- producing -------------------------------------------------------------------------
    def claim(self, *, block: bool, stop: threading.Event | None = None) -> Claim | None:
        """Claims the next batch the group needs. Blocks (when ``block``) until a slot is free;
        returns None if nothing can be claimed now (not blocking) or ``stop`` was set."""
        delay = 0.0005
        while True:
            with self._mutex:
                self._apply_freed()
                self._health(force=False)
                c = self._claim_locked()
                if c is not None or not block:
                    return c
            if stop is not None and stop.wait(delay):
                return None
            delay = min(delay * 2, 0.01)

    def _claim_locked(self) -> Claim | None:
        h, S, s_tab = self._h, self.slots, self._s
        enrolled = self._enrolled()
        if not enrolled:
            return None
        todo = [s for s in range(S) if s_tab[s]["state"] == TODO and self._needed(int(s_tab[s]["q"]))]
        if todo:
            s = min(todo, key=lambda s: int(s_tab[s]["q"]))
            return self._take_slot(s, int(s_tab[s]["q"]))
        first = min(int(self._m[k]["start"]) for k in enrolled)
        if int(h["frontier"]) < first:
            self._try_release()
            if int(h["released"]) == int(h["frontier"]):
                h["released"] = h["frontier"] = first  # nobody needs the batches in between
        q = int(h["frontier"])
        if q - int(h["released"]) >= S:
            self._try_release()
            if q - int(h["released"]) >= S:
                self._drop_idle()
                self._try_release()
                if q - int(h["released"]) >= S:
                    return None
        if q < first:
            return None
        h["frontier"] = q + 1
        return self._take_slot(q % S, q)

    def _take_slot(self, s: int, q: int) -> Claim:
        h = self._h
        h["tokens"] += 1
        slot = self._s[s]
        slot["state"], slot["q"], slot["producer"] = CLAIMED, q, self._me
        slot["token"], slot["n"], slot["claimed_at"] = int(h["tokens"]), 0, time.monotonic()
        live = int(np.count_nonzero(self._s["state"][: self.slots] != EMPTY))
        h["live_peak"] = max(int(h["live_peak"]), live)
        return Claim(q, int(h["tokens"]))

    def _valid(self, c: Claim) -> bool:
        slot = self._s[c.q % self.slots]
        return int(slot["state"]) == CLAIMED and int(slot["q"]) == c.q and int(slot["token"]) == c.token

    def slot_view(self, c: Claim) -> memoryview:
        """The bytes of the claimed slot, to write the batch into before :meth:`publish`."""
        s = c.q % self.slots
        return memoryview(self._data)[s * self.stride : (s + 1) * self.stride]

    def publish(self, c: Claim, n: int) -> None:
        """Makes the claimed batch (``n`` samples written into its slot) visible to consumers."""
        with self._mutex:
            if not self._valid(c):
                return  # the group reclaimed it (this member was taken for dead): drop it
            slot = self._s[c.q % self.slots]
            slot["n"], slot["state"] = n, READY
            self._m[self._me]["produced"] += 1

    def publish_error(self, c: Claim, message: str, path: str = "") -> None:
        """Marks the batch as failed: every member that reaches it raises with ``message``."""
        text = json.dumps({"message": message, "path": path}).encode()[: self.stride]
        with self._mutex:
            if not self._valid(c):
                return
            s = c.q % self.slots
            self._data[s * self.stride : s * self.stride + len(text)] = text
            slot = self._s[s]
            slot["n"], slot["state"] = len(text), ERROR

    def unclaim(self, c: Claim) -> None:
        """Gives a claimed batch back to the group (someone else makes it)."""
        with self._mutex:
            if self._valid(c):
                self._s[c.q % self.slots]["state"] = TODO

    # -- consuming -------------------------------------------------------------------------
    def ready(self, q: int) -> bool:
        """Whether batch ``q`` is ready (or failed), without locking: for polling."""
        slot = self._s[q % self.slots]
        return int(slot["q"]) == q and int(slot["state"]) in (READY, ERROR)

    def take(self, q: int) -> Taken:
        """Takes ready batch ``q`` (this member's next): from now on it holds the slot until
        :meth:`hold` 's tensor is freed or :meth:`release` is called."""
        s = q % self.slots
        with self._mutex:
            me, slot = self._m[self._me], self._s[s]
            if int(me["cursor"]) != q:
                raise CoordlError(f"hp_group {self.name!r}: internal error: batch {q} taken out of order")
            if not self.ready(q):
                raise CoordlError(f"hp_group {self.name!r}: internal error: batch {q} is not ready")
            me["cursor"] = q + 1
            me["consumed"] += 1
            if int(slot["state"]) == ERROR:
                info = json.loads(bytes(self._data[s * self.stride : s * self.stride + int(slot["n"])]).decode())
                return Taken(q, s, 0, error=info["message"], error_path=info["path"])
            me["held"] = int(me["held"]) | (1 << s)
            self._holds[s] = (q, None)
            return Taken(q, s, int(slot["n"]))

    def produced_by_me(self, q: int) -> bool:
        slot = self._s[q % self.slots]
        return int(slot["q"]) == q and int(slot["producer"]) == self._me

    def labels_ids(self, t: Taken) -> tuple[np.ndarray, np.ndarray]:
        """Copies of the labels and sample ids of a taken batch."""
        off = t.slot * self.stride + self._images_bytes()
        bs = int(self._h["batch_size"])
        labels = np.frombuffer(self._data, np.int64, t.n, off).copy()
        ids = np.frombuffer(self._data, np.int64, t.n, off + 8 * bs).copy()
        return labels, ids

    def _images_bytes(self) -> int:
        if self._img_bytes is None:
            import torch

            itemsize = torch.empty((), dtype=getattr(torch, self.dtype)).element_size()
            self._img_bytes = int(self._h["batch_size"]) * int(np.prod(self.sample_shape, dtype=np.int64)) * itemsize
        return self._img_bytes

    def shared_images(self, t: Taken) -> memoryview:
        """The image bytes of a taken batch in the shared mapping (copy them, then :meth:`release`)."""
        off = t.slot * self.stride
        return memoryview(self._data)[off : off + self._images_bytes()]

    def private_images(self, t: Taken) -> mmap.mmap:
        """A copy-on-write private mapping of a taken batch's slot: zero-copy for the consumer,
        and writes to it stay private. The slot stays held until the mapping is freed."""
        mm = mmap.mmap(self._data_fd, self.stride, flags=mmap.MAP_PRIVATE,
                       prot=mmap.PROT_READ | mmap.PROT_WRITE, offset=t.slot * self.stride)  # fmt: skip
        self._holds[t.slot] = (t.q, weakref.ref(mm))
        weakref.finalize(mm, self._on_freed, t.slot, t.q)
        return mm

    def _on_freed(self, slot: int, q: int) -> None:
        # Runs wherever the last reference died (maybe inside our own locked code): queue
        # the release and apply it now only if no thread of this process is in the mutex.
        self._freed.append((slot, q))
        if self._closed or not self._mutex.try_enter():
            return
        try:
            self._apply_freed()
        finally:
            self._mutex.__exit__(None, None, None)

    def _apply_freed(self) -> None:
        while self._freed:
            slot, q = self._freed.popleft()
            if self._holds.get(slot, (None,))[0] == q:
                self._drop_hold(slot)

    def _drop_hold(self, slot: int) -> None:
        del self._holds[slot]
        me = self._m[self._me]
        me["held"] = int(me["held"]) & ~(1 << slot)

    def release(self, t: Taken) -> None:
        """Releases a taken batch this member copied out."""
        with self._mutex:
            if self._holds.get(t.slot, (None,))[0] == t.q:
                self._drop_hold(t.slot)

    def release_older(self, q: int) -> None:
        """Releases every held batch before ``q``; one still referenced is first unshared
        (its pages copied into the private mapping), so the caller's tensor never changes."""
        self._release_where(lambda held_q: held_q < q)

    def release_all(self) -> None:
        self._release_where(lambda held_q: True)

    def _release_where(self, pred) -> None:
        with self._mutex:
            self._apply_freed()
            for slot, (held_q, ref) in list(self._holds.items()):
                if not pred(held_q):
                    continue
                mm = ref() if ref is not None else None
                if mm is not None:
                    mm.madvise(MADV_POPULATE_WRITE)
                self._drop_hold(slot)

    # -- health ----------------------------------------------------------------------------
    def health(self) -> None:
        """Reclaims what dead members hold and drops members idle too long; for waiters."""
        with self._mutex:
            self._apply_freed()
            self._health(force=True)

    def _health(self, force: bool) -> None:
        now = time.monotonic()
        if not force and now - self._last_health < 0.2:
            return
        self._last_health = now
        self._reap_dead()

    def _reap_dead(self) -> None:
        for k in range(MAX_MEMBERS):
            m = self._m[k]
            if k == self._me or m["state"] != 1:
                continue
            if not self._dead(k):
                continue
            mine = (self._s["state"][: self.slots] == CLAIMED) & (self._s["producer"][: self.slots] == k)
            self._s["state"][: self.slots][mine] = TODO
            log.warning(
                "coordl: a member of hp_group %r (pid %d) is gone; %d batch(es) it was making go to the others",
                self.name, int(m["pid"]), int(np.count_nonzero(mine)),
            )  # fmt: skip
            m["state"], m["start"], m["cursor"], m["held"], m["iterating"] = 0, -1, -1, 0, 0
        self._try_release()

    def _dead(self, k: int) -> bool:
        try:
            fd = os.open(self._membership.path("member", k), os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:
            return True
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        finally:
            os.close(fd)  # also drops the lock we just took
        return True

    def _drop_idle(self) -> None:
        """Unenrolls members between epochs that have kept a full ring waiting too long."""
        q = int(self._h["released"])
        now = time.monotonic()
        for k in self._enrolled():
            m = self._m[k]
            if k == self._me or m["iterating"] or m["cursor"] > q or now - m["idle_since"] < self.idle_timeout:
                continue
            log.warning(
                "coordl: hp_group %r: member pid %d has not started its next epoch for %.0f s while the others "
                "wait; it rejoins at a later epoch boundary", self.name, int(m["pid"]), now - m["idle_since"],
            )  # fmt: skip
            m["start"], m["cursor"] = -1, -1

    def waiting_on(self, q: int) -> str:
        """Who batch ``q`` waits for, in words, for progress messages."""
        slot = self._s[q % self.slots]
        if int(slot["q"]) == q and int(slot["state"]) == CLAIMED:
            return f"member pid {int(self._m[int(slot['producer'])]['pid'])} is making it"
        blockers = [int(self._m[k]["pid"]) for k in self._enrolled() if int(self._m[k]["cursor"]) <= int(self._h["released"])]
        return f"the staging area is full; the slowest member(s): pid {blockers}" if blockers else "nobody has claimed it yet"

    # -- stats -----------------------------------------------------------------------------
    def stats(self) -> dict:
        S, stride = self.slots, self.stride
        s = self._s[:S]
        live = 0
        for k in range(S):
            st = int(s[k]["state"])
            if st == CLAIMED or (st in (READY, ERROR) and (self._needed(int(s[k]["q"])) or self._held(k))):
                live += 1
        m = self._m
        return {
            "hp_members": int(np.count_nonzero(m["state"] == 1)),
            "staging_bound": S * stride,
            "staging_bytes": live * stride,
            "staging_peak_bytes": int(self._h["live_peak"]) * stride,
        }

    def position(self) -> tuple[int, int]:
        """The group's ``(released, frontier)`` counters."""
        return int(self._h["released"]), int(self._h["frontier"])

    # -- lifetime --------------------------------------------------------------------------
    def close(self) -> None:
        """Leaves the group: claims go back, holds are unshared and released. Idempotent."""
        if self._closed:
            return
        try:
            with self._mutex:
                self._apply_freed()
                for slot, (_, ref) in list(self._holds.items()):
                    mm = ref() if ref is not None else None
                    if mm is not None:
                        mm.madvise(MADV_POPULATE_WRITE)
                    self._drop_hold(slot)
                mine = (self._s["state"][: self.slots] == CLAIMED) & (self._s["producer"][: self.slots] == self._me)
                self._s["state"][: self.slots][mine] = TODO
                m = self._m[self._me]
                m["state"], m["start"], m["cursor"], m["held"], m["iterating"] = 0, -1, -1, 0, 0
                self._try_release()
        finally:
            self._closed = True
            self._detach()

    def _detach(self) -> None:
        if self._me_fd >= 0:
            os.close(self._me_fd)
            self._me_fd = -1
        mutex = getattr(self, "_mutex", None)
        if mutex is not None:
            mutex.close()
            self._mutex = None
        self._h = self._m = self._s = None
        for mm in (self._data, self._ctl):
            if mm is not None:
                with contextlib.suppress(BufferError):
                    mm.close()
        self._data = self._ctl = None
        if self._data_fd >= 0:
            os.close(self._data_fd)
            self._data_fd = -1
        self._membership.leave(remove_if_last=True)


def _slots_for(bound, stride: int, directory: str) -> int:
    free = segment.space(directory).free
    if bound == "auto":
        slots = max(MIN_SLOTS, min(16, (2 << 30) // stride))
    else:
        from coordl.fetch.cache import parse_bytes

        slots = parse_bytes(bound) // stride if isinstance(bound, str) else int(bound) // stride
        if slots < MIN_SLOTS:
            raise ValueError(
                f"hp_staging={bound!r} holds {slots} batch(es) of {stride} bytes; it must hold at least {MIN_SLOTS}"
            )
    slots = min(slots, MAX_SLOTS)
    if slots * stride > free // 2:
        fit = (free // 2) // stride
        if fit < MIN_SLOTS:
            raise SharedMemoryError(
                f"the hp_group staging area needs {MIN_SLOTS} batches of {stride} bytes but {directory} has only "
                f"{free} bytes free; enlarge it (docker run --shm-size) or use a smaller batch"
            )
        log.warning("coordl: staging %d batches instead of %d: %s has %d bytes free", fit, slots, directory, free)
        slots = fit
    return slots


def _mismatch(name: str, theirs: dict, mine: dict) -> str:
    diff = [k for k in sorted(set(theirs) | set(mine)) if theirs.get(k) != mine.get(k)]
    detail = "; ".join(f"{k}: the group has {theirs.get(k)!r}, this job has {mine.get(k)!r}" for k in diff)
    return (
        f"hp_group {name!r} was started by a job with a different configuration ({detail}). Members of a group "
        "must load the same dataset with the same batch size, pipeline and seed; use another hp_group name "
        "for a different configuration"
    )


def _cow_supported(fd: int, length: int) -> bool:
    """Whether private mappings can be unshared in place (MADV_POPULATE_WRITE, Linux 5.14+)."""
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


_areas: weakref.WeakSet = weakref.WeakSet()


def _forget_in_forked_children(area: StagingArea) -> None:
    """A forked child must not keep a member's liveness lock (or a dead member would look alive)."""
    _areas.add(area)
    if len(_areas) == 1 and not getattr(_forget_in_forked_children, "registered", False):
        os.register_at_fork(after_in_child=_close_member_fds)
        _forget_in_forked_children.registered = True


def _close_member_fds() -> None:
    for area in list(_areas):
        if area._me_fd >= 0:
            with contextlib.suppress(OSError):
                os.close(area._me_fd)
            area._me_fd = -1
