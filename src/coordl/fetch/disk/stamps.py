"""An entry's version: the stamp that names one version of a sample (its path, size, ETag and
modification time), and the tier's names and stamps of an index's samples."""

from __future__ import annotations

import hashlib

import numpy as np

__all__ = ["keys", "stamp"]


def stamp(path: str, size: int, etag: str | None, mtime_ns: int | None = None) -> bytes:
    """16 bytes naming one version of a sample: its path, size, ETag (``""`` for a file) and the
    modification time in ns of the file it lies in (None for an object: its ETag names its version).
    An object's stamp is what it was before modification times were stamped, so entries stay valid."""
    text = f"{path}\0{size}\0{etag or ''}" + (f"\0{mtime_ns}" if mtime_ns is not None else "")
    return hashlib.sha256(text.encode("utf-8", "surrogateescape")).digest()[:16]


def keys(index, ids) -> tuple[list[str], list[bytes]]:
    """The tier's names (paths) and stamps of samples ``ids`` of ``index``: path, size, ETag and
    modification time (:attr:`Index.mtimes <coordl.index.Index.mtimes>`, which the index's check
    brings up to date when it is loaded), so that an entry of another version is stale."""
    ids = np.asarray(ids, dtype=np.int64)
    names = [index.paths[i] for i in ids.tolist()]
    sizes = index.sizes[ids].tolist()
    if index.etags is not None:
        etags = [index.etags[i] for i in ids.tolist()]
    elif index.shards is not None and index.shards.etags is not None:
        etags = [index.shards.etags[k] for k in index.shards.of[ids].tolist()]
    else:
        etags = [None] * len(names)
    mtimes = index.mtimes[ids].tolist() if index.mtimes is not None else [None] * len(names)
    return names, [stamp(*key) for key in zip(names, sizes, etags, mtimes, strict=True)]
