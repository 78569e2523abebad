"""The node's local-storage tier: samples of a dataset that lies elsewhere (``s3://``, a network
file system, another device), kept in a folder on local storage once read, for every later epoch,
job and run of the node.

CoorDL's own architecture ("if the data resides on a remote storage service, it is cached in local
storage when first accessed"), under the MinIO policy: what enters stays, the tier is filled once,
and it is never evicted (``coordl cache clean --disk PATH`` empties it). It lies under the memory
cache: a sample the memory cache misses is read from here when it is here, else from the store and
then written here, off the training path, by this process's writer thread.

Layout of the folder ``<path>/coordl-disk-<uid>/``: one file per sample, named by the SHA-256 of the
sample's path (``ab/cd/abcd...``), holding a :data:`HEADER` and the sample's bytes; ``ledger``, the
bytes the tier holds and its budget (changed under an ``flock``); ``users``, which every process
using the tier holds a shared ``flock`` on (``coordl cache clean --disk`` removes only a tier nobody
holds); ``tmp/``, files being written.
Two datasets that read the same objects share their entries.

Invariants:

- **Never a torn sample.** A sample is written to ``tmp/<pid>-<n>``, ``fdatasync``-ed, and
  published by ``link`` into its place, which fails if another process published it first: so
  every sample is stored once, and a reader sees a whole entry or none. What a killed writer leaves
  in ``tmp/`` is removed by the next process that opens the tier (its pid is gone).
- **Checked on read.** An entry is taken only if its header names the sample's size and *stamp*
  (the hash of its path, size and ETag: an object replaced in the store has another ETag, so its
  entry is stale and the sample is fetched again and its entry replaced) and its bytes match the
  CRC-32 written with them; else the sample is read from the store.
- **Bounded.** The ledger's budget (the folder's free space less :data:`MARGIN` when the first
  process made the tier, or ``Disk(size)``) is reserved before a sample is written; a full tier,
  or a full disk or a quota (``ENOSPC``, ``EDQUOT``), stops this process's filling with one warning,
  and the run goes on.
- **No page cache.** Reads are followed by ``posix_fadvise(DONTNEED)`` (or bypass it with
  ``O_DIRECT``, ``Disk(direct=True)``), writes by ``fdatasync`` then ``DONTNEED``: the tier's bytes
  are not kept in memory twice, nor charged to a memory limit.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import logging
import mmap
import os
import queue
import shutil
import threading
import zlib
from dataclasses import dataclass

import numpy as np

from coordl import errors

__all__ = ["HEADER", "MARGIN", "DiskSpec", "DiskTier", "describe", "keys", "remove", "spec_for", "tier_folder"]

log = logging.getLogger(__name__)

MAGIC = b"coordlds"
VERSION = 1
HEADER = np.dtype(
    [
        ("magic", "S8"),
        ("version", "<u4"),
        ("crc", "<u4"),  # zlib.crc32 of the sample's bytes
        ("size", "<u8"),
        ("stamp", "u1", (16,)),  # see stamp(); raw bytes (an "S16" field would drop trailing NULs)
        ("reserved", "V24"),
    ]
)  # 64 bytes
MARGIN = 0.05  # of the folder's file system left free by a budget of "auto"
QUEUE = 256  # samples waiting for the writer; a reader that would add more waits
_ALIGN = 4096  # O_DIRECT's alignment


def tier_folder(path: str) -> str:
    """The tier's folder inside ``path`` (one per user: its files are the user's)."""
    return os.path.join(os.path.abspath(os.fspath(path)), f"coordl-disk-{os.getuid()}")


def stamp(path: str, size: int, etag: str | None, mtime_ns: int | None = None) -> bytes:
    """16 bytes naming one version of a sample: its path, size, ETag (``""`` for a file) and the
    modification time in ns of the file it lies in (None for an object: its ETag names its version).
    An object's stamp is what it was before modification times were stamped, so entries stay valid."""
    text = f"{path}\0{size}\0{etag or ''}" + (f"\0{mtime_ns}" if mtime_ns is not None else "")
    return hashlib.sha256(text.encode("utf-8", "surrogateescape")).digest()[:16]


def keys(index, ids) -> tuple[list[str], list[bytes]]:
    """The tier's names (paths) and stamps of samples ``ids`` of ``index``: path, size, ETag and
    modification time (:attr:`Index.mtimes <coordl.index.Index.mtimes>`, which the index's check
    brings up to date when it is loaded), so that an entry of another version is stale."""
    ids = np.asarray(ids, dtype=np.int64)
    names = [index.paths[i] for i in ids.tolist()]
    sizes = index.sizes[ids].tolist()
    if index.etags is not None:
        etags = [index.etags[i] for i in ids.tolist()]
    elif index.shards is not None and index.shards.etags is not None:
        etags = [index.shards.etags[k] for k in index.shards.of[ids].tolist()]
    else:
        etags = [None] * len(names)
    mtimes = index.mtimes[ids].tolist() if index.mtimes is not None else [None] * len(names)
    return names, [stamp(*key) for key in zip(names, sizes, etags, mtimes, strict=True)]


def spec_for(disk, index) -> DiskSpec | None:
    """The tier a loader with ``Cache(disk=disk)`` (a :class:`~coordl.options.Disk`, or None) uses
    for ``index``: None without one, or (with a warning) when the dataset's files lie on the tier's
    own file system, where a copy would cost the disk and save nothing."""
    if disk is None:
        return None
    folder = tier_folder(disk.path)
    os.makedirs(folder, mode=0o700, exist_ok=True)
    if not index.in_store and len(index):
        first = index.location(0)[0]
        try:
            same = os.stat(first).st_dev == os.stat(folder).st_dev
        except OSError:
            same = False
        if same:
            errors.warn(
                f"coordl: Cache(disk={disk.path!r}) is on the file system of the dataset's files ({first}): the "
                "local tier would copy them next to themselves, so it is not used. It serves datasets that lie "
                "elsewhere: s3://, a network file system, another device"
            )
            return None
    return DiskSpec(folder, disk.size, disk.direct, disk.peers_first)


def _entry_name(path: str) -> str:
    h = hashlib.sha256(path.encode("utf-8", "surrogateescape")).hexdigest()[:32]
    return os.path.join(h[:2], h[2:4], h)


@dataclass(frozen=True)
class DiskSpec:
    """How a process opens the node's local-storage tier (picklable: worker processes open it too).

    Attributes:
        folder: the tier's folder (:func:`tier_folder`).
        size: its budget in bytes, or ``"auto"`` (the folder's free space less :data:`MARGIN`),
            used by the process that makes the tier.
        direct: read with ``O_DIRECT`` instead of dropping the pages behind each read.
        peers_first: ask the other nodes' memory caches before this tier.
    """

    folder: str
    size: int | str = "auto"
    direct: bool = False
    peers_first: bool = False

    def open(self) -> DiskTier:
        return DiskTier(self.folder, self.size, direct=self.direct, peers_first=self.peers_first)


class DiskTier:
    """This process's attachment to a local-storage tier (see the module docstring).

    Args:
        folder: the tier's folder; made when missing.
        size: the budget when this process makes the tier (bytes, or ``"auto"``).
        direct: read with ``O_DIRECT``.
    """

    def __init__(self, folder: str, size: int | str = "auto", *, direct: bool = False, peers_first: bool = False):
        self.folder = folder
        self.direct = direct
        self.peers_first = peers_first
        os.makedirs(os.path.join(folder, "tmp"), mode=0o700, exist_ok=True)
        self._users = os.open(os.path.join(folder, "users"), os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
        fcntl.flock(self._users, fcntl.LOCK_SH)  # released by the kernel when this process ends
        self._ledger = os.open(os.path.join(folder, "ledger"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        with self._locked():
            used, budget = self._read_ledger()
            if budget == 0:  # the first process decides the budget
                budget = int(size) if size != "auto" else _auto_budget(folder)
                self._write_ledger(used, budget)
        self.budget = budget
        self._remove_dead_writers()
        self._queue: queue.Queue = queue.Queue(maxsize=QUEUE)
        self._pending: dict[str, tuple[bytes, list]] = {}  # queued, not yet written: served from here
        self._pending_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._count = 0
        self.filling = True  # until the tier, the disk or a quota is full: then this process stops writing
        self.written = 0  # samples this process wrote into the tier
        self.written_bytes = 0
        self.closed = False
        self._pid = os.getpid()

    # -- reading --------------------------------------------------------------------------------
    def paths(self, names) -> list[str]:
        return [os.path.join(self.folder, _entry_name(n)) for n in names]

    def present(self, names) -> np.ndarray:
        """A mask of the samples (by path) that have an entry (checked again when read), or that
        this process has queued for its writer."""
        with self._pending_lock:
            pending = [n in self._pending for n in names]
        return np.array([q or os.path.exists(p) for q, p in zip(pending, self.paths(names))], dtype=bool)

    def read_into(self, names, stamps: list[bytes], sizes, buffers) -> np.ndarray:
        """Reads sample ``k``'s entry into ``buffers[k]`` (a list of buffers of ``sizes[k]`` bytes in
        all): a mask of those read whole and checked (header, stamp, size, CRC-32); the others (no
        entry, a stale or damaged one) are left for the store."""
        ok = np.zeros(len(sizes), dtype=bool)
        head = np.empty(1, HEADER)
        extra = bytearray(1)
        for k, path in enumerate(self.paths(names)):
            size = int(sizes[k])
            if self._from_pending(names[k], stamps[k], buffers[k]):
                ok[k] = True  # still in this process's writer queue: the bytes it will write
                continue
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | (os.O_DIRECT if self.direct else 0))
            except OSError:
                continue
            try:
                if self.direct:
                    got = self._read_direct(fd, head, buffers[k], size)
                else:
                    got = os.readv(fd, [memoryview(head).cast("B"), *buffers[k], extra]) == HEADER.itemsize + size
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            except OSError:
                got = False
            finally:
                os.close(fd)
            h = head[0]
            if not got or h["magic"] != MAGIC or h["version"] != VERSION or h["size"] != size:
                continue
            if h["stamp"].tobytes() != stamps[k] or _crc(buffers[k]) != int(h["crc"]):
                continue  # another version of the sample, or damaged: read from the store, written again
            ok[k] = True
        return ok

    def _from_pending(self, name: str, stamp_: bytes, buffers: list) -> bool:
        with self._pending_lock:
            found = self._pending.get(name)
        if found is None or found[0] != stamp_:
            return False
        src = np.concatenate([np.frombuffer(v, np.uint8) for v in found[1]]) if len(found[1]) > 1 else found[1][0]
        src = np.frombuffer(src, np.uint8) if not isinstance(src, np.ndarray) else src
        at = 0
        for b in buffers:
            b = np.frombuffer(b, np.uint8) if not isinstance(b, np.ndarray) else b
            b[:] = src[at : at + len(b)]
            at += len(b)
        return True

    def _read_direct(self, fd: int, head: np.ndarray, views: list, size: int) -> bool:
        """One O_DIRECT read of the whole entry into an aligned buffer, then copied into place."""
        total = HEADER.itemsize + size
        length = -(-(total + 1) // _ALIGN) * _ALIGN
        with mmap.mmap(-1, length) as scratch:  # page-aligned
            n = os.preadv(fd, [scratch], 0)
            if n != total:
                return False
            data = np.frombuffer(scratch, np.uint8, total)
            memoryview(head).cast("B")[:] = data[: HEADER.itemsize]
            at = HEADER.itemsize
            for v in views:
                v = np.frombuffer(v, np.uint8) if not isinstance(v, np.ndarray) else v
                v[:] = data[at : at + len(v)]
                at += len(v)
            del data
        return True

    # -- filling ----------------------------------------------------------------------------------
    def put(self, names, stamps: list[bytes], data) -> None:
        """Has the writer thread store these samples (their bytes must stay unchanged until written:
        cache views, or buffers of their own). Waits while the writer's queue is full; does nothing
        once this process stopped filling."""
        if not self.filling or self.closed:
            return
        if self._thread is None or os.getpid() != self._pid:
            self._pid = os.getpid()
            self._thread = threading.Thread(target=self._write_loop, name="coordl-disk", daemon=True)
            self._thread.start()
        for name, stamp_, d in zip(names, stamps, data, strict=True):
            views = d if isinstance(d, list) else [d]
            with self._pending_lock:
                self._pending[name] = (stamp_, views)
            self._queue.put((name, stamp_, views))

    def flush(self, timeout: float | None = None) -> bool:
        """Waits until every sample put so far is written (or given up); False at ``timeout``."""
        if self._thread is None:
            return True
        done = threading.Event()
        try:
            self._queue.put(done, timeout=timeout)
        except queue.Full:
            return False
        return done.wait(timeout)

    def _write_loop(self) -> None:
        from coordl import lifecycle

        lifecycle.quiet_thread()
        while True:
            item = self._queue.get()
            if item is None:
                return
            if isinstance(item, threading.Event):
                item.set()
                continue
            try:
                if self.filling:
                    self._write(*item)
            except Exception as e:  # noqa: BLE001 - a write that fails leaves the sample to the store
                log.warning("coordl: could not write sample %s into the local tier at %s: %s", item[0], self.folder, e)
            finally:
                with self._pending_lock:
                    if self._pending.get(item[0], (None, None))[1] is item[2]:
                        del self._pending[item[0]]

    def _write(self, name: str, stamp_: bytes, views: list) -> None:
        final = os.path.join(self.folder, _entry_name(name))
        stale = False
        try:
            with open(final, "rb") as f:
                h = np.frombuffer(f.read(HEADER.itemsize), HEADER)
            stale = len(h) == 1 and h[0]["stamp"].tobytes() != stamp_
            if not stale:
                return  # published by another process (or an earlier pass)
        except FileNotFoundError:
            pass
        size = sum(len(v) for v in views)
        if not self._reserve(size):
            return
        head = np.zeros(1, HEADER)
        head["magic"], head["version"], head["size"] = MAGIC, VERSION, size
        head["stamp"] = np.frombuffer(stamp_, np.uint8)
        head["crc"] = _crc(views)
        self._count += 1
        tmp = os.path.join(self.folder, "tmp", f"{os.getpid()}-{threading.get_ident()}-{self._count}")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            try:
                _write_all(fd, [memoryview(head).cast("B"), *views])
                os.fdatasync(fd)  # on disk before it is published; then its pages can be dropped
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
            os.makedirs(os.path.dirname(final), exist_ok=True)
            if stale:
                old = _size_of(final)
                os.replace(tmp, final)
                self._release(old)
            else:
                try:
                    os.link(tmp, final)
                except FileExistsError:  # another process published it first: it is stored once
                    self._release(size)
                    return
            self.written += 1
            self.written_bytes += size
        except OSError as e:
            self._release(size)
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                self._stop(f"the disk is full ({e.strerror})")
                return
            raise
        finally:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass

    def _reserve(self, size: int) -> bool:
        with self._locked():
            used, budget = self._read_ledger()
            if used + size > budget:
                full = True
            else:
                self._write_ledger(used + size, budget)
                full = False
        if full:
            self._stop(f"it holds its budget of {budget} bytes")
        return not full

    def _release(self, size: int) -> None:
        with self._locked():
            used, budget = self._read_ledger()
            self._write_ledger(max(0, used - size), budget)

    def _stop(self, why: str) -> None:
        if self.filling:
            self.filling = False
            errors.warn(
                f"coordl: the local tier at {self.folder} stops filling: {why}. Samples it does not hold are "
                "read from the store in every epoch; the run goes on"
            )

    # -- the ledger -------------------------------------------------------------------------------
    def used(self) -> int:
        """Bytes the tier holds (every process's entries)."""
        with self._locked():
            return self._read_ledger()[0]

    def _locked(self):
        tier = self

        class _Lock:
            def __enter__(self):
                fcntl.flock(tier._ledger, fcntl.LOCK_EX)

            def __exit__(self, *exc):
                fcntl.flock(tier._ledger, fcntl.LOCK_UN)

        return _Lock()

    def _read_ledger(self) -> tuple[int, int]:
        raw = os.pread(self._ledger, 16, 0)
        if len(raw) < 16:
            return 0, 0
        used, budget = np.frombuffer(raw, "<i8")
        return int(used), int(budget)

    def _write_ledger(self, used: int, budget: int) -> None:
        os.pwrite(self._ledger, np.array([used, budget], "<i8").tobytes(), 0)

    def _remove_dead_writers(self) -> None:
        """Removes what killed writers left in ``tmp/`` (files of processes that are gone)."""
        tmp = os.path.join(self.folder, "tmp")
        for name in os.listdir(tmp):
            pid = name.split("-", 1)[0]
            if pid.isdigit() and not _alive(int(pid)):
                try:
                    os.unlink(os.path.join(tmp, name))
                except FileNotFoundError:
                    pass

    def close(self, timeout: float = 10.0) -> None:
        """Writes what is queued (at most ``timeout`` seconds), stops the writer. Idempotent."""
        if self.closed:
            return
        self.closed = True
        if self._thread is not None and os.getpid() == self._pid and self._thread.is_alive():
            self.flush(timeout)
            try:
                self._queue.put(None, timeout=1.0)
            except queue.Full:
                pass
            self._thread.join(timeout=1.0)
        os.close(self._ledger)
        os.close(self._users)


def describe(path: str) -> tuple[int, int] | None:
    """The bytes the tier under ``path`` holds and its budget, or None when there is none."""
    ledger = os.path.join(tier_folder(path), "ledger")
    try:
        raw = open(ledger, "rb").read(16)
    except FileNotFoundError:
        return None
    if len(raw) < 16:
        return 0, 0
    used, budget = np.frombuffer(raw, "<i8")
    return int(used), int(budget)


def remove(path: str) -> bool | None:
    """Removes the tier under ``path``: True; False when a running process uses it; None when there is none."""
    folder = tier_folder(path)
    try:
        users = os.open(os.path.join(folder, "users"), os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        if not os.path.isdir(folder):
            return None
        shutil.rmtree(folder, ignore_errors=True)
        return True
    try:
        try:
            fcntl.flock(users, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        shutil.rmtree(folder)
        return True
    finally:
        os.close(users)


def _crc(views) -> int:
    crc = 0
    for v in views:
        crc = zlib.crc32(v, crc)
    return crc


def _write_all(fd: int, views: list) -> None:
    views = [memoryview(v).cast("B") for v in views]
    while views:
        n = os.writev(fd, views)
        while views and n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        if views and n:
            views[0] = views[0][n:]


def _size_of(path: str) -> int:
    try:
        return max(0, os.stat(path).st_size - HEADER.itemsize)
    except FileNotFoundError:
        return 0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _auto_budget(folder: str) -> int:
    usage = shutil.disk_usage(folder)
    return max(0, int(usage.free - MARGIN * usage.total))
