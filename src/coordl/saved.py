"""An index's saved copy: where it is kept, saving it, loading it, and reusing it while it is current.

A scanned tree, a COCO dataset or tar shards are indexed once and saved in the index directory
(:func:`coordl.index.default_index_dir`), one file named by what it was made from
(``index-<name>.idx``, :mod:`coordl.indexfile`). A later start loads it when what it was made from
is unchanged: the tree's folders' times (a folder's time changes when a file is added or removed),
the shards' sizes and times, the annotations file's; and then checks every sample against its
dataset (:mod:`coordl.currency`), so that a file rewritten in place, or an object replaced under its
key, gets its new size, modification time or ETag in the index (and in the saved file) before
anything is read. The index class is the caller's (``cls``): this module builds indexes, it does not
define them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
from collections.abc import Callable
from typing import TypeVar

from coordl import currency, indexfile
from coordl.detection.boxes import Boxes
from coordl.paths import PathTable
from coordl.s3 import url as s3url
from coordl.tars import Shards

#: The caller's index class (:class:`coordl.index.Index`): this module builds and saves indexes of it,
#: and imports nothing of the module that defines it (which calls this one).
Index = TypeVar("Index")

__all__ = ["current_tree", "load", "name", "publish", "renewed", "reused", "save", "store_name", "tree_path"]

log = logging.getLogger(__name__)


def store_name() -> str:
    """The endpoint an ``s3://`` index was listed from: one bucket name at two stores is two datasets."""
    from coordl.s3 import client

    return client.settings().endpoint or "aws"


def tree_path(index_dir: str, root: str, extensions: tuple[str, ...], allow_empty: bool = False) -> str:
    """Where the index of the tree (or ``s3://`` prefix) ``root`` scanned with these rules is saved."""
    key = [root, list(extensions)] + ([True] if allow_empty else [])  # the key of earlier versions when False
    if s3url.is_url(root):
        key.append({"store": store_name()})
    return os.path.join(index_dir, f"index-{name(key)}{indexfile.SUFFIX}")


def publish(index: Index, dirs: list, saved: str) -> Index:
    """Saves ``index`` at ``saved`` (:func:`save`) and returns the saved copy, mapped: this process
    then shares it with the node's others and frees the built arrays (on a network filesystem, a
    copy of it in memory). A concurrent start may have replaced the file with another dataset's
    index, or another version's: then the built one is kept. Not saved (logged): the built one, to
    be made again next time."""
    try:
        save(index, dirs, saved)
    except OSError as e:
        log.warning("coordl: could not save the index to %s (%s); it will be rescanned next time", saved, e)
        return index
    opened = load(saved, type(index))
    if opened is not None and opened[0].version == index.version:  # the same samples, files' times and all
        index = opened[0]
    return dataclasses.replace(index, saved_path=saved)


def name(key) -> str:
    """16 hex digits naming a saved index by what it was made from (a JSON-able ``key``)."""
    return hashlib.sha256(json.dumps(key).encode()).hexdigest()[:16]


def save(index: Index, dirs: list, path: str) -> None:
    """Saves ``index`` with ``dirs``: its folders' times, or its shards' ``[size, mtime_ns]``."""
    meta = {"root": index.root, "classes": list(index.classes), "dirs": dirs}
    sh, bx = index.shards, index.boxes
    shards = (sh.files, sh.of, sh.offsets) if sh is not None else None
    boxes = None
    if bx is not None:
        boxes = (bx.offsets, bx.xyxy, bx.labels, bx.image_sizes, bx.image_ids)
        meta["categories"] = [[int(k), v] for k, v in bx.categories.items()]
        meta["skipped"] = dict(bx.skipped)
    indexfile.write(
        path, index.paths, index.labels, index.sizes, index.fingerprint, meta, index.etags, shards, boxes, index.mtimes
    )
    with contextlib.suppress(OSError):  # version 1's file of the same tree, which is never read again
        os.unlink(path[: -len(indexfile.SUFFIX)] + ".npz")


def load(path: str, cls: type[Index]) -> tuple[Index, list] | None:
    """The saved index at ``path`` (a ``cls``) and its folders' times; None (logged) if it is missing or
    unusable."""
    saved = indexfile.read(path)
    if isinstance(saved, str):
        log.info("coordl: saved index %s unusable (%s); rescanning", path, saved)
    if not isinstance(saved, indexfile.Saved):
        return None
    try:
        classes, root, dirs = tuple(saved.meta["classes"]), saved.meta["root"], list(saved.meta["dirs"])
        boxes = None
        if saved.boxes is not None:
            categories = {int(k): str(v) for k, v in saved.meta["categories"]}
            boxes = Boxes(*saved.boxes, categories=categories, skipped=dict(saved.meta["skipped"]))
    except (KeyError, TypeError, ValueError) as e:
        log.info("coordl: saved index %s unusable (%s); rescanning", path, f"metadata: {e!r}")
        return None
    index = cls(
        paths=saved.paths,
        labels=saved.labels,
        sizes=saved.sizes,
        classes=classes,
        root=root,
        fingerprint=saved.fingerprint,
        etags=saved.etags,
        shards=_shards(saved.shards, dirs),
        boxes=boxes,
        mtimes=saved.mtimes,
    )
    return index, dirs


def _shards(saved, made_from) -> Shards | None:
    """The shards of a saved index, with the ETags of ``s3://`` shards from what it was made from."""
    if saved is None:
        return None
    files, of, offsets = saved
    etags = PathTable.from_strings([str(s[1]) for s in made_from]) if len(files) and s3url.is_url(files[0]) else None
    return Shards(files, of, offsets, etags)


def reused(saved: str, cls: type[Index], check: Callable[[Index, list], Index | None]) -> Index | None:
    """The saved index at ``saved`` (a ``cls``) as ``check(index, dirs)`` finds it against its dataset (the
    index, brought up to date; None: it must be made again), checked by one process of this machine
    at a time (:func:`coordl.currency.turn`): one that waited for another's check, begun since it
    started, takes that check's result."""
    with currency.turn(saved) as turn:
        opened = load(saved, cls)
        if opened is None:
            return None
        index, dirs = opened
        if turn.covers(index.version):
            return dataclasses.replace(index, saved_path=saved, changed=turn.changed)
        began = currency.now_ns()
        current = check(index, dirs)
        if current is not None:
            turn.record(began, current.version, current.changed)
            log.info(
                "coordl: checked the %d samples of the saved index of %s in %.1f s: %d changed",
                len(current),
                current.root,
                (currency.now_ns() - began) / 1e9,
                current.changed,
            )
        return current


def current_tree(
    index: Index, dirs: list, root: str, saved: str, extensions: tuple[str, ...], allow_empty: bool
) -> Index | None:
    """A saved index of a tree (or ``s3://`` prefix, listed by ``extensions``) as it is now, saved
    again if a sample changed; None (logged) if it must be scanned again (see :func:`reused`)."""
    if index.root != root or index.shards is not None or index.boxes is not None:
        return None
    if s3url.is_url(root):
        from coordl.s3 import listing

        found = listing.scan(root, extensions, None, allow_empty)  # the one listing of the prefix
        now, added = currency.of_listing(index, found.urls, found.sizes, found.etags)
        if list(index.classes) != found.classes or isinstance(now, str):
            why = now if isinstance(now, str) else "its class prefixes changed"
            log.info("coordl: %s since the index of %s was saved; indexing it again", why, root)
            fresh = type(index).build(found.urls, found.labels, found.sizes, found.classes, root, etags=found.etags)
            return publish(fresh, [], saved)
        if added:
            log.info(
                "coordl: %d keys under %s are not in its saved index (added since): rebuild=True or "
                "COORDL_REINDEX=1 indexes them",
                added,
                root,
            )
        return renewed(index, now, dirs, saved, root)
    for folder, mtime in dirs:
        try:
            changed = os.stat(folder).st_mtime_ns != mtime
        except OSError:
            changed = True
        if changed:
            log.info("coordl: %s changed since the index was saved; rescanning", folder)
            return None
    # A folder whose mtime kept its value still lists the same names; a class folder
    # added or removed changes root's mtime. So the saved index holds the tree's files: are they
    # the same versions? (A file rewritten in place changes no folder's time.)
    return renewed(index, currency.of_samples(index), dirs, saved, root)


def renewed(index: Index, now: currency.Now | str, dirs: list, saved: str, where: str) -> Index | None:
    """``index`` (saved at ``saved`` with ``dirs``) with the sizes, modification times and ETags its
    samples have ``now``, saved again if any changed; None (logged) if it must be made again."""
    if isinstance(now, str):
        log.info("coordl: %s since the index of %s was saved; indexing it again", now, where)
        return None
    if not now.changed:
        return dataclasses.replace(index, saved_path=saved)
    log.info(
        "coordl: %d samples of %s changed since the index was saved (size, modification time or ETag): "
        "they are read from the store again, never from a copy of before",
        now.changed,
        where,
    )
    etags = now.etags if now.etags is not None else index.etags
    renewed = type(index).build(
        index.paths, index.labels, now.sizes, index.classes, index.root, etags, boxes=index.boxes, mtimes=now.mtimes
    )
    return dataclasses.replace(publish(renewed, dirs, saved), changed=now.changed)
