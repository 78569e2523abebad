"""Storage bytes per epoch with the MinIO cache, from coordl's counters and from /proc/diskstats.

    python -m benchmarks minio_epochs --data /var/tmp/coordl-bench/train --images 2000 --cache 0.5

CoordLoader over an ImageNet-like dataset, the cache a fraction of it, the page cache dropped before every epoch:
the bytes the block device delivered against the minimum, ``dataset - cached``.
"""

import itertools
import json

import coordl
from benchmarks.harness import dataset, limits, measure, report
from benchmarks.harness.report import log, mb
from benchmarks.loaders import epoch_row


def options(p) -> None:
    dataset.add_dataset_options(p, data="/var/tmp/coordl-bench/train")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--cache", type=float, default=0.5, help="cache budget as a fraction of the dataset")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--drop-level", type=int, default=3, choices=(1, 3), help="drop_caches: 3 (and dentries, inodes), 1")


def run(args) -> dict | None:
    data, dev = dataset.dataset_from_args(args), measure.device_of(args.data)
    log(f"dataset: {dataset.describe(data)}; device {dev}")
    rows, notes = [], set()
    kw = {"batch_size": args.batch_size, "device_id": None, "shuffle": True, "pipeline": "imagenet-train"}
    # Warm-up: DALI's libraries loaded and a pipeline built first, so that epoch 0's device reads are the dataset's.
    with coordl.CoordLoader(args.data, cache=0, **kw) as warm:
        list(itertools.islice(warm, 3))  # three batches
    with coordl.CoordLoader(args.data, cache=args.cache, **kw) as loader:
        for epoch in range(args.epochs):
            notes.add(limits.drop_page_cache(args.drop_level))
            loader.set_epoch(epoch)
            row, s = {"epoch": epoch} | epoch_row(iter(loader), dev), loader.stats()
            disk, minimum = row.pop("device_bytes"), data["total_bytes"] - (s["cache_bytes"] if epoch else 0)
            row |= {"storage_bytes_stats": s["storage_bytes"], "storage_bytes_disk": disk, "minimum_bytes": minimum}
            row |= {"stats_over_min": round(s["storage_bytes"] / minimum, 4), "disk_over_min": round(disk / minimum, 4)}
            rows.append(row | {k: s[k] for k in ("cache_hits", "storage_reads", "cache_bytes")})
            log(json.dumps(rows[-1]))
    return {"dataset": data, "notes": sorted(notes - {None}), "epochs": rows}


def table(result) -> str:
    mbs, ratios = ("storage_bytes_stats", "storage_bytes_disk", "minimum_bytes"), ("stats_over_min", "disk_over_min")
    rows = [[r[k] for k in ("epoch", "seconds", "samples_per_s")] for r in result["epochs"]]
    rows = [row + [mb(r[k]) for k in mbs] + [f"{r[k]:.4f}" for k in ratios] for row, r in zip(rows, result["epochs"])]
    head = "epoch|s|samples/s|storage MB (stats)|device MB (diskstats)|minimum MB|stats/min|disk/min"
    return "\n".join([report.table(head, rows)] + [f"NOTE: {n}" for n in result["notes"]])
