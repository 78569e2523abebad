"""Who in a staging area is alive, from the kernel: member lock files, dead and idle members, forks.

Member ``k`` holds an exclusive ``flock`` on its file ``member.<k>`` while it lives;
the kernel drops it when the process dies, ``kill -9`` included, so a member whose file
can be locked is dead. A forked child closes its copy of the descriptor: else the
child would keep the lock, and a dead parent would look alive.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import time
import weakref

from coordl.shm import group, own
from coordl.staging.ring import Ring

__all__ = ["MemberLock", "drop_idle", "is_dead", "lock_path", "reap_dead"]

log = logging.getLogger(__name__)


class MemberLock:
    """This process's ``flock`` on a member file: the proof that the member lives.

    Not inherited: a forked child closes its copy of the descriptor.
    """

    _held: weakref.WeakSet = weakref.WeakSet()
    _fork_hook = False

    def __init__(self, fd: int):
        self._fd = fd
        MemberLock._held.add(self)
        if not MemberLock._fork_hook:
            os.register_at_fork(after_in_child=MemberLock._forget_in_child)
            MemberLock._fork_hook = True

    @classmethod
    def take(cls, path: str) -> MemberLock | None:
        """Locks the member file ``path``; None if a member still holds it (one still leaving)."""
        fd, _ = own.open_or_create(path)  # this user's own file, or a ForeignFileError
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        return cls(fd)

    def release(self) -> None:
        """Closes the descriptor (in the process that took the lock: the member is gone). Idempotent."""
        if self._fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = -1

    @staticmethod
    def _forget_in_child() -> None:
        for lock in list(MemberLock._held):
            lock.release()


def lock_path(membership: group.Membership, k: int) -> str:
    """The lock file of member ``k`` (``member.<k>``)."""
    return membership.path("member", k)


def is_dead(path: str) -> bool:
    """Whether the member whose lock file is ``path`` is gone (its lock can be taken).

    Raises:
        ForeignFileError: the file is not this user's own (replaced in a shm directory that is
            not sticky): the member's liveness cannot be known.
    """
    try:
        fd = own.open_own(path)
    except FileNotFoundError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)  # also drops the lock we just took
    return True


def reap_dead(ring: Ring, me: int, membership: group.Membership, name: str) -> None:
    """Clears the records of the dead members (their claims go to the others), then releases
    what nobody needs any more. The caller holds the mutex.

    Args:
        ring: the group's records.
        me: this member, alive by definition.
        membership: the group's files.
        name: the group's name, for the log.
    """
    for k in range(len(ring.m)):
        if k == me or ring.m[k]["state"] != 1 or not is_dead(lock_path(membership, k)):
            continue
        pid = int(ring.m[k]["pid"])
        requeued = ring.remove_member(k)
        log.warning(
            "coordl: a member of hp_group %r (pid %d) is gone; %d batch(es) it was making go to the others",
            name,
            pid,
            requeued,
        )
    ring.try_release()


def drop_idle(ring: Ring, me: int, idle_timeout: float, name: str) -> None:
    """Unenrolls members between epochs that have kept a full ring waiting longer than
    ``idle_timeout`` seconds; they rejoin at a later pass. The caller holds the mutex."""
    q = int(ring.h["released"])
    now = time.monotonic()
    for k in ring.enrolled():
        m = ring.m[k]
        if k == me or m["iterating"] or m["cursor"] > q or now - m["idle_since"] < idle_timeout:
            continue
        log.warning(
            "coordl: hp_group %r: member pid %d has not started its next epoch for %.0f s while the others "
            "wait; it rejoins at a later epoch boundary",
            name,
            int(m["pid"]),
            now - m["idle_since"],
        )
        m["start"], m["cursor"] = -1, -1
