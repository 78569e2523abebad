"""The ImageNet recipes: :class:`ImageNetTrain` (a random resized crop decoded alone, a flip) and
:class:`ImageNetVal` (resize, centre crop), both normalised to CHW float32 or left as uint8 pixels."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from coordl import draws
from coordl.prep import windows
from coordl.prep.decoders import ImageDecoder
from coordl.prep.fields import IMAGENET_MEAN, IMAGENET_STD, NormalisedPixels, check_common, check_max_short_side
from coordl.prep.protocol import PrepContext, Recipe

__all__ = ["ImageNetTrain", "ImageNetVal"]


class _Pixels(NormalisedPixels, Recipe):
    """What both ImageNet recipes answer alike: their decoder (capped at ``max_short_side``), their key."""

    @property
    def decoder(self) -> ImageDecoder:
        return ImageDecoder(adjust_orientation=True, max_short_side=self.max_short_side)

    def key(self) -> str:
        if self.max_short_side is None:  # the key from before the field: older checkpoints still resume
            return repr(self).replace(", max_short_side=None", "")
        return repr(self)


@dataclass(frozen=True)
class ImageNetTrain(_Pixels):
    """The standard ImageNet training recipe.

    Decode with a random crop of ``scale`` of the area and ``ratio`` aspect, resize to
    ``size`` x ``size``, flip horizontally with probability ``flip``, normalise with
    ``mean``/``std`` (fractions of 255), CHW. ``dtype="uint8"`` skips normalisation.

    ``max_short_side=N`` changes the data: every image whose shorter side is longer than ``N``
    pixels is first resized (aspect kept, antialiased) to a shorter side of ``N``, as FFCV's
    ``max_resolution`` stores a dataset; the crop is then taken from that image. It makes
    decoded images smaller (the decoded tier holds more of them, and augmenting them costs less)
    at the price of decoding whole images on the encoded path.
    """

    size: int = 224
    scale: tuple[float, float] = (0.08, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)
    flip: float = 0.5
    mean: tuple[float, ...] = IMAGENET_MEAN
    std: tuple[float, ...] = IMAGENET_STD
    dtype: str = "float32"
    max_short_side: int | None = None
    name: str = field(default="imagenet-train", init=False)

    def __post_init__(self):
        check_common(self.size, self.mean, self.std, self.dtype)
        check_max_short_side(self.max_short_side)
        if not 0 < self.scale[0] <= self.scale[1] <= 1:
            raise ValueError(f"scale must satisfy 0 < min <= max <= 1, got {self.scale}")
        if not 0 < self.ratio[0] <= self.ratio[1]:
            raise ValueError(f"ratio must satisfy 0 < min <= max, got {self.ratio}")
        if not 0 <= self.flip <= 1:
            raise ValueError(f"flip is a probability in [0, 1], got {self.flip}")

    @property
    def crops_window(self) -> bool:
        """Decodes only its crop window, unless it caps images (then it decodes them whole)."""
        return not self.max_short_side

    def encoded(self, data, ctx: PrepContext):
        from coordl.prep import graph  # DALI's ops: imported when a pipeline is built

        if self.crops_window:
            return graph.windowed(self, data, graph.image_shape(data, ctx), ctx)
        return super().encoded(data, ctx)

    def window(self, shape, ctx: PrepContext):
        anchor, size = ctx.random.planned_crop_window(shape, self.ratio)
        return anchor, size, None

    def from_window(self, crop, rest, ctx: PrepContext):
        from coordl.prep import graph

        return graph.train_tail(self, crop, ctx)

    def augment(self, images, ctx: PrepContext):
        from coordl.prep import graph

        anchor, size, rest = self.window(images.shape(), ctx)
        return self.from_window(graph.slice_window(images, anchor, size, ctx), rest, ctx)

    def feed(self, seed: int, epoch: int, ids: np.ndarray, columns: int, boxes, decoded=None) -> tuple:
        """The draws with the area fractions and aspect ratios computed (:func:`~coordl.prep.windows.shape_free`);
        given the decoded images, their windows and flips (:meth:`planned`)."""
        u = windows.shape_free(draws.uniforms(seed, epoch, ids, columns), self.scale, self.ratio)
        if decoded is None:
            return (u,)
        shapes = np.array([x.shape[:2] for x in decoded], dtype=np.int64).reshape(-1, 2)
        anchor, size = windows.crop_windows(shapes[:, 0], shapes[:, 1], u, self.ratio)
        return anchor, size, windows.flips(u, self.flip)

    plans_decoded = True

    def planned(self, images, anchor, size, mirror, ctx: PrepContext):
        """On decoded images whose crop windows and flips were computed before the pipeline
        (:mod:`coordl.prep.windows`): the same pixels as :meth:`augment`'s."""
        from coordl.prep import graph

        return graph.train_tail(self, graph.slice_window(images, anchor, size, ctx), ctx, mirror=mirror)


@dataclass(frozen=True)
class ImageNetVal(_Pixels):
    """The standard ImageNet validation recipe: resize the shorter side to ``resize``,
    center-crop ``size`` x ``size``, normalise, CHW. ``max_short_side`` as :class:`ImageNetTrain`'s."""

    size: int = 224
    resize: int = 256
    mean: tuple[float, ...] = IMAGENET_MEAN
    std: tuple[float, ...] = IMAGENET_STD
    dtype: str = "float32"
    max_short_side: int | None = None
    name: str = field(default="imagenet-val", init=False)

    def __post_init__(self):
        check_common(self.size, self.mean, self.std, self.dtype)
        check_max_short_side(self.max_short_side)
        if not isinstance(self.resize, int) or self.resize < self.size:
            raise ValueError(f"resize must be an int >= size ({self.size}), got {self.resize!r}")

    def augment(self, images, ctx: PrepContext):
        from coordl.prep import graph

        return graph.val_tail(self, images, ctx)
