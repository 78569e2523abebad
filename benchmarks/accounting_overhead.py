"""What the always-on accounting costs, per batch and as a share of the loader's throughput.

Per batch the accounting reads the fetch-wait clock twice and records a ``StepWaits`` entry in the
consumer and enters and leaves the DALI-wait clock in the driver; per storage read, two
``perf_counter_ns`` calls; per wait for a read, an enter and leave. This times exactly those calls
(the loader's own objects), then a warm loader's batch (everything cached), and gives the ratio.

    python -m benchmarks accounting_overhead [--data /var/tmp/coordl-bench/train]
"""

import statistics
import time

import coordl
from benchmarks.harness import dataset, measure
from coordl.accounting import BusyClock, StepWaits


def per_batch_cost(batch_size: int, miss_fraction: float, n: int = 200_000) -> float:
    """Seconds of accounting per batch: the consumer's and driver's calls, and the per-read ones."""
    fetching, dali, waits = BusyClock(), BusyClock(), StepWaits()
    t0 = time.perf_counter()
    for _ in range(n):
        f0, c0 = fetching.total(), time.perf_counter()  # consumer, before the wait
        dali.enter()  # driver, around DALI's outputs
        dali.leave()
        fetching.enter()  # driver, one wait for a read per batch
        fetching.leave()
        waits.record(time.perf_counter() - c0, fetch=fetching.total() - f0)
    batch = (time.perf_counter() - t0) / n
    t0 = time.perf_counter()
    for _ in range(n):
        a = time.perf_counter_ns()
        _ = time.perf_counter_ns() - a
    return batch + round(batch_size * miss_fraction) * (time.perf_counter() - t0) / n


def options(p) -> None:
    dataset.add_dataset_options(p, data="/var/tmp/coordl-bench/train")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--epochs", type=int, default=3)


def run(args) -> dict | None:
    data = dataset.dataset_from_args(args)
    cost = {k: per_batch_cost(args.batch_size, f) for k, f in (("all_cached", 0.0), ("all_from_storage", 1.0))}
    kw = {"device_id": None, "cache": 1.0, "shuffle": True, "pipeline": "imagenet-train"}
    with coordl.CoordLoader(data["root"], batch_size=args.batch_size, **kw) as loader:  # epoch 0 fills the cache
        es = measure.epochs(loader, args.epochs - 1, warmup=1, keys=("elapsed_s", "batches"))
    batch = statistics.median(e["stats"]["elapsed_s"] / e["stats"]["batches"] for e in es if not e["warmup"])
    result = {"batch_size": args.batch_size, "accounting_per_batch_s": cost, "loader_batch_s": batch}
    return result | {"overhead_fraction": {k: c / batch for k, c in cost.items()}, "dataset": data}


def table(r: dict) -> str:
    (hit, miss), batch, n = r["accounting_per_batch_s"].values(), r["loader_batch_s"], r["batch_size"]
    return (
        f"accounting per batch of {n}: {1e6 * hit:.1f} us (all cached), {1e6 * miss:.1f} us (all from storage)\n"
        f"warm loader batch: {1e3 * batch:.1f} ms ({n / batch:.0f} samples/s)\n"
        f"overhead: {100 * hit / batch:.4f}% (cached), {100 * miss / batch:.4f}% (storage); target < 1%"
    )
