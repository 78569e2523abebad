"""coordl's torch backend vs DataLoader, the same Python per sample: warm throughput, and short memory and slow storage.

Both loaders (:mod:`benchmarks.loaders`) run Pillow and ``loaders.TrainAugment`` in ``--workers`` workers;
``torch`` opens each file by path, ``coordl-torch`` (``CoordLoader`` over ``coordl.datasets.ImageFolder``)
gets the bytes from coordl's cache or storage. ``warm``: every byte in memory, the loaders (and the DALI
path, ``coordl``) in this process, a warm-up epoch each then ``--reps`` epochs each ABBA: median samples/s,
coordl-torch / torch (target >= 0.95). ``limited``: ``python -m benchmarks run --loaders torch,coordl-torch``
at ``--cache`` and ``--bandwidth`` (into ``torch_backend_run/``): per epoch seconds, device and ``stats()``
bytes against the minimum (dataset less what is cached), torch / coordl-torch of the steady epoch times.

    python -m benchmarks torch_backend                      # both parts, ~6 min; --part warm or limited
    python -m benchmarks torch_backend --quick              # tiny dataset, few epochs, no memory limit (tests)
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import loaders
from benchmarks.harness import cli, dataset, jobs, measure, report, results
from benchmarks.harness.report import log, mb
from coordl.units import format_bytes, parse_bytes

OUT = None  # results/torch_backend.json, or torch_backend_quick.json with --quick
WARM = ("coordl-torch", "coordl", "torch")  # coordl-torch first: it drops the page cache of what it reads
TARGET_RATIO = 0.95
DATA, QUICK_DATA = "/var/tmp/coordl-bench/bench", "/var/tmp/coordl-bench/quick"  # run.py's dataset; --quick's


def time_epoch(loader, dev: tuple[int, int]) -> dict:
    """One whole epoch of ``loader``: seconds, samples, samples/s, bytes the device delivered."""
    before, t0 = measure.sectors_read(dev), time.perf_counter()
    samples = sum(images.shape[0] for images in loader.epoch())
    seconds = time.perf_counter() - t0
    row = {"seconds": round(seconds, 3), "samples": samples, "samples_per_s": round(samples / seconds, 1)}
    return row | {"device_bytes": measure.sectors_read(dev) - before}


def warm(args, data: dict, dev: tuple[int, int]) -> dict:
    """A warm-up epoch of every loader, then ``--reps`` epochs each, ABBA, in this process."""
    total, files, made = data["total_bytes"], data["files"], {}
    try:
        for name in WARM:
            made[name] = loaders.Loader(name, args.data, args.batch_size, args.workers, args.seed, cache_bytes=total)
        warmup = {name: time_epoch(made[name], dev) for name in WARM}
        if (held := made["coordl-torch"].counters()["cache_items"]) != files:
            raise RuntimeError(f"coordl's cache holds {held} of {files} samples: free /dev/shm (`coordl cache ls`)")
        epochs = []
        for rep, name in measure.alternate(list(WARM), args.reps):
            epochs.append(row := {"rep": rep, "loader": name, **time_epoch(made[name], dev)})
            if row["samples"] != files:
                raise RuntimeError(f"{name} delivered {row['samples']} samples in an epoch of {files}")
            if (counters := made[name].counters()) is not None:
                row["counters"] = counters
            log(f"[warm] rep {rep} {name:12s} {row['samples_per_s']:8.1f} samples/s  device {mb(row['device_bytes'])}")
    finally:
        for loader in made.values():
            loader.close()
    median = {name: statistics.median(e["samples_per_s"] for e in epochs if e["loader"] == name) for name in WARM}
    out = {"cache_bytes": total, "reps": args.reps, "warmup": warmup, "epochs": epochs, "median_samples_per_s": median}
    ratio = round(median["coordl-torch"] / median["torch"], 4)
    return out | {"ratio_coordl_torch_over_torch": ratio, "target_ratio": TARGET_RATIO}


def limited(args) -> dict:
    """run.py's ``fits`` scenario and one limited scenario for torch and coordl-torch, per epoch."""
    out = Path(args.out).with_name(Path(args.out).stem + "_run")  # run.py's own results, beside ours
    kw = {"cache": args.cache, "bandwidth": args.bandwidth, "epochs": args.epochs, "batch_size": args.batch_size}
    kw |= {"workers": args.workers, "fit_epochs": 2 if args.quick else 3, "warmup_batches": 1 if args.quick else 3}
    # --quick: no memory limit (a tiny dataset is smaller than a loader's memory swings: any budget ends in OOM)
    options = jobs.flags(loaders="torch,coordl-torch", **kw, seed=args.seed, out=out, no_memory_limit=args.quick)
    cmd = jobs.scenario_command("run", *dataset.dataset_argv(args), *options)
    log(f"[limited] {' '.join(cmd)}")
    if status := subprocess.run(cmd, stdout=sys.stderr, check=False).returncode:  # run.py's report: progress
        raise RuntimeError(f"run.py exited with status {status}; its children's logs are in {out / 'logs'}")
    whole = json.loads((out / "results.json").read_text())
    res, total = whole["results"], whole["dataset"]["total_bytes"]
    cell = next(c for c in res["scenarios"] if c["name"] != "fits")
    part = {"scenario": cell["name"], "cache_fraction": cell["cache"], "bandwidth_bps": cell["bandwidth_bps"]}
    part |= {"prep_rate_samples_per_s": res.get("prep_rate_samples_per_s"), "limits": res["limits"]}
    fits = {r["loader"]: r["steady"]["samples_per_s"] for r in res["runs"] if r["scenario"] == "fits" and "steady" in r}
    part |= {"run_results": str(out / "results.json"), "fits_samples_per_s": fits, "loaders": {}}
    for r in (r for r in res["runs"] if r["scenario"] == cell["name"]):
        entry = {key: r.get(key) for key in ("cache_bytes", "memory_limit_bytes", "working_set_bytes", "error")}
        entry["epochs"] = [epoch_row(e, total, r["cache_bytes"]) for e in r["epochs"]]
        if steady := entry["epochs"][1:]:
            entry["steady_seconds"] = statistics.median(e["seconds"] for e in steady)
        part["loaders"][r["loader"]] = entry
    secs = [part["loaders"].get(name, {}).get("steady_seconds") for name in ("torch", "coordl-torch")]
    return part | ({"ratio_torch_over_coordl_torch": round(secs[0] / secs[1], 4)} if all(secs) else {})


def epoch_row(e: dict, total: int, cache_bytes: int) -> dict:
    """One epoch of a run.py run with the minimum bytes it had to read (the dataset less coordl's resident
    cache, or less the memory granted to a page-cache loader) and the ratios to it. The cold epoch 0 has
    none: its warm-up batches, and those the workers fetched ahead, were read before it was timed."""
    c = e.get("counters")
    row = {k: e[k] for k in ("epoch", "seconds", "samples_per_s", "device_bytes", "wait_s", "peak_memory_bytes")}
    row |= {"storage_bytes": c["storage_bytes"] if c else None, "minimum_bytes": None}
    minimum = total - (c["cache_bytes"] if c else cache_bytes)
    if e["epoch"] > 0 and minimum > 0:
        row |= {"minimum_bytes": minimum, "device_over_min": round(e["device_bytes"] / minimum, 4)}
        if c:
            row["storage_over_min"] = round(c["storage_bytes"] / minimum, 4)
    return row


def table(result: dict) -> str:
    out = []
    if w := result.get("warm"):
        rows = []
        for name, median in w["median_samples_per_s"].items():
            es = [e for e in w["epochs"] if e["loader"] == name]
            rates = ", ".join(f"{e['samples_per_s']:.0f}" for e in es)
            rows.append([name, median, rates, mb(max(e["device_bytes"] for e in es))])
        out += [report.table("warm loader|median samples/s|samples/s per epoch|device MB per epoch (max)", rows)]
        out += [f"**coordl-torch / torch: {w['ratio_coordl_torch_over_torch']:.3f}** (target >= {w['target_ratio']})"]
    if lim := result.get("limited"):
        storage = format_bytes(lim["bandwidth_bps"], "MB") + "/s" if lim["bandwidth_bps"] else "unthrottled"
        out += [f"Limited: cache {lim['cache_fraction']:.0%}, storage {storage}; epoch 0 cold, without a minimum."]
        out += [f"**NOTE:** {n}" for n in lim["limits"]["notes"]]
        rows = []
        for name, entry in lim["loaders"].items():
            rows += [[name, f"failed: {entry['error']}"]] if entry["error"] else []
            for e in entry["epochs"]:
                rows.append([name, mb(entry["memory_limit_bytes"] or None, 0), e["epoch"], e["seconds"]])
                rows[-1] += [e["samples_per_s"], mb(e["device_bytes"]), mb(e["storage_bytes"]), mb(e["minimum_bytes"])]
                rows[-1] += [e.get("device_over_min"), e.get("storage_over_min")]
        head = "loader|memory limit MB|epoch|s|samples/s|device MB|stats MB|minimum MB|device/min|stats/min"
        out += [report.table(head, rows)]
        if "ratio_torch_over_coordl_torch" in lim:
            out += [f"**steady epoch time torch / coordl-torch: {lim['ratio_torch_over_coordl_torch']:.3f}**"]
    return "\n\n".join(out) + "\n"


def options(p) -> None:
    what = "what to measure; the JSON keeps the other part from an earlier run on the same dataset"
    p.add_argument("--part", choices=("both", "warm", "limited"), default="both", help=what)
    root = f"dataset root (default: {DATA}, 500MB, 100 classes; with --quick, {QUICK_DATA}, 64 images, 4)"
    dataset.add_dataset_options(p, data=None, images=None, size=None, classes=None, data_help=root)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--workers", type=int, default=2, help="DataLoader worker processes per loader")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--reps", type=int, help="warm: timed epochs per loader (default 4; --quick: 1)")
    p.add_argument("--cache", type=float, default=0.5, help="limited: cache fraction of the dataset")
    throttle = "limited: one storage throttle, '20MB' (per second) or a multiple of the prep rate, '0.5P'"
    p.add_argument("--bandwidth", default="0.5P", help=throttle)
    p.add_argument("--epochs", type=int, help="limited: epochs, the first cold (default 4; --quick: 2)")
    p.add_argument("--quick", action="store_true", help="a tiny run for the tests: small defaults, few epochs")


def run(args) -> dict:
    q, out = args.quick, str(cli.RESULTS / f"torch_backend{'_quick' if args.quick else ''}.json")
    cli.defaults(args, q, data=(DATA, QUICK_DATA), classes=(100, 4), reps=(4, 1), epochs=(4, 2), out=(out, out))
    if args.images is None and args.size is None:
        args.images, args.size = (64, None) if q else (None, parse_bytes("500MB"))
    if args.reps < 1 or args.epochs < 2 or "," in args.bandwidth or not 0 < args.cache < 1:
        raise SystemExit("--reps must be at least 1, --epochs 2, --bandwidth one throttle, --cache between 0 and 1")
    data, dev = dataset.dataset_from_args(args), measure.device_of(args.data)
    log(f"dataset: {dataset.describe(data)}; device {dev[0]}:{dev[1]}")
    parts = ("warm", "limited") if args.part == "both" else (args.part,)
    result = {"dataset": data, **results.kept(args.out, parts, data)}  # the other part of an earlier run
    if "warm" in parts:
        result["warm"] = warm(args, data, dev)
    if "limited" in parts:
        result["limited"] = limited(args)
    return result
