"""Coordinated prep: N jobs sharing an hp_group vs the same N jobs each loading alone.

N trials of :mod:`benchmarks.hp_trials` (batch 64) at once, the MinIO cache warm, prep-bound. Per N:
per-trial samples/s in both modes and their ratio (target: at least 0.8 x N), batches decoded per
epoch for the whole machine, bytes read from the block device in a cold first epoch (the dataset's
pages evicted, the MinIO cache empty), the staging memory's peak, CPU seconds per epoch; and the
time survivors lose when one of 3 members is killed with SIGKILL in the middle of its second epoch.

    python -m benchmarks hp_group --data /var/tmp/coordl-bench/train --images 2000    # ~5 min
"""

from __future__ import annotations

import json
import shutil
import signal
import tempfile
import time
from pathlib import Path

from benchmarks import hp_trials
from benchmarks.harness import jobs, limits, measure
from coordl.units import format_bytes

NAME = "hp_group"


def options(p) -> None:
    hp_trials.add_options(p)
    p.add_argument("--jobs", default="2,4")


def cold_epoch(args, n: int, group: str | None, workdir: Path, dev) -> dict:
    """One epoch of ``n`` trials, the dataset's pages evicted just before the go: the device's bytes."""
    cold = {}

    def evict():  # the dataset leaves the page cache (the trials' libraries stay in it)
        limits.evict(args.data)
        cold["before"] = measure.sectors_read(dev)

    specs = [{"batch": args.batch_size, "group": group, "epochs": 1}] * n
    trials = jobs.run_together([hp_trials.command(args, NAME, s) for s in specs], workdir, evict)
    return {
        "device_bytes": measure.sectors_read(dev) - cold["before"],
        "epochs": [e for t in trials for e in t["epochs"]],
    }


def recovery(args, workdir: Path) -> list[dict]:
    """3 members, one killed with SIGKILL in the middle of its second epoch: the survivors' longest
    wait for a batch after the kill, beside their typical one."""
    nb = -(-args.images // args.batch_size)
    progress = workdir / "progress0"
    progress.unlink(missing_ok=True)
    specs = [
        {"batch": args.batch_size, "group": "bench-kill", "progress": progress if k == 0 else None} for k in (0, 1, 2)
    ]
    procs, outs = jobs.start_jobs([hp_trials.command(args, NAME, s) for s in specs], workdir)
    while not progress.exists() or int(progress.read_text() or 0) < nb + nb // 2:
        time.sleep(0.01)
    killed_at = time.monotonic()
    procs[0].send_signal(signal.SIGKILL)
    codes = [p.wait() for p in procs]
    if any(codes[1:]):
        raise SystemExit(f"a surviving trial failed: exit codes {codes}")
    gaps = []
    for out in outs[1:]:
        t = json.loads(out.read_text())["times"]
        before = [b - a for a, b in zip(t, t[1:]) if b < killed_at]
        after = [b - a for a, b in zip(t, t[1:]) if a >= killed_at - 1 and b >= killed_at]
        if not before or not after:
            when = "after" if not before else "before"
            raise SystemExit(
                f"the survivors' batches all came {when} the kill: the dataset ({args.images} images, batch "
                f"{args.batch_size}) is too small to measure the recovery: give more --images"
            )
        typical = sorted(before)[len(before) // 2]
        gaps.append({"typical_gap_s": typical, "max_gap_after_kill_s": max(after), "lost_s": max(after) - typical})
    return gaps


def run(args) -> dict | None:
    if args.trial:
        return hp_trials.trial(args)
    from coordl.shm import reaper

    data, dev = hp_trials.images(args), measure.device_of(args.data)
    nb = -(-args.images // args.batch_size)
    print(f"{nb} batches of {args.batch_size} per epoch")
    workdir = Path(tempfile.mkdtemp(prefix="coordl-hp-bench-"))
    results = {"dataset": data, "batch_size": args.batch_size, "rows": []}
    try:
        for n in [int(x) for x in args.jobs.split(",")]:
            row = {"jobs": n}
            for mode in ("alone", "coordinated"):
                group = None if mode == "alone" else f"bench{n}"
                reaper.reap(include_kept=True)  # a cold start: no MinIO cache (and no page cache)
                cold = cold_epoch(args, n, group, workdir, dev)
                trials = hp_trials.launch(args, NAME, workdir, [{"batch": args.batch_size, "group": group}] * n)
                rates = [hp_trials.rate(t) for t in trials]
                steady = [e for t in trials for e in t["epochs"][1:]]
                every = [e for t in trials for e in t["epochs"]]
                # Every batch a member decoded, whichever epoch it was counted in, per epoch run.
                decoded = sum(e["produced"] for e in every) / args.epochs if group else n * nb
                row[mode] = {
                    "per_job_samples_per_s": rates,
                    "mean_per_job_samples_per_s": sum(rates) / len(rates),
                    "cold_epoch_device_bytes": cold["device_bytes"],
                    "cold_epoch_stats_storage_bytes": sum(e["storage_bytes"] for e in cold["epochs"]),
                    "batches_decoded_per_epoch": decoded,
                    "staging_peak_bytes": max((e["staging_peak_bytes"] or 0) for e in steady),
                    "staging_bound": max((e["staging_bound"] or 0) for e in steady),
                    "page_cache": "dataset evicted with POSIX_FADV_DONTNEED before the cold epoch",
                    "jobs": [t["epochs"] for t in trials],
                    "cpu_s_per_epoch": sum(t["cpu_s"]["user"] + t["cpu_s"]["sys"] for t in trials) / args.epochs,
                }
                print(
                    f"N={n} {mode:>11}: per job {[round(r) for r in rates]} samples/s, cold epoch read "
                    f"{format_bytes(cold['device_bytes'], 'MB')} from the device, {decoded:.0f} batches decoded "
                    f"per epoch, {row[mode]['cpu_s_per_epoch']:.1f} CPU-s per epoch"
                )
            row["ratio"] = row["coordinated"]["mean_per_job_samples_per_s"] / row["alone"]["mean_per_job_samples_per_s"]
            print(f"N={n}: coordinated / alone per-job throughput = {row['ratio']:.2f} (target >= {0.8 * n:.1f})")
            results["rows"].append(row)
        results["recovery"] = gaps = recovery(args, workdir)
        print(
            f"kill -9 of one of 3 members: survivors' longest wait for a batch after the kill "
            f"{[round(g['max_gap_after_kill_s'], 3) for g in gaps]} s (typical "
            f"{[round(g['typical_gap_s'], 3) for g in gaps]} s)"
        )
    finally:
        reaper.reap(include_kept=True)
        shutil.rmtree(workdir, ignore_errors=True)
    return results
