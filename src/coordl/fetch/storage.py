"""The only code that reads the dataset's files.

Reads go straight into the caller's buffers (a MinIO cache slot, or a fresh array)
and, when coordl caches the bytes itself, are followed by
``posix_fadvise(DONTNEED)`` so that the same bytes do not also sit in the OS page
cache: memory is counted once, and what the device delivers per epoch is what
coordl accounts for.
"""

from __future__ import annotations

import os

import numpy as np

from coordl.errors import DatasetChangedError

__all__ = ["read", "read_into"]


def read_into(path: str, size: int, views: list[np.ndarray], *, drop_page_cache: bool) -> None:
    """Reads the ``size`` bytes of ``path`` into ``views`` (consecutive buffers, ``size`` in total).

    Raises:
        DatasetChangedError: the file's size is no longer ``size``.
        OSError: the file cannot be opened or read (the message names it).
    """
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        actual = os.fstat(fd).st_size
        if actual != size:
            raise DatasetChangedError(
                f"{path} is {actual} bytes but the index says {size}: the dataset changed after "
                "it was indexed; restart so that it is indexed again"
            )
        for view in views:
            done = 0
            while done < len(view):
                n = os.readv(fd, [view[done:]])
                if n == 0:
                    raise DatasetChangedError(f"{path} ended early, after {done} bytes of {len(view)}")
                done += n
        if drop_page_cache:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def read(path: str, size: int, *, drop_page_cache: bool) -> np.ndarray:
    """Reads the ``size`` bytes of ``path`` into a new uint8 array."""
    out = np.empty(size, dtype=np.uint8)
    read_into(path, size, [out], drop_page_cache=drop_page_cache)
    return out
