"""Reads samples' bytes from where the index says they are: files (:mod:`coordl.fetch.storage`) or
objects in a store (:mod:`coordl.s3.reads`). Everything that reads a dataset goes through here."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from coordl.fetch import storage
from coordl.index import Index
from coordl.threads import Signal

__all__ = ["read", "read_many"]


def read_many(
    index: Index,
    ids: np.ndarray,
    buffers: Sequence[list],
    *,
    drop_page_cache: bool,
    stop: Signal | None = None,
) -> dict[int, Exception]:
    """Reads sample ``ids[k]`` into ``buffers[k]`` (a list of buffers of its size in all), for every ``k``.
    When ``stop`` is set, requests still waiting for an object store end (as failures).

    Returns:
        the samples that could not be read, by position: an ``OSError`` or a
        :class:`~coordl.errors.DatasetChangedError`.

    Raises:
        StoreError: an object store refused the job's credentials (``s3://`` datasets).
    """
    ids = np.asarray(ids, dtype=np.int64)
    sizes = index.sizes[ids].tolist()
    if index.shards is not None and index.in_store:
        return _shard_ranges(index, ids, sizes, buffers, stop)
    if index.in_store:
        from coordl.s3 import reads

        order = ids.tolist()
        urls = [index.paths[i] for i in order]
        etags = [index.etags[i] for i in order]
        return reads.read_many(urls, sizes, etags, buffers, stop=stop)
    if index.shards is not None:
        sh = index.shards
        files = sh.files.encoded(sh.of[ids])
        return storage.read_ranges(
            files, sh.offsets[ids].tolist(), sizes, buffers, drop_page_cache=drop_page_cache, names=_Names(index, ids)
        )
    return storage.read_many(index.paths.encoded(ids), sizes, buffers, drop_page_cache=drop_page_cache)


#: Members of one ``s3://`` shard read by one range GET when at most this many bytes lie between them:
#: the tar headers and small members (``.cls``, ``.json``) between two neighbouring samples' images.
MERGE_GAP = 4096


def _shard_ranges(index: Index, ids: np.ndarray, sizes: list, buffers, stop) -> dict[int, Exception]:
    """Reads samples of ``s3://`` tar shards: one range GET per run of members of a shard that lie
    within :data:`MERGE_GAP` of each other, ``If-Match`` the shard's ETag; the bytes between them go
    to scratch buffers."""
    from coordl.s3 import reads

    sh = index.shards
    of, offsets = sh.of[ids].tolist(), sh.offsets[ids].tolist()
    runs: list[list] = []  # [shard, start, end, [buffers], [positions]]
    for k in sorted(range(len(ids)), key=lambda k: (of[k], offsets[k])):
        run = runs[-1] if runs else None
        if run is not None and run[0] == of[k] and run[2] <= offsets[k] <= run[2] + MERGE_GAP:
            if offsets[k] > run[2]:
                run[3].append(np.empty(offsets[k] - run[2], dtype=np.uint8))
            run[3] += buffers[k]
            run[2] = offsets[k] + sizes[k]
            run[4].append(k)
        else:
            runs.append([of[k], offsets[k], offsets[k] + sizes[k], list(buffers[k]), [k]])
    failed = reads.read_many(
        [sh.files[r[0]] for r in runs],
        [r[2] - r[1] for r in runs],
        [sh.etags[r[0]] for r in runs],
        [r[3] for r in runs],
        stop=stop,
        offsets=[r[1] for r in runs],
    )
    return {k: e for r, e in failed.items() for k in runs[r][4]}


class _Names:
    """The paths of a call's samples, decoded only for a message."""

    def __init__(self, index: Index, ids: np.ndarray):
        self.index, self.ids = index, ids

    def __getitem__(self, k: int) -> str:
        return self.index.paths[int(self.ids[k])]


def read(index: Index, i: int, *, drop_page_cache: bool = False) -> np.ndarray:
    """The bytes of sample ``i`` in a new uint8 array.

    Raises:
        OSError: it cannot be read (missing, unreadable, forbidden, timed out).
        DatasetChangedError: it is no longer what the index says (size, ETag).
        StoreError: the object store refused the job's credentials.
    """
    out = np.empty(int(index.sizes[i]), dtype=np.uint8)
    failed = read_many(index, np.array([i], dtype=np.int64), [[out]], drop_page_cache=drop_page_cache)
    if failed:
        raise failed[0]
    return out
