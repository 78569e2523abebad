"""The trials :mod:`benchmarks.hp_group` starts together: each a child with one CoordLoader, the MinIO cache
warm and kept, ``imagenet-train`` on the CPU, reading each batch (``x.sum()``), then sleeping
``--sleep-per-batch`` (its training step). It records per epoch its seconds, samples, batches, exactly once
or not and its ``stats()``; per batch ``next()``'s time, the first read's, when it came and whether it was
a view of a staged slot; its first batch's latency and its CPU seconds.
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
SPEC = ("group", "after", "entered", "last", "progress")  # a trial's options beside its batch, epochs, sleep


def add_options(p: argparse.ArgumentParser) -> None:
    """The dataset, ``--epochs``, and a trial's own options (hidden, with ``--trial``)."""
    dataset.add_dataset_options(p, data="/var/tmp/coordl-bench/train")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--trial", action="store_true", help=argparse.SUPPRESS)
    for a in (*SPEC, "ready", "go"):
        p.add_argument(f"--{a}", help=argparse.SUPPRESS)
    for a, kind in (("batch-size", int), ("stage-batch", int), ("sleep-per-batch", float)):
        p.add_argument(f"--{a}", type=kind, default=0, help=argparse.SUPPRESS)


def trial(args) -> None:
    """One trial: waits for the go (and for the trial before it to have entered the group, with
    ``--after``), runs its epochs, writes what it saw to ``--out``."""
    import coordl

    group = args.group
    if group and args.stage_batch:
        group = coordl.HPGroup(group, stage_batch=args.stage_batch)
    out = {"group": args.group, "epochs": [], "take_s": [], "read_s": [], "times": [], "views": 0, "batches": 0}
    kw = {"pipeline": "imagenet-train", "device_id": None, "return_index": True, "shuffle": True}
    kw |= {"cache": coordl.Cache(size=1.0, keep=True), **({"hp_group": group} if group else {})}
    with coordl.CoordLoader(args.data, batch_size=args.batch_size, **kw) as loader:
        jobs.wait_for_go(args.ready, args.go)
        _wait_file(args.after)
        for epoch in range(args.epochs):
            loader.set_epoch(epoch)
            t0, b0 = time.monotonic(), out["batches"]
            it = iter(loader)
            if epoch == 0 and args.entered:
                Path(args.entered).touch()
                _wait_file(args.last)  # every trial is a member of the group's first pass
                t0 = time.monotonic()
            seen = []
            for ids in _timed(it, out):
                if not seen and epoch == 0:
                    out["first_batch_s"] = out["times"][-1] - t0
                seen += ids.tolist()
                if args.progress:
                    Path(args.progress).write_text(str(out["batches"]))
                time.sleep(args.sleep_per_batch)
            s = loader.stats()
            out["stage_batch"] = s.get("stage_batch")
            once = len(seen) == len(set(seen)) == args.images
            e = {"seconds": time.monotonic() - t0, "samples": len(seen), "batches": out["batches"] - b0}
            out["epochs"].append(e | {"exactly_once": once} | {k: s.get(k) for k in STATS})
    ru = resource.getrusage(resource.RUSAGE_SELF)
    Path(args.out).write_text(json.dumps(out | {"cpu_s": ru.ru_utime + ru.ru_stime}))


def _timed(it, out: dict):
    """The sample ids of each batch of ``it``, its ``next()`` and first read timed (in ``out``)."""
    t = time.monotonic()
    for x, _, ids in it:
        t1 = time.monotonic()
        x.sum()
        out["take_s"].append(t1 - t)
        out["read_s"].append(time.monotonic() - t1)
        out["times"].append(t1)
        out["views"] += not x.untyped_storage().resizable()  # a mapping of the slot, not a copy
        out["batches"] += 1
        yield ids
        t = time.monotonic()


def _wait_file(path: str | None) -> None:
    while path and not os.path.exists(path):
        time.sleep(0.001)


def command(args, spec: dict) -> list[str]:
    """The command of one trial of ``spec``: ``batch`` and optionally ``stage_batch``, ``sleep``, ``epochs``
    and those of ``SPEC`` (the group, and the files a trial waits for or writes)."""
    kw = {"data": args.data, "images": args.images, "batch_size": spec["batch"]}
    kw |= {"epochs": spec.get("epochs", args.epochs), "sleep_per_batch": spec.get("sleep")}
    kw |= {"stage_batch": spec.get("stage_batch"), **{k: spec.get(k) for k in SPEC}}
    return jobs.scenario_command("hp_group", *jobs.flags(trial=True, **kw))


def launch(args, workdir: Path, specs: list[dict], before_go=None) -> list[dict]:
    """Runs trials of ``specs`` together (:func:`command`); returns what each wrote."""
    return jobs.run_together([command(args, s) for s in specs], workdir, before_go)


def rate(out: dict) -> float:
    """Samples/s of a trial over its epochs after the first (pipeline build, joining)."""
    steady = out["epochs"][1:]
    return sum(e["samples"] for e in steady) / sum(e["seconds"] for e in steady)


def summary(outs: list[dict]) -> dict:
    """Trials run together: per-trial samples/s, whether every epoch was exactly once, the medians of
    ``next()`` and of the first read; for the machine per epoch, batches decoded (a member's ``produced``,
    whichever epoch it was counted in) and CPU seconds; the staging memory's peak after the first epoch."""
    n, every = len(outs[0]["epochs"]), [e for o in outs for e in o["epochs"]]
    out = {"per_job_samples_per_s": [rate(o) for o in outs], "exactly_once": all(e["exactly_once"] for e in every)}
    out |= {f"{k}_ms_median": [1000 * statistics.median(o[f"{k}_s"]) for o in outs] for k in ("take", "read")}
    decoded = sum(e["produced"] if o["group"] else e["batches"] for o in outs for e in o["epochs"])
    out["batches_decoded_per_epoch"] = decoded / n
    out["cpu_s_per_epoch"] = sum(o["cpu_s"] for o in outs) / n
    out["staging_peak_bytes"] = max(e["staging_peak_bytes"] or 0 for o in outs for e in o["epochs"][1:])
    return out | {"epochs": [o["epochs"] for o in outs]}


def compare(args, workdir: Path, modes: dict[str, list[dict]]) -> dict:
    """Runs each mode's trials ``--reps`` times, the modes ABBA; per mode its runs' :func:`summary`."""
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    for r, m in measure.alternate(list(modes), args.reps):
        runs[m].append(s := summary(launch(args, workdir, modes[m])))
        print(f"  rep {r + 1} {m:>8}: per job {[round(x) for x in s['per_job_samples_per_s']]} samples/s")
    return runs


def ratios(runs: dict, a: str = "alone", b: str = "group") -> list[float]:
    """Per rep, the mean per-trial rate of mode ``b`` over mode ``a``'s."""
    mean = statistics.mean
    return [mean(y["per_job_samples_per_s"]) / mean(x["per_job_samples_per_s"]) for x, y in zip(runs[a], runs[b])]
