"""What the always-on accounting costs, per batch and as a share of the loader's throughput.

The accounting adds, per batch: two reads of the fetch-wait clock and a ``StepWaits.record``
in the consumer, an enter/leave of the DALI-wait clock in the driver; per storage read,
two ``perf_counter_ns`` calls; per wait for a read, an enter/leave. This times exactly those
calls (the same objects the loader uses), then a warm loader's batch, and reports the ratio.

    python -m benchmarks accounting_overhead [--data /var/tmp/coordl-bench/train]
"""

from __future__ import annotations

import statistics
import time

import coordl
from benchmarks.harness import dataset
from coordl.accounting import BusyClock, StepWaits


def per_batch_cost(batch_size: int, miss_fraction: float, n: int = 200_000) -> float:
    """Seconds of accounting per batch: the consumer's and driver's calls, and the per-read ones."""
    fetching, dali, waits = BusyClock(), BusyClock(), StepWaits()
    reads = round(batch_size * miss_fraction)
    t0 = time.perf_counter()
    for _ in range(n):
        f0, c0 = fetching.total(), time.perf_counter()  # consumer, before the wait
        dali.enter()  # driver, around DALI's outputs
        dali.leave()
        fetching.enter()  # driver, one wait for a read per batch
        fetching.leave()
        wait = time.perf_counter() - c0
        waits.record(wait, fetch=fetching.total() - f0)
    batch = (time.perf_counter() - t0) / n
    t0 = time.perf_counter()
    for _ in range(n):
        a = time.perf_counter_ns()
        _ = time.perf_counter_ns() - a
    read = (time.perf_counter() - t0) / n
    return batch + reads * read


def loader_batch_time(root: str, batch_size: int, epochs: int) -> float:
    """Seconds per batch of a warm CoordLoader (everything cached), median over epochs."""
    times = []
    with coordl.CoordLoader(
        root, batch_size=batch_size, device_id=None, cache=1.0, shuffle=True, pipeline="imagenet-train"
    ) as loader:
        for epoch in range(epochs):
            loader.set_epoch(epoch)
            for _ in loader:
                pass
            s = loader.stats()
            if epoch:
                times.append(s["elapsed_s"] / s["batches"])
    return statistics.median(times)


def options(p) -> None:
    dataset.add_dataset_options(p, data="/var/tmp/coordl-bench/train")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--epochs", type=int, default=3)


def run(args) -> dict | None:
    data = dataset.dataset_from_args(args)
    cost_hit = per_batch_cost(args.batch_size, 0.0)
    cost_miss = per_batch_cost(args.batch_size, 1.0)
    batch = loader_batch_time(data["root"], args.batch_size, args.epochs)
    result = {
        "batch_size": args.batch_size,
        "accounting_per_batch_s": {"all_cached": cost_hit, "all_from_storage": cost_miss},
        "loader_batch_s": batch,
        "overhead_fraction": {"all_cached": cost_hit / batch, "all_from_storage": cost_miss / batch},
    }
    return {**result, "dataset": data}


def table(r: dict) -> str:
    hit, miss, batch, n = *r["accounting_per_batch_s"].values(), r["loader_batch_s"], r["batch_size"]
    return (
        f"accounting per batch of {n}: {1e6 * hit:.1f} us (all cached), {1e6 * miss:.1f} us (all from storage)\n"
        f"warm loader batch: {1e3 * batch:.1f} ms ({n / batch:.0f} samples/s)\n"
        f"overhead: {100 * hit / batch:.4f}% (cached), {100 * miss / batch:.4f}% (storage); target < 1%"
    )
