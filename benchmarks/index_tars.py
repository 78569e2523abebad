"""Tar shards indexed at scale (:mod:`benchmarks.index`'s ``tars`` and ``tars-s3``), each way in a fresh process.

``tars``: ``--shards`` of ``--per-shard`` samples, a ``.jpg`` of 60-160 KB (holes of sparse files) and a ``.cls``
each, indexed in one process and by workers, cold, warm and from the saved index; the same reads alone (the
device's floor). ``tars-s3``: members of each size in ``--members`` on moto behind ``--latency-ms`` a request,
indexed by range GETs, streamed, and left to choose. Both alternated ABBA ``--reps`` times."""

import concurrent.futures as cf
import os
import tarfile
import time
from pathlib import Path

import numpy as np

from benchmarks.harness import limits, measure
from benchmarks.harness.report import log
from benchmarks.indexing import fresh, made
from coordl.units import parse_bytes

WAYS = {"range": "range GETs of the headers", "stream": "one GET per shard, streamed", "auto": "left to choose"}


def write_tar(path: Path, members) -> None:
    """A tar file (GNU format) of ``members``: ``(name, bytes)``, or ``(name, size)``: a hole of a sparse file."""
    with open(path, "wb") as f:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = data if isinstance(data, int) else len(data)
            f.write(info.tobuf(tarfile.GNU_FORMAT))
            if isinstance(data, int):
                f.seek(-(-data // 512) * 512, os.SEEK_CUR)
            else:
                f.write(data + b"\0" * (-len(data) % 512))
        f.write(b"\0" * 1024)


def write_shards(root: Path, shards: int, per_shard: int, low: int, high: int, sparse: bool) -> None:
    """Shards of samples whose ``.jpg`` member is ``low``-``high`` bytes (a hole, or random bytes) and a ``.cls``."""
    rng = np.random.default_rng(0)

    def members(s: int):
        for i, size in enumerate(rng.integers(low, high + 1, per_shard).tolist()):
            yield f"{s * per_shard + i:09d}.jpg", size if sparse else rng.bytes(size)
            yield f"{s * per_shard + i:09d}.cls", str(i % 1000).encode()

    for s in range(shards):
        write_tar(root / f"shard-{s:06d}.tar", members(s))


def header_reads(index, in_flight: int) -> dict:
    """The reads indexing makes, without the parsing (the device's floor): in each shard one after the other,
    4 KB at its start and at the header after each image, ``in_flight`` shards at once; how many, and seconds."""
    from coordl.tars.format import BLOCK, WINDOW

    sh, t0 = index.shards, time.perf_counter()
    ends = (sh.offsets + index.sizes + BLOCK - 1) // BLOCK * BLOCK
    bounds = np.flatnonzero(np.diff(sh.of)) + 1

    def one(part):
        k, at = part
        with open(sh.files[k], "rb", buffering=0) as f:
            for pos in [0, *at.tolist()]:
                os.pread(f.fileno(), WINDOW, pos)
        return len(at) + 1

    parts = [(int(sh.of[i]), e) for i, e in zip(np.concatenate([[0], bounds]), np.split(ends, bounds))]
    with cf.ThreadPoolExecutor(in_flight) as pool:
        reads = sum(pool.map(one, parts))
    return {"reads": reads, "reads_s": time.perf_counter() - t0}


def indexed(data: str, shards: int, index_dir: Path, *, way="auto", one=False, then=None, env=None) -> dict:
    """``Index.from_tars`` of the shards in a fresh Python (``one``: in that process only; ``then``: as ``child``)."""
    kwargs = {"index_dir": str(index_dir), "stream": {"range": False, "stream": True, "auto": None}[way]}
    spec = {"how": "from_tars", "args": [f"{data}/shard-{{000000..{shards - 1:06d}}}.tar"], "kwargs": kwargs}
    spec |= {"set": {"coordl.tars.scan.PARALLEL_SHARDS": 1 << 40} if one else {}, "then": then}
    return fresh(spec, env=env)


def local(args, work: Path) -> dict:
    from coordl.tars import scan

    data, key = Path(args.data) / "tars", f"{args.shards} {args.per_shard}"
    wrote = made(data, key, lambda r: write_shards(r, args.shards, args.per_shard, 60_000, 159_999, True))
    log(f"shards: {args.shards} x {args.per_shard} in {data} (written in {wrote:.0f} s)")
    cores, rows = len(os.sched_getaffinity(0)), []
    in_flight = cores * scan.IO_THREADS  # as many reads as the workers keep
    for rep, one in measure.alternate([True, False], args.reps):
        note = limits.drop_page_cache()
        cold, loaded = (indexed(str(data), args.shards, work / f"{rep}{one}", one=one) for _ in range(2))
        warm = indexed(str(data), args.shards, work / f"{rep}{one}-warm", one=one)  # the headers in the page cache
        row = {"rep": rep, "processes": "one" if one else f"{cores} workers", "index_s": cold["seconds"]}
        row |= {"samples": cold["samples"], "samples_per_s": round(cold["samples"] / cold["seconds"])}
        row |= {"warm_index_s": warm["seconds"], "load_saved_s": loaded["seconds"]}
        row["page_cache"] = "dropped" if note is None else f"not dropped ({note})"
        if not one:
            limits.drop_page_cache()
            then = ["benchmarks.index_tars:header_reads", in_flight]
            reads = indexed(str(data), args.shards, work / f"{rep}{one}", then=then)  # the saved index, its reads
            row |= {"reads_alone_s": reads["reads_s"], "reads": reads["reads"], "reads_in_flight": in_flight}
        rows.append(row)
        log(row)
    return {"rows": rows}


def s3(args, work: Path) -> dict:
    from coordl_testing.s3server import S3Server

    rows = []
    with S3Server(latency_s=args.latency_ms / 1000) as server:
        server.create_bucket("tars")
        for spec in args.members.split(","):
            (work / spec).mkdir()
            write_shards(work / spec, args.shards, args.per_shard, *(parse_bytes(x) for x in spec.split("-")), False)
            server.upload_tree(str(work / spec), "tars", spec)
            total = sum(f.stat().st_size for f in (work / spec).glob("*.tar"))
            log(f"members of {spec}: {args.shards} shards, {total / 1e6:.1f} MB")
            for rep, way in measure.alternate(list(WAYS), args.reps):
                server.reset()
                r = indexed(f"s3://tars/{spec}", args.shards, work / f"{spec}{rep}{way}", way=way, env=server.env())
                row = {"members": spec, "shard_bytes": total, "rep": rep, "how": WAYS[way], "index_s": r["seconds"]}
                rows.append(row | {"samples": r["samples"], "gets": server.count(), "bytes": server.bytes_sent()})
                log(rows[-1])
    return {"rows": rows}
