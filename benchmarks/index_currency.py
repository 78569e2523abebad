"""What a run's check of its saved index against the dataset costs (:mod:`coordl.currency`).

**Files**: the tree of :mod:`benchmarks.index_scale` in ``--data``; each step in a fresh Python: a new
``scan`` (list, stat, save); the ``check`` at reuse, warm (``--loads`` times, median; and once with
each of ``--threads`` stat threads) and cold (after ``drop_caches`` 3, root; ``--no-cold`` skips it);
the check finding ``--changed`` files rewritten at their size with a later time, then one finding
nothing. **s3://**: ``--s3-classes`` x ``--s3-per-class`` objects of 3 bytes in moto's server behind a
proxy adding ``--latency-ms`` a request: a new listing and the check at reuse (``--loads`` times, with
the proxy's requests and the process's CPU), the check without the latency, and one object replaced.
1.28M keys in moto are impractical (its listing of a page walks the bucket), so ImageNet's 1,000
classes of 1,281 keys are extrapolated from the pages measured (``s3.extrapolated``). The tree, the
objects (with moto's server) and the saved indexes are deleted at the end (``--keep`` keeps the tree).

    python -m benchmarks index_currency
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks.harness import jobs, limits
from benchmarks.harness.report import log
from benchmarks.index_scale import fresh, make_tree, remove_tree, tree_options


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
    return fresh("index_currency", "--child", *args, env=env)


# -- files ------------------------------------------------------------------------------------
def rewrite_some(root: Path, classes: int, per_class: int, n: int) -> None:
    """Rewrites ``n`` files spread over the tree in place, at their size, 5 s later in time."""
    for k in range(0, classes * per_class, max(1, classes * per_class // n))[:n]:
        path = root / f"n{k // per_class:08d}" / f"n{k // per_class:08d}_{k % per_class}.jpg"
        st = path.stat()
        path.write_bytes(path.read_bytes()[::-1])
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 5_000_000_000))


def files(args, work: Path) -> dict:
    root = Path(args.data) / "train"
    log(f"making {args.classes} x {args.per_class} files in {root}")
    made_s = make_tree(root, args.classes, args.per_class)

    def check(threads: int = 0, what: str = "check") -> dict:
        return run_child(what, str(root), str(work / "index-files"), str(threads))

    out: dict = {"root": str(root), "files": args.classes * args.per_class, "made_s": made_s, "scan": check(0, "scan")}
    warm = [check() for _ in range(args.loads)]
    out["check_warm"] = {"median_s": statistics.median(r["seconds"] for r in warm), "runs": warm}
    out["check_warm_by_threads"] = [check(t) for t in args.threads]
    out["check_cold_by_threads"] = []
    for t in [] if args.no_cold else args.threads:
        if why := limits.drop_page_cache(3):
            out["check_cold_skipped"] = why
            break
        out["check_cold_by_threads"].append(check(t))
    rewrite_some(root, args.classes, args.per_class, args.changed)
    out["changed"], out["after_changed"] = check(), check()
    if out["changed"]["changed"] != args.changed or out["after_changed"]["changed"]:
        raise SystemExit(f"the checks found {out['changed']['changed']}, then {out['after_changed']['changed']}")
    return out


BUCKET = "coordl-currency-bench"


def s3(args, work: Path) -> dict:
    from coordl_testing.s3server import S3Server

    classes, per_class = args.s3_classes, args.s3_per_class
    with S3Server() as server:
        server.create_bucket(BUCKET)
        keys = [f"train/n{c:08d}/n{c:08d}_{i}.jpg" for c in range(classes) for i in range(per_class)]
        s3c = server.client()
        log(f"putting {len(keys)} objects into moto")
        t0 = time.perf_counter()
        with ThreadPoolExecutor(16) as pool:
            list(pool.map(lambda k: s3c.put_object(Bucket=BUCKET, Key=k, Body=b"\xff\xd8x"), keys))
        put_s = time.perf_counter() - t0
        root, env, index_dir = f"s3://{BUCKET}/train", server.env(), str(work / "index-s3")

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
        if out["changed"]["changed"] != 1:
            raise SystemExit(f"the check found {out['changed']['changed']} objects changed, not 1")
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
    tree_options(p)
    p.add_argument("--threads", type=int, nargs="+", default=[1, 8, 32], help="stat threads to compare")
    p.add_argument("--changed", type=int, default=1000, help="files rewritten before the last check")
    p.add_argument("--no-cold", action="store_true", help="skip the cold checks (which drop the machine's caches)")
    p.add_argument("--s3-classes", type=int, default=40)
    p.add_argument("--s3-per-class", type=int, default=1281)
    p.add_argument("--latency-ms", type=float, default=20.0)
    p.add_argument("--skip", choices=["files", "s3"], action="append", default=[])
    p.add_argument("--child", nargs=4, help=argparse.SUPPRESS)  # WHAT ROOT INDEX_DIR THREADS: one measurement


def run(args) -> dict | None:
    if args.child:
        what, root, index_dir, threads = args.child
        return jobs.say(**child(what, root, index_dir, int(threads)))
    result = {}
    with tempfile.TemporaryDirectory(dir="/var/tmp", prefix="coordl-index-currency-") as tmp:
        try:
            if "files" not in args.skip:
                result["files"] = files(args, Path(tmp))
        finally:
            if not args.keep:
                remove_tree(Path(args.data))
        if "s3" not in args.skip:
            result["s3"] = s3(args, Path(tmp))
    return result


def table(result: dict) -> str:
    return json.dumps(result, indent=1)[:6000]
