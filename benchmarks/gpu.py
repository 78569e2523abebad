"""ResNet-50 training on one GPU fed by four loaders, and the same loaders' prep alone (issue 46).

Loaders (:mod:`benchmarks.gpu_loaders`, the same augmentation, batch size and CPU threads/workers):
``coordl`` (GPU decode: DALI ``mixed``), ``dali`` (DALI's own GPU pipeline), ``coordl-cpu`` (DALI on the
CPU, batches copied to the GPU) and ``torch`` (``DataLoader``, ``--threads`` Pillow workers, ``pin_memory``).
Modes: ``train`` (a ResNet-50 step per batch: torchvision's model, else ``examples/imagenet/models.py``'s;
bf16 autocast, channels_last, SGD) and ``prep`` (the batches alone, on the GPU). Each loader runs in a child:
a warm-up epoch not counted, then ``--epochs`` epochs of each mode, alternating; loaders ABBA for ``--reps``.
Per loader and mode: samples/s (GPU synchronised at each epoch's end), the stall fraction (time in ``next()``
/ epoch time; coordl's ``stats()["stall_s"]`` beside it), CPU seconds per sample (process tree). A loader that
cannot run here is reported skipped with the reason, a failed or overrun run with its error; the JSON is
written after every run. The dataset: ``--images`` generated JPEGs of about 400x350 (the photographs do not
travel to the GPU machine), made once under ``--data``, read into the page cache before anything is measured.

The defaults (20,000 images, 2.2 GB; batch 256; 16 threads; 1 warm-up and 1 epoch per mode; 1 rep) take
about 3 minutes on 16 cores and an H200 (estimated from this 2-core VM: ~35 s of data, ~35 s per loader);
``--budget`` (330 s, data included) skips a run that would start too late and ``--run-timeout`` (120 s) ends
one that hangs, so the command stays under 6 minutes whatever the GPU's rates.

    python -m benchmarks gpu --out benchmarks/results/gpu.json      # on the GPU machine, < 6 minutes
    python -m benchmarks gpu --cpu-smoke --out /tmp/gpu-smoke.json  # the CPU side: ~1 minute on 2 cores
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

from benchmarks import gpu_loaders as loaders
from benchmarks.harness import cli, dataset, jobs, limits, measure
from benchmarks.harness.measure import cpu_seconds

DATA, SMOKE_DATA = "/var/tmp/coordl-bench/gpu", "/var/tmp/coordl-bench/gpu-smoke"
MODES = ("train", "prep")
CLASSES = 1000  # the model's outputs: ImageNet's head, whatever the dataset's folders


# -- one run (a child process) ----------------------------------------------------------------
def job(args) -> None:
    """One loader in this process: a warm-up epoch, then ``--epochs`` epochs of each mode, alternating."""
    import torch

    device_id = None if args.cpu_smoke else args.device_id
    if device_id is not None:
        torch.cuda.set_device(device_id)
        torch.backends.cudnn.benchmark = True
    sync = (lambda: torch.cuda.synchronize(device_id)) if device_id is not None else (lambda: None)
    t0 = time.perf_counter()
    loader = loaders.Loader(args.job, args.data, args.batch_size, args.threads, device_id)
    out = {"loader": args.job, "device_id": device_id, "samples": loader.n, "epochs": []}
    step = None
    if "train" in args.modes:
        step = loaders.TrainStep(args.arch, CLASSES, device_id)
        out.update(model=args.arch, model_from=step.origin, params=step.params)
    out["build_s"] = time.perf_counter() - t0
    first = "train" if step is not None else args.modes[0]
    schedule = [(first, True)] * args.warmup + [(m, False) for _ in range(args.epochs) for m in args.modes]
    try:
        for k, (mode, warmup) in enumerate(schedule):
            sync()
            cpu, t0, n, wait, shape = cpu_seconds(), time.perf_counter(), 0, 0.0, None
            batches = loader.epoch(k)
            while True:
                t = time.perf_counter()
                try:
                    images, labels = next(batches)
                except StopIteration:
                    break
                wait += time.perf_counter() - t
                if mode == "train":
                    step(images, labels)
                n, shape = n + len(images), list(images.shape)
            sync()
            seconds = time.perf_counter() - t0
            e = {"mode": mode, "warmup": warmup, "seconds": seconds, "samples": n, "wait_s": wait, "shape": shape}
            e["cpu_s"] = cpu_seconds() - cpu
            e["device"] = str(images.device) if n else None
            if hasattr(loader, "stats"):
                e["stats"] = loader.stats()
            out["epochs"].append(e)
            print(f"    {args.job} epoch {k} {mode}{' (warm-up)' if warmup else ''}: {n / seconds:.1f} samples/s")
    finally:
        loader.close()
    if device_id is not None:
        out["gpu"] = torch.cuda.get_device_name(device_id)
        out["peak_gpu_memory_bytes"] = torch.cuda.max_memory_allocated(device_id)
    Path(args.out).write_text(json.dumps(out))


def summary(run: dict) -> dict:
    """Per mode, over the measured epochs: samples/s, stall fractions and CPU seconds per sample."""
    out = {}
    for mode in MODES:
        es = [e for e in run["epochs"] if e["mode"] == mode and not e["warmup"]]
        if not es:
            continue
        seconds, n = sum(e["seconds"] for e in es), sum(e["samples"] for e in es)
        s = {"epochs": len(es), "samples_per_s": n / seconds, "cpu_s_per_sample": sum(e["cpu_s"] for e in es) / n}
        s["stall_fraction"] = sum(e["wait_s"] for e in es) / seconds
        if all("stats" in e for e in es):  # coordl's own accounting
            s["stats_stall_fraction"] = sum(e["stats"]["stall_s"] for e in es) / seconds
        out[mode] = s
    return out


# -- the runs -----------------------------------------------------------------------------------
def job_command(args, name: str, out: Path) -> list[str]:
    kw = {"batch_size": args.batch_size, "threads": args.threads, "epochs": args.epochs, "warmup": args.warmup}
    kw |= {"modes": ",".join(args.modes), "arch": args.arch, "device_id": args.device_id, "data": args.root}
    return jobs.scenario_command("gpu", *jobs.flags(job=name, out=out, **kw, cpu_smoke=args.cpu_smoke))


def run_all(args, result: dict, workdir: Path, started: float) -> None:
    runs = result["runs"] = {name: [] for name in args.loaders}
    longest = 0.0
    for rep, name in measure.alternate(args.loaders, args.reps):
        left = args.budget - (time.perf_counter() - started)
        reason = loaders.missing(name)
        if reason is None and left < longest:
            reason = f"out of time: {left:.0f} s of --budget {args.budget:.0f} s left, a run took {longest:.0f} s"
        if reason is not None:
            runs[name].append({"skipped": reason})
            print(f"  rep {rep + 1} {name}: skipped ({reason})")
            continue
        out, t0 = workdir / f"{name}.json", time.perf_counter()
        load = os.getloadavg()[0]
        try:
            limit = max(min(left, args.run_timeout), 30)
            command = job_command(args, name, out)
            proc = subprocess.run(command, timeout=limit, capture_output=True, text=True, check=False)
            run = json.loads(out.read_text()) if proc.returncode == 0 else {"error": _tail(proc)}
        except subprocess.TimeoutExpired as e:
            said = (e.stdout or b"")[-1500:]
            said = said.decode(errors="replace") if isinstance(said, bytes) else said
            run = {"error": f"still running after {e.timeout:.0f} s (--run-timeout, --budget); ended: {said}"}
        out.unlink(missing_ok=True)
        run.update(wall_s=time.perf_counter() - t0, load_before=load, load_after=os.getloadavg()[0])
        if "error" in run:
            print(f"  rep {rep + 1} {name}: failed after {run['wall_s']:.0f} s: {run['error'][-600:]}")
        else:
            longest = max(longest, run["wall_s"])  # what a run takes here: a hung one says nothing of it
            run["summary"] = summary(run)
            cells = [
                f"{mode} {s['samples_per_s']:.1f} samples/s (stall {s['stall_fraction']:.2f})"
                for mode, s in run["summary"].items()
            ]
            cells = ", ".join(cells)
            print(f"  rep {rep + 1} {name}: {cells}; {run['wall_s']:.0f} s")
        runs[name].append(run)
        cli.save(args, result)  # after every run: what finished survives an interrupted command


def _tail(proc: subprocess.CompletedProcess) -> str:
    return f"exit {proc.returncode}: " + (proc.stdout[-1500:] + proc.stderr[-3000:]).strip()


def medians(result: dict) -> dict:
    """Per loader and mode, the median of the runs' figures; and coordl's ratios to each other loader."""
    import statistics

    med: dict[str, dict] = {}
    for name, runs in result["runs"].items():
        done = [r["summary"] for r in runs if "summary" in r]
        for mode in MODES:
            cells = [s[mode] for s in done if mode in s]
            if cells:
                keys = [k for k in cells[0] if k != "epochs"]
                med.setdefault(name, {})[mode] = {k: statistics.median(c[k] for c in cells) for k in keys}
    ratios = {}
    for other in loaders.LOADERS[1:]:
        for mode in MODES:
            a, b = med.get("coordl", {}).get(mode), med.get(other, {}).get(mode)
            if a and b:
                ratios[f"coordl/{other} {mode}"] = a["samples_per_s"] / b["samples_per_s"]
    return {"median": med, "ratios": ratios}


# -- the dataset --------------------------------------------------------------------------------
def images(args) -> dict:
    """Makes (or finds) the dataset and reads every file once, so that it is in the page cache."""
    t0 = time.perf_counter()
    lacking = [m for m in ("PIL", "tqdm") if importlib.util.find_spec(m) is None]
    if lacking:
        figures = _found(args.data)
        if figures is None:
            raise SystemExit(
                f"cannot make the dataset: {' and '.join(lacking)} not installed (coordl.tools.datagen writes the "
                "JPEGs with Pillow and shows its progress with tqdm). Install them (on the GPU machine: "
                "scripts/gpu_extras.sh here, then scripts/gpu_run.sh there), or pass --data a folder of JPEGs "
                "made elsewhere (ImageFolder: one folder per class)."
            )
    else:
        figures = dataset.dataset_from_args(args)
    figures["make_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    read = limits.read_through(os.path.join(d, f) for d, _, files in os.walk(figures["root"]) for f in files)
    figures.update(page_cache_read_s=time.perf_counter() - t0, page_cache_read_bytes=read)
    return figures


def _found(root: str) -> dict | None:
    """The figures of a dataset made before (found without Pillow), or None if ``root`` holds no images."""
    from coordl.index import Index

    if not os.path.isdir(root):
        return None
    index = Index.scan(root, index_dir="")
    if not len(index):
        return None
    total = sum(os.path.getsize(p) for p in index.paths)
    out = {"root": root, "files": len(index), "classes": len(index.classes), "total_bytes": total}
    return out | {
        "mean_bytes": round(total / len(index)),
        "source": "found (made before; Pillow is not installed here)",
    }


# -- the command ------------------------------------------------------------------------------
def options(p) -> None:
    p.add_argument("--job", choices=loaders.LOADERS, help=argparse.SUPPRESS)
    p.add_argument("--warmup", type=int, default=1, help=argparse.SUPPRESS)
    dataset.add_dataset_options(p, data=None, images=20000, classes=100)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="DALI threads / DataLoader workers (all CPUs)")
    p.add_argument("--epochs", type=int, default=1, help="measured epochs of each mode per run (default: 1)")
    p.add_argument("--reps", type=int, default=1, help="rounds of runs, in a rotating order (default: 1)")
    p.add_argument("--loaders", default=",".join(loaders.LOADERS), help="(default: %(default)s)")
    p.add_argument("--modes", default=",".join(MODES), help="(default: %(default)s)")
    p.add_argument("--arch", default="resnet50", help="the model (default: resnet50; --cpu-smoke: resnet_tiny)")
    p.add_argument("--device-id", type=int, default=0, help="the GPU (default: 0)")
    p.add_argument("--budget", type=float, default=330.0, help="seconds for the runs, data included (default: 330)")
    p.add_argument("--run-timeout", type=float, default=120.0, help="seconds one loader's run may take (default: 120)")
    smoke = "the CPU side: 64 small images, every loader on the CPU (DataLoader: 2 workers), resnet_tiny, batch 16"
    p.add_argument("--cpu-smoke", action="store_true", help=smoke)


def run(args) -> dict | None:
    args.modes = args.modes.split(",")
    if args.job:
        args.root = args.data
        return job(args)
    started = time.perf_counter()
    args.data = args.data or (SMOKE_DATA if args.cpu_smoke else DATA)
    args.synthetic = args.synthetic or not args.photos  # the photographs do not travel to the GPU machine
    if args.cpu_smoke:
        args.images, args.classes, args.width, args.height = 64, 4, 160, 120
        args.batch_size, args.threads, args.epochs, args.reps = 16, 2, 1, 1
        args.arch = "resnet_tiny" if args.arch == "resnet50" else args.arch
    args.loaders = args.loaders.split(",")
    if not args.cpu_smoke:
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device: run this on a GPU machine, or --cpu-smoke for its CPU side")
    data = images(args)
    args.root = data["root"]
    print(
        f"dataset: {dataset.describe(data)}, {data['classes']} classes; made/found in {data['make_s']:.1f} s, "
        f"read into the page cache in {data['page_cache_read_s']:.1f} s"
    )
    config = {k: getattr(args, k) for k in ("batch_size", "threads", "epochs", "warmup", "reps", "modes", "arch")}
    config |= {"device": "cpu" if args.cpu_smoke else f"cuda:{args.device_id}", "budget_s": args.budget}
    result = {"cpu_smoke": args.cpu_smoke, "dataset": data, "config": config}
    print(
        f"batch {args.batch_size}, {args.threads} threads/workers, {args.arch}, "
        f"{args.warmup} warm-up + {args.epochs} epoch(s) per mode, runs in ABBA order"
    )
    with tempfile.TemporaryDirectory(prefix="coordl-gpu-") as tmp:
        run_all(args, result, Path(tmp), started)
    result.update(medians(result))
    result["wall_s"] = time.perf_counter() - started
    if [r for rs in result["runs"].values() for r in rs if "error" in r]:
        cli.save(args, result)
        print(table(result))
        raise SystemExit(f"a run failed; wrote {args.out}")
    return result


def table(result: dict) -> str:
    lines = [
        "| loader | mode | samples/s | stall (next) | stall (stats) | CPU-ms/sample |",
        "|---|---|---|---|---|---|",
    ]
    for name, runs in result["runs"].items():
        notes = [r.get("skipped") or r["error"].splitlines()[0] for r in runs if "summary" not in r]
        for mode, m in result["median"].get(name, {}).items():
            stats = m.get("stats_stall_fraction")
            lines.append(
                f"| {name} | {mode} | {m['samples_per_s']:.1f} | {m['stall_fraction']:.3f} | "
                f"{'-' if stats is None else f'{stats:.3f}'} | {1000 * m['cpu_s_per_sample']:.2f} |"
            )
        lines += [f"| {name} | - | {note} | | | |" for note in notes]
    lines += [f"{key}: {r:.3f}" for key, r in result["ratios"].items()]
    return "\n".join(lines)
