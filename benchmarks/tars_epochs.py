"""Tar shards' steady epochs: coordl at cache 0/0.5/1 against WebDataset + DataLoader and DALI's reader.

A photo dataset (``--images``) written as shards of ``--per-shard`` samples, then ``--epochs`` epochs of
each loader in a child process, ABBA ``--reps`` times: coordl with the cache at each fraction of
``--cache``, WebDataset's pipeline (shard shuffle, a 1,000-sample buffer, Pillow decoding and a random
resized crop in ``--workers`` DataLoader workers) and DALI's ``readers.webdataset``. Steady samples/s:
the median of the epochs after the first.

- ``--store local``: the shards on a file system of their own (a loop device over an image file, made
  and removed by the run), so that ``/proc/diskstats`` counts their reads alone; the page cache dropped
  before each epoch, the device throttled to ``--throttle`` in a blkio cgroup when given (root).
- ``--store s3``: the shards on a local S3 server (moto behind ``coordl_testing.s3server``'s counting
  proxy) adding ``--latency`` to each request: the GETs and bytes it served per epoch.

    python -m benchmarks tars_epochs --images 2000 --throttle 20MB                 # ~8 min
    python -m benchmarks tars_epochs --images 2000 --store s3 --latency 0.02       # ~30 min
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.harness import dataset, jobs, limits, measure
from coordl.units import parse_bytes

RESULTS = Path(__file__).parent / "results"
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
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # one loader, in its cgroup
    for name in ("--pattern", "--loader", "--shard-list", "--dali-index"):
        p.add_argument(name, help=argparse.SUPPRESS)
    p.add_argument("--cache-fraction", type=float, default=0.0, help=argparse.SUPPRESS)


def write_photo_shards(folder: str, out: Path, per_shard: int) -> str:
    """The dataset's JPEGs as shards (WebDataset's keys and ``.cls`` labels), in its index's order."""
    from coordl import Index

    index = Index.scan(folder, index_dir="")
    n = -(-len(index) // per_shard)
    mark = out / ".made-by-benchmarks-tars"
    if not (mark.exists() and mark.read_text() == f"{index.fingerprint} {per_shard}"):
        out.mkdir(parents=True, exist_ok=True)
        for s in range(n):
            with tarfile.open(out / f"shard-{s:06d}.tar", "w", format=tarfile.GNU_FORMAT) as tf:
                for i in range(s * per_shard, min(len(index), (s + 1) * per_shard)):
                    label = str(int(index.labels[i])).encode()
                    for ext, data in (("jpg", Path(index.paths[i]).read_bytes()), ("cls", label)):
                        info = tarfile.TarInfo(f"{i:09d}.{ext}")
                        info.size = len(data)
                        tf.addfile(info, io.BytesIO(data))
        mark.write_text(f"{index.fingerprint} {per_shard}")
    return str(out / f"shard-{{000000..{n - 1:06d}}}.tar")


def child(args) -> None:
    """In the child (in the cgroup): ``--epochs`` epochs of ``--loader``, one line of JSON per epoch
    after the parent says go (it drops the page cache or resets the store's counts between them)."""
    pattern, bs = args.pattern, args.batch_size
    stats = None
    if args.loader == "coordl":
        import coordl

        kw = {"pipeline": "imagenet-train", "device_id": None, "cache": args.cache_fraction}
        loader = coordl.CoordLoader(pattern, batch_size=bs, shuffle=True, **kw)
        make = lambda e: (loader.set_epoch(e), iter(loader))[1]  # noqa: E731
        stats = loader.stats
    elif args.loader == "webdataset":
        make = _webdataset(args)
    else:
        make = _dali(args)
    dev = None if pattern.startswith("s3://") else measure.device_of(os.path.dirname(pattern))
    parent = jobs.Parent()
    parent.say(event="ready")
    for e in range(args.epochs):
        parent.wait()
        before, t0, n = measure.sectors_read(dev) if dev else 0, time.perf_counter(), 0
        for batch in make(e):
            n += len(batch[1]) if args.loader != "dali" else int(batch[0]["data"].shape[0])
        row = {"epoch": e, "samples": n, "seconds": round(time.perf_counter() - t0, 3)}
        if dev:
            row["disk_bytes"] = measure.sectors_read(dev) - before
        if stats:
            s = stats()
            row.update(storage_bytes=s["storage_bytes"], cache_bytes=s["cache_bytes"])
        parent.say(event="epoch", **row)
    parent.wait()
    parent.say(event="done")


def _shards(args) -> list[str]:
    """The shards, as the loaders other than coordl name them: local paths, or ``s3://`` URLs."""
    return json.loads(Path(args.shard_list).read_text())


def _webdataset(args):
    import torch
    import webdataset as wds
    from PIL import Image

    def crop(im: Image.Image):  # RandomResizedCrop(224)'s work in Pillow, and a tensor
        rng = np.random.default_rng()
        w, h = im.size
        s = float(np.sqrt(rng.uniform(0.08, 1.0)))
        cw, ch = max(1, int(w * s)), max(1, int(h * s))
        x, y = int(rng.integers(0, w - cw + 1)), int(rng.integers(0, h - ch + 1))
        out = im.crop((x, y, x + cw, y + ch)).resize((224, 224), Image.BILINEAR)
        return torch.from_numpy(np.asarray(out, dtype=np.float32) / 255.0).permute(2, 0, 1)

    urls = _shards(args)
    if urls[0].startswith("s3://"):  # WebDataset's way to read a URL: curl, here of a presigned GET
        import boto3
        from botocore.config import Config

        s3 = boto3.client("s3", config=Config(s3={"addressing_style": "path"}))  # the AWS_* variables
        where = [dict(zip(("Bucket", "Key"), u[5:].split("/", 1))) for u in urls]
        urls = [f"pipe:curl -s -f '{s3.generate_presigned_url('get_object', Params=w)}'" for w in where]
    ds = (
        wds.WebDataset(urls, shardshuffle=len(urls), empty_check=False)
        .shuffle(1000)
        .decode("pil")
        .to_tuple("jpg", "cls")
        .map_tuple(crop, int)
        .batched(args.batch_size)
    )
    dl = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=args.workers)
    return lambda e: iter(dl)


def _dali(args):
    from nvidia.dali import fn, pipeline_def, types
    from nvidia.dali.plugin.pytorch import DALIGenericIterator

    urls = _shards(args)
    index = json.loads(Path(args.dali_index).read_text()) if args.dali_index else None

    @pipeline_def(batch_size=args.batch_size, num_threads=len(os.sched_getaffinity(0)), device_id=None)
    def pipe():
        # dont_use_mmap: read as the others do; a mapping keeps the shards' pages through drop_caches
        kw = {"index_paths": index, "ext": ["jpg", "cls"], "random_shuffle": True, "dont_use_mmap": True}
        jpg, cls = fn.readers.webdataset(paths=urls, name="reader", **kw)
        images = fn.decoders.image_random_crop(jpg, device="cpu", output_type=types.RGB)
        images = fn.resize(images, size=(224, 224))
        images = fn.crop_mirror_normalize(images, dtype=types.FLOAT, mirror=fn.random.coin_flip())
        return images, fn.pad(cls, axes=(0,), shape=(8,))  # the label's text, padded: a uniform tensor

    p = pipe()
    p.build()
    it = DALIGenericIterator(p, ["data", "label"], reader_name="reader", auto_reset=True)
    return lambda e: iter(it)


@contextlib.contextmanager
def own_device(folder: Path, size: int):
    """``folder`` as the mount of an ext4 file system of its own, on a loop device (direct I/O) over
    an image file beside it: the device's read counter then sees the shards' reads alone, not the
    libraries a loader's process pages in again after the page cache is dropped. All removed after."""
    image = folder.with_name(folder.name + ".img")
    folder.mkdir(parents=True, exist_ok=True)
    with open(image, "wb") as f:
        f.truncate(size)
    try:
        subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], check=True)
        losetup = ["losetup", "--find", "--show", "--direct-io=on", str(image)]
        loop = subprocess.run(losetup, capture_output=True, text=True, check=True).stdout.strip()
        try:
            subprocess.run(["mount", loop, str(folder)], check=True)
            try:
                yield loop
            finally:
                subprocess.run(["umount", str(folder)], check=True)
        finally:
            subprocess.run(["losetup", "-d", loop], check=True)
    finally:
        image.unlink()


def run(args) -> dict | None:
    if args.child:
        return child(args)
    data = dataset.dataset_from_args(args)
    with contextlib.ExitStack() as stack:
        if args.store == "s3":
            pattern, shards, server = _in_store(args, stack)
            where = {"store": "s3", "latency_s": args.latency}
        else:
            server, out = None, Path(args.shards_dir)
            loop = stack.enter_context(own_device(out, 2 * data["total_bytes"] + (64 << 20)))
            pattern = write_photo_shards(args.data, out, args.per_shard)
            shards = [str(p) for p in sorted(out.glob("*.tar"))]
            where = {"store": "local", "device": loop}
        rows = _epoch_rows(args, data, pattern, shards, server, where)
    return {"dataset": data, **where, "rows": rows}


def out_path(args) -> str:
    return args.out or str(RESULTS / f"tars_epochs_{args.store}.json")


def table(results: dict) -> str:
    rows, lines = results["rows"], []
    moved = "store_bytes" if results["store"] == "s3" else "disk_bytes"
    for name in dict.fromkeys(r["loader"] for r in rows):
        mine = [r for r in rows if r["loader"] == name]
        rate = statistics.median(r["steady_samples_per_s"] for r in mine)
        last = statistics.median(r["epochs"][-1][moved] for r in mine)
        lines.append(f"{name:18s} steady {rate:7.1f} samples/s, last epoch read {last / 1e6:8.1f} MB")
    return "\n".join(lines)


def _in_store(args, stack):
    """The shards uploaded to a local S3 server behind ``--latency``: their pattern, URLs and the server."""
    from coordl_testing.s3server import S3Server

    pattern = write_photo_shards(args.data, Path(args.shards_dir), args.per_shard)
    server = stack.enter_context(S3Server(latency_s=args.latency))
    server.create_bucket("tars")
    keys = server.upload_tree(args.shards_dir, "tars", "shards")
    shards = [f"s3://tars/{k}" for k in keys if k.endswith(".tar")]
    return f"s3://tars/shards/{os.path.basename(pattern)}", shards, server


def one_run(args, command: list[str], env: dict, lim, server, throttle) -> tuple[float, dict, list[dict]]:
    """One loader's child in ``lim``'s cgroups: the seconds it took to be made, the store's counts
    meanwhile, and its epochs, each started cold (pages dropped, or the store's counts reset)."""
    t0, made, epochs = time.perf_counter(), {}, []

    def store() -> dict:
        return {"gets": server.count(), "store_bytes": server.bytes_sent()} if server else {}

    def heard(event: str, msg: dict) -> None:
        if event == "ready":
            made.update(made_s=time.perf_counter() - t0, **store())
            if throttle[1]:
                lim.throttle(*throttle)
        else:
            epochs.append({**msg, **store()})
        if len(epochs) < args.epochs:
            limits.drop_page_cache() if server is None else server.reset()

    code, err, _ = jobs.converse(command, heard, env=env, preexec_fn=lim.join)
    if code or len(epochs) < args.epochs:
        raise RuntimeError(f"{command[4:8]} failed ({code}):\n{jobs.error_text(err)}")
    return made.pop("made_s"), made, epochs


def _epoch_rows(args, data, pattern, shards, server, where) -> list[dict]:
    caps = limits.probe()
    local = server is None
    device = measure.device_of(os.path.dirname(pattern)) if local else None
    throttle = args.throttle if local and caps["blkio"] else None
    where.update(throttle=throttle, notes=caps["notes"])
    configs = [("coordl", float(c)) for c in args.cache.split(",")] + [("webdataset", None), ("dali", None)]
    scratch = Path(tempfile.mkdtemp(prefix="coordl-tars-bench-"))
    shard_list = scratch / "shards.json"
    shard_list.write_text(json.dumps(shards))
    dali_index = []
    if not local:  # without index files, DALI's reader infers them by reading every s3:// shard's headers
        for f in sorted(Path(args.shards_dir).glob("*.tar")):
            dali_index.append(str(scratch / f"{f.stem}.idx"))
            wds2idx = [sys.executable, "-c", "import sys, wds2idx; sys.exit(wds2idx.main())", str(f), dali_index[-1]]
            subprocess.run(wds2idx, check=True, capture_output=True)
        (scratch / "dali_index.json").write_text(json.dumps(dali_index))
    env = {**os.environ, **(server.env() if server else {}), "COORDL_INDEX_DIR": str(scratch / "index")}
    rows = []
    try:
        for rep in range(args.reps):
            for loader, cache in configs if rep % 2 == 0 else configs[::-1]:  # ABBA
                lim = limits.Limits(f"coordl-tars-{os.getpid()}", False, throttle is not None)
                kw = {"pattern": pattern, "loader": loader, "epochs": args.epochs, "batch_size": args.batch_size}
                kw |= {"workers": args.workers, "shard_list": shard_list, "cache_fraction": cache}
                kw["dali_index"] = scratch / "dali_index.json" if dali_index else None
                command = jobs.scenario_command("tars_epochs", *jobs.flags(child=True, **kw))
                try:
                    made_s, made, epochs = one_run(args, command, env, lim, server, (device, throttle))
                finally:
                    lim.remove()
                    shutil.rmtree(scratch / "index", ignore_errors=True)
                    if server:
                        server.reset()
                steady = [e["samples"] / e["seconds"] for e in epochs[1:] or epochs]
                name = loader if cache is None else f"coordl cache {cache:g}"
                row = {"rep": rep, "loader": name, "steady_samples_per_s": round(statistics.median(steady), 1)}
                row |= {"made_s": round(made_s, 2), "made": made, "epochs": epochs}
                if cache is not None:  # what an epoch after the first must read: the uncached samples' bytes
                    row["least_bytes"] = data["total_bytes"] - epochs[-1]["cache_bytes"]
                rows.append(row)
                print(row, flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return rows
