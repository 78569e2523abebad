"""The partitioned cache across nodes: storage bytes, peer bytes and epoch time on 2 and 4 nodes.

Each "node" is a network namespace with a private tmpfs at /dev/shm (``coordl_testing.netns.Cluster``),
its link shaped with ``tbf`` (``--rate``), its processes in a blkio cgroup throttling the dataset's
device. One torchrun rank per node (gloo), a CoordLoader per rank (``--job``: the loop of
``tests/multinode_train.py`` plus per-epoch device counters, the node's cache contents and a barrier
before ``close()``; ``--close-first`` closes first, as the test does).

Per node count, first the prep rate (mode b at 100%, unthrottled); every node's throttle is then
``--throttle-frac`` x that rate in bytes. Per aggregate cache (50% and 100% x ``--margin`` of the
dataset), three modes in a fresh cluster each, the dataset's pages evicted, ABBA ``--reps`` times:
``a`` no peer cache; ``b`` partitioned, plain sharding; ``c`` partitioned, locality-aware. Per node and
epoch: storage bytes (loader, blkio, ``/proc/self/io``), peer bytes in and served, the epoch time, and
what storage, network and prep alone would need. For b and c, the peer samples computed from the
caches' contents with ``coordl.placement`` beside the measured ones. Targets: b's and c's steady
storage at the minimum (dataset - cached across nodes), c's peer bytes <= 10% of b's, b >= 2x faster
than a at 100%. Needs root, network namespaces and v1 blkio cgroups.

    python -m benchmarks multinode                     # ~20 min on 2 cores
    python -m benchmarks multinode --quick             # smoke test: 128 images, 2 nodes, 2 epochs, ~1 min
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.harness import cli, dataset, limits, measure, report
from benchmarks.harness.report import mb
from coordl_testing import netns

BLKIO = Path("/sys/fs/cgroup/blkio")
MODES = {
    "a": ("no peer cache", ["--peers", "off"]),
    "b": ("partitioned", ["--locality", "0"]),
    "c": ("partitioned + locality", ["--locality", "1"]),
}
STAT_KEYS = (
    "samples samples_per_s elapsed_s stall_s storage_reads storage_bytes peer_reads peer_bytes peer_served_reads "
    "peer_served_bytes cache_hits cache_hit_bytes cache_bytes cache_items cache_budget admitted"
).split()
RUNS_HEAD = (
    "nodes|aggregate|mode|rep|budget/node MB|epoch 0 s|steady s|bounds s (storage / network / prep)|steady storage"
    " MB (loader / blkio / minimum)|steady peer MB|steady peer samples (measured / model: delivered, plain, least)"
    "|run blkio MB / loader MB"
)
CHECKS_HEAD = (
    "nodes|aggregate|reps|b storage / minimum MB|c storage / minimum MB|b, c at minimum|c peer / b peer MB|"
    "c / b (<= 0.1)|a time / b time (per rep)|model a / b (slowest bounds)|a time / c time (per rep)|"
    "b >= 2x faster than a"
)
SUMMED = "storage_bytes blkio_read_bytes proc_read_bytes peer_bytes peer_served_bytes cache_hit_bytes samples".split()


def options(p) -> None:
    p.add_argument("--job", nargs=2, metavar=("DATA", "OUT"), help="one rank (started by torchrun)")
    root = "dataset root (default: /var/tmp/coordl-bench/multinode-<images>)"
    dataset.add_dataset_options(p, data=None, images=2048, classes=16, data_help=root)
    p.add_argument("--nodes", default="2,4", help="node counts, e.g. 2,4")
    p.add_argument("--aggregate", default="0.5,1.0", help="aggregate cache sizes, fractions of the dataset")
    p.add_argument("--margin", type=float, default=1.1, help="per-node budget at 100%%: margin / nodes of the dataset")
    p.add_argument("--modes", default="abc")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--reps", type=int, default=2, help="repetitions of every configuration's modes, ABBA")
    p.add_argument("--seed", type=int, default=5)
    p.add_argument("-b", "--batch-size", type=int, default=64)
    p.add_argument("--crop", type=int, default=64, help="random-resized crop size in pixels (default: 64)")
    p.add_argument("--threads", type=int, default=1, help="DALI threads per node")
    p.add_argument("--rate", default="1gbit", help="tbf rate of every link")
    p.add_argument("--throttle-frac", type=float, default=0.1, help="storage throttle, x the node's prep rate")
    p.add_argument("--throttle", type=int, help="bytes/s per node, instead of --throttle-frac x prep rate")
    p.add_argument("--run-timeout", type=float, default=900)
    p.add_argument("--close-first", action="store_true", help="close each loader before the final barrier")
    p.add_argument("--quick", action="store_true", help="smoke test: 128 images, 2 nodes, 2 epochs")
    for name in ("--cache", "--peers", "--locality", "--blkio", "--device"):  # a rank's
        p.add_argument(name, help=argparse.SUPPRESS)


# -- one rank (launched by torchrun) ----------------------------------------------------------
def job(a) -> None:
    """``tests/multinode_train.py``'s loop, plus the node's device counters around every epoch."""
    import torch.distributed as dist

    import coordl

    data, out = a.job
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    peers = coordl.Peers(enabled="auto" if a.peers != "off" else False, locality_aware=a.locality == "1")
    kw = {"pipeline": coordl.ImageNetTrain(size=a.crop), "device_id": None, "return_index": True, "seed": a.seed}
    kw |= {"cache": int(a.cache), "prep": a.threads, "peers": peers, "shuffle": True}
    loader = coordl.CoordLoader(data, batch_size=a.batch_size, **kw)
    record = {"rank": rank, "world_size": dist.get_world_size(), "epochs": []}
    for epoch in range(a.epochs):
        loader.set_epoch(epoch)
        dev0, io0, t0 = limits.blkio_read(a.blkio, a.device), _proc_read_bytes(), time.perf_counter()
        batches = [ids.tolist() for _, _, ids in loader]
        seconds = time.perf_counter() - t0
        dev1, io1 = limits.blkio_read(a.blkio, a.device), _proc_read_bytes()
        # What the node's cache holds now: the holder map every rank learns at the next pass.
        cached = loader.node_cache.ready_mask(np.arange(len(loader.index))) if loader.node_cache else []
        record["epochs"].append(
            {
                "time_s": seconds,
                "stats": loader.stats(),
                "batches": batches,
                "cached": np.flatnonzero(cached).tolist(),
                "proc_read_bytes": io1 - io0,
                "blkio_read_bytes": None if dev0 is None else dev1 - dev0,
            }
        )
        Path(out, f"rank{rank}.json").write_text(json.dumps(record))
    # The nodes end together here; with --close-first a node closes first, and its server serves on
    # until the others have finished their pass (Peers(linger)).
    if a.close_first:
        loader.close()
    dist.barrier()
    loader.close()
    dist.destroy_process_group()


def _proc_read_bytes() -> int:
    """Bytes this process caused to be fetched from storage (``/proc/self/io``, all its threads)."""
    line = next(ln for ln in Path("/proc/self/io").read_text().splitlines() if ln.startswith("read_bytes:"))
    return int(line.split()[1])


# -- one run: a fresh cluster ------------------------------------------------------------------
class Run:
    """One job of ``nodes`` nodes in a fresh cluster, each node in a blkio cgroup of its own."""

    def __init__(self, args, data: dict, nodes: int, budget: int, mode: str, throttle, port: int, prep_sps=None):
        self.args, self.data, self.nodes, self.budget, self.mode = args, data, nodes, budget, mode
        self.throttle, self.port, self.prep_sps = throttle, port, prep_sps  # prep: per node, unthrottled
        self.device = "{}:{}".format(*measure.device_of(data["root"]))

    def rank_argv(self, k: int, out: Path, blkio: str, master: str) -> list[str]:
        a = self.args
        argv = ["torchrun", "--nnodes", self.nodes, "--node_rank", k, "--nproc_per_node", 1, "--master_addr", master]
        argv += ["--master_port", self.port, "-m", "benchmarks", "multinode", "--job", self.data["root"], out]
        argv += ["--epochs", a.epochs, "-b", a.batch_size, "--cache", self.budget, "--crop", a.crop]
        argv += ["--threads", a.threads, "--seed", a.seed, "--blkio", blkio, "--device", self.device]
        return [str(x) for x in argv] + MODES[self.mode][1] + (["--close-first"] if a.close_first else [])

    def execute(self) -> dict:
        out, logs, cgroups = Path(tempfile.mkdtemp(prefix="cdl-mn-")), [], []
        try:
            for k in range(self.nodes):
                cgroups.append(limits.Cgroup("blkio", f"cdl-mn{os.getpid()}-{self.port}-{k}"))
                if self.throttle:
                    cgroups[k].write("blkio.throttle.read_bps_device", f"{self.device} {self.throttle}")
            counters = [str(cg.path / "blkio.throttle.io_service_bytes") for cg in cgroups]
            os.sync()  # evict() cannot drop dirty pages (a dataset just written)
            limits.evict(self.data["root"])
            before = [limits.blkio_read(c, self.device) for c in counters]
            env = dict(os.environ, GLOO_SOCKET_IFNAME="eth0", OMP_NUM_THREADS="1")
            t0 = time.perf_counter()
            with netns.Cluster(self.nodes, rate=self.args.rate, shm_bytes=self.budget + (256 << 20)) as c:
                procs = []
                for k in range(self.nodes):
                    logs.append(open(out / f"node{k}.log", "w"))
                    argv = self.rank_argv(k, out, counters[k], c.address(0))
                    cg = [str(cgroups[k].path)]
                    procs.append(c.popen(k, argv, env=env, cgroups=cg, stdout=logs[k], stderr=subprocess.STDOUT))
                deadline = time.monotonic() + self.args.run_timeout
                codes = [_wait(p, deadline) for p in procs]
            wall = time.perf_counter() - t0
            after = [limits.blkio_read(c, self.device) for c in counters]
            texts = [(out / f"node{k}.log").read_text() for k in range(self.nodes)]
            if any(code != 0 for code in codes):
                raise RuntimeError(f"exit codes {codes}; logs:\n" + "\n----\n".join(t[-3000:] for t in texts))
            ranks = [json.loads((out / f"rank{k}.json").read_text()) for k in range(self.nodes)]
            result = self.result(ranks, [y - x for x, y in zip(before, after)], wall)
            return {**result, "warnings": [_warnings(t) for t in texts]}
        finally:
            for log in logs:
                log.close()
            for cg in cgroups:  # the cluster killed what was left in them
                cg.remove()
            for f in out.iterdir():
                f.unlink()
            out.rmdir()

    def traffic(self, ranks: list[dict]) -> dict:
        """Peer samples per steady epoch: measured, and computed from what the nodes cached.

        From the nodes' cache contents at the start of an epoch, ``placement`` and
        ``coordl_testing.traffic`` give the samples that cross nodes under plain sharding (*plain*) and
        the least any equal split moves (*least*); for the batches the ranks received, the samples held
        by another node (*delivered*, which ``peer_reads`` should equal); and whether they are the plan's.
        """
        from coordl import placement, sampler
        from coordl_testing.traffic import traffic

        n, world, size = self.data["files"], len(ranks), self.args.batch_size
        nodes, as_planned = np.arange(world), True
        out = {"measured": [], "delivered": [], "plain": [], "least": []}
        for k in range(1, len(ranks[0]["epochs"])):
            bitmaps = np.zeros((world, n), dtype=bool)
            for r in ranks:
                bitmaps[r["rank"], r["epochs"][k - 1]["cached"]] = True
            holder = placement.holders(bitmaps)
            plain = least = 0
            planned = [[] for _ in range(world)]
            for g in placement.global_batches(sampler.epoch_order(n, self.args.seed, k), world, size, False):
                parts, shards = placement.plan(g, holder, nodes), [g[r::world] for r in range(world)]
                least += traffic(g, holder, nodes, parts)
                plain += traffic(g, holder, nodes, shards)
                for r in range(world):
                    planned[r].append(sorted((parts if self.mode == "c" else shards)[r].tolist()))
            delivered = 0
            for r in ranks:
                got = r["epochs"][k]["batches"]
                delivered += sum(int(holder[i] >= 0 and holder[i] != r["rank"]) for b in got for i in b)
                as_planned &= [sorted(b) for b in got] == planned[r["rank"]]
            out["measured"].append(sum(r["epochs"][k]["stats"]["peer_reads"] for r in ranks))
            for key, v in (("delivered", delivered), ("plain", plain), ("least", least)):
                out[key].append(v)
        planned_by = "locality-aware plan" if self.mode == "c" else "plain sharding"
        return {f"steady_peer_reads_{k}": v for k, v in out.items()} | {
            "batches_as_planned": as_planned,
            "planned_by": planned_by,
        }

    def result(self, ranks: list[dict], run_blkio: list[int], wall: float) -> dict:
        def row(e):
            io = {k: e[k] for k in ("blkio_read_bytes", "proc_read_bytes")}
            return {"epoch": e["stats"]["epoch"], "time_s": round(e["time_s"], 3), **io} | {
                k: e["stats"][k] for k in STAT_KEYS
            }

        per_node = [{"node": r["rank"], "epochs": [row(e) for e in r["epochs"]]} for r in ranks]
        totals, link = [], _rate_bytes(self.args.rate)
        for k in range(len(per_node[0]["epochs"])):
            rows = [n["epochs"][k] for n in per_node]
            ids = {i for r in ranks for b in r["epochs"][k]["batches"] for i in b}
            cached = sum(n["epochs"][k - 1]["cache_bytes"] for n in per_node) if k else 0
            # The minimum holds when the nodes share their caches; without peers (mode a) it does not apply.
            least = self.data["total_bytes"] - cached if self.mode != "a" else None
            t = {"epoch": k, "time_s": max(x["time_s"] for x in rows), "cached_bytes_start": cached}
            t |= {"minimum_storage_bytes": least, "covers_dataset": len(ids) == self.data["files"]}
            t |= {key: sum(x[key] or 0 for x in rows) for key in SUMMED}
            # What each resource alone needs for this epoch (the slowest node): storage at the throttle,
            # the node's link at the tbf rate, decoding at the measured prep rate.
            moved = max(max(x["peer_bytes"], x["peer_served_bytes"]) for x in rows)
            t["storage_bound_s"] = max(x["storage_bytes"] / self.throttle for x in rows) if self.throttle else None
            t["network_bound_s"] = moved / link if link else None
            t["prep_bound_s"] = max(x["samples"] / self.prep_sps for x in rows) if self.prep_sps else None
            totals.append(t)
        steady = totals[1:] or totals

        def mean(key, digits=None):
            return None if steady[0][key] is None else round(sum(t[key] for t in steady) / len(steady), digits)

        summary = {
            "epoch0_time_s": round(totals[0]["time_s"], 3),
            "steady_time_s": mean("time_s", 3),
            **{
                f"steady_{k}": mean(k) for k in ("storage_bytes", "blkio_read_bytes", "peer_bytes", "peer_served_bytes")
            },
            **{f"steady_{k}": mean(k, 3) for k in ("storage_bound_s", "network_bound_s", "prep_bound_s")},
            "steady_minimum_storage_bytes": mean("minimum_storage_bytes"),
            "epoch0_storage_bytes": totals[0]["storage_bytes"],
            "epoch0_blkio_read_bytes": totals[0]["blkio_read_bytes"],
            "run_blkio_read_bytes": sum(run_blkio),
            "loader_storage_bytes_all_epochs": sum(t["storage_bytes"] for t in totals),
            "aggregate_cached_bytes": sum(n["epochs"][-1]["cache_bytes"] for n in per_node),
        }
        if self.mode != "a":
            summary.update(self.traffic(ranks))
        out = {"nodes": self.nodes, "mode": self.mode, "mode_name": MODES[self.mode][0], "budget_per_node": self.budget}
        out |= {"throttle_bps": self.throttle, "wall_s": round(wall, 1), "per_node": per_node, "epochs": totals}
        return out | {"run_blkio_read_bytes_per_node": run_blkio, "summary": summary}


def _wait(p: subprocess.Popen, deadline: float) -> int | None:
    try:
        return p.wait(timeout=max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        return None  # the cluster's close() kills it


def _warnings(log: str) -> list[str]:
    """coordl's warnings in a node's log (peer failures, above all), each once, with a count."""
    counts: dict[str, int] = {}
    for line in (ln.strip() for ln in log.splitlines() if "coordl:" in ln):
        counts[line] = counts.get(line, 0) + 1
    return [f"{n} x {line}" for line, n in counts.items()]


def _rate_bytes(rate: str | None) -> float | None:
    """A tc rate (``1gbit``, ``500mbit``, ``100kbit``, ``8bit``) in bytes/s."""
    for unit, scale in {"gbit": 1e9, "mbit": 1e6, "kbit": 1e3, "bit": 1}.items():
        if rate and rate.lower().endswith(unit):
            return float(rate[: -len(unit)]) * scale / 8
    if rate:
        raise ValueError(f"cannot read the tc rate {rate!r}; give it as <number>gbit, mbit, kbit or bit")
    return None


# -- the sweep ---------------------------------------------------------------------------------
def prep_rate(run: dict, mean_bytes: float) -> dict:
    """Per-node steady samples/s of an unthrottled run served from the caches, and in bytes."""
    rates = [e["samples_per_s"] for n in run["per_node"] for e in n["epochs"][1:] or n["epochs"]]
    sps = sum(rates) / len(rates)
    return {
        "samples_per_s_per_node": round(sps, 1),
        "bytes_per_s_per_node": round(sps * mean_bytes),
        "min_samples_per_s": round(min(rates), 1),
        "max_samples_per_s": round(max(rates), 1),
    }


def checks(runs: dict) -> list[dict]:
    """The targets per node count and aggregate cache: ``runs[(nodes, aggregate)][mode]`` lists that
    mode's runs; times and bytes are their means, the time ratios also per repetition."""
    out = []
    for (nodes, agg), by_mode in sorted(runs.items()):
        mean = {m: _mean_summary(rs) for m, rs in by_mode.items()}
        a, b, c = (mean.get(m) for m in "abc")
        row = {"nodes": nodes, "aggregate_cache": agg, "repetitions": max(len(rs) for rs in by_mode.values())}
        for name, x in (("b", b), ("c", c)):
            if x is not None:
                used, least = x["steady_storage_bytes"], x["steady_minimum_storage_bytes"]
                row[f"{name}_storage_bytes"], row[f"{name}_minimum_bytes"] = round(used), round(least)
                row[f"{name}_blkio_bytes"] = round(x["steady_blkio_read_bytes"])
                row[f"{name}_storage_over_minimum"] = round(used / least, 4) if least else None
                row[f"{name}_storage_at_minimum"] = used <= 1.01 * least  # 1%: the few items padding repeats
        if b is not None and c is not None:
            pb, pc = b["steady_peer_bytes"], c["steady_peer_bytes"]
            row["b_peer_bytes"], row["c_peer_bytes"] = round(pb), round(pc)
            row["c_peer_over_b_peer"] = round(pc / pb, 5) if pb else None
            row["c_peer_at_most_10pct_of_b"] = pc <= 0.1 * pb
        for x_name, x in (("b", b), ("c", c)):
            if a is not None and x is not None:
                row[f"a_time_over_{x_name}_time"] = round(a["steady_time_s"] / x["steady_time_s"], 3)
                row[f"a_time_over_{x_name}_time_per_rep"] = [
                    round(ra["summary"]["steady_time_s"] / rx["summary"]["steady_time_s"], 3)
                    for ra, rx in zip(by_mode["a"], by_mode[x_name])
                ]
        if a is not None and b is not None:
            # The bottleneck model: each mode at its slowest bound (storage, network, prep).
            slow = [max(v for k, v in x.items() if k.endswith("_bound_s") and v is not None) for x in (a, b)]
            row["model_a_time_over_b_time"] = round(slow[0] / slow[1], 3) if slow[1] else None
            if agg >= 1.0:
                row["b_at_least_2x_faster_than_a"] = a["steady_time_s"] >= 2.0 * b["steady_time_s"]
        out.append(row)
    return out


def _mean_summary(runs: list[dict]) -> dict:
    """The mean of the runs' numeric summary values (a value any run lacks is None)."""
    out = {}
    for key in runs[0]["summary"]:
        values = [r["summary"][key] for r in runs]
        numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)
        out[key] = sum(values) / len(values) if numeric else None
    return out


def run(args) -> dict | None:
    if args.job:
        return job(args)
    if args.quick:
        args.images, args.size, args.nodes, args.epochs, args.reps = 128, None, "2", 2, 1
    args.data = args.data or f"/var/tmp/coordl-bench/multinode-{args.images or args.size}"
    why = netns.unavailable() or (None if (BLKIO / "blkio.throttle.read_bps_device").exists() else "no v1 blkio cgroup")
    if why:
        raise SystemExit(f"cannot run: {why}")
    started, data = time.perf_counter(), dataset.dataset_from_args(args)
    print(f"dataset: {dataset.describe(data)}", flush=True)
    # Load the libraries (DALI's operators too: a pipeline runs) once, so that throttled nodes
    # find them in the page cache; the dataset's pages are evicted before every run.
    warm = (
        "import sys, torch, torch.distributed.run, coordl\n"
        "with coordl.CoordLoader(coordl.Index.scan(sys.argv[1], index_dir=''), batch_size=8, cache=0,"
        " device_id=None, prep=1, shuffle=True, pipeline=coordl.ImageNetTrain(size=64)) as w:\n    next(iter(w))\n"
    )
    subprocess.run([sys.executable, "-c", warm, args.data], check=True)
    result, runs = {"dataset": data, "prep": {}, "runs": [], "checks": []}, {}
    port, total = 29700 + os.getpid() % 100 * 10, data["total_bytes"]
    for nodes in (int(x) for x in args.nodes.split(",")):
        port += 1
        full = min(total, int(total * args.margin / nodes))
        print(f"\n== {nodes} nodes: prep rate (mode b, {args.margin:.0%} aggregate cache, no throttle)", flush=True)
        prep_run = Run(args, data, nodes, full, "b", None, port).execute()
        print_run(prep_run)
        rate = prep_rate(prep_run, data["mean_bytes"])
        throttle = args.throttle or int(args.throttle_frac * rate["bytes_per_s_per_node"])
        result["prep"][str(nodes)] = {**rate, "throttle_bps_per_node": throttle, "run": prep_run}
        print(f"prep rate {rate['samples_per_s_per_node']} samples/s per node; throttle {mb(throttle)} MB/s per node")
        for agg in (float(x) for x in args.aggregate.split(",")):
            budget = min(total, int(total * (args.margin if agg >= 1.0 else agg) / nodes))
            for rep, mode in measure.alternate(list(args.modes), args.reps):
                port += 1
                print(
                    f"\n== {nodes} nodes, aggregate cache {agg:.0%} (budget {mb(budget)} MB per node), mode {mode}: "
                    f"{MODES[mode][0]}, repetition {rep + 1}/{args.reps}",
                    flush=True,
                )
                one = Run(args, data, nodes, budget, mode, throttle, port, rate["samples_per_s_per_node"]).execute()
                one["aggregate_cache"], one["repetition"] = agg, rep
                print_run(one)
                runs.setdefault((nodes, agg), {}).setdefault(mode, []).append(one)
                result["runs"].append(one)
                result["checks"] = checks(runs)
                result["total_wall_s"] = round(time.perf_counter() - started, 1)
                cli.save(args, dict(result), dataset=data)  # after every run
    Path(args.out).with_suffix(".md").write_text(render({**result, "options": vars(args)}))
    return result


# -- output ------------------------------------------------------------------------------------
def _s(x) -> str:
    return "-" if x is None else f"{x:.2f}"


def _mb(x) -> str:
    return mb(x, digits=2)  # the reports' MB columns have two decimals


def _ints(values: list) -> str:
    return "+".join(str(v) for v in values)


def node_table(run: dict) -> str:
    head = "node|epoch|time s|samples/s|storage MB (loader)|blkio MB|peer MB in|peer MB served|cache hit MB|cached MB"
    keys = ("storage_bytes", "blkio_read_bytes", "peer_bytes", "peer_served_bytes", "cache_hit_bytes")
    rows = [
        [n["node"], e["epoch"], f"{e['time_s']:.2f}", f"{e['samples_per_s']:.1f}", *(_mb(e[k]) for k in keys)]
        + [_mb(e["cache_bytes"])]
        for n in run["per_node"]
        for e in n["epochs"]
    ]
    minimum = "minimum storage {}".format
    rows += [
        ["all", t["epoch"], f"{t['time_s']:.2f} (max)", "", *(_mb(t[k]) for k in keys)]
        + [minimum(_mb(t["minimum_storage_bytes"]))]
        for t in run["epochs"]
    ]
    return report.table(head, rows)


def print_run(run: dict) -> None:
    print(node_table(run))
    for k, lines in enumerate(run.get("warnings", [])):
        print("".join(f"node {k}: {line}\n" for line in lines), end="")
    s = run["summary"]
    print(
        f"steady epoch {s['steady_time_s']:.2f} s, storage {_mb(s['steady_storage_bytes'])} MB (blkio "
        f"{_mb(s['steady_blkio_read_bytes'])}, minimum {_mb(s['steady_minimum_storage_bytes'])}), peer "
        f"{_mb(s['steady_peer_bytes'])} MB; bounds s: storage {_s(s['steady_storage_bound_s'])}, network "
        f"{_s(s['steady_network_bound_s'])}, prep {_s(s['steady_prep_bound_s'])}; wall {run['wall_s']} s",
        flush=True,
    )
    if "steady_peer_reads_measured" in s:
        print(
            f"peer samples per steady epoch: measured {_ints(s['steady_peer_reads_measured'])}; model: delivered "
            f"{_ints(s['steady_peer_reads_delivered'])}, plain {_ints(s['steady_peer_reads_plain'])}, least "
            f"{_ints(s['steady_peer_reads_least'])}; as the {s['planned_by']} says: {s['batches_as_planned']}"
        )


def runs_table(runs: list[dict]) -> str:
    rows = []
    for r in runs:
        s, peers = r["summary"], "-"
        if "steady_peer_reads_measured" in s:
            peers = " / ".join(_ints(s[f"steady_peer_reads_{k}"]) for k in ("measured", "delivered", "plain", "least"))
        bounds = " / ".join(_s(s[f"steady_{k}_bound_s"]) for k in ("storage", "network", "prep"))
        storage = " / ".join(
            _mb(s[f"steady_{k}"]) for k in ("storage_bytes", "blkio_read_bytes", "minimum_storage_bytes")
        )
        run_io = f"{_mb(s['run_blkio_read_bytes'])} / {_mb(s['loader_storage_bytes_all_epochs'])}"
        mode, times = f"{r['mode']} ({r['mode_name']})", (f"{s['epoch0_time_s']:.2f}", f"{s['steady_time_s']:.2f}")
        rows.append([r["nodes"], f"{r['aggregate_cache']:.0%}", mode, r["repetition"] + 1, _mb(r["budget_per_node"])])
        rows[-1] += [*times, bounds, storage, _mb(s["steady_peer_bytes"]), peers, run_io]
    return report.table(RUNS_HEAD, rows)


def checks_table(rows: list[dict]) -> str:
    out = []
    for r in rows:
        g = r.get
        per = {x: ", ".join(str(v) for v in g(f"a_time_over_{x}_time_per_rep", [])) for x in "bc"}
        pair = "{} / {}".format
        out.append([r["nodes"], f"{r['aggregate_cache']:.0%}", r["repetitions"]])
        out[-1] += [pair(_mb(g(f"{x}_storage_bytes")), _mb(g(f"{x}_minimum_bytes"))) for x in "bc"]
        out[-1] += [f"{g('b_storage_at_minimum')}, {g('c_storage_at_minimum')}"]
        out[-1] += [pair(_mb(g("c_peer_bytes")), _mb(g("b_peer_bytes")))]
        out[-1] += [f"{g('c_peer_over_b_peer')} ({g('c_peer_at_most_10pct_of_b')})"]
        out[-1] += [f"{g('a_time_over_b_time')} ({per['b']})", g("model_a_time_over_b_time")]
        out[-1] += [f"{g('a_time_over_c_time')} ({per['c']})", g("b_at_least_2x_faster_than_a", "n/a (50%)")]
    return report.table(CHECKS_HEAD, out)


def table(results: dict) -> str:
    return checks_table(results["checks"])


def render(result: dict) -> str:
    """The Markdown report beside the JSON: prep rates, the targets, every run and every node's epochs.
    How to read it: the module's docstring and docs/benchmarks.md."""
    a = result["options"]
    md = [
        "# Partitioned cache across nodes (`python -m benchmarks multinode`)",
        "",
        f"{a['reps']} repetition(s), modes ABBA; tbf {a['rate']}; batch {a['batch_size']} per rank; crops of "
        f"{a['crop']} px; {a['threads']} DALI thread; throttle {a['throttle_frac']} x the prep rate; "
        f"{result['total_wall_s'] / 60:.1f} min.",
        "",
        "## Prep rate and throttle",
        "",
        report.table(
            ["nodes", "steady samples/s per node (min-max)", "MB/s per node", "throttle MB/s per node"],
            [
                [n, f"{p['samples_per_s_per_node']} ({p['min_samples_per_s']}-{p['max_samples_per_s']})"]
                + [_mb(p["bytes_per_s_per_node"]), _mb(p["throttle_bps_per_node"])]
                for n, p in result["prep"].items()
            ],
        ),
        "",
        "## Target checks (steady epochs; means over repetitions)",
        "",
        checks_table(result["checks"]),
        "",
        "## Per run (steady = mean over epochs 1..)",
        "",
        runs_table(result["runs"]),
        "",
        "## Per node and epoch",
        "",
    ]
    for nodes, pr in result["prep"].items():
        md += [f"### {nodes} nodes: prep-rate run (mode b, no throttle)", "", node_table(pr["run"]), ""]
    for r in result["runs"]:
        head = f"### {r['nodes']} nodes, aggregate {r['aggregate_cache']:.0%}, mode {r['mode']} ({r['mode_name']}), "
        md += [head + f"repetition {r['repetition'] + 1}, wall {r['wall_s']} s", "", node_table(r), ""]
        md += [f"- node {k}: `{line}`" for k, lines in enumerate(r.get("warnings", [])) for line in lines]
    return "\n".join(md) + "\n"
