"""Trials of an HP group as the tests watch them: spawned processes that report each step on a pipe,
the group's shared records read by the test, and the locks a process holds.

A trial (:func:`trial`) sends ``("ask", t, n)`` before each ``next()`` (``n``: the batches it had
this epoch), ``("got", t)`` when it has the batch, ``("gone", t)`` when it is the one that finds a
dead member (coordl's warning), then ``("ok", result)`` or ``("error", traceback)``. The test adds
``("eof", t)`` when it sees the pipe closed: the kernel closes a trial's files when it ends, in the
same step as it drops the trial's ``flock`` s.
Times are ``time.monotonic()``: CLOCK_MONOTONIC, one clock for every process of the machine.
Each trial has its own pipe, so a trial killed in the middle of a message harms no other's.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import logging
import mmap
import os
import select
import struct
import threading
import time
import traceback
from multiprocessing.connection import wait

from coordl.shm import names
from coordl.staging.layout import CLAIMED, CONTROL_BYTES, group_fingerprint, records

GUARD_S = 120.0  # a guard against hanging forever, not a bound: no step of these tests comes near it


def trial(conn, root: str, group: str, epochs: int, start, loader) -> None:
    """Runs ``epochs`` epochs in ``group`` (started together with the others at the barrier ``start``);
    reports each step on ``conn``, then ids, image sums and stats per epoch."""
    lock = threading.Lock()  # the producer thread reports "gone", the main thread the rest

    def send(*msg):
        with lock:
            conn.send(msg)

    class Noticed(logging.Handler):  # called in the thread that logs, at once
        def emit(self, record):
            if "is gone" in record.getMessage():  # liveness.reap_dead: a member found dead, its claims given back
                send("gone", time.monotonic())

    logging.getLogger("coordl.staging.liveness").addHandler(Noticed(logging.WARNING))
    try:
        out = {"ids": [], "sums": [], "stats": []}
        with loader(root, hp_group=group) as ld:
            start.wait(GUARD_S)
            for e in range(epochs):
                ld.set_epoch(e)
                it = iter(ld)
                ids, sums = [], []
                while True:
                    send("ask", time.monotonic(), len(ids))  # asks for its batch number len(ids) of the epoch
                    batch = next(it, None)
                    if batch is None:
                        break
                    t = time.monotonic()
                    x, _, i = batch
                    ids.append(i.tolist())
                    sums.append(float(x.double().sum()))
                    x.mul_(0)  # a consumer's writes must not reach the other members
                    send("got", t)
                out["ids"].append(ids)
                out["sums"].append(sums)
                out["stats"].append(ld.stats())
        send("ok", out)
    except BaseException:  # noqa: BLE001 - reported to the test
        send("error", traceback.format_exc())


class Trials:
    """The test's side of the trials' pipes: every message, by pid, in the order received."""

    def __init__(self):
        self.conns: dict[int, object] = {}  # pid -> read end
        self.events: dict[int, list[tuple]] = {}
        self.results: dict[int, dict] = {}

    def add(self, pid: int, conn) -> None:
        self.conns[pid] = conn
        self.events[pid] = []

    def last(self, pid: int) -> str | None:
        ev = self.events[pid]
        return ev[-1][0] if ev else None

    def kinds(self, pid: int, kind: str) -> list[float]:
        return [e[1] for e in self.events[pid] if e[0] == kind]

    def tails(self) -> dict[int, list[str]]:
        return {pid: [e[0] for e in ev[-4:]] for pid, ev in self.events.items()}

    def forget(self, pid: int) -> None:
        """Stops reading ``pid``'s pipe (a killed trial's last message may be cut)."""
        self.conns.pop(pid).close()

    def pump(self, timeout: float) -> list[tuple[int, tuple]]:
        """Waits up to ``timeout`` for messages; returns those that came, as ``(pid, message)``."""
        got = []
        for conn in wait(list(self.conns.values()), timeout):
            pid = next(p for p, c in self.conns.items() if c is conn)
            try:
                msg = conn.recv()
            except EOFError:  # the trial's end closed its pipe: its locks were dropped in the same step
                self.events[pid].append(("eof", time.monotonic()))
                self.forget(pid)
                continue
            self.events[pid].append(msg)
            if msg[0] == "error":
                raise AssertionError(f"trial {pid} failed:\n{msg[1]}")
            if msg[0] == "ok":
                self.results[pid] = msg[1]
            got.append((pid, msg))
        return got

    def drain(self) -> list[tuple[int, tuple]]:
        """Every message already sent, without waiting."""
        got = []
        while more := self.pump(0):
            got += more
        return got

    def until(self, cond, what: str, guard: float = GUARD_S) -> None:
        """Reads messages until ``cond()`` holds (checked after each batch of messages)."""
        deadline = time.monotonic() + guard
        while not cond():
            left = deadline - time.monotonic()
            assert left > 0, f"guard ({guard:.0f} s) passed waiting for {what}; last messages: {self.tails()}"
            self.pump(left)

    def close(self) -> None:
        for pid in list(self.conns):
            self.forget(pid)


class Records:
    """The test's read-only view of an HP group's shared records (rank 0), read under the group's mutex."""

    def __init__(self, directory: str, group: str):
        fp = group_fingerprint(group, 0)
        self.directory = directory
        path = os.path.join(directory, names.segment_name(fp, "stage"))
        fd = os.open(path, os.O_RDONLY)
        try:
            self._mm = mmap.mmap(fd, CONTROL_BYTES, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        self.h, self.m, self.s = records(self._mm)
        self.mutex_path = os.path.join(directory, names.segment_name(fp, "mutex"))
        self._mutex = os.open(self.mutex_path, os.O_RDWR)  # no O_CREAT: it exists while members live
        self.fingerprint = fp

    @contextlib.contextmanager
    def locked(self):
        fcntl.flock(self._mutex, fcntl.LOCK_EX)
        try:
            yield self
        finally:
            fcntl.flock(self._mutex, fcntl.LOCK_UN)

    def member(self, pid: int) -> int:
        """The member index of live process ``pid``."""
        ks = [k for k in range(len(self.m)) if int(self.m[k]["state"]) == 1 and int(self.m[k]["pid"]) == pid]
        assert len(ks) == 1, f"pid {pid} is not one member of the group: {ks}"
        return ks[0]

    def claims(self, k: int) -> dict[int, int]:
        """The batches member ``k`` is making: ``{q: token}``."""
        s = self.s[: int(self.h["slots"])]
        return {int(r["q"]): int(r["token"]) for r in s if int(r["state"]) == CLAIMED and int(r["producer"]) == k}

    def member_file(self, k: int) -> str:
        return os.path.join(self.directory, names.segment_name(self.fingerprint, "member", k))

    def close(self) -> None:
        os.close(self._mutex)
        del self.h, self.m, self.s
        self._mm.close()


class Opens:
    """When processes open ``path`` (inotify ``IN_OPEN``), as read by a thread of the test: each
    look at a member's lock file (``liveness.is_dead``) opens it once."""

    IN_OPEN = 0x20
    EVENT = struct.Struct("iIII")  # wd, mask, cookie, len (a watched file's events have no name)

    def __init__(self, path: str):
        libc = ctypes.CDLL(None, use_errno=True)
        self.times: list[float] = []
        self._changed = threading.Condition()
        self._fd = libc.inotify_init1(os.O_CLOEXEC)
        if self._fd < 0 or libc.inotify_add_watch(self._fd, path.encode(), self.IN_OPEN) < 0:
            raise OSError(ctypes.get_errno(), f"inotify on {path}")
        self._stop_r, self._stop_w = os.pipe()
        self._thread = threading.Thread(target=self._read, name="test-inotify", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while True:
            ready, _, _ = select.select([self._fd, self._stop_r], [], [])
            if self._stop_r in ready:
                return
            data = os.read(self._fd, 4096)
            t = time.monotonic()
            off = 0
            while off < len(data):
                _, mask, _, n = self.EVENT.unpack_from(data, off)
                off += self.EVENT.size + n
                if mask & self.IN_OPEN:
                    with self._changed:
                        self.times.append(t)
                        self._changed.notify_all()

    def after(self, t: float) -> list[float]:
        with self._changed:
            return [x for x in self.times if x > t]

    def wait_for(self, n: int, after: float, what: str, guard: float = GUARD_S) -> None:
        """Waits until ``path`` was opened ``n`` times after ``after``."""
        with self._changed:
            ok = self._changed.wait_for(lambda: sum(x > after for x in self.times) >= n, guard)
        assert ok, f"guard ({guard:.0f} s) passed waiting for {what}"

    def close(self) -> None:
        os.write(self._stop_w, b"x")
        self._thread.join()
        for fd in (self._fd, self._stop_r, self._stop_w):
            os.close(fd)


def exclusive_flocks(pid: int) -> set[int]:
    """Inodes of the files on which process ``pid`` holds an exclusive ``flock`` (from /proc/locks)."""
    held = set()
    with open("/proc/locks") as f:
        for line in f:
            fields = line.split()
            if "->" in fields:  # a request still waiting, not a lock held
                continue
            # "1: FLOCK  ADVISORY  WRITE 1234 00:2d:5678 0 EOF"
            if fields[1] == "FLOCK" and fields[3] == "WRITE" and int(fields[4]) == pid:
                held.add(int(fields[5].split(":")[2]))
    return held
