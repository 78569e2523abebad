"""Remote prep on a Ray node (``coordl.RayPrep``) against local prep alone, one core each.

The trainer pinned to core 0, a one-CPU Ray node (``ray start``) pinned to core 1 (the trainer's own:
``RayPrep(on_trainer_node=True)``), both in a network namespace with only loopback up. The loop does no
work. Per backend (``dali``: ``imagenet-train``; ``torch``: ``ImageFolder`` + ``loaders.TrainAugment``):
``local`` (no Ray), ``remote`` (``RayPrep(workers=1, local=False)``), ``both`` (``local=True``); a fresh
trainer per run, ``--skip`` warm-up epochs, configurations ABBA for ``--rounds``. Targets: both/local
>= 1.7, remote/local >= 0.9. The node is stopped by PID (never ``ray stop``); the JSON records that none
remained. Needs root, cores 0 and 1, and Ray (``pip install -e ".[ray]"``).

    python -m benchmarks ray_prep            # ~10 min; --quick: 64 images, 1 round, 2 epochs, < 1 min
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.harness import cli, dataset, jobs, limits, measure
from benchmarks.harness.report import log, mb

OUT = None  # results/ray_prep.json, or ray_prep_quick.json with --quick (out_path)
DATA = "/var/tmp/coordl-bench/ray-prep"
QUICK_DATA = "/var/tmp/coordl-bench/ray-prep-quick"
BACKENDS = ("dali", "torch")
CONFIGS = ("local", "remote", "both")
TARGETS = {"both": 1.7, "remote": 0.9}  # at least this many times local's samples/s
TRAINER_CORE, RAY_CORE = 0, 1
MID_BATCHES = 8  # the fewest batches in an epoch for a mid-epoch rate (its middle half)
STATS = ("samples", "batches", "elapsed_s", "stall_s", "read_s", "prep_s", "storage_reads", "storage_bytes")
REMOTE_STATS = ("remote_units", "local_units", "remote_workers", "remote_retried", "remote_result_bytes")


# -- processes, by network namespace -----------------------------------------------------------
def netns(pid: int | str) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/net")
    except OSError:  # gone, or a zombie
        return None


def pids_in_my_netns() -> list[int]:
    """Every live process in this process's network namespace: in a private one, only what this
    benchmark started."""
    mine = netns("self")
    return [int(p) for p in os.listdir("/proc") if p.isdigit() and netns(p) == mine]


# -- the trainer: one configuration, in a child pinned to core 0 --------------------------------
def make_loader(args):
    import coordl

    backend, config = args.trainer
    remote = {"remote": {"local": False}, "both": {"local": True}}.get(config)
    if remote is not None:
        remote["on_trainer_node"] = True  # the one Ray node is the trainer's, its core pinned apart
        remote["in_flight"] = args.in_flight
        if backend == "dali":
            remote["output"] = args.output
    common_kw = {"batch_size": args.batch_size, "shuffle": True, "seed": args.seed, "cache": 0}
    if backend == "dali":
        prep = coordl.Prep(threads=1) if remote is None else coordl.RayPrep(workers=1, threads=1, **remote)
        return coordl.CoordLoader(args.data, pipeline="imagenet-train", device_id=None, prep=prep, **common_kw)
    from benchmarks.loaders import TrainAugment
    from coordl.datasets import ImageFolder

    prep = None if remote is None else coordl.RayPrep(workers=1, **remote)
    return coordl.CoordLoader(ImageFolder(args.data, transform=TrainAugment()), num_workers=0, prep=prep, **common_kw)


def trainer(args) -> None:
    """Runs ``--epochs`` epochs of one configuration; writes per-epoch figures to ``--out``
    (a process connected to Ray has its stdout redirected, so not there)."""
    import torch

    torch.set_num_threads(1)  # one core: intra-op threads would only take turns on it
    dev = measure.device_of(args.data)
    me, parent = os.getpid(), os.getppid()
    t0 = time.perf_counter()
    loader = make_loader(args)
    result = {"made_s": round(time.perf_counter() - t0, 3), "epochs": []}
    actors: set[int] = set()

    def cpu() -> dict:
        out = {"trainer": measure.process_cpu_seconds(me), "actor": 0.0, "ray": 0.0}
        for pid in pids_in_my_netns():
            if pid not in (me, parent):
                out["actor" if pid in actors else "ray"] += measure.process_cpu_seconds(pid)
        return out

    try:
        for epoch in range(args.epochs):
            c0, d0, t = cpu(), measure.sectors_read(dev), time.perf_counter()
            arrivals = []  # (when, samples so far) per batch
            for images, labels in loader:
                if not arrivals:  # one sample's bytes, as delivered
                    result["image_bytes"] = images[0].numel() * images.element_size()
                arrivals.append((time.perf_counter(), len(labels) + (arrivals[-1][1] if arrivals else 0)))
            seconds = time.perf_counter() - t
            samples = arrivals[-1][1]
            q = len(arrivals) // 4  # the middle half of the epoch: no pipeline filling or draining
            (mid0, n0), (mid1, n1) = arrivals[q], arrivals[-1 - q]
            mid = {"samples": n1 - n0, "seconds": round(mid1 - mid0, 4)} if len(arrivals) >= MID_BATCHES else None
            c1, d1 = cpu(), measure.sectors_read(dev)
            s = loader.stats()
            e = {"epoch": epoch, "seconds": round(seconds, 4), "samples": samples, "mid": mid}
            e |= {"samples_per_s": round(samples / seconds, 1), "device_bytes": d1 - d0}
            e |= {"cpu_s": {who: round(c1[who] - c0[who], 3) for who in c0}}
            result["epochs"].append(e | {"stats": {k: s[k] for k in STATS + REMOTE_STATS if k in s}})
            if args.trainer[1] != "local" and epoch + 1 == args.skip:
                # The actor starts in the background and may still be starting (its imports, its pipeline)
                # when the warm-up epochs end, above all where the local pipeline takes every unit meanwhile.
                t = time.perf_counter()
                pool = loader.resources.remote.pool
                pool.wait_ready(timeout=300)
                result["actor_ready_wait_s"] = round(time.perf_counter() - t, 3)
                actors = {int(info["worker"].rsplit(":", 1)[1]) for info in pool.ready.values()}
                result["actor_pids"] = sorted(actors)  # their CPU counts from the next epoch
    finally:
        loader.close()
    Path(args.out).write_text(json.dumps(result))


# -- the Ray node, pinned to core 1 -------------------------------------------------------------
class RayNode:
    """A one-CPU Ray head on ``RAY_CORE`` with its own temp dir, stopped by PID (see the module's docstring)."""

    def __init__(self, env: dict):
        self.env = env
        self.temp = tempfile.mkdtemp(prefix="coordl-raybench-", dir="/tmp")  # short: Ray's socket paths
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.address = f"127.0.0.1:{self.port}"

    def start(self) -> None:
        ray = Path(sys.executable).with_name("ray")
        cmd = ["taskset", "-c", str(RAY_CORE), str(ray if ray.exists() else "ray"), "start", "--head", "--num-cpus=1"]
        cmd += [f"--port={self.port}", "--include-dashboard=false", "--disable-usage-stats"]
        cmd += [f"--temp-dir={self.temp}", "--node-ip-address=127.0.0.1"]
        p = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=180, check=False)
        if p.returncode:
            raise RuntimeError(f"`{' '.join(cmd)}` exited with {p.returncode}:\n{(p.stdout + p.stderr)[-3000:]}")

    def spilling(self, after: float) -> dict:
        """The raylet's cumulative spill and restore counters (its ``debug_state.txt``, written every
        10 s), from a dump made after ``after`` (``time.time()``), waiting up to 15 s for one."""
        path = Path(self.temp) / "session_latest" / "logs" / "debug_state.txt"
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and not (path.exists() and path.stat().st_mtime > after):
            time.sleep(0.5)
        if not path.exists():
            return {}
        wanted = ("cumulative spill requests", "cumulative restore requests", "num bytes currently spilled")
        out = {}
        for line in path.read_text().splitlines():
            key, _, value = line.strip().lstrip("- ").partition(": ")
            if key in wanted and value.strip().isdigit():
                out[key] = int(value)
        return out

    def stop(self) -> list[int]:
        """Ends every other process in this namespace (SIGTERM, then SIGKILL after 10 s); returns
        those still there, which should be none."""
        me = os.getpid()
        for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
            pids = [p for p in pids_in_my_netns() if p != me]
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + wait
            while pids and time.monotonic() < deadline:
                time.sleep(0.2)
                pids = [p for p in pids_in_my_netns() if p != me]
            if not pids:
                break
        shutil.rmtree(self.temp, ignore_errors=True)
        return [p for p in pids_in_my_netns() if p != me]


# -- the measurement ----------------------------------------------------------------------------
def child_env(address: str | None) -> dict:
    """This checkout's coordl and benchmarks first on the path (for the actors too), and the node's address."""
    path = [str(dataset.ROOT / "src"), str(dataset.ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(":"))]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_ADDRESS", "RAY_AUTH_"))}
    env["PYTHONPATH"] = os.pathsep.join(path)
    # Without it, `ray start` turns token auth on when ~/.ray/auth_token exists (another session may have
    # made or may replace it) and the trainer is refused. Nothing outside this namespace can reach the node.
    env["RAY_AUTH_MODE"] = "disabled"
    return env | ({"RAY_ADDRESS": address} if address else {})


def run_one(args, env: dict, backend: str, config: str, work: Path) -> dict:
    out, logfile = work / f"{backend}-{config}.json", work / f"{backend}-{config}.log"
    cmd = ["taskset", "-c", str(TRAINER_CORE), *jobs.scenario_command("ray_prep", "--trainer", backend, config)]
    kw = {"data": args.data, "batch_size": args.batch_size, "epochs": args.epochs, "seed": args.seed, "skip": args.skip}
    cmd += jobs.flags(**kw, out=out, in_flight=args.in_flight or None, output=args.output)
    out.unlink(missing_ok=True)
    t0 = time.perf_counter()
    with open(logfile, "w") as f:
        status = subprocess.run(
            cmd, env=env, stdout=f, stderr=subprocess.STDOUT, cwd=dataset.ROOT, timeout=args.timeout
        )
    if status.returncode or not out.exists():
        tail = logfile.read_text()[-4000:]
        raise RuntimeError(f"the trainer ({backend}, {config}) exited with {status.returncode}:\n{tail}")
    run = json.loads(out.read_text())
    run["wall_s"] = round(time.perf_counter() - t0, 2)
    run.update(steady(run["epochs"][args.skip :], args.batch_size))
    return run


def steady(epochs: list[dict], batch_size: int) -> dict:
    """A run's steady figures: its epochs after the warm-up, summed."""
    seconds = sum(e["seconds"] for e in epochs)
    samples = sum(e["samples"] for e in epochs)

    def total(key) -> float:
        return sum(e["stats"].get(key, 0) for e in epochs)

    out = {"steady_samples_per_s": round(samples / seconds, 1), "steady_seconds": round(seconds, 3)}
    mids = [e["mid"] for e in epochs]
    out["mid_samples_per_s"] = (
        round(sum(m["samples"] for m in mids) / sum(m["seconds"] for m in mids), 1) if all(mids) else None
    )
    out["steady_cpu_s_per_sample"] = {k: sum(e["cpu_s"][k] for e in epochs) / samples for k in epochs[0]["cpu_s"]}
    out["steady_device_bytes"] = sum(e["device_bytes"] for e in epochs)
    out["trainer_s_per_batch"] = seconds / total("batches")
    remote, local = total("remote_units"), total("local_units")
    if remote or local:
        out["remote_share"] = remote / (remote + local)
        out["remote_units"], out["local_units"] = remote, local
    if remote:
        out["remote_result_bytes_per_sample"] = total("remote_result_bytes") / (remote * batch_size)
        if not local:  # every read and prep second is the actor's: its time per unit
            out["actor_s_per_unit"] = (total("read_s") + total("prep_s")) / remote
    return out


def measure_all(args, env: dict, work: Path) -> list[dict]:
    """``--rounds`` rounds of every backend's configurations, ABBA."""
    runs = []
    for r, (backend, config) in measure.alternate([(b, c) for b in args.backends for c in CONFIGS], args.rounds):
        run = {"round": r, "backend": backend, "config": config, **run_one(args, env, backend, config, work)}
        runs.append(run)
        extra = f", remote share {run['remote_share']:.2f}" if "remote_share" in run else ""
        log(f"round {r} {backend:5s} {config:6s} {run['steady_samples_per_s']:7.1f} samples/s{extra}")
    return runs


def rates(runs: list[dict], key: str) -> dict:
    """Each configuration's ``key`` (samples/s) over its runs: the values, median, min and max, the
    ratios to local of the medians (with their targets), and per round."""
    values = {c: [r[key] for r in runs if r["config"] == c] for c in CONFIGS}
    med = {c: statistics.median(v) for c, v in values.items()}
    by_round: dict[int, dict] = {}
    for r in runs:
        by_round.setdefault(r["round"], {})[r["config"]] = r[key]
    return {
        "samples_per_s": values,
        "median": med,
        "min": {c: min(v) for c, v in values.items()},
        "max": {c: max(v) for c, v in values.items()},
        "ratio": {c: round(med[c] / med["local"], 3) for c in TARGETS},
        "ratio_per_round": {c: [round(v[c] / v["local"], 3) for v in by_round.values()] for c in TARGETS},
        "meets_target": {c: med[c] / med["local"] >= t for c, t in TARGETS.items()},
    }


def figures(runs: list[dict]) -> dict:
    """The figures that explain one configuration's rate: medians over its runs (maxima for bytes)."""
    keys = ("remote_share", "remote_result_bytes_per_sample", "actor_s_per_unit", "trainer_s_per_batch", "image_bytes")
    f = {k: statistics.median(r[k] for r in runs) for k in keys if k in runs[0]}
    f["cpu_s_per_sample"] = {
        k: statistics.median(r["steady_cpu_s_per_sample"][k] for r in runs) for k in ("trainer", "actor", "ray")
    }
    f["device_bytes_max"] = max(r["steady_device_bytes"] for r in runs)
    return f


def summarise(runs: list[dict], backends) -> dict:
    """Per backend: :func:`rates` of whole steady epochs and of their middle halves, and :func:`figures`."""
    out = {}
    for backend in backends:
        mine = [r for r in runs if r["backend"] == backend]
        out[backend] = rates(mine, "steady_samples_per_s")
        if all(r["mid_samples_per_s"] for r in mine):  # epochs of MID_BATCHES batches or more
            out[backend]["mid_epoch"] = rates(mine, "mid_samples_per_s")
        out[backend]["figures"] = {c: figures([r for r in mine if r["config"] == c]) for c in CONFIGS}
    return out


def table(result: dict) -> str:
    a, lines = result["args"], []
    lines += [
        f"Batch {a['batch_size']}; trainer on core {TRAINER_CORE}, Ray node "
        f"(1 CPU) on core {RAY_CORE}; {a['rounds']} rounds, {a['epochs']} epochs per run, the first "
        f"{a['skip']} left out; RayPrep(in_flight={a['in_flight']}, output={a.get('output', 'pipeline')!r}) on DALI.",
        "",
        "| backend | config | samples/s, median [min-max] | / local | per round | mid-epoch samples/s | / local | "
        "remote share | result KB/sample | actor s/unit | trainer s/batch | CPU ms/sample: trainer, actor, ray |",
        "|" + "---|" * 12,
    ]

    def cell(value, fmt=".3f"):
        return "-" if value is None else format(value, fmt)

    for backend, s in result["summary"].items():
        mid = s.get("mid_epoch", {"median": {}, "ratio": {}})
        for c in CONFIGS:
            f, kb = s["figures"][c], s["figures"][c].get("remote_result_bytes_per_sample")
            cpu = ", ".join(f"{1e3 * f['cpu_s_per_sample'][k]:.1f}" for k in ("trainer", "actor", "ray"))
            per_round = ", ".join(f"{x:.2f}" for x in s["ratio_per_round"].get(c, [])) or "-"
            cells = [f"{s['median'][c]:.1f} [{s['min'][c]:.0f}-{s['max'][c]:.0f}]", cell(s["ratio"].get(c)), per_round]
            cells += [cell(mid["median"].get(c), ".1f"), cell(mid["ratio"].get(c)), cell(f.get("remote_share"), ".2f")]
            cells += [cell(None if kb is None else kb / 1e3, ".0f"), cell(f.get("actor_s_per_unit"))]
            cells += [cell(f.get("trainer_s_per_batch")), cpu]
            lines.append(f"| {backend} | {c} | " + " | ".join(cells) + " |")
    lines.append("")
    for backend, s in result["summary"].items():
        verdict = [
            f"{c}/local {s['ratio'][c]:.3f} ({'meets' if s['meets_target'][c] else 'MISSES'} >= {t})"
            for c, t in TARGETS.items()
        ]
        verdict = ", ".join(verdict)
        f = s["figures"]
        disk = max(x["device_bytes_max"] for x in f.values())
        uncounted = any(x.get("remote_result_bytes_per_sample") == 0 for x in f.values())
        lines.append(
            f"{backend}: {verdict}; a delivered sample is {f['local']['image_bytes'] / 1e3:.0f} KB"
            + (" (stats() counts no remote_result_bytes for this backend)" if uncounted else "")
            + f"; the device read at most {mb(disk)} MB in a run's steady epochs"
        )
    store = ", ".join(f"{k} {v}" for k, v in result["object_store"].items()) or "no figures (no debug_state.txt)"
    lines.append(f"Ray's object store over all runs: {store}")
    lines.append(f"Ray processes left after the node was stopped: {len(result['ray_processes_left'])}")
    return "\n".join(lines) + "\n"


# -- main ---------------------------------------------------------------------------------------
def cannot_run() -> str | None:
    if os.geteuid() != 0:
        return "needs root: the Ray node and the trainer run in a network namespace of their own (unshare -n)"
    if len(os.sched_getaffinity(0)) < 2 or not {TRAINER_CORE, RAY_CORE} <= os.sched_getaffinity(0):
        return f"needs cores {TRAINER_CORE} and {RAY_CORE}"
    missing = [t for t in ("unshare", "ip", "taskset") if shutil.which(t) is None]
    if missing:
        return f"needs {', '.join(missing)} (util-linux, iproute2)"
    try:
        import ray  # noqa: F401
    except ImportError:
        return 'needs Ray: pip install -e ".[ray]"'
    return None


def options(p) -> None:
    root = f"dataset root (default: {DATA}; with --quick, {QUICK_DATA})"
    dataset.add_dataset_options(p, data=None, images=None, classes=None, width=480, height=360, data_help=root)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--rounds", type=int, help="rounds of every configuration, alternated (default 5; --quick: 1)")
    p.add_argument("--epochs", type=int, help="epochs per run, the first --skip left out (default 4; --quick: 2)")
    p.add_argument("--skip", type=int, default=1, help="epochs left out of the steady rate (default 1)")
    p.add_argument("--backends", default="dali,torch", help="dali, torch or both (default: dali,torch)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--in-flight", type=int, help="RayPrep(in_flight) of remote and both (default: RayPrep's own)")
    uint8 = "RayPrep(output) of DALI's remote and both: 'uint8' sends pixels, normalised on the trainer"
    p.add_argument("--output", choices=["pipeline", "uint8"], default="pipeline", help=uint8)
    p.add_argument("--timeout", type=float, default=600, help="seconds a trainer may run (default 600)")
    p.add_argument("--quick", action="store_true", help="a smoke run for the tests: 64 images, 1 round, 2 epochs")
    p.add_argument("--trainer", nargs=2, metavar=("BACKEND", "CONFIG"), help=argparse.SUPPRESS)
    p.add_argument("--in-netns", action="store_true", help=argparse.SUPPRESS)


def run(args) -> dict | None:
    if args.trainer:
        return trainer(args)
    q, out = args.quick, str(cli.RESULTS / f"ray_prep{'_quick' if args.quick else ''}.json")
    cli.defaults(args, q, data=(DATA, QUICK_DATA), classes=(8, 2), rounds=(5, 1), epochs=(4, 2), out=(out, out))
    if args.images is None and args.size is None:
        args.images = 64 if q else 1024
    args.backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    if not args.backends or set(args.backends) - set(BACKENDS):
        raise SystemExit(f"--backends takes dali and/or torch, got {args.backends}")
    if args.rounds < 1 or args.epochs <= args.skip:
        raise SystemExit("--rounds must be at least 1 and --epochs more than --skip")

    if not args.in_netns:
        why = cannot_run()
        if why:
            raise SystemExit(f"ray_prep: {why}")
        dataset.dataset_from_args(args)  # made here, with its progress bar; found again inside
        child = subprocess.Popen(["unshare", "-n", *jobs.scenario_command("ray_prep", "--in-netns", *args._argv)])
        try:
            code = child.wait()
        except KeyboardInterrupt:  # the child got it too: let it stop its Ray node
            code = child.wait()
        if code:
            raise SystemExit(code)
        return None  # the child wrote the result

    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    data = dataset.dataset_from_args(args)
    limits.read_through(p for p in Path(args.data).rglob("*") if p.is_file())  # into the page cache
    node = RayNode(child_env(None))
    env = child_env(node.address)
    log(f"dataset: {dataset.describe(data)}; Ray node at {node.address}, temp dir {node.temp}")
    work = Path(tempfile.mkdtemp(prefix="coordl-raybench-runs-"))
    try:
        node.start()
        runs = measure_all(args, env, work)
        store = node.spilling(after=time.time())
    finally:
        left = node.stop()
        shutil.rmtree(work, ignore_errors=True)
        if left:
            log(f"ray_prep: processes left in the namespace after SIGKILL: {left}")
    args_ = {k: v for k, v in vars(args).items() if not k.startswith("_")}
    result = {"args": args_, "dataset": data, "ray_address": node.address, "ray_processes_left": left}
    result |= {"object_store": store, "runs": runs}
    result["summary"] = summarise(runs, args.backends)
    if left:  # written all the same, with the processes left named
        cli.save(args, result)
        raise SystemExit(f"ray_prep: processes left in the namespace: {left}")
    return result
