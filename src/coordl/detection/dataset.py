"""Where a detection dataset's samples are: the image files of a COCO annotations file (a folder
or an ``s3://`` prefix), their sizes and what a saved index of it is made from (which says it is still the dataset's);
and the boxes of tar shards' ``.json`` members."""

from __future__ import annotations

import logging
import os
import posixpath
from dataclasses import dataclass

import numpy as np

from coordl.detection import coco
from coordl.detection.boxes import Boxes
from coordl.errors import AnnotationError
from coordl.s3 import url as s3url

__all__ = ["Found", "boxes_of_members", "coco_samples", "made_from"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Found:
    """A COCO dataset's samples: image paths (or URLs), their sizes in bytes, their ETags
    (``s3://``; else None), their boxes and their modification times in ns (files; else None)."""

    paths: list[str]
    sizes: list[int]
    etags: list[str] | None
    boxes: Boxes
    mtimes: list[int] | None = None


def made_from(images: str, annotations: str) -> list:
    """What a saved index of the dataset was made from: the annotations file's size and
    modification time, and (a folder) the images folder's modification time, which changes when
    a file is added or removed.

    Raises:
        FileNotFoundError: no annotations file, or no images folder.
    """
    try:
        st = os.stat(annotations)
    except FileNotFoundError:
        raise FileNotFoundError(f"annotations file {annotations} does not exist") from None
    out = [annotations, st.st_size, st.st_mtime_ns]
    if not s3url.is_url(images):
        if not os.path.isdir(images):
            raise FileNotFoundError(f"images folder {images} does not exist or is not a folder")
        out += [images, os.stat(images).st_mtime_ns]
    return out


def coco_samples(images: str, annotations: str, *, skip_empty: bool, on_error: str) -> Found:
    """The samples of a COCO annotations file whose images are in ``images``.

    A ``file_name`` must name a file under ``images``: one that is absolute or climbs out of it
    with ``..`` (after normalisation: ``a/../../b`` climbs, ``a/../b`` does not) would make the
    node's caches hold, and the loader deliver, a file the dataset does not own. The check is on
    the name only: a symbolic link inside ``images`` is followed, as the file system says.

    Raises:
        AnnotationError: see :mod:`coordl.detection.coco`; an image listed but missing, or whose
            ``file_name`` is outside ``images`` (unless ``on_error="skip"``, which leaves it out,
            counts it and warns).
    """
    parsed = coco.parse(coco.load(annotations), annotations, skip_empty=skip_empty, on_error=on_error)
    boxes, names = parsed.boxes, parsed.file_names
    outside = [k for k, name in enumerate(names) if _outside(name)]
    if outside:
        shown = ", ".join(repr(names[k]) for k in outside[:5]) + (" ..." if len(outside) > 5 else "")
        if on_error != "skip":
            raise AnnotationError(
                f"{annotations}: {len(outside)} images have a file_name outside the images' root {images} "
                f"(absolute, or climbing out with '..'): {shown}; name each image relative to {images}, "
                "or pass on_error='skip' to leave them out",
                path=annotations,
                image_id=int(boxes.image_ids[outside[0]]),
            )
        log.warning(
            "coordl: %d images of %s have a file_name outside the images' root %s: %s; left out",
            len(outside),
            annotations,
            images,
            shown,
        )
        keep = np.setdiff1d(np.arange(len(names)), outside)
        boxes = boxes.subset(keep)
        boxes.skipped["images"] += len(outside)
        names = [names[k] for k in keep]
    paths = [_join(images, name) for name in names]
    if s3url.is_url(images):
        from coordl.s3 import listing

        known = listing.stat_known(paths)
        found = [known.get(p) for p in paths]
    else:
        found = [_stat(p) for p in paths]
    missing = [k for k, f in enumerate(found) if f is None]
    if missing:
        k = missing[0]
        image_id = int(boxes.image_ids[k])
        if on_error != "skip":
            raise AnnotationError(
                f"{annotations}: image {image_id} is {names[k]}, which is not in {images} "
                f"({len(missing)} listed images are missing); pass on_error='skip' to leave them out",
                path=paths[k],
                image_id=image_id,
            )
        log.warning("coordl: %d images of %s are missing from %s; left out", len(missing), annotations, images)
        keep = np.setdiff1d(np.arange(len(paths)), missing)
        boxes = boxes.subset(keep)
        boxes.skipped["images"] += len(missing)
        paths, found = [paths[k] for k in keep], [found[k] for k in keep]
    sizes = [f[0] for f in found]
    etags, mtimes = ([f[1] for f in found], None) if s3url.is_url(images) else (None, [f[1] for f in found])
    log.info(
        "coordl: indexed %d images and %d boxes of %s", len(paths), len(boxes.labels), os.path.basename(annotations)
    )
    return Found(paths, sizes, etags, boxes, mtimes)


def boxes_of_members(paths, members: list[bytes], *, on_error: str) -> Boxes:
    """The boxes of tar samples from their ``.json`` members (:func:`coco.parse_sample`), the
    sample at ``paths[i]`` (``<shard>:<member>``) an image of id its member's ``image_id``, else ``i``."""
    skipped = {"images": 0, "boxes": 0, "annotations": 0}
    boxes, labels, sizes, ids = [], [], [], []
    for i, (path, raw) in enumerate(zip(paths, members, strict=True)):
        where = path.rsplit(".", 1)[0] + ".json"
        width, height, image_id, xyxy, labs = coco.parse_sample(raw, where, on_error, skipped)
        boxes.append(xyxy)
        labels.append(labs)
        sizes.append((width, height))
        ids.append(i if image_id is None else image_id)
    return Boxes.from_lists(boxes, labels, sizes, ids, {}, skipped)


def _outside(name: str) -> bool:
    """Whether a ``file_name`` names no file under the images' root: absolute, or climbing out
    with ``..`` once normalised (a ``..`` is a step up on a file system, and an object store's
    HTTP path may be normalised the same way, so both kinds of root refuse it)."""
    if name.startswith("/") or os.path.isabs(name):
        return True
    normal = posixpath.normpath(name.replace(os.sep, "/"))
    return normal == ".." or normal.startswith("../")


def _join(images: str, name: str) -> str:
    if s3url.is_url(images):
        return images.rstrip("/") + "/" + name
    return os.path.join(images, name)


def _stat(path: str) -> tuple[int, int] | None:
    """A file's size and modification time (ns), or None when it is missing."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_size, st.st_mtime_ns
