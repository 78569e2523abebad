"""Generate deterministic COCO-format object-detection datasets of solid coloured rectangles.

:func:`make_coco` writes ``root/<split>/<image_id:012d>.<ext>`` and
``root/annotations/instances_<split>.json`` in COCO's instances format. Each image is a noisy
grey background (or a crop of a photograph, with mild grain) holding up to a few axis-aligned
rectangles, each filled with the solid colour of its category (:data:`CATEGORY_COLOURS`, by the
category's position in ``categories``). Rectangles have integer corners, lie fully inside the
image and keep at least :data:`GAP` pixels of background between each other, so the ground
truth of every pixel is known: a test can check what a loader delivers pixel by pixel (PNG) or
by the mean colour of each box (JPEG, quality 95 without chroma subsampling).

The JSON's ``bbox`` is COCO's ``[x, y, w, h]``: the rectangle covers pixel columns
``x .. x+w-1`` and rows ``y .. y+h-1``, i.e. corners ``(x, y, x+w, y+h)`` in continuous pixel
coordinates, which is how :class:`ImageTruth` gives them. Image ids run from 1; the JSON's
``images`` list is shuffled (never in id order when there are two or more images), so readers
must sort by id, as torchvision's ``CocoDetection`` does.

Image ``i`` (id ``i + 1``) is a pure function of ``(seed, i)`` and the arguments: it has its
own generator, ``numpy.random.default_rng([seed, i])``, which draws the size, the rectangles,
their categories and crowd flags, then the background, in that order (so ``crowd`` changes the
flags only). A second call with the same arguments writes byte-identical files; when the JSON
already holds the same arguments (its ``info`` key) and every image file exists, the call
returns at once. Files are written atomically (temporary name, then :func:`os.replace`); the
JSON is removed first and written last, so it vouches for the images beside it.

:func:`write_shards` packs a dataset into WebDataset-style tar shards.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import json
import operator
import os
import re
import tarfile
from dataclasses import dataclass

import numpy as np
from PIL import Image

from coordl.tools.datagen import images
from coordl.tools.datagen.job import write_atomic

__all__ = [
    "CATEGORY_COLOURS",
    "CATEGORY_NAMES",
    "FORMAT_VERSION",
    "GAP",
    "Box",
    "CocoSet",
    "ImageTruth",
    "make_coco",
    "write_shards",
]

FORMAT_VERSION = 1  # bump when what the same arguments draw changes: older files are then regenerated
# Saturated colours, at least 255 levels apart from each other and ~221 from mid-grey.
CATEGORY_COLOURS = (
    (255, 0, 0),
    (0, 255, 0),
    (0, 0, 255),
    (255, 255, 0),
    (255, 0, 255),
    (0, 255, 255),
    (255, 255, 255),
    (0, 0, 0),
)
CATEGORY_NAMES = ("red", "green", "blue", "yellow", "magenta", "cyan", "white", "black")
GAP = 2  # pixels of background kept between two rectangles
_TRIES = 50  # placements tried per rectangle before giving it up
_GREY = (96, 161)  # the background's base level, drawn per image
_NOISE = 40.0  # std of the synthetic background's per-pixel noise
_PHOTO_GRAIN = 8.0  # std of the grain over a photograph
_EXTS = ("jpg", "png")
_DESCRIPTION = "synthetic rectangles by coordl.tools.datagen.coco"
_IMAGE_NAME = re.compile(r"^\d{12}\.(jpg|png)$")
_SHARD_NAME = re.compile(r"^shard-(\d{6})\.tar$")

Box = tuple[int, int, int, int, int, int]  # (x1, y1, x2, y2, category_id, iscrowd)


@dataclass(frozen=True)
class ImageTruth:
    """One image's ground truth.

    Attributes:
        width: Width in pixels.
        height: Height in pixels.
        boxes: ``(x1, y1, x2, y2, category_id, iscrowd)`` per rectangle, integers, in annotation-id
            order; the rectangle covers columns ``x1 .. x2-1`` and rows ``y1 .. y2-1``.
    """

    width: int
    height: int
    boxes: tuple[Box, ...]


@dataclass(frozen=True)
class CocoSet:
    """A generated COCO dataset: where it is and what every image holds.

    Attributes:
        root: Absolute path of the dataset's root folder.
        images: The folder of the image files, ``root/<split>``.
        annotations: The JSON file, ``root/annotations/instances_<split>.json``.
        split: The split's name.
        ext: The image files' extension, ``"jpg"`` or ``"png"``.
        image_ids: Every image id, sorted (``1 .. num_images``).
        truths: Each image id's :class:`ImageTruth`.
        colours: Each category id's ``(r, g, b)`` fill colour.
        total_bytes: Sum of the image files' sizes.
    """

    root: str
    images: str
    annotations: str
    split: str
    ext: str
    image_ids: list[int]
    truths: dict[int, ImageTruth]
    colours: dict[int, tuple[int, int, int]]
    total_bytes: int

    def truth(self, image_id: int) -> ImageTruth:
        """The ground truth of image ``image_id``."""
        return self.truths[image_id]

    def path(self, image_id: int) -> str:
        """The file of image ``image_id``."""
        return os.path.join(self.images, f"{image_id:012d}.{self.ext}")


def make_coco(
    root: str | os.PathLike[str],
    num_images: int,
    *,
    seed: int = 0,
    width: tuple[int, int] = (160, 320),
    height: tuple[int, int] = (120, 240),
    boxes: tuple[int, int] = (0, 4),
    categories: tuple[int, ...] = (1, 2, 3, 7),
    image_format: str = "jpg",
    quality: int = 95,
    crowd: float = 0.0,
    photos_dir: str | os.PathLike[str] | None = None,
    min_side: int = 12,
    split: str = "train",
) -> CocoSet:
    """Generate (or find already generated) a deterministic COCO detection dataset.

    Args:
        root: Folder of the dataset; created if missing. Image files of this split that this call
            would not write (a larger earlier dataset's) are deleted.
        num_images: Number of images, at least 1; their ids are ``1 .. num_images``.
        seed: Non-negative random seed.
        width: Inclusive ``(min, max)`` range the images' widths are drawn from, uniformly.
        height: The same for heights.
        boxes: Inclusive ``(min, max)`` range of the number of rectangles drawn per image; an
            image holds fewer when they do not fit apart from each other.
        categories: Distinct category ids (at most ``len(CATEGORY_COLOURS)``); the k-th is filled
            with ``CATEGORY_COLOURS[k]`` and named ``CATEGORY_NAMES[k]``.
        image_format: ``"jpg"`` (4:4:4, quality ``quality``) or ``"png"`` (exact colours).
        quality: JPEG quality, 1 to 100.
        crowd: Probability that a rectangle is annotated ``"iscrowd": 1`` (it is drawn all the same).
        photos_dir: Folder of photographs to crop backgrounds from; ``None`` for noisy grey.
        min_side: Smallest side of a rectangle in pixels (the largest is half the image's side).
        split: Name of the split, e.g. ``"train"`` or ``"val2017"``.

    Returns:
        The dataset's :class:`CocoSet`.

    Raises:
        TypeError: If a count, size, seed or quality is not an integer.
        ValueError: If an argument is out of range.
        FileNotFoundError: If ``photos_dir`` does not exist.
    """
    num_images = _as_int("num_images", num_images)
    if num_images < 1:
        raise ValueError(f"num_images must be >= 1, got {num_images}")
    seed = _as_int("seed", seed)
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    quality = _as_int("quality", quality)
    if not 1 <= quality <= 100:
        raise ValueError(f"quality must be between 1 and 100, got {quality}")
    min_side = _as_int("min_side", min_side)
    if min_side < 1:
        raise ValueError(f"min_side must be >= 1, got {min_side}")
    cats = tuple(_as_int("a category id", c) for c in categories)
    if not 1 <= len(cats) <= len(CATEGORY_COLOURS) or len(set(cats)) < len(cats) or min(cats) < 1:
        raise ValueError(f"categories must be 1 to {len(CATEGORY_COLOURS)} distinct ids >= 1, got {categories!r}")
    if image_format not in _EXTS:
        raise ValueError(f"image_format must be 'jpg' or 'png', got {image_format!r}")
    if not (isinstance(crowd, (int, float)) and 0.0 <= crowd <= 1.0):
        raise ValueError(f"crowd must be a probability between 0 and 1, got {crowd!r}")
    if not isinstance(split, str) or not re.fullmatch(r"[A-Za-z0-9_.-]+", split) or split in (".", ".."):
        raise ValueError(f"split must be a folder name such as 'train' or 'val2017', got {split!r}")
    plan = _Plan(
        num_images=num_images,
        seed=seed,
        width=_range("width", width, 1),
        height=_range("height", height, 1),
        boxes=_range("boxes", boxes, 0),
        categories=cats,
        image_format=image_format,
        quality=quality,
        crowd=float(crowd),
        min_side=min_side,
        split=split,
        photos=images.list_photos(photos_dir) if photos_dir is not None else (),
    )
    arguments = dataclasses.asdict(plan) | {"photos": _digest(plan.photos)}  # contents, not paths
    info = {"description": _DESCRIPTION, "version": FORMAT_VERSION, "arguments": json.loads(json.dumps(arguments))}
    root = os.path.abspath(root)
    folder = os.path.join(root, split)
    ann_path = os.path.join(root, "annotations", f"instances_{split}.json")
    doc = _reusable(ann_path, folder, info)
    if doc is None:
        doc = _generate(plan, folder, ann_path, info)
    return _coco_set(root, folder, ann_path, split, doc)


def write_shards(coco: CocoSet, out_dir: str | os.PathLike[str], per_shard: int = 50) -> list[str]:
    """Pack ``coco`` into WebDataset-style tar shards ``out_dir/shard-000000.tar``, ...

    One sample per image, in image-id order, ``per_shard`` to a shard: members ``<key>.<ext>``
    (the image file's bytes) and ``<key>.json`` (``{"image_id", "width", "height",
    "annotations": [{"bbox": [x, y, w, h], "area", "category_id", "iscrowd"}]}``), with
    ``key = f"{image_id:012d}"``. Shards are written atomically and deterministically (zero
    mtimes and owners); shards of an earlier, larger run left in ``out_dir`` are deleted.

    Returns:
        The shards' paths, in order.

    Raises:
        ValueError: If ``per_shard`` is below 1.
    """
    per_shard = _as_int("per_shard", per_shard)
    if per_shard < 1:
        raise ValueError(f"per_shard must be >= 1, got {per_shard}")
    out_dir = os.path.abspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for start in range(0, len(coco.image_ids), per_shard):
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
            for image_id in coco.image_ids[start : start + per_shard]:
                key = f"{image_id:012d}"
                with open(coco.path(image_id), "rb") as f:
                    _add_member(tar, f"{key}.{coco.ext}", f.read())
                truth = coco.truth(image_id)
                sample = {"image_id": image_id, "width": truth.width, "height": truth.height}
                _add_member(tar, f"{key}.json", json.dumps(sample | {"annotations": _annotations(truth)}).encode())
        paths.append(os.path.join(out_dir, f"shard-{len(paths):06d}.tar"))
        write_atomic(paths[-1], buf.getvalue())
    for name in os.listdir(out_dir):
        m = _SHARD_NAME.match(name)
        if m and int(m.group(1)) >= len(paths):
            os.remove(os.path.join(out_dir, name))
    return paths


@dataclass(frozen=True)
class _Plan:
    """Everything an image depends on besides its index."""

    num_images: int
    seed: int
    width: tuple[int, int]
    height: tuple[int, int]
    boxes: tuple[int, int]
    categories: tuple[int, ...]
    image_format: str
    quality: int
    crowd: float
    min_side: int
    split: str
    photos: tuple[str, ...]

    def draw(self, i: int) -> tuple[ImageTruth, bytes]:
        """Image ``i``'s ground truth and encoded file."""
        rng = np.random.default_rng([self.seed, i])
        w = int(rng.integers(self.width[0], self.width[1] + 1))
        h = int(rng.integers(self.height[0], self.height[1] + 1))
        rects = _place(rng, w, h, int(rng.integers(self.boxes[0], self.boxes[1] + 1)), self.min_side)
        kinds = rng.integers(len(self.categories), size=len(rects))
        crowds = rng.random(len(rects)) < self.crowd
        if self.photos:
            pixels = images.add_grain(rng, images.photo_crop(rng, self.photos, w, h), _PHOTO_GRAIN)
        else:
            grey = np.full((h, w, 3), rng.integers(*_GREY), dtype=np.uint8)
            pixels = images.add_grain(rng, grey, _NOISE)
        out = []
        for (x1, y1, x2, y2), k, c in zip(rects, kinds, crowds):
            pixels[y1:y2, x1:x2] = CATEGORY_COLOURS[k]
            out.append((x1, y1, x2, y2, self.categories[k], int(c)))
        buf = io.BytesIO()
        if self.image_format == "png":
            Image.fromarray(pixels).save(buf, "PNG", optimize=False)
        else:
            Image.fromarray(pixels).save(buf, "JPEG", quality=self.quality, subsampling=0, optimize=False)
        return ImageTruth(w, h, tuple(out)), buf.getvalue()


def _place(rng: np.random.Generator, w: int, h: int, count: int, min_side: int) -> list[tuple[int, int, int, int]]:
    """Up to ``count`` rectangles ``(x1, y1, x2, y2)`` inside ``w x h``, :data:`GAP` pixels apart."""
    placed: list[tuple[int, int, int, int]] = []
    if min(w, h) < min_side:
        return placed
    for _ in range(count):
        for _ in range(_TRIES):
            bw = int(rng.integers(min_side, max(min_side, w // 2) + 1))
            bh = int(rng.integers(min_side, max(min_side, h // 2) + 1))
            x = int(rng.integers(0, w - bw + 1))
            y = int(rng.integers(0, h - bh + 1))
            if all(
                x >= x2 + GAP or x + bw + GAP <= x1 or y >= y2 + GAP or y + bh + GAP <= y1 for x1, y1, x2, y2 in placed
            ):
                placed.append((x, y, x + bw, y + bh))
                break
    return placed


def _generate(plan: _Plan, folder: str, ann_path: str, info: dict) -> dict:
    """Write every image, then the JSON; return the JSON's document."""
    os.makedirs(folder, exist_ok=True)
    os.makedirs(os.path.dirname(ann_path), exist_ok=True)
    with contextlib.suppress(FileNotFoundError):  # (a generator running beside this one may remove it first)
        os.remove(ann_path)  # until the new one is written, the images beside it are vouched for by nobody
    ext = plan.image_format
    entries, annotations = [], []
    for i in range(plan.num_images):
        truth, data = plan.draw(i)
        image_id = i + 1
        write_atomic(os.path.join(folder, f"{image_id:012d}.{ext}"), data)
        entries.append(
            {"id": image_id, "file_name": f"{image_id:012d}.{ext}", "width": truth.width, "height": truth.height}
        )
        annotations += [
            {"id": len(annotations) + 1 + j, "image_id": image_id, **a} for j, a in enumerate(_annotations(truth))
        ]
    keep = {e["file_name"] for e in entries}
    for name in os.listdir(folder):
        if _IMAGE_NAME.match(name) and name not in keep:
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(folder, name))
    order = np.random.default_rng([plan.seed, plan.num_images, 1]).permutation(plan.num_images)
    if plan.num_images > 1 and (order == np.arange(plan.num_images)).all():
        order = np.roll(order, 1)  # readers must sort by id: never hand them a sorted list
    doc = {
        "info": info,
        "images": [entries[j] for j in order],
        "annotations": annotations,
        "categories": [
            {"id": c, "name": CATEGORY_NAMES[k], "supercategory": "rectangle"} for k, c in enumerate(plan.categories)
        ],
    }
    write_atomic(ann_path, json.dumps(doc).encode())
    return doc


def _reusable(ann_path: str, folder: str, info: dict) -> dict | None:
    """The JSON's document if it was written with these arguments and its images all exist."""
    try:
        with open(ann_path, "rb") as f:
            doc = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict) or doc.get("info") != info:
        return None
    if not all(os.path.isfile(os.path.join(folder, e["file_name"])) for e in doc["images"]):
        return None
    return doc


def _coco_set(root: str, folder: str, ann_path: str, split: str, doc: dict) -> CocoSet:
    boxes: dict[int, list[Box]] = {e["id"]: [] for e in doc["images"]}
    for a in sorted(doc["annotations"], key=operator.itemgetter("id")):
        x, y, w, h = a["bbox"]
        boxes[a["image_id"]].append((x, y, x + w, y + h, a["category_id"], a["iscrowd"]))
    truths = {e["id"]: ImageTruth(e["width"], e["height"], tuple(boxes[e["id"]])) for e in doc["images"]}
    ids = sorted(truths)
    ext = doc["info"]["arguments"]["image_format"]
    colours = {c["id"]: CATEGORY_COLOURS[k] for k, c in enumerate(doc["categories"])}
    total = sum(os.path.getsize(os.path.join(folder, f"{i:012d}.{ext}")) for i in ids)
    return CocoSet(root, folder, ann_path, split, ext, ids, truths, colours, total)


def _annotations(truth: ImageTruth) -> list[dict]:
    """The image's boxes as COCO annotations, less their ``id`` and ``image_id``."""
    return [
        {"bbox": [x1, y1, x2 - x1, y2 - y1], "area": (x2 - x1) * (y2 - y1), "category_id": c, "iscrowd": crowd}
        for x1, y1, x2, y2, c, crowd in truth.boxes
    ]


def _add_member(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    member = tarfile.TarInfo(name)
    member.size, member.mode, member.mtime = len(data), 0o644, 0
    tar.addfile(member, io.BytesIO(data))


def _digest(photos: tuple[str, ...]) -> str | None:
    """Hash of the photographs' contents in order (moving the folder keeps it), or ``None``."""
    if not photos:
        return None
    return hashlib.sha256("".join(images.file_digest(p) for p in photos).encode()).hexdigest()[:16]


def _as_int(name: str, value: object) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"{name} must be an integer, got {value!r}") from None


def _range(name: str, value: object, low: int) -> tuple[int, int]:
    try:
        a, b = value  # type: ignore[misc]
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a (min, max) pair with {low} <= min <= max, got {value!r}") from None
    a, b = _as_int(name, a), _as_int(name, b)
    if not low <= a <= b:
        raise ValueError(f"{name} must be a (min, max) pair with {low} <= min <= max, got {value!r}")
    return (a, b)
