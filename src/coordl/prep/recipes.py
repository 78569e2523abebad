"""The pre-processing recipes a loader can run, as plain validated configuration."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = [
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "DecodedRecipe",
    "ImageNetTrain",
    "ImageNetVal",
    "PrepContext",
    "max_short_side",
    "resolve_recipe",
    "takes_decoded",
]

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


@dataclass(frozen=True)
class PrepContext:
    """What a custom DALI recipe needs to know to build its ops.

    Attributes:
        decoder_device: ``"cpu"`` or ``"mixed"`` (the GPU decoder), for ``fn.decoders.*``.
        device: ``"cpu"`` or ``"gpu"``, for the ops after decoding.
        device_id: the GPU, or None on CPU.
        random: per-sample random numbers that are a function of ``(seed, epoch, sample)``
            (:class:`coordl.prep.planned.SampleRandom`: ``uniform``, ``coin_flip``, ``randint``,
            ``normal``, ``crop_window``); draw from it rather than from ``fn.random.*`` so that a
            sample's augmentation is the same whichever rank, batch or resume delivers it.
    """

    decoder_device: str
    device: str
    device_id: int | None
    random: object = None


def _check_common(size, mean, std, dtype):
    if not isinstance(size, int) or size < 1:
        raise ValueError(f"size must be a positive int, got {size!r}")
    if len(mean) != 3 or len(std) != 3 or any(s <= 0 for s in std):
        raise ValueError(f"mean and std need 3 values each (std > 0), got mean={mean}, std={std}")
    if dtype not in ("float32", "uint8"):
        raise ValueError(f"dtype must be 'float32' (normalised) or 'uint8' (raw pixels), got {dtype!r}")


def _check_max_short_side(n):
    if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
        raise ValueError(f"max_short_side must be a positive int (pixels) or None, got {n!r}")


@dataclass(frozen=True)
class ImageNetTrain:
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
        _check_common(self.size, self.mean, self.std, self.dtype)
        _check_max_short_side(self.max_short_side)
        if not 0 < self.scale[0] <= self.scale[1] <= 1:
            raise ValueError(f"scale must satisfy 0 < min <= max <= 1, got {self.scale}")
        if not 0 < self.ratio[0] <= self.ratio[1]:
            raise ValueError(f"ratio must satisfy 0 < min <= max, got {self.ratio}")
        if not 0 <= self.flip <= 1:
            raise ValueError(f"flip is a probability in [0, 1], got {self.flip}")


@dataclass(frozen=True)
class ImageNetVal:
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
        _check_common(self.size, self.mean, self.std, self.dtype)
        _check_max_short_side(self.max_short_side)
        if not isinstance(self.resize, int) or self.resize < self.size:
            raise ValueError(f"resize must be an int >= size ({self.size}), got {self.resize!r}")


@dataclass(frozen=True)
class DecodedRecipe:
    """A custom recipe that starts where decoding ends, so that it can use the decoded tier.

    coordl decodes every sample to RGB ``uint8`` ``(H, W, 3)`` at the file's own resolution
    (``fn.decoders.image(encoded, output_type=types.RGB)``), or takes the image from the node's
    decoded tier (``Cache(decoded=...)``) when another epoch or job decoded it already, and calls
    ``augment(images, ctx)`` on the batch; what it returns is delivered. Both ways give the same
    pixels, so a sample's tensor does not depend on where its image came from.

    A plain callable ``f(encoded, ctx)`` receives the encoded bytes instead and decodes them
    itself; it never uses the decoded tier.

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
        _check_max_short_side(self.max_short_side)

    @property
    def name(self) -> str:
        return f"decoded:{getattr(self.augment, '__qualname__', 'custom')}"


_NAMED = {"imagenet-train": ImageNetTrain, "imagenet-val": ImageNetVal}

Recipe = ImageNetTrain | ImageNetVal | DecodedRecipe | Callable


def max_short_side(recipe) -> int | None:
    """The cap on a decoded image's shorter side the recipe asks for (None: the file's resolution)."""
    return getattr(recipe, "max_short_side", None) if takes_decoded(recipe) else None


def takes_decoded(recipe) -> bool:
    """Whether a recipe starts from decoded images (and can use the decoded tier): the built-in
    recipes and :class:`DecodedRecipe` do; a plain callable on encoded bytes does not."""
    return isinstance(recipe, (ImageNetTrain, ImageNetVal, DecodedRecipe))


def resolve_recipe(pipeline) -> Recipe:
    """A recipe from what the user passed as ``pipeline=``.

    Args:
        pipeline: ``"imagenet-train"``, ``"imagenet-val"``, an :class:`ImageNetTrain` /
            :class:`ImageNetVal`, a :class:`DecodedRecipe` (a function of the decoded images), or a
            callable ``f(encoded, ctx) -> images`` that builds DALI ops from the encoded-bytes
            ``DataNode`` and a :class:`PrepContext`.
    """
    if isinstance(pipeline, str):
        if pipeline not in _NAMED:
            raise ValueError(f"unknown pipeline {pipeline!r}; expected one of {sorted(_NAMED)} or a callable")
        return _NAMED[pipeline]()
    if isinstance(pipeline, (ImageNetTrain, ImageNetVal, DecodedRecipe)) or callable(pipeline):
        return pipeline
    raise TypeError(f"pipeline must be a recipe name, a recipe or a callable, got {type(pipeline).__name__}")


def recipe_key(recipe) -> str:
    """A stable description of a recipe, for config fingerprints."""
    if isinstance(recipe, (ImageNetTrain, ImageNetVal)):
        if recipe.max_short_side is None:  # the key from before the field: older checkpoints still resume
            return repr(recipe).replace(", max_short_side=None", "")
        return repr(recipe)
    if isinstance(recipe, DecodedRecipe):
        fn = recipe.augment
        cap = f":max_short_side={recipe.max_short_side}" if recipe.max_short_side else ""
        return f"decoded:{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}{cap}"
    return f"callable:{getattr(recipe, '__module__', '?')}.{getattr(recipe, '__qualname__', repr(recipe))}"
