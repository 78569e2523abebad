"""An entry's version: the stamp that names one version of a sample (its path, size and ETag), and
the tier's names and stamps of an index's samples."""

from __future__ import annotations

import hashlib

import numpy as np

__all__ = ["keys", "stamp"]


def stamp(path: str, size: int, etag: str | None) -> bytes:
    """16 bytes naming one version of a sample: its path, size and ETag (``""`` for a file)."""
    return hashlib.sha256(f"{path}\0{size}\0{etag or ''}".encode("utf-8", "surrogateescape")).digest()[:16]


def keys(index, ids) -> tuple[list[str], list[bytes]]:
    """The tier's names (paths) and stamps of samples ``ids`` of ``index``."""
    ids = np.asarray(ids, dtype=np.int64)
    names = [index.paths[i] for i in ids.tolist()]
    sizes = index.sizes[ids].tolist()
    if index.etags is not None:
        etags = [index.etags[i] for i in ids.tolist()]
    elif index.shards is not None and index.shards.etags is not None:
        etags = [index.shards.etags[k] for k in index.shards.of[ids].tolist()]
    else:
        etags = [None] * len(names)
    return names, [stamp(n, s, e) for n, s, e in zip(names, sizes, etags, strict=True)]
