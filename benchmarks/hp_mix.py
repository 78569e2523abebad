"""HP groups without lockstep: trials of the same or different batch sizes, and a slow trial.

Trials of :mod:`benchmarks.hp_trials` started together; per-trial samples/s over the epochs after the
first; the compared modes ABBA, ``--reps`` times. Scenarios (``--scenarios``):

- ``same``: N = 2 and 4 trials of batch 64, alone (no ``hp_group``) vs in a group. Target: each trial
  in the group at least 0.9 N x a trial alone.
- ``mix``: trials of batch 16, 32 and 64, alone vs in a group (``HPGroup(stage_batch=64)``). Target: at
  least 0.85 N x, every epoch of every trial exactly once.
- ``handoff``: what taking a ready batch costs: one trial in a group training 0.2 s per batch (its
  producer always ahead); the median ``next()`` and first read (``x.sum()``, the page faults of a mapped
  batch), for batch 64 staged as 64 (a view of a slot), 16 as 64 (views of a quarter of one), 64 as 16
  (a copy of four slots).
- ``slow``: two fast trials in a group ("pair"); with a third 3x slower per batch in the group ("trio");
  the slow one beside the group ("beside"). Targets: the fast trials lose at most 10% in the trio; the
  slow one is no slower in the trio than beside.

    python -m benchmarks hp_mix --data /var/tmp/coordl-bench/train --images 2000    # ~20 min
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import tempfile
from pathlib import Path

from benchmarks import hp_trials
from benchmarks.hp_trials import mean

NAME = "hp_mix"


def options(p) -> None:
    hp_trials.add_options(p)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--sleep", type=float, default=0.0, help="the fast trials' training step per batch (slow scenario)")
    p.add_argument("--scenarios", default="same,mix,handoff,slow")
    p.add_argument("--jobs", default="2,4", help="the numbers of trials of the same scenario")
    p.add_argument("--handoff-key", default="handoff", help="the result's key for the hand-off figures")
    p.add_argument(
        "--stage-batch-unsupported", action="store_true", help="a coordl before HPGroup(stage_batch): batch 64 only"
    )


def same(args, workdir: Path) -> list[dict]:
    rows = []
    for n in [int(x) for x in args.jobs.split(",")]:
        print(f"same batch, N={n}")
        runs = hp_trials.compare(
            args, NAME, workdir, {"alone": [{"batch": 64}] * n, "group": [{"batch": 64, "group": f"same{n}"}] * n}
        )
        ratios = hp_trials.ratios(runs)
        print(f"N={n}: group / alone per job = {[round(x, 2) for x in ratios]} (target >= {0.9 * n:.1f})")
        rows.append({"jobs": n, "ratios": ratios, "ratio_median": statistics.median(ratios), "target": 0.9 * n, **runs})
    return rows


def mix(args, workdir: Path) -> dict:
    print("batch sizes 16, 32, 64")
    alone = [{"batch": b} for b in (16, 32, 64)]
    group = [{"batch": b, "group": "mix", "stage_batch": 64} for b in (16, 32, 64)]
    runs = hp_trials.compare(args, NAME, workdir, {"alone": alone, "group": group})
    ratios = hp_trials.ratios(runs)
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
            s = hp_trials.summary(hp_trials.launch(args, NAME, workdir, [spec]))
            takes.append(s["take_ms_median"][0])
            reads.append(s["read_ms_median"][0])
        print(f"hand-off, batch {batch} staged as {staged}: next() {takes} ms, first read {reads} ms")
        rows.append({"batch": batch, "staged": staged, "take_ms": takes, "read_ms": reads})
    return rows


def slow(args, workdir: Path) -> dict:
    fast = {"batch": 64, "sleep": args.sleep, "group": "fast"}
    first = hp_trials.summary(hp_trials.launch(args, NAME, workdir, [fast, fast]))
    per_batch = 64 / mean(first["per_job_samples_per_s"])
    slow_sleep = 3 * per_batch  # its training step alone takes 3x a fast trial's whole batch
    print(f"slow member: a fast batch takes {per_batch:.3f} s in the pair; the slow one sleeps {slow_sleep:.3f} s")
    s_in, s_out = {"batch": 64, "sleep": slow_sleep, "group": "fast"}, {"batch": 64, "sleep": slow_sleep}
    modes = {"pair": [fast, fast], "trio": [fast, fast, s_in], "beside": [fast, fast, s_out]}
    runs = hp_trials.compare(args, NAME, workdir, modes)
    fast_loss = [
        1 - mean(t["per_job_samples_per_s"][:2]) / mean(p["per_job_samples_per_s"])
        for p, t in zip(runs["pair"], runs["trio"], strict=True)
    ]
    slow_ratio = [
        t["per_job_samples_per_s"][2] / b["per_job_samples_per_s"][2]
        for t, b in zip(runs["trio"], runs["beside"], strict=True)
    ]
    print(
        f"slow: fast trials lose {[f'{100 * x:.1f}%' for x in fast_loss]} in the trio (target <= 10%); the slow "
        f"one in the trio / beside = {[round(x, 2) for x in slow_ratio]} (target >= 1.0)"
    )
    return {
        "fast_sleep_s": args.sleep,
        "fast_batch_s_in_pair": per_batch,
        "slow_sleep_s": slow_sleep,
        "fast_loss": fast_loss,
        "slow_trio_over_beside": slow_ratio,
        **runs,
    }


def run(args) -> dict | None:
    if args.trial:
        return hp_trials.trial(args)
    from coordl.shm import reaper

    data = hp_trials.images(args)
    results = {"epochs": args.epochs, "reps": args.reps}
    if os.path.exists(args.out):  # the scenarios run before stay, the ones run now replace theirs
        results = {**json.loads(Path(args.out).read_text()).get("results", {}), **results}
    workdir = Path(tempfile.mkdtemp(prefix="coordl-hp-mix-"))
    try:
        hp_trials.launch(args, NAME, workdir, [{"batch": 64}])  # fills the node's cache (kept): every run warm
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
        shutil.rmtree(workdir, ignore_errors=True)  # the trials' go/ready files and outputs
    return {**results, "dataset": data}
