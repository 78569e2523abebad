"""Pure: the built-in training recipe's crop windows and flips, computed with numpy from a
sample's draws and its image's shape.

:class:`~coordl.prep.recipes.ImageNetTrain` draws 23 numbers per sample (:mod:`coordl.draws`):
10 area fractions and 10 aspect ratios to try, the window's place, and the flip.
:func:`shape_free` turns the first 20 into the fractions and ratios themselves, which do not
depend on the image, once per batch; the rest of torchvision's rule depends on the image's shape.
DALI computes that rest in the pipeline where the shape is known only there (encoded bytes:
:meth:`coordl.prep.planned.SampleRandom.planned_crop_window`), and :func:`crop_windows` computes
it here where it is known beforehand (an epoch served whole from the decoded tier), which spares
the pipeline its forty-odd per-sample operators. The two are the same float32 arithmetic, operation
for operation (products, quotients, square roots and floors, each rounded once), so they give the
same windows, bit for bit; the tests check it on thousands of shapes.
"""

from __future__ import annotations

import numpy as np

__all__ = ["ATTEMPTS", "COLUMNS", "crop_windows", "flips", "shape_free"]

ATTEMPTS = 10  # crop windows tried before the fallback, as torchvision's RandomResizedCrop
COLUMNS = 2 * ATTEMPTS + 3  # draws per sample: fractions, aspects, the place (x, y), the flip

_F = np.float32


def shape_free(u: np.ndarray, scale, ratio) -> np.ndarray:
    """The draws ``u`` (``(n, COLUMNS)`` float32 in ``[0, 1)``) with columns 0-9 replaced by area
    fractions in ``scale`` and columns 10-19 by aspect ratios drawn log-uniformly from ``ratio``."""
    s_lo, s_hi = float(scale[0]), float(scale[1])
    log_lo, log_hi = float(np.log(ratio[0])), float(np.log(ratio[1]))
    out = np.array(u, dtype=_F, copy=True)
    out[:, :ATTEMPTS] = _F(s_lo) + _F(s_hi - s_lo) * out[:, :ATTEMPTS]
    out[:, ATTEMPTS : 2 * ATTEMPTS] = np.exp(_F(log_lo) + _F(log_hi - log_lo) * out[:, ATTEMPTS : 2 * ATTEMPTS])
    return out


def crop_windows(heights, widths, planned: np.ndarray, ratio) -> tuple[np.ndarray, np.ndarray]:
    """Each sample's crop window, as torchvision's ``RandomResizedCrop`` chooses it.

    The first of the 10 windows (area fraction and aspect ratio from ``planned``, sides rounded
    half up) that fits in the image is placed uniformly; if none fits, the centre crop of the
    whole image with its aspect ratio clamped to ``ratio``.

    Args:
        heights, widths: each image's shape in pixels.
        planned: :func:`shape_free` draws, ``(n, COLUMNS)``.

    Returns:
        ``(anchor, size)``: float32 ``(n, 2)`` arrays, ``[x, y]`` and ``[w, h]`` in pixels.
    """
    r_lo, r_hi = _F(ratio[0]), _F(ratio[1])
    height = np.asarray(heights, dtype=_F)[:, None]
    width = np.asarray(widths, dtype=_F)[:, None]
    frac, aspect = planned[:, :ATTEMPTS], planned[:, ATTEMPTS : 2 * ATTEMPTS]
    target = (height * width) * frac
    w = np.floor(np.sqrt(target * aspect) + _F(0.5))
    h = np.floor(np.sqrt(target / aspect) + _F(0.5))
    fits = (w >= _F(1.0)) & (w <= width) & (h >= _F(1.0)) & (h <= height)
    priority = fits * np.arange(ATTEMPTS, 0, -1, dtype=_F)  # the first that fits ranks highest
    best = priority.max(axis=1, keepdims=True)
    found = best > _F(0.0)
    pick = (priority == best) & found
    w_try = (pick * w).sum(axis=1, keepdims=True, dtype=_F)  # one term at most: exact
    h_try = (pick * h).sum(axis=1, keepdims=True, dtype=_F)
    image_ratio = width / height
    narrow, wide = image_ratio < r_lo, image_ratio > r_hi
    w_fb = np.maximum(_F(1.0), width - wide * (width - np.floor(height * r_hi + _F(0.5))))
    h_fb = np.maximum(_F(1.0), height - narrow * (height - np.floor(width / r_lo + _F(0.5))))
    keep = found.astype(_F)
    other = _F(1.0) - keep
    w_out = keep * w_try + other * w_fb
    h_out = keep * h_try + other * h_fb
    ux, uy = planned[:, 2 * ATTEMPTS, None], planned[:, 2 * ATTEMPTS + 1, None]
    x = keep * np.floor(ux * (width - w_out + _F(1.0))) + other * np.floor((width - w_out) * _F(0.5))
    y = keep * np.floor(uy * (height - h_out + _F(1.0))) + other * np.floor((height - h_out) * _F(0.5))
    return np.hstack([x, y]).astype(_F), np.hstack([w_out, h_out]).astype(_F)


def flips(planned: np.ndarray, probability: float) -> np.ndarray:
    """1 where a sample is flipped (its last draw below ``probability``), else 0: int32 ``(n,)``."""
    return (planned[:, COLUMNS - 1] < _F(probability)).astype(np.int32)
