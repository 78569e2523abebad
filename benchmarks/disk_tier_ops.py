"""What the local tier's own work costs per entry: a write epoch and a read epoch through ``DiskTier``.

Entries put into a fresh tier under ``--root`` (reservation, write, ``fdatasync``, ledger, link), then
read back shuffled (open, ``fstat`` check, ``readv``, pages dropped, CRC-32): process CPU and wall time
per entry, a fresh process per run. On a tmpfs the figures are the code's own.

    python -m benchmarks disk_tier_ops --root /dev/shm
"""

import os
import tempfile
import time

import numpy as np

from benchmarks.harness import measure, report
from benchmarks.indexing import fresh

KEYS = ("write_us", "write_wall_us", "read_us", "read_wall_us")


def one(root: str, entries: int, size: int) -> dict:
    """One write epoch and one read epoch in this process."""
    from coordl.fetch import disk

    rng, out = np.random.default_rng(0), {}

    def per_entry(cpu: float, t: float) -> tuple[float, float]:  # CPU and wall microseconds an entry
        cpu = measure.process_cpu_seconds(os.getpid()) - cpu
        return cpu / entries * 1e6, (time.perf_counter() - t) / entries * 1e6

    with tempfile.TemporaryDirectory(prefix="coordl-bench-disk-ops-", dir=root) as base:
        tier = disk.DiskTier(disk.tier_folder(base))
        data = [rng.integers(0, 256, size, np.uint8) for _ in range(entries)]
        names = [f"s3://bucket/train/{k:07d}.jpg" for k in range(entries)]
        stamps = [disk.stamp(n, size, "etag") for n in names]
        c, t = measure.process_cpu_seconds(os.getpid()), time.perf_counter()
        for k in range(0, entries, 64):
            tier.put(names[k : k + 64], stamps[k : k + 64], data[k : k + 64])
        if not tier.flush(600) or tier.written != entries:
            raise SystemExit(f"the tier wrote {tier.written} of {entries} entries")
        out["write_us"], out["write_wall_us"] = per_entry(c, t)
        order, into = rng.permutation(entries), [np.empty(size, np.uint8) for _ in range(entries)]
        c, t = measure.process_cpu_seconds(os.getpid()), time.perf_counter()
        for ids in (order[k : k + 64].tolist() for k in range(0, entries, 64)):
            got = tier.read_into(
                [names[i] for i in ids], [stamps[i] for i in ids], [size] * len(ids), [[into[i]] for i in ids]
            )
            if not np.all(np.asarray(got) == 1):  # GOOD: read whole and checked
                raise SystemExit(f"the tier read back {got}")
        out["read_us"], out["read_wall_us"] = per_entry(c, t)
        tier.close()
    return out


def options(p) -> None:
    p.add_argument("--root", default="/dev/shm", help="where the tiers go (default /dev/shm: the code's cost alone)")
    p.add_argument("--entries", type=int, default=5000)
    p.add_argument("--size", type=int, default=4000, help="bytes per sample (default 4000)")
    p.add_argument("--rounds", type=int, default=5)


def run(args) -> dict:
    runs = [fresh({"how": f"{__name__}:one", "args": [args.root, args.entries, args.size]}) for _ in range(args.rounds)]
    return {"runs": runs, "medians": measure.medians({"now": runs}, KEYS)}  # each run in a fresh process


def table(r: dict) -> str:
    rows = [[w, *(m[k] for k in KEYS)] for w, m in r["medians"].items()]
    return report.table("tier|write us CPU/entry|write us wall/entry|read us CPU/entry|read us wall/entry", rows)
