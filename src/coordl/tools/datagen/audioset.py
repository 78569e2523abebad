"""Write a generated audio dataset once: render and encode each file, write it atomically, vouch in a manifest.

A generator (:mod:`.audio`'s tones, :mod:`.music`'s clips) describes its files as a *plan*: an
object with ``count`` files, each rendered by ``plan.render(i)`` into a :class:`Rendered` (its
path under the root, label, samples, rate and format), a pure function of the plan and ``i``.
:func:`write_set` encodes them (:mod:`.audiocodec`) into ``root/<class>/<class>_<j:04d>.<ext>``
files, in this process or, for :data:`POOL_MIN_SAMPLES` of audio or more on several cores, in a
``fork`` pool; the files are the same either way. The manifest, ``root/`` :data:`MANIFEST`,
holds the generator's arguments and every file's record: it is removed first and written last,
so a second call with the same arguments finds it, checks that every file is there with its
size, and returns the :class:`ToneSet` at once.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import re
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from coordl import cpus
from coordl.tools.datagen.audiocodec import FORMATS, encode, soundfile
from coordl.tools.datagen.job import TMP_NAME, write_atomic

__all__ = [
    "MANIFEST",
    "POOL_MIN_SAMPLES",
    "AudioRecord",
    "Plan",
    "Rendered",
    "ToneSet",
    "check_count",
    "check_number",
    "write_set",
]

MANIFEST = ".coordl-audio.json"
POOL_MIN_SAMPLES = 20_000_000  # less audio (frames x channels) is written in this process: ~4 min of stereo 44.1 kHz
_CHUNK = 2  # files per pool task


@dataclass(frozen=True)
class AudioRecord:
    """One audio file of a generated set.

    Attributes:
        path: Absolute path of the file.
        label: Class index (the position of its folder among the sorted class folders).
        frequency: The tone's frequency in Hz; for :func:`~.music.make_clips`, the clip's tonic.
        rate: Sample rate in Hz the file decodes to.
        channels: 1 or 2.
        frames: Samples per channel the file decodes to.
        format: One of :data:`FORMATS` (also the file's extension).
        size: The file's size in bytes.
    """

    path: str
    label: int
    frequency: float
    rate: int
    channels: int
    frames: int
    format: str
    size: int


@dataclass(frozen=True)
class ToneSet:
    """A generated audio dataset: an ImageFolder-style tree and what every file holds.

    Attributes:
        root: Absolute path of the dataset's folder.
        classes: The class folders' names; sorted, so a name's position is its label.
        records: Every file's :class:`AudioRecord`, sorted by path (so by class, then index).
        total_bytes: Sum of the files' sizes.
    """

    root: str
    classes: tuple[str, ...]
    records: tuple[AudioRecord, ...]
    total_bytes: int
    _by_path: dict[str, AudioRecord] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_by_path", {r.path: r for r in self.records})

    def __len__(self) -> int:
        return len(self.records)

    def truth(self, path: str | os.PathLike[str]) -> AudioRecord:
        """The record of the file at ``path`` (absolute, or relative to the working directory).

        Raises:
            KeyError: If ``path`` is not a file of this set.
        """
        try:
            return self._by_path[os.path.abspath(path)]
        except KeyError:
            raise KeyError(f"{path} is not a file of the audio set at {self.root}") from None


@dataclass(frozen=True)
class Rendered:
    """One file's content, before encoding: ``samples`` is float32 ``(frames, channels)`` in [-1, 1]."""

    relpath: str
    label: int
    frequency: float
    rate: int
    format: str
    serial: int  # the Ogg stream's serial number (ignored by other formats)
    samples: np.ndarray


class Plan(Protocol):
    """What :func:`write_set` needs of a generator (a picklable object)."""

    count: int  # the number of files

    def render(self, i: int) -> Rendered:
        """File ``i``'s content, a pure function of the plan and ``i``."""


def check_count(name: str, value: object, low: int, high: int | None = None) -> int:
    """``value`` as an ``int`` if it is an integer from ``low`` to ``high`` (``None``: no upper bound).

    Raises:
        TypeError: If ``value`` is not an integer (``bool`` is not).
        ValueError: If it is out of range.
    """
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    if value < low or (high is not None and value > high):
        bounds = f"between {low} and {high}" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be {bounds}, got {value}")
    return int(value)


def check_number(name: str, value: object, low: float, high: float | None = None) -> float:
    """``value`` as a ``float`` if it is a real number from ``low`` to ``high`` (``None``: no upper bound).

    Raises:
        ValueError: If it is not a number (``bool`` is not), or out of range.
    """
    ok = isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)
    if not ok or not (low <= value and (high is None or value <= high)):  # (NaN fails both)
        bounds = f"between {low} and {high}" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be a number {bounds}, got {value!r}")
    return float(value)


def write_set(root: str, info: dict[str, Any], classes: tuple[str, ...], plan: Plan, samples_hint: int) -> ToneSet:
    """Write ``plan``'s files under ``root`` unless the manifest there already vouches for them.

    Args:
        root: Absolute path of the dataset's folder; created if missing.
        info: The generator's name, format version and arguments (JSON-able): the manifest's key.
        classes: The class folders' names, sorted.
        plan: The files.
        samples_hint: About how many samples (frames x channels) all files hold: whether to use a pool.

    Returns:
        The dataset's :class:`ToneSet`.
    """
    info = json.loads(json.dumps(info))  # tuples as lists: as it reads back
    manifest = os.path.join(root, MANIFEST)
    found = _reusable(root, manifest, info)
    if found is not None:
        return found
    soundfile()  # before touching the folder
    for name in classes:
        os.makedirs(os.path.join(root, name), exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        os.remove(manifest)  # until the new one is written, the files are vouched for by nobody
    rows = _write_all(root, plan, samples_hint)
    _remove_stale(root, classes, {row[0] for row in rows})
    write_atomic(manifest, json.dumps({"info": info, "classes": list(classes), "files": sorted(rows)}).encode())
    return _tone_set(root, classes, sorted(rows))


_Row = tuple[str, int, float, int, int, int, str, int]  # an AudioRecord with its path relative to the root


def _write_one(root: str, plan: Plan, i: int) -> _Row:
    r = plan.render(i)
    data = encode(r.samples, r.rate, r.format, r.serial)
    write_atomic(os.path.join(root, r.relpath), data)
    frames, channels = r.samples.shape
    return (r.relpath, r.label, r.frequency, r.rate, channels, frames, r.format, len(data))


def _write_all(root: str, plan: Plan, samples_hint: int) -> list[_Row]:
    workers = min(cpus.available(), plan.count)
    # (daemonic processes, e.g. pool workers, may not start a pool of their own)
    if workers < 2 or samples_hint < POOL_MIN_SAMPLES or multiprocessing.current_process().daemon:
        return [_write_one(root, plan, i) for i in range(plan.count)]
    tasks = [(root, plan, range(k, min(k + _CHUNK, plan.count))) for k in range(0, plan.count, _CHUNK)]
    context = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else None)
    with context.Pool(workers) as pool:
        rows = [row for chunk in pool.imap_unordered(_write_chunk, tasks) for row in chunk]
        pool.close()
        pool.join()
    return rows


def _write_chunk(task: tuple[str, Plan, range]) -> list[_Row]:
    root, plan, indices = task
    return [_write_one(root, plan, i) for i in indices]


_FILE_NAME = re.compile(r"^(.+)_\d{4,}\.(" + "|".join(FORMATS) + r")$")


def _remove_stale(root: str, classes: tuple[str, ...], keep: set[str]) -> None:
    """Delete files an earlier run with other arguments wrote beside ``keep``, and class folders left empty."""
    for entry in os.scandir(root):
        if not entry.is_dir(follow_symlinks=False):
            continue
        removed = False
        for file in os.scandir(entry.path):
            ours = _FILE_NAME.match(file.name) or TMP_NAME.match(file.name)
            if ours and file.name.startswith(entry.name + "_") and f"{entry.name}/{file.name}" not in keep:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(file.path)
                removed = True
        if removed and entry.name not in classes:
            with contextlib.suppress(OSError):  # (not empty: it holds something else)
                os.rmdir(entry.path)


def _reusable(root: str, manifest: str, info: dict[str, Any]) -> ToneSet | None:
    """The set the manifest describes if it was written with ``info`` and its files are all there."""
    try:
        with open(manifest, "rb") as f:
            doc = json.load(f)
        if doc["info"] != info:
            return None
        rows = [tuple(row) for row in doc["files"]]
        if not all(os.path.getsize(os.path.join(root, row[0])) == row[7] for row in rows):
            return None
        return _tone_set(root, tuple(doc["classes"]), rows)
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return None


def _tone_set(root: str, classes: tuple[str, ...], rows: list) -> ToneSet:
    records = tuple(AudioRecord(os.path.join(root, row[0]), *row[1:]) for row in rows)
    return ToneSet(root, classes, records, sum(r.size for r in records))
