"""The ``coordl cache`` command's side of the local tier: what a tier holds (:func:`describe`),
removing it (:func:`remove`), and checking every entry and the ledger against the folder
(:func:`verify`). Each opens the folder with the checks of :mod:`~coordl.fetch.disk.folder`, and
refuses (:class:`~coordl.fetch.disk.folder.ForeignFolderError`) a tier that is not this user's
private folder: nothing in it is read, removed or followed.
"""

from __future__ import annotations

import fcntl
import os
import stat
import zlib
from dataclasses import dataclass, field

import numpy as np

from coordl.fetch.disk.entries import HEADER, MAGIC, VERSION, is_entry_name, private, walk
from coordl.fetch.disk.folder import open_folder, tier_folder
from coordl.fetch.disk.ledger import Ledger, Usage
from coordl.units import format_bytes

__all__ = ["Report", "describe", "remove", "verify"]

_CHUNK = 1 << 20  # bytes verify reads at a time


def describe(path: str) -> Usage | None:
    """What the tier under ``path`` takes on disk, its budget and its reservations; None when there
    is no tier there.

    Raises:
        ForeignFolderError: the tier's folder is not this user's private folder.
    """
    opened = open_folder(tier_folder(path), create=False)
    if opened is None:
        return None
    try:
        return Ledger(opened.ledger).usage() if opened.ledger is not None else Usage(0, 0, 0)
    finally:
        opened.close()


def remove(path: str) -> bool | None:
    """Removes the tier under ``path``: True; False when a running process uses it; None when there is none.

    Raises:
        ForeignFolderError: the tier's folder is not this user's private folder (left as it is).
    """
    folder = tier_folder(path)
    opened = open_folder(folder, create=False)
    if opened is None:
        return None
    try:
        if opened.users is not None:
            try:
                fcntl.flock(opened.users, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False
        _empty(opened.fd)
        parent = os.open(os.path.dirname(folder), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            here = os.stat(os.path.basename(folder), dir_fd=parent, follow_symlinks=False)
            mine = os.fstat(opened.fd)
            if (here.st_dev, here.st_ino) == (mine.st_dev, mine.st_ino):
                os.rmdir(os.path.basename(folder), dir_fd=parent)
        finally:
            os.close(parent)
        return True
    finally:
        opened.close()


@dataclass
class Report:
    """What :func:`verify` found in a tier and fixed."""

    folder: str
    busy: bool = False  # a running process uses the tier: nothing was checked
    entries: int = 0  # entries found whole
    on_disk: int = 0  # what they and the entry folders take on disk (du -B1)
    removed: list[str] = field(default_factory=list)  # "<entry>: <why>" for each entry removed
    left: list[str] = field(default_factory=list)  # what lies where entries do and could not be removed
    dead_files: int = 0  # files killed writers left in tmp/
    ledger: Usage | None = None  # what the ledger said before
    slots: list = field(default_factory=list)  # (slot, bytes, pid) reservations of writers that are gone

    @property
    def clean(self) -> bool:
        """Whether the tier was whole: no entry removed, nothing left in tmp/, the ledger right."""
        ledger_right = self.ledger is not None and self.ledger.used == self.on_disk and not self.ledger.reserved
        return not (self.busy or self.removed or self.left or self.dead_files or self.slots) and ledger_right

    def lines(self) -> list[str]:
        """The report, line by line, as ``coordl cache verify`` prints it."""
        if self.busy:
            return [f"left the local-storage tier {self.folder}: a running process uses it; verify it when none does"]
        out = [
            f"checked the local-storage tier {self.folder}: {self.entries} entries whole, "
            f"{format_bytes(self.on_disk)} on disk ({self.on_disk} bytes) with their folders"
        ]
        out += [f"removed {line}" for line in self.removed]
        out += [f"left {line}" for line in self.left]
        if self.dead_files:
            out.append(f"removed {self.dead_files} file(s) that killed writers left in tmp/")
        before = self.ledger
        if before is None or before.used != self.on_disk:
            said = "was unreadable" if before is None else f"counted {before.used} bytes"
            out.append(f"the ledger {said}; it counts {self.on_disk} bytes now, what the folder takes")
        for k, n, pid in self.slots:
            out.append(f"released {n} bytes reserved by writer slot {k} (pid {pid}), which is gone")
        out.append("the tier was clean" if self.clean else "the tier is clean now")
        return out


def verify(path: str) -> Report | None:
    """Checks every entry of the tier under ``path`` (its name, this user's private file, header,
    size, stamp, CRC-32) and removes those that fail, removes what killed writers left in ``tmp/``,
    and sets the ledger to what the folder takes on disk, releasing every reservation. Only alone
    with the tier (``busy`` otherwise). None when there is no tier.

    An entry's stamp says which version of the sample it holds; whether that version is the
    store's is known only to a run's index, which checks it when the entry is read.

    Raises:
        ForeignFolderError: the tier's folder is not this user's private folder (nothing is read).
    """
    folder = tier_folder(path)
    if open_folder(folder, create=False) is None:
        return None
    opened = open_folder(folder, create=True)  # ledger, users and tmp/ made if missing
    report = Report(folder)
    try:
        try:
            fcntl.flock(opened.users, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            report.busy = True
            return report
        for rel, st, is_entry in walk(opened.fd):
            if not is_entry:
                report.on_disk += st.st_blocks * 512
                if not private(st, stat.S_IFDIR):
                    mode = stat.S_IMODE(st.st_mode)
                    report.left.append(f"{rel}: not a private folder of this user (mode {mode:04o})")
                continue
            why = _fault(opened.fd, rel, st)
            if why is None:
                report.entries += 1
                report.on_disk += st.st_blocks * 512
            elif stat.S_ISDIR(st.st_mode):
                report.left.append(f"{rel}: {why}")
                report.on_disk += st.st_blocks * 512
            else:
                os.unlink(rel, dir_fd=opened.fd)
                report.removed.append(f"{rel}: {why}")
        for name in os.listdir(opened.tmp):
            os.unlink(name, dir_fd=opened.tmp)
            report.dead_files += 1
        ledger = Ledger(opened.ledger)
        report.ledger, report.slots = ledger.reconcile(report.on_disk)
        return report
    finally:
        opened.close()


def _fault(fd: int, rel: str, st: os.stat_result) -> str | None:
    """What is wrong with the entry at ``rel`` (None: nothing)."""
    if not is_entry_name(rel):
        return "not an entry's name"
    if stat.S_ISLNK(st.st_mode):
        return "a symbolic link"
    if not private(st):
        return f"not a private file of this user (mode {stat.S_IMODE(st.st_mode):04o}, uid {st.st_uid})"
    try:
        f = os.open(rel, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=fd)
    except OSError as e:
        return f"unreadable ({e.strerror})"
    try:
        raw = os.pread(f, HEADER.itemsize, 0)
        if len(raw) < HEADER.itemsize:
            return f"cut inside its header ({len(raw)} of {HEADER.itemsize} bytes)"
        h = np.frombuffer(raw, HEADER)[0]
        if h["magic"] != MAGIC or h["version"] != VERSION:
            return "its header is not an entry's (magic or version)"
        if not h["stamp"].any():
            return "its header has no stamp"
        size, have = int(h["size"]), os.fstat(f).st_size - HEADER.itemsize
        if have != size:
            return f"{'cut in' if have < size else 'longer than'} its payload ({have} of {size} bytes)"
        crc, at = 0, HEADER.itemsize
        while at < HEADER.itemsize + size:
            chunk = os.pread(f, _CHUNK, at)
            if not chunk:
                return "cut while it was read"
            crc = zlib.crc32(chunk, crc)
            at += len(chunk)
        os.posix_fadvise(f, 0, 0, os.POSIX_FADV_DONTNEED)
        if crc != int(h["crc"]):
            return "its bytes do not match their CRC-32"
        return None
    finally:
        os.close(f)


def _empty(fd: int) -> None:
    """Removes everything inside the folder ``fd``, following no link."""
    for name in os.listdir(fd):
        st = os.stat(name, dir_fd=fd, follow_symlinks=False)
        if stat.S_ISDIR(st.st_mode):
            sub = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            try:
                _empty(sub)
            finally:
                os.close(sub)
            os.rmdir(name, dir_fd=fd)
        else:
            os.unlink(name, dir_fd=fd)
