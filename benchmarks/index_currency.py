"""What a run's check of its saved index against the dataset costs (:mod:`coordl.currency`).

**Files.** The tree of :mod:`benchmarks.index_scale` (``--classes`` x ``--per-class`` tiny ``.jpg``
files, 1000 x 1281 = 1,281,000 by default) on the local disk, in ``--data``; each step in a fresh
Python:

- ``scan``: ``Index.scan(root)`` made anew: the tree listed, every file stat'ed, the index saved;
- ``check, warm``: ``Index.scan(root)`` reusing the saved index: its folders' times, then a stat of
  every file on ``coordl.currency.STAT_THREADS`` threads (``--loads`` times, median; and once with each
  of ``--threads``);
- ``check, cold``: the same after ``sync; echo 3 > /proc/sys/vm/drop_caches`` (pages, dentries and
  inodes dropped), once with each of ``--threads`` (root; ``--no-cold`` skips it);
- ``changed``: ``--changed`` files rewritten in place at their size with a later time: the check that
  finds them and saves the index again; then a check that finds nothing.

**s3://** ``--s3-classes`` x ``--s3-per-class`` objects of 3 bytes in moto's server
(:mod:`coordl_testing.s3server`) behind a proxy that adds ``--latency-ms`` to every request: a new
listing (``Index.scan(root, rebuild=True)``) and the check at reuse (``Index.scan(root)``), each
``--loads`` times, with the proxy's request count and the process's CPU time; the same check without
the latency; and one object replaced, found by the check. 1.28M keys in moto are impractical (its
listing of a page walks every key of the bucket): the figure for ImageNet's 1,000 classes of
1,281 keys is extrapolated from the measured pages (see the JSON's ``s3.extrapolated``).

Deletes the tree, the objects and the saved indexes at the end (``--keep`` keeps the tree).

    python -m benchmarks index_currency
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks.harness import dataset, jobs, limits
from benchmarks.index_scale import make_tree, remove_tree


# -- measured in a child ----------------------------------------------------------------------
def child(what: str, root: str, index_dir: str, threads: int) -> dict:
    from coordl import currency
    from coordl.index import Index

    if threads:
        currency.STAT_THREADS = threads
    if root.startswith("s3://"):  # the client made before the clock starts: a run's fixed cost, not the check's
        from coordl.s3 import client, listing  # noqa: F401

        client.boto3_client()
    c0, t0 = time.process_time(), time.perf_counter()
    index = Index.scan(root, index_dir=index_dir, rebuild=what == "scan")
    out = {"seconds": time.perf_counter() - t0, "cpu_s": time.process_time() - c0, "samples": len(index)}
    return out | {"changed": index.changed, "version": index.version, "threads": currency.STAT_THREADS}


def run_child(*args: str, env: dict | None = None) -> dict:
    full = dict(os.environ, **(env or {}))
    full["PYTHONPATH"] = os.pathsep.join([str(dataset.ROOT / "src"), str(dataset.ROOT)])
    return jobs.run_json(jobs.scenario_command("index_currency", "--child", *args), env=full, cwd=dataset.ROOT)


# -- files ------------------------------------------------------------------------------------
def rewrite_some(root: Path, classes: int, per_class: int, n: int) -> None:
    """Rewrites ``n`` files spread over the tree in place, at their size, 5 s later in time."""
    step = max(1, classes * per_class // n)
    for k in range(0, classes * per_class, step)[:n]:
        name = f"n{k // per_class:08d}"
        path = root / name / f"{name}_{k % per_class}.jpg"
        st = path.stat()
        body = path.read_bytes()
        path.write_bytes(body[::-1])
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 5_000_000_000))


def files(args, work: Path) -> dict:
    root = Path(args.data) / "train"
    index_dir = str(work / "index-files")
    print(f"making {args.classes} x {args.per_class} files in {root}", file=sys.stderr)
    made_s = make_tree(root, args.classes, args.per_class)
    out: dict = {"root": str(root), "files": args.classes * args.per_class, "made_s": made_s}
    out["scan"] = run_child("scan", str(root), index_dir, "0")
    warm = [run_child("check", str(root), index_dir, "0") for _ in range(args.loads)]
    out["check_warm"] = {"median_s": statistics.median(r["seconds"] for r in warm), "runs": warm}
    out["check_warm_by_threads"] = [run_child("check", str(root), index_dir, str(t)) for t in args.threads]
    cold = []
    for t in [] if args.no_cold else args.threads:
        why = limits.drop_page_cache(3)
        if why:
            out["check_cold_skipped"] = why
            break
        cold.append(run_child("check", str(root), index_dir, str(t)))
    out["check_cold_by_threads"] = cold
    rewrite_some(root, args.classes, args.per_class, args.changed)
    out["changed"] = run_child("check", str(root), index_dir, "0")
    out["after_changed"] = run_child("check", str(root), index_dir, "0")
    assert out["changed"]["changed"] == args.changed and out["after_changed"]["changed"] == 0, out
    return out


# -- s3:// ------------------------------------------------------------------------------------
BUCKET = "coordl-currency-bench"


def s3(args, work: Path) -> dict:
    from coordl_testing.s3server import S3Server

    classes, per_class = args.s3_classes, args.s3_per_class
    with S3Server() as server:
        server.create_bucket(BUCKET)
        keys = [f"train/n{c:08d}/n{c:08d}_{i}.jpg" for c in range(classes) for i in range(per_class)]
        s3c = server.client()
        print(f"putting {len(keys)} objects into moto", file=sys.stderr)
        t0 = time.perf_counter()
        with ThreadPoolExecutor(16) as pool:
            list(pool.map(lambda k: s3c.put_object(Bucket=BUCKET, Key=k, Body=b"\xff\xd8x"), keys))
        put_s = time.perf_counter() - t0
        root = f"s3://{BUCKET}/train"
        env = server.env()
        index_dir = str(work / "index-s3")

        def measured(what: str, latency_ms: float) -> dict:
            server.latency_s = latency_ms / 1000
            server.reset()
            r = run_child(what, root, index_dir, "0", env=env)
            r["list_requests"] = sum(1 for _, p, _, _ in server.requests("GET") if "list-type" in p)
            r["object_requests"] = server.count("GET") + server.count("HEAD")
            r["latency_ms"] = latency_ms
            return r

        out: dict = {"objects": len(keys), "classes": classes, "per_class": per_class, "put_s": put_s}
        out["scan"] = [measured("scan", args.latency_ms) for _ in range(args.loads)]
        out["check"] = [measured("check", args.latency_ms) for _ in range(args.loads)]
        out["check_no_latency"] = [measured("check", 0.0) for _ in range(args.loads)]
        s3c.put_object(Bucket=BUCKET, Key=keys[len(keys) // 2], Body=b"\xff\xd8y")
        out["changed"] = measured("check", args.latency_ms)
        assert out["changed"]["changed"] == 1, out["changed"]
        print("deleting the objects", file=sys.stderr)
        for start in range(0, len(keys), 1000):
            s3c.delete_objects(Bucket=BUCKET, Delete={"Objects": [{"Key": k} for k in keys[start : start + 1000]]})
    out["extrapolated"] = extrapolate(out, args.latency_ms)
    return out


def extrapolate(out: dict, latency_ms: float, classes: int = 1000, per_class: int = 1281) -> dict:
    """ImageNet's prefix from the measured check: the listing's pages, the latency-bound rounds (the
    classes are listed :data:`coordl.s3.listing.LIST_THREADS` at a time, a class's pages one after
    another) and the client's CPU per page (boto3 parses each page's XML, holding the GIL)."""
    from coordl.s3.listing import LIST_THREADS

    check = min(out["check"], key=lambda r: r["seconds"])
    quiet = min(out["check_no_latency"], key=lambda r: r["seconds"])
    pages = check["list_requests"]
    per_page_cpu = quiet["cpu_s"] / pages
    per_page_wall = quiet["seconds"] / pages  # moto's time and the client's, no added latency
    pages_big = classes * math.ceil(per_class / 1000) + math.ceil(classes / 1000)
    rounds = math.ceil(classes / LIST_THREADS) * math.ceil(per_class / 1000) + 1
    latency_s = rounds * latency_ms / 1000
    cpu_s = pages_big * per_page_cpu
    what = f"{classes} classes x {per_class} keys: {pages_big} pages, {rounds} rounds of {LIST_THREADS} classes at "
    out = {"what": what + f"{latency_ms:g} ms; the client's CPU per page as measured here", "pages": pages_big}
    out |= {"latency_bound_s": latency_s, "client_cpu_s": cpu_s, "measured_pages": pages}
    out |= {"client_cpu_per_page_ms": 1000 * per_page_cpu, "wall_per_page_no_latency_ms": 1000 * per_page_wall}
    return out | {"estimate_s": max(latency_s, cpu_s)}


def options(p) -> None:
    p.add_argument("--child", nargs=4, help=argparse.SUPPRESS)  # WHAT ROOT INDEX_DIR THREADS: one measurement
    p.add_argument("--data", default="/var/tmp/coordl-index-scale", help="where the tree is made")
    p.add_argument("--classes", type=int, default=1000)
    p.add_argument("--per-class", type=int, default=1281)
    p.add_argument("--loads", type=int, default=3, help="repetitions of each warm measurement")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 8, 32], help="stat threads to compare")
    p.add_argument("--changed", type=int, default=1000, help="files rewritten before the last check")
    p.add_argument("--no-cold", action="store_true", help="skip the cold checks (which drop the machine's caches)")
    p.add_argument("--s3-classes", type=int, default=40)
    p.add_argument("--s3-per-class", type=int, default=1281)
    p.add_argument("--latency-ms", type=float, default=20.0)
    p.add_argument("--skip", choices=["files", "s3"], action="append", default=[])
    p.add_argument("--keep", action="store_true", help="keep the tree for another run")


def run(args) -> dict | None:
    if args.child:
        what, root, index_dir, threads = args.child
        return jobs.say(**child(what, root, index_dir, int(threads)))
    result = {}
    with tempfile.TemporaryDirectory(dir="/var/tmp", prefix="coordl-index-currency-") as tmp:
        work = Path(tmp)
        try:
            if "files" not in args.skip:
                result["files"] = files(args, work)
        finally:
            if not args.keep:
                remove_tree(Path(args.data), Path(args.data) / "train")
        if "s3" not in args.skip:
            result["s3"] = s3(args, work)
    return result


def table(result: dict) -> str:
    return json.dumps(result, indent=1)[:6000]
