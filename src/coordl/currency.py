"""Whether a saved index still describes its dataset: every sample's size, modification time or ETag
as the store says it now, how many changed, and one check per machine at a time.

A saved index is reused while its tree's folders keep their modification times (:mod:`coordl.index`),
which a file rewritten in place does not change; nor does an object replaced under its key change
its store's prefixes. So each reuse asks the store once, when the index is loaded:

- files: a ``stat`` of every file, :data:`STAT_THREADS` at once (the calls overlap where the file
  system waits for its disk or its server; on a warm local disk, Python's share is a few µs a file);
- ``s3://``: the listing of the prefix by the index's rules (:func:`coordl.s3.listing.scan`: a
  request per thousand keys, the classes listed at once), or of the folders of a list of URLs
  (:func:`coordl.s3.listing.stat_known`).

A sample has changed when its size, modification time (ns) or ETag is not the index's. Not caught: a
file rewritten at the same size within its file system's timestamp granularity, or one whose
modification time was set back (``touch -d``, ``cp -p`` or ``rsync -t`` of other bytes).

Processes that load one saved index at once (the ranks of a node) take turns: an ``flock`` on
``index-<key>.lock`` beside it. One that had to wait for another's check, which began after this
process started, takes that check's result (recorded in the lock file, with the host and the version
it left) and asks the store nothing: what changed since that check began changed during this
process's run, where a read still catches a changed size (``DatasetChangedError``). A process that
did not wait (it started long before, or came after) checks for itself.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from coordl.paths import PathTable
from coordl.threads import daemon_pool

__all__ = ["STAT_THREADS", "Now", "Turn", "now_ns", "of_listing", "of_samples", "stat_files", "turn"]

STAT_THREADS = 32  # stat calls in flight at once (a cold disk or a network file system answers many at once)
CHUNK = 8192  # files a thread stats per task


@dataclass(frozen=True)
class Now:
    """What the store says of an index's samples now, in the index's order.

    Attributes:
        sizes: bytes of every sample's file or object (int64).
        mtimes: modification time in ns of every file (int64), or None for objects.
        etags: every object's ETag, or None for files.
        changed: samples whose size, modification time or ETag is not the index's.
    """

    sizes: np.ndarray
    mtimes: np.ndarray | None
    etags: PathTable | None
    changed: int


def stat_files(paths: PathTable, threads: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The size and modification time (ns) of every file of ``paths`` (int64 arrays; -1 for one that
    cannot be stat'ed: gone, or a folder on its way that cannot be searched), ``threads`` at a time
    (default :data:`STAT_THREADS`)."""
    threads = threads or STAT_THREADS
    n = len(paths)
    sizes, mtimes = np.full(n, -1, np.int64), np.full(n, -1, np.int64)

    def part(start: int) -> None:
        end = min(n, start + CHUNK)
        got_sizes, got_mtimes = [], []
        stat = os.stat
        for path in paths.encoded(np.arange(start, end)):
            try:
                st = stat(path)
            except OSError:
                got_sizes.append(-1)
                got_mtimes.append(-1)
                continue
            got_sizes.append(st.st_size)
            got_mtimes.append(st.st_mtime_ns)
        sizes[start:end], mtimes[start:end] = got_sizes, got_mtimes

    starts = range(0, n, CHUNK)
    if len(starts) <= 1:
        for s in starts:
            part(s)
    else:
        with daemon_pool(min(threads, len(starts)), "coordl-stat") as pool:
            list(pool.map(part, starts))
    return sizes, mtimes


def of_samples(index) -> Now | str:
    """Every sample of ``index`` (an :class:`~coordl.index.Index` of files, or of ``s3://`` URLs)
    as its store has it now; or why the index must be made again (a sentence: files or objects
    are gone, the first named).

    Raises:
        StoreError: the store refused the credentials, or there is no such bucket.
    """
    if index.etags is not None:
        from coordl.s3 import listing

        urls = list(index.paths)
        known = listing.stat_known(urls)
        gone = [u for u in urls if u not in known]
        if gone:
            return _gone(gone[0], len(gone))
        sizes = np.array([known[u][0] for u in urls], np.int64)
        return _compare(index, sizes, None, PathTable.from_strings([known[u][1] for u in urls]))
    sizes, mtimes = stat_files(index.paths)
    gone = np.flatnonzero(sizes < 0)
    if len(gone):
        return _gone(index.paths[int(gone[0])], len(gone))
    return _compare(index, sizes, mtimes, None)


def of_listing(index, urls: list[str], sizes: list[int], etags: list[str]) -> tuple[Now | str, int]:
    """An ``s3://`` index against a listing of its prefix by the same rules (``urls`` in its order),
    and how many listed keys it does not hold (added since it was saved: they stay out). A key of the
    index that the listing lacks: why the index must be made again (a sentence)."""
    listed = PathTable.from_strings(urls)
    if listed == index.paths:  # the usual case: the same keys, compared as two buffers
        return _compare(index, np.array(sizes, np.int64), None, PathTable.from_strings(etags)), 0
    at = {u: k for k, u in enumerate(urls)}
    where = [at.get(u, -1) for u in index.paths]
    gone = [index.paths[i] for i, k in enumerate(where) if k < 0]
    if gone:
        return _gone(gone[0], len(gone)), 0
    sizes_now = np.array([sizes[k] for k in where], np.int64)
    now = _compare(index, sizes_now, None, PathTable.from_strings([etags[k] for k in where]))
    return now, len(urls) - len(where)


def _gone(first: str, n: int) -> str:
    return f"{first} is gone" if n == 1 else f"{n} of its samples are gone ({first}, ...)"


def _compare(index, sizes: np.ndarray, mtimes: np.ndarray | None, etags: PathTable | None) -> Now:
    differ = sizes != index.sizes
    if mtimes is not None:
        differ |= True if index.mtimes is None else mtimes != index.mtimes
    if etags is not None:
        differ |= True if index.etags is None else _strings_differ(etags, index.etags)
    return Now(sizes, mtimes, etags, int(np.count_nonzero(differ)))


def _strings_differ(a: PathTable, b: PathTable) -> np.ndarray:
    """A mask of the entries that differ between two tables of as many strings."""
    if np.array_equal(a.offsets, b.offsets) and np.array_equal(a.blob, b.blob):
        return np.zeros(len(a), dtype=bool)
    la, lb = np.diff(a.offsets), np.diff(b.offsets)
    out = la != lb
    for i in np.flatnonzero(~out).tolist():
        out[i] = a[i] != b[i]
    return out


def now_ns() -> int:
    """The machine's boot clock (``CLOCK_BOOTTIME``), which every process of it shares, in ns."""
    return time.clock_gettime_ns(time.CLOCK_BOOTTIME)


def _started_ns() -> int | None:
    """When this process started, on :func:`now_ns`'s clock (``/proc/self/stat``'s start time)."""
    try:
        with open("/proc/self/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return int(fields[19]) * 1_000_000_000 // os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


class Turn:
    """This process's turn at checking one saved index (see :func:`turn`)."""

    def __init__(self, fd: int | None, last: dict | None, waited: bool = False):
        self._fd, self.last, self.waited = fd, last, waited

    def covers(self, version: str) -> bool:
        """Whether this process waited for a check on this host that began after this process
        started and left the saved index at ``version``: then that check is this run's."""
        r, started = self.last, _started_ns()
        return (
            self.waited
            and r is not None
            and started is not None
            and r.get("host") == socket.gethostname()
            and isinstance(r.get("began_ns"), int)
            and r["began_ns"] >= started
            and r.get("version") == version
        )

    @property
    def changed(self) -> int:
        """The samples the last check found changed."""
        return int((self.last or {}).get("changed", 0))

    def record(self, began_ns: int, version: str, changed: int) -> None:
        """Records a check that began at ``began_ns`` (:func:`now_ns`) and left the saved index at ``version``."""
        if self._fd is None:
            return
        data = json.dumps({"host": socket.gethostname(), "began_ns": began_ns, "version": version, "changed": changed})
        with contextlib.suppress(OSError):
            os.ftruncate(self._fd, 0)
            os.pwrite(self._fd, data.encode(), 0)


@contextlib.contextmanager
def turn(saved: str) -> Iterator[Turn]:
    """Holds the turn to check the saved index at ``saved`` (``index-<key>.idx``) among this
    machine's processes: an exclusive ``flock`` on ``index-<key>.lock``, the lock file made private
    (0600) and never followed through a link; where it cannot be made or locked (a read-only index
    folder, a file system without locks), every process checks for itself."""
    path = os.path.splitext(saved)[0] + ".lock"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    except OSError:
        yield Turn(None, None)
        return
    try:
        try:
            if os.fstat(fd).st_uid != os.getuid():  # another user's file: never trusted, never written
                raise PermissionError
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                waited = False
            except BlockingIOError:  # another process checks now
                fcntl.flock(fd, fcntl.LOCK_EX)  # released by the kernel if that process dies
                waited = True
        except OSError:
            yield Turn(None, None)
            return
        yield Turn(fd, _read(fd), waited)
    finally:
        os.close(fd)


def _read(fd: int) -> dict | None:
    """The record in a lock file, if there is a readable one."""
    try:
        last = json.loads(os.pread(fd, 4096, 0) or b"null")
    except (OSError, ValueError):
        return None
    return last if isinstance(last, dict) else None
