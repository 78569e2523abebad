"""Tar shards (WebDataset's format): indexing at ImageNet's scale, and steady epochs against
WebDataset's own loader and DALI's ``readers.webdataset``.

``index``: ``--shards`` shards of ``--per-shard`` samples (1,000 x 1,281 = 1,281,000 by default),
each sample a ``.jpg`` member of 60-160 KB and a ``.cls`` member, written as sparse files (the
images' bytes are holes: the geometry, offsets and headers of a real shard on a few GB of disk).
Then, with the page cache dropped, ``Index.from_tars`` in one process and with its worker
processes, and the load of the saved index.

    python -m benchmarks.tars index

``epochs``: a photo dataset (``--images``) written as shards of ``--per-shard`` samples, then
``--epochs`` epochs of each loader in a child process (the page cache dropped before each, the
dataset's device throttled to ``--throttle`` in a blkio cgroup when given): coordl with the cache at
each fraction of ``--cache``, WebDataset's pipeline (shard shuffle, a 1,000-sample buffer, Pillow
decoding and a random resized crop in ``--workers`` DataLoader workers), and DALI's
``readers.webdataset`` (random shuffle, DALI's decoder and crop). Steady samples/s is the median
of the epochs after the first; bytes per epoch come from ``/proc/diskstats``.

    python -m benchmarks.tars epochs --images 2000 --throttle 20MB
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import subprocess
import sys
import tarfile
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
    """In a fresh Python: one ``Index.from_tars`` (``--processes 1``: in this process only)."""
    from coordl import Index
    from coordl.tars import scan

    if args.processes == 1:
        scan.PARALLEL_SHARDS = 1 << 40
    pattern = f"{args.data}/shard-{{000000..{args.shards - 1:06d}}}.tar"
    t0 = time.perf_counter()
    index = Index.from_tars(pattern, index_dir=args.index_dir)
    return {"seconds": round(time.perf_counter() - t0, 3), "samples": len(index), "saved": bool(index.saved_path)}


def run_index(args) -> int:
    data = Path(args.data)
    wrote = write_sparse_shards(data, args.shards, args.per_shard)
    print(
        f"shards: {args.shards} x {args.per_shard} in {data} (written in {wrote:.0f} s)" if wrote else f"shards: {data}"
    )
    rows = []
    for rep in range(args.reps):
        for processes in (1, 0) if rep % 2 == 0 else (0, 1):
            index_dir = Path(args.index_dir or "/var/tmp/coordl-bench/tars-index-dir")
            for f in index_dir.glob("index-*"):
                f.unlink()
            note = common.drop_page_cache()
            made = _child(args, "--processes", str(processes), "--index-dir", str(index_dir))
            loaded = _child(args, "--processes", str(processes), "--index-dir", str(index_dir))
            row = {
                "rep": rep,
                "processes": "one" if processes == 1 else f"{len(os.sched_getaffinity(0))} workers",
                "index_s": made["seconds"],
                "samples": made["samples"],
                "samples_per_s": round(made["samples"] / made["seconds"]),
                "load_saved_s": loaded["seconds"],
                "page_cache": "dropped" if note is None else f"not dropped ({note})",
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    out = {"benchmark": "tars index", "args": vars(args), "machine": common.machine(), "rows": rows}
    path = Path(args.out or RESULTS / "tars_index.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2))
    for kind in {r["processes"] for r in rows}:
        med = statistics.median(r["index_s"] for r in rows if r["processes"] == kind)
        load = statistics.median(r["load_saved_s"] for r in rows if r["processes"] == kind)
        rate = rows[0]["samples"] / med
        print(f"{kind:12s} index {med:.1f} s ({rate:,.0f} samples/s), saved index loaded in {load:.3f} s")
    return 0


def _child(args, *extra) -> dict:
    command = common.module_command("tars", "index-child", "--data", args.data, "--shards", str(args.shards), *extra)
    done = subprocess.run(command, capture_output=True, text=True, check=True)
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
    after the parent says go (it drops the page cache between them)."""
    pattern, bs = args.pattern, args.batch_size
    if args.loader == "coordl":
        import coordl

        loader = coordl.CoordLoader(
            pattern, batch_size=bs, shuffle=True, pipeline="imagenet-train", device_id=None, cache=args.cache_fraction
        )
        make = lambda e: (loader.set_epoch(e), iter(loader))[1]  # noqa: E731
    elif args.loader == "webdataset":
        make = _webdataset(args)
    else:
        make = _dali(args)
    dev = common.device_of(os.path.dirname(pattern))
    print(json.dumps({"ready": True}), flush=True)
    for e in range(args.epochs):
        sys.stdin.readline()
        before, t0, n = common.sectors_read(dev), time.perf_counter(), 0
        for batch in make(e):
            n += len(batch[1]) if args.loader != "dali" else int(batch[0]["data"].shape[0])
        seconds = time.perf_counter() - t0
        print(
            json.dumps(
                {
                    "epoch": e,
                    "samples": n,
                    "seconds": round(seconds, 3),
                    "disk_bytes": common.sectors_read(dev) - before,
                }
            ),
            flush=True,
        )
    return {}


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

    urls = [str(p) for p in sorted(Path(os.path.dirname(args.pattern)).glob("*.tar"))]
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

    urls = [str(p) for p in sorted(Path(os.path.dirname(args.pattern)).glob("*.tar"))]

    @pipeline_def(batch_size=args.batch_size, num_threads=len(os.sched_getaffinity(0)), device_id=None)
    def pipe():
        # dont_use_mmap: read as the others do; a mapping keeps the shards' pages through drop_caches
        jpg, cls = fn.readers.webdataset(
            paths=urls, ext=["jpg", "cls"], random_shuffle=True, dont_use_mmap=True, name="reader"
        )
        images = fn.decoders.image_random_crop(jpg, device="cpu", output_type=types.RGB)
        images = fn.resize(images, size=(224, 224))
        images = fn.crop_mirror_normalize(images, dtype=types.FLOAT, mirror=fn.random.coin_flip())
        return images, fn.pad(cls, axes=(0,), shape=(8,))  # the label's text, padded: a uniform tensor

    p = pipe()
    p.build()
    it = DALIGenericIterator(p, ["data", "label"], reader_name="reader", auto_reset=True)
    return lambda e: iter(it)


def run_epochs(args) -> int:
    from benchmarks import limits

    dataset = common.dataset_from_args(args)
    pattern = write_photo_shards(args.data, Path(args.shards_dir), args.per_shard)
    caps = limits.probe()
    device = common.device_of(os.path.dirname(pattern))
    throttle = args.throttle if caps["blkio"] else None
    configs = [("coordl", float(c)) for c in args.cache.split(",")] + [("webdataset", None), ("dali", None)]
    rows = []
    for rep in range(args.reps):
        for loader, cache in configs if rep % 2 == 0 else configs[::-1]:
            lim = limits.Limits(f"coordl-tars-{os.getpid()}", False, throttle is not None)
            extra = ["--cache-fraction", str(cache)] if cache is not None else []
            command = common.module_command(
                "tars", "epochs-child", "--pattern", pattern, "--loader", loader, "--epochs", str(args.epochs),
                "--batch-size", str(args.batch_size), "--workers", str(args.workers), *extra,
            )  # fmt: skip
            try:
                proc = subprocess.Popen(
                    command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, preexec_fn=lim.join
                )
                assert json.loads(proc.stdout.readline()) == {"ready": True}
                if throttle:
                    lim.throttle(device, throttle)
                epochs = []
                for _ in range(args.epochs):
                    common.drop_page_cache()
                    proc.stdin.write("go\n")
                    proc.stdin.flush()
                    epochs.append(json.loads(proc.stdout.readline()))
                proc.stdin.close()
                assert proc.wait(timeout=600) == 0
            finally:
                lim.remove()
            steady = [e["samples"] / e["seconds"] for e in epochs[1:]] or [epochs[0]["samples"] / epochs[0]["seconds"]]
            row = {
                "rep": rep,
                "loader": loader if cache is None else f"coordl cache {cache:g}",
                "steady_samples_per_s": round(statistics.median(steady), 1),
                "first_epoch_s": epochs[0]["seconds"],
                "disk_bytes_per_epoch": [e["disk_bytes"] for e in epochs],
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    out = {
        "benchmark": "tars epochs",
        "args": vars(args),
        "dataset": dataset,
        "throttle": throttle,
        "notes": caps["notes"],
        "machine": common.machine(),
        "rows": rows,
    }
    path = Path(args.out or RESULTS / "tars_epochs.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2))
    for name in dict.fromkeys(r["loader"] for r in rows):
        mine = [r for r in rows if r["loader"] == name]
        rate = statistics.median(r["steady_samples_per_s"] for r in mine)
        disk = statistics.median(r["disk_bytes_per_epoch"][-1] for r in mine)
        print(f"{name:18s} steady {rate:7.1f} samples/s, last epoch read {disk / 1e6:8.1f} MB")
    return 0


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
    ix.add_argument("--out", default=None)
    child = sub.add_parser("index-child")
    child.add_argument("--data")
    child.add_argument("--shards", type=int)
    child.add_argument("--processes", type=int, default=0)
    child.add_argument("--index-dir")
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
    ep.add_argument("--out", default=None)
    ec = sub.add_parser("epochs-child")
    ec.add_argument("--pattern")
    ec.add_argument("--loader")
    ec.add_argument("--epochs", type=int)
    ec.add_argument("--batch-size", type=int)
    ec.add_argument("--workers", type=int)
    ec.add_argument("--cache-fraction", type=float, default=0.0)
    args = p.parse_args()
    if args.what == "index":
        return run_index(args)
    if args.what == "index-child":
        print(json.dumps(index_child(args)), flush=True)
        return 0
    if args.what == "epochs":
        return run_epochs(args)
    epochs_child(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
