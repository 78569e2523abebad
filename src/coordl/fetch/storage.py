"""The only code that reads the dataset's files.

Reads go straight into the caller's buffers (a MinIO cache slot, or a slice of one buffer for
the batch) and, when coordl caches the bytes itself, are followed by
``posix_fadvise(DONTNEED)`` so that the same bytes do not also sit in the OS page
cache: memory is counted once, and what the device delivers per epoch is what
coordl accounts for.

A file costs ``open``, one ``readv``, the ``fadvise`` when asked for, and ``close``: the
``readv`` asks for one byte more than the index's size, so a file that grew is caught without
an ``fstat`` (one that shrank reads short). :func:`read_many` reads a list of files in one call,
so that the per-file cost is those system calls and little Python.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from coordl.errors import DatasetChangedError

__all__ = ["read_many", "read_ranges", "read_whole"]

_FLAGS = os.O_RDONLY | os.O_CLOEXEC
_DONTNEED = os.POSIX_FADV_DONTNEED
_SPARE = bytearray(1)  # the byte after a file's end; its value is never read


def read_whole(fd: int, views: list, *, drop_page_cache: bool) -> int:
    """Reads the open file ``fd`` from its start into ``views`` with one byte more, so that a file
    longer than they hold is seen without an ``fstat`` (the count is one more than they hold); then,
    when asked, drops its pages from the page cache. Returns the bytes read (one ``readv``: fewer
    than they hold for a file that is shorter, or a short read)."""
    n = os.readv(fd, [*views, _SPARE])
    if drop_page_cache:
        os.posix_fadvise(fd, 0, 0, _DONTNEED)
    return n


def read_many(
    paths: Sequence[str | bytes], sizes: Sequence[int], buffers: Sequence[list], *, drop_page_cache: bool
) -> dict[int, Exception]:
    """Reads file ``k`` of ``paths`` (``sizes[k]`` bytes) into ``buffers[k]``, a list of buffers
    that hold ``sizes[k]`` bytes in all, for every ``k``.

    Returns:
        the files that could not be read, by position: an ``OSError`` (missing, unreadable) or a
        :class:`~coordl.errors.DatasetChangedError` (its size is no longer the index's). The
        other files are read whatever happens to these.
    """
    failed: dict[int, Exception] = {}
    close = os.close
    for k, path in enumerate(paths):
        try:
            fd = os.open(path, _FLAGS)
        except OSError as e:
            failed[k] = e
            continue
        try:
            size = sizes[k]
            views = buffers[k]
            n = read_whole(fd, views, drop_page_cache=drop_page_cache)
            if n != size:
                _rest(fd, os.fsdecode(path), size, views, n)
                if drop_page_cache:
                    os.posix_fadvise(fd, 0, 0, _DONTNEED)  # the rest's pages too
        except (OSError, DatasetChangedError) as e:
            failed[k] = e
        finally:
            close(fd)
    return failed


def _rest(fd: int, path: str, size: int, views: list, done: int) -> None:
    """After a first ``readv`` of ``done`` bytes that were not ``size``: the file changed, or the
    read was short (a signal, some network filesystems), and then the rest is read."""
    actual = os.fstat(fd).st_size
    if actual != size:
        raise DatasetChangedError(
            f"{path} is {actual} bytes but the index says {size}: the dataset changed after "
            "it was indexed; restart so that it is indexed again"
        )
    flat = [memoryview(v).cast("B") for v in views]
    while done < size:
        n = os.readv(fd, _after(flat, done))
        if n == 0:
            raise DatasetChangedError(f"{path} ended early, after {done} bytes of {size}")
        done += n


def read_ranges(
    paths: Sequence[str | bytes],
    offsets: Sequence[int],
    sizes: Sequence[int],
    buffers: Sequence[list],
    *,
    drop_page_cache: bool,
    names: Sequence[str] | None = None,
) -> dict[int, Exception]:
    """Reads ``sizes[k]`` bytes at ``offsets[k]`` of file ``paths[k]`` (a tar shard's member) into
    ``buffers[k]``, for every ``k``: one ``preadv`` each, in the order of their files and offsets,
    each file opened once; with ``drop_page_cache``, the range read is dropped from the page cache.

    Returns:
        the ranges that could not be read, by position: an ``OSError`` or a
        :class:`~coordl.errors.DatasetChangedError` (the file ends before the range does; ``names[k]``
        names the member in the message).
    """
    failed: dict[int, Exception] = {}
    order = sorted(range(len(paths)), key=lambda k: (paths[k], offsets[k]))
    fd, opened, why = -1, None, None
    preadv, fadvise = os.preadv, os.posix_fadvise
    try:
        for k in order:
            path = paths[k]
            if path != opened:
                if fd >= 0:
                    os.close(fd)
                fd, opened, why = -1, path, None
                try:
                    fd = os.open(path, _FLAGS)
                except OSError as e:
                    why = e
            if why is not None:
                failed[k] = why
                continue
            try:
                offset, size = int(offsets[k]), int(sizes[k])
                n = preadv(fd, buffers[k], offset)
                if n != size:
                    _rest_range(fd, os.fsdecode(path), offset, size, buffers[k], n, names[k] if names else None)
                if drop_page_cache:
                    fadvise(fd, offset, size, _DONTNEED)
            except (OSError, DatasetChangedError) as e:
                failed[k] = e
    finally:
        if fd >= 0:
            os.close(fd)
    return failed


def _rest_range(fd: int, path: str, offset: int, size: int, views: list, done: int, name: str | None) -> None:
    """After a ``preadv`` of ``done`` bytes, not ``size``: the rest, unless the file ends first."""
    flat = [memoryview(v).cast("B") for v in views]
    while done < size:
        n = os.preadv(fd, _after(flat, done), offset + done)
        if n == 0:
            actual = os.fstat(fd).st_size
            what = f"member {name}" if name else f"{size} bytes at byte {offset}"
            raise DatasetChangedError(
                f"{path} is {actual} bytes and ends inside {what}: the shard changed after it was indexed; "
                "restart so that it is indexed again"
            )
        done += n


def _after(flat: list[memoryview], done: int) -> list[memoryview]:
    """The parts of the buffers ``flat`` (bytes) after their first ``done`` bytes."""
    rest = []
    for v in flat:
        if done >= len(v):
            done -= len(v)
            continue
        rest.append(v[done:])
        done = 0
    return rest
