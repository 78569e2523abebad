"""Storage bytes per epoch with the MinIO cache, from coordl's counters and from /proc/diskstats.

Runs CoordLoader for several epochs over an ImageNet-like dataset with the cache at a
fraction of the dataset, dropping the OS page cache before every epoch, and compares
the bytes the block device delivered with the minimum, ``dataset - cached``.

    python -m benchmarks minio_epochs --data /var/tmp/coordl-bench/train --images 2000 --cache 0.5
"""

from __future__ import annotations

import json
import time

import coordl
from benchmarks.harness import dataset, limits, measure, report


def options(p) -> None:
    dataset.add_dataset_options(p, data="/var/tmp/coordl-bench/train")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--cache", type=float, default=0.5, help="cache budget as a fraction of the dataset")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument(
        "--drop-level",
        type=int,
        default=3,
        choices=(1, 3),
        help="drop_caches level before each epoch: 3 (pages, dentries, inodes) or 1 (pages only)",
    )


def run(args) -> dict | None:

    data = dataset.dataset_from_args(args)
    dev = measure.device_of(args.data)
    print(f"dataset: {dataset.describe(data)}; device {dev}")
    rows, notes = [], []
    # Warm-up: load DALI's libraries and build a pipeline before anything is measured,
    # so that the first epoch's device reads are the dataset's, not the libraries'.
    with coordl.CoordLoader(
        args.data, batch_size=args.batch_size, device_id=None, cache=0, shuffle=True, pipeline="imagenet-train"
    ) as warm:
        for k, _ in enumerate(warm):
            if k == 2:
                break
    with coordl.CoordLoader(
        args.data, batch_size=args.batch_size, device_id=None, cache=args.cache, shuffle=True, pipeline="imagenet-train"
    ) as loader:
        for epoch in range(args.epochs):
            why = limits.drop_page_cache(args.drop_level)
            if why and why not in notes:
                notes.append(why)
            before = measure.sectors_read(dev)
            t0 = time.perf_counter()
            loader.set_epoch(epoch)
            for _ in loader:
                pass
            seconds = time.perf_counter() - t0
            disk = measure.sectors_read(dev) - before
            s = loader.stats()
            minimum = data["total_bytes"] - s["cache_bytes"] if epoch else data["total_bytes"]
            row = {"epoch": epoch, "seconds": round(seconds, 2), "samples_per_s": round(s["samples"] / seconds, 1)}
            row |= {"storage_bytes_stats": s["storage_bytes"], "storage_bytes_disk": disk, "minimum_bytes": minimum}
            row |= {"stats_over_min": round(s["storage_bytes"] / minimum, 4), "disk_over_min": round(disk / minimum, 4)}
            row |= {k: s[k] for k in ("cache_hits", "storage_reads", "cache_bytes")}
            rows.append(row)
            print(json.dumps(row))
    return {"dataset": data, "notes": notes, "epochs": rows}


def table(result) -> str:
    rows = result["epochs"]
    head = "| epoch | s | samples/s | storage MB (stats) | device MB (diskstats) | minimum MB | stats/min | disk/min |"
    lines = [head, "|" + "---|" * 8]
    for r in rows:
        lines.append(
            f"| {r['epoch']} | {r['seconds']} | {r['samples_per_s']} | {report.mb(r['storage_bytes_stats'])} | "
            f"{report.mb(r['storage_bytes_disk'])} | {report.mb(r['minimum_bytes'])} | {r['stats_over_min']:.4f} | "
            f"{r['disk_over_min']:.4f} |"
        )
    return "\n".join(lines + [f"NOTE: {n}" for n in result["notes"]])
