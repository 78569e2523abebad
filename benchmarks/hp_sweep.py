"""A sweep of batch sizes in one HP group: the default staged batch against ``stage_batch`` chosen by hand.

Three trials of batch 16, 64 and 128 share an ``hp_group`` over the same ImageNet-like dataset,
the MinIO cache warm, the standard training recipe at 224 on the CPU (prep-bound). They enter the
group in a set order (each calls ``iter(loader)`` once the one before it has: the first makes the
group's staging area, so decides its staged batch), then all start consuming together. A trial
reads each batch (``x.sum()``); per-trial samples/s is taken over the epochs after the first.

Modes (``--modes``), each run in both start orders (16 first, 128 first), alternated ``--reps``
times:

- ``shorthand``: ``hp_group="sweep"``, the default staged batch (``HPGroup(stage_batch=None)``);
- ``stage128``: ``HPGroup("sweep", stage_batch=128)``, the sweep's largest batch size by hand;
- ``first16``: ``HPGroup("sweep", stage_batch=16)``, 16 first only: what the shorthand did before
  the default changed when the trial of 16 started first (batches of 64 and 128 copied).

Target: every trial's samples/s with the shorthand within 5% of ``stage128``'s, in either order;
each trial gets every batch as a view (no copy) in both; every epoch exactly once. Also reported:
the group's staged batch (``stats()["stage_batch"]``), and each trial's first batch's latency
(from its ``iter()`` to its first batch, which waits for a whole staged batch).

    python -m benchmarks.hp_sweep --data /var/tmp/coordl-bench/train --images 2000
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import common
from benchmarks.hp_mix import mean, rate

HERE = Path(__file__).resolve().parent
SWEEP = (16, 64, 128)
ORDERS = {"16-first": SWEEP, "128-first": SWEEP[::-1]}


def _wait_file(path: str) -> None:
    while not os.path.exists(path):
        time.sleep(0.001)


def job(args) -> None:
    """One trial: waits for the go file and for the trial before it to enter the group, enters,
    waits for every trial to have entered, runs its epochs, writes what it saw."""
    import coordl

    group = coordl.HPGroup(args.group, stage_batch=args.stage_batch) if args.stage_batch else args.group
    out = {"epochs": [], "views": 0, "batches": 0}
    with coordl.CoordLoader(
        args.data,
        batch_size=args.batch_size,
        shuffle=True,
        pipeline="imagenet-train",
        device_id=None,
        return_index=True,
        cache=coordl.Cache(size=1.0, keep=True),
        hp_group=group,
    ) as loader:
        common.wait_for_go(args.ready, args.go)
        if args.after:
            _wait_file(args.after)
        for epoch in range(args.epochs):
            loader.set_epoch(epoch)
            t0 = time.perf_counter()
            it = iter(loader)
            if epoch == 0:
                Path(args.entered).touch()
                _wait_file(args.last)  # every trial is a member of the group's first pass
                t0 = time.perf_counter()
            seen, n = [], 0
            for x, _, ids in it:
                if not n and epoch == 0:
                    out["first_batch_s"] = time.perf_counter() - t0
                x.sum()
                out["views"] += not x.untyped_storage().resizable()  # a mapping of the slot, not a copy
                out["batches"] += 1
                seen += ids.tolist()
                n += len(ids)
            s = loader.stats()
            out["stage_batch"] = s.get("stage_batch")
            out["epochs"].append(
                {
                    "seconds": time.perf_counter() - t0,
                    "samples": n,
                    "exactly_once": len(seen) == len(set(seen)) == args.images,
                    **{k: s.get(k) for k in ("produced", "consumed_shared", "detached", "order_epoch")},
                }
            )
    Path(args.out).write_text(json.dumps(out))


def launch(args, workdir: Path, batches: tuple[int, ...], stage_batch: int | None) -> list[dict]:
    """Runs trials of ``batches`` in one group, entering it in that order; what each wrote, in that order."""
    go = workdir / "go"
    go.unlink(missing_ok=True)
    entered = [workdir / f"entered{k}" for k in range(len(batches))]
    for e in entered:
        e.unlink(missing_ok=True)
    commands, files = [], []
    for k, b in enumerate(batches):
        out, ready = common.job_files(workdir, k)
        cmd = common.module_command(
            "hp_sweep",
            "--job",
            "--data",
            args.data,
            "--images",
            str(args.images),
            "--batch-size",
            str(b),
            "--epochs",
            str(args.epochs),
            "--group",
            "sweep",
            "--stage-batch",
            str(stage_batch or 0),
            "--after",
            str(entered[k - 1]) if k else "",
            "--entered",
            str(entered[k]),
            "--last",
            str(entered[-1]),
            "--ready",
            str(ready),
            "--go",
            str(go),
            "--out",
            str(out),
        )
        commands.append(cmd)
        files.append((out, ready))
    procs = common.start_together(commands, [r for _, r in files], go)
    for p in procs:
        p.wait()
    if any(p.returncode for p in procs):
        raise SystemExit(f"a trial failed: exit codes {[p.returncode for p in procs]}")
    return [json.loads(out.read_text()) for out, _ in files]


def summary(outs: list[dict], batches: tuple[int, ...]) -> dict:
    """Per trial, keyed by batch size: samples/s, the share of its batches that were views, its
    first batch's latency; and the group's staged batch."""
    return {
        "samples_per_s": {b: rate(o) for b, o in zip(batches, outs, strict=True)},
        "views": {b: o["views"] / o["batches"] for b, o in zip(batches, outs, strict=True)},
        "first_batch_s": {b: o["first_batch_s"] for b, o in zip(batches, outs, strict=True)},
        "stage_batch": sorted({o["stage_batch"] for o in outs}),
        "exactly_once": all(e["exactly_once"] for o in outs for e in o["epochs"]),
        "epochs": {b: o["epochs"] for b, o in zip(batches, outs, strict=True)},
    }


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def main() -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.hp_sweep", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--job", action="store_true", help=argparse.SUPPRESS)
    for a in ("--group", "--after", "--entered", "--last", "--ready", "--go", "--out"):
        p.add_argument(a, help=argparse.SUPPRESS)
    p.add_argument("--batch-size", type=int, default=64, help=argparse.SUPPRESS)
    p.add_argument("--stage-batch", type=int, default=0, help=argparse.SUPPRESS)
    common.add_dataset_options(p, data="/var/tmp/coordl-bench/train")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--modes", default="shorthand,stage128,first16")
    p.add_argument("--orders", default=",".join(ORDERS), help="start orders to run: 16-first, 128-first")
    p.add_argument("--result", default=str(HERE / "results" / "hp_sweep.json"))
    args = p.parse_args()
    if args.job:
        job(args)
        return 0

    from coordl.shm import reaper

    dataset = common.dataset_from_args(args)
    args.images = dataset["files"]
    print(f"dataset: {common.describe(dataset)}")
    stage = {"shorthand": None, "stage128": 128, "first16": 16}
    modes = [m for m in args.modes.split(",") if m]
    orders = [o for o in args.orders.split(",") if o]
    unknown = sorted(set(orders) - set(ORDERS))
    if unknown:
        raise SystemExit(f"--orders: unknown {unknown}; choose from {sorted(ORDERS)}")
    runs: dict[str, dict[str, list[dict]]] = {
        m: {o: [] for o in orders if m != "first16" or o == "16-first"} for m in modes
    }
    workdir = Path(tempfile.mkdtemp(prefix="coordl-hp-sweep-"))
    results = {"machine": common.machine(), "dataset": dataset, "epochs": args.epochs, "reps": args.reps}
    try:
        launch(args, workdir, (64,), None)  # fills the node's cache (kept): every run starts warm
        for r in range(args.reps):
            for order in orders:
                batches = ORDERS[order]
                # ABBA: each mode runs first in one rep and second in the next, so that a drift of
                # the machine (the page cache, the CPU's clock) favours neither.
                for m in modes if r % 2 == 0 else modes[::-1]:
                    if order not in runs[m]:
                        continue
                    before = loadavg()
                    s = summary(launch(args, workdir, batches, stage[m]), batches)
                    s["loadavg_before"], s["loadavg_after"] = before, loadavg()
                    runs[m][order].append(s)
                    rates = {b: round(x) for b, x in s["samples_per_s"].items()}
                    views = {b: f"{100 * v:.0f}%" for b, v in s["views"].items()}
                    print(
                        f"  rep {r + 1} {order:>9} {m:>9}: staged {s['stage_batch']}, samples/s {rates}, "
                        f"views {views}, load {before} -> {s['loadavg_after']}"
                    )
    finally:
        reaper.reap(include_kept=True)
        for f in workdir.iterdir():
            f.unlink()
        workdir.rmdir()
    results["runs"] = runs
    ratios = {}
    if "shorthand" in runs and "stage128" in runs:
        for order in orders:
            pairs = zip(runs["shorthand"][order], runs["stage128"][order], strict=True)
            per = [{b: a["samples_per_s"][b] / c["samples_per_s"][b] for b in SWEEP} for a, c in pairs]
            ratios[order] = {
                "per_rep": per,
                "median": {b: statistics.median(p[b] for p in per) for b in SWEEP},
                "of_means": {
                    b: mean([a["samples_per_s"][b] for a in runs["shorthand"][order]])
                    / mean([c["samples_per_s"][b] for c in runs["stage128"][order]])
                    for b in SWEEP
                },
            }
            print(
                f"{order}: shorthand / stage_batch=128 per trial (median of {args.reps}): "
                f"{ {b: round(x, 3) for b, x in ratios[order]['median'].items()} } (target within 5%)"
            )
    results["shorthand_over_stage128"] = ratios
    Path(args.result).parent.mkdir(parents=True, exist_ok=True)
    Path(args.result).write_text(json.dumps(results, indent=1))
    print(f"wrote {args.result}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
