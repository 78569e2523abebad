"""The pre-processing recipes a loader can run: the built-in ones by name, and what a user passes.

Each kind of recipe is a class answering the protocol of :mod:`coordl.prep.protocol`
(:class:`Recipe`): :class:`ImageNetTrain` and :class:`ImageNetVal` (:mod:`.imagenet`),
:class:`SSDTrain` and :class:`SSDVal` (:mod:`.ssd`), :class:`AudioTrain` and :class:`AudioVal`
(:mod:`.waveforms`), :class:`DecodedRecipe` (:mod:`.custom`), a callable on encoded bytes
(:class:`CallableRecipe`), and a user's own subclass of :class:`Recipe`.
"""

from __future__ import annotations

from coordl.prep.custom import DecodedRecipe
from coordl.prep.fields import IMAGENET_MEAN, IMAGENET_STD
from coordl.prep.imagenet import ImageNetTrain, ImageNetVal
from coordl.prep.protocol import CallableRecipe, PrepContext, Recipe, as_recipe
from coordl.prep.ssd import SSDTrain, SSDVal
from coordl.prep.waveforms import AudioTrain, AudioVal

__all__ = [
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "NAMED",
    "AudioTrain",
    "AudioVal",
    "CallableRecipe",
    "DecodedRecipe",
    "ImageNetTrain",
    "ImageNetVal",
    "PrepContext",
    "Recipe",
    "SSDTrain",
    "SSDVal",
    "resolve_recipe",
]

#: The recipes ``pipeline=`` names.
NAMED = {
    "imagenet-train": ImageNetTrain,
    "imagenet-val": ImageNetVal,
    "ssd-train": SSDTrain,
    "ssd-val": SSDVal,
    "audio-train": AudioTrain,
    "audio-val": AudioVal,
}


def resolve_recipe(pipeline) -> Recipe:
    """A recipe from what the user passed as ``pipeline=``.

    Args:
        pipeline: ``"imagenet-train"``, ``"imagenet-val"``, ``"ssd-train"``, ``"ssd-val"``,
            ``"audio-train"``, ``"audio-val"``, a recipe object (a built-in one, a
            :class:`DecodedRecipe`, a subclass of :class:`Recipe`), or a callable
            ``f(encoded, ctx) -> images`` that builds DALI ops from the encoded-bytes ``DataNode``
            and a :class:`PrepContext`.
    """
    if isinstance(pipeline, str):
        if pipeline not in NAMED:
            raise ValueError(f"unknown pipeline {pipeline!r}; expected one of {sorted(NAMED)} or a callable")
        return NAMED[pipeline]()
    return as_recipe(pipeline)
