"""Tar shards (WebDataset's format): indexing at ImageNet's scale, and steady epochs against
WebDataset's own loader and DALI's ``readers.webdataset``.

``index``: ``--shards`` shards of ``--per-shard`` samples (1,000 x 1,281 = 1,281,000 by default),
each sample a ``.jpg`` member of 60-160 KB and a ``.cls`` member, written as sparse files (the
images' bytes are holes: the geometry, offsets and headers of a real shard on a few GB of disk).
Then, with the page cache dropped, ``Index.from_tars`` in one process and with its worker
processes, and the load of the saved index.

    python -m benchmarks.tars index

Then, with the page cache dropped, the same reads alone (no parsing, as many in flight as the
worker processes keep): the device's floor for any indexer that walks the headers; and, with the
headers in the page cache, indexing again: the parsing alone.

``s3-index``: for each size of image member in ``--members``, ``--shards`` shards of
``--per-shard`` samples (random bytes: indexing reads headers, it decodes nothing) on a local S3
server adding ``--latency`` to each request, indexed by range GETs, streamed, and left to choose
(the default), in fresh processes: seconds, GETs and bytes moved.

    python -m benchmarks.tars s3-index

``epochs``: a photo dataset (``--images``) written as shards of ``--per-shard`` samples, then
``--epochs`` epochs of each loader in a child process: coordl with the cache at each fraction of
``--cache``, WebDataset's pipeline (shard shuffle, a 1,000-sample buffer, Pillow decoding and a
random resized crop in ``--workers`` DataLoader workers), and DALI's ``readers.webdataset``
(random shuffle, DALI's decoder and crop). Steady samples/s is the median of the epochs after the
first.

- ``--store local``: the shards on a file system of their own (a loop device over an image file,
  made and removed by the run), so that ``/proc/diskstats`` counts their reads alone; the page cache
  dropped before each epoch, the device throttled to ``--throttle`` in a blkio cgroup when given.
  coordl's own count of the bytes it read (``storage_bytes``) is beside the device's.
- ``--store s3``: the shards uploaded to a local S3 server (moto behind
  ``coordl_testing.s3server``'s counting proxy) that adds ``--latency`` to each request; per epoch,
  the object GETs and bytes it served. WebDataset reads each shard with ``curl``, its way to read a
  URL; DALI's reader with its AWS SDK.

    python -m benchmarks.tars epochs --images 2000 --throttle 20MB
    python -m benchmarks.tars epochs --images 2000 --store s3 --latency 0.02
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

from benchmarks import common
from coordl.units import parse_bytes

HERE = Path(__file__).parent
RESULTS = HERE / "results"


# -- index -----------------------------------------------------------------------------------
def write_sparse_shards(root: Path, shards: int, per_shard: int, seed: int = 0) -> float:
    """Writes the synthetic shards unless complete ones are there; returns the seconds it took."""
    mark = root / ".made-by-benchmarks-tars"
    if mark.exists() and mark.read_text() == f"{shards} {per_shard}":
        return 0.0
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    t0 = time.perf_counter()
    for s in range(shards):
        sizes = rng.integers(60_000, 160_000, per_shard).tolist()
        with open(root / f"shard-{s:06d}.tar", "wb") as f:
            for i, size in enumerate(sizes):
                key = f"{s * per_shard + i:09d}"
                jpg = tarfile.TarInfo(f"{key}.jpg")
                jpg.size = size
                f.write(jpg.tobuf(tarfile.GNU_FORMAT))
                f.seek(-(-size // 512) * 512, os.SEEK_CUR)  # a hole: the image's bytes are never read
                label = str(i % 1000).encode()
                cls = tarfile.TarInfo(f"{key}.cls")
                cls.size = len(label)
                f.write(cls.tobuf(tarfile.GNU_FORMAT) + label + b"\0" * (512 - len(label)))
            f.write(b"\0" * 1024)
        if (s + 1) % 100 == 0:
            print(f"  wrote {s + 1} of {shards} shards ({time.perf_counter() - t0:.0f} s)", flush=True)
    mark.write_text(f"{shards} {per_shard}")
    return time.perf_counter() - t0


def index_child(args) -> dict:
    """In a fresh Python: one ``Index.from_tars`` (``--processes 1``: in this process only), or with
    ``--reads-only`` the reads alone of a saved index's shards (:func:`header_reads`)."""
    from coordl import Index
    from coordl.tars import scan

    if args.processes == 1:
        scan.PARALLEL_SHARDS = 1 << 40
    if args.io_threads:
        scan.IO_THREADS = args.io_threads
    pattern = f"{args.data}/shard-{{000000..{args.shards - 1:06d}}}.tar"
    if args.reads_only:
        index = Index.from_tars(pattern, index_dir=args.index_dir)
        t0 = time.perf_counter()
        reads = header_reads(index, args.reads_only)
        return {"seconds": round(time.perf_counter() - t0, 3), "samples": len(index), "reads": reads}
    t0 = time.perf_counter()
    stream = {"range": False, "stream": True, "auto": None}[args.stream]
    index = Index.from_tars(pattern, index_dir=args.index_dir, stream=stream)
    return {"seconds": round(time.perf_counter() - t0, 3), "samples": len(index), "saved": bool(index.saved_path)}


def header_reads(index, in_flight: int) -> int:
    """The reads indexing makes, without the parsing: in each shard, one after the other, 4 KB at
    its start and at the header after each image (where the indexer's window moves to), with
    ``in_flight`` shards read at once; how many reads that was. Its time is the device's floor for
    any indexer that walks the headers with that many reads in flight."""
    import concurrent.futures as cf

    from coordl.tars.format import BLOCK, WINDOW

    sh = index.shards
    ends = (sh.offsets + index.sizes + BLOCK - 1) // BLOCK * BLOCK
    bounds = np.flatnonzero(np.diff(sh.of)) + 1

    def one(part):
        k, at = part
        fd = os.open(sh.files[k], os.O_RDONLY)
        try:
            os.pread(fd, WINDOW, 0)
            for pos in at.tolist():
                os.pread(fd, WINDOW, pos)
        finally:
            os.close(fd)
        return len(at) + 1

    parts = [(int(sh.of[i]), e) for i, e in zip(np.concatenate([[0], bounds]), np.split(ends, bounds))]
    with cf.ThreadPoolExecutor(in_flight) as pool:
        return sum(pool.map(one, parts))


def run_index(args) -> int:
    data = Path(args.data)
    wrote = write_sparse_shards(data, args.shards, args.per_shard)
    print(
        f"shards: {args.shards} x {args.per_shard} in {data} (written in {wrote:.0f} s)" if wrote else f"shards: {data}"
    )
    index_dir = Path(args.index_dir or "/var/tmp/coordl-bench/tars-index-dir")
    from coordl.tars import scan

    in_flight = len(os.sched_getaffinity(0)) * (args.io_threads or scan.IO_THREADS)  # as many as the workers keep
    rows = []
    for rep in range(args.reps):
        for processes in (1, 0) if rep % 2 == 0 else (0, 1):
            how = ["--processes", str(processes), "--index-dir", str(index_dir)]
            how += ["--io-threads", str(args.io_threads)] if args.io_threads else []
            for f in index_dir.glob("index-*"):
                f.unlink()
            note = common.drop_page_cache()
            made = _child(args, *how)
            loaded = _child(args, *how)
            for f in index_dir.glob("index-*"):
                f.unlink()
            warm = _child(args, *how)  # the shards' headers are in the page cache now: the parsing alone
            row = {
                "rep": rep,
                "processes": "one" if processes == 1 else f"{len(os.sched_getaffinity(0))} workers",
                "index_s": made["seconds"],
                "samples": made["samples"],
                "samples_per_s": round(made["samples"] / made["seconds"]),
                "warm_index_s": warm["seconds"],
                "load_saved_s": loaded["seconds"],
                "page_cache": "dropped" if note is None else f"not dropped ({note})",
            }
            if processes == 0:
                common.drop_page_cache()
                reads = _child(args, *how, "--reads-only", str(in_flight))
                row.update(reads_alone_s=reads["seconds"], reads=reads["reads"], reads_in_flight=in_flight)
            rows.append(row)
            print(json.dumps(row), flush=True)
    out = {"benchmark": "tars index", "args": vars(args), "machine": common.machine(), "rows": rows}
    path = Path(args.out or RESULTS / "tars_index.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2))
    for kind in dict.fromkeys(r["processes"] for r in rows):
        mine = [r for r in rows if r["processes"] == kind]
        med = statistics.median(r["index_s"] for r in mine)
        warm = statistics.median(r["warm_index_s"] for r in mine)
        load = statistics.median(r["load_saved_s"] for r in mine)
        rate = rows[0]["samples"] / med
        print(
            f"{kind:12s} index {med:.1f} s ({rate:,.0f} samples/s) cold, {warm:.1f} s warm; "
            f"saved index loaded in {load:.3f} s"
        )
        if "reads_alone_s" in mine[0]:
            alone = statistics.median(r["reads_alone_s"] for r in mine)
            n = mine[0]["reads"]
            print(f"{'':12s} its {n:,} reads alone, {in_flight} in flight, cold: {alone:.1f} s ({n / alone:,.0f}/s)")
    shutil.rmtree(index_dir, ignore_errors=True)
    return 0


def _child(args, *extra, env=None) -> dict:
    command = common.module_command("tars", "index-child", "--data", args.data, "--shards", str(args.shards), *extra)
    done = subprocess.run(command, capture_output=True, text=True, check=True, env=env)
    return json.loads(done.stdout.strip().splitlines()[-1])


# -- epochs ------------------------------------------------------------------------------------
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
                    for ext, data in (
                        ("jpg", Path(index.paths[i]).read_bytes()),
                        ("cls", str(int(index.labels[i])).encode()),
                    ):
                        info = tarfile.TarInfo(f"{i:09d}.{ext}")
                        info.size = len(data)
                        tf.addfile(info, io.BytesIO(data))
        mark.write_text(f"{index.fingerprint} {per_shard}")
    return str(out / f"shard-{{000000..{n - 1:06d}}}.tar")


def epochs_child(args) -> dict:
    """In the child (in the cgroup): ``--epochs`` epochs of ``--loader``, one line of JSON per epoch
    after the parent says go (it drops the page cache or resets the store's counts between them)."""
    pattern, bs = args.pattern, args.batch_size
    stats = None
    if args.loader == "coordl":
        import coordl

        loader = coordl.CoordLoader(
            pattern, batch_size=bs, shuffle=True, pipeline="imagenet-train", device_id=None, cache=args.cache_fraction
        )
        make = lambda e: (loader.set_epoch(e), iter(loader))[1]  # noqa: E731
        stats = loader.stats
    elif args.loader == "webdataset":
        make = _webdataset(args)
    else:
        make = _dali(args)
    dev = None if pattern.startswith("s3://") else common.device_of(os.path.dirname(pattern))
    print(json.dumps({"ready": True}), flush=True)
    for e in range(args.epochs):
        sys.stdin.readline()
        before, t0, n = common.sectors_read(dev) if dev else 0, time.perf_counter(), 0
        for batch in make(e):
            n += len(batch[1]) if args.loader != "dali" else int(batch[0]["data"].shape[0])
        row = {"epoch": e, "samples": n, "seconds": round(time.perf_counter() - t0, 3)}
        if dev:
            row["disk_bytes"] = common.sectors_read(dev) - before
        if stats:
            s = stats()
            row.update(storage_bytes=s["storage_bytes"], cache_bytes=s["cache_bytes"])
        print(json.dumps(row), flush=True)
    return {}


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
        urls = [
            "pipe:curl -s -f '{}'".format(
                s3.generate_presigned_url("get_object", Params=dict(zip(("Bucket", "Key"), u[5:].split("/", 1))))
            )
            for u in urls
        ]
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
        jpg, cls = fn.readers.webdataset(
            paths=urls, index_paths=index, ext=["jpg", "cls"], random_shuffle=True, dont_use_mmap=True, name="reader"
        )
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
        loop = subprocess.run(
            ["losetup", "--find", "--show", "--direct-io=on", str(image)], capture_output=True, text=True, check=True
        ).stdout.strip()
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


def run_epochs(args) -> int:
    dataset = common.dataset_from_args(args)
    with contextlib.ExitStack() as stack:
        if args.store == "s3":
            pattern, shards, server = _in_store(args, stack)
            where = {"store": "s3", "latency_s": args.latency}
        else:
            server, out = None, Path(args.shards_dir)
            loop = stack.enter_context(own_device(out, 2 * dataset["total_bytes"] + (64 << 20)))
            pattern = write_photo_shards(args.data, out, args.per_shard)
            shards = [str(p) for p in sorted(out.glob("*.tar"))]
            where = {"store": "local", "device": loop}
        rows = _epoch_rows(args, dataset, pattern, shards, server, where)
    out = {
        "benchmark": "tars epochs",
        "args": vars(args),
        "dataset": dataset,
        **where,
        "machine": common.machine(),
        "rows": rows,
    }
    path = Path(args.out or RESULTS / f"tars_epochs_{args.store}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2))
    moved = "store_bytes" if args.store == "s3" else "disk_bytes"
    for name in dict.fromkeys(r["loader"] for r in rows):
        mine = [r for r in rows if r["loader"] == name]
        rate = statistics.median(r["steady_samples_per_s"] for r in mine)
        last = statistics.median(r["epochs"][-1][moved] for r in mine)
        print(f"{name:18s} steady {rate:7.1f} samples/s, last epoch read {last / 1e6:8.1f} MB")
    return 0


def _in_store(args, stack):
    """The shards uploaded to a local S3 server behind ``--latency``: their pattern, URLs and the server."""
    from coordl_testing.s3server import S3Server

    pattern = write_photo_shards(args.data, Path(args.shards_dir), args.per_shard)
    server = stack.enter_context(S3Server(latency_s=args.latency))
    server.create_bucket("tars")
    keys = server.upload_tree(args.shards_dir, "tars", "shards")
    shards = [f"s3://tars/{k}" for k in keys if k.endswith(".tar")]
    return f"s3://tars/shards/{os.path.basename(pattern)}", shards, server


WAYS = {
    "range": "range GETs of the headers",
    "stream": "one GET per shard, streamed",
    "auto": "left to choose (the default)",
}


def _store_index(args, server, n: int, prefix: str = "s3://tars/shards") -> list[dict]:
    """``Index.from_tars`` of the ``s3://`` shards each way (:data:`WAYS`), in fresh processes,
    ``--reps`` times: seconds, GETs and bytes moved."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="coordl-tars-index-") as index_dir:
        env = {**os.environ, **server.env()}
        ns = argparse.Namespace(data=prefix, shards=n)
        for rep in range(args.reps):
            for way in list(WAYS) if rep % 2 == 0 else list(WAYS)[::-1]:
                for f in Path(index_dir).glob("index-*"):
                    f.unlink()
                server.reset()
                made = _child(ns, "--index-dir", index_dir, "--stream", way, env=env)
                row = {
                    "rep": rep,
                    "how": WAYS[way],
                    "index_s": made["seconds"],
                    "samples": made["samples"],
                    "gets": server.count(),
                    "bytes": server.bytes_sent(),
                }
                rows.append(row)
                print(json.dumps(row), flush=True)
    server.reset()
    return rows


def write_member_shards(root: Path, shards: int, per_shard: int, low: int, high: int, seed: int = 0) -> None:
    """Shards of samples whose ``.jpg`` member is ``low``-``high`` random bytes, and a ``.cls``."""
    rng = np.random.default_rng(seed)
    root.mkdir(parents=True, exist_ok=True)
    for s in range(shards):
        with tarfile.open(root / f"shard-{s:06d}.tar", "w", format=tarfile.GNU_FORMAT) as tf:
            for i in range(per_shard):
                key = f"{s * per_shard + i:09d}"
                for ext, data in (("jpg", rng.bytes(int(rng.integers(low, high + 1)))), ("cls", str(i % 10).encode())):
                    info = tarfile.TarInfo(f"{key}.{ext}")
                    info.size = len(data)
                    tf.addfile(info, io.BytesIO(data))


def run_s3_index(args) -> int:
    from coordl_testing.s3server import S3Server

    rows = []
    with S3Server(latency_s=args.latency) as server, tempfile.TemporaryDirectory(prefix="coordl-tars-s3ix-") as tmp:
        server.create_bucket("tars")
        for spec in args.members.split(","):
            low, high = (parse_bytes(x) for x in spec.split("-"))
            folder = Path(tmp) / spec
            write_member_shards(folder, args.shards, args.per_shard, low, high)
            server.upload_tree(str(folder), "tars", spec)
            total = sum(f.stat().st_size for f in folder.glob("*.tar"))
            shutil.rmtree(folder)
            print(f"members of {spec}: {args.shards} shards, {total / 1e6:.1f} MB", flush=True)
            for row in _store_index(args, server, args.shards, f"s3://tars/{spec}"):
                rows.append({"members": spec, "shard_bytes": total, **row})
    out = {"benchmark": "tars s3 index", "args": vars(args), "machine": common.machine(), "rows": rows}
    path = Path(args.out or RESULTS / "tars_s3_index.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2))
    for spec in dict.fromkeys(r["members"] for r in rows):
        for how in WAYS.values():
            mine = [r for r in rows if r["members"] == spec and r["how"] == how]
            med = statistics.median(r["index_s"] for r in mine)
            print(
                f"{spec:12s} {how:30s} {med:6.2f} s, {statistics.median(r['gets'] for r in mine):6.0f} GETs, "
                f"{statistics.median(r['bytes'] for r in mine) / 1e6:7.1f} MB"
            )
    return 0


def _epoch_rows(args, dataset, pattern, shards, server, where) -> list[dict]:
    from benchmarks import limits

    caps = limits.probe()
    local = server is None
    device = common.device_of(os.path.dirname(pattern)) if local else None
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
            subprocess.run(
                [sys.executable, "-c", "import sys, wds2idx; sys.exit(wds2idx.main())", str(f), dali_index[-1]],
                check=True,
                capture_output=True,
            )
        (scratch / "dali_index.json").write_text(json.dumps(dali_index))
    env = {**os.environ, **(server.env() if server else {}), "COORDL_INDEX_DIR": str(scratch / "index")}
    rows = []
    try:
        for rep in range(args.reps):
            for loader, cache in configs if rep % 2 == 0 else configs[::-1]:
                lim = limits.Limits(f"coordl-tars-{os.getpid()}", False, throttle is not None)
                extra = ["--cache-fraction", str(cache)] if cache is not None else []
                command = common.module_command(
                    "tars", "epochs-child", "--pattern", pattern, "--loader", loader, "--epochs", str(args.epochs),
                    "--batch-size", str(args.batch_size), "--workers", str(args.workers),
                    "--shard-list", str(shard_list), *extra,
                    *(["--dali-index", str(scratch / "dali_index.json")] if dali_index else []),
                )  # fmt: skip
                t0 = time.perf_counter()
                try:
                    proc = subprocess.Popen(
                        command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, preexec_fn=lim.join
                    )
                    assert json.loads(proc.stdout.readline()) == {"ready": True}
                    made_s = time.perf_counter() - t0
                    made = {"gets": server.count(), "store_bytes": server.bytes_sent()} if server else {}
                    if throttle:
                        lim.throttle(device, throttle)
                    epochs = []
                    for _ in range(args.epochs):
                        if local:
                            common.drop_page_cache()
                        else:
                            server.reset()
                        proc.stdin.write("go\n")
                        proc.stdin.flush()
                        epoch = json.loads(proc.stdout.readline())
                        if server:
                            epoch.update(gets=server.count(), store_bytes=server.bytes_sent())
                        epochs.append(epoch)
                    proc.stdin.close()
                    assert proc.wait(timeout=600) == 0
                finally:
                    lim.remove()
                    shutil.rmtree(scratch / "index", ignore_errors=True)
                    if server:
                        server.reset()
                steady = [e["samples"] / e["seconds"] for e in epochs[1:] or epochs]
                row = {
                    "rep": rep,
                    "loader": loader if cache is None else f"coordl cache {cache:g}",
                    "steady_samples_per_s": round(statistics.median(steady), 1),
                    "made_s": round(made_s, 2),
                    "made": made,
                    "epochs": epochs,
                }
                if cache is not None:  # what an epoch after the first must read: the uncached samples' bytes
                    row["least_bytes"] = dataset["total_bytes"] - epochs[-1]["cache_bytes"]
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return rows


def main() -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.tars", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(dest="what", required=True)
    ix = sub.add_parser("index", help="index 1.28M samples in 1,000 shards")
    ix.add_argument("--data", default="/var/tmp/coordl-bench/tars-sparse")
    ix.add_argument("--shards", type=int, default=1000)
    ix.add_argument("--per-shard", type=int, default=1281)
    ix.add_argument("--reps", type=int, default=3)
    ix.add_argument("--index-dir", default=None)
    ix.add_argument("--io-threads", type=int, default=0, help="shards a process indexes at once (default: coordl's)")
    ix.add_argument("--out", default=None)
    child = sub.add_parser("index-child")
    child.add_argument("--data")
    child.add_argument("--shards", type=int)
    child.add_argument("--processes", type=int, default=0)
    child.add_argument("--index-dir")
    child.add_argument("--io-threads", type=int, default=0)
    child.add_argument("--stream", choices=("auto", "range", "stream"), default="auto", help="s3:// shards' reads")
    child.add_argument("--reads-only", type=int, default=0, help="the reads alone, this many in flight")
    s3 = sub.add_parser("s3-index", help="index s3:// shards by range GETs, streamed, and left to choose")
    s3.add_argument("--members", default="2KB-4KB,60KB-160KB", help="the image members' sizes, low-high, each")
    s3.add_argument("--shards", type=int, default=10)
    s3.add_argument("--per-shard", type=int, default=200)
    s3.add_argument("--latency", type=float, default=0.02, help="seconds the S3 server adds to each request")
    s3.add_argument("--reps", type=int, default=3)
    s3.add_argument("--out", default=None)
    ep = sub.add_parser("epochs", help="steady epochs against webdataset and DALI's reader")
    common.add_dataset_options(ep, data="/var/tmp/coordl-bench/tars-photos")
    ep.add_argument("--shards-dir", default="/var/tmp/coordl-bench/tars-photos-shards")
    ep.add_argument("--per-shard", type=int, default=200)
    ep.add_argument("--cache", default="0,0.5,1", help="coordl's cache fractions")
    ep.add_argument("--throttle", type=parse_bytes, default=None, help="the device's read rate, e.g. 20MB")
    ep.add_argument("--epochs", type=int, default=3)
    ep.add_argument("--batch-size", type=int, default=64)
    ep.add_argument("--workers", type=int, default=2, help="webdataset's DataLoader workers")
    ep.add_argument("--reps", type=int, default=1)
    ep.add_argument("--store", choices=("local", "s3"), default="local", help="local files or a local S3 server")
    ep.add_argument("--latency", type=float, default=0.02, help="seconds the S3 server adds to each request")
    ep.add_argument("--out", default=None)
    ec = sub.add_parser("epochs-child")
    ec.add_argument("--pattern")
    ec.add_argument("--loader")
    ec.add_argument("--epochs", type=int)
    ec.add_argument("--batch-size", type=int)
    ec.add_argument("--workers", type=int)
    ec.add_argument("--cache-fraction", type=float, default=0.0)
    ec.add_argument("--shard-list")
    ec.add_argument("--dali-index", default=None, help="a JSON list of DALI's index files of the shards")
    args = p.parse_args()
    if args.what == "index":
        return run_index(args)
    if args.what == "index-child":
        print(json.dumps(index_child(args)), flush=True)
        return 0
    if args.what == "epochs":
        return run_epochs(args)
    if args.what == "s3-index":
        return run_s3_index(args)
    epochs_child(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
