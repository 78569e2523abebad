"""Shared-memory segments: reserved space, mapping, free space (made and opened by :mod:`.own`)."""

from __future__ import annotations

import errno
import mmap
import os
from dataclasses import dataclass

__all__ = ["ShmSpace", "map_fd", "reserve", "space"]


@dataclass(frozen=True)
class ShmSpace:
    """Size and free bytes of the filesystem holding the shm directory."""

    total: int
    free: int


def space(directory: str) -> ShmSpace:
    """Returns the total and free bytes of the filesystem that holds ``directory``."""
    st = os.statvfs(directory)
    return ShmSpace(total=st.f_blocks * st.f_frsize, free=st.f_bavail * st.f_frsize)


def reserve(fd: int, size: int, offset: int = 0) -> None:
    """Reserves ``size`` bytes of ``fd`` from ``offset`` before anything is written to them.

    On tmpfs, writing to a page of a sparse mapping when the filesystem is full
    raises ``SIGBUS`` and kills the process; ``posix_fallocate`` instead fails
    cleanly with ``ENOSPC`` up front, so a full ``/dev/shm`` is an error we can handle.

    Raises:
        OSError: with ``errno.ENOSPC`` when there is not enough space.
    """
    if size <= 0:
        return
    try:
        os.posix_fallocate(fd, offset, size)
    except OSError as e:
        if e.errno in (errno.EOPNOTSUPP, errno.EINVAL):
            # Filesystems without fallocate: fall back to writing zeros, which
            # also fails with ENOSPC instead of faulting later.
            _zero_fill(fd, size, offset)
        else:
            raise


def _zero_fill(fd: int, size: int, offset: int = 0) -> None:
    block = bytes(1 << 20)
    end = offset + size
    while offset < end:
        offset += os.pwrite(fd, block[: min(end - offset, len(block))], offset)


def map_fd(fd: int, size: int) -> mmap.mmap:
    """Maps ``size`` bytes of ``fd`` shared and read-write."""
    return mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
