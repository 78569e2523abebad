"""Audio on the CPU: coordl's AudioTrain against DALI's audio pipeline and a DataLoader; HP groups of M5 trials.

Scenarios (``--scenarios``), as :mod:`benchmarks.detection`'s, with :mod:`benchmarks.audio_baselines`'
loaders, each decoding, downmixing, resampling to 8 kHz and cutting a random 4 s window:

- ``prep``: ``coordl`` (``AudioTrain(sample_rate=8000, samples=32000)``), ``dali`` (``fn.readers.file`` +
  ``fn.decoders.audio`` + ``fn.slice``) and ``torch`` (soundfile + ``scipy.signal.resample_poly``), the
  dataset cached, no training step, a child process per run, ABBA ``--reps`` times;
- ``hp``: two coordl trials training M5 (one torch thread) in the HP group ``bench-audio`` vs apart;
- ``hp-prep``: the same with no model step (``x.sum()`` per batch).

The dataset is FMA-like (``coordl.tools.datagen.music.make_clips``): ``--clips`` clips of 30 s, 44.1 kHz
stereo, Ogg Vorbis, in 8 genre folders (``--smoke``: 40 short tones of ``datagen.tones``).

    python -m benchmarks audio                     # 300 clips, 3 reps: about 24 minutes on 2 cores
    python -m benchmarks audio --smoke --data /tmp/audio-smoke --out /tmp/audio.json
"""

from __future__ import annotations

import statistics

from benchmarks import audio_baselines as baselines
from benchmarks.harness import compare, jobs

LOADERS = ("coordl", "dali", "torch")
GROUP = "bench-audio"
DATA, SMOKE_DATA = "/var/tmp/coordl-bench/fma", "/var/tmp/coordl-bench/audio-smoke"


def options(p) -> None:
    g = p.add_argument_group("dataset", "generated under --data if missing, found again by a later run")
    g.add_argument("--data", help=f"dataset root (default: {DATA}; with --smoke, {SMOKE_DATA})")
    g.add_argument("--clips", type=int, default=300, help="clips to generate (default: %(default)s)")
    g.add_argument("--classes", type=int, default=8, help="genre folders (default: %(default)s)")
    g.add_argument("--seconds", type=float, default=30.0, help="each clip's duration (default: %(default)s)")
    g.add_argument("--format", default="ogg", help="ogg (Vorbis), opus, flac or wav (default: %(default)s)")
    g.add_argument("--dataset-seed", type=int, default=0, help="the generator's seed (default: 0)")
    compare.add_options(p, LOADERS, hp_epochs=2)
    p.add_argument("--scenarios", default="prep,hp,hp-prep", help="of prep, hp, hp-prep (default: %(default)s)")
    p.add_argument("--smoke", action="store_true", help="40 short tones, batch 16, 1 rep, 1 epoch: a test's run")


def clips(args) -> dict:
    """Generates (or finds) the dataset (with ``--smoke``, a small set of 1-6 s tones); returns its figures."""
    if args.smoke:
        from coordl.tools.datagen.tones import make_tones

        s = make_tones(args.data, classes=4, per_class=10, seed=args.dataset_seed)
        kind = "tones by coordl.tools.datagen.tones.make_tones: 16/22.05/44.1 kHz, mono/stereo, WAV/FLAC/Ogg Vorbis"
    else:
        from coordl.tools.datagen.music import make_clips

        seed = args.dataset_seed
        s = make_clips(args.data, args.clips, classes=args.classes, seconds=args.seconds, format=args.format, seed=seed)
        kind = f"music-like clips by coordl.tools.datagen.music.make_clips: 44.1 kHz stereo, {args.format}"
    rs = s.records
    out = {"root": s.root, "files": len(rs), "classes": len(s.classes), "total_bytes": s.total_bytes}
    out |= {
        "mean_bytes": round(s.total_bytes / len(rs)),
        "mean_seconds": round(statistics.mean(r.frames / r.rate for r in rs), 3),
    }
    out |= {
        k: sorted({getattr(r, a) for r in rs})
        for k, a in (("formats", "format"), ("rates", "rate"), ("channels", "channels"))
    }
    return out | {"source": kind}


def command(args):
    kw = {"batch_size": args.batch_size, "threads": args.threads, "data": args.data, "clips": args.clips}
    kw |= {"classes": args.classes, "seconds": args.seconds, "format": args.format, "dataset_seed": args.dataset_seed}
    argv = jobs.flags(**kw, smoke=args.smoke)
    return lambda name, *extra: jobs.scenario_command("audio", "--job", name, *argv, *extra)


def job(args) -> None:
    import torch

    c = clips(args)
    torch.set_num_threads(1)  # a trial's model step, and nothing of the loaders' own
    if args.job == "dali":
        loader = baselines.DaliAudio(c["root"], args.batch_size, args.threads)
    elif args.job == "torch":
        loader = baselines.torch_loader(c["root"], args.batch_size, args.threads)
    else:
        loader = baselines.coordl_loader(c["root"], args.batch_size, args.threads, group=args.group)
    step = None
    if args.step == "m5":
        m5 = baselines.M5Step(c["classes"])
        step = lambda b: m5(*b)  # noqa: E731
    elif args.step == "touch":
        step = lambda b: b[0].sum()  # noqa: E731  # a trivial training step
    compare.job(args, loader, step)


def run(args) -> dict | None:
    args.data = args.data or (SMOKE_DATA if args.smoke else DATA)
    if args.job:
        return job(args)
    if args.smoke:
        args.batch_size, args.reps, args.epochs, args.hp_epochs = 16, 1, 1, 2
    args.loaders, scenarios = args.loaders.split(","), args.scenarios.split(",")
    c = clips(args)
    print(f"dataset: {c['files']} files, {c['total_bytes'] / 1e6:.1f} MB, mean {c['mean_seconds']:.1f} s")
    result = {"dataset": c, "recipe": {"sample_rate": baselines.RATE, "samples": baselines.SAMPLES}}
    if "prep" in scenarios:
        print(f"prep-bound, batch {args.batch_size}, {args.threads} threads/workers, runs alternating")
        result["prep"] = compare.prep(args, command(args))
    for name, step in (("hp", "m5"), ("hp-prep", "touch")):
        if name in scenarios:
            print(f"two trials ({'M5 steps' if step == 'm5' else 'no model'}), hp_group={GROUP!r} vs separate")
            result[name] = compare.hp(args, command(args), GROUP, step)
    return result


def table(results: dict) -> str:
    return compare.table(results, ("hp", "hp-prep"))
