"""Pure: the SSD recipes' geometry, as functions of ``(seed, epoch, sample)``: each sample's crop
window, flip and colour twist, and the boxes they deliver.

The crop is SSD300 v1.1's (NVIDIA's PyTorch reference, after the SSD paper): a try picks one of
the options uniformly, "no crop", a minimum IoU from ``thresholds``, or "any window"; a window
whose sides are ``scaling`` of the image's (each drawn alone) and whose aspect ``w / h`` lies in
``aspect`` is placed uniformly; it is taken when every box's IoU with it is above the option's
minimum and at least one box's centre lies strictly inside it. The reference tries until one
succeeds; here the tries are ``SSDTrain(tries)`` (default 50), after which the whole image is
taken, so that every random choice is one of a fixed number of draws (:mod:`coordl.draws`). An
image without a box is never cropped (no window keeps a box), as in the reference.

The window is snapped to whole pixels (``floor`` of each edge, as the reference does) before the
IoUs are measured and before the boxes are moved, so the delivered boxes are exactly where the
delivered pixels put them: a box is kept when its centre lies inside the window, clipped to it,
moved to the window's origin, scaled to the output's ``size`` and mirrored with the pixels.

Draws per sample (``5 * tries + 6`` uniforms): per try its option, width, height, left and top;
then the flip and the colour twist's brightness, contrast, saturation and hue.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from coordl import draws
from coordl.detection.boxes import Boxes

__all__ = ["FED", "Plan", "columns", "plan", "val_targets"]

#: The numbers fed to the pipeline per sample: the window's x, y, w, h (pixels), the flip, then
#: brightness, contrast, saturation and hue.
FED = 9


@dataclass(frozen=True)
class Plan:
    """A batch's SSDTrain augmentation and the targets it delivers.

    Attributes:
        windows: int64 ``(n, 4)``: each crop window's ``x, y, w, h`` in pixels of the stored image.
        flips: bool ``(n,)``.
        colour: float32 ``(n, 4)``: brightness, contrast, saturation, hue (degrees).
        xyxy: float32 ``(boxes, 4)``: the delivered boxes, sample after sample, in pixels of the
            delivered ``size`` x ``size`` image.
        labels: int64 ``(boxes,)``.
        counts: int64 ``(n,)``: each sample's delivered boxes.
    """

    windows: np.ndarray
    flips: np.ndarray
    colour: np.ndarray
    xyxy: np.ndarray
    labels: np.ndarray
    counts: np.ndarray

    def fed(self) -> np.ndarray:
        """float32 ``(n, FED)``: what the pipeline is fed per sample (pixel counts are exact in float32)."""
        return np.column_stack([self.windows, self.flips, self.colour]).astype(np.float32)


def columns(recipe) -> int:
    """The uniform draws per sample of an :class:`~coordl.prep.recipes.SSDTrain`."""
    return 5 * recipe.tries + 6


def plan(recipe, boxes: Boxes, seed: int, epoch: int, ids) -> Plan:
    """Samples ``ids``' windows, flips, colour twists and delivered boxes in ``epoch`` (see the
    module docstring); ``recipe`` an :class:`~coordl.prep.recipes.SSDTrain`."""
    ids = np.asarray(ids, dtype=np.int64)
    n, t = len(ids), recipe.tries
    u = draws.uniforms(seed, epoch, ids, columns(recipe)).astype(np.float64)
    size = boxes.image_sizes[ids].astype(np.float64)
    width, height = size[:, :1], size[:, 1:]
    xyxy, labels, counts = boxes.gather(ids)
    xyxy = xyxy.astype(np.float64)

    # Every try of every sample at once: (n, t).
    options = len(recipe.thresholds) + 2  # "no crop", each threshold, "any window"
    option = np.minimum((u[:, 0:t] * options).astype(np.int64), options - 1)
    lo, hi = recipe.scaling
    w = lo + (hi - lo) * u[:, t : 2 * t]
    h = lo + (hi - lo) * u[:, 2 * t : 3 * t]
    left = u[:, 3 * t : 4 * t] * (1.0 - w)
    top = u[:, 4 * t : 5 * t] * (1.0 - h)
    x0, y0 = np.floor(left * width), np.floor(top * height)
    x1, y1 = np.floor((left + w) * width), np.floor((top + h) * height)
    shaped = (w / h >= recipe.aspect[0]) & (w / h <= recipe.aspect[1]) & (x1 > x0) & (y1 > y0)
    minimum = np.array([np.inf, *recipe.thresholds, -np.inf])[option]  # "no crop" never passes a minimum

    # Per box and try: its IoU with its sample's window, and whether its centre lies inside.
    of = np.repeat(np.arange(n), counts)
    bx0, by0, bx1, by1 = (xyxy[:, k : k + 1] for k in range(4))
    wx0, wy0, wx1, wy1 = x0[of], y0[of], x1[of], y1[of]
    inter = np.clip(np.minimum(bx1, wx1) - np.maximum(bx0, wx0), 0, None) * np.clip(
        np.minimum(by1, wy1) - np.maximum(by0, wy0), 0, None
    )
    union = (bx1 - bx0) * (by1 - by0) + (wx1 - wx0) * (wy1 - wy0) - inter
    below = ~(inter / union > minimum[of])
    cx, cy = (bx0 + bx1) / 2, (by0 + by1) / 2
    inside = (cx > wx0) & (cx < wx1) & (cy > wy0) & (cy < wy1)
    ok = shaped & (option != 0) & (_per_sample(below, counts) == 0) & (_per_sample(inside, counts) > 0)
    ends = ok | (option == 0)  # a try ends the search when it crops, or when it draws "no crop"
    first = np.argmax(ends, axis=1)
    crop = ends.any(axis=1) & ok[np.arange(n), first]
    pick = (np.arange(n), first)
    windows = np.column_stack(
        [
            np.where(crop, x0[pick], 0.0),
            np.where(crop, y0[pick], 0.0),
            np.where(crop, x1[pick] - x0[pick], width[:, 0]),
            np.where(crop, y1[pick] - y0[pick], height[:, 0]),
        ]
    )

    rest = u[:, 5 * t :]
    flips = rest[:, 0] < recipe.flip
    colour = np.column_stack(
        [
            _uniform(rest[:, 1], recipe.brightness),
            _uniform(rest[:, 2], recipe.contrast),
            _uniform(rest[:, 3], recipe.saturation),
            _uniform(rest[:, 4], recipe.hue),
        ]
    ).astype(np.float32)
    out, keep = _moved(xyxy, of, windows, flips, recipe.size)
    return Plan(
        windows.astype(np.int64),
        flips,
        colour,
        out[keep].astype(np.float32),
        labels[keep],
        np.bincount(of[keep], minlength=n).astype(np.int64),
    )


def val_targets(recipe, boxes: Boxes, ids) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Samples ``ids``' boxes scaled to an :class:`~coordl.prep.recipes.SSDVal`'s output:
    ``(xyxy, labels, counts)``."""
    xyxy, labels, counts = boxes.gather(np.asarray(ids, dtype=np.int64))
    size = np.repeat(boxes.image_sizes[np.asarray(ids, dtype=np.int64)], counts, axis=0).astype(np.float64)
    sides = np.column_stack([size[:, 0], size[:, 1], size[:, 0], size[:, 1]])
    scaled = xyxy.astype(np.float64) * recipe.size / sides  # an edge on the image's edge lands on ``size``
    return np.clip(scaled, 0.0, recipe.size).astype(np.float32), labels, counts


def _moved(xyxy, of, windows, flips, size: int) -> tuple[np.ndarray, np.ndarray]:
    """The boxes in the delivered image's pixels, and which are kept (centre inside the window)."""
    wx, wy, ww, wh = (windows[of, k : k + 1] for k in range(4))
    cx, cy = (xyxy[:, 0:1] + xyxy[:, 2:3]) / 2, (xyxy[:, 1:2] + xyxy[:, 3:4]) / 2
    keep = ((cx > wx) & (cx < wx + ww) & (cy > wy) & (cy < wy + wh))[:, 0]
    # Multiplied, then divided: a box edge on the window's edge lands on 0 or ``size`` exactly.
    x = (np.clip(xyxy[:, [0, 2]], wx, wx + ww) - wx) * size / ww
    y = (np.clip(xyxy[:, [1, 3]], wy, wy + wh) - wy) * size / wh
    mirrored = flips[of]
    x = np.where(mirrored[:, None], size - x[:, ::-1], x)
    return np.clip(np.column_stack([x[:, 0], y[:, 0], x[:, 1], y[:, 1]]), 0.0, size), keep


def _per_sample(flags: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """``flags`` (boxes, t) summed over each sample's boxes: ``(samples, t)`` (0 for a sample without boxes)."""
    cum = np.concatenate([np.zeros((1, flags.shape[1])), np.cumsum(flags, axis=0)])
    ends = np.cumsum(counts)
    return cum[ends] - cum[ends - counts]


def _uniform(u: np.ndarray, bounds) -> np.ndarray:
    lo, hi = float(bounds[0]), float(bounds[1])
    return lo + (hi - lo) * u
