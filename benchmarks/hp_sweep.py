"""A sweep of batch sizes in one HP group: the default staged batch against stage_batch chosen by hand.

Three trials (:mod:`benchmarks.hp_trials`) of batch 16, 64 and 128 share an ``hp_group``; they enter
the group in a set order (each calls ``iter(loader)`` once the one before it has: the first makes the
staging area, so decides its staged batch), then all consume together. Per-trial samples/s over the
epochs after the first. Modes (``--modes``), each in both start orders (16 first, 128 first), ABBA
``--reps`` times:

- ``shorthand``: ``hp_group="sweep"``, the default staged batch;
- ``stage128``: ``HPGroup("sweep", stage_batch=128)``, the sweep's largest batch by hand;
- ``first16``: ``HPGroup("sweep", stage_batch=16)``, 16 first only: what the shorthand staged before.

Target: every trial's samples/s with the shorthand within 5% of ``stage128``'s, in either order; every
batch a view (no copy) in both; every epoch exactly once. Also: the group's staged batch and each
trial's first batch's latency.

    python -m benchmarks hp_sweep --modes shorthand,stage128 --reps 4    # ~8 min on 2 cores
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
from pathlib import Path

from benchmarks import hp_trials
from benchmarks.harness import measure
from benchmarks.hp_trials import mean

SWEEP = (16, 64, 128)
ORDERS = {"16-first": SWEEP, "128-first": SWEEP[::-1]}
STAGE = {"shorthand": None, "stage128": 128, "first16": 16}


def options(p) -> None:
    hp_trials.add_options(p)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--modes", default="shorthand,stage128,first16")
    p.add_argument("--orders", default=",".join(ORDERS), help="start orders to run: 16-first, 128-first")


def launch(args, workdir: Path, batches: tuple[int, ...], stage_batch: int | None) -> list[dict]:
    """Trials of ``batches`` in one group, entering it in that order; what each wrote, in that order."""
    entered = [workdir / f"entered{k}" for k in range(len(batches))]
    for e in entered:
        e.unlink(missing_ok=True)
    specs = [
        {
            "batch": b,
            "group": "sweep",
            "stage_batch": stage_batch,
            "after": entered[k - 1] if k else None,
            "entered": entered[k],
            "last": entered[-1],
        }
        for k, b in enumerate(batches)
    ]
    return hp_trials.launch(args, "hp_sweep", workdir, specs)


def summary(outs: list[dict], batches: tuple[int, ...]) -> dict:
    """Per trial, keyed by batch size: samples/s, the share of its batches that were views, its first
    batch's latency; and the group's staged batch."""
    by = list(zip(batches, outs, strict=True))
    return {
        "samples_per_s": {b: hp_trials.rate(o) for b, o in by},
        "views": {b: o["views"] / o["batches"] for b, o in by},
        "first_batch_s": {b: o["first_batch_s"] for b, o in by},
        "stage_batch": sorted({o["stage_batch"] for o in outs}),
        "exactly_once": all(e["exactly_once"] for o in outs for e in o["epochs"]),
        "epochs": {b: o["epochs"] for b, o in by},
    }


def run(args) -> dict | None:
    if args.trial:
        return hp_trials.trial(args)
    from coordl.shm import reaper

    data = hp_trials.images(args)
    modes, orders = [m for m in args.modes.split(",") if m], [o for o in args.orders.split(",") if o]
    if unknown := sorted(set(orders) - set(ORDERS)):
        raise SystemExit(f"--orders: unknown {unknown}; choose from {sorted(ORDERS)}")
    runs = {m: {o: [] for o in orders if m != "first16" or o == "16-first"} for m in modes}
    workdir = Path(tempfile.mkdtemp(prefix="coordl-hp-sweep-"))
    try:
        hp_trials.launch(args, "hp_sweep", workdir, [{"batch": 64}])  # fills the node's cache (kept)
        for r, (order, m) in measure.alternate([(o, m) for o in orders for m in modes], args.reps):
            if order not in runs[m]:
                continue
            before = [round(x, 2) for x in os.getloadavg()]
            s = summary(launch(args, workdir, ORDERS[order], STAGE[m]), ORDERS[order])
            s["loadavg_before"], s["loadavg_after"] = before, [round(x, 2) for x in os.getloadavg()]
            runs[m][order].append(s)
            rates = {b: round(x) for b, x in s["samples_per_s"].items()}
            views = {b: f"{100 * v:.0f}%" for b, v in s["views"].items()}
            print(f"  rep {r + 1} {order:>9} {m:>9}: staged {s['stage_batch']}, samples/s {rates}, views {views}")
    finally:
        reaper.reap(include_kept=True)
        shutil.rmtree(workdir, ignore_errors=True)
    ratios = {}
    if "shorthand" in runs and "stage128" in runs:
        for order in orders:
            short, by_hand = runs["shorthand"][order], runs["stage128"][order]
            per = [{b: a["samples_per_s"][b] / c["samples_per_s"][b] for b in SWEEP} for a, c in zip(short, by_hand)]
            ratios[order] = {
                "per_rep": per,
                "median": {b: statistics.median(p[b] for p in per) for b in SWEEP},
                "of_means": {
                    b: mean([a["samples_per_s"][b] for a in short]) / mean([c["samples_per_s"][b] for c in by_hand])
                    for b in SWEEP
                },
            }
            print(
                f"{order}: shorthand / stage_batch=128 per trial (median of {args.reps}): "
                f"{ {b: round(x, 3) for b, x in ratios[order]['median'].items()} } (target within 5%)"
            )
    return {"dataset": data, "epochs": args.epochs, "reps": args.reps, "runs": runs, "shorthand_over_stage128": ratios}
