"""What the built-in image recipes share: the checks of their fields (each raises a ``ValueError``
that names the field, what it must be and what was given), and :class:`NormalisedPixels`, their
answers about an output of ``size`` x ``size`` pixels normalised with ``mean`` and ``std``."""

from __future__ import annotations

import dataclasses

__all__ = [
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "NormalisedPixels",
    "check_common",
    "check_max_short_side",
    "check_range",
]

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def check_common(size, mean, std, dtype) -> None:
    """An image recipe's output size, normalisation and dtype."""
    if not isinstance(size, int) or size < 1:
        raise ValueError(f"size must be a positive int, got {size!r}")
    if len(mean) != 3 or len(std) != 3 or any(s <= 0 for s in std):
        raise ValueError(f"mean and std need 3 values each (std > 0), got mean={mean}, std={std}")
    if dtype not in ("float32", "uint8"):
        raise ValueError(f"dtype must be 'float32' (normalised) or 'uint8' (raw pixels), got {dtype!r}")


def check_max_short_side(n) -> None:
    if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
        raise ValueError(f"max_short_side must be a positive int (pixels) or None, got {n!r}")


def check_range(name: str, bounds, lo: float | None = None) -> None:
    """A ``(min, max)`` tuple with ``min <= max`` (and ``min >= lo``)."""
    ok = isinstance(bounds, tuple) and len(bounds) == 2 and all(isinstance(v, (int, float)) for v in bounds)
    if not ok or bounds[0] > bounds[1] or (lo is not None and bounds[0] < lo):
        floor = f", from {lo}" if lo is not None else ""
        raise ValueError(f"{name} must be a (min, max) tuple with min <= max{floor}, got {bounds!r}")


class NormalisedPixels:
    """A mixin of the :class:`~coordl.prep.protocol.Recipe` answers of a frozen dataclass recipe
    with fields ``size``, ``mean``, ``std`` and ``dtype``: a CHW ``(3, size, size)`` output, whose
    float32 pixels can travel as uint8 and be normalised after."""

    def output(self):
        return (3, self.size, self.size), self.dtype

    def normalisation(self):
        return (self.mean, self.std) if self.dtype == "float32" else None

    def pixels(self):
        return dataclasses.replace(self, dtype="uint8")
