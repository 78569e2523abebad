"""Coordinated prep: trials sharing an hp_group vs alone; batch sizes, a slow trial, a sweep, a kill -9.

Trials of :mod:`benchmarks.hp_trials` started together, the node's cache warm (filled first), prep-bound;
per-trial samples/s over the epochs after the first; compared modes ABBA, ``--reps`` times. Scenarios
(``--scenarios``), their targets:

- ``same``: N (``--jobs``) trials of batch 64 alone (no ``hp_group``) vs in a group: per-trial samples/s and
  their ratio (at least 0.9 N), batches decoded and CPU seconds per epoch, the staging memory's peak;
- ``cold``: for each N and mode, one epoch with the dataset's pages evicted and no MinIO cache: the bytes
  read from the block device;
- ``recovery``: 3 trials in a group, one killed with SIGKILL in the middle of its second epoch: the
  survivors' longest wait for a batch after the kill, beside their typical one;
- ``mix``: trials of batch 16, 32 and 64 alone vs in a group (``HPGroup(stage_batch=64)``): at least 0.85 N x,
  every epoch of every trial exactly once;
- ``handoff``: one trial in a group training 0.2 s per batch (its producer always ahead): the median
  ``next()`` and first read (the page faults of a mapped batch), batch 64 staged as 64 (a view of a slot),
  16 as 64 (views of a quarter of one), 64 as 16 (a copy of four slots);
- ``slow``: two trials training ``--sleep`` s per batch in a group ("pair"); with a third 3x slower per
  batch in the group ("trio"); the slow one beside the group ("beside"): the fast lose at most 10% in the
  trio, the slow one is no slower in the trio than beside;
- ``sweep``: trials of batch 16, 64 and 128 entering one group in a set order (``--orders``: the first
  makes the staging area), then consuming together; ``--modes``: ``shorthand`` (``hp_group="sweep"``),
  ``stage128`` (``stage_batch=128``), ``first16`` (``stage_batch=16``, 16 first only): per-trial samples/s
  (shorthand within 5% of stage128's), batches that were views, staged batch, first batch's latency.

The scenarios run before in ``--out`` stay in it, each named under ``"earlier"`` with the command, commit
and date that made it; those run now replace theirs.

    python -m benchmarks hp_group --data /var/tmp/coordl-bench/train --images 2000 --scenarios same,mix   # ~15 min
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks import hp_trials as trials
from benchmarks.harness import dataset, jobs, limits, measure

SWEEP = (16, 64, 128)
ORDERS = {"16-first": SWEEP, "128-first": SWEEP[::-1]}
STAGE = {"shorthand": None, "stage128": 128, "first16": 16}


def options(p) -> None:
    trials.add_options(p)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--scenarios", default="same,cold,recovery,mix,handoff,slow,sweep")
    p.add_argument("--jobs", default="2,4", help="the numbers of trials of same and cold")
    p.add_argument("--sleep", type=float, default=0.0, help="the fast trials' training step per batch (slow)")
    p.add_argument("--modes", default="shorthand,stage128,first16", help="of sweep")
    p.add_argument("--orders", default=",".join(ORDERS), help="sweep's start orders: 16-first, 128-first")


def run(args) -> dict | None:
    if args.trial:
        return trials.trial(args)
    from coordl.shm import reaper

    data = dataset.dataset_from_args(args)
    args.images, scenarios = data["files"], args.scenarios.split(",")  # a trial checks every epoch against it
    print(f"dataset: {dataset.describe(data)}")
    measured = [f"slow_sleep_{args.sleep:g}" if name == "slow" else name for name in scenarios]
    results = kept(args.out, measured)
    results |= {"epochs": args.epochs, "reps": args.reps}
    workdir = Path(tempfile.mkdtemp(prefix="coordl-hp-"))
    try:
        if "cold" in scenarios:
            results["cold"] = cold(args, workdir, reaper)
        trials.launch(args, workdir, [{"batch": 64}])  # fills the node's cache (kept): every run after warm
        for name in ("same", "recovery", "mix", "handoff", "slow", "sweep"):
            if name in scenarios:
                results[f"slow_sleep_{args.sleep:g}" if name == "slow" else name] = globals()[name](args, workdir)
    finally:
        reaper.reap(include_kept=True)
        shutil.rmtree(workdir, ignore_errors=True)  # the trials' go/ready files and outputs
    return {**results, "dataset": data}


def kept(out: str, measured: list[str]) -> dict:
    """The scenarios of an earlier result at ``out`` that this run does not measure again, each named
    in ``"earlier"`` with the command, commit and date it came from: the file's own envelope is this
    run's."""
    if not os.path.exists(out):
        return {}
    before = json.loads(Path(out).read_text())
    results = {k: v for k, v in before.get("results", {}).items() if k not in ("epochs", "reps")}
    origin = {k: before[k] for k in ("command", "commit", "date") if k in before}
    earlier = results.pop("earlier", {})
    earlier |= {k: origin for k in results if k not in earlier}
    kept = {k: v for k, v in results.items() if k not in measured}
    return {**kept, "earlier": {k: v for k, v in earlier.items() if k in kept}} if kept else {}


def same(args, workdir: Path) -> list[dict]:
    rows = []
    for n in [int(x) for x in args.jobs.split(",")]:
        print(f"same batch, N={n}")
        runs = trials.compare(
            args, workdir, {"alone": [{"batch": 64}] * n, "group": [{"batch": 64, "group": f"same{n}"}] * n}
        )
        ratios = trials.ratios(runs)
        print(f"N={n}: group / alone per job = {[round(x, 2) for x in ratios]} (target >= {0.9 * n:.1f})")
        rows.append({"jobs": n, "ratios": ratios, "ratio_median": statistics.median(ratios), "target": 0.9 * n, **runs})
    return rows


def cold(args, workdir: Path, reaper) -> list[dict]:
    """One epoch of N trials alone and in a group, no MinIO cache and the dataset's pages evicted just
    before the go (the trials' libraries stay in the page cache): the device's bytes."""
    dev, rows, before = measure.device_of(args.data), [], {}

    def evict():
        limits.evict(args.data)
        before["bytes"] = measure.sectors_read(dev)

    for n in [int(x) for x in args.jobs.split(",")]:
        row = {"jobs": n}
        for mode in ("alone", "group"):
            reaper.reap(include_kept=True)
            outs = trials.launch(
                args, workdir, [{"batch": 64, "group": mode == "group" and f"cold{n}", "epochs": 1}] * n, evict
            )
            stats_bytes = sum(e["storage_bytes"] for o in outs for e in o["epochs"])
            row[mode] = {
                "device_bytes": measure.sectors_read(dev) - before["bytes"],
                "stats_storage_bytes": stats_bytes,
            }
            print(f"cold epoch, N={n} {mode}: {row[mode]['device_bytes'] / 1e6:.1f} MB from the device")
        rows.append(row)
    return rows


def recovery(args, workdir: Path) -> list[dict]:
    nb, progress = -(-args.images // 64), workdir / "progress0"
    progress.unlink(missing_ok=True)
    specs = [{"batch": 64, "group": "bench-kill", "progress": progress if k == 0 else None} for k in (0, 1, 2)]
    procs, outs = jobs.start_jobs([trials.command(args, s) for s in specs], workdir)
    while not progress.exists() or int(progress.read_text() or 0) < nb + nb // 2:
        time.sleep(0.01)
    killed_at = time.monotonic()
    procs[0].send_signal(signal.SIGKILL)
    if any(codes := [p.wait() for p in procs][1:]):
        raise SystemExit(f"a surviving trial failed: exit codes {codes}")
    gaps = []
    for out in outs[1:]:
        t = json.loads(out.read_text())["times"]
        before = [b - a for a, b in zip(t, t[1:]) if b < killed_at]
        after = [b - a for a, b in zip(t, t[1:]) if a >= killed_at - 1 and b >= killed_at]
        if not before or not after:
            raise SystemExit("the survivors' batches all came before or after the kill: give more --images")
        typical = statistics.median_high(before)
        gaps.append({"typical_gap_s": typical, "max_gap_after_kill_s": max(after), "lost_s": max(after) - typical})
    print(f"kill -9 of one of 3: the survivors' longest waits after it {[g['max_gap_after_kill_s'] for g in gaps]} s")
    return gaps


def mix(args, workdir: Path) -> dict:
    print("batch sizes 16, 32, 64")
    group = [{"batch": b, "group": "mix", "stage_batch": 64} for b in (16, 32, 64)]
    runs = trials.compare(args, workdir, {"alone": [{"batch": b} for b in (16, 32, 64)], "group": group})
    ratios, once = trials.ratios(runs), all(r["exactly_once"] for rs in runs.values() for r in rs)
    print(f"mix: group / alone per job = {[round(x, 2) for x in ratios]} (target >= 2.55); exactly once: {once}")
    return {
        "ratios": ratios,
        "ratio_median": statistics.median(ratios),
        "target": 0.85 * 3,
        "exactly_once": once,
        **runs,
    }


def handoff(args, workdir: Path) -> list[dict]:
    rows = []
    for batch, staged in ((64, 64), (16, 64), (64, 16)):
        spec = {"batch": batch, "group": "handoff", "stage_batch": staged if batch != staged else 0, "sleep": 0.2}
        s = [trials.summary(trials.launch(args, workdir, [spec])) for _ in range(args.reps)]
        takes, reads = [x["take_ms_median"][0] for x in s], [x["read_ms_median"][0] for x in s]
        print(f"hand-off, batch {batch} staged as {staged}: next() {takes} ms, first read {reads} ms")
        rows.append({"batch": batch, "staged": staged, "take_ms": takes, "read_ms": reads})
    return rows


def slow(args, workdir: Path) -> dict:
    fast = {"batch": 64, "sleep": args.sleep, "group": "fast"}
    per_batch = 64 / statistics.mean(
        trials.summary(trials.launch(args, workdir, [fast, fast]))["per_job_samples_per_s"]
    )
    slow_sleep = 3 * per_batch  # its training step alone takes 3x a fast trial's whole batch
    s_in, s_out = {"batch": 64, "sleep": slow_sleep, "group": "fast"}, {"batch": 64, "sleep": slow_sleep}
    runs = trials.compare(
        args, workdir, {"pair": [fast, fast], "trio": [fast, fast, s_in], "beside": [fast, fast, s_out]}
    )
    rates = {m: [r["per_job_samples_per_s"] for r in rs] for m, rs in runs.items()}
    fast_loss = [1 - statistics.mean(t[:2]) / statistics.mean(p) for p, t in zip(rates["pair"], rates["trio"])]
    slow_ratio = [t[2] / b[2] for t, b in zip(rates["trio"], rates["beside"])]
    print(f"slow: the fast lose {fast_loss} in the trio (target <= 0.1); the slow one, trio / beside = {slow_ratio}")
    kw = {"fast_sleep_s": args.sleep, "fast_batch_s_in_pair": per_batch, "slow_sleep_s": slow_sleep}
    return {**kw, "fast_loss": fast_loss, "slow_trio_over_beside": slow_ratio, **runs}


def sweep(args, workdir: Path) -> dict:
    modes, orders = [m for m in args.modes.split(",") if m], [o for o in args.orders.split(",") if o]
    runs = {m: {o: [] for o in orders if m != "first16" or o == "16-first"} for m in modes}
    for r, (order, m) in measure.alternate([(o, m) for o in orders for m in runs if o in runs[m]], args.reps):
        entered, batches = [workdir / f"entered{k}" for k in range(3)], ORDERS[order]
        for e in entered:
            e.unlink(missing_ok=True)
        spec = {"group": "sweep", "stage_batch": STAGE[m], "last": entered[-1]}
        specs = [
            {**spec, "batch": b, "after": entered[k - 1] if k else None, "entered": entered[k]}
            for k, b in enumerate(batches)
        ]
        load = [round(x, 2) for x in os.getloadavg()]
        outs = dict(zip(batches, trials.launch(args, workdir, specs)))
        s = {
            "samples_per_s": {b: trials.rate(o) for b, o in outs.items()},
            "views": {b: o["views"] / o["batches"] for b, o in outs.items()},
        }
        s |= {
            "first_batch_s": {b: o["first_batch_s"] for b, o in outs.items()},
            "stage_batch": sorted({o["stage_batch"] for o in outs.values()}),
        }
        s |= {
            "exactly_once": all(e["exactly_once"] for o in outs.values() for e in o["epochs"]),
            "epochs": {b: o["epochs"] for b, o in outs.items()},
        }
        runs[m][order].append(s | {"loadavg_before": load, "loadavg_after": [round(x, 2) for x in os.getloadavg()]})
        print(
            f"  rep {r + 1} {order} {m}: staged {s['stage_batch']}, samples/s {s['samples_per_s']}, views {s['views']}"
        )
    ratios = {}
    for order in orders if {"shorthand", "stage128"} <= set(runs) else ():
        short, by_hand = runs["shorthand"][order], runs["stage128"][order]
        per = [{b: a["samples_per_s"][b] / c["samples_per_s"][b] for b in SWEEP} for a, c in zip(short, by_hand)]
        mean = {
            b: statistics.mean(a["samples_per_s"][b] for a in short)
            / statistics.mean(c["samples_per_s"][b] for c in by_hand)
            for b in SWEEP
        }
        ratios[order] = {
            "per_rep": per,
            "median": {b: statistics.median(p[b] for p in per) for b in SWEEP},
            "of_means": mean,
        }
        print(f"{order}: shorthand / stage_batch=128 per trial, median: {ratios[order]['median']} (target within 5%)")
    return {"runs": runs, "shorthand_over_stage128": ratios}
