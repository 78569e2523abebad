"""DALI's ops for recipes: decoding, windows, the built-in recipes' tails, and the graph that
serves a batch whose samples come encoded and decoded.

No function here asks which recipe it runs: a recipe (:mod:`coordl.prep.protocol`) composes these
ops in its own methods, and :func:`windowed` and :func:`tiered` are written against the protocol.
A recipe is decoding followed by augmentation; one that decodes only a window of each image
(:attr:`~coordl.prep.protocol.Recipe.crops_window`) is served from encoded bytes by
``fn.decoders.image_slice`` and from decoded images by ``fn.slice``: cropping a decoded image
gives exactly what decoding only the window gives.

:func:`tiered` serves a batch whose samples come three ways (:data:`~coordl.fetch.ahead.ENCODED`,
``DECODE_KEEP``, ``DECODED``), with DALI's per-sample conditionals, and also returns the full
decoded images of the ``DECODE_KEEP`` samples so that they can be put into the decoded tier.
"""

from __future__ import annotations

from nvidia.dali import fn, types
from nvidia.dali import math as dmath

from coordl.fetch.ahead import DECODE_KEEP, DECODED

__all__ = [
    "audio_window",
    "decode_audio",
    "decode_image",
    "decode_window",
    "image_shape",
    "normalize",
    "probe_image",
    "slice_window",
    "squared",
    "ssd_fed",
    "ssd_tail",
    "tiered",
    "train_tail",
    "val_tail",
    "windowed",
]


def decode_image(data, ctx, cap: int | None = None):
    """The full decode of images (RGB, HWC, uint8), the shorter side brought down to ``cap``."""
    images = fn.decoders.image(
        data, device=ctx.decoder_device, output_type=types.RGB, adjust_orientation=ctx.adjust_orientation
    )
    if not cap:
        return images
    # An image whose shorter side is N or less is "resized" to its own size: the same op on every
    # image, so that every path gives the same pixels.
    shape = fn.cast(images.shape(), dtype=types.FLOAT)
    shorter = dmath.min(float(cap), dmath.min(shape[0], shape[1]))
    return fn.resize(images, device=ctx.device, resize_shorter=shorter)


def probe_image(data, ctx):
    """An image's decode as the probe for undecodable samples runs it."""
    return fn.decoders.image(data, device=ctx.decoder_device, output_type=types.RGB)


def decode_audio(data, sample_rate: int, quality: float):
    """The whole clip, downmixed and resampled (float32, 1-D)."""
    waveform, _ = fn.decoders.audio(
        data, sample_rate=float(sample_rate), downmix=True, dtype=types.FLOAT, quality=float(quality)
    )
    return waveform


def image_shape(data, ctx):
    """Each encoded image's ``(H, W, C)`` (int64), from its header: what the decoders will make of it."""
    return fn.peek_image_shape(data, dtype=types.INT64, adjust_orientation=ctx.adjust_orientation)


def windowed(recipe, data, shape, ctx):
    """A :attr:`~coordl.prep.protocol.Recipe.crops_window` recipe's output from encoded bytes:
    its window from each image's ``shape``, decoded alone."""
    anchor, size, rest = recipe.window(shape, ctx)
    return recipe.from_window(decode_window(data, anchor, size, ctx), rest, ctx)


def tiered(recipe, data, images, kind, ctx):
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
    if recipe.crops_window:
        # The window (from each sample's shape, or fed); then the crop, from the tier's image,
        # from a full decode (kept for the tier) or from decoding the window alone.
        if kind == DECODED:
            shape = images.shape()
        else:
            shape = image_shape(data, ctx)
        anchor, size, rest = recipe.window(shape, ctx)
        if kind == DECODED:
            crop = slice_window(images, anchor, size, ctx)
            full = images[0:0]
        else:
            if kind == DECODE_KEEP:
                full = recipe.decoder.decode(data, ctx)
                crop = slice_window(full, anchor, size, ctx)
            else:
                crop = decode_window(data, anchor, size, ctx)
                full = images
        return recipe.from_window(crop, rest, ctx), full, shape
    if kind == DECODED:
        decoded = images
        full = images[0:0]
    else:
        decoded = recipe.decoder.decode(data, ctx)
        if kind == DECODE_KEEP:
            full = decoded
        else:
            full = images
    return recipe.augment(decoded, ctx), full, decoded.shape()


def decode_window(data, anchor, size, ctx):
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


def slice_window(images, anchor, size, ctx):
    """The window ``(anchor, size)`` of decoded images: the same pixels as :func:`decode_window`."""
    return fn.slice(
        images, anchor, size, axis_names="WH", normalized_anchor=False, normalized_shape=False, device=ctx.device
    )


def train_tail(recipe, images, ctx, mirror=None):
    """The ImageNet training recipe after its crop: resize, flip (drawn unless given), normalise."""
    images = fn.resize(images, device=ctx.device, resize_x=recipe.size, resize_y=recipe.size)
    if mirror is None:
        mirror = ctx.random.coin_flip(recipe.flip)
    return normalize(images, recipe, ctx, mirror=mirror, crop=None)


def val_tail(recipe, images, ctx):
    """The ImageNet validation recipe on decoded images: the shorter side to ``resize``, the centre
    ``size`` x ``size``, normalised."""
    images = fn.resize(images, device=ctx.device, resize_shorter=recipe.resize)
    return normalize(images, recipe, ctx, mirror=0, crop=(recipe.size, recipe.size))


def squared(recipe, images, ctx):
    """The whole image resized to ``size`` x ``size``, normalised (SSD's evaluation recipe)."""
    images = fn.resize(images, device=ctx.device, resize_x=recipe.size, resize_y=recipe.size)
    return normalize(images, recipe, ctx, mirror=0, crop=None)


def audio_window(waveform, samples: int, ctx, *, drawn: bool, gain=None):
    """A window of ``samples`` of each resampled clip, as ``(1, samples)``: from a start drawn
    uniformly among the clip's ``length - samples + 1`` (``drawn``) or the centre, zeros after the
    clip's end; then a gain drawn from ``gain`` (decibels), if given."""
    length = fn.cast(waveform.shape(), dtype=types.FLOAT)[0]
    room = dmath.max(length - float(samples), 0.0)  # the starts there are, less one
    if drawn:
        start = dmath.floor(ctx.random.uniform() * (room + 1.0))
    else:
        start = dmath.floor(room * 0.5)
    window = fn.slice(
        waveform,
        start=fn.cast(fn.reshape(start, shape=[1]), dtype=types.INT32),
        shape=[samples],
        axes=[0],
        out_of_bounds_policy="pad",
        fill_values=0.0,
    )
    if gain is not None:
        window = window * dmath.pow(10.0, ctx.random.uniform(gain) / 20.0)
    window = fn.reshape(window, shape=[1, samples])
    return window.gpu() if ctx.device == "gpu" else window  # DALI decodes audio on the CPU only


def ssd_fed(ctx, shape, fed: int):
    """SSDTrain's per-sample plan as fed (:func:`coordl.detection.crops.Plan.fed`, ``fed`` numbers):
    the window's anchor and size (pixels), the flip and the colour twist (brightness, contrast,
    saturation, hue).

    The window was planned on the image's size as its annotations give it; it is kept inside the
    image's real ``shape`` (HWC), so that an image of another size decodes (and is then refused by
    the size check) instead of failing the pipeline."""
    p = ctx.random.fed(fed)
    shape = fn.cast(shape, dtype=types.FLOAT)
    height, width = shape[0], shape[1]
    x, y = dmath.min(p[0], width - 1.0), dmath.min(p[1], height - 1.0)
    w, h = dmath.min(p[2], width - x), dmath.min(p[3], height - y)
    return fn.stack(x, y), fn.stack(w, h), (fn.cast(p[4], dtype=types.INT32), (p[5], p[6], p[7], p[8]))


def ssd_tail(recipe, images, mirror, colour, ctx):
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
    return normalize(images, recipe, ctx, mirror=mirror, crop=None)


def normalize(images, recipe, ctx, *, mirror, crop):
    """``fn.crop_mirror_normalize`` to CHW with the recipe's ``mean``/``std`` (fractions of 255), or
    uint8 pixels when its ``dtype`` is ``"uint8"``."""
    kwargs = {"crop": crop} if crop else {}
    if recipe.dtype == "uint8":
        mean, std, dtype = [0.0], [1.0], types.UINT8
    else:
        mean, std, dtype = [m * 255 for m in recipe.mean], [s * 255 for s in recipe.std], types.FLOAT
    return fn.crop_mirror_normalize(
        images, device=ctx.device, dtype=dtype, output_layout="CHW", mirror=mirror, mean=mean, std=std, **kwargs
    )
