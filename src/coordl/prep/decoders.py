"""How a recipe's samples are decoded: the decoder's settings, and what its decoded items are.

A recipe names its decoder (:attr:`coordl.prep.protocol.Recipe.decoder`); the decoder answers what
the pipeline, the checks and the decoded tier ask of decoding: the DALI ops of a full decode, the
probe that finds an undecodable sample, the decoded tier's item (dtype, layout, the empty one),
what names those items (:meth:`form`), and the faults that show in the bytes or the decoded shape.
Settings, not the index, decide the decoder's arguments: EXIF orientation is the recipe's choice
(a detection recipe keeps the stored pixels' frame, which its boxes are in).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from coordl.prep import checks

__all__ = ["AudioDecoder", "ImageDecoder"]

_EMPTY_IMAGE = np.zeros((0, 0, 3), dtype=np.uint8)  # the decoded image of a sample that comes encoded
_EMPTY_IMAGE.flags.writeable = False
_EMPTY_WAVEFORM = np.zeros(0, dtype=np.float32)  # the same for an audio clip
_EMPTY_WAVEFORM.flags.writeable = False


@dataclass(frozen=True)
class ImageDecoder:
    """Images decoded to RGB ``uint8`` HWC at the file's resolution.

    Attributes:
        adjust_orientation: apply the EXIF orientation (DALI's argument of that name); False keeps
            the pixels as stored (the frame of a detection index's boxes, as Pillow reads them).
        max_short_side: images whose shorter side is longer are resized (aspect kept) to it.
    """

    adjust_orientation: bool = True
    max_short_side: int | None = None

    media = "image"  # the files it reads (an index scans for them)
    dtype, layout = "uint8", "HWC"  # a decoded item (the decoded tier's)
    empty = _EMPTY_IMAGE
    checks_before = False
    checks_after = False

    def decode(self, data, ctx):
        """The full decode (DALI ops), capped at :attr:`max_short_side`."""
        from coordl.prep import graph  # DALI's ops: imported when a pipeline is built

        return graph.decode_image(data, ctx, self.max_short_side)

    def probe(self, data, ctx):
        """The decode that tells whether one sample decodes (no cap, no orientation)."""
        from coordl.prep import graph

        return graph.probe_image(data, ctx)

    def form(self) -> dict:
        return {"max_short_side": self.max_short_side}

    def before_decoding(self, batch) -> dict[int, str]:
        return {}

    def after_decoding(self, shapes) -> dict[int, str]:
        return {}


@dataclass(frozen=True)
class AudioDecoder:
    """Audio clips decoded, downmixed to mono and resampled to ``sample_rate`` (DALI's
    windowed-sinc resampler at ``quality``): float32 ``(samples,)``. A clip's header is checked
    before decoding, its length after (:mod:`coordl.prep.checks`)."""

    sample_rate: int
    quality: float

    media = "audio"
    adjust_orientation = True  # no pixels to turn: PrepContext's default
    dtype, layout = "float32", None
    empty = _EMPTY_WAVEFORM
    checks_before = True
    checks_after = True

    def decode(self, data, ctx):
        from coordl.prep import graph

        return graph.decode_audio(data, self.sample_rate, self.quality)

    def probe(self, data, ctx):
        return self.decode(data, ctx)

    def form(self) -> dict:
        return {"waveform": f"{self.sample_rate}Hz:q{float(self.quality):g}"}

    def before_decoding(self, batch) -> dict[int, str]:
        return checks.clip_headers(batch)

    def after_decoding(self, shapes) -> dict[int, str]:
        return checks.empty_clips(shapes)
