"""The trials the HP-group scenarios (:mod:`benchmarks.hp_group`, :mod:`benchmarks.hp_mix`,
:mod:`benchmarks.hp_sweep`) start together: each a child process with one CoordLoader over the same
ImageNet-like dataset, the MinIO cache warm and kept (``Cache(size=1.0, keep=True)``), the standard
training recipe at 224 on the CPU (prep-bound), reading each batch (``x.sum()``) and sleeping
``--sleep`` seconds per batch (its training step).

A trial records per epoch its seconds, samples, whether it saw every sample exactly once and its
``stats()``; per batch the time ``next()`` took, the first read, when it arrived, and whether it was
a view of a staged slot (no copy); its first batch's latency and its CPU seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import time
from pathlib import Path

from benchmarks.harness import dataset, jobs, measure

STATS = "produced consumed_shared detached alone_batches order_epoch hp_members storage_bytes staging_peak_bytes"
STATS = (*STATS.split(), "staging_bound")


def add_options(p: argparse.ArgumentParser) -> None:
    """The dataset, ``--epochs``, and a trial's own options (hidden): the scenario's ``run`` calls
    :func:`trial` when ``--trial`` is given."""
    dataset.add_dataset_options(p, data="/var/tmp/coordl-bench/train")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--trial", action="store_true", help=argparse.SUPPRESS)
    for a in ("--group", "--ready", "--go", "--after", "--entered", "--last", "--progress"):
        p.add_argument(a, help=argparse.SUPPRESS)
    p.add_argument("--batch-size", type=int, default=64, help=argparse.SUPPRESS)
    p.add_argument("--stage-batch", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--sleep-per-batch", type=float, default=0.0, help=argparse.SUPPRESS)


def images(args) -> dict:
    """The dataset (made or found); ``args.images`` becomes its count, which a trial checks against."""
    data = dataset.dataset_from_args(args)
    args.images = data["files"]
    print(f"dataset: {dataset.describe(data)}")
    return data


def _wait_file(path: str | None) -> None:
    while path and not os.path.exists(path):
        time.sleep(0.001)


def trial(args) -> None:
    """One trial: waits for the go (and for the trial before it to have entered the group, with
    ``--after``), runs its epochs, writes what it saw to ``--out``."""
    import coordl

    group = args.group
    if group and args.stage_batch:
        group = coordl.HPGroup(group, stage_batch=args.stage_batch)
    out = {"epochs": [], "take_s": [], "read_s": [], "times": [], "views": 0, "batches": 0}
    kw = {"pipeline": "imagenet-train", "device_id": None, "return_index": True, "shuffle": True}
    kw |= {"cache": coordl.Cache(size=1.0, keep=True), **({"hp_group": group} if group else {})}
    with coordl.CoordLoader(args.data, batch_size=args.batch_size, **kw) as loader:
        jobs.wait_for_go(args.ready, args.go)
        _wait_file(args.after)
        for epoch in range(args.epochs):
            loader.set_epoch(epoch)
            t0 = time.perf_counter()
            it = iter(loader)
            if epoch == 0 and args.entered:
                Path(args.entered).touch()
                _wait_file(args.last)  # every trial is a member of the group's first pass
                t0 = time.perf_counter()
            seen = []
            while True:
                t = time.perf_counter()
                try:
                    x, _, ids = next(it)
                except StopIteration:
                    break
                t1 = time.perf_counter()
                x.sum()
                if not seen and epoch == 0:
                    out["first_batch_s"] = t1 - t0
                out["take_s"].append(t1 - t)
                out["read_s"].append(time.perf_counter() - t1)
                out["times"].append(time.monotonic())
                out["views"] += not x.untyped_storage().resizable()  # a mapping of the slot, not a copy
                out["batches"] += 1
                seen += ids.tolist()
                if args.progress:
                    Path(args.progress).write_text(str(out["batches"]))
                if args.sleep_per_batch:
                    time.sleep(args.sleep_per_batch)
            s = loader.stats()
            out["stage_batch"] = s.get("stage_batch")
            once = len(seen) == len(set(seen)) == args.images
            e = {"seconds": time.perf_counter() - t0, "samples": len(seen), "exactly_once": once}
            out["epochs"].append(e | {k: s.get(k) for k in STATS})
    ru = resource.getrusage(resource.RUSAGE_SELF)
    out["cpu_s"] = {"user": ru.ru_utime, "sys": ru.ru_stime}
    Path(args.out).write_text(json.dumps(out))


def command(args, scenario: str, spec: dict) -> list[str]:
    """The command of one trial of ``spec``: ``batch`` and optionally ``group``, ``stage_batch``,
    ``sleep``, ``epochs``, and the files ``after``, ``entered``, ``last``, ``progress``."""
    kw = {
        "data": args.data,
        "images": args.images,
        "batch_size": spec["batch"],
        "epochs": spec.get("epochs", args.epochs),
    }
    kw |= {"sleep_per_batch": spec.get("sleep", 0.0), "stage_batch": spec.get("stage_batch") or 0}
    argv = jobs.flags(
        trial=True, **kw, **{k: spec.get(k) or None for k in ("group", "after", "entered", "last", "progress")}
    )
    return jobs.scenario_command(scenario, *argv)


def launch(args, scenario: str, workdir: Path, specs: list[dict]) -> list[dict]:
    """Runs trials of ``specs`` together (:func:`command`); returns what each wrote."""
    return jobs.run_together([command(args, scenario, s) for s in specs], workdir)


def rate(out: dict) -> float:
    """Samples/s of a trial over its epochs after the first (pipeline build, joining)."""
    steady = out["epochs"][1:]
    return sum(e["samples"] for e in steady) / sum(e["seconds"] for e in steady)


def summary(outs: list[dict]) -> dict:
    out = {"per_job_samples_per_s": [rate(o) for o in outs]}
    out["exactly_once"] = all(e["exactly_once"] for o in outs for e in o["epochs"])
    out |= {f"{k}_ms_median": [1000 * statistics.median(o[f"{k}_s"]) for o in outs] for k in ("take", "read")}
    return out | {"epochs": [o["epochs"] for o in outs]}


def mean(xs) -> float:
    return sum(xs) / len(xs)


def compare(args, scenario: str, workdir: Path, modes: dict[str, list[dict]]) -> dict:
    """Runs each mode's trials ``--reps`` times, the modes ABBA; per mode its runs' :func:`summary`."""
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    for r, m in measure.alternate(list(modes), args.reps):
        s = summary(launch(args, scenario, workdir, modes[m]))
        runs[m].append(s)
        print(f"  rep {r + 1} {m:>8}: per job {[round(x) for x in s['per_job_samples_per_s']]} samples/s")
    return runs


def ratios(runs: dict, a: str = "alone", b: str = "group") -> list[float]:
    """Per rep, the mean per-trial rate of mode ``b`` over mode ``a``'s."""
    return [
        mean(y["per_job_samples_per_s"]) / mean(x["per_job_samples_per_s"])
        for x, y in zip(runs[a], runs[b], strict=True)
    ]
