"""Coordinated prep: N jobs sharing an ``hp_group`` vs the same N jobs each loading alone.

All jobs run at the same time on this machine over the same ImageNet-like dataset,
with the MinIO cache warm (it holds the whole dataset), the standard training recipe
(random resized crop to 224, flip, normalise) and batch 64: a prep-bound setting,
since decoding is the bottleneck. Each job only reads its batches (``x.sum()``).

Reported per N: per-job samples/s in both modes and their ratio (target: at least
0.8 x N), batches decoded per epoch for the whole machine, bytes read from the block
device in a cold first epoch (page cache dropped, MinIO cache empty), staging memory
peak, and the time survivors lose when one member is killed with SIGKILL mid-epoch.

    python -m benchmarks.hp_group --data /var/tmp/coordl-bench/train --images 2000
"""

from __future__ import annotations

import argparse
import json
import resource
import signal
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import common
from coordl.units import format_bytes

HERE = Path(__file__).resolve().parent


def job(args) -> None:
    """One training job: waits for the go file, runs its epochs, writes what it saw."""
    import coordl

    kw = {"hp_group": args.group} if args.group else {}
    out = {"epochs": [], "times": []}
    with coordl.CoordLoader(
        args.data,
        batch_size=args.batch_size,
        shuffle=True,
        pipeline="imagenet-train",
        device_id=None,
        **kw,
        cache=coordl.Cache(size=1.0, keep=True),
    ) as loader:
        common.wait_for_go(args.ready, args.go)
        for epoch in range(args.epochs):
            loader.set_epoch(epoch)
            t0 = time.perf_counter()
            n = 0
            for x, _ in loader:
                x.sum()
                n += len(x)
                out["times"].append(time.monotonic())
                if args.progress:
                    Path(args.progress).write_text(str(len(out["times"])))
            s = loader.stats()
            out["epochs"].append(
                {
                    "seconds": time.perf_counter() - t0,
                    "samples": n,
                    **{
                        k: s.get(k)
                        for k in (
                            "produced",
                            "consumed_shared",
                            "storage_bytes",
                            "staging_peak_bytes",
                            "staging_bound",
                            "order_epoch",
                            "hp_members",
                        )
                    },
                }
            )
    ru = resource.getrusage(resource.RUSAGE_SELF)
    out["cpu_s"] = {"user": ru.ru_utime, "sys": ru.ru_stime}
    Path(args.out).write_text(json.dumps(out))


def launch(
    args,
    n: int,
    group: str | None,
    workdir: Path,
    epochs: int,
    kill_one: bool = False,
    dev: tuple[int, int] | None = None,
) -> dict:
    """Starts ``n`` jobs, lets them go together once all are ready; with ``dev``, drops the page
    cache just before and counts the bytes the device delivers while they run."""
    go = workdir / "go"
    go.unlink(missing_ok=True)
    commands, outs = [], []
    for k in range(n):
        out, ready = common.job_files(workdir, k)
        cmd = common.module_command(
            "hp_group",
            "--job",
            "--data",
            args.data,
            "--batch-size",
            str(args.batch_size),
            "--epochs",
            str(epochs),
            "--ready",
            str(ready),
            "--go",
            str(go),
            "--out",
            str(out),
        )
        if group:
            cmd += ["--group", group]
        if kill_one and k == 0:
            cmd += ["--progress", str(workdir / "progress0")]
        commands.append(cmd)
        outs.append((out, ready))
    cold = {}

    def drop_the_dataset():  # the dataset leaves the page cache (the jobs' libraries stay in it)
        cold["why"] = evict(args.data)
        cold["before"] = common.sectors_read(dev)

    procs = common.start_together(commands, [r for _, r in outs], go, drop_the_dataset if dev is not None else None)
    why, before = cold.get("why"), cold.get("before")
    killed_at = None
    if kill_one:
        nb = -(-args.images // args.batch_size)
        progress = workdir / "progress0"
        while True:  # kill job 0 in the middle of its second epoch
            try:
                done = int(progress.read_text() or 0)
            except (FileNotFoundError, ValueError):
                done = 0
            if done >= nb + nb // 2:
                break
            time.sleep(0.01)
        killed_at = time.monotonic()
        procs[0].send_signal(signal.SIGKILL)
    for p in procs:
        p.wait()
    jobs = []
    for k, (out, _) in enumerate(outs):
        if kill_one and k == 0:
            continue
        if procs[k].returncode != 0:
            raise SystemExit(f"job {k} failed with exit code {procs[k].returncode}")
        jobs.append(json.loads(out.read_text()))
    device_bytes = common.sectors_read(dev) - before if dev is not None else None
    return {"jobs": jobs, "killed_at": killed_at, "device_bytes": device_bytes, "drop_caches": why or "ok"}


def evict(root: str) -> str | None:
    """Drops the dataset's files from the page cache (``POSIX_FADV_DONTNEED``); None if it worked."""
    common.evict(root)
    return None


def per_job_rate(run: dict) -> list[float]:
    """Samples/s of each job over its epochs after the first (pipeline build, joining)."""
    rates = []
    for j in run["jobs"]:
        steady = j["epochs"][1:]
        rates.append(sum(e["samples"] for e in steady) / sum(e["seconds"] for e in steady))
    return rates


def main() -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.hp_group", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--job", action="store_true", help=argparse.SUPPRESS)
    for a in ("--group", "--ready", "--go", "--out", "--progress"):
        p.add_argument(a, help=argparse.SUPPRESS)
    common.add_dataset_options(p, data="/var/tmp/coordl-bench/train")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--jobs", default="2,4")
    p.add_argument("--result", default=str(HERE / "results" / "hp_group.json"))
    args = p.parse_args()
    if args.job:
        job(args)
        return 0

    from coordl.shm import reaper

    dataset = common.dataset_from_args(args)
    args.images = dataset["files"]
    dev = common.device_of(args.data)
    nb = -(-args.images // args.batch_size)
    print(f"dataset: {common.describe(dataset)}; {nb} batches of {args.batch_size} per epoch")
    workdir = Path(tempfile.mkdtemp(prefix="coordl-hp-bench-"))
    results = {"machine": common.machine(), "dataset": dataset, "batch_size": args.batch_size, "rows": []}
    try:
        for n in [int(x) for x in args.jobs.split(",")]:
            row = {"jobs": n}
            for mode in ("alone", "coordinated"):
                reaper.reap(include_kept=True)  # a cold start: no MinIO cache (and no page cache)
                cold = launch(args, n, None if mode == "alone" else f"bench{n}", workdir, 1, dev=dev)
                cold_bytes = cold["device_bytes"]
                run = launch(args, n, None if mode == "alone" else f"bench{n}", workdir, args.epochs)
                rates = per_job_rate(run)
                steady = [e for j in run["jobs"] for e in j["epochs"][1:]]
                every = [e for j in run["jobs"] for e in j["epochs"]]
                # Every batch a member decoded, whichever epoch it was counted in, per epoch run.
                decoded = sum(e["produced"] for e in every) / args.epochs if mode == "coordinated" else n * nb
                row[mode] = {
                    "per_job_samples_per_s": rates,
                    "mean_per_job_samples_per_s": sum(rates) / len(rates),
                    "cold_epoch_device_bytes": cold_bytes,
                    "cold_epoch_stats_storage_bytes": sum(
                        e["storage_bytes"] for j in cold["jobs"] for e in j["epochs"]
                    ),
                    "batches_decoded_per_epoch": decoded,
                    "staging_peak_bytes": max((e["staging_peak_bytes"] or 0) for e in steady),
                    "staging_bound": max((e["staging_bound"] or 0) for e in steady),
                    "page_cache": "dataset evicted with POSIX_FADV_DONTNEED before the cold epoch",
                    "jobs": [j["epochs"] for j in run["jobs"]],
                    "cpu_s_per_epoch": sum(j["cpu_s"]["user"] + j["cpu_s"]["sys"] for j in run["jobs"]) / args.epochs,
                }
                print(
                    f"N={n} {mode:>11}: per job {[round(r) for r in rates]} samples/s, cold epoch read "
                    f"{format_bytes(cold_bytes, 'MB')} from the device, {row[mode]['batches_decoded_per_epoch']:.0f} "
                    f"batches decoded per epoch, {row[mode]['cpu_s_per_epoch']:.1f} CPU-s per epoch"
                )
            row["ratio"] = row["coordinated"]["mean_per_job_samples_per_s"] / row["alone"]["mean_per_job_samples_per_s"]
            print(f"N={n}: coordinated / alone per-job throughput = {row['ratio']:.2f} (target >= {0.8 * n:.1f})")
            results["rows"].append(row)
        # Recovery: 3 members, one killed with SIGKILL in the middle of its second epoch.
        run = launch(args, 3, "bench-kill", workdir, args.epochs, kill_one=True)
        gaps = []
        for j in run["jobs"]:
            t = j["times"]
            before = [b - a for a, b in zip(t, t[1:], strict=False) if b < run["killed_at"]]
            after = [
                b - a for a, b in zip(t, t[1:], strict=False) if a >= run["killed_at"] - 1 and b >= run["killed_at"]
            ]
            typical = sorted(before)[len(before) // 2]
            gaps.append({"typical_gap_s": typical, "max_gap_after_kill_s": max(after), "lost_s": max(after) - typical})
        results["recovery"] = gaps
        print(
            f"kill -9 of one of 3 members: survivors' longest wait for a batch after the kill "
            f"{[round(g['max_gap_after_kill_s'], 3) for g in gaps]} s (typical "
            f"{[round(g['typical_gap_s'], 3) for g in gaps]} s)"
        )
    finally:
        reaper.reap(include_kept=True)
    Path(args.result).parent.mkdir(parents=True, exist_ok=True)
    Path(args.result).write_text(json.dumps(results, indent=1))
    print(f"wrote {args.result}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
