"""The recipe protocol: what the pipeline graph, the checks, staging and delivery ask a recipe.

A recipe is one object that answers for itself, as :mod:`coordl.prep.site` does for ``prep=``:
nothing else in coordl asks which kind of recipe it holds. The questions, and who asks them:

- the source (:mod:`coordl.sources`): :meth:`Recipe.index_options` (which files to index: images
  or audio clips, with or without boxes) and :meth:`Recipe.check_index` (can it deliver this
  index's targets);
- the pipeline (:mod:`coordl.prep.dali`, :mod:`coordl.prep.graph`): :attr:`Recipe.decoder` (how a
  sample is decoded, the decoder's settings, the decoded tier's items), :meth:`Recipe.encoded`,
  :meth:`Recipe.augment`, :meth:`Recipe.window` and :meth:`Recipe.from_window` (a recipe that
  decodes only a window of each image), :meth:`Recipe.feed` (the per-sample numbers fed beside
  the bytes), :meth:`Recipe.planned` (an epoch served decoded, its windows computed before);
- the checks: :meth:`Recipe.before_decoding` and :meth:`Recipe.after_decoding`;
- staging and remote prep: :meth:`Recipe.output` (a sample's shape and dtype when known),
  :meth:`Recipe.normalisation` and :meth:`Recipe.pixels` (pixels that travel as uint8 and are
  normalised after);
- the decoded tier: :attr:`Recipe.takes_decoded` and :meth:`Recipe.decoded_form`;
- delivery (:mod:`coordl.delivery`): :meth:`Recipe.targets`;
- the configuration's identity: :meth:`Recipe.key`.

Every method has a default, so a recipe of one's own overrides only what differs: a function of
decoded images overrides :meth:`Recipe.augment`; a detection recipe sets ``target = "boxes"`` and
overrides :meth:`Recipe.targets`; an audio recipe returns an :class:`~coordl.prep.decoders.AudioDecoder`.
This is also the one module that may ask a recipe's type (:func:`as_recipe`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from coordl import draws
from coordl.prep.decoders import ImageDecoder

__all__ = ["CallableRecipe", "PrepContext", "Recipe", "as_recipe"]


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
        adjust_orientation: for the decoders' argument of that name, from the recipe's decoder
            (:attr:`Recipe.decoder`): False for a detection recipe (its boxes are in the frame of
            the pixels as stored, as Pillow reads them).
    """

    decoder_device: str
    device: str
    device_id: int | None
    random: object = None
    adjust_orientation: bool = True


class Recipe:
    """A kind of recipe: subclass it (a frozen dataclass, usually) and override what differs.

    Attributes:
        name: what the loader's ``repr`` and messages call it (None: "a custom recipe").
        target: what a sample's target is made from: ``"label"`` (the index's class) or
            ``"boxes"`` (a detection index's boxes, :meth:`coordl.Index.from_coco`).
        takes_decoded: whether the recipe starts from decoded images or waveforms
            (:meth:`augment`), and so can use the decoded tier.
    """

    name: str | None = None
    target: str = "label"
    takes_decoded: bool = True

    # -- the source ---------------------------------------------------------------------------

    @property
    def decoder(self):
        """How a sample is decoded: an :class:`~coordl.prep.decoders.ImageDecoder` (the default:
        RGB at the file's resolution, EXIF orientation applied unless ``target`` is ``"boxes"``)
        or an :class:`~coordl.prep.decoders.AudioDecoder`."""
        return ImageDecoder(adjust_orientation=self.target != "boxes")

    def index_options(self) -> dict:
        """The arguments of :func:`coordl.sources.make_index` for a folder or tar shards: which
        files to index (the decoder's media) and whether the samples carry boxes."""
        return {"boxes": self.target == "boxes", "audio": self.decoder.media == "audio"}

    def check_index(self, index) -> None:
        """Raises ``ValueError`` when the recipe cannot deliver the index's targets: boxes asked of
        an index without them, or an index of boxes that the recipe would not move with its pixels."""
        name = self.name or "a custom recipe"
        if self.target == "boxes" and index.boxes is None:
            raise ValueError(
                f"pipeline {name!r} moves boxes with the pixels, and this dataset has none: give it a detection "
                "index, coordl.Index.from_coco(images, annotations) (or tar shards whose samples carry a .json member)"
            )
        if index.boxes is not None and self.target != "boxes":
            raise ValueError(
                f"this dataset's targets are boxes, which pipeline {name!r} would not move with the pixels: use "
                "pipeline='ssd-train' or 'ssd-val' (coordl.SSDTrain / coordl.SSDVal), or a recipe of your own "
                "whose target is 'boxes' (docs/recipes.md)"
            )

    # -- the pipeline -------------------------------------------------------------------------

    def encoded(self, data, ctx: PrepContext):
        """The recipe's output from the encoded bytes' ``DataNode``: decoding, then :meth:`augment`."""
        return self.augment(self.decoder.decode(data, ctx), ctx)

    def encoded_checked(self, data, ctx: PrepContext):
        """:meth:`encoded`, and what :meth:`after_decoding` checks (each decoded sample's shape), or
        None when the recipe checks nothing after decoding."""
        return self.encoded(data, ctx), None

    def augment(self, images, ctx: PrepContext):
        """The recipe's output from decoded images (``uint8`` HWC) or waveforms (float32)."""
        raise TypeError(f"the recipe {self!r} takes encoded bytes, not decoded images")

    #: Whether the recipe decodes only a window of each image (:meth:`window`, :meth:`from_window`).
    crops_window: bool = False

    def window(self, shape, ctx: PrepContext):
        """``(anchor, size, rest)``: each sample's window (pixels, ``[x, y]`` and ``[w, h]``) from
        its image's ``shape`` (HWC), and what :meth:`from_window` needs besides the crop."""
        raise NotImplementedError

    def from_window(self, crop, rest, ctx: PrepContext):
        """The recipe's output from the decoded windows."""
        raise NotImplementedError

    def feed(self, seed: int, epoch: int, ids: np.ndarray, columns: int, boxes, decoded=None) -> tuple:
        """The per-sample arrays fed beside a batch's bytes: by default the ``columns`` uniform draws
        of ``(seed, epoch, sample)`` that ``ctx.random`` hands out. ``decoded``: the batch's decoded
        images, for a recipe that :attr:`plans_decoded`."""
        return (draws.uniforms(seed, epoch, ids, columns),)

    #: Whether, on an epoch the decoded tier serves whole, the recipe is fed what :meth:`planned` takes.
    plans_decoded: bool = False

    def planned(self, images, anchor, size, mirror, ctx: PrepContext):
        """The recipe's output from decoded images whose windows and flips were computed before:
        :meth:`feed`, given the decoded images, returns them as ``anchor`` and ``size`` (float32
        ``(n, 2)``, pixels) and ``mirror`` (int32 ``(n,)``)."""
        raise NotImplementedError

    # -- the checks ---------------------------------------------------------------------------

    @property
    def checks_before(self) -> bool:
        """Whether a batch's bytes are checked before decoding (:meth:`before_decoding`)."""
        return self.decoder.checks_before

    @property
    def checks_after(self) -> bool:
        """Whether the decoded samples' shapes are checked (:meth:`after_decoding`)."""
        return self.decoder.checks_after

    def before_decoding(self, batch) -> dict[int, str]:
        """``{position in the batch: why}`` of the samples whose bytes show a fault."""
        return self.decoder.before_decoding(batch)

    def after_decoding(self, boxes, ids: np.ndarray, shapes) -> dict[int, str]:
        """``{position in the batch: why}`` of the samples whose decoded shape is wrong."""
        return self.decoder.after_decoding(shapes)

    # -- staging, remote prep, the decoded tier -------------------------------------------------

    def output(self) -> tuple[tuple[int, ...], str] | None:
        """A sample's shape and dtype, when the recipe knows them without running (None: staging
        runs it on one sample to learn them)."""
        return None

    def normalisation(self) -> tuple[tuple[float, ...], tuple[float, ...]] | None:
        """``(mean, std)`` (fractions of 255) when the output is normalised pixels that may travel
        as uint8 (:meth:`pixels`) and be normalised after; None otherwise."""
        return None

    def pixels(self) -> Recipe:
        """The recipe that delivers this one's uint8 pixels before normalisation."""
        raise TypeError(f"the recipe {self!r} has no uint8 pixels to send before normalisation")

    def decoded_form(self) -> dict:
        """What names the decoded tier's items beyond the file's own decoding (the arguments of
        :meth:`CacheSpec.for_dataset <coordl.fetch.spec.CacheSpec.for_dataset>`)."""
        return self.decoder.form()

    # -- delivery and identity ----------------------------------------------------------------

    def targets(self, labels, ids, *, boxes, seed: int, epoch: int, device):
        """What the training loop receives beside a batch's outputs: by default the labels (int64).

        Args:
            labels: the batch's labels, an int64 tensor.
            ids: the samples' positions in the index (int64 tensor, on the CPU).
            boxes: the index's :class:`~coordl.detection.boxes.Boxes`, or None.
            seed, epoch: the loader's seed and the epoch whose draws made the batch's pixels.
            device: where the batch's images are.
        """
        return labels

    def key(self) -> str:
        """A stable description, for the configuration's fingerprint (a resume checks it)."""
        return repr(self)


class CallableRecipe(Recipe):
    """A user's function ``f(encoded, ctx)`` of the encoded bytes' ``DataNode``, as a recipe.

    It decodes itself, so it never uses the decoded tier."""

    takes_decoded = False

    def __init__(self, fn: Callable):
        self.fn = fn

    def encoded(self, data, ctx: PrepContext):
        return self.fn(data, ctx)

    def key(self) -> str:
        fn = self.fn
        return f"callable:{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"

    def __repr__(self) -> str:
        return f"CallableRecipe({self.fn!r})"

    def __eq__(self, other) -> bool:
        return type(other) is CallableRecipe and other.fn == self.fn

    def __hash__(self) -> int:
        return hash(self.fn)


def as_recipe(pipeline) -> Recipe:
    """``pipeline`` as a :class:`Recipe`: a recipe as it is, a callable wrapped
    (:class:`CallableRecipe`)."""
    if isinstance(pipeline, Recipe):
        return pipeline
    if callable(pipeline):
        return CallableRecipe(pipeline)
    raise TypeError(f"pipeline must be a recipe name, a recipe or a callable, got {type(pipeline).__name__}")
