"""Tar shards indexed at ImageNet's scale: 1,281,000 samples in 1,000 sparse shards, cold and warm.

``--shards`` shards of ``--per-shard`` samples, each a ``.jpg`` member of 60-160 KB and a ``.cls``,
written as sparse files (the images' bytes are holes: a real shard's geometry on a few GB of disk).
In fresh processes, alternated ABBA ``--reps`` times: ``Index.from_tars`` in one process and with its
worker processes, page cache dropped, then the saved index's load and, headers in the page cache, the
parsing alone; and the same reads alone (no parsing, as many in flight as the workers keep: the
device's floor).

    python -m benchmarks tars_index          # ~20 min, root (drops the page cache)
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tarfile
import time
from pathlib import Path

import numpy as np

from benchmarks.harness import jobs, limits, measure, report
from benchmarks.harness.report import log

MARK = ".made-by-benchmarks-tars"  # a complete set of shards, and its size


def write_shards(root: Path, shards: int, per_shard: int, low: int, high: int, sparse: bool) -> float:
    """Shards of samples whose ``.jpg`` member is ``low``-``high`` bytes (holes of a sparse file, or random
    bytes) and a ``.cls``, unless complete ones are there; returns the seconds it took."""
    if (root / MARK).exists() and (root / MARK).read_text() == f"{shards} {per_shard}":
        return 0.0
    root.mkdir(parents=True, exist_ok=True)
    rng, t0 = np.random.default_rng(0), time.perf_counter()

    def header(name: str, size: int) -> bytes:
        info = tarfile.TarInfo(name)
        info.size = size
        return info.tobuf(tarfile.GNU_FORMAT)

    for s in range(shards):
        with open(root / f"shard-{s:06d}.tar", "wb") as f:
            for i, size in enumerate(rng.integers(low, high + 1, per_shard).tolist()):
                f.write(header(f"{s * per_shard + i:09d}.jpg", size))
                if sparse:
                    f.seek(-(-size // 512) * 512, os.SEEK_CUR)  # a hole: the image's bytes are never read
                else:
                    f.write(rng.bytes(size) + b"\0" * (-size % 512))
                label = str(i % 1000).encode()
                f.write(header(f"{s * per_shard + i:09d}.cls", len(label)) + label + b"\0" * (512 - len(label)))
            f.write(b"\0" * 1024)
        if (s + 1) % 100 == 0:
            log(f"  wrote {s + 1} of {shards} shards ({time.perf_counter() - t0:.0f} s)")
    (root / MARK).write_text(f"{shards} {per_shard}")
    return time.perf_counter() - t0


def child_command(data: str, shards: int, *extra: str) -> list[str]:
    return jobs.scenario_command("tars_index", "--child", "--data", data, "--shards", str(shards), *extra)


def child(args) -> dict:
    """In a fresh Python: one ``Index.from_tars`` (``--processes 1``: in this process only), or with
    ``--reads-only`` the reads alone of a saved index's shards (:func:`header_reads`)."""
    from coordl import Index
    from coordl.tars import scan

    if args.processes == 1:
        scan.PARALLEL_SHARDS = 1 << 40
    pattern = f"{args.data}/shard-{{000000..{args.shards - 1:06d}}}.tar"
    stream = {"range": False, "stream": True, "auto": None}[args.stream]
    t0 = time.perf_counter()
    index = Index.from_tars(pattern, index_dir=args.index_dir, stream=stream)
    if not args.reads_only:
        return {"seconds": round(time.perf_counter() - t0, 3), "samples": len(index)}
    t0 = time.perf_counter()
    reads = header_reads(index, args.reads_only)
    return {"seconds": round(time.perf_counter() - t0, 3), "samples": len(index), "reads": reads}


def header_reads(index, in_flight: int) -> int:
    """The reads indexing makes, without the parsing: in each shard, one after the other, 4 KB at its
    start and at the header after each image (where the indexer's window moves to), ``in_flight``
    shards at once; returns how many. Its time is the device's floor for any indexer that walks the
    headers with that many reads in flight."""
    import concurrent.futures as cf

    from coordl.tars.format import BLOCK, WINDOW

    sh = index.shards
    ends = (sh.offsets + index.sizes + BLOCK - 1) // BLOCK * BLOCK
    bounds = np.flatnonzero(np.diff(sh.of)) + 1

    def one(part):
        k, at = part
        fd = os.open(sh.files[k], os.O_RDONLY)
        try:
            for pos in [0, *at.tolist()]:
                os.pread(fd, WINDOW, pos)
        finally:
            os.close(fd)
        return len(at) + 1

    parts = [(int(sh.of[i]), e) for i, e in zip(np.concatenate([[0], bounds]), np.split(ends, bounds))]
    with cf.ThreadPoolExecutor(in_flight) as pool:
        return sum(pool.map(one, parts))


def options(p) -> None:
    p.add_argument("--data", default="/var/tmp/coordl-bench/tars-sparse")
    p.add_argument("--shards", type=int, default=1000)
    p.add_argument("--per-shard", type=int, default=1281)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--index-dir", default="/var/tmp/coordl-bench/tars-index-dir")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # one indexing, in a fresh Python
    p.add_argument("--processes", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--stream", choices=("auto", "range", "stream"), default="auto", help=argparse.SUPPRESS)
    p.add_argument("--reads-only", type=int, default=0, help=argparse.SUPPRESS)  # the reads alone, this many in flight


def run(args) -> dict | None:
    if args.child:
        return jobs.say(**child(args))
    from coordl.tars import scan

    wrote = write_shards(Path(args.data), args.shards, args.per_shard, 60_000, 159_999, sparse=True)
    log(f"shards: {args.shards} x {args.per_shard} in {args.data} (written in {wrote:.0f} s)")
    cores, index_dir = len(os.sched_getaffinity(0)), Path(args.index_dir)
    in_flight = cores * scan.IO_THREADS  # as many as the workers keep

    def indexed(*extra: str, saved: bool = False) -> dict:
        if not saved:
            shutil.rmtree(index_dir, ignore_errors=True)
        return jobs.run_json(child_command(args.data, args.shards, "--index-dir", str(index_dir), *extra))

    rows = []
    for rep, processes in measure.alternate([1, 0], args.reps):
        note = limits.drop_page_cache()
        made = indexed("--processes", str(processes))
        loaded = indexed("--processes", str(processes), saved=True)
        warm = indexed("--processes", str(processes))  # the shards' headers are in the page cache now
        row = {"rep": rep, "processes": "one" if processes == 1 else f"{cores} workers", "index_s": made["seconds"]}
        row |= {"samples": made["samples"], "samples_per_s": round(made["samples"] / made["seconds"])}
        row |= {"warm_index_s": warm["seconds"], "load_saved_s": loaded["seconds"]}
        row["page_cache"] = "dropped" if note is None else f"not dropped ({note})"
        if processes == 0:
            limits.drop_page_cache()
            reads = indexed("--reads-only", str(in_flight), saved=True)
            row.update(reads_alone_s=reads["seconds"], reads=reads["reads"], reads_in_flight=in_flight)
        rows.append(row)
        log(row)
    shutil.rmtree(index_dir, ignore_errors=True)
    return {"rows": rows, "reads_in_flight": in_flight}


def table(results: dict) -> str:
    out = []
    for kind in dict.fromkeys(r["processes"] for r in results["rows"]):
        mine = [r for r in results["rows"] if r["processes"] == kind]
        med = {k: statistics.median(r[k] for r in mine if k in r) for k in ("index_s", "warm_index_s", "load_saved_s")}
        row = [kind, med["index_s"], round(mine[0]["samples"] / med["index_s"]), med["warm_index_s"]]
        row.append(med["load_saved_s"])
        if "reads" in mine[0]:
            alone = statistics.median(r["reads_alone_s"] for r in mine)
            row += [f"{mine[0]['reads']:,} reads, {results['reads_in_flight']} in flight: {alone:.1f}"]
        out.append(row)
    return report.table("how|cold s (median)|samples/s|warm s|saved index loaded s|the reads alone, cold s", out)
