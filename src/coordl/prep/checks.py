"""What is wrong with a sample that DALI would decode without an error: an audio clip cut short or
empty, a detection image of another size than its annotations (its boxes would not be where its
pixels are). Pure functions of a batch and what the pipeline said of it; the recipe's decoder or
the recipe asks them (:meth:`~coordl.prep.protocol.Recipe.before_decoding`,
:meth:`~coordl.prep.protocol.Recipe.after_decoding`), and the caller
(:class:`~coordl.prep.dali.DaliPrep`) raises a :class:`~coordl.errors.SampleError` or, with
``on_error="skip"``, leaves the samples out.
"""

from __future__ import annotations

import numpy as np

from coordl.audio import formats
from coordl.fetch.ahead import DECODED

__all__ = ["clip_headers", "empty_clips", "image_sizes"]


def clip_headers(batch) -> dict[int, str]:
    """``{position in the batch: why}`` of the audio clips whose header shows a fault
    (:func:`coordl.audio.formats.fault`); samples that come decoded are not read again."""
    kinds = batch.kinds()
    out = {}
    for k, (data, kind) in enumerate(zip(batch.data, kinds.tolist(), strict=True)):
        if kind != DECODED:
            why = formats.fault(data)
            if why is not None:
                out[k] = why
    return out


def empty_clips(shapes) -> dict[int, str]:
    """The clips of no samples, from each decoded clip's shape ``(samples,)`` as DALI gave it."""
    lengths = np.array([int(np.asarray(s)[0]) for s in shapes], dtype=np.int64)
    return {int(k): "it decodes to no samples (a zero-length clip)" for k in np.flatnonzero(lengths == 0)}


def image_sizes(boxes, ids: np.ndarray, shapes) -> dict[int, str]:
    """The detection images whose decoded ``(H, W, C)`` is not their annotations' size
    (``boxes.image_sizes``)."""
    hw = np.array([np.asarray(s)[:2] for s in shapes], dtype=np.int64).reshape(-1, 2)
    expected = boxes.image_sizes[ids][:, ::-1]
    return {
        int(k): (
            f"the image is {hw[k, 1]}x{hw[k, 0]} pixels, its annotations say {expected[k, 1]}x{expected[k, 0]}: "
            "its boxes would not be where its pixels are"
        )
        for k in np.flatnonzero((hw != expected).any(axis=1))
    }
