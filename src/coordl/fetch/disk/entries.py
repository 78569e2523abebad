"""One sample's entry in the local tier: its name, its header, the checks a reader makes, and the
walk over a tier's entries.

An entry is the file ``ab/cd/abcd...`` (the first 32 hex digits of the SHA-256 of the sample's
path) holding a :data:`HEADER` and the sample's bytes. A reader takes an entry only when it is a
private regular file of this user whose header names the sample's size and stamp and whose bytes
match the CRC-32 written with them: :func:`judge` says which of :data:`GOOD`, :data:`STALE` (another
version of the sample: its stamp differs) or :data:`DAMAGED` (anything else) it is.
"""

from __future__ import annotations

import hashlib
import os
import re
import stat
import zlib

import numpy as np

from coordl.shm import own

__all__ = [
    "ABSENT",
    "DAMAGED",
    "GOOD",
    "HEADER",
    "MAGIC",
    "STALE",
    "VERSION",
    "crc",
    "entry_name",
    "header",
    "is_entry_name",
    "judge",
    "private",
    "walk",
    "write_all",
]

MAGIC = b"coordlds"
VERSION = 1
HEADER = np.dtype(
    [
        ("magic", "S8"),
        ("version", "<u4"),
        ("crc", "<u4"),  # zlib.crc32 of the sample's bytes
        ("size", "<u8"),
        ("stamp", "u1", (16,)),  # see stamps.stamp(); raw bytes (an "S16" field would drop trailing NULs)
        ("reserved", "V24"),
    ]
)  # 64 bytes

# What a reader found for a sample (read_into's answer, one per sample).
ABSENT = 0  # no entry
GOOD = 1  # read whole and checked
STALE = 2  # an entry of another version of the sample (its stamp differs): to be replaced
DAMAGED = 3  # cut, flipped, not this user's private file: to be repaired

_HEX = re.compile(r"[0-9a-f]{32}")


def entry_name(path: str) -> str:
    """The entry's file, relative to the tier's folder: ``ab/cd/abcd...``."""
    h = hashlib.sha256(path.encode("utf-8", "surrogateescape")).hexdigest()[:32]
    return os.path.join(h[:2], h[2:4], h)


def header(size: int, stamp: bytes, crc_: int) -> np.ndarray:
    """The header of an entry of ``size`` bytes of version ``stamp`` whose CRC-32 is ``crc_``."""
    head = np.zeros(1, HEADER)
    head["magic"], head["version"], head["size"], head["crc"] = MAGIC, VERSION, size, crc_
    head["stamp"] = np.frombuffer(stamp, np.uint8)
    return head


def private(st: os.stat_result, kind: int = stat.S_IFREG) -> bool:
    """Whether ``st`` is of this user, of type ``kind``, with no access for group or others (the rule of
    :func:`coordl.shm.own.wrong`; an entry may have two links while it is being published)."""
    return own.wrong(st, kind, one_link=False) is None


def judge(head: np.ndarray, got: int, size: int, stamp: bytes, views) -> int:
    """What an entry read into ``head`` and ``views`` is (``got``: bytes the read returned, which
    asked for one byte more than the entry should hold): :data:`GOOD`, :data:`STALE` or
    :data:`DAMAGED`."""
    if got < HEADER.itemsize:
        return DAMAGED  # cut inside its header
    h = head[0]
    if h["magic"] != MAGIC or h["version"] != VERSION:
        return DAMAGED
    if h["stamp"].tobytes() != stamp:
        return STALE  # another version of the sample (or a stamp damaged: rewritten either way)
    if got != HEADER.itemsize + size or h["size"] != size or crc(views) != int(h["crc"]):
        return DAMAGED  # cut in its payload, longer than it should be, or its bytes changed
    return GOOD


def crc(views) -> int:
    """The CRC-32 of the bytes of ``views``, one after the other."""
    out = 0
    for v in views:
        out = zlib.crc32(v, out)
    return out


def write_all(fd: int, views: list) -> None:
    """Writes every byte of ``views`` to ``fd``."""
    views = [memoryview(v).cast("B") for v in views]
    while views:
        n = os.writev(fd, views)
        while views and n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        if views and n:
            views[0] = views[0][n:]


def walk(fd: int):
    """What lies in the tier's entry folders under the folder ``fd``: ``(relative path, lstat,
    whether it is where an entry lies)`` for each entry folder (``ab/``, ``ab/cd/``) and each thing
    inside them (an entry, or something else where an entry would lie: :func:`is_entry_name` and
    the lstat tell). The tier's other names (``ledger``, ``users``, ``tmp/``) are left out."""
    for name in sorted(os.listdir(fd)):
        if _is_hex(name, 2):
            yield from _level(fd, name, 1)


def is_entry_name(rel: str) -> bool:
    """Whether ``rel`` is where an entry lies: ``ab/cd/abcd...``."""
    parts = rel.split(os.sep)
    return len(parts) == 3 and _HEX.fullmatch(parts[2]) is not None and parts[2][:4] == parts[0] + parts[1]


def _level(fd: int, rel: str, depth: int):
    """``rel`` (at ``depth``: 1 for ``ab``, 2 for ``ab/cd``, 3 for an entry) and what it holds."""
    try:
        st = os.stat(rel, dir_fd=fd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if depth == 3 or not (stat.S_ISDIR(st.st_mode) and _is_hex(os.path.basename(rel), 2)):
        yield rel, st, True
        return
    yield rel, st, False
    try:
        sub = os.open(rel, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
    except OSError:
        return
    try:
        names = sorted(os.listdir(sub))
    finally:
        os.close(sub)
    for name in names:
        yield from _level(fd, os.path.join(rel, name), depth + 1)


def _is_hex(name: str, n: int) -> bool:
    return len(name) == n and all(c in "0123456789abcdef" for c in name)
