"""How well ``coordl analyze`` predicts training speed at other cache sizes.

One ``coordl analyze`` run of ``benchmarks.small_resnet`` (a small ResNet trained on the CPU) under a
memory cgroup and a blkio throttle predicts the steady-epoch throughput at cache sizes 25%,
50%, 75% and 100%; then each of them is measured: the same script, the same limits, one cold
epoch and two steady ones.

The throttle is chosen so that the no-cache case is I/O-bound: an unthrottled phase P
measures R (training on cached data) first, and storage is set to ``--storage-factor`` x R x
the mean sample size (0.4: fetch-bound below about 60% cache, prep/compute-bound above).

    python -m benchmarks analyze_accuracy            # ~10 minutes on 2 cores
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

from benchmarks.harness import dataset, jobs, limits, measure
from benchmarks.harness.report import log
from benchmarks.harness.report import table as md_table
from coordl.analyze import report as rep
from coordl.analyze.run import run_phase
from coordl.units import format_bytes


def settle(root: str) -> None:
    """Libraries in the page cache (each phase starts a fresh Python that imports torch and DALI,
    which must not crawl through the storage throttle), the dataset's files out of it."""
    subprocess.run(
        [sys.executable, "-c", "import torch, nvidia.dali, coordl.prep.dali, coordl.analyze.run"], check=True
    )
    limits.evict(root)


def limited(args, name: str, memory: int, bandwidth: int, dev, caps):
    lim = limits.Limits(name, caps["memory"], caps["blkio"])
    lim.limit_memory(memory)
    lim.throttle(dev, bandwidth)
    return lim


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

    data = dataset.dataset_from_args(args)
    root, total = data["root"], data["total_bytes"]
    b = total / data["files"]
    caps = limits.probe()
    dev = measure.device_of(root)
    out_dir = Path(args.out).with_suffix("")
    out_dir.mkdir(parents=True, exist_ok=True)
    script = jobs.module_command("small_resnet", root, "--batch-size", str(args.batch_size))
    torch_threads, prep_threads = (int(v) for v in args.threads.split(","))
    if torch_threads:
        script += ["--threads", str(torch_threads)]
    if prep_threads:
        script += ["--prep-threads", str(prep_threads)]
    log(f"dataset {dataset.describe(data)}; limits: {caps}")

    # 1. The throttle: a fraction of what training on cached data needs.
    if args.bandwidth is None:
        kw = {"out": str(out_dir), "steps": args.steps, "warmup": 5, "run_id": uuid.uuid4().hex[:12], "timeout": 900}
        res = run_phase(script + ["--cache", "0"], "P", **kw, extra={"subset_batches": 16})
        R = sum(r["R_samples_per_s"] for r in res)
        args.bandwidth = args.storage_factor * R * b
        log(f"calibration: R = {R:.0f} samples/s -> storage throttled to {format_bytes(args.bandwidth, 'MB')}/s")
    bw = int(args.bandwidth)
    if args.quick:  # storage need not be slow to check the harness
        bw = max(bw, 200_000_000)

    # 2. One analysis, at the job's cache size.
    settle(root)
    memory = int(args.working_set + args.analyze_cache * total + 16 * args.batch_size * b * 1.1)
    lim = limited(args, f"coordl-analyze-{os.getpid()}", memory, bw, dev, caps)
    report_path = out_dir / "report.json"
    t0 = time.perf_counter()
    try:
        cmd = [sys.executable, "-m", "coordl.cli", "analyze", "--steps", str(args.steps), "--out", str(out_dir)]
        cmd += ["--json", str(report_path), "--", *script, "--cache", str(args.analyze_cache)]
        subprocess.run(cmd, check=True, preexec_fn=lim.join)
    finally:
        lim.remove()
    analyze_s = time.perf_counter() - t0
    report = json.loads(report_path.read_text())

    # 3. Measure each cache size.
    fractions = [float(x) for x in args.fractions.split(",")]
    model = rep.Model(rep.rates_from(report["phases"]))
    rows = []
    for x in fractions:
        settle(root)
        memory = int(args.working_set + x * total)
        lim = limited(args, f"coordl-analyze-m-{os.getpid()}", memory, bw, dev, caps)
        try:
            cmd = script + ["--cache", str(x), "--epochs", str(args.epochs)]
            proc = subprocess.run(cmd, check=True, capture_output=True, text=True, preexec_fn=lim.join)
        finally:
            lim.remove()
        epochs = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
        steady = epochs[1:]
        measured = statistics.median(e["samples"] / e["elapsed_s"] for e in steady)
        predicted = model.throughput(x)
        row = {"cache_fraction": x, "predicted_samples_per_s": predicted, "measured_samples_per_s": measured}
        row |= {"error": predicted / measured - 1, "bound": model.bound(x)}
        rows.append(
            row | {"storage_bytes_per_epoch": statistics.mean(e["storage_bytes"] for e in steady), "epochs": epochs}
        )
        log(
            f"cache {x:.0%}: predicted {predicted:.0f}, measured {measured:.0f} samples/s "
            f"({100 * (predicted / measured - 1):+.1f}%), {model.bound(x)}-bound"
        )

    threads = {"torch": torch_threads or "default", "dali": prep_threads or "default"}
    result = {"dataset": data, "limits": caps, "storage_bytes_per_s": bw, "analyze_cache_fraction": args.analyze_cache}
    result |= {"threads": threads, "analyze_seconds": analyze_s, "rates": report["rates"], "rows": rows}
    result["max_abs_error"] = max(abs(r["error"]) for r in rows)
    png = Path(args.out).with_suffix(".png")
    try:
        rep.plot(
            report,
            str(png),
            measured=[(r["cache_fraction"], r["measured_samples_per_s"]) for r in rows],
            title=f"small ResNet on 2 CPU cores, storage {format_bytes(bw, 'MB')}/s: predicted vs measured",
        )
    except ImportError:
        png = None
    return {**result, "plot": str(png) if png else None}


def table(result: dict) -> str:
    rows = [
        [f"{r['cache_fraction']:.0%}", f"{r['predicted_samples_per_s']:.0f}", f"{r['measured_samples_per_s']:.0f}"]
        + [f"{100 * r['error']:+.1f}%", r["bound"]]
        for r in result["rows"]
    ]
    g = result["rates"]
    return (
        md_table(["cache", "predicted samples/s", "measured samples/s", "error", "bound"], rows)
        + f"\nrates: G {g['G']:.0f}, P {g['P']:.0f}, R {g['R']:.0f} samples/s; S {format_bytes(g['S'], 'MB')}/s;"
        f" analysis took {result['analyze_seconds']:.0f} s; plot: {result['plot']}"
    )
