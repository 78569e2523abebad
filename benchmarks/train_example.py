"""examples/imagenet/train.py with ``--loader coordl`` vs ``--loader torch``, short memory, slow storage.

    python benchmarks/train_example.py                       # resnet18, 224 px, ~25 min on 2 cores
    python benchmarks/train_example.py --quick               # resnet_tiny, 64 px, seconds (smoke test)

Both runs are the same command but for ``--loader``, each in its own memory and blkio cgroup:

1. the dataset (``train/`` and ``val/``, generated from the photographs) is evicted from
   the page cache; the storage throttle applies from the start;
2. epoch 0 runs with no memory limit (it reads every byte from storage either way);
3. when it ends, the memory limit is set to what the run holds in anonymous memory then
   (the model, the optimiser, DALI or the DataLoader workers), plus ``--slack``, plus
   ``--cache`` of the dataset: coordl gets ``--cache`` as its cache budget, the DataLoader
   the same bytes for the page cache;
4. the later epochs run under it. Per epoch: the script's own summary line (time, wait
   for data, coordl's fetch/prep split and bytes) and the bytes the device delivered
   (the cgroup's ``blkio.throttle.io_service_bytes``).

Writes ``results/train_example.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import common  # noqa: E402
import limits  # noqa: E402

from coordl.fetch.cache import parse_bytes  # noqa: E402

TRAIN = HERE.parent / "examples" / "imagenet" / "train.py"
MB = 1e6
SUMMARY = re.compile(r"Epoch \[(\d+)\] summary: .*")


def blkio_read(lim: limits.Limits, dev: tuple[int, int]) -> int | None:
    if not lim or not lim.blkio:
        return None
    for line in lim.blkio.read("blkio.throttle.io_service_bytes").splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[0] == f"{dev[0]}:{dev[1]}" and parts[1] == "Read":
            return int(parts[2])
    return 0


def run_one(args, loader: str, dataset_bytes: int, dev, caps: dict) -> dict:
    lim = limits.Limits(f"coordl-train-{os.getpid()}-{loader}", caps["memory"], caps["blkio"]) \
        if caps["memory"] or caps["blkio"] else None  # fmt: skip
    os.sync()
    common.evict(args.data)
    cache_bytes = int(args.cache * dataset_bytes)
    cmd = [sys.executable, "-u", str(TRAIN), args.data, "-a", args.arch, "--epochs", str(args.epochs),
           "-b", str(args.batch_size), "-j", str(args.workers), "--image-size", str(args.image_size),
           "--seed", "0", "--loader", loader, "--cache", str(args.cache), "-p", "1000000",
           "--checkpoint-dir", str(Path(args.out) / f"ckpt-{loader}")]  # fmt: skip
    run = {"loader": loader, "cmd": " ".join(cmd[1:]), "epochs": []}
    if lim:
        lim.throttle(dev, args.bandwidth)
    log = open(Path(args.out) / f"train_example-{loader}.log", "w")
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True, preexec_fn=lim.join if lim else None)
    try:
        last = blkio_read(lim, dev)
        for line in proc.stdout:
            log.write(line)
            m = SUMMARY.match(line.strip())
            if not m:
                continue
            now = blkio_read(lim, dev)
            epoch = {"epoch": int(m[1]), "line": line.strip(), "device_bytes": None if now is None else now - last}
            last = now
            if lim and lim.memory:
                epoch["memory_usage_bytes"] = lim.usage()
            run["epochs"].append(epoch)
            print(f"  {loader}: {line.strip()}" + ("" if now is None else f"; device {epoch['device_bytes'] / MB:.1f} MB"),
                  flush=True)  # fmt: skip
            if epoch["epoch"] == 0 and lim and lim.memory:
                anon = lim.stat("total_rss")
                run["working_set_bytes"] = anon
                # coordl's cache cannot shrink, so the slack keeps its peaks from the OOM killer; the
                # page cache would use any slack for data, so the DataLoader gets none (as in run.py).
                slack = args.slack if loader == "coordl" else args.baseline_slack
                run["memory_limit_bytes"] = anon + slack + cache_bytes
                lim.limit_memory(run["memory_limit_bytes"])
                print(f"  {loader}: memory limit {run['memory_limit_bytes'] / MB:.0f} MB = anonymous "
                      f"{anon / MB:.0f} MB + slack {slack / MB:.0f} MB + {args.cache:.0%} of the dataset",
                      flush=True)  # fmt: skip
        run["returncode"] = proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
        if lim:
            lim.remove()
    run["wall_s"] = time.perf_counter() - t0
    for e in run["epochs"]:
        m = re.search(r"([\d.]+) s, ([\d.]+) samples/s; waited for data ([\d.]+) s", e["line"])
        e["seconds"], e["samples_per_s"], e["wait_s"] = (float(x) for x in m.groups())
    return run


def ensure_val(root: str, images: int, classes: int) -> dict:
    """The validation split: other images than the training split's (another seed)."""
    from coordl.datagen import make_dataset

    photos = str(common.SHARED_PHOTOS) if common.SHARED_PHOTOS.is_dir() else None
    s = make_dataset(root, num_images=images, num_classes=classes, photos_dir=photos, seed=1, progress=False)
    return {"root": s.root, "files": s.files, "total_bytes": s.total_bytes}


def markdown(result: dict) -> str:
    a = result["args"]
    out = [
        "# examples/imagenet/train.py: `--loader coordl` vs `--loader torch`",
        "",
        f"`{result['command']}` on {result['machine']['cpus']} cores; `-a {a['arch']}`, "
        f"`--image-size {a['image_size']}`, `-b {a['batch_size']}`, `-j {a['workers']}`, {a['epochs']} epochs.",
        f"Dataset: {result['dataset']['train_files']} training + {result['dataset']['val_files']} validation JPEGs "
        f"({result['dataset']['total_bytes'] / MB:.1f} MB, generated from photographs). Storage throttled to "
        f"{a['bandwidth'] / MB:.1f} MB/s (blkio); from epoch 1 memory limited to the run's anonymous memory + "
        f"{a['cache']:.0%} of the dataset (coordl: `--cache {a['cache']}`), + {a['slack'] / 2**20:.0f} MiB of "
        f"headroom for coordl's peaks and {a['baseline_slack'] / 2**20:.0f} MiB for the DataLoader's.",
        "Device MB of epoch k: what the device delivered between the summary lines of epochs k-1 and k "
        "(epoch k's training and epoch k-1's validation).",
        "",
        "| loader | epoch | seconds | samples/s | waited for data s | device MB | memory limit MB |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in result["runs"]:
        for e in r["epochs"]:
            dev = "-" if e["device_bytes"] is None else f"{e['device_bytes'] / MB:.1f}"
            limit = f"{r['memory_limit_bytes'] / MB:.0f}" if e["epoch"] > 0 and "memory_limit_bytes" in r else "none"
            out.append(f"| {r['loader']} | {e['epoch']} | {e['seconds']:.1f} | {e['samples_per_s']:.1f} | "
                       f"{e['wait_s']:.1f} | {dev} | {limit} |")  # fmt: skip
    out += ["", "The summary lines the script printed:", "", "```"]
    for r in result["runs"]:
        out += [e["line"] for e in r["epochs"]]
    out += ["```", ""]
    return "\n".join(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default="/var/tmp/coordl-bench/imagenet-example", help="holds (or gets) train/ and val/")
    p.add_argument("--train-images", type=int, default=1000)
    p.add_argument("--val-images", type=int, default=100)
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("-a", "--arch", default="resnet18")
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("-b", "--batch-size", type=int, default=32)
    p.add_argument("-j", "--workers", type=int, default=2)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--cache", type=float, default=0.5, help="fraction of the dataset the memory limit leaves for data")
    p.add_argument("--bandwidth", type=parse_bytes, default="2MB", help="storage throttle, bytes per second")
    p.add_argument("--slack", type=parse_bytes, default="64MiB", help="coordl's memory beyond its anonymous memory")
    p.add_argument("--baseline-slack", type=parse_bytes, default=0, help="the DataLoader's (its page cache would use it)")
    p.add_argument("--loaders", default="coordl,torch")
    p.add_argument("--quick", action="store_true", help="resnet_tiny at 64 px on 128+32 images, 2 epochs")
    p.add_argument("--out", default=str(HERE / "results"))
    args = p.parse_args()
    if args.quick:
        args.arch, args.image_size, args.train_images, args.val_images, args.epochs = "resnet_tiny", 64, 128, 32, 2
        args.bandwidth = parse_bytes("20MB")
        if args.data == p.get_default("data"):
            args.data = "/var/tmp/coordl-bench/imagenet-example-quick"
    Path(args.out).mkdir(parents=True, exist_ok=True)
    caps = limits.probe()
    for note in caps["notes"]:
        print(f"note: {note}", file=sys.stderr)
    train = common.ensure_dataset(os.path.join(args.data, "train"), args.train_images, args.classes, None)
    val = ensure_val(os.path.join(args.data, "val"), args.val_images, args.classes)
    dataset = {"train_files": train["files"], "val_files": val["files"],
               "total_bytes": train["total_bytes"] + val["total_bytes"], "source": train["source"]}  # fmt: skip
    dev = common.device_of(train["root"])
    result = {"command": "python benchmarks/train_example.py " + " ".join(sys.argv[1:]), "machine": common.machine(),
              "args": vars(args), "dataset": dataset, "limits": caps, "runs": []}  # fmt: skip
    for loader in args.loaders.split(","):
        print(f"{loader}:", flush=True)
        result["runs"].append(run_one(args, loader, train["total_bytes"] + val["total_bytes"], dev, caps))
    name = "train_example_quick" if args.quick else "train_example"
    (Path(args.out) / f"{name}.json").write_text(json.dumps(result, indent=1))
    md = markdown(result)
    (Path(args.out) / f"{name}.md").write_text(md)
    print(md)
    return max(r["returncode"] for r in result["runs"])


if __name__ == "__main__":
    sys.exit(main())
