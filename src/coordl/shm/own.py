"""Opening coordl's shared files so that only this user's own private files are ever used.

The shm directory (``/dev/shm``) is writable by every local user, and coordl's names in it are
predictable (:mod:`.names`), so another user can make a file, a symbolic link or a FIFO at one of
them first. Every file of coordl's there is therefore:

- made with ``O_CREAT | O_EXCL | O_NOFOLLOW``, mode 0600 (:func:`create_exclusive`): exactly one
  creator wins, a link is never followed, and the umask cannot widen the mode;
- opened with ``O_NOFOLLOW`` and checked with ``fstat`` right after (:func:`open_own`), before a
  byte is read or written or a lock relied on: a regular file, owned by this user, no permission
  bit for the group or others, one link. What fails is closed unread and reported as a
  :class:`ForeignFileError` naming the file, its owner and what is wrong with it.

What is not this user's is never read, written, truncated, locked, followed or unlinked
(:func:`foreign` tells from ``lstat`` alone, for listing and removing). Checks run when a file is
opened or attached, never per sample read.
"""

from __future__ import annotations

import os
import pwd
import stat
from typing import NamedTuple, NoReturn

__all__ = [
    "Foreign",
    "ForeignFileError",
    "create_exclusive",
    "foreign",
    "open_or_create",
    "open_own",
    "owner_name",
    "refuse",
    "wrong",
]

_NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK  # O_NONBLOCK: a planted FIFO never blocks an open


class Foreign(NamedTuple):
    """A file at one of coordl's names that is not this user's own private file."""

    path: str
    uid: int
    why: str  # "a symbolic link", "owned by another user", "mode 0644", ...

    def __str__(self) -> str:
        return f"{self.path} ({self.why}; owner {owner_name(self.uid)})"


class ForeignFileError(PermissionError):
    """Files at coordl's names in the shm directory are not this user's own private files.

    Attributes:
        found: each such file (:class:`Foreign`), which coordl left as it was.
    """

    def __init__(self, message: str, found: tuple[Foreign, ...]):
        super().__init__(message)
        self.found = found

    def __reduce__(self):  # pickled with its files: it crosses processes (a torch worker's, a Ray actor's)
        return type(self), (str(self), self.found)


def owner_name(uid: int) -> str:
    """``uid 1001 (alice)``, or ``uid 23456`` for a uid without a name."""
    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f"uid {uid}"


def wrong(st: os.stat_result, kind: int = stat.S_IFREG, *, one_link: bool = True) -> str | None:
    """What makes the object of ``st`` not this user's own private ``kind`` (a regular file, or
    ``stat.S_IFDIR``); None when it is. ``one_link``: a regular file with a second hard link fails too
    (a link to a file of ours elsewhere; 0 links: unlinked meanwhile, still ours)."""
    if stat.S_ISLNK(st.st_mode):
        return "a symbolic link"
    if stat.S_IFMT(st.st_mode) != kind:
        return "not a folder" if kind == stat.S_IFDIR else "not a regular file"
    if st.st_uid != os.geteuid():
        return "owned by another user"
    if st.st_mode & 0o077:
        return f"mode {stat.S_IMODE(st.st_mode):04o}, open to other users"
    if one_link and kind == stat.S_IFREG and st.st_nlink > 1:
        return f"{st.st_nlink} hard links"
    return None


def foreign(path: str) -> Foreign | None:
    """``path`` as a :class:`Foreign` file if it is not this user's own private file (from
    ``lstat``: a link is not followed); None when it is, or when there is no such file."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    why = wrong(st)
    return None if why is None else Foreign(path, st.st_uid, why)


def refuse(found: list[Foreign] | tuple[Foreign, ...]) -> NoReturn:
    """Raises the :class:`ForeignFileError` of ``found``."""
    found = tuple(found)
    listing = "; ".join(map(str, found))
    raise ForeignFileError(
        f"coordl left alone files at its names that are not this user's own private files: {listing}. It reads, "
        "writes and follows only its own files there (regular files of this user, mode 0600, one link); remove "
        "these with `rm` as their owner or root",
        found,
    )


def _check(fd: int, path: str) -> int:
    """Returns ``fd`` if it is this user's own private file; else closes it and raises."""
    st = os.fstat(fd)
    why = wrong(st)
    if why is None:
        return fd
    os.close(fd)
    refuse([Foreign(path, st.st_uid, why)])


def open_own(path: str, *, write: bool = True) -> int:
    """Opens this user's existing file ``path`` (read-write, or read-only), never through a link,
    and checks it before returning its descriptor.

    Raises:
        FileNotFoundError: there is no such file.
        ForeignFileError: it is not this user's own private file (a link, another user's, open to
            others, not a regular file); it was neither read nor written.
    """
    try:
        fd = os.open(path, (os.O_RDWR if write else os.O_RDONLY) | _NOFOLLOW)
    except FileNotFoundError:
        raise
    except OSError:  # ELOOP: a symlink; EISDIR, ENXIO...: something else that is not ours
        found = foreign(path)
        if found is None:
            raise
        refuse([found])
    return _check(fd, path)


def create_exclusive(path: str) -> int:
    """Creates ``path`` with ``O_EXCL``, never through a link, mode 0600; returns its fd.

    Raises:
        FileExistsError: a file of this user's is there already (attach to it instead).
        ForeignFileError: what is there is not this user's own private file.
    """
    try:
        # The umask cannot widen 0600, and O_EXCL makes exactly one creator win (and fails on a link).
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o600)
    except FileExistsError:
        found = foreign(path)
        if found is not None:
            refuse([found])
        raise


def open_or_create(path: str) -> tuple[int, bool]:
    """This user's file ``path``, made (0600) if there is none: ``(fd, created)``.

    Raises:
        ForeignFileError: what is there is not this user's own private file.
    """
    while True:
        try:
            return create_exclusive(path), True
        except FileExistsError:
            pass
        try:
            return open_own(path), False
        except FileNotFoundError:
            continue  # removed between the two: make it
