"""Generate deterministic ImageFolder-style audio datasets of sine tones, one frequency per class.

:func:`make_tones` writes ``root/<class>/<class>_<j:04d>.<ext>``, class ``k``'s folder named
after its frequency (``tone_0300hz``, ``tone_0500hz``, ...: sorted, the folders are in class
order). Every file of class ``k`` holds a sine tone of :func:`tone_frequency` ``(k)`` Hz, with
a random phase, an amplitude in [0.3, 0.8] per channel (a stereo file has the same tone in both
channels, at two amplitudes), white noise of std ``noise`` and 10 ms raised-cosine fades at
both ends. So a test knows each file's ground truth: the strongest bin of its spectrum is its
class's frequency, whatever the codec; and every frequency (at most 3.3 kHz) survives
resampling to 8 kHz.

File ``j`` of class ``k`` is a pure function of ``(seed, k, j)`` and the arguments: its own
generator, ``numpy.random.default_rng([seed, k, j])``, draws the sample rate, the channel
count, the duration, the phase, the amplitudes, the noise and the Ogg serial number, in that
order. Formats take turns (file ``j`` of class ``k`` is ``formats[(k + j) % len(formats)]``),
so every class holds every format once it has ``len(formats)`` files. Opus files are written at
48 kHz (libsndfile writes Opus at 8, 12, 16, 24 and 48 kHz only), whatever rate was drawn. A
second call with the same arguments finds the files and returns at once.

How the modules fit together: this module and :mod:`.music` say what each file holds (a plan);
:mod:`.audioset` writes a plan's files once (see :func:`~.audioset.write_set`) and returns the
:class:`ToneSet`; :mod:`.audiocodec` encodes each file with soundfile; :mod:`.audioshards` packs
a set into WebDataset tar shards. Imports point one way: :mod:`.music` uses this module, both use
:mod:`.audioset`, which uses :mod:`.audiocodec`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from coordl.tools.datagen.audiocodec import OPUS_RATE, check_formats
from coordl.tools.datagen.audioset import (
    AudioRecord,
    Rendered,
    ToneSet,
    check_count,
    check_number,
    write_set,
)
from coordl.tools.datagen.audioshards import write_audio_shards

__all__ = [
    "FORMAT_VERSION",
    "FREQS",
    "AudioRecord",
    "ToneSet",
    "fade",
    "make_tones",
    "tone_frequency",
    "write_audio_shards",
]

FORMAT_VERSION = 1  # bump when what the same arguments draw changes: older sets are then regenerated
# 200 Hz apart, all below 4 kHz (the Nyquist frequency of 8 kHz audio).
FREQS = tuple(range(300, 3301, 200))
FADE_SECONDS = 0.010
_AMPLITUDE = (0.3, 0.8)
_DESCRIPTION = "sine tones by coordl.tools.datagen.tones"


def tone_frequency(k: int) -> int:
    """The frequency in Hz of class ``k``'s tone, ``FREQS[k]``.

    Raises:
        ValueError: If ``k`` is not between 0 and ``len(FREQS) - 1``.
    """
    if not 0 <= k < len(FREQS):
        raise ValueError(f"class {k!r} has no tone: classes run from 0 to {len(FREQS) - 1}")
    return FREQS[k]


def make_tones(
    root: str | os.PathLike[str],
    *,
    classes: int = 4,
    per_class: int = 24,
    rates: tuple[int, ...] = (16000, 22050, 44100),
    channels: tuple[int, ...] = (1, 2),
    seconds: tuple[float, float] = (1.0, 6.0),
    formats: tuple[str, ...] = ("wav", "flac", "ogg"),
    seed: int = 0,
    noise: float = 0.05,
) -> ToneSet:
    """Generate (or find already generated) a deterministic dataset of sine tones.

    Args:
        root: Folder of the dataset; created if missing. Files of an earlier set in it that this
            call would not write are deleted.
        classes: Number of classes, 1 to ``len(FREQS)``.
        per_class: Files per class, at least 1.
        rates: Sample rates in Hz each file draws one from (8000 to 192000; with ``"mp3"``, one of
            :data:`~.audiocodec.MP3_RATES`).
        channels: Channel counts each file draws one from (1 and/or 2).
        seconds: ``(min, max)`` range each file draws its duration from, uniformly.
        formats: File formats, taking turns: ``"wav"`` and ``"flac"`` (16-bit PCM), ``"ogg"``
            (Vorbis), ``"opus"`` (48 kHz), ``"mp3"``.
        seed: Non-negative random seed.
        noise: Standard deviation of the white noise added to each channel.

    Returns:
        The dataset's :class:`ToneSet`.

    Raises:
        TypeError: If a count, rate or seed is not an integer.
        ValueError: If an argument is out of range.
        ImportError: If soundfile is not installed.
    """
    plan = _TonePlan(
        classes=check_count("classes", classes, 1, len(FREQS)),
        per_class=check_count("per_class", per_class, 1),
        rates=tuple(check_count("a rate", r, 8000, 192000) for r in _nonempty("rates", rates, "sample rates")),
        channels=tuple(check_count("a channel count", c, 1, 2) for c in _nonempty("channels", channels, "1 and/or 2")),
        seconds=_seconds(seconds),
        formats=_nonempty("formats", formats, "format names"),
        seed=check_count("seed", seed, 0),
        noise=check_number("noise", noise, 0.0, 0.2),
    )
    check_formats(plan.formats, plan.rates)
    info = {"description": _DESCRIPTION, "version": FORMAT_VERSION, "arguments": vars(plan)}
    mean_samples = np.mean(plan.rates) * np.mean(plan.channels) * sum(plan.seconds) / 2
    return write_set(os.path.abspath(root), info, plan.class_names(), plan, int(plan.count * mean_samples))


def fade(samples: np.ndarray, rate: int, seconds: float = FADE_SECONDS) -> np.ndarray:
    """``samples`` (``(frames, channels)``) faded in and out over ``seconds`` (a raised cosine), in place."""
    ramp = min(len(samples) // 2, round(seconds * rate))
    if ramp > 0:
        gain = 0.5 - 0.5 * np.cos(np.pi * (np.arange(ramp) + 0.5) / ramp)
        samples[:ramp] *= gain[:, None]
        samples[len(samples) - ramp :] *= gain[::-1, None]
    return samples


@dataclass(frozen=True)
class _TonePlan:
    """Everything a file depends on besides its class and index (picklable, for a pool)."""

    classes: int
    per_class: int
    rates: tuple[int, ...]
    channels: tuple[int, ...]
    seconds: tuple[float, float]
    formats: tuple[str, ...]
    seed: int
    noise: float

    @property
    def count(self) -> int:
        return self.classes * self.per_class

    def class_names(self) -> tuple[str, ...]:
        return tuple(f"tone_{FREQS[k]:04d}hz" for k in range(self.classes))

    def render(self, i: int) -> Rendered:
        """File ``j = i % per_class`` of class ``k = i // per_class``."""
        k, j = divmod(i, self.per_class)
        rng = np.random.default_rng([self.seed, k, j])
        rate = int(self.rates[rng.integers(len(self.rates))])
        channels = int(self.channels[rng.integers(len(self.channels))])
        duration = rng.uniform(*self.seconds)
        fmt = self.formats[(k + j) % len(self.formats)]
        rate = OPUS_RATE if fmt == "opus" else rate
        frames = max(1, round(duration * rate))
        phase = rng.uniform(0.0, 2 * np.pi)
        amplitudes = rng.uniform(*_AMPLITUDE, size=channels)
        tone = np.sin(2 * np.pi * FREQS[k] / rate * np.arange(frames) + phase)
        samples = tone[:, None] * amplitudes + self.noise * rng.standard_normal((frames, channels))
        samples = np.clip(fade(samples, rate), -1.0, 1.0).astype(np.float32)
        name = self.class_names()[k]
        relpath = f"{name}/{name}_{j:04d}.{fmt}"
        return Rendered(relpath, k, float(FREQS[k]), rate, fmt, int(rng.integers(2**32)), samples)


def _nonempty(name: str, values: object, what: str) -> tuple:
    if isinstance(values, (str, bytes)) or not isinstance(values, (tuple, list)) or not values:
        raise ValueError(f"{name} must be a non-empty tuple of {what}, got {values!r}")
    return tuple(values)


def _seconds(value: object, name: str = "seconds", low: float = 0.001) -> tuple[float, float]:
    try:
        a, b = (check_number(name, v, low) for v in value)  # type: ignore[union-attr]
    except (TypeError, ValueError):
        a = b = -1.0
    if not low <= a <= b:
        raise ValueError(f"{name} must be a (min, max) pair with {low} <= min <= max, got {value!r}")
    return (a, b)
