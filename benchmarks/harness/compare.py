"""Loaders compared in child processes, alternated ABBA, and two trials in an HP group vs apart.

The shape :mod:`benchmarks.detection`, :mod:`benchmarks.audio` and :mod:`benchmarks.gpu` share: a
scenario's ``run(args)`` with ``args.job`` set is one child (:func:`job`: its loader, a warm-up
epoch, the measured epochs, written to ``--out``); :func:`prep` runs each of ``args.loaders`` alone,
``args.reps`` times in ABBA order; :func:`hp` starts two coordl trials together, in the HP group
vs without one.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
from pathlib import Path

from . import jobs, measure


def add_options(p: argparse.ArgumentParser, loaders: tuple[str, ...], *, jobs_of=None, epochs=2, hp_epochs=3) -> None:
    """The comparison's options, and the hidden ones of a child job (``--job`` one of ``jobs_of``)."""
    p.add_argument("--job", choices=jobs_of or loaders, help=argparse.SUPPRESS)
    for a in ("--group", "--ready", "--go"):
        p.add_argument(a, help=argparse.SUPPRESS)
    p.add_argument("--warmup", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--step", default="none", help=argparse.SUPPRESS)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--threads", type=int, default=2, help="DALI threads / DataLoader workers (default: 2)")
    p.add_argument("--epochs", type=int, default=epochs, help=f"measured epochs per run (default: {epochs})")
    p.add_argument("--hp-epochs", type=int, default=hp_epochs, help=f"epochs per hp trial (default: {hp_epochs})")
    p.add_argument("--reps", type=int, default=3, help="alternated repetitions (default: 3)")
    p.add_argument("--loaders", default=",".join(loaders), help="of the prep scenario (default: %(default)s)")


def job(args, loader, step=None, **extra) -> None:
    """A child's run of ``loader``: wait for the go (trials), warm-up and measured epochs, to ``--out``."""
    try:
        jobs.wait_for_go(args.ready, args.go)
        es = measure.epochs(
            loader, args.epochs, warmup=args.warmup, step=step, keys=(*measure.STATS, "consumed_shared")
        )
    finally:
        if hasattr(loader, "close"):
            loader.close()
    out = {"loader": args.job, "group": args.group, "step": args.step, **extra, "epochs": es}
    Path(args.out).write_text(json.dumps(out))


def prep(args, command) -> dict:
    """Each of ``args.loaders`` alone in a child (``command(name, *extra)``), ABBA for ``args.reps``:
    each run, the medians, coordl/each other."""
    runs: dict[str, list[dict]] = {name: [] for name in args.loaders}
    with tempfile.TemporaryDirectory(prefix="coordl-bench-") as tmp:
        for rep, name in measure.alternate(args.loaders, args.reps):
            out, load = Path(tmp) / f"{name}.json", os.getloadavg()[0]
            subprocess.run([*command(name, "--epochs", str(args.epochs)), "--out", str(out)], check=True)
            run = {**json.loads(out.read_text()), "load_before": load, "load_after": os.getloadavg()[0]}
            run.update(measure.steady(run))
            runs[name].append(run)
            print(
                f"  rep {rep + 1} {name:>10}: {run['samples_per_s']:7.1f} samples/s, "
                f"{1000 * run['cpu_s_per_sample']:.2f} CPU-ms/sample"
            )
    median = measure.medians(runs)
    return {"runs": runs, "median": median, "ratios": measure.ratios(median)}


def hp(args, command, group: str, step: str = "touch") -> dict:
    """Two coordl trials (``command("coordl", *extra)``) doing ``step`` per batch, in the HP group
    ``group`` vs separate, ABBA for ``args.reps``: per-trial rates and speedups."""
    runs: dict[str, list[dict]] = {"separate": [], "group": []}
    extra = ["--epochs", str(args.hp_epochs - 1), "--step", step]
    with tempfile.TemporaryDirectory(prefix="coordl-bench-") as tmp:
        for rep, mode in measure.alternate(list(runs), args.reps):
            trial = command("coordl", *extra, *(["--group", group] if mode == "group" else []))
            load = os.getloadavg()[0]
            trials = jobs.run_together([trial, trial], Path(tmp))
            rates = [measure.steady(j)["samples_per_s"] for j in trials]
            cpu = sum(measure.steady(j)["cpu_s_per_sample"] * 0.5 for j in trials)  # per sample a trial gets
            runs[mode].append(
                {"per_trial_samples_per_s": rates, "cpu_s_per_sample": cpu, "jobs": trials, "load_before": load}
            )
            print(f"  rep {rep + 1} {mode:>8}: per trial {[round(r, 1) for r in rates]} samples/s")
    speedups = [
        statistics.mean(g["per_trial_samples_per_s"]) / statistics.mean(s["per_trial_samples_per_s"])
        for s, g in zip(runs["separate"], runs["group"], strict=True)
    ]
    return {
        "trials": 2,
        "group": group,
        "step": step,
        **runs,
        "speedups": speedups,
        "speedup_median": statistics.median(speedups),
    }


def table(results: dict, hp_names=("hp",)) -> str:
    """The prep comparison's medians and runs, its ratios, and each HP scenario's per-trial speedups."""
    lines = []
    if "prep" in results:
        lines += ["| loader | median samples/s | runs | median CPU-ms/sample | runs |", "|---|---|---|---|---|"]
        for name, rs in results["prep"]["runs"].items():
            m = results["prep"]["median"][name]
            rates = ", ".join(f"{r['samples_per_s']:.1f}" for r in rs)
            cpus = ", ".join(f"{1000 * r['cpu_s_per_sample']:.2f}" for r in rs)
            lines.append(
                f"| {name} | {m['samples_per_s']:.1f} | {rates} | {1000 * m['cpu_s_per_sample']:.2f} | {cpus} |"
            )
        for key, r in results["prep"]["ratios"].items():
            lines.append(f"{key}: samples/s {r['samples_per_s']:.3f}, CPU/sample {r['cpu_s_per_sample']:.3f}")
    for name in (n for n in hp_names if n in results):
        h = results[name]
        for mode in ("separate", "group"):
            rates = "; ".join(", ".join(f"{x:.1f}" for x in r["per_trial_samples_per_s"]) for r in h[mode])
            cpus = ", ".join(f"{1000 * r['cpu_s_per_sample']:.2f}" for r in h[mode])
            lines.append(f"{name} {mode}: per-trial samples/s {rates}; CPU-ms per trial sample {cpus}")
        speedups = ", ".join(f"{s:.2f}" for s in h["speedups"])
        lines.append(f"{name} per-trial speedup ({h['step']}): median {h['speedup_median']:.2f} ({speedups})")
    return "\n".join(lines)
