"""Tar shards on s3:// indexed by range GETs, streamed, and left to choose, behind 20 ms a request.

For each size of image member in ``--members``, ``--shards`` shards of ``--per-shard`` samples (random
bytes: indexing decodes nothing) on a local S3 server adding ``--latency`` to each request; each way in
a fresh process (:mod:`benchmarks.tars_index`'s child), ABBA ``--reps`` times: seconds, GETs, bytes.

    python -m benchmarks tars_s3_index       # ~2 min
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
from pathlib import Path

from benchmarks.harness import jobs, measure, report
from benchmarks.harness.report import log
from benchmarks.tars_index import MARK, child_command, write_shards
from coordl.units import parse_bytes

WAYS = {"range": "range GETs of the headers", "stream": "one GET per shard, streamed"}
WAYS["auto"] = "left to choose (the default)"


def options(p) -> None:
    p.add_argument("--members", default="2KB-4KB,60KB-160KB", help="the image members' sizes, low-high, each")
    p.add_argument("--shards", type=int, default=10)
    p.add_argument("--per-shard", type=int, default=200)
    p.add_argument("--latency", type=float, default=0.02, help="seconds the S3 server adds to each request")
    p.add_argument("--reps", type=int, default=3)


def run(args) -> dict:
    from coordl_testing.s3server import S3Server

    rows = []
    with S3Server(latency_s=args.latency) as server, tempfile.TemporaryDirectory(prefix="coordl-tars-s3ix-") as tmp:
        server.create_bucket("tars")
        env = {**os.environ, **server.env()}
        for spec in args.members.split(","):
            folder = Path(tmp) / spec
            write_shards(folder, args.shards, args.per_shard, *(parse_bytes(x) for x in spec.split("-")), sparse=False)
            (folder / MARK).unlink()
            server.upload_tree(str(folder), "tars", spec)
            total = sum(f.stat().st_size for f in folder.glob("*.tar"))
            shutil.rmtree(folder)
            log(f"members of {spec}: {args.shards} shards, {total / 1e6:.1f} MB")
            for rep, way in measure.alternate(list(WAYS), args.reps):
                shutil.rmtree(Path(tmp) / "index", ignore_errors=True)
                server.reset()
                how = ["--index-dir", str(Path(tmp) / "index"), "--stream", way]
                made = jobs.run_json(child_command(f"s3://tars/{spec}", args.shards, *how), env=env)
                row = {"members": spec, "shard_bytes": total, "rep": rep, "how": WAYS[way], "index_s": made["seconds"]}
                rows.append(row | {"samples": made["samples"], "gets": server.count(), "bytes": server.bytes_sent()})
                log(rows[-1])
    return {"rows": rows}


def table(results: dict) -> str:
    out = []
    for spec in dict.fromkeys(r["members"] for r in results["rows"]):
        for how in WAYS.values():
            mine = [r for r in results["rows"] if r["members"] == spec and r["how"] == how]
            out.append([spec, how, *(statistics.median(r[k] for r in mine) for k in ("index_s", "gets", "bytes"))])
    return report.table("members|how|s (median)|GETs|bytes", out)
