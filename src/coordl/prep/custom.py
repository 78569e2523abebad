"""A user's function of decoded images as a recipe: :class:`DecodedRecipe`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from coordl.prep.decoders import ImageDecoder
from coordl.prep.fields import check_max_short_side
from coordl.prep.protocol import Recipe

__all__ = ["DecodedRecipe"]


@dataclass(frozen=True)
class DecodedRecipe(Recipe):
    """A custom recipe that starts where decoding ends, so that it can use the decoded tier.

    coordl decodes every sample to RGB ``uint8`` ``(H, W, 3)`` at the file's own resolution
    (``fn.decoders.image(encoded, output_type=types.RGB)``), or takes the image from the node's
    decoded tier (``Cache(decoded=...)``) when another epoch or job decoded it already, and calls
    ``augment(images, ctx)`` on the batch; what it returns is delivered. Both ways give the same
    pixels, so a sample's tensor does not depend on where its image came from.

    A plain callable ``f(encoded, ctx)`` receives the encoded bytes instead and decodes them
    itself; it never uses the decoded tier. For more (audio clips, boxes, targets of its own),
    subclass :class:`coordl.Recipe` (docs/recipes.md).

    Args:
        augment: ``f(images, ctx) -> images`` building DALI ops from the decoded images'
            ``DataNode`` and a :class:`PrepContext`.
        max_short_side: images whose shorter side is longer are resized to it first (a change
            to the data, as :class:`ImageNetTrain`'s).
    """

    augment: Callable
    max_short_side: int | None = None

    def __post_init__(self):
        if not callable(self.augment):
            raise TypeError(f"DecodedRecipe needs a callable augment(images, ctx), got {type(self.augment).__name__}")
        check_max_short_side(self.max_short_side)

    @property
    def name(self) -> str:
        return f"decoded:{getattr(self.augment, '__qualname__', 'custom')}"

    @property
    def decoder(self) -> ImageDecoder:
        return ImageDecoder(adjust_orientation=True, max_short_side=self.max_short_side)

    def key(self) -> str:
        fn = self.augment
        cap = f":max_short_side={self.max_short_side}" if self.max_short_side else ""
        return f"decoded:{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}{cap}"
