"""The SSD recipes for object detection: :class:`SSDTrain` (SSD300 v1.1's IoU-constrained crop,
flip and colour twist, planned from the boxes) and :class:`SSDVal` (the whole image resized).

Their targets are boxes (``target = "boxes"``): the index must carry them, the decoders keep the
stored pixels' orientation (the frame the boxes are in), each decoded image's size is checked
against its annotations, and a delivered batch's boxes are computed from its sample ids by the
same pure function (:mod:`coordl.detection.crops`) that planned the pixels' windows and flips.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from coordl.detection import crops
from coordl.prep import checks
from coordl.prep.fields import IMAGENET_MEAN, IMAGENET_STD, NormalisedPixels, check_common, check_range
from coordl.prep.protocol import PrepContext, Recipe

__all__ = ["SSDTrain", "SSDVal"]


class _Boxes(NormalisedPixels, Recipe):
    """What both SSD recipes answer alike: boxes as targets, the image size checked, their output."""

    target = "boxes"

    @property
    def checks_after(self) -> bool:
        return True

    def encoded_checked(self, data, ctx: PrepContext):
        from coordl.prep import graph  # DALI's ops: imported when a pipeline is built

        return self.encoded(data, ctx), graph.image_shape(data, ctx)

    def after_decoding(self, boxes, ids: np.ndarray, shapes) -> dict[int, str]:
        return checks.image_sizes(boxes, ids, shapes)

    def targets(self, labels, ids, *, boxes, seed: int, epoch: int, device):
        """One ``{"boxes", "labels", "image_id"}`` per sample (:func:`coordl.detection.targets.targets`)."""
        from coordl.detection.targets import targets as as_targets  # imports torch: when a batch is delivered

        ids = np.asarray(ids.numpy() if hasattr(ids, "numpy") else ids, dtype=np.int64)
        xyxy, classes, counts = self.delivered_boxes(boxes, seed, epoch, ids)
        return as_targets(xyxy, classes, counts, boxes.image_ids[ids].tolist(), device)


@dataclass(frozen=True)
class SSDTrain(_Boxes):
    """SSD300 v1.1's training recipe for object detection (an index with boxes:
    :meth:`coordl.Index.from_coco`).

    The IoU-constrained random crop (each try picks "no crop", a minimum IoU of ``thresholds`` or
    "any window"; a window of ``scaling`` of each side with ``w / h`` in ``aspect``, taken when every
    box overlaps it by more than the minimum and a box's centre lies inside it; ``tries`` tries,
    then the whole image), boxes kept when their centre lies in the crop and clipped to it, resize to
    ``size`` x ``size``, horizontal flip of pixels and boxes with probability ``flip``, the colour
    twist (hue in degrees and saturation, then brightness and contrast around 128, each drawn from
    its range), normalise with ``mean``/``std`` (fractions of 255), CHW; ``dtype="uint8"`` skips the
    normalisation. Every choice is a function of ``(seed, epoch, sample)``
    (:mod:`coordl.detection.crops`). Batches are ``(images, targets)``, ``targets`` a list of
    ``{"boxes": float32 (N, 4) x1 y1 x2 y2 in pixels of the output, "labels": int64 (N,),
    "image_id": int}``.
    """

    size: int = 300
    thresholds: tuple[float, ...] = (0.1, 0.3, 0.5, 0.7, 0.9)
    scaling: tuple[float, float] = (0.3, 1.0)
    aspect: tuple[float, float] = (0.5, 2.0)
    tries: int = 50
    flip: float = 0.5
    brightness: tuple[float, float] = (0.875, 1.125)
    contrast: tuple[float, float] = (0.5, 1.5)
    saturation: tuple[float, float] = (0.5, 1.5)
    hue: tuple[float, float] = (-18.0, 18.0)
    mean: tuple[float, ...] = IMAGENET_MEAN
    std: tuple[float, ...] = IMAGENET_STD
    dtype: str = "float32"
    name: str = field(default="ssd-train", init=False)

    def __post_init__(self):
        check_common(self.size, self.mean, self.std, self.dtype)
        if not isinstance(self.thresholds, tuple) or not all(
            isinstance(t, (int, float)) and 0 <= t < 1 for t in self.thresholds
        ):
            raise ValueError(f"thresholds must be a tuple of minimum IoUs in [0, 1), got {self.thresholds!r}")
        check_range("scaling", self.scaling, 0)
        if not 0 < self.scaling[0] <= self.scaling[1] <= 1:
            raise ValueError(f"scaling must satisfy 0 < min <= max <= 1, got {self.scaling}")
        check_range("aspect", self.aspect, 0)
        if self.aspect[0] <= 0:
            raise ValueError(f"aspect must be positive, got {self.aspect}")
        if isinstance(self.tries, bool) or not isinstance(self.tries, int) or self.tries < 1:
            raise ValueError(f"tries must be a positive int, got {self.tries!r}")
        if not 0 <= self.flip <= 1:
            raise ValueError(f"flip is a probability in [0, 1], got {self.flip}")
        for name in ("brightness", "contrast", "saturation"):
            check_range(name, getattr(self, name), 0)
        check_range("hue", self.hue)

    @property
    def twists_colour(self) -> bool:
        """Whether the colour twist changes anything (all ranges ``(1, 1)`` and hue ``(0, 0)``: not)."""
        unit = (1, 1)
        same = self.brightness == unit and self.contrast == unit and self.saturation == unit
        return not (same and self.hue == (0, 0))

    crops_window = True  # the window planned from the boxes, decoded alone

    def encoded(self, data, ctx: PrepContext):
        from coordl.prep import graph

        return graph.windowed(self, data, graph.image_shape(data, ctx), ctx)

    def window(self, shape, ctx: PrepContext):
        from coordl.prep import graph

        return graph.ssd_fed(ctx, shape, crops.FED)

    def from_window(self, crop, rest, ctx: PrepContext):
        from coordl.prep import graph

        mirror, colour = rest
        return graph.ssd_tail(self, crop, mirror, colour, ctx)

    def augment(self, images, ctx: PrepContext):
        from coordl.prep import graph

        anchor, size, rest = self.window(images.shape(), ctx)
        return self.from_window(graph.slice_window(images, anchor, size, ctx), rest, ctx)

    def feed(self, seed: int, epoch: int, ids: np.ndarray, columns: int, boxes, decoded=None) -> tuple:
        """Each sample's window, flip and colour, planned from its boxes (:func:`coordl.detection.crops.plan`)."""
        return (crops.plan(self, boxes, seed, epoch, ids).fed(),)

    def delivered_boxes(self, boxes, seed: int, epoch: int, ids: np.ndarray):
        """``(xyxy, labels, counts)`` of the boxes the samples' pixels carry in ``epoch``."""
        p = crops.plan(self, boxes, seed, epoch, ids)
        return p.xyxy, p.labels, p.counts


@dataclass(frozen=True)
class SSDVal(_Boxes):
    """SSD300's evaluation recipe: resize the whole image to ``size`` x ``size``, normalise, CHW;
    boxes scaled exactly with it (``x * size / width``, ``y * size / height``). Batches as
    :class:`SSDTrain`'s."""

    size: int = 300
    mean: tuple[float, ...] = IMAGENET_MEAN
    std: tuple[float, ...] = IMAGENET_STD
    dtype: str = "float32"
    name: str = field(default="ssd-val", init=False)

    def __post_init__(self):
        check_common(self.size, self.mean, self.std, self.dtype)

    def augment(self, images, ctx: PrepContext):
        from coordl.prep import graph

        return graph.squared(self, images, ctx)

    def delivered_boxes(self, boxes, seed: int, epoch: int, ids: np.ndarray):
        return crops.val_targets(self, boxes, ids)
