"""Coordinated prep: trials sharing an hp_group vs alone; batch sizes, a slow trial, a sweep, a kill -9.

Trials (:func:`trial`: a child with one CoordLoader, ``imagenet-train`` on the CPU, reading each batch, then
sleeping, its training step) started together, the node's cache warm, prep-bound, per-trial
samples/s after the first epoch, modes ABBA ``--reps`` times. ``--scenarios`` (docs/hp-search.md): ``same`` (``--jobs``
trials of batch 64), ``cold`` (a cold epoch's device bytes), ``recovery`` (one of 3 killed by SIGKILL), ``mix``
(batches 16, 32, 64), ``handoff`` (taking a batch staged as 64 or 16), ``slow`` (a pair training ``--sleep`` s
a batch, a third 3x slower in the group or beside it), ``sweep`` (batches 16, 64, 128 entering one group in
either order, staged by ``--modes``). What an earlier run in ``--out`` measured and this one does not stays.

    python -m benchmarks hp_group --data /var/tmp/coordl-bench/train --images 2000 --scenarios same,mix   # ~15 min
"""

import argparse
import json
import os
import resource
import shutil
import signal
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.harness import dataset, jobs, limits, measure
from benchmarks.harness import results as schema
from coordl.shm import reaper

SWEEP = (16, 64, 128)
ORDERS = {"16-first": SWEEP, "128-first": SWEEP[::-1]}
STAGE = {"shorthand": None, "stage128": 128, "first16": 16}
STATS = "produced consumed_shared detached alone_batches order_epoch hp_members storage_bytes staging_peak_bytes"
STATS = (*STATS.split(), "staging_bound")


def options(p) -> None:
    dataset.add_dataset_options(p, data="/var/tmp/coordl-bench/train")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--scenarios", default="same,cold,recovery,mix,handoff,slow,sweep")
    p.add_argument("--jobs", default=[2, 4], type=lambda x: [int(n) for n in x.split(",")], help="of same and cold")
    p.add_argument("--sleep", type=float, default=0.0, help="the fast trials' training step per batch (slow)")
    p.add_argument("--modes", default="shorthand,stage128,first16", help="of sweep")
    for a in ("--trial", "--ready", "--go"):  # a trial's spec (JSON: command) and its jobs.start_jobs files
        p.add_argument(a, help=argparse.SUPPRESS)


def run(args) -> dict | None:
    if args.trial:
        return trial(args)
    data = dataset.dataset_from_args(args)
    args.images, scenarios = data["files"], args.scenarios.split(",")  # a trial checks every epoch against it
    print(f"dataset: {dataset.describe(data)}")
    key = {name: f"slow_sleep_{args.sleep:g}" if name == "slow" else name for name in scenarios}
    results = kept(args.out, [*key.values(), "epochs", "reps"], data) | {"epochs": args.epochs, "reps": args.reps}
    workdir = Path(tempfile.mkdtemp(prefix="coordl-hp-"))
    try:
        if "cold" in scenarios:
            results["cold"] = cold(args, workdir)
        launch(args, workdir, [{"batch": 64}])  # fills the node's cache (kept): every run after warm
        for name in ("same", "recovery", "mix", "handoff", "slow", "sweep"):
            if name in scenarios:
                results[key[name]] = globals()[name](args, workdir)
    finally:
        reaper.reap(include_kept=True)
        shutil.rmtree(workdir, ignore_errors=True)  # the trials' go/ready files and outputs
    return {**results, "dataset": data}


def kept(path: str | Path, measured, dataset: dict | None = None) -> dict:
    """What a run that measures ``measured`` keeps of the earlier result at ``path``: its other results, each
    named in ``"earlier"`` with the command, commit and date it came from; nothing of another shape or dataset."""
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
    runs = compare(args, workdir, {"alone": alone, "group": [{**s, "group": name} for s in alone]})
    rates = {m: [statistics.mean(r["per_job_samples_per_s"]) for r in rs] for m, rs in runs.items()}
    ratios = [g / a for a, g in zip(rates["alone"], rates["group"])]
    print(f"{name}: group / alone per job = {[round(x, 2) for x in ratios]} (target >= {target:.2f})")
    return {"ratios": ratios, "ratio_median": statistics.median(ratios), "target": target, **runs}


def same(args, workdir: Path) -> list[dict]:
    return [{"jobs": n, **grouped(args, workdir, f"same{n}", [{"batch": 64}] * n, 0.9 * n)} for n in args.jobs]


def mix(args, workdir: Path) -> dict:
    r = grouped(args, workdir, "mix", [{"batch": b, "stage_batch": 64} for b in (16, 32, 64)], 0.85 * 3)
    return r | {"exactly_once": all(x["exactly_once"] for m in ("alone", "group") for x in r[m])}


def cold(args, workdir: Path) -> list[dict]:
    """One epoch of N trials alone and in a group, no cache, the dataset's pages evicted: the device's bytes."""
    dev, rows, before = measure.device_of(args.data), [], {}

    def evict():
        limits.evict(args.data)
        before["bytes"] = measure.sectors_read(dev)

    for n in args.jobs:
        row = {"jobs": n}
        for mode in ("alone", "group"):
            reaper.reap(include_kept=True)
            specs = [{"batch": 64, "group": mode == "group" and f"cold{n}", "epochs": 1}] * n
            outs = launch(args, workdir, specs, evict)
            row[mode] = {"device_bytes": measure.sectors_read(dev) - before["bytes"]}
            row[mode]["stats_storage_bytes"] = sum(e["storage_bytes"] for o in outs for e in o["epochs"])
            print(f"cold epoch, N={n} {mode}: {row[mode]['device_bytes'] / 1e6:.1f} MB from the device")
        rows.append(row)
    return rows


def recovery(args, workdir: Path) -> list[dict]:
    nb, progress = -(-args.images // 64), workdir / "progress0"
    progress.unlink(missing_ok=True)
    specs = [{"batch": 64, "group": "bench-kill", "progress": progress if k == 0 else None} for k in (0, 1, 2)]
    procs, outs = jobs.start_jobs([command(args, s) for s in specs], workdir)
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
        s = [summary(launch(args, workdir, [spec])) for _ in range(args.reps)]
        takes, reads = [x["take_ms_median"][0] for x in s], [x["read_ms_median"][0] for x in s]
        print(f"hand-off, batch {batch} staged as {staged}: next() {takes} ms, first read {reads} ms")
        rows.append({"batch": batch, "staged": staged, "take_ms": takes, "read_ms": reads})
    return rows


def slow(args, workdir: Path) -> dict:
    fast = {"batch": 64, "sleep": args.sleep, "group": "fast"}
    pair = summary(launch(args, workdir, [fast, fast]))
    per_batch = 64 / statistics.mean(pair["per_job_samples_per_s"])
    s_out = {"batch": 64, "sleep": 3 * per_batch}  # its training step alone takes 3x a fast trial's whole batch
    modes = {"pair": [fast, fast], "trio": [fast, fast, {**s_out, "group": "fast"}], "beside": [fast, fast, s_out]}
    runs = compare(args, workdir, modes)
    rates = {m: [r["per_job_samples_per_s"] for r in rs] for m, rs in runs.items()}
    fast_loss = [1 - statistics.mean(t[:2]) / statistics.mean(p) for p, t in zip(rates["pair"], rates["trio"])]
    slow_ratio = [t[2] / b[2] for t, b in zip(rates["trio"], rates["beside"])]
    print(f"slow: the fast lose {fast_loss} in the trio (target <= 0.1); the slow one, trio / beside = {slow_ratio}")
    kw = {"fast_sleep_s": args.sleep, "fast_batch_s_in_pair": per_batch, "slow_sleep_s": s_out["sleep"]}
    return {**kw, "fast_loss": fast_loss, "slow_trio_over_beside": slow_ratio, **runs}


def sweep(args, workdir: Path) -> dict:
    runs = {m: {o: [] for o in ORDERS if m != "first16" or o == "16-first"} for m in args.modes.split(",") if m}
    entered = [workdir / f"entered{k}" for k in range(3)]
    for r, (order, m) in measure.alternate([(o, m) for o in ORDERS for m in runs if o in runs[m]], args.reps):
        for e in entered:
            e.unlink(missing_ok=True)
        spec, after = {"group": "sweep", "stage_batch": STAGE[m], "last": entered[-1]}, [None, *entered[:-1]]
        specs = [{**spec, "batch": b, "after": a, "entered": e} for b, a, e in zip(ORDERS[order], after, entered)]
        load = [round(x, 2) for x in os.getloadavg()]
        outs = dict(zip(ORDERS[order], launch(args, workdir, specs)))
        s = {"samples_per_s": {b: rate(o) for b, o in outs.items()}}
        s["views"] = {b: o["views"] / o["batches"] for b, o in outs.items()}
        s |= {k: {b: o[k] for b, o in outs.items()} for k in ("first_batch_s", "epochs")}
        s |= {"stage_batch": sorted({o["stage_batch"] for o in outs.values()}), "loadavg_before": load}
        s["exactly_once"] = all(e["exactly_once"] for o in outs.values() for e in o["epochs"])
        runs[m][order].append(s | {"loadavg_after": [round(x, 2) for x in os.getloadavg()]})
        print(f"  rep {r + 1} {order} {m}: staged {s['stage_batch']}, {s['samples_per_s']}/s, views {s['views']}")
    ratios = {}
    for order in ORDERS if {"shorthand", "stage128"} <= set(runs) else ():
        short, by_hand = ([x["samples_per_s"] for x in runs[m][order]] for m in ("shorthand", "stage128"))
        per = [{b: x[b] / y[b] for b in SWEEP} for x, y in zip(short, by_hand)]
        means = {b: statistics.mean(x[b] for x in short) / statistics.mean(y[b] for y in by_hand) for b in SWEEP}
        ratios[order] = {"per_rep": per, "median": {b: statistics.median(p[b] for p in per) for b in SWEEP}}
        ratios[order]["of_means"] = means
        print(f"{order}: shorthand / stage_batch=128 per trial, median: {ratios[order]['median']} (target within 5%)")
    return {"runs": runs, "shorthand_over_stage128": ratios}


# -- a trial, and trials started together ---------------------------------------------------------
def trial(args) -> None:
    """One trial of the spec ``--trial`` (:func:`command`): waits for the go and ``after``, runs, writes ``--out``."""
    import coordl

    spec = json.loads(args.trial)
    name, stage = spec.get("group"), spec.get("stage_batch")
    group = coordl.HPGroup(name, stage_batch=stage) if name and stage else name
    out = {"group": name, "epochs": [], "take_s": [], "read_s": [], "times": [], "views": 0, "batches": 0}
    kw = {"pipeline": "imagenet-train", "device_id": None, "return_index": True, "shuffle": True}
    kw |= {"cache": coordl.Cache(size=1.0, keep=True), "hp_group": group or None}
    with coordl.CoordLoader(args.data, batch_size=spec["batch"], **kw) as loader:
        jobs.wait_for_go(args.ready, args.go)
        _wait_file(spec.get("after"))
        for epoch in range(spec["epochs"]):
            loader.set_epoch(epoch)
            t0, b0 = time.monotonic(), out["batches"]
            it = iter(loader)
            if epoch == 0 and spec.get("entered"):
                Path(spec["entered"]).touch()
                _wait_file(spec["last"])  # every trial is a member of the group's first pass
                t0 = time.monotonic()
            seen, t = [], time.monotonic()
            for x, _, ids in it:  # per batch: next()'s time, the first read's, when it came, a view or a copy
                t1 = time.monotonic()
                x.sum()
                out["take_s"].append(t1 - t)
                out["read_s"].append(time.monotonic() - t1)
                out["times"].append(t1)
                out["views"] += not x.untyped_storage().resizable()  # a mapping of the slot, not a copy
                out["batches"] += 1
                if not seen and epoch == 0:
                    out["first_batch_s"] = t1 - t0
                seen += ids.tolist()
                if spec.get("progress"):
                    Path(spec["progress"]).write_text(str(out["batches"]))
                time.sleep(spec.get("sleep") or 0)
                t = time.monotonic()
            s = loader.stats()
            out["stage_batch"] = s.get("stage_batch")
            once = len(seen) == len(set(seen)) == spec["images"]
            e = {"seconds": time.monotonic() - t0, "samples": len(seen), "batches": out["batches"] - b0}
            out["epochs"].append(e | {"exactly_once": once} | {k: s.get(k) for k in STATS})
    ru = resource.getrusage(resource.RUSAGE_SELF)
    Path(args.out).write_text(json.dumps(out | {"cpu_s": ru.ru_utime + ru.ru_stime}))


def _wait_file(path: str | None) -> None:
    while path and not os.path.exists(path):
        time.sleep(0.001)


def command(args, spec: dict) -> list[str]:
    """One trial of ``spec`` (``batch``; ``group``, ``stage_batch``, ``sleep``, ``epochs``, files: :func:`trial`)."""
    spec = json.dumps({"epochs": args.epochs, "images": args.images, **spec}, default=str)
    return jobs.scenario_command("hp_group", "--data", args.data, "--trial", spec)


def launch(args, workdir: Path, specs: list[dict], before_go=None) -> list[dict]:
    """Runs trials of ``specs`` together (:func:`command`); returns what each wrote."""
    return jobs.run_together([command(args, s) for s in specs], workdir, before_go)


def rate(out: dict) -> float:
    """Samples/s of a trial over its epochs after the first (pipeline build, joining)."""
    steady = out["epochs"][1:]
    return sum(e["samples"] for e in steady) / sum(e["seconds"] for e in steady)


def summary(outs: list[dict]) -> dict:
    """Trials run together: per-trial samples/s, exactly once, the medians of ``next()`` and of the first read;
    per epoch, batches decoded (a member's ``produced``) and CPU seconds; the staging peak after the first epoch."""
    n, every = len(outs[0]["epochs"]), [e for o in outs for e in o["epochs"]]
    out = {"per_job_samples_per_s": [rate(o) for o in outs], "exactly_once": all(e["exactly_once"] for e in every)}
    out |= {f"{k}_ms_median": [1000 * statistics.median(o[f"{k}_s"]) for o in outs] for k in ("take", "read")}
    decoded = sum(e["produced"] if o["group"] else e["batches"] for o in outs for e in o["epochs"])
    out["batches_decoded_per_epoch"] = decoded / n
    out["cpu_s_per_epoch"] = sum(o["cpu_s"] for o in outs) / n
    out["staging_peak_bytes"] = max(e["staging_peak_bytes"] or 0 for o in outs for e in o["epochs"][1:])
    return out | {"epochs": [o["epochs"] for o in outs]}


def compare(args, workdir: Path, modes: dict[str, list[dict]]) -> dict:
    """Runs each mode's trials ``--reps`` times, the modes ABBA; per mode its runs' :func:`summary`."""
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    for r, m in measure.alternate(list(modes), args.reps):
        runs[m].append(s := summary(launch(args, workdir, modes[m])))
        print(f"  rep {r + 1} {m:>8}: per job {[round(x) for x in s['per_job_samples_per_s']]} samples/s")
    return runs
