"""Indexes at scale: building, loading and checking folder, COCO and tar-shard indexes, their time and memory.

Each step in a fresh Python (:mod:`benchmarks.indexing`); the files made in ``--data`` deleted after unless
``--keep``. ``scale``: 1,281,000 tiny files scanned, saved, loaded, the memory, a forked worker's copies;
``currency``: the check of a saved index (warm, cold, by ``--threads``) on that tree and on ``s3://`` keys behind
``--latency-ms``; ``coco``: a COCO-sized ``Index.from_coco``; ``tars``, ``tars-s3``: :mod:`benchmarks.index_tars`.

    python -m benchmarks index --what scale                        # ~3 min, results/index_scale.json
    python -m benchmarks index --what currency     # ~25 min, root for the cold checks; results/index_currency.json
    python -m benchmarks index --what coco                         # ~2 min, results/coco_index.json
    python -m benchmarks index --what tars         # ~20 min, root (drops the page cache); results/tars_index.json
    python -m benchmarks index --what tars-s3                      # ~2 min, results/tars_s3_index.json
"""

import functools
import json
import math
import multiprocessing
import os
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from benchmarks import index_tars
from benchmarks.harness import cli, limits
from benchmarks.harness.report import log
from benchmarks.indexing import fresh, made, memory, remove

OUT = None  # results/<OUTS[--what]>.json (out_path)
CATEGORIES = [i for i in range(1, 91) if i not in (12, 26, 29, 30, 45, 66, 68, 69, 71, 83)]  # COCO's 80 ids


def tree(args) -> tuple[Path, dict]:
    """The tree (ImageNet's names: ``n<8 digits>/n<8 digits>_<i>.jpg``), made unless there; its figures."""
    root, n = Path(args.data) / "train", args.classes * args.per_class

    def write(root: Path) -> None:
        for c in range(args.classes):
            (root / f"n{c:08d}").mkdir()
            for i in range(args.per_class):
                (root / f"n{c:08d}" / f"n{c:08d}_{i}.jpg").write_bytes(b"\xff\xd8" + b"x" * (i % 13))

    log(f"making {args.classes} x {args.per_class} files in {root}")
    return root, {"root": str(root), "files": n, "made_s": made(root, f"{args.classes} {args.per_class}", write)}


def scan_and_save(root: str, index_dir: str) -> dict:
    """The tree's listing and its saving timed apart (saving is in coordl.saved now, in coordl.index before)."""
    from coordl import index as ix

    try:
        from coordl.saved import save, tree_path
    except ImportError:
        save, tree_path = ix._save, ix._saved_path
    Path(index_dir).mkdir()
    t0 = time.perf_counter()
    index, dirs = ix._scan(root, ix.IMG_EXTENSIONS)
    t1 = time.perf_counter()
    save(index, dirs, tree_path(index_dir, root, ix.IMG_EXTENSIONS))
    saved = sum(p.stat().st_size for p in Path(index_dir).iterdir())
    out = {"coordl": ix.__file__, "samples": len(index), "fingerprint": index.fingerprint, "scan_s": t1 - t0}
    return out | {"save_s": time.perf_counter() - t1, "file_bytes": saved}


def walk(index) -> dict:
    """A forked child (a ``DataLoader`` worker) reads every path and size: the pages it copies (pytorch#13246)."""
    global WALKED
    WALKED = index  # the worker is forked with it: nothing pickled
    with multiprocessing.get_context("fork").Pool(1) as pool:
        return pool.apply(walked)


def walked() -> dict:
    m0, t0, paths, sizes = memory(), time.perf_counter(), WALKED.paths, WALKED.sizes
    out = {"check": sum(len(paths[i]) + int(sizes[i]) for i in range(len(WALKED))), "walk_s": time.perf_counter() - t0}
    return out | {"worker_after_walk": {k: v - m0[k] for k, v in memory().items()}}


def scale(args, work: Path) -> dict:
    """The figures of the coordl this Python imports (``PYTHONPATH=<an older checkout>/src``: an older one's)."""
    root, made_tree = tree(args)
    scan = fresh({"how": "benchmarks.index:scan_and_save", "args": [str(root), str(work / "index")]})
    load = {"how": "scan", "args": [str(root)], "kwargs": {"index_dir": str(work / "index")}}
    runs = [fresh(load | {"then": ["benchmarks.index:walk"]}) for _ in range(args.reps)]
    traced = fresh(load | {"heap": True})
    if any(r["fingerprint"] != scan["fingerprint"] for r in [*runs, traced]):
        raise SystemExit("a load scanned the tree again")
    best, loads = min(runs, key=lambda r: r["seconds"]), [r["seconds"] for r in runs]
    out = {"tree": made_tree, **scan}
    out |= {"load_s": statistics.median(loads), "load_s_all": loads, "heap_bytes": traced["heap_bytes"]}
    return out | {k: best[k] for k in ("after_load", "walk_s", "worker_after_walk")}


def check(root: str, index_dir: Path, threads: int | None = None, rebuild: bool = False, env=None) -> dict:
    """``Index.scan`` finding its saved index (``rebuild``: a new scan), with ``threads`` stat threads."""
    spec = {"how": "scan", "args": [root], "kwargs": {"index_dir": str(index_dir), "rebuild": rebuild}}
    spec |= {"set": {"coordl.currency.STAT_THREADS": threads} if threads else {}}
    spec["before"] = ["coordl.s3.client:boto3_client"] if root.startswith("s3://") else []
    return fresh(spec, env=env) | {"threads": threads}  # None: coordl.currency.STAT_THREADS


def files(args, work: Path) -> dict:
    root, out = tree(args)
    at = functools.partial(check, str(root), work / "index-files")  # at(threads, rebuild)
    out["scan"] = at(rebuild=True)
    warm = [at() for _ in range(args.reps)]
    out["check_warm"] = {"median_s": statistics.median(r["seconds"] for r in warm), "runs": warm}
    out["check_warm_by_threads"] = [at(t) for t in args.threads]
    cold = [] if args.no_cold else args.threads  # each after the page cache is dropped (as root; else not measured)
    out["check_cold_by_threads"] = [at(t) for t in cold if not limits.drop_page_cache(3)]
    for k in range(0, out["files"], max(1, out["files"] // args.changed))[: args.changed]:
        path = root / "n{0:08d}/n{0:08d}_{1}.jpg".format(*divmod(k, args.per_class))
        st = path.stat()  # rewritten in place, at its size, 5 s later in time
        path.write_bytes(path.read_bytes()[::-1])
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 5_000_000_000))
    out["changed"], out["after_changed"] = at(), at()
    if out["changed"]["changed"] != args.changed or out["after_changed"]["changed"]:
        raise SystemExit(f"the checks found {out['changed']['changed']}, then {out['after_changed']['changed']}")
    return out


def s3(args, work: Path) -> dict:
    from coordl_testing.s3server import S3Server

    keys = [f"train/n{c:08d}/n{c:08d}_{i}.jpg" for c in range(args.s3_classes) for i in range(args.s3_per_class)]
    out: dict = {"objects": len(keys), "classes": args.s3_classes, "per_class": args.s3_per_class}
    with S3Server() as server:
        server.create_bucket("coordl-currency-bench")
        log(f"putting {len(keys)} objects into moto")
        with ThreadPoolExecutor(16) as pool:
            list(pool.map(lambda k: server.put("coordl-currency-bench", k, b"\xff\xd8x"), keys))

        def measured(latency_ms: float, rebuild: bool = False) -> dict:
            server.latency_s = latency_ms / 1000
            server.reset()
            r = check("s3://coordl-currency-bench/train", work / "index-s3", None, rebuild, server.env())
            r["list_requests"] = sum(1 for _, p, _, _ in server.requests("GET") if "list-type" in p)
            r["object_requests"] = server.count("GET") + server.count("HEAD")
            return r | {"latency_ms": latency_ms}

        out["scan"] = [measured(args.latency_ms, rebuild=True) for _ in range(args.reps)]
        out["check"] = [measured(args.latency_ms) for _ in range(args.reps)]
        out["check_no_latency"] = [measured(0.0) for _ in range(args.reps)]
        server.put("coordl-currency-bench", keys[len(keys) // 2], b"\xff\xd8y")
        out["changed"] = measured(args.latency_ms)
        if out["changed"]["changed"] != 1:
            raise SystemExit(f"the check found {out['changed']['changed']} objects changed, not 1")
    return out | {"extrapolated": extrapolate(out, args.latency_ms)}


def extrapolate(out: dict, latency_ms: float, classes: int = 1000, per_class: int = 1281) -> dict:
    """ImageNet's prefix from the measured check: its pages, the latency's rounds (``LIST_THREADS`` classes at
    a time, a class's pages one after another), the client's CPU a page (boto3 parsing its XML)."""
    from coordl.s3.listing import LIST_THREADS

    pages = min(out["check"], key=lambda r: r["seconds"])["list_requests"]
    quiet = min(out["check_no_latency"], key=lambda r: r["seconds"])
    pages_big = classes * math.ceil(per_class / 1000) + math.ceil(classes / 1000)
    rounds = math.ceil(classes / LIST_THREADS) * math.ceil(per_class / 1000) + 1
    latency_s, cpu_s = rounds * latency_ms / 1000, pages_big * quiet["cpu_s"] / pages
    out = {"pages": pages_big, "rounds": rounds, "classes_at_once": LIST_THREADS, "latency_ms": latency_ms}
    out |= {"latency_bound_s": latency_s, "client_cpu_s": cpu_s, "measured_pages": pages}
    out |= {"client_cpu_per_page_ms": 1000 * quiet["cpu_s"] / pages, "estimate_s": max(latency_s, cpu_s)}
    return out | {"wall_per_page_no_latency_ms": 1000 * quiet["seconds"] / pages}  # moto's time and the client's


def write_coco(root: Path, images: int) -> None:
    """``train2017/``, an empty file per image (~640x480), and ``instances_train.json``: 7.3 boxes each, 1% crowd."""
    rng = np.random.default_rng(0)
    w, h, counts = rng.integers(320, 641, images), rng.integers(240, 481, images), rng.poisson(7.3, images)
    of = np.repeat(np.arange(images), counts)  # each box's image
    bw, bh = rng.uniform(2, w[of] / 2), rng.uniform(2, h[of] / 2)
    xywh = np.stack([rng.uniform(0, w[of] - bw), rng.uniform(0, h[of] - bh), bw, bh], 1).round(2).tolist()
    cats, crowd, area = rng.choice(CATEGORIES, len(of)).tolist(), rng.random(len(of)) < 0.01, (bw * bh).tolist()
    (root / "train2017").mkdir()
    names = [f"{i + 1:012d}.jpg" for i in range(images)]
    for name in names:
        (root / "train2017" / name).write_bytes(b"x")
    sizes = enumerate(zip(names, w.tolist(), h.tolist()))
    doc = {"images": [{"id": i + 1, "file_name": n, "width": x, "height": y} for i, (n, x, y) in sizes]}
    doc["annotations"] = [
        {"id": k + 1, "image_id": int(i) + 1, "category_id": c, "bbox": b, "area": a, "iscrowd": int(z)}
        for k, (i, c, b, a, z) in enumerate(zip(of, cats, xywh, area, crowd))
    ]
    doc["categories"] = [{"id": c, "name": f"c{c}"} for c in CATEGORIES]
    (root / "instances_train.json").write_text(json.dumps(doc))


def boxes(index) -> dict:
    """A detection index's boxes: how many, their arrays' bytes, and its saved file's."""
    b = index.boxes
    arrays = sum(a.nbytes for a in (b.offsets, b.xyxy, b.labels, b.image_sizes, b.image_ids))
    return {"boxes": int(len(b.labels)), "box_bytes": arrays, "file_bytes": os.path.getsize(index.saved_path)}


def coco(args, work: Path) -> dict:
    root = Path(args.data) / "coco"
    made_s = made(root, str(args.images), lambda r: write_coco(r, args.images))
    ann = root / "instances_train.json"
    spec = {"how": "from_coco", "args": [str(root / "train2017"), str(ann)], "then": ["benchmarks.index:boxes"]}
    cold, *loads = (fresh(spec | {"kwargs": {"index_dir": str(work)}}) for _ in range(1 + args.reps))
    r = {"annotations_bytes": ann.stat().st_size, "made_s": made_s, "images": cold["samples"], "boxes": cold["boxes"]}
    r |= {"box_bytes": cold["box_bytes"], "index_file_bytes": cold["file_bytes"], "cold_s": cold["seconds"]}
    return r | {"load_s": statistics.median(x["seconds"] for x in loads), "loads_s": [x["seconds"] for x in loads]}


def options(p) -> None:
    p.add_argument("--what", choices=list(WHATS), default="scale", help="what is measured (default: scale)")
    p.add_argument("--data", default="/var/tmp/coordl-bench/index", help="where the files are made")
    p.add_argument("--reps", type=int, help="repetitions of each measurement (default: 3; coco 5)")
    p.add_argument("--keep", action="store_true", help="keep the files made for another run")
    p.add_argument("--classes", type=int, default=1000)
    p.add_argument("--per-class", type=int, default=1281)
    p.add_argument("--threads", type=int, nargs="+", default=[1, 8, 32], help="currency: stat threads to compare")
    p.add_argument("--changed", type=int, default=1000, help="currency: files rewritten before the last check")
    p.add_argument("--no-cold", action="store_true", help="currency: no cold checks (they drop the machine's caches)")
    p.add_argument("--s3-classes", type=int, default=40)
    p.add_argument("--s3-per-class", type=int, default=1281)
    p.add_argument("--latency-ms", type=float, default=20.0, help="s3: the S3 server's added latency a request")
    p.add_argument("--skip", choices=["files", "s3"], action="append", default=[])
    p.add_argument("--images", type=int, default=118_287, help="coco")
    p.add_argument("--shards", type=int, help="tar shards (default: tars 1000, tars-s3 10)")
    p.add_argument("--per-shard", type=int, help="samples a shard (default: tars 1281, tars-s3 200)")
    p.add_argument("--members", default="2KB-4KB,60KB-160KB", help="tars-s3: the image members' sizes, low-high")


def currency(args, work: Path) -> dict:
    return {k: part(args, work) for k, part in (("files", files), ("s3", s3)) if k not in args.skip}


WHATS = {"scale": scale, "currency": currency, "coco": coco, "tars": index_tars.local, "tars-s3": index_tars.s3}
OUTS = {"scale": "index_scale", "currency": "index_currency", "coco": "coco_index", "tars-s3": "tars_s3_index"}


def run(args) -> dict:
    cli.defaults(args, args.what == "coco", reps=(3, 5))
    cli.defaults(args, args.what == "tars-s3", shards=(1000, 10), per_shard=(1281, 200))
    with tempfile.TemporaryDirectory(dir="/var/tmp", prefix="coordl-index-") as tmp:
        try:
            return {"what": args.what} | WHATS[args.what](args, Path(tmp))
        finally:
            if not args.keep:
                remove(Path(args.data) / {"coco": "coco", "tars": "tars"}.get(args.what, "train"))


def out_path(args) -> str:
    return args.out or str(cli.RESULTS / f"{OUTS.get(args.what, 'tars_index')}.json")


def table(results: dict) -> str:
    return json.dumps(results, indent=1)  # every figure, where it is in the result file
