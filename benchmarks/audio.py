"""Audio on the CPU: coordl's AudioTrain against DALI's own audio pipeline and a ``DataLoader``
decoding with soundfile and resampling with scipy, and an HP group of two M5 trials.

Scenarios (``--scenarios``):

- ``prep``: prep-bound loading, the whole dataset in memory (page cache warm, coordl's cache holding
  it) and no training step. Three loaders with the same batch size and CPU threads/workers, each
  decoding, downmixing, resampling to 8 kHz and cutting a random 4 s window
  (:mod:`benchmarks.audio_baselines`): ``coordl`` (``AudioTrain(sample_rate=8000, samples=32000)``),
  ``dali`` (``fn.readers.file`` + ``fn.decoders.audio`` + ``fn.slice``) and ``torch``
  (``DataLoader`` over soundfile + ``scipy.signal.resample_poly``). Each run is a child process: a
  warm-up epoch, then ``--epochs`` epochs measured for samples/s and CPU seconds per sample (the
  process, its threads, its live descendants and its reaped children). Runs alternate A B C A B C,
  ``--reps`` times; reported: each run, the medians, coordl/dali and coordl/torch.
- ``hp``: two coordl trials started together, each training M5 (forward, backward, Adam; one torch
  thread) on every batch, in the HP group ``bench-audio`` vs the same two without a group,
  alternating, ``--reps`` times; per-trial samples/s over the epochs after the first; speedup =
  group / separate (the mean of the two trials').
- ``hp-prep``: the same with no model step (each trial reads its batches, ``x.sum()``).

The dataset is FMA-like (``coordl.tools.datagen.music.make_clips``): ``--clips`` clips of 30 s of
music-like audio, 44.1 kHz stereo, Ogg Vorbis (DALI does not read FMA's MP3s), in 8 genre folders,
generated once under ``--data`` (about 1 s per clip on 2 cores).

    python -m benchmarks.audio                     # 300 clips, 3 reps: about 15 minutes on 2 cores
    python -m benchmarks.audio --smoke --data /tmp/audio-smoke --out /tmp/audio.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import audio_baselines as baselines
from benchmarks import common, detection
from benchmarks.detection import cpu_seconds

HERE = Path(__file__).resolve().parent
LOADERS = ("coordl", "dali", "torch")
GROUP = "bench-audio"
DATA, SMOKE_DATA = "/var/tmp/coordl-bench/fma", "/var/tmp/coordl-bench/audio-smoke"


def job(args) -> None:
    """One run of one loader (a child process): builds it, a warm-up epoch, then the measured epochs."""
    import torch

    clips = dataset(args)
    torch.set_num_threads(1)  # a trial's model step, and nothing of the loaders' own
    if args.job == "dali":
        loader = baselines.DaliAudio(clips["root"], args.batch_size, args.threads)
    elif args.job == "torch":
        loader = baselines.torch_loader(clips["root"], args.batch_size, args.threads)
    else:
        loader = baselines.coordl_loader(clips["root"], args.batch_size, args.threads, group=args.group)
    step = baselines.M5Step(clips["classes"]) if args.step == "m5" else None
    out = {"loader": args.job, "group": args.group, "step": args.step, "epochs": []}
    keys = ("storage_reads", "cache_hits", "cache_items", "stall_s", "prep_s", "produced", "consumed_shared")
    try:
        if args.ready:
            common.wait_for_go(args.ready, args.go)
        for epoch in range(args.warmup + args.epochs):
            if hasattr(loader, "set_epoch"):
                loader.set_epoch(epoch)
            cpu, t0, n, shape = cpu_seconds(), time.perf_counter(), 0, None
            for waveforms, labels in loader:
                if step is not None:
                    step(waveforms, labels)
                elif args.step == "touch":
                    waveforms.sum()  # a trivial training step
                n, shape = n + len(waveforms), list(waveforms.shape)
            e = {"warmup": epoch < args.warmup, "seconds": time.perf_counter() - t0, "samples": n, "shape": shape}
            e["cpu_s"] = cpu_seconds() - cpu
            if hasattr(loader, "stats"):
                s = loader.stats()
                e["stats"] = {k: s.get(k) for k in keys}
            out["epochs"].append(e)
    finally:
        if hasattr(loader, "close"):
            loader.close()
    Path(args.out).write_text(json.dumps(out))


def job_command(args, name: str, out: Path, *extra: str) -> list[str]:
    argv = ["--job", name, "--out", str(out), "--batch-size", str(args.batch_size), "--threads", str(args.threads)]
    return common.module_command("audio", *argv, *dataset_argv(args), *extra)


def prep(args, workdir: Path) -> dict:
    """The loaders alone, alternated (:func:`benchmarks.detection.prep` with this module's jobs)."""
    return detection.prep(args, workdir, job_command)


def hp(args, workdir: Path, step: str) -> dict:
    """Two trials with ``step`` (``m5`` or ``touch``) per batch, in the group vs separate, alternating."""
    return {**detection.hp(args, workdir, job_command, GROUP, ("--step", step)), "step": step}


# -- the dataset -----------------------------------------------------------------------------
def add_dataset_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("dataset", "generated under --data if missing, found again by a later run")
    g.add_argument("--data", help=f"dataset root (default: {DATA}; with --smoke, {SMOKE_DATA})")
    g.add_argument("--clips", type=int, default=300, help="clips to generate (default: %(default)s)")
    g.add_argument("--classes", type=int, default=8, help="genre folders (default: %(default)s)")
    g.add_argument("--seconds", type=float, default=30.0, help="each clip's duration (default: %(default)s)")
    g.add_argument("--format", default="ogg", help="ogg (Vorbis), opus, flac or wav (default: %(default)s)")
    g.add_argument("--dataset-seed", type=int, default=0, help="the generator's seed (default: 0)")


def dataset_argv(args) -> list[str]:
    argv = ["--data", args.data, "--clips", str(args.clips), "--classes", str(args.classes)]
    argv += ["--seconds", str(args.seconds), "--format", args.format, "--dataset-seed", str(args.dataset_seed)]
    return argv + (["--smoke"] if args.smoke else [])


def dataset(args) -> dict:
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
    return {
        "root": s.root,
        "files": len(rs),
        "classes": len(s.classes),
        "total_bytes": s.total_bytes,
        "mean_bytes": round(s.total_bytes / len(rs)),
        "mean_seconds": round(statistics.mean(r.frames / r.rate for r in rs), 3),
        "formats": sorted({r.format for r in rs}),
        "rates": sorted({r.rate for r in rs}),
        "channels": sorted({r.channels for r in rs}),
        "source": kind,
    }


# -- the command -----------------------------------------------------------------------------
def main() -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.audio", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--job", choices=LOADERS, help=argparse.SUPPRESS)
    for a in ("--group", "--ready", "--go"):
        p.add_argument(a, help=argparse.SUPPRESS)
    p.add_argument("--warmup", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--step", choices=("none", "touch", "m5"), default="none", help=argparse.SUPPRESS)
    add_dataset_options(p)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--threads", type=int, default=2, help="DALI threads / DataLoader workers (default: 2)")
    p.add_argument("--epochs", type=int, default=2, help="measured epochs per prep run, after a warm-up (default: 2)")
    p.add_argument("--hp-epochs", type=int, default=2, help="epochs per hp trial, the first not measured (default: 2)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--scenarios", default="prep,hp,hp-prep", help="of prep, hp, hp-prep (default: %(default)s)")
    p.add_argument("--loaders", default=",".join(LOADERS), help="of the prep scenario (default: %(default)s)")
    p.add_argument("--smoke", action="store_true", help="40 short tones, batch 16, 1 rep, 1 epoch: a test's run")
    p.add_argument("--out", default=str(HERE / "results" / "audio.json"))
    args = p.parse_args()
    args.data = args.data or (SMOKE_DATA if args.smoke else DATA)
    if args.job:
        job(args)
        return 0
    if args.smoke:
        args.batch_size, args.reps, args.epochs, args.hp_epochs = 16, 1, 1, 2
    args.loaders = args.loaders.split(",")
    scenarios = args.scenarios.split(",")
    command = " ".join(["python -m benchmarks.audio", *sys.argv[1:]])
    clips = dataset(args)
    print(
        f"dataset: {clips['files']} files in {clips['classes']} classes, {clips['total_bytes'] / 1e6:.1f} MB, "
        f"mean {clips['mean_bytes'] / 1e3:.1f} KB, mean {clips['mean_seconds']:.1f} s ({clips['source']})"
    )
    result = {
        "benchmark": "audio",
        "command": command,
        "machine": {**common.machine(), "load_at_start": os.getloadavg()},
        "dataset": clips,
        "recipe": {"sample_rate": baselines.RATE, "samples": baselines.SAMPLES},
        "batch_size": args.batch_size,
        "threads": args.threads,
        "epochs": args.epochs,
        "hp_epochs": args.hp_epochs,
        "reps": args.reps,
    }
    with tempfile.TemporaryDirectory(prefix="coordl-audio-") as tmp:
        if "prep" in scenarios:
            print(f"prep-bound, batch {args.batch_size}, {args.threads} threads/workers, runs alternating")
            result["prep"] = prep(args, Path(tmp))
        for name, step in (("hp", "m5"), ("hp-prep", "touch")):
            if name in scenarios:
                print(f"two trials ({'M5 steps' if step == 'm5' else 'no model'}), hp_group={GROUP!r} vs separate")
                result[name] = hp(args, Path(tmp), step)
    result["machine"]["load_at_end"] = os.getloadavg()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(table(result))
    print(f"wrote {args.out}")
    return 0


def table(result: dict) -> str:
    lines = []
    if "prep" in result:
        lines += ["| loader | median samples/s | runs | median CPU-ms/sample | runs |", "|---|---|---|---|---|"]
        for name, rs in result["prep"]["runs"].items():
            m = result["prep"]["median"][name]
            rates = ", ".join(f"{r['samples_per_s']:.1f}" for r in rs)
            cpus = ", ".join(f"{1000 * r['cpu_s_per_sample']:.2f}" for r in rs)
            lines.append(
                f"| {name} | {m['samples_per_s']:.1f} | {rates} | {1000 * m['cpu_s_per_sample']:.2f} | {cpus} |"
            )
        for key, r in result["prep"]["ratios"].items():
            lines.append(f"{key}: samples/s {r['samples_per_s']:.3f}, CPU/sample {r['cpu_s_per_sample']:.3f}")
    for name in ("hp", "hp-prep"):
        if name in result:
            h = result[name]
            for mode in ("separate", "group"):
                rates = "; ".join(", ".join(f"{x:.1f}" for x in r["per_trial_samples_per_s"]) for r in h[mode])
                cpus = ", ".join(f"{1000 * r['cpu_s_per_sample']:.2f}" for r in h[mode])
                lines.append(f"{name} {mode}: per-trial samples/s {rates}; CPU-ms per trial sample {cpus}")
            speedups = ", ".join(f"{s:.2f}" for s in h["speedups"])
            lines.append(f"{name} per-trial speedup ({h['step']}): median {h['speedup_median']:.2f} ({speedups})")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
