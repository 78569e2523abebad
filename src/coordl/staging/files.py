"""A staging area's two shared files: made by the group's first member, checked and mapped by the others.

``stage`` holds the records (:mod:`coordl.staging.layout`), ``batches`` the slots. Both are
made exclusively and opened only as this user's own private files (:mod:`coordl.shm.own`).
The first member reserves both up front with ``posix_fallocate`` (the staging memory
bound) and sets the header's ``magic`` last; a later member checks the version and
that its configuration is the group's.
"""

from __future__ import annotations

import errno
import json
import mmap
import os
from typing import NamedTuple

from coordl.errors import CoordlError, GroupConfigError, SharedMemoryError
from coordl.shm import group, own, segment
from coordl.staging.layout import (
    CONFIG_BYTES,
    CONTROL_BYTES,
    HEADER_BYTES,
    MAGIC,
    VERSION,
    records,
    slot_stride,
    slots_for,
)

__all__ = ["Mapped", "attach", "create"]


class Mapped(NamedTuple):
    """The mappings of a staging area's files."""

    ctl: mmap.mmap  # the ``stage`` file
    data_fd: int  # the ``batches`` file, kept open for private mappings of its slots
    data: mmap.mmap


def create(
    membership: group.Membership,
    config: str,
    *,
    batch_size: int,
    nb: int,
    shape: tuple[int, ...],
    dtype: str,
    epoch: int,
    bound,
) -> Mapped:
    """Makes the files of a new staging area (``nb`` batches per pass; ``bound``: ``hp_staging``).

    Raises:
        ValueError: ``config`` (JSON) is too large, or ``bound`` too small.
        SharedMemoryError: the shm directory has no room for the area.
        ForeignFileError: another user made a file at one of their names first.
    """
    stride = slot_stride(batch_size, shape, dtype)
    slots = slots_for(bound, stride, membership.directory)
    encoded = config.encode()
    if len(encoded) > CONFIG_BYTES:
        raise ValueError("the hp_group configuration is too large to stage")
    fd = own.create_exclusive(membership.path("stage"))
    try:
        segment.reserve(fd, CONTROL_BYTES)
        ctl = segment.map_fd(fd, CONTROL_BYTES)
    finally:
        os.close(fd)
    try:
        dfd = own.create_exclusive(membership.path("batches"))
    except BaseException:
        ctl.close()
        raise
    try:
        segment.reserve(dfd, slots * stride)
    except OSError as e:
        os.close(dfd)
        ctl.close()
        if e.errno == errno.ENOSPC:
            raise SharedMemoryError(
                f"no room for the hp_group staging area ({slots} batches of {stride} bytes) in "
                f"{membership.directory}; pass a smaller HPGroup(staging=...) or free shared memory"
            ) from None
        raise
    data = segment.map_fd(dfd, slots * stride)
    h, _, _ = records(ctl)
    h["version"], h["slots"], h["stride"] = VERSION, slots, stride
    h["batch_size"], h["nb"], h["epoch_offset"] = batch_size, nb, epoch
    h["ndim"], h["dtype"] = len(shape), dtype.encode()
    h["shape"][: len(shape)] = shape
    h["config_len"] = len(encoded)
    ctl[HEADER_BYTES : HEADER_BYTES + len(encoded)] = encoded
    h["magic"] = MAGIC  # last: a header with the magic is complete
    return Mapped(ctl, dfd, data)


def attach(membership: group.Membership, name: str, config: str) -> Mapped:
    """Maps the files of group ``name``'s staging area.

    Raises:
        CoordlError: another coordl version made them.
        GroupConfigError: the group's configuration is not ``config``.
        ForeignFileError: one of them is not this user's own private file.
    """
    fd = own.open_own(membership.path("stage"))
    try:
        dfd = own.open_own(membership.path("batches"))  # both checked before either is read
    except BaseException:
        os.close(fd)
        raise
    try:
        ctl = segment.map_fd(fd, os.fstat(fd).st_size)
    except BaseException:
        os.close(dfd)
        raise
    finally:
        os.close(fd)
    h, _, _ = records(ctl)
    if int(h["magic"]) != MAGIC or int(h["version"]) != VERSION:
        os.close(dfd)
        raise CoordlError(f"hp_group {name!r}: its staging area was made by another coordl version")
    theirs = bytes(ctl[HEADER_BYTES : HEADER_BYTES + int(h["config_len"])]).decode()
    if theirs != config:
        os.close(dfd)
        raise GroupConfigError(_mismatch(name, json.loads(theirs), json.loads(config)))
    return Mapped(ctl, dfd, segment.map_fd(dfd, int(h["slots"]) * int(h["stride"])))


def _mismatch(name: str, theirs: dict, mine: dict) -> str:
    diff = [k for k in sorted(set(theirs) | set(mine)) if theirs.get(k) != mine.get(k)]
    detail = "; ".join(f"{k}: the group has {theirs.get(k)!r}, this job has {mine.get(k)!r}" for k in diff)
    return (
        f"hp_group {name!r} was started by a job with a different configuration ({detail}). Members of a group "
        "must load the same dataset with the same pipeline, shuffling and seed; use another hp_group name "
        "for a different configuration"
    )
