"""The partitioned cache across nodes: storage bytes, peer bytes and epoch time, 2 and 4 nodes.

Each "node" is a network namespace with a private tmpfs at /dev/shm (``netns.Cluster``), its
link shaped with ``tbf`` (``--rate``), its processes in a blkio cgroup of their own whose
``read_bps_device`` throttles the dataset's device. One torchrun per node, one rank per node,
``init_process_group("gloo")``, and a CoordLoader per rank (this file's ``worker`` mode, the
loader of ``tests/multinode_train.py`` plus per-epoch device counters). For every node count
and aggregate cache size (the sum of the nodes' cache budgets: 50% and 100% of the dataset,
the latter with a ``--margin`` so that shards of uneven byte sizes still fit), three modes run
back to back, each in a fresh cluster after the dataset's pages are evicted:

- ``a``: no peer cache (``peers=False``): each node has only its own MinIO cache;
- ``b``: the partitioned cache with plain sharding (``locality_aware=False``);
- ``c``: the partitioned cache, locality-aware.

First, per node count, the prep rate: mode ``b`` at 100% with no throttle (steady epochs are
served from the caches, so they run at the rate the node decodes). Every node's throttle is
then ``--throttle-frac`` times that rate in bytes, so that the no-peer case is I/O-bound.

Per node and epoch it records the bytes the loader read from storage, the bytes the node's
blkio cgroup saw read from the device (read inside the worker around each epoch) and the
process's ``read_bytes`` (``/proc/self/io``), peer bytes received and served, and the epoch
time; per run, the blkio delta of the whole run as well. The targets: in ``b`` and ``c`` the
steady storage bytes are the minimum (dataset bytes minus the bytes cached across nodes at the
start of the epoch); ``c``'s peer bytes are at most 10% of ``b``'s; at 100% aggregate cache,
``b``'s steady epoch is at least 2x faster than ``a``'s. Needs root, network namespaces and
v1 blkio cgroups.

    python benchmarks/multinode.py                     # ~15 min on 2 cores
    python benchmarks/multinode.py --quick             # smoke test: tiny dataset, 2 nodes, 2 epochs
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

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent))
import common  # noqa: E402
import netns  # noqa: E402

BLKIO = Path("/sys/fs/cgroup/blkio")
MODES = {
    "a": ("no peer cache", ["--peers", "off"]),
    "b": ("partitioned", ["--locality", "0"]),
    "c": ("partitioned + locality", ["--locality", "1"]),
}
STAT_KEYS = ("samples", "samples_per_s", "elapsed_s", "stall_s", "storage_reads", "storage_bytes", "peer_reads",
             "peer_bytes", "peer_served_reads", "peer_served_bytes", "cache_hits", "cache_hit_bytes", "cache_bytes",
             "cache_items", "cache_budget", "admitted")  # fmt: skip


# -- the training job, one per node (launched by torchrun) ------------------------------------
def worker(argv: list[str]) -> None:
    """``tests/multinode_train.py``'s loop, plus the node's device counters around every epoch."""
    p = argparse.ArgumentParser(prog="multinode.py worker")
    p.add_argument("data")
    p.add_argument("out")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("-b", "--batch-size", type=int, default=32)
    p.add_argument("--cache", type=int, required=True, help="bytes")
    p.add_argument("--size", type=int, default=64)
    p.add_argument("--peers", choices=("auto", "off"), default="auto")
    p.add_argument("--locality", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--blkio", help="this node's blkio.throttle.io_service_bytes")
    p.add_argument("--device", default="254:0")
    a = p.parse_args(argv)

    import torch.distributed as dist

    import coordl

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    loader = coordl.CoordLoader(
        a.data, batch_size=a.batch_size, pipeline=coordl.ImageNetTrain(size=a.size), cache_bytes=a.cache,
        device_id=None, num_threads=a.threads, return_index=True, seed=5, peers="auto" if a.peers == "auto" else False,
        locality_aware=bool(a.locality),
    )  # fmt: skip
    record = {"rank": rank, "world_size": dist.get_world_size(), "epochs": []}
    for epoch in range(a.epochs):
        loader.set_epoch(epoch)
        dev0, io0, t0 = _blkio_read(a.blkio, a.device), _proc_read_bytes(), time.perf_counter()
        ids = []
        for _, _, batch_ids in loader:
            ids.extend(batch_ids.tolist())
        seconds = time.perf_counter() - t0
        dev1, io1 = _blkio_read(a.blkio, a.device), _proc_read_bytes()
        record["epochs"].append({"time_s": seconds, "stats": loader.stats(), "ids": ids,
                                 "blkio_read_bytes": None if dev0 is None else dev1 - dev0,
                                 "proc_read_bytes": io1 - io0})  # fmt: skip
        with open(os.path.join(a.out, f"rank{rank}.json"), "w") as f:
            json.dump(record, f)
    loader.close()
    dist.barrier()
    dist.destroy_process_group()


def _blkio_read(path: str | None, device: str) -> int | None:
    """Bytes read from ``device`` by the cgroup so far, or None without a cgroup."""
    if not path:
        return None
    for line in Path(path).read_text().splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[0] == device and parts[1] == "Read":
            return int(parts[2])
    return 0  # nothing read from that device yet


def _proc_read_bytes() -> int:
    """Bytes this process caused to be fetched from storage (``/proc/self/io``, all its threads)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    return 0


# -- one run: a fresh cluster ------------------------------------------------------------------
class Run:
    """One job of ``nodes`` nodes in a fresh cluster, each node in a blkio cgroup of its own."""

    def __init__(self, args, dataset: dict, nodes: int, budget: int, mode: str, throttle: int | None, port: int):
        self.args, self.dataset, self.nodes, self.budget = args, dataset, nodes, budget
        self.mode, self.throttle, self.port = mode, throttle, port
        self.device = "%d:%d" % common.device_of(dataset["root"])
        self.cgroups = [BLKIO / f"cdl-mn{os.getpid()}-{port}-{k}" for k in range(nodes)]

    def execute(self) -> dict:
        out = Path(tempfile.mkdtemp(prefix="cdl-mn-"))
        logs = []
        try:
            for cg in self.cgroups:
                cg.mkdir()
                if self.throttle:
                    (cg / "blkio.throttle.read_bps_device").write_text(f"{self.device} {self.throttle}\n")
            common.evict(self.dataset["root"])
            before = [_blkio_read(str(cg / "blkio.throttle.io_service_bytes"), self.device) for cg in self.cgroups]
            shm = self.budget + (256 << 20)
            env = dict(os.environ, GLOO_SOCKET_IFNAME="eth0", OMP_NUM_THREADS="1")
            t0 = time.perf_counter()
            with netns.Cluster(self.nodes, rate=self.args.rate, shm_bytes=shm) as c:
                procs = []
                for k in range(self.nodes):
                    log = open(out / f"node{k}.log", "w")
                    logs.append(log)
                    blk = str(self.cgroups[k] / "blkio.throttle.io_service_bytes")
                    argv = ["torchrun", "--nnodes", str(self.nodes), "--node_rank", str(k), "--nproc_per_node", "1",
                            "--master_addr", c.address(0), "--master_port", str(self.port), str(HERE), "worker",
                            self.dataset["root"], str(out), "--epochs", str(self.args.epochs),
                            "-b", str(self.args.batch_size), "--cache", str(self.budget), "--size", str(self.args.size),
                            "--threads", str(self.args.threads), "--blkio", blk, "--device", self.device,
                            *MODES[self.mode][1]]  # fmt: skip
                    procs.append(c.popen(k, argv, env=env, cgroups=[str(self.cgroups[k])], stdout=log,
                                         stderr=subprocess.STDOUT))  # fmt: skip
                deadline = time.monotonic() + self.args.run_timeout
                codes = [self._wait(p, deadline) for p in procs]
            wall = time.perf_counter() - t0
            after = [_blkio_read(str(cg / "blkio.throttle.io_service_bytes"), self.device) for cg in self.cgroups]
            if any(code != 0 for code in codes):
                tails = [(out / f"node{k}.log").read_text()[-3000:] for k in range(self.nodes)]
                raise RuntimeError(f"exit codes {codes}; logs:\n" + "\n----\n".join(tails))
            ranks = [json.loads((out / f"rank{k}.json").read_text()) for k in range(self.nodes)]
            return self._result(ranks, [y - x for x, y in zip(before, after)], wall)
        finally:
            for log in logs:
                log.close()
            for cg in self.cgroups:  # the cluster killed what was left in them
                _rmdir(cg)
            for f in out.iterdir():
                f.unlink()
            out.rmdir()

    @staticmethod
    def _wait(p: subprocess.Popen, deadline: float) -> int | None:
        try:
            return p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            return None  # the cluster's close() kills it

    def _result(self, ranks: list[dict], run_blkio: list[int], wall: float) -> dict:
        n_items = self.dataset["files"]
        per_node = []
        for r in ranks:
            epochs = []
            for e in r["epochs"]:
                s = e["stats"]
                epochs.append({"epoch": s["epoch"], "time_s": round(e["time_s"], 3),
                               "blkio_read_bytes": e["blkio_read_bytes"], "proc_read_bytes": e["proc_read_bytes"],
                               **{k: s[k] for k in STAT_KEYS}})  # fmt: skip
            per_node.append({"node": r["rank"], "epochs": epochs})
        totals = []
        for k in range(len(per_node[0]["epochs"])):
            rows = [n["epochs"][k] for n in per_node]
            ids = [i for r in ranks for i in r["epochs"][k]["ids"]]
            cached_before = sum(n["epochs"][k - 1]["cache_bytes"] for n in per_node) if k else 0
            t = {"epoch": k, "time_s": max(x["time_s"] for x in rows),
                 "minimum_storage_bytes": self.dataset["total_bytes"] - cached_before,
                 "cached_bytes_start": cached_before, "covers_dataset": len(set(ids)) == n_items}  # fmt: skip
            for key in ("storage_bytes", "blkio_read_bytes", "proc_read_bytes", "peer_bytes", "peer_served_bytes",
                        "cache_hit_bytes", "samples"):  # fmt: skip
                t[key] = sum(x[key] or 0 for x in rows)
            totals.append(t)
        steady = totals[1:] or totals
        summary = {
            "epoch0_time_s": round(totals[0]["time_s"], 3),
            "steady_time_s": round(sum(t["time_s"] for t in steady) / len(steady), 3),
            **{f"steady_{key}": round(sum(t[key] for t in steady) / len(steady))
               for key in ("storage_bytes", "blkio_read_bytes", "peer_bytes", "peer_served_bytes",
                           "minimum_storage_bytes")},
            "epoch0_storage_bytes": totals[0]["storage_bytes"],
            "epoch0_blkio_read_bytes": totals[0]["blkio_read_bytes"],
            "run_blkio_read_bytes": sum(run_blkio),
            "loader_storage_bytes_all_epochs": sum(t["storage_bytes"] for t in totals),
            "aggregate_cached_bytes": sum(n["epochs"][-1]["cache_bytes"] for n in per_node),
        }  # fmt: skip
        return {"nodes": self.nodes, "mode": self.mode, "mode_name": MODES[self.mode][0], "budget_per_node": self.budget,
                "throttle_bps": self.throttle, "wall_s": round(wall, 1), "per_node": per_node, "epochs": totals,
                "run_blkio_read_bytes_per_node": run_blkio, "summary": summary}  # fmt: skip


def _rmdir(cg: Path) -> None:
    deadline = time.monotonic() + 10
    while cg.exists():
        try:
            cg.rmdir()
        except OSError:
            if time.monotonic() > deadline:
                print(f"warning: cannot remove {cg}", file=sys.stderr)
                return
            time.sleep(0.1)


# -- the sweep ---------------------------------------------------------------------------------
def prep_rate(run: dict, mean_bytes: float) -> dict:
    """Per-node steady samples/s of an unthrottled run served from the caches, and in bytes."""
    rates = [e["samples_per_s"] for n in run["per_node"] for e in n["epochs"][1:]] or [
        e["samples_per_s"] for n in run["per_node"] for e in n["epochs"]
    ]
    sps = sum(rates) / len(rates)
    return {"samples_per_s_per_node": round(sps, 1), "bytes_per_s_per_node": round(sps * mean_bytes),
            "min_samples_per_s": round(min(rates), 1), "max_samples_per_s": round(max(rates), 1)}  # fmt: skip


def checks(runs: dict) -> list[dict]:
    """The issue's targets per node count and aggregate cache, from runs measured back to back."""
    out = []
    for (nodes, agg), by_mode in sorted(runs.items()):
        a, b, c = (by_mode.get(m) for m in "abc")
        row = {"nodes": nodes, "aggregate_cache": agg}
        for name, r in (("b", b), ("c", c)):
            if r is not None:
                s = r["summary"]
                row[f"{name}_storage_over_minimum"] = round(s["steady_storage_bytes"] / max(1, s["steady_minimum_storage_bytes"]), 4)
                row[f"{name}_blkio_over_minimum"] = round(s["steady_blkio_read_bytes"] / max(1, s["steady_minimum_storage_bytes"]), 4)
                row[f"{name}_storage_at_minimum"] = s["steady_storage_bytes"] <= 1.01 * s["steady_minimum_storage_bytes"] + 1
        if b is not None and c is not None:
            pb, pc = b["summary"]["steady_peer_bytes"], c["summary"]["steady_peer_bytes"]
            row["c_peer_over_b_peer"] = round(pc / pb, 4) if pb else None
            row["c_peer_at_most_10pct_of_b"] = pc <= 0.1 * pb
        if a is not None and b is not None:
            speedup = a["summary"]["steady_time_s"] / b["summary"]["steady_time_s"]
            row["a_time_over_b_time"] = round(speedup, 3)
            if agg >= 1.0:
                row["b_at_least_2x_faster_than_a"] = speedup >= 2.0
        if a is not None and c is not None:
            row["a_time_over_c_time"] = round(a["summary"]["steady_time_s"] / c["summary"]["steady_time_s"], 3)
        out.append(row)
    return out


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        worker(sys.argv[2:])
        return 0
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", help="dataset root (default /var/tmp/coordl-bench/multinode-<images>)")
    p.add_argument("--images", type=int, default=1024)
    p.add_argument("--classes", type=int, default=16)
    p.add_argument("--photos", help="photographs to crop from (default: ../shared/photos if present)")
    p.add_argument("--nodes", default="2,4", help="node counts, e.g. 2,4")
    p.add_argument("--aggregate", default="0.5,1.0", help="aggregate cache sizes, fractions of the dataset")
    p.add_argument("--margin", type=float, default=1.1, help="per-node budget at 100%%: margin / nodes of the dataset")
    p.add_argument("--modes", default="abc")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("-b", "--batch-size", type=int, default=32)
    p.add_argument("--size", type=int, default=64, help="crop size")
    p.add_argument("--threads", type=int, default=1, help="DALI threads per node")
    p.add_argument("--rate", default="1gbit", help="tbf rate of every link")
    p.add_argument("--throttle-frac", type=float, default=0.3,
                   help="each node's storage throttle, as a fraction of its measured prep rate in bytes")
    p.add_argument("--throttle", type=int, help="bytes/s per node, instead of --throttle-frac x prep rate")
    p.add_argument("--run-timeout", type=float, default=900)
    p.add_argument("--quick", action="store_true", help="smoke test: 128 images, 2 nodes, 2 epochs")
    p.add_argument("--out", help="JSON path; the .md goes next to it (default benchmarks/results/multinode.json)")
    args = p.parse_args()
    if args.quick:
        args.images, args.nodes, args.epochs = 128, "2", 2
        args.out = args.out or os.path.join(tempfile.gettempdir(), "coordl-multinode-quick.json")
    args.out = args.out or str(HERE.parent / "results" / "multinode.json")
    args.data = args.data or f"/var/tmp/coordl-bench/multinode-{args.images}"
    why = netns.unavailable() or (None if (BLKIO / "blkio.throttle.read_bps_device").exists() else "no v1 blkio cgroup")
    if why:
        print(f"cannot run: {why}", file=sys.stderr)
        return 2

    started = time.perf_counter()
    dataset = common.ensure_dataset(args.data, args.images, args.classes, args.photos)
    print(f"dataset: {dataset['files']} files, {dataset['total_bytes'] / 1e6:.1f} MB, mean "
          f"{dataset['mean_bytes'] / 1e3:.1f} KB ({dataset['source']}), device "
          "%d:%d" % common.device_of(args.data), flush=True)  # fmt: skip
    # Load the libraries once, so that throttled nodes find them in the page cache.
    subprocess.run([sys.executable, "-c", "import torch, torch.distributed.run, nvidia.dali, coordl"], check=True)
    node_counts = [int(x) for x in args.nodes.split(",")]
    aggregates = [float(x) for x in args.aggregate.split(",")]
    result = {"benchmark": "multinode", "args": vars(args), "dataset": dataset, "machine": common.machine(),
              "load_avg_start": os.getloadavg(), "prep": {}, "runs": [], "checks": []}  # fmt: skip
    port = 29700 + os.getpid() % 100 * 10
    runs: dict = {}
    for nodes in node_counts:
        budgets = {agg: min(dataset["total_bytes"], int(dataset["total_bytes"] * (args.margin if agg >= 1.0 else agg) / nodes))
                   for agg in aggregates}  # fmt: skip
        port += 1
        print(f"\n== {nodes} nodes: prep rate (mode b, {args.margin:.0%} aggregate cache, no throttle)", flush=True)
        full = min(dataset["total_bytes"], int(dataset["total_bytes"] * args.margin / nodes))
        prep_run = Run(args, dataset, nodes, full, "b", None, port).execute()
        _print_run(prep_run)
        rate = prep_rate(prep_run, dataset["mean_bytes"])
        throttle = args.throttle or int(args.throttle_frac * rate["bytes_per_s_per_node"])
        result["prep"][str(nodes)] = {**rate, "throttle_bps_per_node": throttle, "run": prep_run}
        print(f"prep rate {rate['samples_per_s_per_node']} samples/s per node = {rate['bytes_per_s_per_node'] / 1e6:.2f} MB/s;"
              f" throttle {throttle / 1e6:.2f} MB/s per node", flush=True)  # fmt: skip
        for agg in aggregates:
            for mode in args.modes:
                port += 1
                print(f"\n== {nodes} nodes, aggregate cache {agg:.0%} (budget {budgets[agg] / 1e6:.1f} MB per node), "
                      f"mode {mode}: {MODES[mode][0]}", flush=True)  # fmt: skip
                run = Run(args, dataset, nodes, budgets[agg], mode, throttle, port).execute()
                run["aggregate_cache"] = agg
                _print_run(run)
                runs.setdefault((nodes, agg), {})[mode] = run
                result["runs"].append(run)
                result["checks"] = checks(runs)
                _write(result, args.out, started)
    result["checks"] = checks(runs)
    result["load_avg_end"] = os.getloadavg()
    _write(result, args.out, started)
    print("\n" + _checks_table(result["checks"]))
    print(f"\nwrote {args.out} and {Path(args.out).with_suffix('.md')} ({time.perf_counter() - started:.0f} s)")
    return 0


# -- output ------------------------------------------------------------------------------------
def _mb(x) -> str:
    return "-" if x is None else f"{x / 1e6:.2f}"


def _node_table(run: dict) -> str:
    lines = ["| node | epoch | time s | samples/s | storage MB (loader) | blkio MB | peer MB in | peer MB served | "
             "cache hit MB | cached MB |", "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for n in run["per_node"]:
        for e in n["epochs"]:
            lines.append(f"| {n['node']} | {e['epoch']} | {e['time_s']:.2f} | {e['samples_per_s']:.1f} | "
                         f"{_mb(e['storage_bytes'])} | {_mb(e['blkio_read_bytes'])} | {_mb(e['peer_bytes'])} | "
                         f"{_mb(e['peer_served_bytes'])} | {_mb(e['cache_hit_bytes'])} | {_mb(e['cache_bytes'])} |")  # fmt: skip
    for t in run["epochs"]:
        lines.append(f"| all | {t['epoch']} | {t['time_s']:.2f} (max) | | {_mb(t['storage_bytes'])} | "
                     f"{_mb(t['blkio_read_bytes'])} | {_mb(t['peer_bytes'])} | {_mb(t['peer_served_bytes'])} | "
                     f"{_mb(t['cache_hit_bytes'])} | min {_mb(t['minimum_storage_bytes'])} |")  # fmt: skip
    return "\n".join(lines)


def _print_run(run: dict) -> None:
    print(_node_table(run))
    s = run["summary"]
    print(f"steady epoch {s['steady_time_s']:.2f} s, storage {_mb(s['steady_storage_bytes'])} MB "
          f"(blkio {_mb(s['steady_blkio_read_bytes'])}, minimum {_mb(s['steady_minimum_storage_bytes'])}), "
          f"peer {_mb(s['steady_peer_bytes'])} MB; run blkio {_mb(s['run_blkio_read_bytes'])} MB vs loader "
          f"{_mb(s['loader_storage_bytes_all_epochs'])} MB; wall {run['wall_s']} s", flush=True)  # fmt: skip


def _summary_table(runs: list[dict]) -> str:
    lines = ["| nodes | aggregate | mode | budget/node MB | epoch 0 s | steady s | steady storage MB (loader / blkio / "
             "minimum) | steady peer MB | epoch 0 storage MB | run blkio MB / loader MB |",
             "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in runs:
        s = r["summary"]
        lines.append(f"| {r['nodes']} | {r['aggregate_cache']:.0%} | {r['mode']} ({r['mode_name']}) | "
                     f"{_mb(r['budget_per_node'])} | {s['epoch0_time_s']:.2f} | {s['steady_time_s']:.2f} | "
                     f"{_mb(s['steady_storage_bytes'])} / {_mb(s['steady_blkio_read_bytes'])} / "
                     f"{_mb(s['steady_minimum_storage_bytes'])} | {_mb(s['steady_peer_bytes'])} | "
                     f"{_mb(s['epoch0_storage_bytes'])} | {_mb(s['run_blkio_read_bytes'])} / "
                     f"{_mb(s['loader_storage_bytes_all_epochs'])} |")  # fmt: skip
    return "\n".join(lines)


def _checks_table(rows: list[dict]) -> str:
    lines = ["| nodes | aggregate | b storage / min | c storage / min | b, c at minimum | c peer / b peer (<= 0.1) | "
             "a time / b time | a time / c time | b >= 2x faster than a |", "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        at_min = f"{r.get('b_storage_at_minimum')}, {r.get('c_storage_at_minimum')}"
        two_x = r.get("b_at_least_2x_faster_than_a", "n/a (50%)")
        lines.append(f"| {r['nodes']} | {r['aggregate_cache']:.0%} | {r.get('b_storage_over_minimum')} | "
                     f"{r.get('c_storage_over_minimum')} | {at_min} | {r.get('c_peer_over_b_peer')} "
                     f"({r.get('c_peer_at_most_10pct_of_b')}) | {r.get('a_time_over_b_time')} | "
                     f"{r.get('a_time_over_c_time')} | {two_x} |")  # fmt: skip
    return "\n".join(lines)


def _write(result: dict, out: str, started: float) -> None:
    result["total_wall_s"] = round(time.perf_counter() - started, 1)
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
    a, d, m = result["args"], result["dataset"], result["machine"]
    md = ["# Partitioned cache across nodes (`benchmarks/multinode.py`)", "",
          f"Conditions: {m['cpus']} cores ({m['cpu_model']}), {m['mem_gib']} GiB, kernel {m['kernel']}; one network "
          f"namespace per node with a private tmpfs /dev/shm, links shaped with tbf at {a['rate']}; one torchrun rank "
          f"per node, {a['threads']} DALI thread, batch {a['batch_size']} per rank, crops {a['size']} px, "
          f"{a['epochs']} epochs (epoch 0 fills the caches; the others are steady). Each node's processes in a blkio "
          f"cgroup of their own, reads of the dataset's device throttled to {a['throttle_frac']} x the node's measured "
          "prep rate (below); the dataset's pages evicted before every run. Load average at start "
          f"{', '.join(f'{x:.2f}' for x in result['load_avg_start'])}.", "",
          f"Dataset: {d['files']} JPEGs ({d['source']}), {d['total_bytes']:,} bytes, mean {d['mean_bytes']:,} bytes, "
          f"{d['classes']} classes, at `{d['root']}`.", "",
          "Modes: **a** no peer cache (`peers=False`), **b** partitioned cache (`locality_aware=False`), "
          "**c** partitioned + locality-aware. Budget per node: aggregate 50% -> 0.5/nodes of the dataset, "
          f"100% -> {a['margin']}/nodes. Minimum storage of an epoch = dataset bytes - bytes cached across nodes at its "
          "start. blkio = the node's cgroup `blkio.throttle.io_service_bytes` Read delta around the epoch (inside "
          "the worker).", "", "## Prep rate and throttle", "",
          "| nodes | steady samples/s per node (min-max) | MB/s per node | throttle MB/s per node |", "|---|---|---|---|"]  # fmt: skip
    for nodes, pr in result["prep"].items():
        md.append(f"| {nodes} | {pr['samples_per_s_per_node']} ({pr['min_samples_per_s']}-{pr['max_samples_per_s']}) | "
                  f"{_mb(pr['bytes_per_s_per_node'])} | {_mb(pr['throttle_bps_per_node'])} |")  # fmt: skip
    md += ["", "## Target checks (steady epochs, runs of one sweep)", "", _checks_table(result["checks"]), "",
           "## Per run (steady = mean over epochs 1..)", "", _summary_table(result["runs"]), "",
           "## Per node and epoch", ""]  # fmt: skip
    for nodes, pr in result["prep"].items():
        md += [f"### {nodes} nodes: prep-rate run (mode b, no throttle)", "", _node_table(pr["run"]), ""]
    for r in result["runs"]:
        md += [f"### {r['nodes']} nodes, aggregate {r['aggregate_cache']:.0%}, mode {r['mode']} ({r['mode_name']}), "
               f"throttle {_mb(r['throttle_bps'])} MB/s per node, wall {r['wall_s']} s", "", _node_table(r), ""]  # fmt: skip
    md.append(f"Total time: {result['total_wall_s']:.0f} s.")
    path.with_suffix(".md").write_text("\n".join(md) + "\n")


if __name__ == "__main__":
    sys.exit(main())
