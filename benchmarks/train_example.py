"""examples/imagenet/train.py with ``--loader coordl`` vs ``--loader torch``, short memory, slow storage.

    python -m benchmarks train_example                       # resnet18, 112 px, ~15 min on 2 cores
    python -m benchmarks train_example --quick               # resnet_tiny, 64 px, seconds (smoke test)

Each run in its own memory and blkio cgroup, throttled, the dataset evicted; after ``--limit-after`` epochs
memory is limited to the run's own peak + ``--cache`` of the dataset + a slack (:meth:`OwnMemory.limit`). Writes
``train_example{,_quick}.{json,md}`` in ``--out``; examples/imagenet/README.md has the method and the figures.
"""

import contextlib
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.harness import cli, dataset, limits, measure, report
from coordl.units import parse_bytes

OUT = str(cli.RESULTS)  # a folder
DATA = "/var/tmp/coordl-bench/imagenet-example-1000px"
TRAIN = dataset.ROOT / "examples" / "imagenet" / "train.py"
PACKAGES = ("torch", "nvidia", "numpy", "PIL", "pillow", "lib-dynload")
SUMMARY = re.compile(r"Epoch \[(\d+)\] summary: .*")
FIGURES = re.compile(r"([\d.]+) s, ([\d.]+) samples/s; waited for data ([\d.]+) s")


def warm_libraries() -> None:
    """Reads the packages the run maps (torch, DALI, numpy, Pillow) into the page cache, in this process's
    cgroup: the run's cgroups then neither read them through the throttle nor evict them under the limit."""
    import site

    for base in {*site.getsitepackages(), os.path.dirname(os.__file__)}:
        for name in os.listdir(base):
            if name.split(".")[0] in PACKAGES or name.endswith(".libs"):
                limits.read_through(os.path.join(d, f) for d, _, fs in os.walk(os.path.join(base, name)) for f in fs)


class OwnMemory:
    """Samples the run's own memory every 50 ms: the peak of its anonymous memory plus the libraries it maps, not the
    data it caches (page cache, coordl's shared memory); after :meth:`limit`, with ``follow`` the limit follows it."""

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

    def limit(self, args, run: dict, cache_bytes: int) -> None:
        """After the warm-up epochs: own peak memory + slack + the cache fraction. The own memory swings by 100-200
        MB from step to step: coordl's fixed cache cannot shrink (its slack is OOM headroom); the DataLoader's page
        cache would use any memory left free, so its limit follows its own memory (unless ``--no-follow``)."""
        self.frozen, coordl = True, run["loader"] == "coordl"
        own = run["working_set_bytes"] = self.anon + max(0, self.mapped)
        slack = args.slack if coordl else args.baseline_slack
        run["memory_limit_bytes"] = own + slack + cache_bytes
        self.lim.limit_memory(run["memory_limit_bytes"])
        if args.follow and not coordl:
            self.follow = run["memory_limit_follows"] = slack + cache_bytes  # bytes beyond its own memory
        mb = [report.mb(n, 0) for n in (run["memory_limit_bytes"], own, slack)]
        print(f"  {run['loader']}: memory limit {mb[0]} MB = own {mb[1]} + slack {mb[2]} + {args.cache:.0%} of data")


def run_one(args, loader: str, dataset_bytes: int, dev, caps: dict, checkpoints: str, log) -> dict:
    warm_libraries()
    # no cache from an earlier run
    subprocess.run([sys.executable, "-m", "coordl.cli", "cache", "clean"], check=True, stdout=subprocess.DEVNULL)
    limits.evict(args.data)
    cmd = [sys.executable, "-u", str(TRAIN), args.data, "-a", args.arch, "--epochs", str(args.epochs)]
    cmd += ["-b", str(args.batch_size), "-j", str(args.workers), "--image-size", str(args.image_size), "--seed", "0"]
    cmd += ["--loader", loader, "--cache", str(args.cache), "-p", "1000000", "--checkpoint-dir", checkpoints]
    run = {"loader": loader, "cmd": " ".join(cmd[1:]), "epochs": []}
    # the cgroups made after what may fail before the run starts: no cgroup is left behind then
    lim = limits.Limits(f"coordl-train-{os.getpid()}-{loader}", caps["memory"], caps["blkio"])  # either may be absent
    lim.throttle(dev, args.bandwidth)
    blkio, device = lim.blkio and lim.blkio.path, f"{dev[0]}:{dev[1]}"
    t0, meter = time.perf_counter(), OwnMemory(lim) if lim.memory else None
    last = limits.blkio_read(blkio, device)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True, preexec_fn=lim.join)
    try:
        for line in proc.stdout:
            log.write(line)
            if meter and not meter.frozen and re.match(rf"=> saved .*\(start of epoch {args.limit_after + 1}\)", line):
                meter.limit(args, run, int(args.cache * dataset_bytes))
            if m := SUMMARY.match(line.strip()):
                now = limits.blkio_read(blkio, device)
                e = {"epoch": int(m[1]), "line": line.strip(), "device_bytes": None if now is None else now - last}
                if meter:  # the mean page cache + shared memory since the epoch before: the data in memory
                    e["mean_data_in_memory_bytes"] = statistics.mean(data) if (data := meter.sampler.take()) else None
                e |= zip(("seconds", "samples_per_s", "wait_s"), map(float, FIGURES.search(line).groups()))
                run["epochs"].append(e)
                last = now
                print(f"  {loader}: {line.strip()}; device {report.mb(e['device_bytes'])} MB", flush=True)
        run["returncode"] = proc.wait()
    finally:
        proc.kill()
        proc.wait()
        if meter:
            meter.sampler.stop()
        lim.remove()
    run["wall_s"] = time.perf_counter() - t0
    return run


def table(result: dict) -> str:
    """A row per loader and epoch, and the summary lines the script printed."""
    rows, runs = [], [(r, e) for r in result["runs"] for e in r["epochs"]]
    for r, e in runs:
        limit = "none (warm-up)" if e["epoch"] <= result["limit_after"] else report.mb(r.get("memory_limit_bytes"), 0)
        if e["epoch"] > result["limit_after"] and r.get("memory_limit_follows"):
            limit = f"own + {report.mb(r['memory_limit_follows'], 0)}"
        cells = [e["seconds"], e["samples_per_s"], e["wait_s"], report.mb(e["device_bytes"])]
        rows.append([r["loader"], e["epoch"], *cells, report.mb(e.get("mean_data_in_memory_bytes")), limit])
    head = "loader|epoch|seconds|samples/s|waited for data s|device MB|data in memory MB|memory limit MB"
    title, block = "# examples/imagenet/train.py: `--loader coordl` vs `--loader torch`", [e["line"] for _, e in runs]
    return "\n".join([title, "", report.table(head, rows), "", "```", *block, "```", ""])


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
    p.add_argument("--limit-after", type=int, default=2, help="epochs (and their validation) without a memory limit")
    p.add_argument("--cache", type=float, default=0.5, help="fraction of the dataset the memory limit leaves for data")
    p.add_argument("--bandwidth", type=parse_bytes, default="8MB", help="storage throttle, bytes per second")
    p.add_argument("--slack", type=parse_bytes, default="192MiB", help="coordl's memory beyond its own peak")
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
    data["total_bytes"], dev = train["total_bytes"] + val["total_bytes"], measure.device_of(train["root"])
    result = {"dataset": data, "limits": caps, "runs": [], "limit_after": args.limit_after}
    for loader in args.loaders.split(","):
        print(f"{loader}:", flush=True)
        log_path = Path(args.out) / f"train_example-{loader}.log"
        with tempfile.TemporaryDirectory(prefix="coordl-train-example-") as checkpoints, open(log_path, "w") as log:
            result["runs"].append(run_one(args, loader, data["total_bytes"], dev, caps, checkpoints, log))
    out_path(args).with_suffix(".md").write_text(table(result))
    if any(r["returncode"] for r in result["runs"]):
        cli.save(args, result, out_path(args))
        raise SystemExit(max(r["returncode"] for r in result["runs"]))
    return result
