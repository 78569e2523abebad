"""Tar shards on s3:// indexed by range GETs, streamed, and left to choose, behind 20 ms a request.

For each size of image member in ``--members``, ``--shards`` shards of ``--per-shard`` samples (random
bytes: indexing decodes nothing) on a local S3 server adding ``--latency`` to each request; each way in
a fresh process (:mod:`benchmarks.tars_index`'s child), ABBA ``--reps`` times: seconds, GETs, bytes.

    python -m benchmarks tars_s3_index       # ~2 min
"""

from __future__ import annotations

import io
import os
import shutil
import statistics
import tarfile
import tempfile
from pathlib import Path

import numpy as np

from benchmarks.harness import jobs
from benchmarks.tars_index import child_command
from coordl.units import parse_bytes

OUT = str(Path(__file__).parent / "results" / "tars_s3_index.json")


def options(p) -> None:
    p.add_argument("--members", default="2KB-4KB,60KB-160KB", help="the image members' sizes, low-high, each")
    p.add_argument("--shards", type=int, default=10)
    p.add_argument("--per-shard", type=int, default=200)
    p.add_argument("--latency", type=float, default=0.02, help="seconds the S3 server adds to each request")
    p.add_argument("--reps", type=int, default=3)


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
        for rep in range(args.reps):
            for way in list(WAYS) if rep % 2 == 0 else list(WAYS)[::-1]:  # ABBA
                for f in Path(index_dir).glob("index-*"):
                    f.unlink()
                server.reset()
                made = jobs.run_json(child_command(prefix, n, "--index-dir", index_dir, "--stream", way), env=env)
                row = {"rep": rep, "how": WAYS[way], "index_s": made["seconds"], "samples": made["samples"]}
                row |= {"gets": server.count(), "bytes": server.bytes_sent()}
                rows.append(row)
                print(row, flush=True)
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


def run(args) -> dict:
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
    return {"rows": rows}


def table(results: dict) -> str:
    rows, lines = results["rows"], []
    for spec in dict.fromkeys(r["members"] for r in rows):
        for how in WAYS.values():
            mine = [r for r in rows if r["members"] == spec and r["how"] == how]
            med = statistics.median(r["index_s"] for r in mine)
            gets, moved = (statistics.median(r[k] for r in mine) for k in ("gets", "bytes"))
            lines.append(f"{spec:12s} {how:30s} {med:6.2f} s, {gets:6.0f} GETs, {moved / 1e6:7.1f} MB")
    return "\n".join(lines)
