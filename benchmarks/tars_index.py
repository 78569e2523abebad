"""Tar shards indexed at ImageNet's scale: 1,281,000 samples in 1,000 sparse shards, cold and warm.

``--shards`` shards of ``--per-shard`` samples, each a ``.jpg`` member of 60-160 KB and a ``.cls``,
written as sparse files (the images' bytes are holes: the geometry, offsets and headers of a real
shard on a few GB of disk). Then, page cache dropped, ``Index.from_tars`` in one process and with its
worker processes, and the saved index's load; the same reads alone (no parsing, as many in flight as
the workers keep: the device's floor); and with the headers in the page cache, the parsing alone.
Alternated ABBA, ``--reps`` times, each in a fresh process.

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

from benchmarks.harness import jobs, limits


def options(p) -> None:
    p.add_argument("--data", default="/var/tmp/coordl-bench/tars-sparse")
    p.add_argument("--shards", type=int, default=1000)
    p.add_argument("--per-shard", type=int, default=1281)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--index-dir", default=None)
    p.add_argument("--io-threads", type=int, default=0, help="shards a process indexes at once (default: coordl's)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # one indexing, in a fresh Python
    p.add_argument("--processes", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--stream", choices=("auto", "range", "stream"), default="auto", help=argparse.SUPPRESS)
    p.add_argument("--reads-only", type=int, default=0, help=argparse.SUPPRESS)  # the reads alone, this many in flight


def child_command(data: str, shards: int, *extra: str) -> list[str]:
    return jobs.scenario_command("tars_index", "--child", "--data", data, "--shards", str(shards), *extra)


def _child(args, *extra, env=None) -> dict:
    return jobs.run_json(child_command(args.data, args.shards, *extra), env=env)


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


def child(args) -> dict:
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


def run(args) -> dict | None:
    if args.child:
        return jobs.say(**child(args))
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
            note = limits.drop_page_cache()
            made = _child(args, *how)
            loaded = _child(args, *how)
            for f in index_dir.glob("index-*"):
                f.unlink()
            warm = _child(args, *how)  # the shards' headers are in the page cache now: the parsing alone
            who = "one" if processes == 1 else f"{len(os.sched_getaffinity(0))} workers"
            row = {"rep": rep, "processes": who, "index_s": made["seconds"], "samples": made["samples"]}
            row |= {"samples_per_s": round(made["samples"] / made["seconds"]), "warm_index_s": warm["seconds"]}
            row |= {
                "load_saved_s": loaded["seconds"],
                "page_cache": "dropped" if note is None else f"not dropped ({note})",
            }
            if processes == 0:
                limits.drop_page_cache()
                reads = _child(args, *how, "--reads-only", str(in_flight))
                row.update(reads_alone_s=reads["seconds"], reads=reads["reads"], reads_in_flight=in_flight)
            rows.append(row)
            print(row, flush=True)
    shutil.rmtree(index_dir, ignore_errors=True)
    return {"rows": rows, "reads_in_flight": in_flight}


def table(results: dict) -> str:
    rows, in_flight, lines = results["rows"], results["reads_in_flight"], []
    for kind in dict.fromkeys(r["processes"] for r in rows):
        mine = [r for r in rows if r["processes"] == kind]
        med = statistics.median(r["index_s"] for r in mine)
        warm = statistics.median(r["warm_index_s"] for r in mine)
        load = statistics.median(r["load_saved_s"] for r in mine)
        rate = rows[0]["samples"] / med
        lines.append(f"{kind:12s} index {med:.1f} s ({rate:,.0f} samples/s) cold, {warm:.1f} s warm; ")
        lines[-1] += f"saved index loaded in {load:.3f} s"
        if "reads_alone_s" in mine[0]:
            alone = statistics.median(r["reads_alone_s"] for r in mine)
            n = mine[0]["reads"]
            lines.append(
                f"{'':12s} its {n:,} reads alone, {in_flight} in flight, cold: {alone:.1f} s ({n / alone:,.0f}/s)"
            )
    return "\n".join(lines)
