"""A recipe's DALI ops, from encoded bytes or from decoded images, and the graph that mixes both.

A recipe is decoding followed by augmentation. :func:`encoded` builds it on encoded bytes
(the built-in training recipe decodes only its crop window, ``fn.decoders.image_slice``);
:func:`augment` builds the augmentation alone on decoded images (the decoder's RGB output
at the file's resolution, or capped by the recipe's ``max_short_side``). The two deliver the
same pixels for the same draws: cropping a decoded image with ``fn.slice`` gives exactly what
decoding only the window gives (with a cap, both paths decode whole images and resize them).

:func:`tiered` serves a batch whose samples come three ways (:data:`~coordl.fetch.ahead.ENCODED`,
``DECODE_KEEP``, ``DECODED``), with DALI's per-sample conditionals, and also returns the full
decoded images of the ``DECODE_KEEP`` samples so that they can be put into the decoded tier.
"""

from __future__ import annotations

from nvidia.dali import fn, types
from nvidia.dali import math as dmath

from coordl.detection.crops import FED
from coordl.fetch.ahead import DECODE_KEEP, DECODED
from coordl.prep.recipes import (
    AudioTrain,
    DecodedRecipe,
    ImageNetTrain,
    ImageNetVal,
    PrepContext,
    SSDTrain,
    SSDVal,
    is_audio,
    max_short_side,
    takes_decoded,
)

__all__ = ["augment", "decode", "encoded", "encoded_checked", "image_shape", "planned_train", "tiered"]


def decode(data, ctx: PrepContext, recipe=None):
    """The full decode every recipe that takes decoded images starts from (RGB, HWC, uint8),
    its shorter side brought down to the recipe's ``max_short_side`` if it asks for one; an audio
    recipe's, the whole clip downmixed and resampled (float32, 1-D)."""
    if is_audio(recipe):
        waveform, _ = fn.decoders.audio(
            data,
            sample_rate=float(recipe.sample_rate),
            downmix=True,
            dtype=types.FLOAT,
            quality=float(recipe.quality),
        )
        return waveform
    images = fn.decoders.image(
        data, device=ctx.decoder_device, output_type=types.RGB, adjust_orientation=ctx.adjust_orientation
    )
    cap = max_short_side(recipe)
    if not cap:
        return images
    # An image whose shorter side is N or less is "resized" to its own size: the same op on every
    # image, so that every path gives the same pixels.
    shape = fn.cast(images.shape(), dtype=types.FLOAT)
    shorter = dmath.min(float(cap), dmath.min(shape[0], shape[1]))
    return fn.resize(images, device=ctx.device, resize_shorter=shorter)


def image_shape(data, ctx: PrepContext):
    """Each encoded image's ``(H, W, C)`` (int64), from its header: what the decoders will make of it."""
    return fn.peek_image_shape(data, dtype=types.INT64, adjust_orientation=ctx.adjust_orientation)


def encoded_checked(recipe, data, ctx: PrepContext):
    """The recipe's output from encoded bytes, and the shape of each decoded sample that
    :mod:`coordl.prep.checks` checks (a detection image's, from its header; an audio clip's, once
    resampled), or None for other recipes."""
    if is_audio(recipe):
        waveform = decode(data, ctx, recipe)
        return _audio_window(recipe, waveform, ctx), waveform.shape()
    shape = image_shape(data, ctx) if isinstance(recipe, (SSDTrain, SSDVal)) else None
    return encoded(recipe, data, ctx), shape


def encoded(recipe, data, ctx: PrepContext):
    """The recipe's output from encoded bytes."""
    if is_audio(recipe):
        return _audio_window(recipe, decode(data, ctx, recipe), ctx)
    if isinstance(recipe, SSDTrain):
        anchor, size, mirror, colour = _ssd_fed(ctx, image_shape(data, ctx))
        return _ssd_tail(recipe, _decode_window(data, anchor, size, ctx), mirror, colour, ctx)
    if isinstance(recipe, ImageNetTrain) and not recipe.max_short_side:
        anchor, size = ctx.random.planned_crop_window(fn.peek_image_shape(data), recipe.ratio)
        return _train_tail(recipe, _decode_window(data, anchor, size, ctx), ctx)
    if takes_decoded(recipe):
        return augment(recipe, decode(data, ctx, recipe), ctx)
    return recipe(data, ctx)


def augment(recipe, images, ctx: PrepContext):
    """The recipe's output from decoded images or waveforms (a recipe that takes them: see
    :func:`~coordl.prep.recipes.takes_decoded`)."""
    if is_audio(recipe):
        return _audio_window(recipe, images, ctx)
    if isinstance(recipe, ImageNetTrain):
        anchor, size = ctx.random.planned_crop_window(images.shape(), recipe.ratio)
        return _train_tail(recipe, _slice(images, anchor, size, ctx), ctx)
    if isinstance(recipe, ImageNetVal):
        images = fn.resize(images, device=ctx.device, resize_shorter=recipe.resize)
        return _normalize(images, recipe, ctx, mirror=0, crop=(recipe.size, recipe.size))
    if isinstance(recipe, SSDTrain):
        anchor, size, mirror, colour = _ssd_fed(ctx, images.shape())
        return _ssd_tail(recipe, _slice(images, anchor, size, ctx), mirror, colour, ctx)
    if isinstance(recipe, SSDVal):
        images = fn.resize(images, device=ctx.device, resize_x=recipe.size, resize_y=recipe.size)
        return _normalize(images, recipe, ctx, mirror=0, crop=None)
    if isinstance(recipe, DecodedRecipe):
        return recipe.augment(images, ctx)
    raise TypeError(f"the recipe {recipe!r} takes encoded bytes, not decoded images")


def tiered(recipe, data, images, kind, ctx: PrepContext):
    """The recipe over a batch that mixes the three ways a sample comes (``kind`` per sample).

    Only where a sample's pixels come from is conditional: the crop window's arithmetic and the
    augmentation run once over the whole batch. DALI runs a branch's operators on that branch's
    samples alone, so each operator inside a branch is paid once per branch, and every output of
    a branch is merged.

    Args:
        data: encoded bytes (empty for ``DECODED`` samples).
        images: decoded images from the tier (empty for the others).
        kind: int32 per sample.

    Returns:
        ``(outputs, full, shape)``: the recipe's outputs, the decoded images of the
        ``DECODE_KEEP`` samples (an empty image for the others), and each sample's image shape
        ``(H, W, C)`` as it was decoded or as its header says.

    Built inside a pipeline with ``enable_conditionals=True``.
    """
    if isinstance(recipe, SSDTrain) or (isinstance(recipe, ImageNetTrain) and not recipe.max_short_side):
        # The window (from each sample's shape, or fed); then the crop, from the tier's image,
        # from a full decode (kept for the tier) or from decoding the window alone.
        if kind == DECODED:
            shape = images.shape()
        else:
            shape = image_shape(data, ctx)
        if isinstance(recipe, SSDTrain):
            anchor, size, mirror, colour = _ssd_fed(ctx, shape)
        else:
            anchor, size = ctx.random.planned_crop_window(shape, recipe.ratio)
        if kind == DECODED:
            crop = _slice(images, anchor, size, ctx)
            full = images[0:0]
        else:
            if kind == DECODE_KEEP:
                full = decode(data, ctx)
                crop = _slice(full, anchor, size, ctx)
            else:
                crop = _decode_window(data, anchor, size, ctx)
                full = images
        if isinstance(recipe, SSDTrain):
            return _ssd_tail(recipe, crop, mirror, colour, ctx), full, shape
        return _train_tail(recipe, crop, ctx), full, shape
    if kind == DECODED:
        decoded = images
        full = images[0:0]
    else:
        decoded = decode(data, ctx, recipe)
        if kind == DECODE_KEEP:
            full = decoded
        else:
            full = images
    return augment(recipe, decoded, ctx), full, decoded.shape()


def planned_train(recipe: ImageNetTrain, images, anchor, size, mirror, ctx: PrepContext):
    """The training recipe on decoded images whose crop windows and flips were computed before
    the pipeline (:mod:`coordl.prep.windows`): the same pixels as :func:`augment`'s."""
    return _train_tail(recipe, _slice(images, anchor, size, ctx), ctx, mirror=mirror)


def _decode_window(data, anchor, size, ctx: PrepContext):
    """Decodes only the window ``(anchor, size)`` (pixels, ``[x, y]`` and ``[w, h]``)."""
    return fn.decoders.image_slice(
        data,
        anchor,
        size,
        device=ctx.decoder_device,
        output_type=types.RGB,
        adjust_orientation=ctx.adjust_orientation,
        axis_names="WH",
        normalized_anchor=False,
        normalized_shape=False,
    )


def _slice(images, anchor, size, ctx: PrepContext):
    """The window ``(anchor, size)`` of decoded images: the same pixels as :func:`_decode_window`."""
    return fn.slice(
        images, anchor, size, axis_names="WH", normalized_anchor=False, normalized_shape=False, device=ctx.device
    )


def _train_tail(recipe: ImageNetTrain, images, ctx: PrepContext, mirror=None):
    images = fn.resize(images, device=ctx.device, resize_x=recipe.size, resize_y=recipe.size)
    if mirror is None:
        mirror = ctx.random.coin_flip(recipe.flip)
    return _normalize(images, recipe, ctx, mirror=mirror, crop=None)


def _audio_window(recipe, waveform, ctx: PrepContext):
    """A window of ``recipe.samples`` of each resampled clip, as ``(1, samples)``: from a start drawn
    uniformly among the clip's ``length - samples + 1`` (AudioTrain) or the centre (AudioVal), zeros
    after the clip's end; then AudioTrain's gain (decibels)."""
    length = fn.cast(waveform.shape(), dtype=types.FLOAT)[0]
    room = dmath.max(length - float(recipe.samples), 0.0)  # the starts there are, less one
    if isinstance(recipe, AudioTrain):
        start = dmath.floor(ctx.random.uniform() * (room + 1.0))
    else:
        start = dmath.floor(room * 0.5)
    window = fn.slice(
        waveform,
        start=fn.cast(fn.reshape(start, shape=[1]), dtype=types.INT32),
        shape=[recipe.samples],
        axes=[0],
        out_of_bounds_policy="pad",
        fill_values=0.0,
    )
    if isinstance(recipe, AudioTrain) and recipe.gain is not None:
        window = window * dmath.pow(10.0, ctx.random.uniform(recipe.gain) / 20.0)
    window = fn.reshape(window, shape=[1, recipe.samples])
    return window.gpu() if ctx.device == "gpu" else window  # DALI decodes audio on the CPU only


def _ssd_fed(ctx: PrepContext, shape):
    """SSDTrain's per-sample plan as fed (:func:`coordl.detection.crops.Plan.fed`): the window's
    anchor and size (pixels), the flip and the colour twist (brightness, contrast, saturation, hue).

    The window was planned on the image's size as its annotations give it; it is kept inside the
    image's real ``shape`` (HWC), so that an image of another size decodes (and is then refused by
    the size check, :meth:`coordl.prep.dali.DaliPrep.epoch`) instead of failing the pipeline."""
    p = ctx.random.fed(FED)
    shape = fn.cast(shape, dtype=types.FLOAT)
    height, width = shape[0], shape[1]
    x, y = dmath.min(p[0], width - 1.0), dmath.min(p[1], height - 1.0)
    w, h = dmath.min(p[2], width - x), dmath.min(p[3], height - y)
    return fn.stack(x, y), fn.stack(w, h), fn.cast(p[4], dtype=types.INT32), (p[5], p[6], p[7], p[8])


def _ssd_tail(recipe: SSDTrain, images, mirror, colour, ctx: PrepContext):
    """Resize, colour twist (as NVIDIA's SSD300 pipeline: hue and saturation in float, then
    brightness and contrast around 128 back to uint8), flip and normalise."""
    images = fn.resize(images, device=ctx.device, resize_x=recipe.size, resize_y=recipe.size)
    if recipe.twists_colour:
        brightness, contrast, saturation, hue = colour
        images = fn.hsv(images, device=ctx.device, hue=hue, saturation=saturation, dtype=types.FLOAT)
        images = fn.brightness_contrast(
            images,
            device=ctx.device,
            brightness=brightness,
            contrast=contrast,
            contrast_center=128.0,
            dtype=types.UINT8,
        )
    return _normalize(images, recipe, ctx, mirror=mirror, crop=None)


def _normalize(images, recipe, ctx, *, mirror, crop):
    kwargs = {"crop": crop} if crop else {}
    if recipe.dtype == "uint8":
        mean, std, dtype = [0.0], [1.0], types.UINT8
    else:
        mean, std, dtype = [m * 255 for m in recipe.mean], [s * 255 for s in recipe.std], types.FLOAT
    return fn.crop_mirror_normalize(
        images, device=ctx.device, dtype=dtype, output_layout="CHW", mirror=mirror, mean=mean, std=std, **kwargs
    )
