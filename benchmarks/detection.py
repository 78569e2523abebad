"""Object detection on the CPU: coordl's SSDTrain against DALI's own COCO pipeline and a
``DataLoader`` doing the same augmentation in Python, and an HP group of two trials.

Scenarios (``--scenarios``):

- ``prep``: prep-bound loading, the whole dataset in memory (page cache warm, coordl's cache holding
  it) and no training step. Three loaders with the same batch size and CPU threads/workers
  (:mod:`benchmarks.detection_baselines`): ``coordl`` (``SSDTrain(size=300)``), ``dali``
  (NVIDIA's SSD300 pipeline: ``fn.readers.coco``, ``fn.random_bbox_crop``, ...) and ``torch``
  (``DataLoader(CocoDetection(transforms=PythonSSD()))``); ``--loaders`` may add ``dali-1``, DALI's
  with ``num_attempts=1``, which crops as often as coordl and the PyTorch reference do. Each run is
  a child process: a warm-up epoch, then ``--epochs`` epochs measured for samples/s and CPU seconds
  per sample (the process, its threads, its live descendants and its reaped children). Runs alternate A B C A B C,
  ``--reps`` times; reported: each run, the medians, coordl/dali and coordl/torch.
- ``hp``: two coordl trials started together (each reads its batches, ``x.sum()``), in the HP group
  ``bench-detect`` vs the same two without a group, alternating, ``--reps`` times; per-trial
  samples/s over the epochs after the first; speedup = group / separate per trial.

Also measured in the parent: the Python a coordl batch costs outside DALI, ``crops.plan`` (run for
the pipeline's feed and again for the targets) and ``targets``, per batch of ``--batch-size``.

The dataset is COCO-like (``coordl.tools.datagen.coco.make_coco``): JPEGs around ``--width`` x
``--height`` cropped from photographs with 1-8 solid rectangles each, generated once under ``--data``.

    python -m benchmarks.detection                 # 1500 images, 3 reps: about 11 minutes on 2 cores
    python -m benchmarks.detection --smoke --data /tmp/coco-smoke --out /tmp/detection.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import common
from benchmarks import detection_baselines as baselines

HERE = Path(__file__).resolve().parent
LOADERS = ("coordl", "dali", "torch")  # the default set; also "dali-1" (see detection_baselines)


def cpu_seconds() -> float:
    """CPU seconds of this process (every thread), of its live descendants and of its reaped children."""
    stats = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                text = Path(f"/proc/{name}/stat").read_text()
            except OSError:
                continue
            f = text[text.rindex(")") + 2 :].split()  # fields from the 3rd (state) on
            stats[int(name)] = (int(f[1]), sum(int(x) for x in f[11:15]))  # ppid; utime stime cutime cstime
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in stats.items():
        children.setdefault(ppid, []).append(pid)
    total, todo = 0, [os.getpid()]
    while todo:
        pid = todo.pop()
        total += stats.get(pid, (0, 0))[1]
        todo += children.get(pid, [])
    return total / os.sysconf("SC_CLK_TCK")


def job(args) -> None:
    """One run of one loader (a child process): builds it, a warm-up epoch, then the measured epochs."""
    import coordl

    coco = dataset(args)
    if args.job in ("dali", "dali-1"):
        attempts = 1 if args.job == "dali-1" else 50
        loader = baselines.DaliCoco(
            coco["images"], coco["annotations"], args.batch_size, args.threads, attempts=attempts
        )
    elif args.job == "torch":
        loader = baselines.torch_loader(coco["images"], coco["annotations"], args.batch_size, args.threads)
    else:
        index = coordl.Index.from_coco(coco["images"], coco["annotations"])
        loader = baselines.coordl_loader(index, args.batch_size, args.threads, group=args.group)
    out = {"loader": args.job, "group": args.group, "epochs": []}
    keys = ("storage_reads", "cache_hits", "cache_items", "stall_s", "prep_s", "produced", "consumed_shared")
    try:
        if args.ready:
            common.wait_for_go(args.ready, args.go)
        for epoch in range(args.warmup + args.epochs):
            if hasattr(loader, "set_epoch"):
                loader.set_epoch(epoch)
            cpu, t0, n = cpu_seconds(), time.perf_counter(), 0
            for images, _targets in loader:
                if args.touch:
                    images.sum()  # a trivial training step
                n += len(images)
            e = {"warmup": epoch < args.warmup, "seconds": time.perf_counter() - t0, "samples": n}
            e["cpu_s"] = cpu_seconds() - cpu
            if hasattr(loader, "stats"):
                s = loader.stats()
                e["stats"] = {k: s.get(k) for k in keys}
            out["epochs"].append(e)
    finally:
        if hasattr(loader, "close"):
            loader.close()
    Path(args.out).write_text(json.dumps(out))


def steady(run: dict) -> dict:
    """A run's samples/s and CPU seconds per sample over its measured epochs."""
    es = [e for e in run["epochs"] if not e["warmup"]]
    n = sum(e["samples"] for e in es)
    return {"samples_per_s": n / sum(e["seconds"] for e in es), "cpu_s_per_sample": sum(e["cpu_s"] for e in es) / n}


def job_command(args, name: str, out: Path, *extra: str) -> list[str]:
    argv = ["--job", name, "--out", str(out), "--batch-size", str(args.batch_size), "--threads", str(args.threads)]
    return common.module_command("detection", *argv, *dataset_argv(args), *extra)


def prep(args, workdir: Path, command=None) -> dict:
    """Each of ``args.loaders`` run alone in a child (``command(args, name, out, *extra)``, default this
    module's :func:`job_command`), A B C A B C for ``args.reps``: each run, the medians, coordl/each other."""
    command = command or job_command
    runs: dict[str, list[dict]] = {name: [] for name in args.loaders}
    for rep in range(args.reps):
        for name in args.loaders:  # A B C A B C
            out = workdir / f"{name}.json"
            epochs = ["--warmup", "1", "--epochs", str(args.epochs)]
            load = os.getloadavg()[0]
            subprocess.run(command(args, name, out, *epochs), check=True)
            run = {**json.loads(out.read_text()), "load_before": load, "load_after": os.getloadavg()[0]}
            run.update(steady(run))
            runs[name].append(run)
            print(
                f"  rep {rep + 1} {name:>6}: {run['samples_per_s']:7.1f} samples/s, "
                f"{1000 * run['cpu_s_per_sample']:.2f} CPU-ms/sample"
            )
    median = {
        name: {k: statistics.median(r[k] for r in rs) for k in ("samples_per_s", "cpu_s_per_sample")}
        for name, rs in runs.items()
    }
    ratios = {}
    for other in (n for n in median if n != "coordl"):
        if "coordl" in median:
            ratios[f"coordl/{other}"] = {
                "samples_per_s": median["coordl"]["samples_per_s"] / median[other]["samples_per_s"],
                "cpu_s_per_sample": median["coordl"]["cpu_s_per_sample"] / median[other]["cpu_s_per_sample"],
            }
    return {"runs": runs, "median": median, "ratios": ratios}


def hp(args, workdir: Path, command=None, group: str = "bench-detect", step: tuple[str, ...] = ("--touch",)) -> dict:
    """Two coordl trials (``command``, default this module's :func:`job_command`) with ``step``'s arguments,
    in the HP group ``group`` vs separate, alternating for ``args.reps``: per-trial rates and speedups."""
    command = command or job_command
    runs: dict[str, list[dict]] = {"separate": [], "group": []}
    for rep in range(args.reps):
        for mode in runs:
            go = workdir / "go"
            go.unlink(missing_ok=True)
            commands, files = [], []
            for k in range(2):
                out, ready = common.job_files(workdir, k)
                extra = ["--warmup", "1", "--epochs", str(args.hp_epochs - 1), *step]
                extra += ["--ready", str(ready), "--go", str(go)]
                extra += ["--group", group] if mode == "group" else []
                commands.append(command(args, "coordl", out, *extra))
                files.append((out, ready))
            load = os.getloadavg()[0]
            procs = common.start_together(commands, [r for _, r in files], go)
            if any(p.wait() for p in procs):
                raise SystemExit(f"an hp job failed: exit codes {[p.returncode for p in procs]}")
            jobs = [json.loads(out.read_text()) for out, _ in files]
            rates = [steady(j)["samples_per_s"] for j in jobs]
            cpu = sum(steady(j)["cpu_s_per_sample"] * 0.5 for j in jobs)  # per sample delivered to a trial
            runs[mode].append(
                {"per_trial_samples_per_s": rates, "cpu_s_per_sample": cpu, "jobs": jobs, "load_before": load}
            )
            print(f"  rep {rep + 1} {mode:>8}: per trial {[round(r, 1) for r in rates]} samples/s")
    speedups = [
        statistics.mean(g["per_trial_samples_per_s"]) / statistics.mean(s["per_trial_samples_per_s"])
        for s, g in zip(runs["separate"], runs["group"], strict=True)
    ]
    return {
        "trials": 2,
        "group": group,
        **runs,
        "speedups": speedups,
        "speedup_median": statistics.median(speedups),
    }


def python_per_batch(args) -> dict:
    """Milliseconds of Python per coordl batch outside DALI: ``crops.plan`` and ``targets``."""
    import numpy as np

    import coordl
    from coordl.detection import crops, targets

    coco = dataset(args)
    index = coordl.Index.from_coco(coco["images"], coco["annotations"])
    recipe, b = coordl.SSDTrain(size=baselines.SIZE), min(args.batch_size, len(index))
    ids = np.random.default_rng(0).permutation(len(index))[:b]
    out = {}
    for name, f in (("plan", crops.plan), ("targets", targets.targets)):
        times = []
        for epoch in range(50):
            t0 = time.perf_counter()
            f(recipe, index.boxes, 0, epoch, ids)
            times.append(time.perf_counter() - t0)
        out[f"{name}_ms"] = 1000 * statistics.median(times)
    out["batch"] = b
    return out


# -- the dataset -----------------------------------------------------------------------------
def add_dataset_options(p: argparse.ArgumentParser) -> None:
    """``common.add_dataset_options``'s names for a COCO dataset (no classes, no ``--size``)."""
    g = p.add_argument_group("dataset", "generated under --data if missing, found again by a later run")
    g.add_argument("--data", default="/var/tmp/coordl-bench/coco", help="dataset root (default: %(default)s)")
    g.add_argument("--images", type=int, default=1500, help="JPEGs to generate (default: %(default)s)")
    source = g.add_mutually_exclusive_group()
    source.add_argument("--photos", help=f"photographs to crop from (default: {common.SHARED_PHOTOS} if present)")
    source.add_argument("--synthetic", action="store_true", help="generated images, even where photographs are")
    g.add_argument("--width", type=int, default=640, help="mean image width, +-12.5%% (default: %(default)s)")
    g.add_argument("--height", type=int, default=480, help="mean image height, +-12.5%% (default: %(default)s)")
    g.add_argument("--quality", type=int, default=90, help="JPEG quality (default: %(default)s)")
    g.add_argument("--dataset-seed", type=int, default=0, help="the generator's seed (default: 0)")


def dataset_argv(args) -> list[str]:
    argv = ["--data", args.data, "--images", str(args.images), "--width", str(args.width)]
    argv += ["--height", str(args.height), "--quality", str(args.quality), "--dataset-seed", str(args.dataset_seed)]
    photos = common.photos_of(args)
    return argv + (["--photos", photos] if photos else ["--synthetic"])


def dataset(args) -> dict:
    """Generates (or finds) the dataset; returns its figures."""
    from coordl.tools.datagen.coco import make_coco

    photos = common.photos_of(args)
    spread = lambda m: (m - m // 8, m + m // 8)  # noqa: E731
    s = make_coco(
        args.data,
        args.images,
        seed=args.dataset_seed,
        width=spread(args.width),
        height=spread(args.height),
        boxes=(1, 8),
        quality=args.quality,
        photos_dir=photos,
    )
    truths = list(s.truths.values())
    pixels = sum(t.width * t.height for t in truths)
    return {
        "root": s.root,
        "images": s.images,
        "annotations": s.annotations,
        "files": len(truths),
        "total_bytes": s.total_bytes,
        "mean_bytes": round(s.total_bytes / len(truths)),
        "bytes_per_pixel": round(s.total_bytes / pixels, 3),
        "mean_width": round(sum(t.width for t in truths) / len(truths)),
        "mean_height": round(sum(t.height for t in truths) / len(truths)),
        "boxes": sum(len(t.boxes) for t in truths),
        "empty_images": sum(not t.boxes for t in truths),
        "jpeg_quality": args.quality,
        "source": "photographs" if photos else "generated",
    }


# -- the command -----------------------------------------------------------------------------
def main() -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.detection", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--job", choices=(*LOADERS, "dali-1"), help=argparse.SUPPRESS)
    for a in ("--group", "--ready", "--go"):
        p.add_argument(a, help=argparse.SUPPRESS)
    p.add_argument("--warmup", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--touch", action="store_true", help=argparse.SUPPRESS)
    add_dataset_options(p)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--threads", type=int, default=2, help="DALI threads / DataLoader workers (default: 2)")
    p.add_argument("--epochs", type=int, default=2, help="measured epochs per prep run, after a warm-up (default: 2)")
    p.add_argument("--hp-epochs", type=int, default=3, help="epochs per hp trial, the first not measured (default: 3)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--scenarios", default="prep,hp", help="prep, hp or both (default: prep,hp)")
    p.add_argument(
        "--loaders", default=",".join(LOADERS), help="of the prep scenario, and dali-1 (default: %(default)s)"
    )
    p.add_argument("--smoke", action="store_true", help="40 small images, batch 16, 1 rep, 1 epoch: a test's run")
    p.add_argument("--out", default=str(HERE / "results" / "detection.json"))
    args = p.parse_args()
    if args.job:
        job(args)
        return 0
    if args.smoke:
        args.images, args.width, args.height, args.batch_size = 40, 320, 240, 16
        args.reps, args.epochs, args.hp_epochs = 1, 1, 2
    args.loaders = args.loaders.split(",")
    scenarios = args.scenarios.split(",")
    command = " ".join(["python -m benchmarks.detection", *sys.argv[1:]])
    coco = dataset(args)
    print(
        f"dataset: {coco['files']} files, {coco['total_bytes'] / 1e6:.1f} MB, mean {coco['mean_bytes'] / 1e3:.1f} KB, "
        f"{coco['mean_width']}x{coco['mean_height']}, {coco['boxes']} boxes ({coco['source']})"
    )
    result = {
        "benchmark": "detection",
        "command": command,
        "machine": {**common.machine(), "load_at_start": os.getloadavg()},
        "dataset": coco,
        "batch_size": args.batch_size,
        "threads": args.threads,
        "epochs": args.epochs,
        "hp_epochs": args.hp_epochs,
        "reps": args.reps,
        "python_per_batch": python_per_batch(args),
    }
    with tempfile.TemporaryDirectory(prefix="coordl-detection-") as tmp:
        if "prep" in scenarios:
            print(f"prep-bound, batch {args.batch_size}, {args.threads} threads/workers, runs alternating")
            result["prep"] = prep(args, Path(tmp))
        if "hp" in scenarios:
            print("two trials, hp_group='bench-detect' vs separate")
            result["hp"] = hp(args, Path(tmp))
    result["machine"]["load_at_end"] = os.getloadavg()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(table(result))
    print(f"wrote {args.out}")
    return 0


def table(result: dict) -> str:
    pb = result["python_per_batch"]
    lines = [
        f"coordl's Python per batch of {pb['batch']}: plan {pb['plan_ms']:.2f} ms, targets {pb['targets_ms']:.2f} ms"
    ]
    if "prep" in result:
        lines += ["| loader | median samples/s | runs | median CPU-ms/sample | runs |", "|---|---|---|---|---|"]
        for name, rs in result["prep"]["runs"].items():
            m = result["prep"]["median"][name]
            rates = ", ".join(f"{r['samples_per_s']:.1f}" for r in rs)
            cpus = ", ".join(f"{1000 * r['cpu_s_per_sample']:.2f}" for r in rs)
            lines.append(
                f"| {name} | {m['samples_per_s']:.1f} | {rates} | {1000 * m['cpu_s_per_sample']:.2f} | {cpus} |"
            )
        for key, r in result["prep"]["ratios"].items():
            lines.append(f"{key}: samples/s {r['samples_per_s']:.3f}, CPU/sample {r['cpu_s_per_sample']:.3f}")
    if "hp" in result:
        h = result["hp"]
        for mode in ("separate", "group"):
            rates = "; ".join(", ".join(f"{x:.1f}" for x in r["per_trial_samples_per_s"]) for r in h[mode])
            lines.append(f"hp {mode}: per-trial samples/s {rates}")
        speedups = ", ".join(f"{s:.2f}" for s in h["speedups"])
        lines.append(f"hp per-trial speedup: median {h['speedup_median']:.2f} ({speedups})")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
