"""A process's attachment to the node's local-storage tier: reading entries, and the writer thread
that fills the tier and replaces its damaged and stale entries.

Invariants:

- **Never a torn sample.** A sample is written to ``tmp/<slot>.<pid>.<n>``, ``fdatasync``-ed, and
  published by ``link`` into its place, which fails if another process published it first: so
  every sample is stored once, and a reader sees a whole entry or none. What a killed writer leaves
  in ``tmp/`` is removed by the next process that takes its slot, or opens the tier alone.
- **Checked on read, replaced when wrong.** An entry is taken only if it is this user's private
  file whose header names the sample's size and stamp and whose bytes match their CRC-32
  (:func:`~coordl.fetch.disk.entries.judge`). A *stale* entry (another version of the sample) or a
  *damaged* one (cut, flipped, not private) is read from the store in that epoch and rewritten by
  the writer: moved aside (its blocks leave the ledger), then written anew, so the next epoch reads
  it from the tier. The fetcher counts them as ``disk_replaced`` and ``disk_repaired``.
- **Bounded**: see :mod:`~coordl.fetch.disk.ledger` (the budget, the floor kept free, the
  reservations). A full tier, the floor, a full disk or a quota (``ENOSPC``, ``EDQUOT``) stops this
  process's filling with one warning, and the run goes on.
- **No page cache.** Reads are followed by ``posix_fadvise(DONTNEED)`` (or bypass it with
  ``O_DIRECT``, ``Disk(direct=True)``), writes by ``fdatasync`` then ``DONTNEED``: the tier's bytes
  are not kept in memory twice, nor charged to a memory limit.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import queue
import threading

import numpy as np

from coordl import errors
from coordl.fetch.chain import copy_into
from coordl.fetch.disk.entries import DAMAGED, GOOD, HEADER, crc, entry_name, header, judge, private, walk, write_all
from coordl.fetch.disk.folder import make_dirs, open_folder
from coordl.fetch.disk.ledger import Ledger, footprint
from coordl.fetch.storage import read_whole

__all__ = ["QUEUE", "DiskTier"]

log = logging.getLogger(__name__)

QUEUE = 256  # samples waiting for the writer; a reader that would add more waits
_ALIGN = 4096  # O_DIRECT's alignment
_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_WRITE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


class DiskTier:
    """This process's attachment to a local-storage tier (see the module docstring).

    Args:
        folder: the tier's folder; made when missing (its parent must exist).
        size: the budget (bytes, or ``"auto"``: see :meth:`~coordl.fetch.disk.ledger.Ledger.open`).
        direct: read with ``O_DIRECT``.
        keep_free: what the tier leaves free on its file system (``"auto"``, bytes or a fraction).

    Raises:
        ForeignFolderError: the folder, or a file in it, is not this user's private object.
        ValueError: the folder's parent does not exist.
    """

    def __init__(
        self,
        folder: str,
        size: int | str = "auto",
        *,
        direct: bool = False,
        peers_first: bool = False,
        keep_free: int | float | str = "auto",
    ):
        self.folder = folder
        self.direct = direct
        self.peers_first = peers_first
        self.keep_free = keep_free
        self._opened = open_folder(folder, create=True)
        self._dir, self._tmp = self._opened.fd, self._opened.tmp
        self._ledger = Ledger(self._opened.ledger)
        self._block = os.fstatvfs(self._dir).f_frsize
        try:
            self._attach(size)
        except BaseException:
            self._opened.close()
            raise
        self._queue: queue.Queue = queue.Queue(maxsize=QUEUE)
        self._pending: dict[str, tuple[bytes, list]] = {}  # queued, not yet written: served from here
        self._pending_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._count = 0
        self.filling = True  # until the tier, its floor, the disk or a quota is full: then this process stops writing
        self.written = 0  # samples this process wrote into the tier (new, repaired or replaced)
        self.written_bytes = 0
        self.closed = False
        self._pid = os.getpid()

    def _attach(self, size) -> None:
        """Holds ``users`` (shared) and opens the ledger; alone with the tier, first removes what
        dead writers left in ``tmp/`` and sets the budget (:meth:`Ledger.open`)."""
        users = self._opened.users
        try:
            fcntl.flock(users, fcntl.LOCK_EX | fcntl.LOCK_NB)
            alone = True
        except BlockingIOError:
            fcntl.flock(users, fcntl.LOCK_SH)  # released by the kernel when this process ends
            alone = False
        if alone:  # every writer is gone: what they left in tmp/ is dead
            for name in os.listdir(self._tmp):
                _unlink(name, self._tmp)
        self._ledger.open(size, alone=alone, recount=self._recount)
        if alone:
            fcntl.flock(users, fcntl.LOCK_SH)

    @property
    def budget(self) -> int:
        """What the tier may hold now: what it holds, and the room its budget and floor leave."""
        return self._ledger.room(self.keep_free)

    def used(self) -> int:
        """Bytes the tier's entries and entry folders take on disk (every process's)."""
        return self._ledger.usage().used

    # -- reading --------------------------------------------------------------------------------
    def present(self, names) -> np.ndarray:
        """A mask of the samples (by path) that have an entry (checked when read), or that this
        process has queued for its writer."""
        with self._pending_lock:
            pending = [n in self._pending for n in names]
        return np.array([q or _exists(entry_name(n), self._dir) for q, n in zip(pending, names)], dtype=bool)

    def read_into(self, names, stamps: list[bytes], sizes, buffers) -> np.ndarray:
        """Reads sample ``k``'s entry into ``buffers[k]`` (a list of buffers of ``sizes[k]`` bytes in
        all): what was found for each (:data:`~coordl.fetch.disk.entries.GOOD`: read whole and
        checked; ``ABSENT``, ``STALE`` or ``DAMAGED``: left for the store, and for the writer to
        write with ``replace``)."""
        found = np.zeros(len(sizes), dtype=np.uint8)
        head = np.empty(1, HEADER)
        for k, name in enumerate(names):
            size = int(sizes[k])
            if self._from_pending(name, stamps[k], buffers[k]):
                found[k] = GOOD  # still in this process's writer queue: the bytes it will write
                continue
            try:
                fd = os.open(entry_name(name), _READ | (os.O_DIRECT if self.direct else 0), dir_fd=self._dir)
            except FileNotFoundError:
                continue  # ABSENT
            except OSError:
                found[k] = DAMAGED  # a link, or unreadable
                continue
            try:
                if not private(os.fstat(fd)):
                    got = -1
                elif self.direct:
                    got = self._read_direct(fd, head, buffers[k], size)
                else:
                    got = read_whole(fd, [memoryview(head).cast("B"), *buffers[k]], drop_page_cache=True)
            except OSError:
                got = -1
            finally:
                os.close(fd)
            found[k] = DAMAGED if got < 0 else judge(head, got, size, stamps[k], buffers[k])
        return found

    def _from_pending(self, name: str, stamp_: bytes, buffers: list) -> bool:
        with self._pending_lock:
            found = self._pending.get(name)
        if found is None or found[0] != stamp_:
            return False
        src = np.concatenate([np.frombuffer(v, np.uint8) for v in found[1]]) if len(found[1]) > 1 else found[1][0]
        copy_into(np.frombuffer(src, np.uint8) if not isinstance(src, np.ndarray) else src, buffers)
        return True

    def _read_direct(self, fd: int, head: np.ndarray, views: list, size: int) -> int:
        """One O_DIRECT read of the whole entry into an aligned buffer, then copied into place: the
        bytes read (one more than the entry holds when it is longer than it should be)."""
        total = HEADER.itemsize + size
        length = -(-(total + 1) // _ALIGN) * _ALIGN
        with mmap.mmap(-1, length) as scratch:  # page-aligned
            n = os.preadv(fd, [scratch], 0)
            _scatter(scratch, min(n, total), head, views)
        return n

    # -- filling ----------------------------------------------------------------------------------
    def put(self, names, stamps: list[bytes], data, replace=None) -> None:
        """Has the writer thread store these samples (their bytes must stay unchanged until written:
        cache views, or buffers of their own); ``replace[k]``: sample ``k`` has an entry that is stale
        or damaged, to be replaced. Waits while the writer's queue is full; does nothing once this
        process stopped filling."""
        if not self.filling or self.closed:
            return
        if self._thread is None or os.getpid() != self._pid:
            if os.getpid() != self._pid:  # a forked child: its own ledger handle, slot and writer
                self._pid = os.getpid()
                self._ledger = Ledger(os.open("ledger", os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self._dir))
            self._thread = threading.Thread(target=self._write_loop, name="coordl-disk", daemon=True)
            self._thread.start()
        replace = [False] * len(names) if replace is None else replace
        for name, stamp_, d, again in zip(names, stamps, data, replace, strict=True):
            views = d if isinstance(d, list) else [d]
            with self._pending_lock:
                self._pending[name] = (stamp_, views)
            self._queue.put((name, stamp_, views, bool(again)))

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

    def _write(self, name: str, stamp_: bytes, views: list, replace: bool) -> None:
        if self._ledger.slot is None and not self._claim():
            return
        rel = entry_name(name)
        if replace:
            self._remove(rel)  # the stale or damaged entry: its blocks leave the ledger first
        size = sum(len(v) for v in views)
        folders = os.path.dirname(rel)
        new_folders = not _exists(folders, self._dir)  # made under the reservation: at most 2 blocks
        want = footprint(HEADER.itemsize + size, self._block) + (2 * self._block if new_folders else 0)
        why, dead = self._ledger.reserve(want, self.keep_free)
        self._remove_files_of(dead)
        if why is not None:
            self._stop(why)
            return
        self._count += 1
        tmp = f"{self._ledger.slot}.{os.getpid()}.{self._count}"
        blocks = 0  # what the entry's file takes on disk, once written
        try:
            fd = os.open(tmp, _WRITE, 0o600, dir_fd=self._tmp)
            try:
                write_all(fd, [memoryview(header(size, stamp_, crc(views))).cast("B"), *views])
                os.fdatasync(fd)  # on disk before it is published; then its pages can be dropped
                blocks = os.fstat(fd).st_blocks * 512
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
            made = make_dirs(self._dir, folders) if new_folders else 0
            self._ledger.commit(want, blocks + made)  # the folders stay, whatever happens to the file
            want = 0
            if not self._publish(tmp, rel):
                self._ledger.add(-blocks)  # another process published it first: it is stored once
                return
            self.written += 1
            self.written_bytes += size
        except OSError as e:
            if want:
                self._ledger.cancel(want)
            else:
                self._ledger.add(-blocks)
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                self._stop(f"the disk is full ({e.strerror})")
                return
            raise
        finally:
            _unlink(tmp, self._tmp)

    def _publish(self, tmp: str, rel: str) -> bool:
        """Links the written file into place: False when an entry is there already."""
        try:
            os.link(tmp, rel, src_dir_fd=self._tmp, dst_dir_fd=self._dir, follow_symlinks=False)
            return True
        except FileExistsError:
            return False

    def _remove(self, rel: str) -> None:
        """Moves the entry at ``rel`` aside and removes it, taking its blocks out of the ledger (the
        move decides which process removed it, so that its blocks leave the ledger once)."""
        self._count += 1
        aside = f"{self._ledger.slot}.{os.getpid()}.{self._count}.old"
        try:
            os.rename(rel, aside, src_dir_fd=self._dir, dst_dir_fd=self._tmp)
        except FileNotFoundError:
            return  # another process removed it
        try:
            blocks = os.stat(aside, dir_fd=self._tmp, follow_symlinks=False).st_blocks * 512
        finally:
            _unlink(aside, self._tmp)
        self._ledger.add(-blocks)

    def _claim(self) -> bool:
        slot, left = self._ledger.claim()
        if slot is None:
            self._stop("every writer's slot of its ledger is taken by a running process")
            return False
        if left:
            self._remove_files_of([slot])
        return True

    def _remove_files_of(self, slots: list[int]) -> None:
        """Removes what the dead writers of ``slots`` left in ``tmp/``."""
        if slots:
            prefixes = tuple(f"{k}." for k in slots)
            for name in os.listdir(self._tmp):
                if name.startswith(prefixes) and not name.startswith(f"{self._ledger.slot}.{os.getpid()}."):
                    _unlink(name, self._tmp)

    def _stop(self, why: str) -> None:
        if self.filling:
            self.filling = False
            errors.warn(
                f"coordl: the local tier at {self.folder} stops filling: {why}. Samples it does not hold are "
                "read from the store in every epoch; the run goes on"
            )

    def _recount(self) -> int:
        """What the tier's entries and entry folders take on disk, counted from the folder."""
        return sum(st.st_blocks * 512 for _, st, _ in walk(self._dir))

    def close(self, timeout: float = 10.0) -> None:
        """Writes what is queued (at most ``timeout`` seconds), stops the writer. Idempotent."""
        if self.closed:
            return
        self.closed = True
        mine = self._thread is not None and os.getpid() == self._pid
        if mine and self._thread.is_alive():
            if not self.flush(timeout):
                self.filling = False  # what is still queued is left to the store
            try:
                self._queue.put(None, timeout=1.0)
            except queue.Full:
                pass
            self._thread.join(timeout=1.0)
            if self._thread.is_alive():
                return  # still in a write: its descriptors stay open for it (a closed number could be reused)
        if self._ledger.fd != self._opened.ledger:
            os.close(self._ledger.fd)
        self._opened.close()


def _scatter(scratch, n: int, head: np.ndarray, views: list) -> None:
    """Copies the first ``n`` bytes of ``scratch`` into ``head`` and then ``views`` (the views of
    ``scratch`` made here end with the call, so that it can be closed)."""
    data = np.frombuffer(scratch, np.uint8, n)
    memoryview(head).cast("B")[: min(n, HEADER.itemsize)] = data[: HEADER.itemsize]
    at = HEADER.itemsize
    for v in views:
        v = np.frombuffer(v, np.uint8) if not isinstance(v, np.ndarray) else v
        part = data[at : at + len(v)]
        v[: len(part)] = part
        at += len(v)


def _exists(rel: str, fd: int) -> bool:
    try:
        os.stat(rel, dir_fd=fd, follow_symlinks=False)
        return True
    except FileNotFoundError:
        return False


def _unlink(name: str, fd: int) -> None:
    try:
        os.unlink(name, dir_fd=fd)
    except FileNotFoundError:
        pass
