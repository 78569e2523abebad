"""An ImageNet-sized index: scan, save and load times, and the index's memory per process.

Makes a tree of ``--classes`` x ``--per-class`` tiny ``.jpg`` files (1000 x 1281 = 1,281,000
by default, a few bytes each: the scan reads sizes, not contents) in ``--data``, then, for
this checkout's ``src/`` and (with ``--before-ref``) the ``src/`` of an earlier commit, each
step in a fresh Python:

- ``scan``: listing the tree (``coordl.index._scan``) and saving the index (``_save``);
- ``load``: ``Index.scan(root)`` finding the saved index fresh (``--loads`` times, median);
  the process's memory before and after (``/proc/self/smaps_rollup``: RSS, PSS and USS, the
  private pages), and the heap the index holds (``tracemalloc``, in a separate load);
- ``walk``: a forked child (as a ``DataLoader`` worker is) reads ``index.paths[i]`` and
  ``index.sizes[i]`` of every sample; its USS before and after is the memory the walk
  copied out of the parent (pytorch/pytorch#13246).

Deletes the tree and the saved indexes at the end (``--keep`` keeps the tree for another run).

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
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from benchmarks.harness import dataset, jobs
from benchmarks.harness.report import mb

# -- the tree ---------------------------------------------------------------------------------
MARK = ".made-by-index-scale"  # in a tree this script made (and may delete); its size once complete


def make_tree(root: Path, classes: int, per_class: int) -> float:
    """Writes the tree (ImageNet's names: ``n<8 digits>/n<8 digits>_<i>.jpg``) unless a complete
    one is there; returns the seconds it took (0 for a tree made by an earlier ``--keep`` run)."""
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
        name = f"n{c:08d}"
        folder = root / name
        folder.mkdir()
        for i in range(per_class):
            fd = os.open(folder / f"{name}_{i}.jpg", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            os.write(fd, b"\xff\xd8" + b"x" * (i % 13))
            os.close(fd)
    mark.write_text(f"{classes} {per_class}")
    return time.perf_counter() - t0


def remove_tree(data: Path, root: Path) -> None:
    """Deletes the tree if this script made it, then ``data`` if that leaves it empty."""
    if (root / MARK).exists():
        shutil.rmtree(root)
    with contextlib.suppress(OSError):
        data.rmdir()


# -- measured in a child ----------------------------------------------------------------------
def memory() -> dict:
    """This process's memory in bytes (``/proc/self/smaps_rollup``): ``rss``; ``pss``; ``uss``, the
    pages only it maps (private clean + dirty: clean ones include page-cache pages of a file
    no other process maps now, which are no copy); ``dirty``, private dirty pages (its heap,
    and the pages a forked child copied by writing them); ``anon``, anonymous memory."""
    f = {}
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines()[1:]:
        key, value = line.split(":", 1)
        f[key] = int(value.split()[0]) * 1024
    out = {"rss": f["Rss"], "pss": f["Pss"], "uss": f["Private_Clean"] + f["Private_Dirty"]}
    return out | {"dirty": f["Private_Dirty"], "anon": f["Anonymous"]}


def delta(after: dict, before: dict) -> dict:
    return {k: after[k] - before[k] for k in after}


def child_scan(root: str, index_dir: str) -> dict:
    # The private functions, to time listing and saving apart (saving in coordl.saved since the index
    # checks its files when it is loaded; in coordl.index before).
    from coordl import index as ix

    try:
        from coordl.saved import save, tree_path
    except ImportError:
        save, tree_path = ix._save, ix._saved_path
    t0 = time.perf_counter()
    index, dirs = ix._scan(root, ix.IMG_EXTENSIONS)
    t1 = time.perf_counter()
    save(index, dirs, tree_path(index_dir, root, ix.IMG_EXTENSIONS))
    t2 = time.perf_counter()
    saved = sum(p.stat().st_size for p in Path(index_dir).iterdir())
    out = {"samples": len(index), "fingerprint": index.fingerprint, "scan_s": t1 - t0, "save_s": t2 - t1}
    return out | {"file_bytes": saved}


def child_load(root: str, index_dir: str, traced: bool) -> dict:
    import gc
    import tracemalloc

    import numpy as np  # noqa: F401 - imported before the baseline, as a training script has

    from coordl import Index

    gc.collect()
    if traced:
        tracemalloc.start()
    m0 = memory()
    t0 = time.perf_counter()
    index = Index.scan(root, index_dir=index_dir)
    t1 = time.perf_counter()
    gc.collect()
    out = {
        "load_s": t1 - t0,
        "samples": len(index),
        "fingerprint": index.fingerprint,
        "after_load": delta(memory(), m0),
    }
    if traced:
        out["heap_bytes"] = tracemalloc.get_traced_memory()[0]
        return out
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the worker: walks every path and size, reports its memory growth
        os.close(r)
        try:
            w0 = memory()
            t = time.perf_counter()
            total = 0
            paths, sizes = index.paths, index.sizes
            for i in range(len(index)):
                total += len(paths[i]) + int(sizes[i])
            walk = {"walk_s": time.perf_counter() - t, "worker_after_walk": delta(memory(), w0), "check": total}
            os.write(w, json.dumps(walk).encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        out.update(json.loads(f.read()))
    os.waitpid(pid, 0)
    return out


# -- the runner -------------------------------------------------------------------------------
def run_child(src: str, *args: str) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([src, str(dataset.ROOT)]))
    return jobs.run_json(jobs.scenario_command("index_scale", *args), env=env, cwd=dataset.ROOT)


def measure(label: str, src: str, root: str, work: Path, loads: int) -> dict:
    index_dir = work / f"index-{label}"
    index_dir.mkdir()
    print(f"[{label}] scanning {root} with {src}", file=sys.stderr)
    scan = run_child(src, "--child", "scan", root, str(index_dir))
    runs = [run_child(src, "--child", "load", root, str(index_dir)) for _ in range(loads)]
    traced = run_child(src, "--child", "traced", root, str(index_dir))
    assert all(r["fingerprint"] == scan["fingerprint"] for r in runs + [traced]), "a load rescanned"
    best = min(runs, key=lambda r: r["load_s"])
    shutil.rmtree(index_dir)
    loaded = {"load_s": statistics.median(r["load_s"] for r in runs), "load_s_all": [r["load_s"] for r in runs]}
    walked = {k: best[k] for k in ("after_load", "walk_s", "worker_after_walk")}
    return {"src": src, **scan, **loaded, **walked, "heap_bytes": traced["heap_bytes"]}


def source_of(ref: str, work: Path) -> str:
    """The ``src/`` folder of commit ``ref`` of this repository, extracted under ``work``."""
    out = work / f"src-{ref}"
    archive = subprocess.run(["git", "-C", str(dataset.ROOT), "archive", ref, "src"], capture_output=True, check=True)
    out.mkdir()
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(out, filter="data")
    return str(out / "src")


def table(result: dict) -> str:
    results = result["results"]
    rows = [
        ("scan s", lambda r: f"{r['scan_s']:.1f}"),
        ("save s", lambda r: f"{r['save_s']:.2f}"),
        ("saved file MB", lambda r: mb(r["file_bytes"])),
        ("load s (median)", lambda r: f"{r['load_s']:.3f}"),
        ("process after load: RSS MB", lambda r: mb(r["after_load"]["rss"])),
        ("process after load: anonymous MB", lambda r: mb(r["after_load"]["anon"])),
        ("heap held by the index (tracemalloc) MB", lambda r: mb(r["heap_bytes"])),
        ("forked worker: walk of every path and size s", lambda r: f"{r['walk_s']:.2f}"),
        ("forked worker: pages copied (private dirty) MB", lambda r: mb(r["worker_after_walk"]["dirty"])),
        ("forked worker: USS growth MB", lambda r: mb(r["worker_after_walk"]["uss"])),
        ("forked worker: RSS growth MB", lambda r: mb(r["worker_after_walk"]["rss"])),
    ]
    labels = list(results)
    lines = ["| | " + " | ".join(labels) + " |", "|---" * (len(labels) + 1) + "|"]
    lines += [f"| {name} | " + " | ".join(cell(results[k]) for k in labels) + " |" for name, cell in rows]
    return "\n".join(lines)


def options(p) -> None:
    p.add_argument("--child", nargs=3, help=argparse.SUPPRESS)  # WHAT ROOT INDEX_DIR: one measurement
    p.add_argument("--data", default="/var/tmp/coordl-index-scale", help="where the tree is made")
    p.add_argument("--classes", type=int, default=1000)
    p.add_argument("--per-class", type=int, default=1281)
    p.add_argument("--loads", type=int, default=3, help="loads of the saved index, each in a fresh process")
    p.add_argument("--before-ref", help="also measure the src/ of this commit (the format before)")
    p.add_argument("--keep", action="store_true", help="keep the tree for another run")


def run(args) -> dict | None:
    if args.child:
        what, root, index_dir = args.child
        measured = child_scan(root, index_dir) if what == "scan" else child_load(root, index_dir, what == "traced")
        return jobs.say(**measured)
    root = Path(args.data) / "train"
    results, made_s = {}, None
    with tempfile.TemporaryDirectory(dir="/var/tmp", prefix="coordl-index-scale-") as tmp:
        work = Path(tmp)
        try:
            print(f"making {args.classes} x {args.per_class} files in {root}", file=sys.stderr)
            made_s = make_tree(root, args.classes, args.per_class)
            if args.before_ref:
                results["before"] = measure("before", source_of(args.before_ref, work), str(root), work, args.loads)
            results["after"] = measure("after", str(dataset.ROOT / "src"), str(root), work, args.loads)
        finally:
            if not args.keep:
                remove_tree(Path(args.data), root)
    tree = {"root": str(root), "files": args.classes * args.per_class, "made_s": made_s}
    return {"tree": tree, "before_ref": args.before_ref, "results": results}
