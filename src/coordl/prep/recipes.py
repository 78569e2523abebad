"""The pre-processing recipes a loader can run, as plain validated configuration."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = [
    "AUDIO",
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "IMAGES",
    "AudioTrain",
    "AudioVal",
    "DecodedRecipe",
    "ImageNetTrain",
    "ImageNetVal",
    "PrepContext",
    "SSDTrain",
    "SSDVal",
    "decoded_form",
    "is_audio",
    "is_detection",
    "max_short_side",
    "normalised",
    "output_shape",
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
        adjust_orientation: for the decoders' argument of that name: False on a detection
            dataset (its boxes are in the frame of the pixels as stored, as Pillow reads them).
    """

    decoder_device: str
    device: str
    device_id: int | None
    random: object = None
    adjust_orientation: bool = True  # False on a detection dataset: its boxes are in the stored pixels' frame


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


def _check_range(name: str, bounds, lo: float | None = None) -> None:
    ok = isinstance(bounds, tuple) and len(bounds) == 2 and all(isinstance(v, (int, float)) for v in bounds)
    if not ok or bounds[0] > bounds[1] or (lo is not None and bounds[0] < lo):
        floor = f", from {lo}" if lo is not None else ""
        raise ValueError(f"{name} must be a (min, max) tuple with min <= max{floor}, got {bounds!r}")


@dataclass(frozen=True)
class SSDTrain:
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
        _check_common(self.size, self.mean, self.std, self.dtype)
        if not isinstance(self.thresholds, tuple) or not all(
            isinstance(t, (int, float)) and 0 <= t < 1 for t in self.thresholds
        ):
            raise ValueError(f"thresholds must be a tuple of minimum IoUs in [0, 1), got {self.thresholds!r}")
        _check_range("scaling", self.scaling, 0)
        if not 0 < self.scaling[0] <= self.scaling[1] <= 1:
            raise ValueError(f"scaling must satisfy 0 < min <= max <= 1, got {self.scaling}")
        _check_range("aspect", self.aspect, 0)
        if self.aspect[0] <= 0:
            raise ValueError(f"aspect must be positive, got {self.aspect}")
        if isinstance(self.tries, bool) or not isinstance(self.tries, int) or self.tries < 1:
            raise ValueError(f"tries must be a positive int, got {self.tries!r}")
        if not 0 <= self.flip <= 1:
            raise ValueError(f"flip is a probability in [0, 1], got {self.flip}")
        for name in ("brightness", "contrast", "saturation"):
            _check_range(name, getattr(self, name), 0)
        _check_range("hue", self.hue)

    @property
    def twists_colour(self) -> bool:
        """Whether the colour twist changes anything (all ranges ``(1, 1)`` and hue ``(0, 0)``: not)."""
        unit = (1, 1)
        same = self.brightness == unit and self.contrast == unit and self.saturation == unit
        return not (same and self.hue == (0, 0))


@dataclass(frozen=True)
class SSDVal:
    """SSD300's evaluation recipe: resize the whole image to ``size`` x ``size``, normalise, CHW;
    boxes scaled exactly with it (``x * size / width``, ``y * size / height``). Batches as
    :class:`SSDTrain`'s."""

    size: int = 300
    mean: tuple[float, ...] = IMAGENET_MEAN
    std: tuple[float, ...] = IMAGENET_STD
    dtype: str = "float32"
    name: str = field(default="ssd-val", init=False)

    def __post_init__(self):
        _check_common(self.size, self.mean, self.std, self.dtype)


def _check_audio(sample_rate, samples, quality) -> None:
    if isinstance(sample_rate, bool) or not isinstance(sample_rate, int) or sample_rate < 1:
        raise ValueError(f"sample_rate must be a positive int (Hz), got {sample_rate!r}")
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
        raise ValueError(f"samples must be a positive int (the window's length), got {samples!r}")
    if isinstance(quality, bool) or not isinstance(quality, (int, float)) or not 0 <= quality <= 100:
        raise ValueError(f"quality must be a number in [0, 100] (DALI's resampling quality), got {quality!r}")


@dataclass(frozen=True)
class AudioTrain:
    """The training recipe of an audio classifier (M5 on FMA, in CoorDL's paper): decode, downmix
    to mono, resample to ``sample_rate`` (DALI's windowed-sinc resampler at ``quality``), a random
    window of ``samples`` (zero-padded at the end when the clip is shorter), optionally a gain drawn
    from ``gain`` (decibels). Batches are ``(waveforms, labels)``, waveforms float32 ``(B, 1,
    samples)``. The window's start and the gain are functions of ``(seed, epoch, sample)``."""

    sample_rate: int = 8000
    samples: int = 32000
    gain: tuple[float, float] | None = None
    quality: float = 50.0
    name: str = field(default="audio-train", init=False)

    def __post_init__(self):
        _check_audio(self.sample_rate, self.samples, self.quality)
        if self.gain is not None:
            _check_range("gain", self.gain)


@dataclass(frozen=True)
class AudioVal:
    """An audio classifier's evaluation recipe: :class:`AudioTrain`'s decoding, the centre window
    of ``samples`` (zero-padded at the end when the clip is shorter), no randomness."""

    sample_rate: int = 8000
    samples: int = 32000
    quality: float = 50.0
    name: str = field(default="audio-val", init=False)

    def __post_init__(self):
        _check_audio(self.sample_rate, self.samples, self.quality)


_NAMED = {
    "imagenet-train": ImageNetTrain,
    "imagenet-val": ImageNetVal,
    "ssd-train": SSDTrain,
    "ssd-val": SSDVal,
    "audio-train": AudioTrain,
    "audio-val": AudioVal,
}

#: The built-in recipes of images: coordl knows their output's shape, and can stage or send their
#: pixels as uint8 and normalise them after (:func:`normalised`).
IMAGES = (ImageNetTrain, ImageNetVal, SSDTrain, SSDVal)
#: The built-in recipes of audio clips.
AUDIO = (AudioTrain, AudioVal)
BUILT_IN = IMAGES + AUDIO

Recipe = ImageNetTrain | ImageNetVal | SSDTrain | SSDVal | AudioTrain | AudioVal | DecodedRecipe | Callable


def is_audio(recipe) -> bool:
    """Whether a recipe reads audio clips (:class:`AudioTrain`, :class:`AudioVal`)."""
    return isinstance(recipe, AUDIO)


def output_shape(recipe) -> tuple[int, ...] | None:
    """A built-in recipe's sample shape (``(3, size, size)`` or ``(1, samples)``), else None."""
    if is_audio(recipe):
        return (1, recipe.samples)
    if isinstance(recipe, IMAGES):
        return (3, recipe.size, recipe.size)
    return None


def is_detection(recipe) -> bool:
    """Whether a recipe takes a detection index and delivers boxes (:class:`SSDTrain`, :class:`SSDVal`)."""
    return isinstance(recipe, (SSDTrain, SSDVal))


def normalised(recipe) -> bool:
    """Whether a recipe's output is a built-in recipe's normalised float32: its pixels can travel as
    uint8 (``dataclasses.replace(recipe, dtype="uint8")``) and be normalised after, with its
    ``mean`` and ``std``."""
    return isinstance(recipe, IMAGES) and recipe.dtype == "float32"


def decoded_form(recipe) -> dict:
    """What a recipe's decoded items are, beyond the file's own decoding: the arguments of
    :meth:`CacheSpec.for_dataset <coordl.fetch.spec.CacheSpec.for_dataset>` that name its decoded
    tier (images capped at ``max_short_side``; an audio recipe's waveforms at its rate and quality)."""
    if is_audio(recipe):
        return {"waveform": f"{recipe.sample_rate}Hz:q{float(recipe.quality):g}"}
    return {"max_short_side": max_short_side(recipe)}


def max_short_side(recipe) -> int | None:
    """The cap on a decoded image's shorter side the recipe asks for (None: the file's resolution)."""
    return getattr(recipe, "max_short_side", None) if takes_decoded(recipe) else None


def takes_decoded(recipe) -> bool:
    """Whether a recipe starts from decoded images or waveforms (and can use the decoded tier): the
    built-in recipes and :class:`DecodedRecipe` do; a plain callable on encoded bytes does not."""
    return isinstance(recipe, (*BUILT_IN, DecodedRecipe))


def resolve_recipe(pipeline) -> Recipe:
    """A recipe from what the user passed as ``pipeline=``.

    Args:
        pipeline: ``"imagenet-train"``, ``"imagenet-val"``, ``"ssd-train"``, ``"ssd-val"``,
            ``"audio-train"``, ``"audio-val"``, a built-in recipe object, a :class:`DecodedRecipe` (a
            function of the decoded images), or a
            callable ``f(encoded, ctx) -> images`` that builds DALI ops from the encoded-bytes
            ``DataNode`` and a :class:`PrepContext`.
    """
    if isinstance(pipeline, str):
        if pipeline not in _NAMED:
            raise ValueError(f"unknown pipeline {pipeline!r}; expected one of {sorted(_NAMED)} or a callable")
        return _NAMED[pipeline]()
    if isinstance(pipeline, (*BUILT_IN, DecodedRecipe)) or callable(pipeline):
        return pipeline
    raise TypeError(f"pipeline must be a recipe name, a recipe or a callable, got {type(pipeline).__name__}")


def recipe_key(recipe) -> str:
    """A stable description of a recipe, for config fingerprints."""
    if isinstance(recipe, (SSDTrain, SSDVal, AudioTrain, AudioVal)):
        return repr(recipe)
    if isinstance(recipe, (ImageNetTrain, ImageNetVal)):
        if recipe.max_short_side is None:  # the key from before the field: older checkpoints still resume
            return repr(recipe).replace(", max_short_side=None", "")
        return repr(recipe)
    if isinstance(recipe, DecodedRecipe):
        fn = recipe.augment
        cap = f":max_short_side={recipe.max_short_side}" if recipe.max_short_side else ""
        return f"decoded:{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}{cap}"
    return f"callable:{getattr(recipe, '__module__', '?')}.{getattr(recipe, '__qualname__', repr(recipe))}"
