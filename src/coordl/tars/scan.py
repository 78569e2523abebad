"""The index of a dataset's shards: every shard's samples, in order, and whether a saved one is fresh.

Shards are indexed in parallel by worker processes (one per CPU this process may use, each a new
interpreter that imports only coordl, never the user's script) when there are at least
:data:`PARALLEL_SHARDS` of them per worker and no label function (a function may not survive the trip
to another interpreter). Reading the headers costs little I/O; parsing them is Python's.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import subprocess
import sys
import time

import numpy as np

from coordl.errors import ShardError
from coordl.paths import PathTable
from coordl.tars.format import IMAGE_EXTENSIONS, scan_shard
from coordl.tars.shards import Shards

__all__ = ["fresh", "index"]

log = logging.getLogger(__name__)

PROGRESS_S = 5.0  # seconds between progress lines while indexing in this process
PARALLEL_SHARDS = 16  # shards per worker process, at least, for the work to be split


def index(files: list[str], *, root, image=IMAGE_EXTENSIONS, label=None, skip: bool = False):
    """The :class:`~coordl.index.Index` of the samples of ``files``, in order, and each shard's
    ``[size, mtime_ns]`` (see :meth:`Index.from_tars <coordl.index.Index.from_tars>`).

    Raises:
        FileNotFoundError: a shard is missing, or the shards hold no sample.
        ShardError: see :func:`~coordl.tars.format.samples_of`.
    """
    from coordl.index import Index

    t0 = time.monotonic()
    workers = min(len(os.sched_getaffinity(0)), len(files) // PARALLEL_SHARDS)
    if label is None and workers > 1:
        scanned = _in_workers(files, list(image), skip, workers)
    else:
        scanned = _here(files, image, label, skip)
    paths, labels, sizes, of, offsets, stamps = [], [], [], [], [], []
    for k, (f, (names, lab, size, offset, stamp)) in enumerate(zip(files, scanned, strict=True)):
        paths += [f"{f}:{name}" for name in names]
        labels += lab
        sizes += size
        offsets += offset
        of += [k] * len(names)
        stamps.append(list(stamp))
    if not paths:
        raise FileNotFoundError(f"the {len(files)} shards ({files[0]}, ...) hold no sample")
    shards = Shards(PathTable.from_strings(files), np.array(of, dtype=np.int64), np.array(offsets, dtype=np.int64))
    log.info(
        "coordl: indexed %d samples in %d shards in %.1f s%s",
        len(paths),
        len(files),
        time.monotonic() - t0,
        f" ({workers} processes)" if label is None and workers > 1 else "",
    )
    return Index.build(paths, labels, sizes, (), root, shards=shards), stamps


def _one(f: str, image, label, skip: bool):
    """One shard's image members' names, labels, sizes and offsets, and its ``(size, mtime_ns)``."""
    try:
        found, stamp = scan_shard(f, image=image, label=label, skip=skip)
    except FileNotFoundError:
        raise FileNotFoundError(f"shard {f} does not exist") from None
    return (
        [s.image.name for s in found],
        [s.label for s in found],
        [s.image.size for s in found],
        [s.image.offset for s in found],
        stamp,
    )


def _here(files, image, label, skip):
    out, last, t0 = [], time.monotonic(), time.monotonic()
    for k, f in enumerate(files):
        out.append(_one(f, image, label, skip))
        if time.monotonic() - last >= PROGRESS_S:
            last = time.monotonic()
            log.info("coordl: indexed %d of %d shards (%.0f s)", k + 1, len(files), last - t0)
    return out


def _in_workers(files, image, skip, workers):
    """:func:`_one` of every shard, in ``workers`` processes of contiguous parts of ``files``."""
    parts = np.array_split(np.arange(len(files)), workers)
    env = dict(os.environ)
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # coordl's parent
    env["PYTHONPATH"] = os.pathsep.join([here, *filter(None, [env.get("PYTHONPATH")])])
    procs = []
    try:
        for part in parts:
            p = subprocess.Popen(
                [sys.executable, "-c", "from coordl.tars import scan; scan.worker()"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                env=env,
            )
            p.stdin.write(json.dumps({"files": [files[k] for k in part], "image": image, "skip": skip}).encode())
            p.stdin.close()
            procs.append(p)
        out = []
        for p in procs:
            data = p.stdout.read()
            if p.wait() != 0 or not data:
                raise RuntimeError(f"coordl: a process indexing tar shards failed (exit status {p.returncode})")
            for kind, value in pickle.loads(data):
                if kind == "ok":
                    out.append(value)
                    continue
                cls = {"ShardError": ShardError, "FileNotFoundError": FileNotFoundError}.get(kind, OSError)
                raise cls(value)
        return out
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def worker() -> None:
    """A worker process: scans the shards its stdin names (JSON), writes their scans to stdout
    (pickled), up to the first error, which it writes in their place."""
    job = json.loads(sys.stdin.buffer.read())
    logging.basicConfig(level=logging.WARNING, format="%(message)s")  # skipped samples, on stderr
    out = []
    for f in job["files"]:
        try:
            out.append(("ok", _one(f, tuple(job["image"]), None, job["skip"])))
        except (ShardError, OSError) as e:
            out.append((type(e).__name__, str(e)))
            break
    sys.stdout.buffer.write(pickle.dumps(out))


def fresh(files: list[str], stamps) -> bool:
    """Whether every shard of ``files`` still has the ``[size, mtime_ns]`` of ``stamps``."""
    if len(stamps) != len(files):
        return False
    for f, (size, mtime) in zip(files, stamps):
        try:
            st = os.stat(f)
        except OSError:
            return False
        if (st.st_size, st.st_mtime_ns) != (size, mtime):
            log.info("coordl: %s changed since the index was saved; indexing again", f)
            return False
    return True
