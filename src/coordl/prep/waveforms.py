"""The audio recipes: :class:`AudioTrain` (a random window, an optional gain) and :class:`AudioVal`
(the centre window) of clips decoded, downmixed and resampled (:class:`~coordl.prep.decoders.AudioDecoder`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from coordl.prep.decoders import AudioDecoder
from coordl.prep.fields import check_range
from coordl.prep.protocol import PrepContext, Recipe

__all__ = ["AudioTrain", "AudioVal"]


def _check_audio(sample_rate, samples, quality) -> None:
    if isinstance(sample_rate, bool) or not isinstance(sample_rate, int) or sample_rate < 1:
        raise ValueError(f"sample_rate must be a positive int (Hz), got {sample_rate!r}")
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
        raise ValueError(f"samples must be a positive int (the window's length), got {samples!r}")
    if isinstance(quality, bool) or not isinstance(quality, (int, float)) or not 0 <= quality <= 100:
        raise ValueError(f"quality must be a number in [0, 100] (DALI's resampling quality), got {quality!r}")


class _Window(Recipe):
    """What both audio recipes answer alike: their decoder, their output, the decoded clip's
    length checked."""

    drawn = False  # whether the window's start is drawn (else the centre)

    @property
    def decoder(self) -> AudioDecoder:
        return AudioDecoder(self.sample_rate, self.quality)

    def encoded_checked(self, data, ctx: PrepContext):
        waveform = self.decoder.decode(data, ctx)
        return self.augment(waveform, ctx), waveform.shape()

    def augment(self, images, ctx: PrepContext):
        from coordl.prep import graph  # DALI's ops: imported when a pipeline is built

        return graph.audio_window(images, self.samples, ctx, drawn=self.drawn, gain=getattr(self, "gain", None))

    def output(self):
        return (1, self.samples), "float32"


@dataclass(frozen=True)
class AudioTrain(_Window):
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

    drawn = True

    def __post_init__(self):
        _check_audio(self.sample_rate, self.samples, self.quality)
        if self.gain is not None:
            check_range("gain", self.gain)


@dataclass(frozen=True)
class AudioVal(_Window):
    """An audio classifier's evaluation recipe: :class:`AudioTrain`'s decoding, the centre window
    of ``samples`` (zero-padded at the end when the clip is shorter), no randomness."""

    sample_rate: int = 8000
    samples: int = 32000
    quality: float = 50.0
    name: str = field(default="audio-val", init=False)

    def __post_init__(self):
        _check_audio(self.sample_rate, self.samples, self.quality)
