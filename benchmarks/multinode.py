"""The partitioned cache across nodes: storage bytes, peer bytes and epoch time on 2 and 4 nodes.

Each "node" a network namespace with a private /dev/shm (``coordl_testing.netns.Cluster``), a 1 Gbit/s ``tbf``
link, a blkio cgroup throttling the dataset's device to ``--throttle-frac`` x the node's prep rate (measured
first, unthrottled); one torchrun rank per node. Per aggregate cache, ABBA ``--reps`` times, a fresh cluster per
run: ``a`` no peer cache, ``b`` partitioned, ``c`` partitioned and locality-aware. Targets: b's and c's steady
storage at the minimum (dataset - cached across nodes), c's peer bytes <= 10% of b's, b >= 2x faster than a at
100%. A .md beside the JSON has the tables per node and epoch. Root, network namespaces, v1 blkio.

    python -m benchmarks multinode                     # ~20 min on 2 cores
    python -m benchmarks multinode --quick             # smoke test: 128 images, 2 nodes, 2 epochs, ~1 min
"""

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.harness import cli, dataset, limits, measure, report
from benchmarks.harness.report import mb
from coordl_testing import netns

BLKIO = Path("/sys/fs/cgroup/blkio")
CROP, MARGIN, RATE = 64, 1.1, "1gbit"  # crops in pixels; at 100%, a node caches MARGIN / nodes; links' tbf
MODES = {"a": "no peer cache", "b": "partitioned", "c": "partitioned + locality"}
STAT_KEYS = "epoch samples samples_per_s storage_bytes peer_bytes peer_served_bytes cache_hit_bytes cache_bytes".split()
SUMMED = "storage_bytes blkio_read_bytes peer_bytes peer_served_bytes cache_hit_bytes samples".split()
CHECKS_FIRST = ("nodes", "aggregate_cache", "repetitions")


def options(p) -> None:
    p.add_argument("--job", help=argparse.SUPPRESS)  # one rank's spec (JSON: one_run), started by torchrun
    root = "dataset root (default: /var/tmp/coordl-bench/multinode-<images>)"
    dataset.add_dataset_options(p, data=None, images=2048, classes=16, data_help=root)
    p.add_argument("--nodes", default="2,4", help="node counts, e.g. 2,4")
    p.add_argument("--aggregate", default="0.5,1.0", help="aggregate cache sizes, fractions of the dataset")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--reps", type=int, default=2, help="repetitions of every configuration's modes, ABBA")
    p.add_argument("-b", "--batch-size", type=int, default=64)
    p.add_argument("--throttle-frac", type=float, default=0.1, help="storage throttle, x the node's prep rate")
    p.add_argument("--quick", action="store_true", help="smoke test: 128 images, 2 nodes, 2 epochs")


def job(a: dict) -> None:
    """One rank (started by torchrun): ``tests/multinode_train.py``'s loop, and the node's blkio counter."""
    import torch.distributed as dist

    import coordl

    dist.init_process_group("gloo")
    peers = coordl.Peers(enabled="auto" if a["mode"] != "a" else False, locality_aware=a["mode"] == "c")
    kw = {"pipeline": coordl.ImageNetTrain(size=CROP), "device_id": None, "seed": 5, "shuffle": True}
    loader = coordl.CoordLoader(a["data"], batch_size=a["batch_size"], cache=a["cache"], prep=1, peers=peers, **kw)
    record = {"rank": dist.get_rank(), "epochs": []}
    for epoch in range(a["epochs"]):
        loader.set_epoch(epoch)
        dev0, t0 = limits.blkio_read(a["blkio"], a["device"]), time.perf_counter()
        for _ in loader:
            pass
        e = {"time_s": time.perf_counter() - t0, "blkio_read_bytes": limits.blkio_read(a["blkio"], a["device"]) - dev0}
        record["epochs"].append(e | {k: loader.stats()[k] for k in STAT_KEYS})
        Path(a["work"], f"rank{record['rank']}.json").write_text(json.dumps(record))
    dist.barrier()  # the nodes end together (test_peers.py checks Peers(linger) for nodes that do not)
    loader.close()
    dist.destroy_process_group()


def one_run(args, data: dict, nodes: int, budget: int, mode: str, port: int, throttle=None) -> dict:
    """One job of ``nodes`` nodes in a fresh cluster, each node in a blkio cgroup (``throttle``: bytes/s)."""
    work, device = Path(tempfile.mkdtemp(prefix="cdl-mn-")), "{}:{}".format(*measure.device_of(data["root"]))
    job = {"data": data["root"], "work": str(work), "mode": mode, "device": device, "cache": budget}
    job |= {"epochs": args.epochs, "batch_size": args.batch_size}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "--nnodes", str(nodes)]
    env, t0 = dict(os.environ, GLOO_SOCKET_IFNAME="eth0", OMP_NUM_THREADS="1"), time.perf_counter()
    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, work)
        cgroups = []  # the cluster kills what is left in them
        for k in range(nodes):
            cgroups.append(cg := limits.Cgroup("blkio", f"cdl-mn{os.getpid()}-{port}-{k}"))
            stack.callback(cg.remove)
            if throttle:
                cg.write("blkio.throttle.read_bps_device", f"{device} {throttle}")
        limits.evict(data["root"])
        c, procs = stack.enter_context(netns.Cluster(nodes, rate=RATE, shm_bytes=budget + (256 << 20))), []
        for k, cg in enumerate(cgroups):
            where = ["--node_rank", str(k), "--master_addr", c.address(0), "--master_port", str(port), "-m"]
            rank = [*torchrun, *where, "benchmarks", "multinode", "--job", json.dumps(job | {"blkio": str(cg.path)})]
            log = stack.enter_context(open(work / f"node{k}.log", "w"))  # noqa: SIM115 - closed by the stack
            procs.append(c.popen(k, rank, env=env, cgroups=[str(cg.path)], stdout=log, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + 900
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):  # the cluster's close() kills it
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
        wall, texts = time.perf_counter() - t0, [(work / f"node{k}.log").read_text() for k in range(nodes)]
        if any(codes := [p.returncode for p in procs]):
            raise RuntimeError(f"exit codes {codes}; logs:\n" + "\n----\n".join(t[-3000:] for t in texts))
        per_node = [json.loads((work / f"rank{k}.json").read_text()) for k in range(nodes)]
    out = {"nodes": nodes, "mode": mode, "mode_name": MODES[mode], "budget_per_node": budget, "throttle_bps": throttle}
    return out | {"wall_s": round(wall, 1), "per_node": per_node, "epochs": epoch_totals(data, per_node, mode)}


def epoch_totals(data: dict, per_node: list[dict], mode: str) -> list[dict]:
    """Per epoch over the nodes: the slowest time, the bytes summed, the minimum storage (dataset - cached)."""
    totals = []
    for k in range(len(per_node[0]["epochs"])):
        rows = [n["epochs"][k] for n in per_node]
        cached = sum(n["epochs"][k - 1]["cache_bytes"] for n in per_node) if k else 0
        t = {"epoch": k, "time_s": max(x["time_s"] for x in rows), "cached_bytes_start": cached}
        t |= {key: sum(x[key] or 0 for x in rows) for key in SUMMED}
        # The minimum holds when the nodes share their caches; without peers (mode a) it does not apply.
        totals.append(t | {"minimum_storage_bytes": data["total_bytes"] - cached if mode != "a" else None})
    return totals


def checks(runs: dict) -> list[dict]:
    """Per node count and aggregate cache (``runs[(nodes, aggregate)][mode]``: that mode's runs): each mode's
    means over its runs' steady epochs, and the verdicts."""
    out = []
    for (nodes, agg), by_mode in sorted(runs.items()):
        row, m = {"nodes": nodes, "aggregate_cache": agg, "repetitions": len(by_mode[min(by_mode)])}, set(by_mode)
        for mode, rs in sorted(by_mode.items()):
            for k in ("time_s", "storage_bytes", "minimum_storage_bytes", "blkio_read_bytes", "peer_bytes"):
                values = [t[k] for r in rs for t in r["epochs"][1:] or r["epochs"]]  # the steady epochs
                row[f"{mode}_{k}"] = None if None in values else statistics.mean(values)
        for x in sorted(set("bc") & m):  # 1%: the few items padding repeats
            row[f"{x}_storage_at_minimum"] = row[f"{x}_storage_bytes"] <= 1.01 * row[f"{x}_minimum_storage_bytes"]
            if "a" in m:
                row[f"a_time_over_{x}_time"] = round(row["a_time_s"] / row[f"{x}_time_s"], 3)
        if {"b", "c"} <= m:
            b = row["b_peer_bytes"]
            row["c_peer_over_b_peer"] = round(row["c_peer_bytes"] / b, 5) if b else None
            row["c_peer_at_most_10pct_of_b"] = row["c_peer_bytes"] <= 0.1 * row["b_peer_bytes"]
        if {"a", "b"} <= m and agg >= 1.0:
            row["b_at_least_2x_faster_than_a"] = row["a_time_s"] >= 2.0 * row["b_time_s"]
        out.append(row)
    return out


def run(args) -> dict | None:
    if args.job:
        return job(json.loads(args.job))
    if args.quick:
        args.images, args.size, args.nodes, args.epochs, args.reps = 128, None, "2", 2, 1
    args.data = args.data or f"/var/tmp/coordl-bench/multinode-{args.images or args.size}"
    if why := netns.unavailable() or (None if (BLKIO / "blkio.throttle.read_bps_device").exists() else "no v1 blkio"):
        raise SystemExit(f"cannot run: {why}")
    started, data = time.perf_counter(), dataset.dataset_from_args(args)
    result, runs, log = {"dataset": data, "prep": {}, "runs": [], "checks": []}, {}, []  # log: the .md's sections
    port, total = 29700 + os.getpid() % 100 * 10, data["total_bytes"]
    for nodes in (int(x) for x in args.nodes.split(",")):
        port, full = port + 1, min(total, int(total * MARGIN / nodes))
        # Unthrottled, it also leaves the libraries in the page cache for the throttled runs (each evicts the dataset).
        prep = one_run(args, data, nodes, full, "b", port)
        rates = [e["samples_per_s"] for n in prep["per_node"] for e in n["epochs"][1:] or n["epochs"]]
        sps = statistics.mean(rates)  # per node, served from the caches
        throttle = int(args.throttle_frac * sps * data["mean_bytes"])
        result["prep"][str(nodes)] = {"samples_per_s_per_node": sps, "spread": measure.spread(rates), "run": prep}
        result["prep"][str(nodes)] |= {"throttle_bps_per_node": throttle}
        head = f"### {nodes} nodes: prep-rate run (mode b, {MARGIN:.0%} aggregate cache, no throttle): "
        log += [head + f"{sps:.1f} samples/s per node; throttle {mb(throttle, 2)} MB/s per node", node_table(prep)]
        print(*log[-2:], sep="\n\n", flush=True)
        for agg in (float(x) for x in args.aggregate.split(",")):
            budget = min(total, int(total * (MARGIN if agg >= 1.0 else agg) / nodes))
            for rep, mode in measure.alternate(list(MODES), args.reps):
                port += 1
                one = one_run(args, data, nodes, budget, mode, port, throttle)
                one["aggregate_cache"], one["repetition"] = agg, rep
                head = f"### {nodes} nodes, aggregate {agg:.0%}, {mb(budget)} MB per node, mode {mode} ({MODES[mode]})"
                log += [head + f", repetition {rep + 1}, wall {one['wall_s']} s", node_table(one)]
                print(*log[-2:], sep="\n\n", flush=True)
                runs.setdefault((nodes, agg), {}).setdefault(mode, []).append(one)
                result["runs"].append(one)
                result["checks"] = checks(runs)
                result["total_wall_s"] = round(time.perf_counter() - started, 1)
                cli.save(args, dict(result), dataset=data)  # after every run
    Path(args.out).with_suffix(".md").write_text(render(args, result, log))
    return result


# -- output ------------------------------------------------------------------------------------
def rows_table(rows: list[dict], keys: list[str], first=()) -> str:
    """A table of ``rows`` (dicts): the ``first`` columns, then ``keys``; bytes in MB, two decimals."""
    heads = [*first, *(k.replace("_bytes", " MB").replace("_bps", " MB/s").replace("steady_", "") for k in keys)]
    cell = lambda r, k: mb(r.get(k), 2) if "_bytes" in k or "_bps" in k else r.get(k)  # noqa: E731
    return report.table(heads, [[*map(r.get, first), *(cell(r, k) for k in keys)] for r in rows])


def node_table(run: dict) -> str:
    keys = ["time_s", "samples_per_s", *SUMMED[:-1], "minimum_storage_bytes", "cache_bytes"]
    per_node = [{"node": n["rank"], **e} for n in run["per_node"] for e in n["epochs"]]
    return rows_table(per_node + [{"node": "all (time: max)", **t} for t in run["epochs"]], keys, ("node", "epoch"))


def table(results: dict) -> str:
    keys = [k for k in dict.fromkeys(k for r in results["checks"] for k in r) if k not in CHECKS_FIRST]
    return rows_table(results["checks"], keys, CHECKS_FIRST)


def render(a, result: dict, log: list[str]) -> str:
    """The Markdown report beside the JSON: the targets, then ``log``: every run's nodes and epochs."""
    what = f"{a.reps} repetition(s), modes ABBA; tbf {RATE}; batch {a.batch_size} per rank; crops of {CROP} px;"
    what += f" 1 DALI thread; throttle {a.throttle_frac} x the prep rate; {result['total_wall_s'] / 60:.1f} min."
    md = ["# Partitioned cache across nodes (`python -m benchmarks multinode`)", what]
    md += ["## Target checks (steady epochs; means over repetitions)", table(result), "## Per node and epoch"]
    return "\n\n".join([*md, *log]) + "\n"
