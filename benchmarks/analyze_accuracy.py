"""How well ``coordl analyze`` predicts training speed at other cache sizes.

One ``coordl analyze`` run of ``benchmarks.small_resnet`` (a small ResNet trained on the CPU) under a memory
cgroup and a blkio throttle predicts the steady-epoch throughput at cache sizes 25%, 50%, 75% and 100%; then
each is measured: the same script, the same limits, one cold epoch and two steady ones. The throttle makes
the no-cache case I/O-bound: ``--storage-factor`` x R (training on cached data, measured unthrottled first)
x the mean sample size (0.4: fetch-bound below about 60% cache). docs/analyze.md has the figures.

    python -m benchmarks analyze_accuracy            # ~10 minutes on 2 cores
"""

import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

from benchmarks.harness import dataset, jobs, limits, measure, report
from benchmarks.harness.report import log
from coordl.analyze import report as analysis
from coordl.analyze.run import run_phase
from coordl.units import format_bytes


def limited(root: str, command: list[str], memory: int, bandwidth: int, dev, caps, **kw):
    """Runs ``command`` in a memory and blkio cgroup of its own, the libraries in the page cache (each phase
    starts a Python that imports torch and DALI, which must not crawl through the throttle), the dataset out."""
    subprocess.run(
        [sys.executable, "-c", "import torch, nvidia.dali, coordl.prep.dali, coordl.analyze.run"], check=True
    )
    limits.evict(root)
    lim = limits.Limits(f"coordl-analyze-{os.getpid()}", caps["memory"], caps["blkio"])
    try:
        lim.limit_memory(memory)
        lim.throttle(dev, bandwidth)
        return subprocess.run(command, check=True, preexec_fn=lim.join, **kw)
    finally:
        lim.remove()


def options(p) -> None:
    dataset.add_dataset_options(p, data="/var/tmp/coordl-bench/train")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--analyze-cache", type=float, default=0.5, help="the analysed job's cache fraction")
    p.add_argument("--fractions", default="0.25,0.5,0.75,1.0")
    p.add_argument("--epochs", type=int, default=3, help="epochs per measurement (the first is cold)")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--storage-factor", type=float, default=0.4)
    p.add_argument("--bandwidth", type=float, help="storage bytes/s (default: from --storage-factor)")
    p.add_argument("--working-set", type=float, default=1.6e9, help="memory the script needs besides the cache")
    threads = "the model's torch threads and DALI's threads: 1,1 (one core each, the default) or 0,0 (every core)"
    p.add_argument("--threads", default="1,1", help=threads)
    p.add_argument("--quick", action="store_true", help="tiny dataset, few steps: checks the harness only")


def run(args) -> dict | None:
    if args.quick:
        args.images, args.size, args.classes, args.steps, args.epochs, args.fractions = 192, None, 4, 4, 2, "0.5,1.0"
        args.batch_size, args.data = 16, args.data + "-quick"
    data, caps = dataset.dataset_from_args(args), limits.probe()
    root, total, dev = data["root"], data["total_bytes"], measure.device_of(data["root"])
    b = total / data["files"]
    out_dir = Path(args.out).with_suffix("")
    out_dir.mkdir(parents=True, exist_ok=True)
    script = jobs.module_command("small_resnet", root, "--batch-size", str(args.batch_size))
    torch_threads, prep_threads = (int(v) for v in args.threads.split(","))
    script += jobs.flags(threads=torch_threads or None, prep_threads=prep_threads or None)  # 0: their defaults
    log(f"dataset {dataset.describe(data)}; limits: {caps}")

    if args.bandwidth is None:  # 1. the throttle: a fraction of what training on cached data needs
        kw = {"out": str(out_dir), "steps": args.steps, "warmup": 5, "run_id": uuid.uuid4().hex[:12], "timeout": 900}
        phases = run_phase(script + ["--cache", "0"], "P", **kw, extra={"subset_batches": 16})
        R = sum(r["R_samples_per_s"] for r in phases)
        args.bandwidth = args.storage_factor * R * b
        log(f"calibration: R = {R:.0f} samples/s -> storage throttled to {format_bytes(args.bandwidth, 'MB')}/s")
    bw = max(int(args.bandwidth), 200_000_000 if args.quick else 0)  # --quick: storage need not be slow

    # 2. One analysis, at the job's cache size.
    memory = int(args.working_set + args.analyze_cache * total + 16 * args.batch_size * b * 1.1)
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "coordl.cli", "analyze", "--steps", str(args.steps), "--out", str(out_dir)]
    cmd += ["--json", str(out_dir / "report.json"), "--", *script, "--cache", str(args.analyze_cache)]
    limited(root, cmd, memory, bw, dev, caps)
    analyze_s, got = time.perf_counter() - t0, json.loads((out_dir / "report.json").read_text())

    # 3. Measure each cache size.
    model, rows = analysis.Model(analysis.rates_from(got["phases"])), []
    for x in (float(x) for x in args.fractions.split(",")):
        cmd = script + ["--cache", str(x), "--epochs", str(args.epochs)]
        proc = limited(root, cmd, int(args.working_set + x * total), bw, dev, caps, capture_output=True, text=True)
        epochs = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
        measured = statistics.median(e["samples"] / e["elapsed_s"] for e in epochs[1:])
        predicted, bound = model.throughput(x), model.bound(x)
        row = {"cache_fraction": x, "predicted_samples_per_s": predicted, "measured_samples_per_s": measured}
        row |= {"error": predicted / measured - 1, "bound": bound, "epochs": epochs}
        rows.append(row | {"storage_bytes_per_epoch": statistics.mean(e["storage_bytes"] for e in epochs[1:])})
        log(f"cache {x:.0%}: predicted {predicted:.0f}, measured {measured:.0f} samples/s, {bound}-bound")

    threads = {"torch": torch_threads or "default", "dali": prep_threads or "default"}
    result = {"dataset": data, "limits": caps, "storage_bytes_per_s": bw, "analyze_cache_fraction": args.analyze_cache}
    result |= {"threads": threads, "analyze_seconds": analyze_s, "rates": got["rates"], "rows": rows}
    result |= {"max_abs_error": max(abs(r["error"]) for r in rows), "plot": str(Path(args.out).with_suffix(".png"))}
    title = f"small ResNet on 2 CPU cores, storage {format_bytes(bw, 'MB')}/s: predicted vs measured"
    try:
        analysis.plot(got, result["plot"], [(r["cache_fraction"], r["measured_samples_per_s"]) for r in rows], title)
    except ImportError:
        result["plot"] = None
    return result


def table(result: dict) -> str:
    keys = ("cache_fraction", "predicted_samples_per_s", "measured_samples_per_s", "error", "bound")
    cells = ([r[k] for k in keys] for r in result["rows"])
    rows = [[f"{x:.0%}", round(p), round(m), f"{e:+.1%}", bound] for x, p, m, e, bound in cells]
    g, took, plot = result["rates"], result["analyze_seconds"], result["plot"]
    rates = f"rates: G {g['G']:.0f}, P {g['P']:.0f}, R {g['R']:.0f} samples/s; S {format_bytes(g['S'], 'MB')}/s"
    head = "cache|predicted samples/s|measured samples/s|error|bound"
    return f"{report.table(head, rows)}\n{rates}; analysis took {took:.0f} s; plot: {plot}"
