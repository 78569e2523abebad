"""examples/imagenet/train.py with ``--loader coordl`` vs ``--loader torch``, short memory, slow storage.

    python -m benchmarks train_example                       # resnet18, 112 px, ~15 min on 2 cores
    python -m benchmarks train_example --quick               # resnet_tiny, 64 px, seconds (smoke test)

The same command but for ``--loader``, each in its own memory and blkio cgroup: the libraries are read
into the page cache outside them and the dataset (``DATA/train``, ``DATA/val`` with the next seed) evicted;
the throttle applies from the start. The first ``--limit-after`` epochs run with no memory limit (the
process's own memory grows for 2-3 epochs); then the limit is the run's own peak memory (anonymous and
mapped, sampled every 50 ms) plus ``--cache`` of the dataset, plus ``--slack`` for coordl (whose cache
budget is ``--cache``); the DataLoader's limit follows its own memory every 50 ms (``limit_memory``). The
later epochs are the ones to compare: per epoch the script's summary line and the device bytes (the
cgroup's ``blkio.throttle.io_service_bytes``). Writes ``train_example{,_quick}.{json,md}`` in ``--out``.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.harness import cli, dataset, limits, measure, report
from coordl.units import format_bytes, parse_bytes

OUT = str(cli.RESULTS)  # a folder
DATA = "/var/tmp/coordl-bench/imagenet-example-1000px"
TRAIN = dataset.ROOT / "examples" / "imagenet" / "train.py"
SUMMARY = re.compile(r"Epoch \[(\d+)\] summary: .*")


def warm_libraries() -> None:
    """Reads the Python packages the run maps (torch, DALI, numpy, Pillow) into the page cache, in
    this process's cgroup: the run's own cgroups then neither read them through the throttle nor
    evict them under the memory limit."""
    import site

    for base in {*site.getsitepackages(), os.path.dirname(os.__file__)}:
        for name in os.listdir(base):
            if name.split(".")[0] in ("torch", "nvidia", "numpy", "PIL", "pillow", "lib-dynload") or name.endswith(
                ".libs"
            ):
                limits.read_through(os.path.join(d, f) for d, _, fs in os.walk(os.path.join(base, name)) for f in fs)


class OwnMemory:
    """Samples the run's own memory every 50 ms while it runs without a limit: the peak of its anonymous
    memory (a training step's activations come and go) plus the libraries it maps, not the data it caches
    (the page cache of the dataset, coordl's shared memory); once :meth:`peak` is taken and ``follow`` set,
    the limit follows the own memory with ``follow`` bytes beyond it."""

    def __init__(self, lim: limits.Limits):
        self.lim, self.anon, self.mapped, self.frozen, self.follow = lim, 0, 0, False, None
        self.sampler = measure.Sampler(self.sample, 0.05)

    def sample(self) -> int:
        stat = {k: self.lim.stat(k) for k in ("total_rss", "total_mapped_file", "total_shmem", "total_cache")}
        mapped = stat["total_mapped_file"] - stat["total_shmem"]
        if not self.frozen:
            self.anon, self.mapped = max(self.anon, stat["total_rss"]), max(self.mapped, mapped)
        elif self.follow is not None:
            with contextlib.suppress(OSError):  # lowering it below the usage makes the kernel reclaim page cache now
                self.lim.limit_memory(stat["total_rss"] + max(0, mapped) + self.follow)
        return stat["total_cache"]  # page cache + shared memory: the data it holds

    def peak(self) -> int:
        self.frozen = True
        return self.anon + max(0, self.mapped)


def limit_memory(args, run: dict, lim: limits.Limits, loader: str, cache_bytes: int, meter: OwnMemory) -> None:
    """After the warm-up epochs: the run's own memory + slack + the cache fraction of the dataset.

    The process's own memory swings by 100-200 MB from step to step. coordl's cache is a fixed
    budget that cannot shrink, so its limit is fixed at its peak own memory + cache + slack: the
    slack is OOM headroom its data cannot use. The DataLoader's page cache would use any memory
    the process leaves free at the moment, so with ``--follow`` (the default) its limit follows
    its own memory every 50 ms, holding its page cache to the same cache fraction (+ its slack).
    """
    own = run["working_set_bytes"] = meter.peak()
    slack = args.slack if loader == "coordl" else args.baseline_slack
    run["memory_limit_bytes"] = own + slack + cache_bytes
    lim.limit_memory(run["memory_limit_bytes"])
    if args.follow and loader != "coordl":
        meter.follow, run["memory_limit_follows"] = slack + cache_bytes, True
    mb = lambda n: format_bytes(n, "MB", digits=0)  # noqa: E731
    how = (
        "follows own memory +"
        if run.get("memory_limit_follows")
        else f"{mb(own + slack + cache_bytes)} = own {mb(own)} +"
    )
    print(f"  {loader}: memory limit {how} slack {mb(slack)} + {args.cache:.0%} of the dataset", flush=True)


def run_one(args, loader: str, dataset_bytes: int, dev, caps: dict) -> dict:
    use, device = caps["memory"] or caps["blkio"], f"{dev[0]}:{dev[1]}"
    lim = limits.Limits(f"coordl-train-{os.getpid()}-{loader}", caps["memory"], caps["blkio"]) if use else None
    warm_libraries()
    subprocess.run(["coordl", "cache", "clean"], check=True, stdout=subprocess.DEVNULL)  # no cache from an earlier run
    os.sync()
    limits.evict(args.data)
    cache_bytes, checkpoints = (
        int(args.cache * dataset_bytes),
        tempfile.mkdtemp(prefix=f"coordl-train-example-{loader}-"),
    )
    cmd = [sys.executable, "-u", str(TRAIN), args.data, "-a", args.arch, "--epochs", str(args.epochs)]
    cmd += ["-b", str(args.batch_size), "-j", str(args.workers), "--image-size", str(args.image_size), "--seed", "0"]
    cmd += ["--loader", loader, "--cache", str(args.cache), "-p", "1000000", "--checkpoint-dir", checkpoints]
    run = {"loader": loader, "cmd": " ".join(cmd[1:]), "epochs": []}
    if lim:
        lim.throttle(dev, args.bandwidth)
    log = open(Path(args.out) / f"train_example-{loader}.log", "w")
    t0, meter = time.perf_counter(), OwnMemory(lim) if lim and lim.memory else None
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True, preexec_fn=lim.join if lim else None)
    try:
        last = limits.blkio_read(lim and lim.blkio and lim.blkio.path, device)
        for line in proc.stdout:
            log.write(line)
            start = re.match(rf"=> saved .*\(start of epoch {args.limit_after + 1}\)", line)
            if meter and "memory_limit_bytes" not in run and start:
                limit_memory(args, run, lim, loader, cache_bytes, meter)
            if m := SUMMARY.match(line.strip()):
                now = limits.blkio_read(lim and lim.blkio and lim.blkio.path, device)
                run["epochs"].append({"epoch": int(m[1]), "line": line.strip()})
                run["epochs"][-1]["device_bytes"], last = None if now is None else now - last, now
                if meter:  # the mean page cache + shared memory since the epoch before: the data in memory
                    data = meter.sampler.take()
                    run["epochs"][-1]["mean_data_in_memory_bytes"] = sum(data) / len(data) if data else None
                device_mb = "" if now is None else f"; device {format_bytes(run['epochs'][-1]['device_bytes'], 'MB')}"
                print(f"  {loader}: {line.strip()}{device_mb}", flush=True)
        run["returncode"] = proc.wait()
    finally:
        proc.kill()
        proc.wait()
        if meter:
            meter.sampler.stop()
        shutil.rmtree(checkpoints, ignore_errors=True)
        log.close()
        if lim:
            lim.remove()
    run["wall_s"] = time.perf_counter() - t0
    for e in run["epochs"]:
        m = re.search(r"([\d.]+) s, ([\d.]+) samples/s; waited for data ([\d.]+) s", e["line"])
        e["seconds"], e["samples_per_s"], e["wait_s"] = (float(x) for x in m.groups())
    return run


def markdown(result: dict) -> str:
    a, d = result["args"], result["dataset"]
    photos = " from photographs" if d.get("source") == "photographs" else ""
    follows = (
        "the limit following its own memory every 50 ms, so that its page cache holds that much."
        if a.get("follow", True)
        else "fixed at its peak own memory (its page cache then also uses what the process leaves free)."
    )
    rows = []
    for r in result["runs"]:
        for e in r["epochs"]:
            limited = e["epoch"] > a["limit_after"] and "memory_limit_bytes" in r
            limit = report.mb(r["memory_limit_bytes"], digits=0) if limited else "none (warm-up)"
            if limited and r.get("memory_limit_follows"):
                limit = f"own + {report.mb(a['baseline_slack'] + a['cache'] * d['total_bytes'], digits=0)}"
            cells = [e["seconds"], e["samples_per_s"], e["wait_s"], report.mb(e["device_bytes"])]
            rows.append([r["loader"], e["epoch"], *cells, report.mb(e.get("mean_data_in_memory_bytes")), limit])
    head = "loader|epoch|seconds|samples/s|waited for data s|device MB|data in memory MB|memory limit MB"
    lines = [e["line"] for r in result["runs"] for e in r["epochs"]]
    return f"""# examples/imagenet/train.py: `--loader coordl` vs `--loader torch`

`-a {a["arch"]}`, `--image-size {a["image_size"]}`, `-b {a["batch_size"]}`, `-j {a["workers"]}`, {a["epochs"]} epochs.
Dataset: {d["train_files"]} training + {d["val_files"]} validation JPEGs ({format_bytes(d["total_bytes"], "MB")}, \
generated{photos}). Storage throttled to {format_bytes(a["bandwidth"], "MB")}/s (blkio). From epoch \
{a["limit_after"] + 1} memory is limited to leave {a["cache"]:.0%} of the dataset for data: coordl (`--cache \
{a["cache"]}`) at its peak own memory + the cache + {format_bytes(a["slack"], "MiB", digits=0)} of headroom its \
fixed cache cannot use; the DataLoader at its own memory + {a["cache"]:.0%} + \
{format_bytes(a["baseline_slack"], "MiB", digits=0)}, {follows}
Device MB of epoch k: what the device delivered between the summary lines of epochs k-1 and k (epoch k's \
training and epoch k-1's validation). Data in memory: the mean of the cgroup's page cache and shared memory over \
the same window (coordl: its cache in /dev/shm; the DataLoader: the page cache).

{report.table(head, rows)}

The summary lines the script printed:

```
{chr(10).join(lines)}
```
"""


def options(p) -> None:
    # Large images: the data to cache must be large against the process's own memory swings, ~100-200 MB.
    where = "holds (or gets) train/, of --images or --size, and val/"
    dataset.add_dataset_options(p, data=DATA, images=1200, classes=10, width=1000, height=875, data_help=where)
    p.add_argument("--val-images", type=int, default=100, help="validation JPEGs, in DATA/val (default: 100)")
    p.add_argument("-a", "--arch", default="resnet18")
    p.add_argument("--image-size", type=int, default=112)
    p.add_argument("-b", "--batch-size", type=int, default=32)
    p.add_argument("-j", "--workers", type=int, default=2)
    p.add_argument("--epochs", type=int, default=6)
    limit = "epochs (and their validation) run without a memory limit: its memory grows for 2-3 epochs, then levels"
    p.add_argument("--limit-after", type=int, default=2, help=limit)
    p.add_argument("--cache", type=float, default=0.5, help="fraction of the dataset the memory limit leaves for data")
    p.add_argument("--bandwidth", type=parse_bytes, default="8MB", help="storage throttle, bytes per second")
    slack = "coordl's memory beyond its own peak (OOM headroom)"
    p.add_argument("--slack", type=parse_bytes, default="192MiB", help=slack)
    p.add_argument("--baseline-slack", type=parse_bytes, default="32MiB", help="the DataLoader's (its cache uses it)")
    fixed = "a fixed limit for the DataLoader too (its page cache then uses what its process leaves free)"
    p.add_argument("--no-follow", dest="follow", action="store_false", help=fixed)
    p.add_argument("--loaders", default="coordl,torch")
    p.add_argument("--quick", action="store_true", help="resnet_tiny at 64 px on 128+32 images, 2 epochs")


def out_path(args) -> Path:
    return Path(args.out) / f"train_example{'_quick' if args.quick else ''}.json"


def run(args) -> dict:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds: the cgroups are removed
    if args.quick:
        args.arch, args.image_size, args.images, args.size, args.val_images = "resnet_tiny", 64, 128, None, 32
        args.epochs, args.limit_after, args.width, args.height, args.bandwidth = 2, 0, 400, 350, parse_bytes("20MB")
        args.data = "/var/tmp/coordl-bench/imagenet-example-quick" if args.data == DATA else args.data
    Path(args.out).mkdir(parents=True, exist_ok=True)
    caps = limits.probe()
    for note in caps["notes"]:
        print(f"note: {note}", file=sys.stderr)
    train = dataset.dataset_from_args(args, root=os.path.join(args.data, "train"))
    val = dataset.dataset_from_args(args, root=f"{args.data}/val", images=args.val_images, seed=args.dataset_seed + 1)
    data = {"train_files": train["files"], "val_files": val["files"], "source": train["source"]}
    data["total_bytes"] = train["total_bytes"] + val["total_bytes"]
    options = {k: v for k, v in vars(args).items() if not k.startswith("_")}
    result = {"args": options, "dataset": data, "limits": caps, "runs": []}
    for loader in args.loaders.split(","):
        print(f"{loader}:", flush=True)
        result["runs"].append(run_one(args, loader, data["total_bytes"], measure.device_of(train["root"]), caps))
    out_path(args).with_suffix(".md").write_text(markdown(result))
    if any(r["returncode"] for r in result["runs"]):
        cli.save(args, result, out_path(args))
        raise SystemExit(max(r["returncode"] for r in result["runs"]))
    return result


table = markdown
