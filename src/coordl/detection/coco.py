"""COCO's ``instances_*.json`` (and a tar sample's ``.json`` member) as a detection index's
boxes, every field checked.

The rules are torchvision's detection references': images in the order of their ids (as
``torchvision.datasets.CocoDetection`` lists them); a box is COCO's ``[x, y, w, h]`` in pixels,
delivered as ``x1, y1, x2, y2 = x, y, x + w, y + h``; ``iscrowd`` boxes are left out of the
targets; labels are the category ids as the file gives them. Images without a box are kept
unless ``skip_empty``.

What is refused, with an :class:`~coordl.errors.AnnotationError` naming the file and the image
id, or left out and counted with ``on_error="skip"``: a box of no area (``w <= 0`` or ``h <= 0``,
or not four finite numbers) or reaching more than :data:`EDGE` pixels outside its image (a box
within that margin is clipped to the image: annotation tools round), an annotation of an image or
a category the file does not list. A file that is not JSON, or whose images are malformed (no
id, no file name, no positive width and height, an id twice), is refused whatever ``on_error``
says: nothing in it can be trusted.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from coordl.detection.boxes import Boxes
from coordl.errors import AnnotationError

__all__ = ["EDGE", "Parsed", "load", "parse", "parse_sample"]

#: How far (pixels) a box may reach outside its image and still be taken, clipped to it.
EDGE = 1.0


@dataclass(frozen=True)
class Parsed:
    """The images of an annotations file that have a sample, in id order, and their boxes.

    Attributes:
        file_names: each image's ``file_name``, relative to the images' folder.
        boxes: their boxes (``skipped`` counts what ``on_error="skip"`` left out).
    """

    file_names: list[str]
    boxes: Boxes


def load(path: str) -> dict:
    """The JSON document of an annotations file.

    Raises:
        FileNotFoundError: no such file.
        AnnotationError: it is not JSON (the message says where it stops being JSON).
    """
    try:
        with open(path, "rb") as f:
            return json.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"annotations file {path} does not exist") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise AnnotationError(f"{path} is not a COCO annotations file: not JSON ({e})", path=path) from None


def parse(doc, path: str, *, skip_empty: bool = False, on_error: str = "raise") -> Parsed:
    """The images and boxes of a COCO instances document (see the module docstring).

    Args:
        doc: the parsed JSON.
        path: the annotations file, for messages.
        skip_empty: leave out images without a box (crowd boxes do not count).
        on_error: ``"raise"`` or ``"skip"`` for a bad box or annotation.

    Raises:
        AnnotationError: see the module docstring.
    """
    if not isinstance(doc, dict) or not all(isinstance(doc.get(k), list) for k in ("images", "annotations")):
        raise AnnotationError(
            f"{path} is not a COCO instances file: it needs the lists 'images' and 'annotations'", path=path
        )
    categories = _categories(doc.get("categories", []), path)
    images = {}
    for entry in doc["images"]:
        image_id, name, size = _image(entry, path)
        if image_id in images:
            raise AnnotationError(f"{path}: image id {image_id} is listed twice", path=path, image_id=image_id)
        images[image_id] = (name, size)
    skipped = {"images": 0, "boxes": 0, "annotations": 0}
    fail = _failer(path, on_error, skipped)
    found: dict[int, list] = {i: [] for i in images}
    for ann in doc["annotations"]:
        if not isinstance(ann, dict):
            fail(f"{path}: an annotation is not an object ({str(ann)[:60]})", None, "annotations")
            continue
        image_id = ann.get("image_id")
        if not _is_int(image_id) or image_id not in images:
            why = f"{path}: annotation {ann.get('id')} is of image {image_id!r}, which the file does not list"
            fail(why, image_id if _is_int(image_id) else None, "annotations")
            continue
        category = ann.get("category_id")
        if categories is not None and (not _is_int(category) or category not in categories):
            why = f"annotation {ann.get('id')} of image {image_id} has category {category!r}, not in the file's"
            fail(f"{path}: {why}", image_id, "annotations")
            continue
        if not _is_int(category):
            why = f"{path}: annotation {ann.get('id')} of image {image_id} has no integer category_id"
            fail(why, image_id, "annotations")
            continue
        if ann.get("iscrowd", 0):
            continue  # torchvision's references leave crowd regions out of the targets
        where = f"{path}: annotation {ann.get('id')} of image {image_id}"
        box = box_of(ann.get("bbox"), images[image_id][1], lambda why, where=where: f"{where}: {why}")
        if isinstance(box, str):
            fail(box, image_id, "boxes")
            continue
        found[image_id].append((box, category))
    ids = sorted(images)
    if skip_empty:
        ids = [i for i in ids if found[i]]
    boxes = [np.array([b for b, _ in found[i]], np.float32).reshape(-1, 4) for i in ids]
    labels = [np.array([c for _, c in found[i]], np.int64) for i in ids]
    table = Boxes.from_lists(boxes, labels, [images[i][1] for i in ids], ids, categories or {}, skipped)
    return Parsed([images[i][0] for i in ids], table)


def parse_sample(raw: bytes, where: str, on_error: str = "raise", skipped: dict | None = None):
    """A tar sample's ``.json`` member (COCO's fields for one image: ``width``, ``height``,
    ``annotations`` of ``bbox``, ``category_id``, ``iscrowd``, and optionally ``image_id``):
    ``(width, height, image_id, xyxy, labels)``; ``image_id`` is None when the member has none.

    Raises:
        AnnotationError: the member is not such JSON, or (``on_error="raise"``) a box is bad.
    """
    try:
        doc = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise AnnotationError(f"{where} is not JSON ({e})", path=where) from None
    if not isinstance(doc, dict):
        raise AnnotationError(f"{where} is not a JSON object of an image's fields", path=where)
    image_id = doc.get("image_id", doc.get("id"))
    if image_id is not None and not _is_int(image_id):
        raise AnnotationError(f"{where}: image_id {image_id!r} is not an integer", path=where)
    size = _size(doc, where, image_id)
    anns = doc.get("annotations", [])
    if not isinstance(anns, list):
        raise AnnotationError(f"{where}: 'annotations' is not a list", path=where, image_id=image_id)
    skipped = {"images": 0, "boxes": 0, "annotations": 0} if skipped is None else skipped
    fail = _failer(where, on_error, skipped)
    boxes, labels = [], []
    for ann in anns:
        category = ann.get("category_id") if isinstance(ann, dict) else None
        if not _is_int(category):
            fail(f"{where}: an annotation of image {image_id} has no integer category_id", image_id, "annotations")
            continue
        if ann.get("iscrowd", 0):
            continue
        box = box_of(ann.get("bbox"), size, lambda why: f"{where}: image {image_id}: {why}")
        if isinstance(box, str):
            fail(box, image_id, "boxes")
            continue
        boxes.append(box)
        labels.append(category)
    return size[0], size[1], image_id, np.array(boxes, np.float32).reshape(-1, 4), np.array(labels, np.int64)


def box_of(bbox, size: tuple[int, int], message: Callable[[str], str]) -> tuple[float, float, float, float] | str:
    """``x1, y1, x2, y2`` of COCO's ``[x, y, w, h]`` in an image of ``size`` (clipped within
    :data:`EDGE`), or the message (from ``message(why)``) that says why it is not a box."""
    if not isinstance(bbox, (list, tuple)) or len(bbox) != 4 or not all(_is_number(v) for v in bbox):
        return message(f"bbox {str(bbox)[:60]} is not four numbers [x, y, w, h]")
    x, y, w, h = (float(v) for v in bbox)
    if w <= 0 or h <= 0:
        return message(f"bbox {list(bbox)} has no area (width and height must be positive)")
    width, height = size
    if x < -EDGE or y < -EDGE or x + w > width + EDGE or y + h > height + EDGE:
        return message(f"bbox {list(bbox)} reaches outside its {width}x{height} image")
    x1, y1, x2, y2 = max(x, 0.0), max(y, 0.0), min(x + w, float(width)), min(y + h, float(height))
    if x2 <= x1 or y2 <= y1:
        return message(f"bbox {list(bbox)} has no area inside its {width}x{height} image")
    return x1, y1, x2, y2


def _failer(path: str, on_error: str, skipped: dict):
    def fail(message: str, image_id, kind: str) -> None:
        if on_error != "skip":
            why = message + "; pass on_error='skip' to leave such ones out"
            raise AnnotationError(why, path=path, image_id=image_id)
        skipped[kind] += 1

    return fail


def _categories(entries, path: str) -> dict[int, str] | None:
    """Category id -> name; None when the file lists no categories (any integer id is taken)."""
    if not isinstance(entries, list):
        raise AnnotationError(f"{path}: 'categories' is not a list", path=path)
    if not entries:
        return None
    out = {}
    for c in entries:
        if not isinstance(c, dict) or not _is_int(c.get("id")):
            raise AnnotationError(f"{path}: a category has no integer id ({str(c)[:60]})", path=path)
        out[int(c["id"])] = str(c.get("name", c["id"]))
    return out


def _image(entry, path: str) -> tuple[int, str, tuple[int, int]]:
    if not isinstance(entry, dict) or not _is_int(entry.get("id")):
        raise AnnotationError(f"{path}: an image has no integer id ({str(entry)[:80]})", path=path)
    image_id = int(entry["id"])
    name = entry.get("file_name")
    if not isinstance(name, str) or not name:
        raise AnnotationError(f"{path}: image {image_id} has no file_name", path=path, image_id=image_id)
    return image_id, name, _size(entry, path, image_id)


def _size(entry: dict, path: str, image_id) -> tuple[int, int]:
    width, height = entry.get("width"), entry.get("height")
    if not (_is_int(width) and _is_int(height) and width > 0 and height > 0):
        raise AnnotationError(
            f"{path}: image {image_id} has no positive integer width and height ({width!r}, {height!r})",
            path=path,
            image_id=image_id,
        )
    return int(width), int(height)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
