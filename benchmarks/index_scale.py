"""An ImageNet-sized index: scan, save and load times, and the index's memory per process.

A tree of ``--classes`` x ``--per-class`` tiny ``.jpg`` files (1000 x 1281 = 1,281,000 by default; the
scan reads sizes, not contents) in ``--data``; for this checkout's ``src/`` and (``--before-ref``) an
earlier commit's, each step in a fresh Python: ``scan`` (list the tree, save the index); ``load``
(``Index.scan(root)`` finding the saved index, ``--loads`` times, median; the process's memory from
``/proc/self/smaps_rollup``, and in another load the heap the index holds, by ``tracemalloc``);
``walk`` (a forked child, as a ``DataLoader`` worker is, reads every path and size: the pages it
copies out of the parent, pytorch/pytorch#13246). The tree is deleted at the end unless ``--keep``.

    python -m benchmarks index_scale --before-ref 2b84f86
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
import tarfile
import tempfile
import time
from pathlib import Path

from benchmarks.harness import dataset, jobs, report
from benchmarks.harness.report import log, mb

MARK = ".made-by-index-scale"  # in a tree this scenario made (and may delete); its size once complete


def make_tree(root: Path, classes: int, per_class: int) -> float:
    """Writes the tree (ImageNet's names: ``n<8 digits>/n<8 digits>_<i>.jpg``) unless a complete one is
    there; returns the seconds it took (0 for a tree an earlier ``--keep`` run made)."""
    mark = root / MARK
    if mark.exists() and mark.read_text() == f"{classes} {per_class}":
        return 0.0
    if root.exists():
        if not mark.exists():
            raise SystemExit(f"{root} exists and was not made by this benchmark; give another --data")
        shutil.rmtree(root)
    root.mkdir(parents=True)
    mark.write_text("incomplete")
    t0 = time.perf_counter()
    for c in range(classes):
        (root / f"n{c:08d}").mkdir()
        for i in range(per_class):
            (root / f"n{c:08d}" / f"n{c:08d}_{i}.jpg").write_bytes(b"\xff\xd8" + b"x" * (i % 13))
    mark.write_text(f"{classes} {per_class}")
    return time.perf_counter() - t0


def remove_tree(data: Path) -> None:
    """Deletes ``data``'s tree if this scenario made it, then ``data`` if that leaves it empty."""
    if (data / "train" / MARK).exists():
        shutil.rmtree(data / "train")
    with contextlib.suppress(OSError):
        data.rmdir()


def fresh(scenario: str, *args: str, src: str | None = None, env: dict | None = None) -> dict:
    """``python -m benchmarks SCENARIO ARGS`` in a fresh Python importing coordl from ``src`` (default:
    this checkout's); the JSON it says last."""
    path = os.pathsep.join([src or str(dataset.ROOT / "src"), str(dataset.ROOT)])
    env = {**os.environ, **(env or {}), "PYTHONPATH": path}
    return jobs.run_json(jobs.scenario_command(scenario, *args), env=env, cwd=dataset.ROOT)


def memory() -> dict:
    """This process's memory in bytes: RSS, PSS, USS (the pages only it maps), private dirty pages (its
    heap, and what a forked child copied by writing), anonymous memory."""
    lines = Path("/proc/self/smaps_rollup").read_text().splitlines()[1:]
    f = {ln.split(":")[0]: int(ln.split()[1]) * 1024 for ln in lines}
    out = {"rss": f["Rss"], "pss": f["Pss"], "uss": f["Private_Clean"] + f["Private_Dirty"]}
    return out | {"dirty": f["Private_Dirty"], "anon": f["Anonymous"]}


def delta(after: dict, before: dict) -> dict:
    return {k: after[k] - before[k] for k in after}


def child_scan(root: str, index_dir: str) -> dict:
    """Listing and saving timed apart (saving is in coordl.saved now, in coordl.index before)."""
    from coordl import index as ix

    try:
        from coordl.saved import save, tree_path
    except ImportError:
        save, tree_path = ix._save, ix._saved_path
    t0 = time.perf_counter()
    index, dirs = ix._scan(root, ix.IMG_EXTENSIONS)
    t1 = time.perf_counter()
    save(index, dirs, tree_path(index_dir, root, ix.IMG_EXTENSIONS))
    saved = sum(p.stat().st_size for p in Path(index_dir).iterdir())
    out = {"samples": len(index), "fingerprint": index.fingerprint, "scan_s": t1 - t0}
    return out | {"save_s": time.perf_counter() - t1, "file_bytes": saved}


def child_load(root: str, index_dir: str, traced: bool) -> dict:
    import gc
    import tracemalloc

    import numpy as np  # noqa: F401 - imported before the baseline, as a training script has

    from coordl import Index

    gc.collect()
    if traced:
        tracemalloc.start()
    m0, t0 = memory(), time.perf_counter()
    index = Index.scan(root, index_dir=index_dir)
    out = {"load_s": time.perf_counter() - t0, "samples": len(index), "fingerprint": index.fingerprint}
    gc.collect()
    out["after_load"] = delta(memory(), m0)
    if traced:
        return out | {"heap_bytes": tracemalloc.get_traced_memory()[0]}
    r, w = os.pipe()
    if (pid := os.fork()) == 0:  # the worker: walks every path and size, reports its memory's growth
        try:
            w0, t = memory(), time.perf_counter()
            paths, sizes = index.paths, index.sizes
            total = sum(len(paths[i]) + int(sizes[i]) for i in range(len(index)))
            walk = {"walk_s": time.perf_counter() - t, "worker_after_walk": delta(memory(), w0), "check": total}
            os.write(w, json.dumps(walk).encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        out.update(json.loads(f.read()))
    os.waitpid(pid, 0)
    return out


def measure(label: str, src: str, root: str, work: Path, loads: int) -> dict:
    index_dir = work / f"index-{label}"
    index_dir.mkdir()
    log(f"[{label}] scanning {root} with {src}")
    scan = fresh("index_scale", "--child", "scan", root, str(index_dir), src=src)
    runs = [fresh("index_scale", "--child", "load", root, str(index_dir), src=src) for _ in range(loads)]
    traced = fresh("index_scale", "--child", "traced", root, str(index_dir), src=src)
    if any(r["fingerprint"] != scan["fingerprint"] for r in runs + [traced]):
        raise SystemExit("a load scanned the tree again")
    best = min(runs, key=lambda r: r["load_s"])
    loaded = {"load_s": statistics.median(r["load_s"] for r in runs), "load_s_all": [r["load_s"] for r in runs]}
    walked = {k: best[k] for k in ("after_load", "walk_s", "worker_after_walk")}
    return {"src": src, **scan, **loaded, **walked, "heap_bytes": traced["heap_bytes"]}


def source_of(ref: str, work: Path) -> str:
    """The ``src/`` folder of commit ``ref`` of this repository, extracted under ``work``."""
    archive = subprocess.run(["git", "-C", str(dataset.ROOT), "archive", ref, "src"], capture_output=True, check=True)
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(work / f"src-{ref}", filter="data")
    return str(work / f"src-{ref}" / "src")


ROWS = {
    "scan s": lambda r: f"{r['scan_s']:.1f}",
    "save s": lambda r: f"{r['save_s']:.2f}",
    "saved file MB": lambda r: mb(r["file_bytes"]),
    "load s (median)": lambda r: f"{r['load_s']:.3f}",
    "process after load: RSS MB": lambda r: mb(r["after_load"]["rss"]),
    "process after load: anonymous MB": lambda r: mb(r["after_load"]["anon"]),
    "heap held by the index (tracemalloc) MB": lambda r: mb(r["heap_bytes"]),
    "forked worker: walk of every path and size s": lambda r: f"{r['walk_s']:.2f}",
    "forked worker: pages copied (private dirty) MB": lambda r: mb(r["worker_after_walk"]["dirty"]),
    "forked worker: USS growth MB": lambda r: mb(r["worker_after_walk"]["uss"]),
    "forked worker: RSS growth MB": lambda r: mb(r["worker_after_walk"]["rss"]),
}


def table(result: dict) -> str:
    runs = result["results"]
    return report.table(["", *runs], [[name, *(f(r) for r in runs.values())] for name, f in ROWS.items()])


def tree_options(p) -> None:
    """The tree's options, which :mod:`benchmarks.index_currency` shares."""
    p.add_argument("--data", default="/var/tmp/coordl-index-scale", help="where the tree is made")
    p.add_argument("--classes", type=int, default=1000)
    p.add_argument("--per-class", type=int, default=1281)
    p.add_argument("--loads", type=int, default=3, help="repetitions of each load, each in a fresh process")
    p.add_argument("--keep", action="store_true", help="keep the tree for another run")


def options(p) -> None:
    tree_options(p)
    p.add_argument("--before-ref", help="also measure the src/ of this commit (the format before)")
    p.add_argument("--child", nargs=3, help=argparse.SUPPRESS)  # WHAT ROOT INDEX_DIR: one measurement


def run(args) -> dict | None:
    if args.child:
        what, root, index_dir = args.child
        return jobs.say(
            **(child_scan(root, index_dir) if what == "scan" else child_load(root, index_dir, what == "traced"))
        )
    root, results, made_s = Path(args.data) / "train", {}, None
    with tempfile.TemporaryDirectory(dir="/var/tmp", prefix="coordl-index-scale-") as tmp:
        try:
            log(f"making {args.classes} x {args.per_class} files in {root}")
            made_s = make_tree(root, args.classes, args.per_class)
            if args.before_ref:
                src = source_of(args.before_ref, Path(tmp))
                results["before"] = measure("before", src, str(root), Path(tmp), args.loads)
            results["after"] = measure("after", str(dataset.ROOT / "src"), str(root), Path(tmp), args.loads)
        finally:
            if not args.keep:
                remove_tree(Path(args.data))
    tree = {"root": str(root), "files": args.classes * args.per_class, "made_s": made_s}
    return {"tree": tree, "before_ref": args.before_ref, "results": results}
