"""Which shards a dataset names (patterns, folders, lists), and where its samples lie in them."""

from __future__ import annotations

import glob
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from coordl.paths import PathTable
from coordl.s3 import url as s3url

__all__ = ["Shards", "expand", "is_tar_data", "shard_list"]

_BRACE = re.compile(r"\{([^{}]*)\}")


@dataclass(frozen=True, eq=False)
class Shards:
    """Where each sample of a tar dataset lies: an :class:`~coordl.index.Index`'s ``shards``.

    Attributes:
        files: the shards' paths (or ``s3://`` URLs), in the dataset's order.
        of: the shard of every sample (int64, a position in ``files``).
        offsets: where every sample's image starts in its shard (int64, bytes).
        etags: each shard's ETag, for ``s3://`` shards (None: local files).
    """

    files: PathTable
    of: np.ndarray
    offsets: np.ndarray
    etags: PathTable | None = None


def expand(spec: str | os.PathLike) -> list[str]:
    """The shards ``spec`` names: a brace pattern (``train-{000000..000146}.tar``, ``{a,b}``; as
    WebDataset's ``braceexpand``, zero-padded ranges keep their width), a folder (its ``.tar`` files,
    sorted), or one tar file; or the same as ``s3://`` URLs (a prefix: its ``.tar`` objects, listed).
    Local paths are made absolute."""
    spec = os.fspath(spec)
    out = _braces(spec)
    if s3url.is_url(spec):
        if len(out) == 1 and not out[0].endswith(".tar"):
            from coordl.s3 import listing

            return listing.tars(out[0])
        return out
    if len(out) == 1 and os.path.isdir(out[0]):
        return sorted(os.path.abspath(p) for p in glob.glob(os.path.join(glob.escape(out[0]), "*.tar")))
    return [os.path.abspath(p) for p in out]


def _braces(spec: str) -> list[str]:
    m = _BRACE.search(spec)
    if m is None:
        return [spec]
    head, body, tail = spec[: m.start()], m.group(1), spec[m.end() :]
    r = re.fullmatch(r"(\d+)\.\.(\d+)", body)
    if r:
        a, b = r.group(1), r.group(2)
        width = len(a) if a.startswith("0") or len(a) == len(b) else 0
        step = 1 if int(b) >= int(a) else -1
        items = [str(k).zfill(width) for k in range(int(a), int(b) + step, step)]
    else:
        items = body.split(",")
    return [x for item in items for x in _braces(head + item + tail)]


def is_tar_data(data) -> bool:
    """Whether a loader's ``data`` names tar shards: a path, URL or pattern ending in ``.tar``, a
    folder that holds ``.tar`` files and no sub-folder, or a list of such paths (not of pairs). (An
    ``s3://`` prefix of shards is named by :meth:`Index.from_tars <coordl.index.Index.from_tars>`:
    as a loader's data, a prefix is an ImageFolder's root.)"""
    if isinstance(data, (str, os.PathLike)):
        spec = os.fspath(data)
        if spec.endswith(".tar"):
            return True
        if s3url.is_url(spec) or not os.path.isdir(spec):  # an s3:// prefix is an ImageFolder's root
            return False
        entries = list(os.scandir(spec))
        return any(e.name.endswith(".tar") for e in entries) and not any(e.is_dir() for e in entries)
    if isinstance(data, Sequence) and data and all(isinstance(x, (str, os.PathLike)) for x in data):
        return all(os.fspath(x).endswith(".tar") for x in data)
    return False


def shard_list(data) -> list[str]:
    """The shards of ``data`` (see :func:`is_tar_data`), in order.

    Raises:
        FileNotFoundError: no shard found (the message names the pattern).
    """
    specs = [data] if isinstance(data, (str, os.PathLike)) else list(data)
    files = [f for spec in specs for f in expand(spec)]
    if not files:
        raise FileNotFoundError(f"no .tar shard found in {os.fspath(specs[0]) if len(specs) == 1 else specs}")
    return files
