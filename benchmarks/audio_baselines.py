"""The three audio loaders :mod:`benchmarks.audio` compares, each decoding a clip, downmixing it to mono,
resampling it to ``RATE`` and cutting a random window of ``SAMPLES`` (zeros after a short clip), with
the same batch size and CPU threads, and yielding ``(waveforms, labels)``: float32 ``(B, 1, SAMPLES)``
and int64 ``(B,)``; and :class:`M5`, the model the HP trials train.

``coordl``
    ``coordl.CoordLoader`` with ``coordl.AudioTrain(sample_rate=RATE, samples=SAMPLES)``, its node's
    cache holding the dataset (encoded bytes: the decoded tier off).
``dali``
    DALI's own pipeline: ``fn.readers.file(random_shuffle=True)``, ``fn.decoders.audio(sample_rate=RATE,
    downmix=True)`` (libsndfile, windowed-sinc resampling at DALI's default quality, 50), a window
    whose start is drawn by ``fn.random.uniform``, cut by ``fn.slice(out_of_bounds_policy="pad")``,
    ``fn.reshape`` to ``(1, SAMPLES)``; ``DALIGenericIterator``.
``torch``
    ``torch.utils.data.DataLoader`` over :class:`SoundfileClips`: ``soundfile.read``, the mean of the
    channels, ``scipy.signal.resample_poly`` (44.1 kHz to 8 kHz: up 80, down 441; polyphase FIR, a
    Kaiser window), the same random window; persistent workers.
"""

from __future__ import annotations

import math
import os

import numpy as np

RATE = 8000
SAMPLES = 32000
EXTENSIONS = (".wav", ".flac", ".ogg", ".oga", ".opus")


def clips(root: str) -> tuple[list[str], list[int]]:
    """The audio files of an ImageFolder-style tree and their labels (the sorted class folders' positions)."""
    classes = sorted(d.name for d in os.scandir(root) if d.is_dir())
    paths, labels = [], []
    for label, name in enumerate(classes):
        for f in sorted(os.listdir(os.path.join(root, name))):
            if f.lower().endswith(EXTENSIONS):
                paths.append(os.path.join(root, name, f))
                labels.append(label)
    return paths, labels


class SoundfileClips:
    """A map-style ``Dataset`` of clips as a torchaudio-style M5 script writes it, with soundfile and
    scipy: ``dataset[i]`` is ``(waveform (1, samples) float32, label)``."""

    def __init__(self, root: str, rate: int = RATE, samples: int = SAMPLES, seed: int = 0):
        self.paths, self.labels = clips(root)
        self.rate, self.samples, self.seed = rate, samples, seed
        self._rng, self._pid = None, None

    def __len__(self) -> int:
        return len(self.paths)

    def rng(self) -> np.random.Generator:
        if self._pid != os.getpid():  # a forked worker draws its own stream, not its parent's copy
            self._rng, self._pid = np.random.default_rng([self.seed, os.getpid()]), os.getpid()
        return self._rng

    def __getitem__(self, i: int):
        import soundfile
        import torch
        from scipy.signal import resample_poly

        data, rate = soundfile.read(self.paths[i], dtype="float32", always_2d=True)
        mono = data.mean(axis=1)
        if rate != self.rate:
            g = math.gcd(rate, self.rate)
            mono = resample_poly(mono, self.rate // g, rate // g)  # 44100 -> 8000: up 80, down 441
        start = int(self.rng().integers(max(len(mono) - self.samples, 0) + 1))
        window = np.zeros(self.samples, dtype=np.float32)
        piece = mono[start : start + self.samples]
        window[: len(piece)] = piece
        return torch.from_numpy(window).reshape(1, self.samples), self.labels[i]


def torch_loader(root: str, batch_size: int, workers: int, seed: int = 0):
    """``DataLoader(SoundfileClips(root))``, shuffled, persistent workers."""
    from benchmarks.loaders import dataloader

    return dataloader(SoundfileClips(root, seed=seed), batch_size, workers, seed)


class DaliAudio:
    """DALI's own audio pipeline on the CPU (``device_id=None``); iterate for one epoch of
    ``(waveforms, labels)``."""

    def __init__(self, root: str, batch_size: int, threads: int, seed: int = 1):
        from nvidia.dali import fn, pipeline_def, types
        from nvidia.dali import math as dmath

        from benchmarks.loaders import dali_iterator

        @pipeline_def(batch_size=batch_size, num_threads=threads, device_id=None, seed=seed, prefetch_queue_depth=2)
        def pipe():
            encoded, labels = fn.readers.file(file_root=root, random_shuffle=True, name="Reader")
            audio, _ = fn.decoders.audio(encoded, sample_rate=float(RATE), downmix=True, dtype=types.FLOAT)
            length = fn.cast(audio.shape(), dtype=types.FLOAT)[0]
            room = dmath.max(length - float(SAMPLES), 0.0)  # the starts there are, less one
            start = dmath.floor(fn.random.uniform(range=[0.0, 1.0]) * (room + 1.0))
            window = fn.slice(
                audio,
                start=fn.cast(fn.reshape(start, shape=[1]), dtype=types.INT32),
                shape=[SAMPLES],
                axes=[0],
                out_of_bounds_policy="pad",
                fill_values=0.0,
            )
            return fn.reshape(window, shape=[1, SAMPLES]), fn.cast(labels, dtype=types.INT64)

        self.it = dali_iterator(pipe(), ["waveforms", "labels"])

    def __iter__(self):
        for (out,) in self.it:
            yield out["waveforms"], out["labels"].flatten()


def coordl_loader(root: str, batch_size: int, threads: int, group: str | None = None, seed: int = 0):
    """``CoordLoader(AudioTrain(sample_rate=RATE, samples=SAMPLES))`` over the folder ``root``, its cache
    the whole dataset (filled by the first epoch), in the HP group ``group`` when given."""
    import coordl

    recipe = coordl.AudioTrain(sample_rate=RATE, samples=SAMPLES)
    kw = {"pipeline": recipe, "device_id": None, "cache": coordl.Cache(size=1.0), "prep": coordl.Prep(threads=threads)}
    kw |= {"seed": seed, **({"hp_group": group} if group else {})}
    return coordl.CoordLoader(root, batch_size=batch_size, shuffle=True, **kw)


def m5(classes: int):
    """M5 (Dai et al., 2017, as torchaudio's tutorial builds it): a strided Conv1d(1, 32, 80, stride 4), then
    three Conv1d(k=3) of 32, 64 and 64 channels, each with BatchNorm, ReLU and MaxPool(4); global
    average pooling and a Linear layer to ``classes``."""
    from torch import nn

    layers, channels = [], 1
    for out, kernel, stride in ((32, 80, 4), (32, 3, 1), (64, 3, 1), (64, 3, 1)):
        layers += [nn.Conv1d(channels, out, kernel, stride=stride), nn.BatchNorm1d(out), nn.ReLU(), nn.MaxPool1d(4)]
        channels = out
    return nn.Sequential(*layers, nn.AdaptiveAvgPool1d(1), nn.Flatten(), nn.Linear(channels, classes))


class M5Step:
    """One training step of :func:`m5` per batch: forward, cross-entropy, backward, Adam."""

    def __init__(self, classes: int, seed: int = 0):
        import torch

        torch.manual_seed(seed)
        self.model = m5(classes)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=0.01, weight_decay=1e-4)
        self.loss = torch.nn.CrossEntropyLoss()

    def __call__(self, waveforms, labels) -> float:
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.loss(self.model(waveforms), labels)
        loss.backward()
        self.optimizer.step()
        return float(loss.detach())
