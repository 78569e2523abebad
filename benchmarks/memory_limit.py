"""The cache under a memory limit: a loader in a v1 memory cgroup that leaves room for part of the dataset.

(1) The loader's own memory: a child with ``cache=0`` in an unlimited cgroup (peak RSS; the cgroup's peak).
(2) The limit: its peak RSS x 1.2 + 64 MiB + ``--cache-fraction`` of the dataset, or ``--limit``. (3) A child
per ``--cache`` value in a fresh cgroup with that limit: exit status, the cgroup's peak, failcnt and OOM kills,
the budget, what was cached, the warnings, every sample exactly once per epoch. Root, a v1 memory cgroup.

    python -m benchmarks memory_limit --data /var/tmp/coordl-bench/memlimit --size 158MiB --classes 10
    python -m benchmarks memory_limit ... --limit 602MiB     # the issue's limit, as measured there
    python -m benchmarks memory_limit --data /var/tmp/coordl-bench/memlimit510 --size 510MB --classes 10 \
        --image-size 64 --batch-size 16 --num-threads 2 --io-threads 2     # tests/test_memory_limit.py's scenario
"""

import argparse
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.harness import dataset, jobs, limits, measure, report
from benchmarks.harness.report import mb
from coordl.units import parse_bytes

STATS = ("storage_reads", "cache_hits", "cache_items", "cache_bytes")  # per epoch, of stats()


def child(args) -> None:
    """Runs in the cgroup: moves itself in first, then makes the loader and iterates it."""
    Path(args.cgroup, "cgroup.procs").write_text(f"{os.getpid()}\n")
    import logging.handlers
    import resource
    import warnings

    import numpy as np

    import coordl

    said, ids, peak = logging.handlers.BufferingHandler(1 << 20), [], [charged(args.cgroup)]

    def step(batch) -> None:
        ids.append(batch[2].numpy())
        peak[0] = max(peak[0], charged(args.cgroup))

    logging.getLogger("coordl").addHandler(said)
    warnings.simplefilter("always")
    cache = args.cache  # "auto", "40MB", an int of bytes or a float fraction, as CoordLoader takes it
    cache = int(cache) if cache.isdigit() else float(cache) if re.fullmatch(r"[0-9]*\.[0-9]+", cache) else cache
    kw = {"pipeline": coordl.ImageNetTrain(size=args.image_size), "fetch": coordl.Fetch(threads=args.io_threads)}
    kw |= {"device_id": None, "return_index": True, "seed": 0, "cache": cache, "prep": args.num_threads}
    with warnings.catch_warnings(record=True) as rec:
        with coordl.CoordLoader(args.data, batch_size=args.batch_size, shuffle=True, **kw) as loader:
            n, budget = len(loader.index), loader.node_cache.budget if loader.node_cache is not None else 0
            es = measure.epochs(loader, args.epochs, step=step, keys=STATS)
    got = np.split(np.concatenate(ids), np.cumsum([e["samples"] for e in es])[:-1])
    out = {"cache_bytes": args.cache, "budget": budget, "epochs": [], "peak_charged": peak[0]}
    for k, (e, g) in enumerate(zip(es, got)):
        once = bool(np.array_equal(np.sort(g), np.arange(n)))
        out["epochs"].append({"epoch": k, "seconds": round(e["seconds"], 2), "exactly_once": once, **e["stats"]})
    out["warnings"] = [str(w.message) for w in rec if issubclass(w.category, RuntimeWarning)]
    out["warnings"] += [r.getMessage() for r in said.buffer if r.levelno >= logging.WARNING]
    out["peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # VmHWM
    jobs.say(**out)


def charged(cgroup: str) -> int:
    """What the cgroup is charged for beyond the page cache: its usage less its reclaimable file pages."""
    stat = limits.memory_stat(cgroup)
    return int(Path(cgroup, "memory.usage_in_bytes").read_text()) - stat["total_cache"] + stat["total_shmem"]


def run_child(args, name: str, cache: str, limit: int | None) -> dict:
    """One child in a fresh memory cgroup (``limit`` None: unlimited); its report and the cgroup's counters."""
    cg = limits.Cgroup("memory", f"coordl-memlimit-{os.getpid()}-{name}")
    shm = tempfile.mkdtemp(prefix="coordl-memlimit-", dir="/dev/shm")  # what a killed child leaves goes with it
    try:
        if limit is not None:
            cg.write("memory.limit_in_bytes", limit)
        kw = {"epochs": args.epochs, "batch_size": args.batch_size, "image_size": args.image_size, "cache": cache}
        kw |= {"io_threads": args.io_threads, "num_threads": args.num_threads or None, "cgroup": cg.path}
        cmd, t0 = jobs.scenario_command("memory_limit", *jobs.flags(child=True, data=args.data, **kw)), time.time()
        said = jobs.outcome(cmd, timeout=1800, env={**os.environ, "COORDL_SHM_DIR": shm})
        row = {"run": name, "cache_bytes": cache, "limit": limit, "returncode": said.pop("returncode", 0)}
        row |= {"seconds": round(time.time() - t0, 1), "max_usage": int(cg.read("memory.max_usage_in_bytes"))}
        oom = dict(line.split() for line in cg.read("memory.oom_control").splitlines())
        return row | {"failcnt": int(cg.read("memory.failcnt")), "oom_kill": int(oom.get("oom_kill", 0))} | said
    finally:
        cg.remove()
        shutil.rmtree(shm, ignore_errors=True)


def options(p) -> None:
    dataset.add_dataset_options(p, data="/var/tmp/coordl-bench/memlimit", images=None, size="158MiB", classes=10)
    p.add_argument("--cache", default="auto,1.0", help="cache_bytes values to run, comma-separated")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--image-size", type=int, default=224, help="the recipe's crop (default 224)")
    p.add_argument("--num-threads", type=int, help="DALI threads (default: coordl's)")
    p.add_argument("--io-threads", type=int, default=8)
    p.add_argument("--cache-fraction", type=float, default=0.3, help="room for this fraction of the dataset")
    p.add_argument("--limit", type=parse_bytes, help="the memory limit (default: from the formula above)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--cgroup", help=argparse.SUPPRESS)


def run(args) -> dict | None:
    if args.child:
        return child(args)
    if not (ok := limits.probe())["memory"]:
        raise SystemExit("cannot run: " + "; ".join(ok["notes"]))
    data = dataset.dataset_from_args(args)
    print(f"dataset: {dataset.describe(data)}")
    own = run_child(args, "own", "0", None)
    if own["returncode"] != 0:
        raise SystemExit(f"the loader failed without a cache: {own['error']}")
    limit = args.limit or int(own["peak_rss"] * 1.2) + (64 << 20) + int(args.cache_fraction * data["total_bytes"])
    how = "--limit" if args.limit else f"peak RSS x1.2 + 64 MiB + {args.cache_fraction:.0%} of the dataset"
    print(f"own memory with cache_bytes=0: peak RSS {mb(own['peak_rss'])} MB, cgroup peak {mb(own['max_usage'])} MB")
    print(f"limit ({how}) = {mb(limit)} MB")
    rows = [own] + [run_child(args, f"c{k}", c, limit) for k, c in enumerate(args.cache.split(","))]
    print(*(r["error"] + "\n" for r in rows if "error" in r), sep="", end="", file=sys.stderr)
    return {"dataset": data, "limit": limit, "runs": rows}


def table(result: dict) -> str:
    rows = []
    for r in result["runs"]:
        last, warned = (r.get("epochs") or [{}])[-1], r.get("warnings", [])
        once = bool(r.get("epochs")) and all(e["exactly_once"] for e in r["epochs"])
        mbs = [mb(x) for x in (r["limit"], r["max_usage"], r.get("budget"), last.get("cache_bytes"))]
        rows.append([r["run"], r["cache_bytes"], mbs[0], r["returncode"], r["oom_kill"], *mbs[1:]])
        rows[-1] += [any("stopped growing" in m for m in warned), once]
    head = "run|cache_bytes|limit MB|exit|oom kills|peak MB|budget MB|cached MB|stopped|exactly once"
    return report.table(head, rows)
