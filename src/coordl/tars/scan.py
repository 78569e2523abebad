"""The index of a dataset's shards: every shard's samples, in order, and whether a saved one is fresh.

Local shards are indexed in parallel by worker processes (one per CPU this process may use, each a new
interpreter that imports only coordl, never the user's script) when there are at least
:data:`PARALLEL_SHARDS` of them per worker and no label function (a function may not survive the trip
to another interpreter). Reading the headers costs little I/O; parsing them is Python's. ``s3://``
shards are indexed by :data:`S3_SHARDS` threads at once, each reading one shard's headers by range
GETs, or the shard streamed where its members are small (:func:`~coordl.tars.format.scan_object`).
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

from coordl import cpus
from coordl.errors import DatasetChangedError, ShardError
from coordl.paths import PathTable
from coordl.s3 import url as s3url
from coordl.tars.format import IMAGE_EXTENSIONS, JSON, scan_object, scan_shard
from coordl.tars.shards import Shards
from coordl.threads import daemon_pool

__all__ = ["index", "made_from"]

log = logging.getLogger(__name__)

PROGRESS_S = 5.0  # seconds between progress lines while indexing in this process
PARALLEL_SHARDS = 16  # shards per worker process, at least, for the work to be split
S3_SHARDS = 32  # s3:// shards indexed at once
IO_THREADS = 16  # local shards indexed at once by a process (their reads overlap; the parsing holds the GIL)


def made_from(files: list[str]) -> list[list]:
    """What an index of the shards is made from, which says that a shard is unchanged: ``[size,
    mtime_ns]`` of a file, ``[size, ETag]`` of an ``s3://`` object (one listing request per thousand
    shards of a prefix).

    Raises:
        FileNotFoundError: a shard is missing.
        StoreError: the store refused the credentials, or there is no such bucket.
    """
    if files and s3url.is_url(files[0]):
        from coordl.s3 import listing

        try:
            sizes, etags = listing.stat_many(files)
        except FileNotFoundError as e:
            raise FileNotFoundError(str(e).replace("sample ", "shard ", 1)) from None
        return [[s, e] for s, e in zip(sizes, etags)]
    out = []
    for f in files:
        try:
            st = os.stat(f)
        except FileNotFoundError:
            raise FileNotFoundError(f"shard {f} does not exist") from None
        out.append([st.st_size, st.st_mtime_ns])
    return out


def index(files: list[str], made: list[list], *, image=IMAGE_EXTENSIONS, label=None, skip=False, stream=None):
    """The samples of ``files``, in order, whose :func:`made_from` is ``made``: their paths
    (``<shard>:<member>``), labels, sizes and :class:`Shards`, what :meth:`Index.from_tars
    <coordl.index.Index.from_tars>` builds an index of; ``stream``: how ``s3://`` shards are read
    (:func:`~coordl.tars.format.scan_object`).

    Raises:
        FileNotFoundError: a shard is missing, or the shards hold no sample.
        ShardError: see :func:`~coordl.tars.format.samples_of`.
        DatasetChangedError: a shard changed while it was indexed.
    """
    t0 = time.monotonic()
    in_store = bool(files) and s3url.is_url(files[0])
    by_name = label is None or label == JSON  # a label function may not survive the trip to a worker
    workers = 0 if in_store or not by_name else min(cpus.available(), len(files) // PARALLEL_SHARDS)
    if in_store:
        scanned = _from_store(files, made, image, label, skip, stream)
    elif workers > 1:
        scanned = _in_workers(files, list(image), skip, workers, label)
    else:
        scanned = _here(files, image, label, skip)
    paths, labels, sizes, of, offsets, moved = [], [], [], [], [], 0
    for k, (f, (names, lab, size, offset, seen)) in enumerate(zip(files, scanned, strict=True)):
        paths += [f"{f}:{name}" for name in names]
        labels += lab
        sizes += size
        offsets += offset
        of += [k] * len(names)
        moved += seen if in_store else 0
        if not in_store and list(seen) != list(made[k]):
            raise DatasetChangedError(f"{f} changed while it was indexed; index it again")
    if not paths:
        raise FileNotFoundError(f"the {len(files)} shards ({files[0]}, ...) hold no sample")
    etags = PathTable.from_strings([str(s[1]) for s in made]) if in_store else None
    shards = Shards(
        PathTable.from_strings(files), np.array(of, dtype=np.int64), np.array(offsets, dtype=np.int64), etags
    )
    how = f" ({workers} processes)" if workers > 1 else ""
    if in_store:
        total = sum(int(s[0]) for s in made)
        way = {True: "streamed", False: "headers by range GETs", None: "range GETs or streamed, per shard"}[stream]
        how = f" ({moved / 1e6:.1f} MB read of {total / 1e6:.1f} MB, {way})"
    log.info("coordl: indexed %d samples in %d shards in %.1f s%s", len(paths), len(files), time.monotonic() - t0, how)
    return paths, labels, sizes, shards


def _one(f: str, image, label, skip: bool):
    """One shard's image members' names, labels, sizes and offsets, and its ``(size, mtime_ns)``."""
    try:
        found, seen = scan_shard(f, image=image, label=label, skip=skip)
    except FileNotFoundError:
        raise FileNotFoundError(f"shard {f} does not exist") from None
    return _columns(found, seen)


def _columns(found, extra):
    return (
        [s.image.name for s in found],
        [s.label for s in found],
        [s.image.size for s in found],
        [s.image.offset for s in found],
        extra,
    )


def _from_store(files, made, image, label, skip, stream):
    """:func:`_one` of every ``s3://`` shard (with the bytes it moved in place of its size and mtime)."""

    def one(k):
        found, moved = scan_object(
            files[k], int(made[k][0]), str(made[k][1]), stream=stream, image=image, label=label, skip=skip
        )
        return _columns(found, moved)

    with daemon_pool(min(S3_SHARDS, len(files)), "coordl-tar-index") as pool:
        return list(pool.map(one, range(len(files))))


def _here(files, image, label, skip):
    """:func:`_one` of every shard, :data:`IO_THREADS` shards at once."""
    out, last, t0 = [], time.monotonic(), time.monotonic()
    for k, scanned in enumerate(_threaded(files, lambda f: _one(f, image, label, skip))):
        out.append(scanned)
        if time.monotonic() - last >= PROGRESS_S:
            last = time.monotonic()
            log.info("coordl: indexed %d of %d shards (%.0f s)", k + 1, len(files), last - t0)
    return out


def _threaded(files, scan):
    """``scan(f)`` of every shard, in order, :data:`IO_THREADS` at once: a shard's headers are read
    one after the other, each wherever the last member ended, so with a cold page cache a shard's
    scan waits for the device at every member; shards scanned together keep it busy."""
    if len(files) == 1:
        yield scan(files[0])
        return
    pool = daemon_pool(min(IO_THREADS, len(files)), "coordl-tar-index")
    try:
        yield from pool.map(scan, files)
    finally:  # a bad shard: the shards not begun are not scanned
        pool.shutdown(wait=True, cancel_futures=True)


def _in_workers(files, image, skip, workers, label=None):
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
            job = {"files": [files[k] for k in part], "image": image, "skip": skip, "label": label}
            p.stdin.write(json.dumps(job).encode())
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

    def scan(f):
        try:
            return "ok", _one(f, tuple(job["image"]), job.get("label"), job["skip"])
        except (ShardError, OSError) as e:
            return type(e).__name__, str(e)

    out = []
    for kind, value in _threaded(job["files"], scan):
        out.append((kind, value))
        if kind != "ok":
            break
    sys.stdout.buffer.write(pickle.dumps(out))
