"""Random numbers for a DALI recipe that are a function of the sample: ``ctx.random``.

DALI's own random operators (``fn.random.*``, ``fn.decoders.image_random_crop``, ...) keep one
generator per position in the batch, which runs on from batch to batch: what a sample draws
depends on the batch it lands in and on how many batches came before. coordl instead feeds the
pipeline a vector of uniform numbers per sample, computed outside it from ``(seed, epoch,
sample)`` (:mod:`coordl.draws`), and :class:`SampleRandom` turns them into the values a recipe
needs with DALI's arithmetic. A sample therefore gets the same crop window and flip in an epoch
whichever rank, batch, resume point or HP group member delivers it.
"""

from __future__ import annotations

import numpy as np
from nvidia.dali import fn, types
from nvidia.dali import math as dmath

from coordl.prep.windows import ATTEMPTS

__all__ = ["ATTEMPTS", "SampleRandom", "uses_dali_random", "window_of"]


class SampleRandom:
    """A recipe's source of per-sample random numbers (``ctx.random``).

    Every call takes the next of the sample's draws, so a recipe draws the same values in the
    same order for the same sample every time it runs in the same epoch. The results are DALI
    ``DataNode`` s on the CPU, one value per sample, usable as any op's argument input.

    Args:
        draws: the pipeline input holding each sample's uniform numbers in ``[0, 1)``.
    """

    def __init__(self, draws):
        self._draws = draws
        self.used = 0  # draws per sample the recipe asked for

    def _take(self, count: int):
        start, self.used = self.used, self.used + count
        return self._draws[start] if count == 1 else self._draws[start : start + count]

    def fed(self, count: int):
        """The sample's next ``count`` numbers as they were fed, untransformed: a built-in recipe's
        plan computed outside the pipeline (:meth:`coordl.detection.crops.Plan.fed`)."""
        return self._take(count)

    def uniform(self, range=(0.0, 1.0)):  # DALI's name for it
        """A float32 uniform in ``[range[0], range[1])`` per sample (as ``fn.random.uniform``)."""
        lo, hi = float(range[0]), float(range[1])
        return lo + (hi - lo) * self._take(1)

    def coin_flip(self, probability: float = 0.5):
        """1 with ``probability``, else 0, as int32 per sample (as ``fn.random.coin_flip``)."""
        return fn.cast(self._take(1) < float(probability), dtype=types.INT32)

    def randint(self, low: int, high: int):
        """An int32 in ``[low, high)`` per sample."""
        if high <= low:
            raise ValueError(f"randint needs low < high, got [{low}, {high})")
        return fn.cast(dmath.floor(low + (high - low) * self._take(1)), dtype=types.INT32)

    def normal(self, mean: float = 0.0, stddev: float = 1.0):
        """A float32 normal per sample (Box-Muller from two draws; as ``fn.random.normal``)."""
        u = self._take(2)
        radius = dmath.sqrt(-2.0 * dmath.log(1.0 - u[0]))
        return float(mean) + float(stddev) * radius * dmath.cos(2.0 * np.pi * u[1])

    def crop_window(self, shape, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3)):
        """A random crop window per sample, as torchvision's ``RandomResizedCrop`` chooses it.

        Up to 10 windows of ``scale`` of the image's area and an aspect ratio drawn log-uniformly
        from ``ratio`` are tried (sides rounded half up); the first that fits is placed uniformly;
        if none fits, the centre crop of the whole image with the aspect ratio clamped to
        ``ratio``.

        Args:
            shape: the images' shapes as DALI gives them, ``(H, W, C)`` (e.g.
                ``fn.peek_image_shape(encoded)`` for encoded bytes, ``images.shape()`` for decoded).

        Returns:
            ``(anchor, size)``: float32 ``[x, y]`` and ``[w, h]`` in pixels, for
            ``fn.decoders.image_slice(encoded, anchor, size, axis_names="WH",
            normalized_anchor=False, normalized_shape=False)`` or ``fn.slice``.
        """
        s_lo, s_hi = float(scale[0]), float(scale[1])
        r_lo, r_hi = float(ratio[0]), float(ratio[1])
        if not (0 < s_lo <= s_hi and 0 < r_lo <= r_hi):
            raise ValueError(
                f"crop_window needs 0 < scale[0] <= scale[1] and 0 < ratio[0] <= ratio[1], got {scale}, {ratio}"
            )
        u = self._take(2 * ATTEMPTS + 2)
        frac = s_lo + (s_hi - s_lo) * u[0:ATTEMPTS]
        log_lo, log_hi = float(np.log(r_lo)), float(np.log(r_hi))
        aspect = dmath.exp(log_lo + (log_hi - log_lo) * u[ATTEMPTS : 2 * ATTEMPTS])
        return window_of(shape, frac, aspect, u[2 * ATTEMPTS], u[2 * ATTEMPTS + 1], ratio)

    def planned_crop_window(self, shape, ratio=(3 / 4, 4 / 3)):
        """:meth:`crop_window` of the built-in training recipe, whose draws arrive planned: area
        fractions and aspect ratios already computed (:func:`coordl.prep.windows.shape_free`), so
        that :func:`coordl.prep.windows.crop_windows` gives the same windows outside DALI."""
        u = self._take(2 * ATTEMPTS + 2)
        return window_of(shape, u[0:ATTEMPTS], u[ATTEMPTS : 2 * ATTEMPTS], u[2 * ATTEMPTS], u[2 * ATTEMPTS + 1], ratio)


def window_of(shape, frac, aspect, ux, uy, ratio):
    """torchvision's crop window from the area fractions and aspect ratios to try, in DALI:
    :func:`coordl.prep.windows.crop_windows`'s arithmetic, operation for operation."""
    r_lo, r_hi = float(ratio[0]), float(ratio[1])
    shape = fn.cast(shape, dtype=types.FLOAT)
    height, width = shape[0], shape[1]
    target = (height * width) * frac
    w = dmath.floor(dmath.sqrt(target * aspect) + 0.5)
    h = dmath.floor(dmath.sqrt(target / aspect) + 0.5)
    fits = (w >= 1.0) & (w <= width) & (h >= 1.0) & (h <= height)
    # The first window that fits: the largest of fits * (ATTEMPTS - k), picked as a one-hot.
    priority = fits * types.Constant(np.arange(ATTEMPTS, 0, -1, dtype=np.float32))
    best = fn.reductions.max(priority)
    found = best > 0.0
    pick = (priority == best) & found
    w_try, h_try = fn.reductions.sum(pick * w), fn.reductions.sum(pick * h)
    # The fallback: the whole image, its aspect clamped to ``ratio``, centred.
    image_ratio = width / height
    narrow, wide = image_ratio < r_lo, image_ratio > r_hi
    w_fb = dmath.max(1.0, width - wide * (width - dmath.floor(height * r_hi + 0.5)))
    h_fb = dmath.max(1.0, height - narrow * (height - dmath.floor(width / r_lo + 0.5)))
    keep = fn.cast(found, dtype=types.FLOAT)
    other = 1.0 - keep
    w_out = keep * w_try + other * w_fb
    h_out = keep * h_try + other * h_fb
    x = keep * dmath.floor(ux * (width - w_out + 1.0)) + other * dmath.floor((width - w_out) * 0.5)
    y = keep * dmath.floor(uy * (height - h_out + 1.0)) + other * dmath.floor((height - h_out) * 0.5)
    return fn.stack(x, y), fn.stack(w_out, h_out)


def uses_dali_random(schemas: list[str]) -> list[str]:
    """The names of the operators among ``schemas`` (a built pipeline's,
    :func:`coordl.compat.pipeline_schemas`) that draw from DALI's own generators."""
    from nvidia.dali import backend

    found = []
    for name in schemas:
        try:
            random = backend.GetSchema(name).HasRandomSeedArg()
        except (KeyError, RuntimeError, TypeError):
            continue
        name = name.replace("__", ".")
        if random and name not in found:
            found.append(name)
    return found
