"""Coordinated prep: trials sharing an hp_group vs alone; batch sizes, a slow trial, a sweep, a kill -9.

Trials of :mod:`benchmarks.hp_trials` started together, the node's cache warm (filled first), prep-bound,
per-trial samples/s over the epochs after the first, compared modes ABBA ``--reps`` times. ``--scenarios``
(targets and tables in docs/hp-search.md): ``same`` (``--jobs`` N trials of batch 64 alone vs in a group),
``cold`` (one epoch of each, the dataset's pages evicted, no MinIO cache: device bytes), ``recovery`` (3
in a group, one killed by SIGKILL mid-epoch: the survivors' longest wait), ``mix`` (batches 16, 32, 64,
``stage_batch=64``), ``handoff`` (``next()`` and the first read of a batch staged as 64 or 16), ``slow``
(a pair training ``--sleep`` s a batch, with a third 3x slower in the group or beside it), ``sweep``
(batches 16, 64, 128 entering one group in ``--orders``, staged by ``--modes``: the shorthand,
``stage_batch=128``, or 16). Scenarios of an earlier run in ``--out`` that this one does not measure stay
(:func:`kept`).

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
from benchmarks.harness import results as schema

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
    key = {name: f"slow_sleep_{args.sleep:g}" if name == "slow" else name for name in scenarios}
    results = kept(args.out, [*key.values(), "epochs", "reps"], data)
    results |= {"epochs": args.epochs, "reps": args.reps}
    workdir = Path(tempfile.mkdtemp(prefix="coordl-hp-"))
    try:
        if "cold" in scenarios:
            results["cold"] = cold(args, workdir, reaper)
        trials.launch(args, workdir, [{"batch": 64}])  # fills the node's cache (kept): every run after warm
        for name in ("same", "recovery", "mix", "handoff", "slow", "sweep"):
            if name in scenarios:
                results[key[name]] = globals()[name](args, workdir)
    finally:
        reaper.reap(include_kept=True)
        shutil.rmtree(workdir, ignore_errors=True)  # the trials' go/ready files and outputs
    return {**results, "dataset": data}


def kept(path: str | Path, measured, dataset: dict | None = None) -> dict:
    """What a run that measures ``measured`` keeps of the earlier result at ``path``: its other results, each
    named in ``"earlier"`` with the command, commit and date it came from (the file's envelope is the new
    run's). Nothing from a file of another shape, or of a dataset of another size than ``dataset``."""
    try:
        before = schema.load(path)
    except (OSError, ValueError):
        return {}
    if dataset is not None and (before["dataset"] or {}).get("total_bytes") != dataset["total_bytes"]:
        return {}
    figures = {k: v for k, v in before["results"].items() if k not in measured}
    earlier, origin = figures.pop("earlier", {}), {k: before[k] for k in ("command", "commit", "date")}
    return {**figures, "earlier": {k: earlier.get(k, origin) for k in figures}} if figures else {}


def grouped(args, workdir: Path, name: str, alone: list[dict], target: float) -> dict:
    """The trials of ``alone`` without a group vs in the group ``name``: per rep, group / alone per trial."""
    runs = trials.compare(args, workdir, {"alone": alone, "group": [{**s, "group": name} for s in alone]})
    ratios = trials.ratios(runs)
    print(f"{name}: group / alone per job = {[round(x, 2) for x in ratios]} (target >= {target:.2f})")
    return {"ratios": ratios, "ratio_median": statistics.median(ratios), "target": target, **runs}


def same(args, workdir: Path) -> list[dict]:
    jobs_ = [int(x) for x in args.jobs.split(",")]
    return [{"jobs": n, **grouped(args, workdir, f"same{n}", [{"batch": 64}] * n, 0.9 * n)} for n in jobs_]


def mix(args, workdir: Path) -> dict:
    r = grouped(args, workdir, "mix", [{"batch": b, "stage_batch": 64} for b in (16, 32, 64)], 0.85 * 3)
    return r | {"exactly_once": all(x["exactly_once"] for m in ("alone", "group") for x in r[m])}


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
            specs = [{"batch": 64, "group": mode == "group" and f"cold{n}", "epochs": 1}] * n
            outs = trials.launch(args, workdir, specs, evict)
            row[mode] = {"device_bytes": measure.sectors_read(dev) - before["bytes"]}
            row[mode]["stats_storage_bytes"] = sum(e["storage_bytes"] for o in outs for e in o["epochs"])
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
    pair = trials.summary(trials.launch(args, workdir, [fast, fast]))
    per_batch = 64 / statistics.mean(pair["per_job_samples_per_s"])
    s_out = {"batch": 64, "sleep": 3 * per_batch}  # its training step alone takes 3x a fast trial's whole batch
    modes = {"pair": [fast, fast], "trio": [fast, fast, {**s_out, "group": "fast"}], "beside": [fast, fast, s_out]}
    runs = trials.compare(args, workdir, modes)
    rates = {m: [r["per_job_samples_per_s"] for r in rs] for m, rs in runs.items()}
    fast_loss = [1 - statistics.mean(t[:2]) / statistics.mean(p) for p, t in zip(rates["pair"], rates["trio"])]
    slow_ratio = [t[2] / b[2] for t, b in zip(rates["trio"], rates["beside"])]
    print(f"slow: the fast lose {fast_loss} in the trio (target <= 0.1); the slow one, trio / beside = {slow_ratio}")
    kw = {"fast_sleep_s": args.sleep, "fast_batch_s_in_pair": per_batch, "slow_sleep_s": s_out["sleep"]}
    return {**kw, "fast_loss": fast_loss, "slow_trio_over_beside": slow_ratio, **runs}


def sweep(args, workdir: Path) -> dict:
    modes, orders = [m for m in args.modes.split(",") if m], [o for o in args.orders.split(",") if o]
    runs = {m: {o: [] for o in orders if m != "first16" or o == "16-first"} for m in modes}
    entered = [workdir / f"entered{k}" for k in range(3)]
    for r, (order, m) in measure.alternate([(o, m) for o in orders for m in runs if o in runs[m]], args.reps):
        for e in entered:
            e.unlink(missing_ok=True)
        spec = {"group": "sweep", "stage_batch": STAGE[m], "last": entered[-1]}
        specs = [
            {**spec, "batch": b, "after": entered[k - 1] if k else None, "entered": entered[k]}
            for k, b in enumerate(ORDERS[order])
        ]
        load = [round(x, 2) for x in os.getloadavg()]
        outs = dict(zip(ORDERS[order], trials.launch(args, workdir, specs)))
        s = {"samples_per_s": {b: trials.rate(o) for b, o in outs.items()}}
        s["views"] = {b: o["views"] / o["batches"] for b, o in outs.items()}
        s |= {k: {b: o[k] for b, o in outs.items()} for k in ("first_batch_s", "epochs")}
        s |= {"stage_batch": sorted({o["stage_batch"] for o in outs.values()}), "loadavg_before": load}
        s["exactly_once"] = all(e["exactly_once"] for o in outs.values() for e in o["epochs"])
        runs[m][order].append(s | {"loadavg_after": [round(x, 2) for x in os.getloadavg()]})
        print(f"  rep {r + 1} {order} {m}: staged {s['stage_batch']}, {s['samples_per_s']}/s, views {s['views']}")
    ratios = {}
    for order in orders if {"shorthand", "stage128"} <= set(runs) else ():
        short, by_hand = runs["shorthand"][order], runs["stage128"][order]
        per = [{b: a["samples_per_s"][b] / c["samples_per_s"][b] for b in SWEEP} for a, c in zip(short, by_hand)]
        median = {b: statistics.median(p[b] for p in per) for b in SWEEP}
        of_means = {b: _mean(short, b) / _mean(by_hand, b) for b in SWEEP}
        ratios[order] = {"per_rep": per, "median": median, "of_means": of_means}
        print(f"{order}: shorthand / stage_batch=128 per trial, median: {median} (target within 5%)")
    return {"runs": runs, "shorthand_over_stage128": ratios}


def _mean(runs: list[dict], batch: int) -> float:
    return statistics.mean(r["samples_per_s"][batch] for r in runs)
