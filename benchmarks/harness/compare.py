"""Loaders compared in child processes, alternated ABBA, and two trials in an HP group vs apart.

The shape :mod:`benchmarks.detection` and :mod:`benchmarks.audio` share (:func:`run`: :func:`prep`, :func:`hp`),
and the loop of :mod:`benchmarks.gpu` (:func:`alone`). A child is the scenario again with ``--job NAME`` (:func:`job`).
"""

import argparse
import json
import math
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from . import cli, jobs, measure, report


def add_options(p: argparse.ArgumentParser, loaders: dict, default: tuple[str, ...], scenarios: str, data: str):
    """The comparison's options (None: set by :func:`run`, smaller with ``--smoke``) and a child's (hidden); returns
    the dataset's group, with ``--data`` (``data``: its help) and ``--dataset-seed``, for the scenario's own."""
    p.add_argument("--job", choices=list(loaders), help=argparse.SUPPRESS)
    for a in ("--group", "--ready", "--go"):
        p.add_argument(a, help=argparse.SUPPRESS)
    p.add_argument("--step", default="none", help=argparse.SUPPRESS)
    p.add_argument("--batch-size", type=int, help="default: 64 (16 with --smoke)")
    p.add_argument("--threads", type=int, default=2, help="DALI threads / DataLoader workers (default: 2)")
    p.add_argument("--epochs", type=int, help="measured epochs per run (default: 2; 1 with --smoke)")
    p.add_argument("--hp-epochs", type=int, help="epochs per HP trial, the first not measured (default: 3 or 2)")
    p.add_argument("--reps", type=int, help="alternated repetitions (default: 3; 1 with --smoke)")
    p.add_argument("--loaders", default=",".join(default), help="of the prep scenario (default: %(default)s)")
    p.add_argument("--scenarios", default=scenarios, help="(default: %(default)s)")
    p.add_argument("--smoke", action="store_true", help="a small dataset, batch 16, 1 rep, 1 epoch: a test's run")
    g = p.add_argument_group("dataset", "generated under --data if missing, found again by a later run")
    g.add_argument("--data", help=data)
    g.add_argument("--dataset-seed", type=int, default=0, help="the generator's seed (default: 0)")
    return g


def run(args, dataset, loaders: dict, steps: dict, hps: dict[str, str], group: str, hp_epochs: int = 3) -> dict | None:
    """``dataset(args)`` made or found; in a child, :func:`job` of ``loaders[--job](args, dataset)``, its step
    ``steps[--step](dataset)`` (none if not there); else ``prep`` and each HP comparison of ``hps`` (name: the
    trials' step) that ``--scenarios`` names."""
    cli.defaults(args, args.smoke, batch_size=(64, 16), epochs=(2, 1), hp_epochs=(hp_epochs, 2), reps=(3, 1))
    data = dataset(args)
    if args.job:
        return job(args, loaders[args.job](args, data), steps[args.step](data) if args.step in steps else None)
    args.loaders, scenarios = args.loaders.split(","), args.scenarios.split(",")
    print(f"dataset: {data['files']} files, {data['total_bytes'] / 1e6:.1f} MB ({data['source']})")
    result = {"dataset": data}

    def command(name, *extra):  # the scenario again, as this one was called, with the child's options after
        return jobs.scenario_command(args._scenario, *args._argv, "--job", name, *extra)

    if "prep" in scenarios:
        print(f"prep-bound, batch {args.batch_size}, {args.threads} threads/workers, runs alternating")
        result["prep"] = prep(args, command)
    for name, step in hps.items():
        if name in scenarios:
            print(f"two trials (step: {step}), hp_group={group!r} vs separate")
            result[name] = hp(args, command, group, step)
    return result


def job(args, loader, step=None) -> None:
    """A child's run of ``loader``: wait for the go (trials), warm-up and measured epochs, to ``--out``."""
    try:
        jobs.wait_for_go(args.ready, args.go)
        es = measure.epochs(loader, args.epochs, warmup=1, step=step, keys=(*measure.STATS, "consumed_shared"))
    finally:
        if hasattr(loader, "close"):
            loader.close()
    Path(args.out).write_text(json.dumps({"loader": args.job, "group": args.group, "step": args.step, "epochs": es}))


def touch(batch) -> None:
    """A trivial training step: read the batch."""
    batch[0].sum()


def coordl_loader(data, recipe, args, seed: int = 0):
    """``CoordLoader(data, pipeline=recipe)``, its cache the whole dataset (filled by the first epoch),
    ``--threads`` DALI threads, in the HP group ``--group`` when given."""
    import coordl

    kw = {"device_id": None, "cache": coordl.Cache(size=1.0), "prep": coordl.Prep(threads=args.threads), "seed": seed}
    kw |= {"hp_group": args.group} if args.group else {}
    return coordl.CoordLoader(data, batch_size=args.batch_size, pipeline=recipe, shuffle=True, **kw)


class ForkedRng:
    """A Python baseline's random stream: a forked DataLoader worker draws its own, not its parent's copy."""

    seed, _pid = 0, None

    def rng(self) -> np.random.Generator:
        if self._pid != os.getpid():
            self._rng, self._pid = np.random.default_rng([self.seed, os.getpid()]), os.getpid()
        return self._rng


def prep(args, command) -> dict:
    """Each of ``args.loaders`` alone in a child (``command(name, *extra)``), ABBA for ``args.reps``:
    each run, the medians, coordl/each other."""
    with tempfile.TemporaryDirectory(prefix="coordl-bench-") as tmp:
        runs = alone(args.loaders, args.reps, command, measure.steady, out=Path(tmp))  # a child's --epochs: as here
    if failed := [r["error"] for rs in runs.values() for r in rs if "error" in r]:
        raise SystemExit(f"a run failed: {failed[0]}")
    median = measure.medians(runs)
    return {"runs": runs, "median": median, "ratios": measure.ratios(median)}


def alone(names, reps, command, figures, *, deadline=math.inf, timeout=None, out=None, saved=lambda runs: None):
    """Each of ``names`` alone in a child (``command(name)``, with ``--out`` a file of the folder ``out`` if given),
    ABBA for ``reps``: the JSON it said, ``figures(it)``, its wall time and the load before and after, or its error
    (``timeout`` seconds at most); skipped once the ``deadline`` (``time.perf_counter()``) is nearer than the
    longest run took; ``saved(runs)`` after every run. Returns the runs per name."""
    runs, longest = {name: [] for name in names}, 0.0
    for rep, name in measure.alternate(names, reps):
        if (left := deadline - time.perf_counter()) < longest:
            runs[name].append({"skipped": f"out of time: {left:.0f} s left, a run took {longest:.0f} s"})
            print(f"  rep {rep + 1} {name}: skipped ({runs[name][-1]['skipped']})")
            continue
        file, t0, load = out and out / f"{name}.json", time.perf_counter(), os.getloadavg()[0]
        wait = timeout and max(min(left, timeout), 30)
        run = jobs.outcome([*command(name), *(["--out", str(file)] if out else [])], timeout=wait, out=file)
        run.update(wall_s=time.perf_counter() - t0, load_before=load, load_after=os.getloadavg()[0])
        said = f"failed: {run['error'][-600:]}" if "error" in run else figures(run)
        if "error" not in run:
            longest = max(longest, run["wall_s"])  # what a run takes here: a hung one says nothing of it
            run.update(said)
        print(f"  rep {rep + 1} {name}: {said}; {run['wall_s']:.0f} s")
        runs[name].append(run)
        saved(runs)
    return runs


def hp(args, command, group: str, step: str) -> dict:
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
            run = {"per_trial_samples_per_s": rates, "cpu_s_per_sample": cpu, "jobs": trials, "load_before": load}
            runs[mode].append(run)
            print(f"  rep {rep + 1} {mode:>8}: per trial {[round(r, 1) for r in rates]} samples/s")
    means = {m: [statistics.mean(r["per_trial_samples_per_s"]) for r in rs] for m, rs in runs.items()}
    speedups = [g / s for s, g in zip(means["separate"], means["group"], strict=True)]
    out = {"trials": 2, "group": group, "step": step, **runs}
    return out | {"speedups": speedups, "speedup_median": statistics.median(speedups)}


def table(results: dict) -> str:
    """The prep comparison's medians and ratios, and each HP comparison's per-trial speedups (the runs
    are printed as they end)."""
    lines = []
    if p := results.get("prep"):
        rows = [[n, m["samples_per_s"], 1000 * m["cpu_s_per_sample"]] for n, m in p["median"].items()]
        lines.append(report.table("loader|median samples/s|median CPU-ms/sample", rows))
        for k, r in p["ratios"].items():
            lines.append(f"{k}: samples/s {r['samples_per_s']:.3f}, CPU/sample {r['cpu_s_per_sample']:.3f}")
    for name, h in results.items():
        if isinstance(h, dict) and "speedups" in h:
            speedups = ", ".join(f"{s:.2f}" for s in h["speedups"])
            lines.append(f"{name} per-trial speedup ({h['step']}): median {h['speedup_median']:.2f} ({speedups})")
    return "\n".join(lines)
