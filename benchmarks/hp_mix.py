"""HP groups without lockstep: trials of the same or different batch sizes, and a slow trial.

Every run starts its jobs together (each waits for a go file once its loader is made) over the
same ImageNet-like dataset, the MinIO cache warm, the standard training recipe at 224 on the CPU
(prep-bound: decoding is the bottleneck on this machine). A job reads each batch (``x.sum()``)
and sleeps ``--sleep`` seconds per batch (its training step); per-job samples/s is taken over
the epochs after the first. Runs of the compared modes alternate, ``--reps`` times each.

Scenarios (``--scenarios``):

- ``same``: N = 2 and 4 jobs of batch 64, alone (no ``hp_group``) vs in a group. Target: each
  job in the group at least 0.9 N x a job alone.
- ``mix``: three jobs of batch 16, 32 and 64, alone vs in a group (``HPGroup(stage_batch=64)``).
  Target: at least 0.85 N x, every epoch of every job exactly once.
- ``handoff``: what a batch costs a job to take once it is ready: one job in a group, training
  0.2 s per batch so that its producer is always ahead; the median time of ``next()`` and of the
  first read of the batch (``x.sum()``, which takes the page faults of a mapped batch), for batch
  64 staged as 64 (a view of a whole slot), batch 16 staged as 64 (views of a quarter of one
  mapping) and batch 64 staged as 16 (a copy of four slots).
- ``slow``: two fast jobs in a group ("pair"); the same two with a third job 3x slower per batch
  in the group ("trio"); the two in a group and the slow job beside them without a group
  ("beside"). Targets: the fast jobs in the trio lose at most 10% against the pair; the slow job
  in the trio is no slower than beside them. The slow job sleeps 3x the time a fast job's batch
  takes in the pair (measured in a first pair run), so that it trains at most a third as fast.

    python -m benchmarks.hp_mix --data /var/tmp/coordl-bench/train --images 2000
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import common

HERE = Path(__file__).resolve().parent


def job(args) -> None:
    """One training job: waits for the go file, runs its epochs, writes what it saw."""
    import coordl

    kw = {}
    if args.group:
        extra = {"stage_batch": args.stage_batch} if args.stage_batch else {}
        kw["hp_group"] = coordl.HPGroup(args.group, **extra)
    out = {"epochs": [], "take_s": [], "read_s": []}
    with coordl.CoordLoader(
        args.data,
        batch_size=args.batch_size,
        shuffle=True,
        pipeline="imagenet-train",
        device_id=None,
        return_index=True,
        cache=coordl.Cache(size=1.0, keep=True),
        **kw,
    ) as loader:
        common.wait_for_go(args.ready, args.go)
        for epoch in range(args.epochs):
            loader.set_epoch(epoch)
            t0 = time.perf_counter()
            seen, n = [], 0
            it = iter(loader)
            while True:
                t = time.perf_counter()
                try:
                    x, _, ids = next(it)
                except StopIteration:
                    break
                t1 = time.perf_counter()
                x.sum()
                out["take_s"].append(t1 - t)
                out["read_s"].append(time.perf_counter() - t1)
                seen += ids.tolist()
                n += len(ids)
                if args.sleep:
                    time.sleep(args.sleep)
            s = loader.stats()
            keys = ("produced", "consumed_shared", "detached", "alone_batches", "order_epoch", "hp_members")
            out["epochs"].append(
                {
                    "seconds": time.perf_counter() - t0,
                    "samples": n,
                    "exactly_once": len(seen) == len(set(seen)) == args.images,
                    **{k: s.get(k) for k in keys},
                }
            )
    Path(args.out).write_text(json.dumps(out))


def launch(args, workdir: Path, jobs: list[dict]) -> list[dict]:
    """Runs ``jobs`` (each: batch, sleep, group, stage_batch) together; returns what each wrote."""
    go = workdir / "go"
    go.unlink(missing_ok=True)
    commands, files = [], []
    for k, spec in enumerate(jobs):
        out, ready = common.job_files(workdir, k)
        cmd = common.module_command(
            "hp_mix",
            "--job",
            "--data",
            args.data,
            "--images",
            str(args.images),
            "--batch-size",
            str(spec["batch"]),
            "--epochs",
            str(args.epochs),
            "--sleep",
            str(spec.get("sleep", 0.0)),
            "--stage-batch",
            str(spec.get("stage_batch") or 0),
            "--ready",
            str(ready),
            "--go",
            str(go),
            "--out",
            str(out),
        )
        if spec.get("group"):
            cmd += ["--group", spec["group"]]
        commands.append(cmd)
        files.append((out, ready))
    procs = common.start_together(commands, [r for _, r in files], go)
    for p in procs:
        p.wait()
    if any(p.returncode for p in procs):
        raise SystemExit(f"a job failed: exit codes {[p.returncode for p in procs]}")
    return [json.loads(out.read_text()) for out, _ in files]


def rate(out: dict) -> float:
    """Samples/s of a job over its epochs after the first."""
    steady = out["epochs"][1:]
    return sum(e["samples"] for e in steady) / sum(e["seconds"] for e in steady)


def summary(outs: list[dict]) -> dict:
    return {
        "per_job_samples_per_s": [rate(o) for o in outs],
        "exactly_once": all(e["exactly_once"] for o in outs for e in o["epochs"]),
        "take_ms_median": [1000 * statistics.median(o["take_s"]) for o in outs],
        "read_ms_median": [1000 * statistics.median(o["read_s"]) for o in outs],
        "epochs": [o["epochs"] for o in outs],
    }


def mean(xs) -> float:
    return sum(xs) / len(xs)


def compare(args, workdir: Path, modes: dict[str, list[dict]]) -> dict:
    """Runs each mode's jobs ``--reps`` times, the modes alternating."""
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    for r in range(args.reps):
        for m, jobs in modes.items():
            s = summary(launch(args, workdir, jobs))
            runs[m].append(s)
            print(f"  rep {r + 1} {m:>8}: per job {[round(x) for x in s['per_job_samples_per_s']]} samples/s")
    return runs


def same(args, workdir: Path) -> list[dict]:
    rows = []
    for n in [int(x) for x in args.jobs.split(",")]:
        print(f"same batch, N={n}")
        alone = [{"batch": 64}] * n
        group = [{"batch": 64, "group": f"same{n}"}] * n
        runs = compare(args, workdir, {"alone": alone, "group": group})
        ratios = [
            mean(g["per_job_samples_per_s"]) / mean(a["per_job_samples_per_s"])
            for a, g in zip(runs["alone"], runs["group"], strict=True)
        ]
        row = {"jobs": n, "ratios": ratios, "ratio_median": statistics.median(ratios), "target": 0.9 * n, **runs}
        print(f"N={n}: group / alone per job = {[round(x, 2) for x in ratios]} (target >= {0.9 * n:.1f})")
        rows.append(row)
    return rows


def mix(args, workdir: Path) -> dict:
    print("batch sizes 16, 32, 64")
    alone = [{"batch": b} for b in (16, 32, 64)]
    group = [{"batch": b, "group": "mix", "stage_batch": 64} for b in (16, 32, 64)]
    runs = compare(args, workdir, {"alone": alone, "group": group})
    ratios = [
        mean(g["per_job_samples_per_s"]) / mean(a["per_job_samples_per_s"])
        for a, g in zip(runs["alone"], runs["group"], strict=True)
    ]
    once = all(r["exactly_once"] for rs in runs.values() for r in rs)
    print(f"mix: group / alone per job = {[round(x, 2) for x in ratios]} (target >= 2.55); exactly once: {once}")
    median = statistics.median(ratios)
    return {"ratios": ratios, "ratio_median": median, "target": 0.85 * 3, "exactly_once": once, **runs}


def handoff(args, workdir: Path) -> list[dict]:
    rows = []
    for batch, staged in ((64, 64), (16, 64), (64, 16)):
        if args.stage_batch_unsupported and batch != staged:
            continue
        spec = {"batch": batch, "group": "handoff", "stage_batch": staged if batch != staged else 0, "sleep": 0.2}
        takes, reads = [], []
        for _ in range(args.reps):
            s = summary(launch(args, workdir, [spec]))
            takes.append(s["take_ms_median"][0])
            reads.append(s["read_ms_median"][0])
        row = {"batch": batch, "staged": staged, "take_ms": takes, "read_ms": reads}
        print(f"hand-off, batch {batch} staged as {staged}: next() {takes} ms, first read {reads} ms")
        rows.append(row)
    return rows


def slow(args, workdir: Path) -> dict:
    fast = {"batch": 64, "sleep": args.sleep, "group": "fast"}
    first = summary(launch(args, workdir, [fast, fast]))
    per_batch = 64 / mean(first["per_job_samples_per_s"])
    slow_sleep = 3 * per_batch  # its training step alone takes 3x a fast job's whole batch
    print(f"slow member: a fast batch takes {per_batch:.3f} s in the pair; the slow one sleeps {slow_sleep:.3f} s")
    s_in = {"batch": 64, "sleep": slow_sleep, "group": "fast"}
    s_out = {"batch": 64, "sleep": slow_sleep}
    runs = compare(args, workdir, {"pair": [fast, fast], "trio": [fast, fast, s_in], "beside": [fast, fast, s_out]})
    fast_loss = [
        1 - mean(t["per_job_samples_per_s"][:2]) / mean(p["per_job_samples_per_s"])
        for p, t in zip(runs["pair"], runs["trio"], strict=True)
    ]
    slow_ratio = [
        t["per_job_samples_per_s"][2] / b["per_job_samples_per_s"][2]
        for t, b in zip(runs["trio"], runs["beside"], strict=True)
    ]
    print(
        f"slow: fast jobs lose {[f'{100 * x:.1f}%' for x in fast_loss]} in the trio (target <= 10%); the slow job "
        f"in the trio / beside = {[round(x, 2) for x in slow_ratio]} (target >= 1.0)"
    )
    return {
        "fast_sleep_s": args.sleep,
        "fast_batch_s_in_pair": per_batch,
        "slow_sleep_s": slow_sleep,
        "fast_loss": fast_loss,
        "slow_trio_over_beside": slow_ratio,
        **runs,
    }


def main() -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.hp_mix", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--job", action="store_true", help=argparse.SUPPRESS)
    for a in ("--group", "--ready", "--go", "--out"):
        p.add_argument(a, help=argparse.SUPPRESS)
    p.add_argument("--batch-size", type=int, default=64, help=argparse.SUPPRESS)
    p.add_argument("--stage-batch", type=int, default=0, help=argparse.SUPPRESS)
    common.add_dataset_options(p, data="/var/tmp/coordl-bench/train")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--sleep", type=float, default=0.0, help="the fast jobs' training step per batch (slow scenario)")
    p.add_argument("--scenarios", default="same,mix,handoff,slow")
    p.add_argument("--jobs", default="2,4", help="the numbers of jobs of the same scenario")
    p.add_argument("--handoff-key", default="handoff", help="the result's key for the hand-off figures")
    p.add_argument(
        "--stage-batch-unsupported", action="store_true", help="a coordl before HPGroup(stage_batch): batch 64 only"
    )
    p.add_argument("--result", default=str(HERE / "results" / "hp_mix.json"))
    args = p.parse_args()
    if args.job:
        job(args)
        return 0

    from coordl.shm import reaper

    dataset = common.dataset_from_args(args)
    args.images = dataset["files"]
    print(f"dataset: {common.describe(dataset)}")
    workdir = Path(tempfile.mkdtemp(prefix="coordl-hp-mix-"))
    results = {"machine": common.machine(), "dataset": dataset, "epochs": args.epochs, "reps": args.reps}
    if os.path.exists(args.result):
        results = {**json.loads(Path(args.result).read_text()), **results}
    try:
        launch(args, workdir, [{"batch": 64}])  # fills the node's cache (kept): every run starts warm
        scenarios = args.scenarios.split(",")
        if "same" in scenarios:
            results["same"] = same(args, workdir)
        if "mix" in scenarios:
            results["mix"] = mix(args, workdir)
        if "handoff" in scenarios:
            results[args.handoff_key] = handoff(args, workdir)
        if "slow" in scenarios:
            results[f"slow_sleep_{args.sleep:g}"] = slow(args, workdir)
    finally:
        reaper.reap(include_kept=True)
        shutil.rmtree(workdir, ignore_errors=True)  # the jobs' go/ready files and outputs
    Path(args.result).parent.mkdir(parents=True, exist_ok=True)
    Path(args.result).write_text(json.dumps(results, indent=1))
    print(f"wrote {args.result}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
