"""Membership of a group of shared segments, with liveness from the kernel.

A group is every segment named ``coordl.<fingerprint>.*``. Each process that uses
the group holds a shared ``flock`` on the group's ``lock`` file for as long as it is
attached; the kernel drops that lock when the process exits or is killed, so "is
anyone using this group?" is answered by trying an exclusive lock, never by a
counter that a crash would leave wrong.

Decisions that depend on who else is attached (initialising the segments when
first, reclaiming what a dead process left half-done when alone, removing the
group when last) are made while holding an exclusive lock on the group's ``init``
file, so that a process joining and a process leaving never both decide at once.
A process that finds the lock file unlinked after locking it (the last user
removed the group meanwhile) starts over.

Every file is made and opened through :mod:`.own`: a group with a file at one of its names
that is not this user's own private file is not joined (:class:`~.own.ForeignFileError` names
them all), and nobody here reads, locks or removes such a file.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Callable, Iterator

from coordl.shm import names, own

__all__ = ["Membership", "foreign_files", "group_files", "remove_group", "try_lock_unused"]


def _open_locked(path: str, op: int) -> int | None:
    """Opens (creating, 0600) and flocks ``path``; None if the file was unlinked meanwhile."""
    fd, _ = own.open_or_create(path)
    try:
        fcntl.flock(fd, op)
        st = os.fstat(fd)
        try:
            now = os.stat(path)
        except FileNotFoundError:
            now = None
        if now is None or (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
            os.close(fd)
            return None
        return fd
    except BaseException:
        os.close(fd)
        raise


def _lock_retrying(path: str, op: int) -> int:
    while True:
        fd = _open_locked(path, op)
        if fd is not None:
            return fd


def group_files(fingerprint: str, directory: str | None = None) -> list[str]:
    """Every file at one of the group's names (:func:`names.parse_name`), lock files last (they
    are removed last), whoever made it."""
    directory = directory or names.shm_dir()
    try:
        entries = os.listdir(directory)
    except FileNotFoundError:
        return []
    kinds = {e: parsed[1] for e in entries if (parsed := names.parse_name(e)) is not None and parsed[0] == fingerprint}
    order = {"init": 2, "lock": 1}
    return [os.path.join(directory, e) for e in sorted(kinds, key=lambda e: order.get(kinds[e], 0))]


def foreign_files(fingerprint: str, directory: str | None = None) -> list[own.Foreign]:
    """The files at the group's names that are not this user's own private files (:func:`own.foreign`)."""
    return [f for path in group_files(fingerprint, directory) if (f := own.foreign(path)) is not None]


def remove_group(fingerprint: str, directory: str | None = None, *, keep_locks: bool = False) -> int:
    """Unlinks every file of the group that is this user's own; returns the bytes freed. Caller
    holds the locks. A file another user made at one of its names is left where it is.

    Args:
        keep_locks: leave the ``lock`` and ``init`` files (the caller stays attached).
    """
    freed = 0
    locks = {names.segment_name(fingerprint, "lock"), names.segment_name(fingerprint, "init")}
    for path in group_files(fingerprint, directory):
        if keep_locks and os.path.basename(path) in locks:
            continue
        if own.foreign(path) is not None:
            continue
        with contextlib.suppress(FileNotFoundError):
            freed += os.lstat(path).st_blocks * 512
            os.unlink(path)
    return freed


def _lock_init_if_exists(fingerprint: str, directory: str) -> int | None:
    """Locks the group's init file exclusively without creating a group that is gone; None if gone."""
    path = os.path.join(directory, names.segment_name(fingerprint, "init"))
    while True:
        try:
            fd = own.open_own(path)
        except FileNotFoundError:
            if not any(own.foreign(p) is None for p in group_files(fingerprint, directory)):
                return None  # nothing of ours: gone, or only what another user made
            # Files without an init lock: a removal was interrupted. Lock to finish it.
            fd, _ = own.open_or_create(path)
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            now = os.stat(path)
        except FileNotFoundError:
            now = None
        st = os.fstat(fd)
        if now is not None and (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino):
            return fd
        os.close(fd)  # the last user removed the group while we waited; look again


@contextlib.contextmanager
def try_lock_unused(fingerprint: str, directory: str | None = None) -> Iterator[bool | None]:
    """Yields True, holding the group's locks, if no live process is attached to the group;
    False if one is; None if the group no longer exists (or has no file of this user's). Creates
    nothing for a group that is gone.

    Raises:
        ForeignFileError: the group's ``init`` or ``lock`` file is not this user's own.
    """
    directory = directory or names.shm_dir()
    init_fd = _lock_init_if_exists(fingerprint, directory)
    if init_fd is None:
        yield None
        return
    try:
        lock_path = os.path.join(directory, names.segment_name(fingerprint, "lock"))
        try:
            fd = own.open_own(lock_path)
        except FileNotFoundError:
            yield True  # attaching creates the lock file under the init lock we hold: nobody is attached
            return
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                yield False
                return
            yield True
        finally:
            os.close(fd)
    finally:
        os.close(init_fd)


class Membership:
    """This process's attachment to a group; held until :meth:`leave`.

    Args:
        fingerprint: the group's fingerprint.
        directory: the shm directory (default :func:`names.shm_dir`).
    """

    def __init__(self, fingerprint: str, directory: str | None = None):
        self.fingerprint = fingerprint
        self.directory = directory or names.shm_dir()
        self._lock_fd: int | None = None

    def path(self, kind: str, ident: int | str | None = None) -> str:
        """The path of one of the group's files."""
        return os.path.join(self.directory, names.segment_name(self.fingerprint, kind, ident))

    def join(self, setup: Callable[[bool], None]) -> None:
        """Attaches to the group, calling ``setup(alone)`` under the group's init lock.

        ``alone`` is True when no other live process is attached: ``setup`` may then
        create, validate or repair the segments freely. With ``alone`` False it
        attaches to what the others use. If ``setup`` raises, this process is not attached
        (and, when alone, the group's files are removed).

        Raises:
            ForeignFileError: a file at one of the group's names is not this user's own private
                file (another user's, a link, open to others): the group is not joined and
                nothing of it is read.
        """
        if self._lock_fd is not None:
            raise RuntimeError("already joined")
        found = foreign_files(self.fingerprint, self.directory)
        if found:
            own.refuse(found)  # before a file of the group is made or opened
        init_fd = _lock_retrying(self.path("init"), fcntl.LOCK_EX)
        try:
            lock_fd = _lock_retrying(self.path("lock"), fcntl.LOCK_SH)
            alone = False
            try:
                alone = self._alone_except_me(lock_fd)
                setup(alone)
            except BaseException:
                if alone:  # nobody else uses what setup left half-made
                    remove_group(self.fingerprint, self.directory)
                os.close(lock_fd)
                raise
            self._lock_fd = lock_fd
        finally:
            os.close(init_fd)

    def _alone_except_me(self, lock_fd: int) -> bool:
        # flock has no "count the holders" call: drop our shared lock, test for an
        # exclusive one, and take the shared lock back. Safe because every joiner
        # and leaver decides under the init lock, which we hold.
        fcntl.flock(lock_fd, fcntl.LOCK_UN)
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            alone = True
        except BlockingIOError:
            alone = False
        fcntl.flock(lock_fd, fcntl.LOCK_SH)
        return alone

    def forget(self) -> None:
        """Closes this process's descriptor of the lock without unlocking it: for a forked
        child's copy of its parent's membership (the lock lives on with the parent's)."""
        fd, self._lock_fd = self._lock_fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)

    def leave(self, remove_if_last: bool, on_last: Callable[[], None] | None = None) -> bool:
        """Detaches; returns True if this was the last process attached.

        Args:
            remove_if_last: unlink every file of the group when last.
            on_last: called (under the init lock) when last, before any removal.
        """
        if self._lock_fd is None:
            return False
        init_fd = _lock_retrying(self.path("init"), fcntl.LOCK_EX)
        try:
            lock_fd, self._lock_fd = self._lock_fd, None
            try:
                fcntl.flock(lock_fd, fcntl.LOCK_UN)
                try:
                    fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    return False
                if on_last is not None:
                    on_last()
                if remove_if_last:
                    remove_group(self.fingerprint, self.directory)
                return True
            finally:
                os.close(lock_fd)
        finally:
            os.close(init_fd)
