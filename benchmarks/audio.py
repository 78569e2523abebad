"""Audio on the CPU: coordl's AudioTrain against DALI's audio pipeline and a DataLoader; HP groups of M5 trials.

As :mod:`benchmarks.harness.compare` runs it, each loader decoding a clip, downmixing, resampling it to 8 kHz and
cutting a random 4 s window: float32 ``(B, 1, 32000)``, int64 labels. ``prep``: ``coordl`` (``AudioTrain``),
``dali`` (:class:`DaliAudio`), ``torch`` (:class:`SoundfileClips`: soundfile, ``resample_poly``); ``hp``: two
coordl trials training M5 in an HP group vs apart; ``hp-prep``: without the model. FMA-like clips
(``datagen.music.make_clips``: 30 s, 44.1 kHz stereo, Ogg Vorbis; ``--smoke``: 40 tones); docs/audio.md.

    python -m benchmarks audio                     # 300 clips, 3 reps: about 24 minutes on 2 cores
    python -m benchmarks audio --smoke --data /tmp/audio-smoke --out /tmp/audio.json
"""

import importlib
import math
import runpy
import statistics

import numpy as np

import coordl
from benchmarks.harness import compare
from benchmarks.harness.dataset import ROOT
from benchmarks.loaders import dali_iterator, dataloader

RATE, SAMPLES = 8000, 32000
M5 = ROOT / "examples" / "audio" / "model.py"  # the model the audio example trains
DATA, SMOKE_DATA = "/var/tmp/coordl-bench/fma", "/var/tmp/coordl-bench/audio-smoke"


def options(p) -> None:
    data = f"dataset root (default: {DATA}; with --smoke, {SMOKE_DATA})"
    g = compare.add_options(p, LOADERS, tuple(LOADERS), "prep,hp,hp-prep", data)
    g.add_argument("--clips", type=int, default=300, help="clips to generate (default: %(default)s)")
    g.add_argument("--classes", type=int, default=8, help="genre folders (default: %(default)s)")
    g.add_argument("--seconds", type=float, default=30.0, help="each clip's duration (default: %(default)s)")
    g.add_argument("--format", default="ogg", help="ogg (Vorbis), opus, flac or wav (default: %(default)s)")


def run(args) -> dict | None:
    args.data = args.data or (SMOKE_DATA if args.smoke else DATA)
    if args.job:  # a trial's model step on one thread, and nothing of the loaders' own
        importlib.import_module("torch").set_num_threads(1)
    steps = {"m5": lambda data: M5Step(data["classes"]), "touch": lambda data: compare.touch}
    result = compare.run(args, clips, LOADERS, steps, {"hp": "m5", "hp-prep": "touch"}, "bench-audio", hp_epochs=2)
    return result and {**result, "recipe": {"sample_rate": RATE, "samples": SAMPLES}}


table = compare.table


def clips(args) -> dict:
    """Generates (or finds) the dataset (with ``--smoke``, 40 tones of 1-6 s); returns its figures."""
    from coordl.tools.datagen import music, tones

    if args.smoke:
        s = tones.make_tones(args.data, classes=4, per_class=10, seed=args.dataset_seed)
        kind = "tones by coordl.tools.datagen.tones.make_tones: 16/22.05/44.1 kHz, mono/stereo, WAV/FLAC/Ogg Vorbis"
    else:
        kw = {"classes": args.classes, "seconds": args.seconds, "format": args.format, "seed": args.dataset_seed}
        s = music.make_clips(args.data, args.clips, **kw)
        kind = f"music-like clips by coordl.tools.datagen.music.make_clips: 44.1 kHz stereo, {args.format}"
    rs, total = s.records, s.total_bytes
    out = {"root": s.root, "files": len(rs), "classes": len(s.classes), "total_bytes": total, "source": kind}
    return out | {"mean_bytes": round(total / len(rs)), "mean_seconds": statistics.mean(r.frames / r.rate for r in rs)}


class SoundfileClips(compare.ForkedRng):
    """A map-style ``Dataset`` of an ImageFolder-style tree of clips as a torchaudio-style M5 script reads
    them, with soundfile and scipy: ``dataset[i]`` is ``(waveform (1, SAMPLES) float32, label)``."""

    def __init__(self, root: str):
        from coordl.audio.formats import AUDIO_EXTENSIONS

        index = coordl.Index.scan(root, extensions=AUDIO_EXTENSIONS, index_dir="")  # ImageFolder's order
        self.clips = list(zip(index.paths, index.labels.tolist()))

    def __len__(self) -> int:
        return len(self.clips)

    def __getitem__(self, i: int):
        import soundfile
        import torch
        from scipy.signal import resample_poly

        data, rate = soundfile.read(self.clips[i][0], dtype="float32", always_2d=True)
        mono = data.mean(axis=1)
        if rate != RATE:
            g = math.gcd(rate, RATE)
            mono = resample_poly(mono, RATE // g, rate // g)  # 44100 -> 8000: up 80, down 441
        start = int(self.rng().integers(max(len(mono) - SAMPLES, 0) + 1))
        piece = mono[start : start + SAMPLES]
        window = np.pad(piece, (0, SAMPLES - len(piece))).astype(np.float32)  # zeros after a short clip
        return torch.from_numpy(window).reshape(1, SAMPLES), self.clips[i][1]


class DaliAudio:
    """DALI's own audio pipeline on the CPU over ``data``; iterate for one epoch of ``(waveforms, labels)``."""

    def __init__(self, args, data: dict):
        from nvidia.dali import fn, pipeline_def, types
        from nvidia.dali import math as dmath

        @pipeline_def(batch_size=args.batch_size, num_threads=args.threads, device_id=None, seed=1)  # queue depth 2
        def pipe():
            encoded, labels = fn.readers.file(file_root=data["root"], random_shuffle=True, name="Reader")
            audio, _ = fn.decoders.audio(encoded, sample_rate=float(RATE), downmix=True, dtype=types.FLOAT)
            length = fn.cast(audio.shape(), dtype=types.FLOAT)[0]
            room = dmath.max(length - float(SAMPLES), 0.0)  # the starts there are, less one
            start = dmath.floor(fn.random.uniform(range=[0.0, 1.0]) * (room + 1.0))
            start = fn.cast(fn.reshape(start, shape=[1]), dtype=types.INT32)
            kw = {"shape": [SAMPLES], "axes": [0], "out_of_bounds_policy": "pad", "fill_values": 0.0}
            window = fn.slice(audio, start=start, **kw)
            return fn.reshape(window, shape=[1, SAMPLES]), fn.cast(labels, dtype=types.INT64)

        self.it = dali_iterator(pipe(), ["waveforms", "labels"])

    def __iter__(self):
        for (out,) in self.it:
            yield out["waveforms"], out["labels"].flatten()


class M5Step:
    """One training step per batch of ``examples/audio/model.py``'s M5 (torchaudio's tutorial's layout): forward,
    cross-entropy, backward, Adam."""

    def __init__(self, classes: int, seed: int = 0):
        import torch

        torch.manual_seed(seed)
        self.model = runpy.run_path(str(M5))["M5"](classes)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=0.01, weight_decay=1e-4)
        self.loss = torch.nn.CrossEntropyLoss()

    def __call__(self, batch) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self.loss(self.model(batch[0]), batch[1]).backward()
        self.optimizer.step()


LOADERS = {  # each child's loader (``--job``), from the options and the dataset's figures
    "coordl": lambda args, data: compare.coordl_loader(
        data["root"], coordl.AudioTrain(sample_rate=RATE, samples=SAMPLES), args
    ),
    "dali": DaliAudio,
    "torch": lambda args, data: dataloader(SoundfileClips(data["root"]), args.batch_size, args.threads, 0),
}
