"""Where the local tier lives and whose it is: ``<path>/coordl-disk-<uid>``, made and opened so that
nothing another local user made there is ever read, written or followed.

``Disk(path)`` is often shared scratch space (``/tmp``, ``/raid``, ``/local_scratch``) where any
local user can make a name first, and the tier's name is predictable. So:

- ``<path>`` must exist (a mistyped or unmounted path is an error, not a new folder);
- every object of the tier is made exclusively and private: the folder and ``tmp/`` with
  ``mkdir`` (0700), ``ledger`` and ``users`` with ``O_CREAT | O_EXCL`` (0600);
- everything is opened through the folder's descriptor with ``O_NOFOLLOW`` (a symbolic link at one
  of its names fails to open), and checked with ``fstat`` before a byte of it is read or written:
  this user's, no access for group or others, the expected type (and one link for ``ledger`` and
  ``users``).

A tier that fails any check is *foreign*: :class:`ForeignFolderError` names what was found at
each name, its owner and how to remove it, and the loader runs without the tier (from the store).
Another user can thus turn a tier off by making its name first, never feed it data nor make this
user's process write through a link. Inside a private folder no other user can make a name, so the
entries and their sub-folders are this user's (they are opened with ``O_NOFOLLOW`` and checked
too, and one that fails is repaired like a damaged entry).
"""

from __future__ import annotations

import os
import socket
import stat
from dataclasses import dataclass

from coordl import errors
from coordl.fetch.disk.entries import private
from coordl.shm import own

__all__ = ["Folder", "ForeignFolderError", "make_dirs", "open_folder", "tier_folder"]

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE = os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # O_NONBLOCK: a FIFO planted there cannot hang us


class ForeignFolderError(errors.CoordlError):
    """The tier's folder, or a file in it, is not this user's private object (the message names
    each, its owner, and how to remove it): the tier is not used."""


def tier_folder(path: str) -> str:
    """The tier's folder inside ``path`` (one per user: its files are the user's)."""
    return os.path.join(os.path.abspath(os.fspath(path)), f"coordl-disk-{os.geteuid()}")


@dataclass
class Folder:
    """A tier's folder, opened and checked: descriptors of the folder, its ``tmp/``, ``users`` and
    ``ledger`` (those three None when opened without ``create`` and missing)."""

    path: str
    fd: int
    tmp: int | None
    users: int | None
    ledger: int | None

    def close(self) -> None:
        for fd in (self.ledger, self.users, self.tmp, self.fd):
            if fd is not None:
                os.close(fd)
        self.fd = self.tmp = self.users = self.ledger = None


def open_folder(folder: str, *, create: bool) -> Folder | None:
    """Opens the tier's folder ``folder`` (:func:`tier_folder`) and its files, making what is
    missing when ``create``; None when there is no tier there and ``create`` is False.

    Raises:
        ValueError: the folder's parent (``Disk(path)``) does not exist, is not a folder, or this user
            cannot write in it.
        ForeignFolderError: the folder, or a file in it, is not this user's private object.
    """
    parent, name = os.path.split(folder)
    try:
        top = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError, PermissionError) as e:
        raise ValueError(_unusable(parent, e)) from None
    try:
        if create:
            try:
                os.mkdir(name, 0o700, dir_fd=top)
            except FileExistsError:
                pass
            except PermissionError as e:
                raise ValueError(_unusable(parent, e)) from None
        try:
            fd = os.open(name, _DIR, dir_fd=top)
        except FileNotFoundError:
            if create:
                raise
            return None
        except OSError as e:  # a link (ELOOP), a file (ENOTDIR), another user's private folder (EACCES)
            raise ForeignFolderError(_foreign(folder)) from e
        if not private(os.fstat(fd), stat.S_IFDIR):
            os.close(fd)
            raise ForeignFolderError(_foreign(folder))
    finally:
        os.close(top)
    out = Folder(folder, fd, None, None, None)
    try:
        out.tmp = _open_inside(fd, "tmp", create, stat.S_IFDIR)
        out.users = _open_inside(fd, "users", create, stat.S_IFREG)
        out.ledger = _open_inside(fd, "ledger", create, stat.S_IFREG)
        if out.users is not None and out.ledger is not None:
            a, b = os.fstat(out.users), os.fstat(out.ledger)
            if (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino):
                raise _Foreign
    except _Foreign:
        out.close()
        raise ForeignFolderError(_foreign(folder)) from None
    except BaseException:
        out.close()
        raise
    return out


def _unusable(parent: str, e: OSError) -> str:
    why = {FileNotFoundError: "does not exist", NotADirectoryError: "is not a folder"}.get(
        type(e), "is not a folder this user can write in"
    )
    return (
        f"Disk(path={parent!r}) {why} on {socket.gethostname()}: the local tier is made inside an existing folder "
        "this user can write in (is the drive mounted, and the path spelt right?); make the folder, or give "
        "Disk(path) another one"
    )


def make_dirs(fd: int, rel: str) -> int:
    """Makes the entry folders of ``rel`` (``ab/cd``) under the folder ``fd`` that are missing
    (0700): the bytes the folders it made take on disk."""
    made = 0
    parts = rel.split(os.sep)
    for k in range(1, len(parts) + 1):
        sub = os.path.join(*parts[:k])
        try:
            os.mkdir(sub, 0o700, dir_fd=fd)
        except FileExistsError:
            continue
        made += os.stat(sub, dir_fd=fd, follow_symlinks=False).st_blocks * 512
    return made


class _Foreign(Exception):
    """A file or folder inside the tier failed its check."""


def _open_inside(fd: int, name: str, create: bool, kind: int) -> int | None:
    """``name`` in the folder ``fd``, a private folder (``stat.S_IFDIR``) or file of this user's with one
    link, made (0700 or 0600) when ``create`` and missing, never through a link; None when missing and not
    made. Raises :class:`_Foreign` for anything else there."""
    folder = kind == stat.S_IFDIR
    if create:
        try:
            if not folder:
                return os.open(name, _FILE | os.O_CREAT | os.O_EXCL, 0o600, dir_fd=fd)
            os.mkdir(name, 0o700, dir_fd=fd)
        except FileExistsError:
            pass
    try:
        sub = os.open(name, _DIR if folder else _FILE, dir_fd=fd)
    except FileNotFoundError:
        if create:
            raise
        return None
    except OSError:
        raise _Foreign from None
    if own.wrong(os.fstat(sub), kind) is not None:
        os.close(sub)
        raise _Foreign
    return sub


def _foreign(folder: str) -> str:
    """The message naming what lies at the tier's names (looked at with lstat: nothing is followed)."""
    found, owners = [], set()
    try:
        st = os.lstat(folder)
    except OSError:
        st = None
    names = [(folder, st)]
    if st is not None and stat.S_ISDIR(st.st_mode):
        for name in ("ledger", "users", "tmp"):
            path = os.path.join(folder, name)
            try:
                names.append((path, os.lstat(path)))
            except OSError:
                pass
    for path, st in names:
        if st is None:
            continue
        bad = own.wrong(st, stat.S_IFDIR if path == folder or path.endswith("/tmp") else stat.S_IFREG) is not None
        if bad or path == folder:
            found.append(f"{path} ({_describe(path, st)})")
            if st.st_uid != os.geteuid():
                owners.add(own.owner_name(st.st_uid))
    me = own.owner_name(os.geteuid())
    owners_text = " or ".join(sorted(owners)) if owners else me
    return (
        f"the local tier at {folder} is not this user's ({me}) to use: {', '.join(found)}. coordl neither reads, "
        f"writes nor follows it, and the tier is off for this run (the samples come from the store). Remove it "
        f"(rm -rf {folder}, as {owners_text} or root), or give Disk(path) another folder"
    )


def _describe(path: str, st: os.stat_result) -> str:
    kind = {stat.S_IFDIR: "a folder", stat.S_IFREG: "a file", stat.S_IFLNK: "a symbolic link"}.get(
        stat.S_IFMT(st.st_mode), "a special file"
    )
    text = f"{kind} of {own.owner_name(st.st_uid)}, mode {stat.S_IMODE(st.st_mode):04o}"
    if stat.S_ISLNK(st.st_mode):
        try:
            text += f", to {os.readlink(path)}"
        except OSError:
            pass
    elif stat.S_ISREG(st.st_mode) and st.st_nlink != 1:
        text += f", {st.st_nlink} links"
    return text
