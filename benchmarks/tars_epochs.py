"""Tar shards' steady epochs: coordl at cache 0/0.5/1 against WebDataset + DataLoader and DALI's reader.

A photo dataset as shards of ``--per-shard`` samples; ``--epochs`` epochs of each loader (``s3.made``) in a
child, ABBA ``--reps`` times; steady samples/s: the median of the epochs after the first. ``--store local``: the
shards on a loop device of their own, the page cache dropped before each epoch, read at ``--throttle`` (blkio,
root); ``--store s3``: on moto behind the counting proxy of ``coordl_testing.s3server``, ``--latency`` a request.

    python -m benchmarks tars_epochs --images 2000 --throttle 20MB                 # ~8 min
    python -m benchmarks tars_epochs --images 2000 --store s3 --latency 0.02       # ~30 min
"""

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from benchmarks import s3
from benchmarks.harness import cli, dataset, limits, measure, report
from benchmarks.index_tars import write_tar
from benchmarks.loaders import random_resized_crop
from coordl.units import parse_bytes

OUT = None  # tars_epochs_<store>.json in benchmarks/results (out_path)


def options(p) -> None:
    dataset.add_dataset_options(p, data="/var/tmp/coordl-bench/tars-photos")
    p.add_argument("--shards-dir", default="/var/tmp/coordl-bench/tars-photos-shards")
    p.add_argument("--per-shard", type=int, default=200)
    p.add_argument("--cache", default="0,0.5,1", help="coordl's cache fractions")
    p.add_argument("--throttle", type=parse_bytes, default=None, help="the device's read rate, e.g. 20MB")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--workers", type=int, default=2, help="webdataset's DataLoader workers")
    p.add_argument("--reps", type=int, default=1)
    p.add_argument("--store", choices=("local", "s3"), default="local", help="local files or a local S3 server")
    p.add_argument("--latency", type=float, default=0.02, help="seconds the S3 server adds to each request")
    p.add_argument("--one", help=argparse.SUPPRESS)  # one loader, in its cgroup: its spec, a JSON file


def write_photo_shards(folder: str, out: Path, per_shard: int) -> str:
    """The dataset's JPEGs as shards (WebDataset's keys and ``.cls`` labels), in its index's order."""
    from coordl import Index

    index = Index.scan(folder, index_dir="")
    n, key, mark = -(-len(index) // per_shard), f"{index.fingerprint} {per_shard}", out / ".made-by-benchmarks-tars"

    def members(s: int):
        for i in range(s * per_shard, min(len(index), (s + 1) * per_shard)):
            yield f"{i:09d}.jpg", Path(index.paths[i]).read_bytes()
            yield f"{i:09d}.cls", str(int(index.labels[i])).encode()

    if not (mark.exists() and mark.read_text() == key):
        out.mkdir(parents=True, exist_ok=True)
        for s in range(n):
            write_tar(out / f"shard-{s:06d}.tar", members(s))
        mark.write_text(key)
    return str(out / f"shard-{{000000..{n - 1:06d}}}.tar")


def webdataset(spec: dict):
    """WebDataset's pipeline (shard shuffle, a 1,000-sample buffer, Pillow decoding and a random resized crop to 224
    in ``workers`` DataLoader workers; an ``s3://`` shard read by curl, a presigned GET)."""
    import torch
    import webdataset as wds
    from PIL import Image

    def crop(im: Image.Image):
        x, y, w, h = random_resized_crop(*im.size)
        out = im.resize((224, 224), Image.BILINEAR, box=(x, y, x + w, y + h))
        return torch.from_numpy(np.asarray(out, dtype=np.float32) / 255.0).permute(2, 0, 1)

    urls = spec["shards"]
    if urls[0].startswith("s3://"):
        from coordl.s3.client import boto3_client  # the AWS_* variables

        where = [dict(zip(("Bucket", "Key"), u[5:].split("/", 1))) for u in urls]
        urls = [f"pipe:curl -s -f '{boto3_client().generate_presigned_url('get_object', Params=w)}'" for w in where]
    ds = wds.WebDataset(urls, shardshuffle=len(urls), empty_check=False).shuffle(1000).decode("pil")
    ds = ds.to_tuple("jpg", "cls").map_tuple(crop, int).batched(spec["batch"])
    return torch.utils.data.DataLoader(ds, batch_size=None, num_workers=spec["workers"])


@contextlib.contextmanager
def own_device(folder: Path, size: int):
    """``folder`` as the mount of an ext4 file system on a loop device (direct I/O) of its own, removed after: its
    read counter sees the shards' reads alone, not the libraries a process pages in again after a drop."""
    image = folder.with_name(folder.name + ".img")
    folder.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as undo:
        undo.callback(image.unlink)
        subprocess.run(["mkfs.ext4", "-q", "-F", str(image), f"{size >> 10}k"], check=True)  # the image file made
        losetup = ["losetup", "--find", "--show", "--direct-io=on", str(image)]
        loop = subprocess.run(losetup, capture_output=True, text=True, check=True).stdout.strip()
        undo.callback(subprocess.run, ["losetup", "-d", loop], check=True)
        subprocess.run(["mount", loop, str(folder)], check=True)
        undo.callback(subprocess.run, ["umount", str(folder)], check=True)
        yield loop


def run(args) -> dict | None:
    if args.one:
        return s3.child(json.loads(Path(args.one).read_text()), {"webdataset": webdataset})
    data, caps, out = dataset.dataset_from_args(args), limits.probe(), Path(args.shards_dir)
    with contextlib.ExitStack() as stack:
        scratch, server, throttle, dev = stack.enter_context(tempfile.TemporaryDirectory()), None, None, None
        if args.store == "local":  # the shards on a file system of their own, throttled
            loop = stack.enter_context(own_device(out, 2 * data["total_bytes"] + (64 << 20)))
            where, dev = {"store": "local", "device": loop}, measure.device_of(str(out))
            throttle = args.throttle if caps["blkio"] else None
        pattern = write_photo_shards(args.data, out, args.per_shard)
        shards, dali_index = sorted(str(p) for p in out.glob("*.tar")), None
        if args.store == "s3":
            from coordl_testing.s3server import S3Server

            server = stack.enter_context(S3Server(latency_s=args.latency))
            server.create_bucket("tars")
            server.upload_tree(str(out), "tars", "shards")
            # without index files DALI's reader reads every shard's headers to make them
            dali_index = [f"{scratch}/{Path(f).stem}.idx" for f in shards]
            for f, idx in zip(shards, dali_index):
                wds2idx = [sys.executable, "-c", "import sys, wds2idx; sys.exit(wds2idx.main())", f, idx]
                subprocess.run(wds2idx, check=True, capture_output=True)
            pattern = f"s3://tars/shards/{Path(pattern).name}"
            shards = [f"s3://tars/shards/{Path(f).name}" for f in shards]
            where = {"store": "s3", "latency_s": args.latency}
        env = {**os.environ, **(server.env() if server else {})}
        spec = {"url": pattern, "epochs": args.epochs, "shards": shards, "dali_index": dali_index}
        spec |= {"batch": args.batch_size, "workers": args.workers, "threads": len(os.sched_getaffinity(0))}
        configs = [("coordl", float(c)) for c in args.cache.split(",")] + [("webdataset", None), ("dali", None)]
        rows = []
        for rep, (kind, cache) in measure.alternate(configs, args.reps):
            one = one_run(spec | {"kind": kind, "cache": cache}, env, server, dev, throttle)
            epochs, name = one["epochs"], kind if cache is None else f"coordl cache {cache:g}"
            steady = statistics.median(e["samples"] / e["seconds"] for e in epochs[1:] or epochs)
            row = {"rep": rep, "loader": name, "steady_samples_per_s": round(steady, 1), "epochs": epochs}
            rows.append(row := row | {"made_s": round(one["made_s"], 2), "made": one["create_requests"]})
            if cache is not None:  # what an epoch after the first must read: the uncached samples' bytes
                row["least_bytes"] = data["total_bytes"] - epochs[-1]["stats"]["cache_bytes"]
            report.log(row)
    return {"dataset": data, **where, "throttle": throttle, "notes": caps["notes"], "rows": rows}


def out_path(args) -> str:
    return args.out or str(cli.RESULTS / f"tars_epochs_{args.store}.json")


def table(results: dict) -> str:
    rows, lines = results["rows"], []
    moved = "get_bytes" if results["store"] == "s3" else "disk_bytes"
    for name in dict.fromkeys(r["loader"] for r in rows):
        mine = [r for r in rows if r["loader"] == name]
        rate = statistics.median(r["steady_samples_per_s"] for r in mine)
        lines.append([name, rate, report.mb(statistics.median(r["epochs"][-1][moved] for r in mine))])
    return report.table("loader|steady samples/s|last epoch read (MB)", lines)


def one_run(spec: dict, env: dict, server, dev, throttle) -> dict:
    """One loader's child in a blkio cgroup (throttled once the loader is made), each epoch cold (the meter's doing)."""
    lim = limits.Limits(f"coordl-tars-{os.getpid()}", False, throttle is not None)
    meter = s3.Meter(server) if server else DeviceMeter(dev)
    try:
        one = s3.run_child("tars_epochs", spec, meter, env, lambda: lim.throttle(dev, throttle), preexec_fn=lim.join)
    finally:
        lim.remove()
    if "error" in one:
        raise RuntimeError(f"{spec['kind']} {spec['cache']} failed:\n{one['error']}")
    return one


class DeviceMeter:
    """The device's bytes read since the last reading; each reading then drops the page cache."""

    def __init__(self, dev: tuple[int, int]):
        self.dev, self.before = dev, measure.sectors_read(dev)

    def read(self) -> dict:
        out = {"disk_bytes": measure.sectors_read(self.dev) - self.before}
        limits.drop_page_cache()
        self.before = measure.sectors_read(self.dev)
        return out
