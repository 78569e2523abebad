"""What the local tier's own work costs per entry: a write epoch and a read epoch through ``DiskTier``.

Puts ``--entries`` samples of ``--size`` bytes into a fresh tier under ``--root`` (the writer thread:
reservation, write, ``fdatasync``, ledger, link), flushes, then reads them back in a shuffled order
(open, ``fstat`` check, ``readv``, drop the pages, CRC-32), and reports the process's CPU time (user +
system) and the wall time per entry. On a tmpfs (``/dev/shm``) the disk costs next to nothing, so
the figures are the code's own: the ownership checks and the block accounting among it. ``--before
PATH`` times another version of the tier's module too (a file holding ``DiskTier``, ``tier_folder``
and ``stamp``, e.g. the one before the checks: ``git show 7eab09f:src/coordl/fetch/disk.py >
/tmp/disk_before.py``), alternating the two, ``--rounds`` times each, a fresh process per run.

    python -m benchmarks disk_tier_ops --root /dev/shm --before /tmp/disk_before.py
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np

from benchmarks.harness import jobs, measure


def one(module: str | None, root: str, entries: int, size: int) -> dict:
    """One write epoch and one read epoch in this process; ``module``: a file to take the tier from."""
    if module:
        spec = importlib.util.spec_from_file_location("disk_before", module)
        disk = importlib.util.module_from_spec(spec)
        sys.modules["disk_before"] = disk
        spec.loader.exec_module(disk)
    else:
        from coordl.fetch import disk
    base = tempfile.mkdtemp(prefix="coordl-bench-disk-ops-", dir=root)
    try:
        tier = disk.DiskTier(disk.tier_folder(base))
        rng = np.random.default_rng(0)
        data = [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(entries)]
        names = [f"s3://bucket/train/{k:07d}.jpg" for k in range(entries)]
        stamps = [disk.stamp(n, size, "etag") for n in names]
        out = {}
        t, c = time.perf_counter(), _cpu()
        for k in range(0, entries, 64):
            tier.put(names[k : k + 64], stamps[k : k + 64], data[k : k + 64])
        assert tier.flush(600) and tier.written == entries
        out["write_us"], out["write_wall_us"] = (_cpu() - c) / entries * 1e6, (time.perf_counter() - t) / entries * 1e6
        order = rng.permutation(entries)
        into = [np.empty(size, np.uint8) for _ in range(entries)]
        t, c = time.perf_counter(), _cpu()
        for k in range(0, entries, 64):
            ids = order[k : k + 64].tolist()
            got = tier.read_into(
                [names[i] for i in ids], [stamps[i] for i in ids], [size] * len(ids), [[into[i]] for i in ids]
            )
            assert np.all(np.asarray(got) == 1)  # GOOD (True in the version before the checks)
        out["read_us"], out["read_wall_us"] = (_cpu() - c) / entries * 1e6, (time.perf_counter() - t) / entries * 1e6
        tier.close()
        return out
    finally:
        shutil.rmtree(base)


def _cpu() -> float:
    t = os.times()
    return t.user + t.system


def options(p) -> None:
    p.add_argument("--root", default="/dev/shm", help="where the tiers go (default /dev/shm: the code's cost alone)")
    p.add_argument("--entries", type=int, default=5000)
    p.add_argument("--size", type=int, default=4000, help="bytes per sample (default 4000)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--before", help="a file holding another version of the tier's module, timed alternately")
    p.add_argument("--one", nargs="?", const="", default=None, help=argparse.SUPPRESS)  # a child: one run


def run(args) -> dict | None:
    if args.one is not None:
        return jobs.say(**one(args.one or None, args.root, args.entries, args.size))
    runs: dict[str, list[dict]] = {"now": [], "before": []}
    for _, which in measure.alternate(["before", "now"] if args.before else ["now"], args.rounds):
        extra = ["--one", args.before] if which == "before" else ["--one"]
        child = ["--root", args.root, "--entries", str(args.entries), "--size", str(args.size), *extra]
        runs[which].append(jobs.run_json(jobs.scenario_command("disk_tier_ops", *child)))
    medians = {w: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for w, rs in runs.items() if rs}
    return {"runs": runs, "medians": medians}


def table(r: dict) -> str:
    return "\n".join(
        f"{which:>6}: write {m['write_us']:.0f} us CPU/entry ({m['write_wall_us']:.0f} wall), "
        f"read {m['read_us']:.1f} us CPU/entry ({m['read_wall_us']:.1f} wall)"
        for which, m in r["medians"].items()
    )
