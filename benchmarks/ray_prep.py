"""Remote prep on a Ray node (``coordl.RayPrep``) against local prep alone, one core each.

The trainer on core 0, a one-CPU Ray node (``ray start``, the trainer's own: ``on_trainer_node=True``) on
core 1, in a network namespace with only loopback up; the loop does no work. Per backend (``dali``:
``imagenet-train``; ``torch``: ``ImageFolder`` + ``loaders.TrainAugment``): ``local`` (no Ray), ``remote``
(``RayPrep(workers=1, local=False)``), ``both`` (``local=True``); a fresh trainer per run, its first epoch
left out, ABBA for ``--rounds``. Targets: both/local >= 1.7, remote/local >= 0.9. The node is stopped by PID
(never ``ray stop``). Root, cores 0 and 1, Ray; docs/remote-prep.md.

    python -m benchmarks ray_prep            # ~10 min; --quick: 64 images, 1 round, 2 epochs, < 1 min
"""

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.harness import cli, dataset, jobs, limits, measure, report
from benchmarks.harness.report import log
from coordl_testing import raycluster

OUT = None  # results/ray_prep.json, or ray_prep_quick.json with --quick (out_path)
DATA, QUICK_DATA = "/var/tmp/coordl-bench/ray-prep", "/var/tmp/coordl-bench/ray-prep-quick"
BACKENDS, CONFIGS = ("dali", "torch"), ("local", "remote", "both")
TARGETS = {"both": 1.7, "remote": 0.9}  # at least this many times local's samples/s
TRAINER_CORE, RAY_CORE = 0, 1
MID_BATCHES, SKIP = 8, 1  # the fewest batches for a mid-epoch rate (its middle half); warm-up epochs
STATS = "batches read_s prep_s remote_units local_units remote_retried remote_result_bytes".split()
WHO = ("trainer", "actor", "ray")  # whose CPU seconds: the trainer's process, the actor's, Ray's others


def netns(pid) -> str | None:
    with contextlib.suppress(OSError):  # gone, or a zombie: None
        return os.readlink(f"/proc/{pid}/ns/net")


def others_in_my_netns() -> list[int]:
    """Every other live process in this network namespace: in a private one, what this benchmark started."""
    return [int(p) for p in os.listdir("/proc") if p.isdigit() and netns(p) == netns("self") and int(p) != os.getpid()]


# -- the trainer: one configuration, in a child pinned to core 0 --------------------------------
def make_loader(args):
    import coordl

    backend, config = args.trainer
    kw = {"batch_size": args.batch_size, "shuffle": True, "seed": 0, "cache": 0}
    remote = {"on_trainer_node": True, "local": config == "both"}  # the one node is the trainer's, its core apart
    if backend == "dali":
        remote |= {"threads": 1, "output": args.output}
        prep = coordl.Prep(threads=1) if config == "local" else coordl.RayPrep(workers=1, **remote)
        return coordl.CoordLoader(args.data, pipeline="imagenet-train", device_id=None, prep=prep, **kw)
    from benchmarks.loaders import TrainAugment
    from coordl.datasets import ImageFolder

    prep = None if config == "local" else coordl.RayPrep(workers=1, **remote)
    return coordl.CoordLoader(ImageFolder(args.data, transform=TrainAugment()), num_workers=0, prep=prep, **kw)


def trainer(args) -> None:
    """Runs one configuration; per-epoch figures to ``--out`` (Ray redirects a connected process's stdout)."""
    import torch

    torch.set_num_threads(1)  # one core: intra-op threads would only take turns on it
    me, parent, loader = os.getpid(), os.getppid(), make_loader(args)
    result, actors = {"epochs": []}, set()

    def cpu() -> dict:
        out = dict.fromkeys(WHO, 0.0) | {"trainer": measure.process_cpu_seconds(me)}
        for pid in set(others_in_my_netns()) - {parent}:
            out["actor" if pid in actors else "ray"] += measure.process_cpu_seconds(pid)
        return out

    try:
        for epoch in range(args.epochs):
            c0, t = cpu(), time.perf_counter()
            arrivals = []  # (when, samples so far) per batch
            for images, labels in loader:
                result["image_bytes"] = images[0].numel() * images.element_size()  # one sample, as delivered
                arrivals.append((time.perf_counter(), len(labels) + (arrivals[-1][1] if arrivals else 0)))
            seconds, samples, q = time.perf_counter() - t, arrivals[-1][1], len(arrivals) // 4
            (mid0, n0), (mid1, n1) = arrivals[q], arrivals[-1 - q]  # the middle half: no filling or draining
            mid = {"samples": n1 - n0, "seconds": round(mid1 - mid0, 4)} if len(arrivals) >= MID_BATCHES else None
            c1, s = cpu(), loader.stats()
            e = {"epoch": epoch, "seconds": round(seconds, 4), "samples": samples, "mid": mid}
            e["cpu_s"] = {who: round(c1[who] - c0[who], 3) for who in WHO}
            result["epochs"].append(e | {"stats": {k: s[k] for k in STATS if k in s}})
            if args.trainer[1] != "local" and epoch + 1 == SKIP:
                # The actor starts in the background and may still be starting (its imports, its pipeline)
                # when the warm-up epochs end, above all where the local pipeline takes every unit meanwhile.
                pool = loader.resources.remote.pool
                pool.wait_ready(timeout=300)
                actors = {int(info["worker"].rsplit(":", 1)[1]) for info in pool.ready.values()}
                result["actor_pids"] = sorted(actors)  # their CPU counts from the next epoch
    finally:
        loader.close()
    Path(args.out).write_text(json.dumps(result))


# -- the Ray node, pinned to core 1 -------------------------------------------------------------
def start_node(env: dict, temp: str) -> str:
    """Starts a one-CPU Ray head on ``RAY_CORE``, its temp dir ``temp``; its address (the default port: ours)."""
    ray = Path(sys.executable).with_name("ray")
    cmd = ["taskset", "-c", str(RAY_CORE), str(ray if ray.exists() else "ray"), "start", "--head", "--num-cpus=1"]
    cmd += ["--include-dashboard=false", "--disable-usage-stats", f"--temp-dir={temp}", "--node-ip-address=127.0.0.1"]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    if p.returncode:
        raise RuntimeError(f"`{' '.join(cmd)}` exited with {p.returncode}:\n{(p.stdout + p.stderr)[-3000:]}")
    return "127.0.0.1:6379"


def spilling(temp: str, after: float) -> dict:
    """The raylet's spill and restore counters, from a ``debug_state.txt`` (every 10 s) written after ``after``."""
    path, deadline = Path(temp) / "session_latest" / "logs" / "debug_state.txt", time.monotonic() + 15
    while time.monotonic() < deadline and not (path.exists() and path.stat().st_mtime > after):
        time.sleep(0.5)
    wanted = ("cumulative spill requests", "cumulative restore requests", "num bytes currently spilled")
    lines = (ln.strip().lstrip("- ").partition(": ") for ln in (path.read_text() if path.exists() else "").splitlines())
    return {key: int(value) for key, _, value in lines if key in wanted and value.strip().isdigit()}


def stop_all() -> list[int]:
    """Ends every other process in this namespace (SIGTERM, SIGKILL after 10 s); returns those left (none)."""
    for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        deadline = time.monotonic() + wait
        for pid in others_in_my_netns():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        while others_in_my_netns() and time.monotonic() < deadline:
            time.sleep(0.2)
    return others_in_my_netns()


def child_env(address: str | None) -> dict:
    """This checkout's coordl and benchmarks first on the path (for the actors too), and the node's address."""
    path = [str(dataset.ROOT / "src"), str(dataset.ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(":"))]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_ADDRESS", "RAY_AUTH_"))}
    # RAY_AUTH_MODE: without it, `ray start` turns token auth on when ~/.ray/auth_token exists (another session may
    # have made or may replace it) and the trainer is refused. Nothing outside this namespace can reach the node.
    env |= {"PYTHONPATH": os.pathsep.join(path), "RAY_AUTH_MODE": "disabled"}
    return env | ({"RAY_ADDRESS": address} if address else {})


def run_one(args, env: dict, r: int, backend: str, config: str, work: Path) -> dict:
    """Round ``r`` of one configuration: a fresh trainer on ``TRAINER_CORE``; its figures and :func:`steady`'s."""
    out = work / f"{backend}-{config}-{r}.json"
    kw = {"data": args.data, "batch_size": args.batch_size, "epochs": args.epochs, "out": out, "output": args.output}
    cmd = jobs.scenario_command("ray_prep", "--trainer", backend, config, *jobs.flags(**kw))
    if "error" in (run := jobs.outcome(["taskset", "-c", str(TRAINER_CORE), *cmd], env=env, out=out)):
        raise RuntimeError(f"the trainer ({backend}, {config}) failed: {run['error']}")
    run = {"round": r, "backend": backend, "config": config, **run}
    return run | steady(run["epochs"][SKIP:], args.batch_size)


def steady(epochs: list[dict], batch_size: int) -> dict:
    """A run's steady figures: its epochs after the warm-up, summed."""
    seconds, samples = (sum(e[k] for e in epochs) for k in ("seconds", "samples"))
    total = {k: sum(e["stats"].get(k, 0) for e in epochs) for k in STATS}
    out = {"steady_samples_per_s": round(samples / seconds, 1), "steady_seconds": round(seconds, 3)}
    mids = [e["mid"] for e in epochs]
    mid = sum(m["samples"] for m in mids) / sum(m["seconds"] for m in mids) if all(mids) else None
    out["mid_samples_per_s"] = mid and round(mid, 1)
    out["steady_cpu_s_per_sample"] = {k: sum(e["cpu_s"][k] for e in epochs) / samples for k in WHO}
    out["trainer_s_per_batch"] = seconds / total["batches"]
    remote, local = total["remote_units"], total["local_units"]
    if remote or local:
        out |= {"remote_share": remote / (remote + local), "remote_units": remote, "local_units": local}
    if remote:
        out["remote_result_bytes_per_sample"] = total["remote_result_bytes"] / (remote * batch_size)
        if not local:  # every read and prep second is the actor's: its time per unit
            out["actor_s_per_unit"] = (total["read_s"] + total["prep_s"]) / remote
    return out


def rates(runs: dict[str, list[dict]], key: str) -> dict:
    """Per configuration: the spread of ``key`` (samples/s) over its runs; the ratios to local of the medians."""
    s = {c: measure.spread_all([r[key] for r in rs]) for c, rs in runs.items()}
    ratio = {c: round(s[c]["median"] / s["local"]["median"], 3) for c in TARGETS}
    return {"samples_per_s": s, "ratio": ratio, "meets_target": {c: ratio[c] >= t for c, t in TARGETS.items()}}


def summarise(runs: list[dict]) -> dict:
    """Per backend: :func:`rates` of steady epochs and of their middle halves; what explains them (medians)."""
    keys = ("remote_share", "remote_result_bytes_per_sample", "actor_s_per_unit", "trainer_s_per_batch", "image_bytes")
    out = {}
    for backend in BACKENDS:
        by = {c: [r for r in runs if (r["backend"], r["config"]) == (backend, c)] for c in CONFIGS}
        s = out[backend] = rates(by, "steady_samples_per_s") | {"figures": {}}
        if all(r["mid_samples_per_s"] for rs in by.values() for r in rs):  # epochs of MID_BATCHES batches or more
            s["mid_epoch"] = rates(by, "mid_samples_per_s")
        for c, rs in by.items():
            f = s["figures"][c] = {k: statistics.median(r[k] for r in rs) for k in keys if k in rs[0]}
            f["cpu_s_per_sample"] = {k: statistics.median(r["steady_cpu_s_per_sample"][k] for r in rs) for k in WHO}
    return out


def table(result: dict) -> str:
    head = "backend|config|samples/s, median [min-max]|/ local|mid-epoch / local|remote share|result KB/sample"
    rows, lines = [], []
    for backend, s in result["summary"].items():
        mid = s.get("mid_epoch", {}).get("ratio", {})
        for c, f in s["figures"].items():
            kb, cpu = f.get("remote_result_bytes_per_sample"), f["cpu_s_per_sample"]
            rows.append([backend, c, report.spread(s["samples_per_s"][c], "{:.1f}", rng=True), s["ratio"].get(c)])
            rows[-1] += [mid.get(c), f.get("remote_share"), kb and kb / 1e3, f.get("actor_s_per_unit")]
            rows[-1] += [f["trainer_s_per_batch"], ", ".join(f"{1e3 * cpu[k]:.1f}" for k in WHO)]
        ok = {c: "meets" if m else "MISSES" for c, m in s["meets_target"].items()}
        meets = ", ".join(f"{c}/local {r:.3f} ({ok[c]} >= {TARGETS[c]})" for c, r in s["ratio"].items())
        lines.append(f"{backend}: {meets}")
    store = ", ".join(f"{k} {v}" for k, v in result["object_store"].items()) or "no figures (no debug_state.txt)"
    lines += [f"Ray's object store over all runs: {store}"]
    lines += [f"Ray processes left after the node was stopped: {len(result['ray_processes_left'])}"]
    head += "|actor s/unit|trainer s/batch|CPU ms/sample: trainer, actor, ray"
    return "\n".join([report.table(head, rows), "", *lines]) + "\n"


def cannot_run() -> str | None:
    if not {TRAINER_CORE, RAY_CORE} <= os.sched_getaffinity(0):
        return f"needs cores {TRAINER_CORE} and {RAY_CORE}"
    return raycluster.unavailable() or (None if shutil.which("taskset") else "needs taskset (util-linux)")


def options(p) -> None:
    root = f"dataset root (default: {DATA}; with --quick, {QUICK_DATA})"
    dataset.add_dataset_options(p, data=None, images=None, classes=None, width=480, height=360, data_help=root)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--rounds", type=int, help="rounds of every configuration, alternated (default 5; --quick: 1)")
    p.add_argument("--epochs", type=int, help="epochs per run, the first left out (default 4; --quick: 2)")
    uint8 = "RayPrep(output) of DALI's remote and both: 'uint8' sends pixels, normalised on the trainer"
    p.add_argument("--output", choices=["pipeline", "uint8"], default="pipeline", help=uint8)
    p.add_argument("--quick", action="store_true", help="a smoke run for the tests: 64 images, 1 round, 2 epochs")
    p.add_argument("--trainer", nargs=2, metavar=("BACKEND", "CONFIG"), help=argparse.SUPPRESS)
    p.add_argument("--in-netns", action="store_true", help=argparse.SUPPRESS)


def run(args) -> dict | None:
    if args.trainer:
        return trainer(args)
    q, out = args.quick, str(cli.RESULTS / f"ray_prep{'_quick' if args.quick else ''}.json")
    cli.defaults(args, q, data=(DATA, QUICK_DATA), classes=(8, 2), rounds=(5, 1), epochs=(4, 2), out=(out, out))
    cli.defaults(args, q, images=(1024, 64))  # unless --size: it has the last word (dataset.dataset_from_args)
    if args.rounds < 1 or args.epochs <= SKIP:
        raise SystemExit(f"--rounds must be at least 1 and --epochs more than {SKIP}")
    if not args.in_netns:  # here the dataset (with its progress bar); the rest in a network namespace of its own
        if why := cannot_run():
            raise SystemExit(f"ray_prep: {why}")
        dataset.dataset_from_args(args)
        os.execvp("unshare", ["unshare", "-n", *jobs.scenario_command("ray_prep", "--in-netns", *args._argv)])
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    data = dataset.dataset_from_args(args)
    limits.read_through(p for p in Path(args.data).rglob("*") if p.is_file())  # into the page cache
    temp = tempfile.mkdtemp(prefix="coordl-raybench-", dir="/tmp")  # short: Ray's socket paths
    work, runs = Path(temp), []  # the trainers' results beside Ray's session
    try:
        address = start_node(child_env(None), temp)
        log(f"dataset: {dataset.describe(data)}; Ray node at {address}, temp dir {temp}")
        for r, (backend, config) in measure.alternate([(b, c) for b in BACKENDS for c in CONFIGS], args.rounds):
            runs.append(run_one(args, child_env(address), r, backend, config, work))
            share = f", remote share {runs[-1]['remote_share']:.2f}" if "remote_share" in runs[-1] else ""
            log(f"round {r} {backend:5s} {config:6s} {runs[-1]['steady_samples_per_s']:7.1f} samples/s{share}")
        store = spilling(temp, after=time.time())
    finally:
        left = stop_all()
        shutil.rmtree(temp, ignore_errors=True)
    result = {"dataset": data, "ray_address": address, "ray_processes_left": left}
    result |= {"object_store": store, "runs": runs, "summary": summarise(runs)}
    if left:  # written all the same, with the processes left named
        cli.save(args, result)
        raise SystemExit(f"ray_prep: processes left in the namespace: {left}")
    return result
