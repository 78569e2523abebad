"""Generate deterministic music-like audio datasets shaped like FMA's: 30 s stereo clips, a "genre" per class.

:func:`make_clips` writes ``root/genre_<k:02d>/genre_<k:02d>_<j:04d>.<ext>``, clip ``i`` in
class ``k = i % classes`` as its ``j = i // classes``-th file. A clip is synthetic music, so
that its compressed size and decoding cost resemble a real song's: a melody, a harmony and a
bass line of notes drawn from its class's :class:`Style` (scale, tonic, tempo, timbre: harmonic
partials whose upper ones die out first), drums in two of every three classes (a kick, a
snare and hi-hats of filtered noise) and a faint noise floor. At 44.1 kHz stereo, a 30 s clip
is ~460 KB as Ogg Vorbis and ~600 KB as MP3 (libsndfile's defaults), a real 30 s clip's size.

Clip ``i`` is a pure function of ``(seed, i)`` and the arguments: its own generator,
``numpy.random.default_rng([seed, i])``, draws a transposition and a tempo, then the voices'
notes, the drums and the noise; more clips extend a set without changing the first ones.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from coordl.tools.datagen.audiocodec import OPUS_RATE, check_formats
from coordl.tools.datagen.audioset import (
    Rendered,
    ToneSet,
    check_count,
    check_number,
    write_set,
)
from coordl.tools.datagen.tones import fade

__all__ = ["FORMAT_VERSION", "SCALES", "Style", "make_clips", "style"]

FORMAT_VERSION = 1  # bump when what the same arguments draw changes: older sets are then regenerated
# Semitones above the tonic: major, natural minor, major pentatonic, blues, dorian, harmonic minor,
# whole tone, octatonic.
SCALES = (
    (0, 2, 4, 5, 7, 9, 11),
    (0, 2, 3, 5, 7, 8, 10),
    (0, 2, 4, 7, 9),
    (0, 3, 5, 6, 7, 10),
    (0, 2, 3, 5, 7, 9, 10),
    (0, 2, 3, 5, 7, 8, 11),
    (0, 2, 4, 6, 8, 10),
    (0, 1, 3, 4, 6, 7, 9, 10),
)
_TABLE = 2048  # samples in one period of a voice's wavetable (a power of two: phase & mask)
_FRACTION = 16  # fixed-point bits of the phase accumulator
_DESCRIPTION = "music-like clips by coordl.tools.datagen.music"


@dataclass(frozen=True)
class Style:
    """What every clip of a class shares.

    Attributes:
        scale: Semitones above the tonic the notes are drawn from.
        tonic: MIDI note of the tonic (45 is A2, 110 Hz).
        notes_per_second: The melody's pace; the drums play a beat every two notes.
        partials: Harmonics in a note.
        rolloff: The k-th harmonic's amplitude is ``k ** -rolloff``.
        decay: Rate of a note's exponential decay, per second (its upper harmonics, 4x as fast).
        drums: Whether the clips have drums.
    """

    scale: tuple[int, ...]
    tonic: int
    notes_per_second: float
    partials: int
    rolloff: float
    decay: float
    drums: bool


def style(k: int) -> Style:
    """Class ``k``'s :class:`Style`: the scales take turns, the rest varies on other cycles."""
    return Style(
        scale=SCALES[k % len(SCALES)],
        tonic=45 + (7 * k) % 12,  # round the circle of fifths
        notes_per_second=2.0 + 0.75 * ((3 * k) % 8),
        partials=3 + (5 * k) % 8,
        rolloff=0.8 + 0.3 * (k % 4),
        decay=1.5 + k % 5,
        drums=k % 3 != 2,
    )


def make_clips(
    root: str | os.PathLike[str],
    num_clips: int,
    *,
    classes: int = 8,
    seconds: float = 30.0,
    rate: int = 44100,
    channels: int = 2,
    format: str = "ogg",
    seed: int = 0,
) -> ToneSet:
    """Generate (or find already generated) a deterministic set of music-like clips.

    Files are written in a pool of processes when there are many (see :mod:`.audioset`).

    Args:
        root: Folder of the dataset; created if missing. Files of an earlier set in it that this
            call would not write are deleted.
        num_clips: Number of clips, at least 1, spread round-robin over the classes.
        classes: Number of classes, 1 to 100.
        seconds: Every clip's duration.
        rate: Sample rate in Hz, 8000 to 192000 (Opus files are written at 48 kHz whatever it is).
        channels: 1 or 2.
        format: ``"ogg"`` (Vorbis), ``"mp3"``, ``"opus"``, ``"flac"`` or ``"wav"``.
        seed: Non-negative random seed.

    Returns:
        The dataset's :class:`~.audioset.ToneSet`; a record's ``frequency`` is its clip's tonic.

    Raises:
        TypeError: If a count, rate or seed is not an integer.
        ValueError: If an argument is out of range.
        ImportError: If soundfile is not installed.
    """
    rate = check_count("rate", rate, 8000, 192000)
    check_formats((format,), (rate,))
    plan = _ClipPlan(
        count=check_count("num_clips", num_clips, 1),
        classes=check_count("classes", classes, 1, 100),
        seconds=check_number("seconds", seconds, 0.001),
        rate=OPUS_RATE if format == "opus" else rate,
        channels=check_count("channels", channels, 1, 2),
        format=format,
        seed=check_count("seed", seed, 0),
    )
    info = {"description": _DESCRIPTION, "version": FORMAT_VERSION, "arguments": vars(plan)}
    names = tuple(f"genre_{k:02d}" for k in range(plan.classes))
    return write_set(os.path.abspath(root), info, names, plan, plan.count * plan.frames * plan.channels)


@dataclass(frozen=True)
class _ClipPlan:
    """Everything a clip depends on besides its index (picklable, for a pool)."""

    count: int
    classes: int
    seconds: float
    rate: int
    channels: int
    format: str
    seed: int

    @property
    def frames(self) -> int:
        return max(1, round(self.seconds * self.rate))

    def render(self, i: int) -> Rendered:
        k, j = i % self.classes, i // self.classes
        rng = np.random.default_rng([self.seed, i])
        s = style(k)
        tonic = s.tonic + int(rng.integers(-2, 3))
        pace = s.notes_per_second * rng.uniform(0.9, 1.1)
        out = np.zeros((self.channels, self.frames), dtype=np.float32)
        for octave, step, partials, decay, level in (
            (1, 1.0, s.partials, s.decay, 0.5),  # melody
            (0, 2.0, s.partials, s.decay * 0.75, 0.3),  # harmony
            (-1, 4.0, 3, 1.0, 0.6),  # bass
        ):
            _voice(out, rng, self.rate, pace / step, tonic + 12 * octave, s.scale, partials, s.rolloff, decay, level)
        if s.drums:
            _drums(out, rng, self.rate, pace / 2)
        out += 0.003 * rng.standard_normal(out.shape, dtype=np.float32)
        out *= rng.uniform(0.55, 0.9) / max(float(np.abs(out).max()), 1e-6)
        samples = fade(np.ascontiguousarray(out.T), self.rate)
        relpath = f"genre_{k:02d}/genre_{k:02d}_{j:04d}.{self.format}"
        frequency = 440.0 * 2.0 ** ((tonic - 69) / 12)
        return Rendered(relpath, k, frequency, self.rate, self.format, int(rng.integers(2**32)), samples)


def _voice(
    out: np.ndarray,
    rng: np.random.Generator,
    rate: int,
    pace: float,
    tonic: int,
    scale: tuple[int, ...],
    partials: int,
    rolloff: float,
    decay: float,
    level: float,
) -> None:
    """Add to ``out`` a line of ``pace`` notes a second, a random walk on ``scale`` (some notes rests)."""
    frames = out.shape[1]
    onsets = np.arange(0.0, frames / rate, 1.0 / pace)
    onsets = np.maximum(0.0, onsets + rng.normal(0.0, 0.01 / pace, onsets.size))  # a human's timing
    degrees = np.clip(np.cumsum(rng.integers(-2, 3, onsets.size)), -len(scale), 2 * len(scale))
    midi = tonic + 12 * (degrees // len(scale)) + np.asarray(scale)[degrees % len(scale)]
    freqs = 440.0 * 2.0 ** ((midi - 69) / 12)
    played = rng.random(onsets.size) >= 0.15
    pans = rng.uniform(0.15, 0.85, onsets.size) * (np.pi / 2)
    levels = level * rng.uniform(0.6, 1.0, onsets.size)
    # Upper harmonics stop below the Nyquist frequency of the highest note: no aliasing.
    partials = max(1, min(partials, int(rate / 2 / freqs.max())))
    bright, dull = _wavetables(partials, rolloff)
    length = min(frames, round(rate * min(2.0, 4.0 / decay)))
    t = np.arange(length, dtype=np.float32) / rate
    attack = np.minimum(1.0, t / 0.005) * np.minimum(1.0, (length - 1 - np.arange(length)) / (0.01 * rate))
    body = (np.exp(-decay * t) * attack).astype(np.float32)
    edge = (np.exp(-4 * decay * t) * attack).astype(np.float32)
    steps = np.arange(length, dtype=np.int64)
    for onset, f, play, pan, a in zip(onsets, freqs, played, pans, levels):
        start = int(onset * rate)
        n = min(length, frames - start)
        if not play or n <= 0:
            continue
        phase = (steps[:n] * round(f / rate * _TABLE * 2**_FRACTION) >> _FRACTION) & (_TABLE - 1)
        note = a * (edge[:n] * bright[phase] + body[:n] * dull[phase])
        _mix(out, start, note, pan)


def _drums(out: np.ndarray, rng: np.random.Generator, rate: int, beats: float) -> None:
    """Add to ``out`` a kick on every beat, a snare on every other beat and a hi-hat every half beat."""
    t = np.arange(round(0.2 * rate)) / rate
    kick = (np.sin(2 * np.pi * (50 * t + 3.0 * (1 - np.exp(-t / 0.03)))) * np.exp(-t / 0.07)).astype(np.float32)
    noise = rng.standard_normal((4, len(t)), dtype=np.float32)
    snare = 0.6 * noise[0] * np.exp(-t / 0.05).astype(np.float32) + 0.3 * kick
    hats = np.diff(noise[1:], axis=1, prepend=0) * np.exp(-t / 0.012).astype(np.float32)  # high-passed
    beat = rate / beats
    for b in range(int(out.shape[1] / beat) + 1):
        start = int(b * beat)
        _mix(out, start, 0.8 * kick, np.pi / 4)
        if b % 2:
            _mix(out, start, 0.5 * snare, rng.uniform(0.35, 0.45) * np.pi)
        for half in (0, 1):
            hat = hats[rng.integers(len(hats))] * rng.uniform(0.08, 0.16)
            _mix(out, start + int(half * beat / 2), hat, rng.uniform(0.2, 0.3) * np.pi)


def _mix(out: np.ndarray, start: int, sound: np.ndarray, pan: float) -> None:
    """Add ``sound`` to ``out`` (``(channels, frames)``) at frame ``start``, panned by ``pan`` (0 left, pi/2 right)."""
    n = min(len(sound), out.shape[1] - start)
    if n <= 0:
        return
    if out.shape[0] == 1:
        out[0, start : start + n] += 0.7 * sound[:n]
    else:
        out[0, start : start + n] += np.cos(pan) * sound[:n]
        out[1, start : start + n] += np.sin(pan) * sound[:n]


def _wavetables(partials: int, rolloff: float) -> tuple[np.ndarray, np.ndarray]:
    """One period of a bright and of a dull sum of ``partials`` harmonics, each peaking at 1."""
    harmonics = np.arange(1, partials + 1)
    waves = np.sin(np.outer(np.arange(_TABLE) * (2 * np.pi / _TABLE), harmonics))
    bright = waves @ harmonics ** (-rolloff)
    dull = waves @ harmonics ** (-rolloff - 2.0)
    return (bright / np.abs(bright).max()).astype(np.float32), (dull / np.abs(dull).max()).astype(np.float32)
