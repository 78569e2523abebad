"""What is wrong with a sample that DALI would decode without an error: a detection image of
another size than its annotations (its boxes would not be where its pixels are), an audio clip
cut short or empty. Pure functions of a batch and what the pipeline said of it; the caller
(:class:`~coordl.prep.dali.DaliPrep`) raises a :class:`~coordl.errors.SampleError` or, with
``on_error="skip"``, leaves the samples out.
"""

from __future__ import annotations

import numpy as np

from coordl.audio import formats
from coordl.fetch.ahead import DECODED
from coordl.prep.recipes import is_audio, is_detection

__all__ = ["after_decoding", "before_decoding", "checks_after", "checks_before"]


def checks_before(recipe) -> bool:
    """Whether a recipe's samples are checked before they are decoded (audio clips' headers)."""
    return is_audio(recipe)


def checks_after(recipe) -> bool:
    """Whether a recipe's samples are checked once decoded (:func:`after_decoding`)."""
    return is_detection(recipe) or is_audio(recipe)


def before_decoding(recipe, batch) -> dict[int, str]:
    """``{position in the batch: why}`` of the samples whose bytes show a fault before decoding:
    an audio clip's header (:func:`coordl.audio.formats.fault`); samples that come decoded are not
    read again."""
    if not is_audio(recipe):
        return {}
    kinds = batch.kinds()
    out = {}
    for k, (data, kind) in enumerate(zip(batch.data, kinds.tolist(), strict=True)):
        if kind != DECODED:
            why = formats.fault(data)
            if why is not None:
                out[k] = why
    return out


def after_decoding(recipe, boxes, ids: np.ndarray, shapes) -> dict[int, str]:
    """``{position in the batch: why}`` of the samples whose decoded shape is wrong: a detection
    image whose size is not its annotations' (``boxes.image_sizes``), an audio clip of no samples.

    Args:
        shapes: the pipeline's shape of each decoded sample (an image's ``(H, W, C)``, a clip's
            ``(samples,)``), as it came out of DALI.
    """
    if is_audio(recipe):
        lengths = np.array([int(np.asarray(s)[0]) for s in shapes], dtype=np.int64)
        return {int(k): "it decodes to no samples (a zero-length clip)" for k in np.flatnonzero(lengths == 0)}
    if not is_detection(recipe):
        return {}
    hw = np.array([np.asarray(s)[:2] for s in shapes], dtype=np.int64).reshape(-1, 2)
    expected = boxes.image_sizes[ids][:, ::-1]
    return {
        int(k): (
            f"the image is {hw[k, 1]}x{hw[k, 0]} pixels, its annotations say {expected[k, 1]}x{expected[k, 0]}: "
            "its boxes would not be where its pixels are"
        )
        for k in np.flatnonzero((hw != expected).any(axis=1))
    }
