"""coordl's torch backend vs DataLoader, the same Python per sample, everything in memory: warm throughput.

    python -m benchmarks torch_backend
    python -m benchmarks torch_backend --quick              # tiny dataset, one rep (tests)

``torch`` (files opened by path) and ``coordl-torch`` (bytes from coordl's cache), Pillow and
``loaders.TrainAugment`` in ``--workers`` workers, and the DALI path ``coordl``, in this process: a warm-up epoch
each, then ``--reps`` epochs each ABBA; median samples/s, coordl-torch / torch (target >= 0.95). The same loaders
with short memory and slow storage are ``run``'s (benchmarks/README.md gives both commands and the method).
"""

from __future__ import annotations

import statistics

from benchmarks import loaders
from benchmarks.harness import cli, dataset, measure, report
from benchmarks.harness.report import log, mb
from coordl.units import parse_bytes

OUT = None  # results/torch_backend.json, or torch_backend_quick.json with --quick
WARM = ("coordl-torch", "coordl", "torch")  # coordl-torch first: it drops the page cache of what it reads
TARGET_RATIO = 0.95
DATA, QUICK_DATA = "/var/tmp/coordl-bench/bench", "/var/tmp/coordl-bench/quick"  # run.py's dataset; --quick's


def warm(args, data: dict, dev: tuple[int, int]) -> dict:
    """A warm-up epoch of every loader, then ``--reps`` epochs each, ABBA, in this process."""
    total, files, made = data["total_bytes"], data["files"], {}
    try:
        for name in WARM:
            made[name] = loaders.Loader(name, args.data, args.batch_size, args.workers, 0, cache_bytes=total)
        warmup = {name: loaders.epoch_row(made[name].batches(), dev) for name in WARM}
        if (held := made["coordl-torch"].counters()["cache_items"]) != files:
            raise RuntimeError(f"coordl's cache holds {held} of {files} samples: free /dev/shm (`coordl cache ls`)")
        epochs = []
        for rep, name in measure.alternate(list(WARM), args.reps):
            epochs.append(row := {"rep": rep, "loader": name, **loaders.epoch_row(made[name].batches(), dev)})
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


def table(result: dict) -> str:
    w, rows = result["warm"], []
    for name, median in w["median_samples_per_s"].items():
        es = [e for e in w["epochs"] if e["loader"] == name]
        rates = ", ".join(f"{e['samples_per_s']:.0f}" for e in es)
        rows.append([name, median, rates, mb(max(e["device_bytes"] for e in es))])
    ratio = f"**coordl-torch / torch: {w['ratio_coordl_torch_over_torch']:.3f}** (target >= {w['target_ratio']})"
    return report.table("loader|median samples/s|samples/s per epoch|device MB per epoch (max)", rows) + f"\n\n{ratio}"


def options(p) -> None:
    root = f"dataset root (default: {DATA}, 500MB, 100 classes; with --quick, {QUICK_DATA}, 64 images, 4)"
    dataset.add_dataset_options(p, data=None, images=None, size=None, classes=None, data_help=root)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--workers", type=int, default=2, help="DataLoader worker processes per loader")
    p.add_argument("--reps", type=int, help="timed epochs per loader (default 4; --quick: 1)")
    p.add_argument("--quick", action="store_true", help="a tiny run for the tests: small defaults, one rep")


def run(args) -> dict:
    q, out = args.quick, str(cli.RESULTS / f"torch_backend{'_quick' if args.quick else ''}.json")
    cli.defaults(args, q, data=(DATA, QUICK_DATA), classes=(100, 4), reps=(4, 1), out=(out, out))
    if args.images is None and args.size is None:
        args.images, args.size = (64, None) if q else (None, parse_bytes("500MB"))
    data, dev = dataset.dataset_from_args(args), measure.device_of(args.data)
    log(f"dataset: {dataset.describe(data)}; device {dev[0]}:{dev[1]}")
    return {"dataset": data, "warm": warm(args, data, dev)}
