"""Storage bytes per epoch with the MinIO cache, from coordl's counters and from /proc/diskstats.

Runs CoordLoader for several epochs over an ImageNet-like dataset with the cache at a
fraction of the dataset, dropping the OS page cache before every epoch, and compares
the bytes the block device delivered with the minimum, ``dataset - cached``.

    python -m benchmarks.minio_epochs --data /var/tmp/coordl-bench/train --images 2000 --cache 0.5
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import coordl
from benchmarks import common


def main() -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.minio_epochs",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    common.add_dataset_options(p, data="/var/tmp/coordl-bench/train")
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
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "minio_epochs.json"))
    args = p.parse_args()

    dataset = common.dataset_from_args(args)
    dev = common.device_of(args.data)
    print(f"dataset: {common.describe(dataset)}; device {dev}")
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
            why = common.drop_page_cache(args.drop_level)
            if why and why not in notes:
                notes.append(why)
            before = common.sectors_read(dev)
            t0 = time.perf_counter()
            loader.set_epoch(epoch)
            for _ in loader:
                pass
            seconds = time.perf_counter() - t0
            disk = common.sectors_read(dev) - before
            s = loader.stats()
            minimum = dataset["total_bytes"] - s["cache_bytes"] if epoch else dataset["total_bytes"]
            row = {
                "epoch": epoch,
                "seconds": round(seconds, 2),
                "samples_per_s": round(s["samples"] / seconds, 1),
                "storage_bytes_stats": s["storage_bytes"],
                "storage_bytes_disk": disk,
                "minimum_bytes": minimum,
                "stats_over_min": round(s["storage_bytes"] / minimum, 4),
                "disk_over_min": round(disk / minimum, 4),
                "cache_hits": s["cache_hits"],
                "storage_reads": s["storage_reads"],
                "cache_bytes": s["cache_bytes"],
            }
            rows.append(row)
            print(json.dumps(row))
    result = {
        "benchmark": "minio_epochs",
        "args": vars(args),
        "dataset": dataset,
        "machine": common.machine(),
        "notes": notes,
        "epochs": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(table(rows))
    for n in notes:
        print("NOTE:", n)
    return 0


def table(rows) -> str:
    head = "| epoch | s | samples/s | storage MB (stats) | device MB (diskstats) | minimum MB | stats/min | disk/min |"
    lines = [head, "|" + "---|" * 8]
    for r in rows:
        lines.append(
            f"| {r['epoch']} | {r['seconds']} | {r['samples_per_s']} | {common.mb(r['storage_bytes_stats'])} | "
            f"{common.mb(r['storage_bytes_disk'])} | {common.mb(r['minimum_bytes'])} | {r['stats_over_min']:.4f} | "
            f"{r['disk_over_min']:.4f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
