"""Shared-memory primitives: names, modes, group membership and the reaper, with real processes.

Liveness is the kernel's (a shared ``flock`` per attached process), so these tests
attach from spawned processes and end them with ``SIGKILL``.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import random
import signal
import stat
import threading
import time
import traceback

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from childproc import report, result
from coordl.fetch import cache as cache_module
from coordl.fetch.cache import NodeCache
from coordl.shm import group, names, own, reaper
from coordl.staging.area import StagingArea

CTX = multiprocessing.get_context("spawn")
FP = "5eed5eed5eed5eed"
FP_DEAD = "deadbeefdeadbeef"
FP_LIVE = "a11ce0a11ce0a11c"
WAIT = 30


def files_of(directory, fp: str) -> list[str]:
    return sorted(e for e in os.listdir(directory) if (p := names.parse_name(e)) is not None and p[0] == fp)


def kill9(p) -> None:
    os.kill(p.pid, signal.SIGKILL)
    p.join(WAIT)
    assert p.exitcode == -signal.SIGKILL


# -- names ------------------------------------------------------------------------------------
def test_segment_name_and_parse_name():
    assert names.segment_name(FP, "table") == f"coordl.{FP}.table"
    assert names.segment_name(FP, "chunk", 3) == f"coordl.{FP}.chunk.3"
    assert names.parse_name(f"coordl.{FP}.chunk.3") == (FP, "chunk", "3")
    assert names.parse_name(f"coordl.{FP}.lock") == (FP, "lock", None)
    for foreign in (
        "coordl",
        f"coordl.{FP}",
        f"coordl.{FP}.nosuchkind",
        f"other.{FP}.table",
        f"coordl.{FP.upper()}.table",
        "coordl.abc.table",
        f"coordl.{FP}.chunk.3/x",
        "sem.mp-1234",
    ):
        assert names.parse_name(foreign) is None, foreign
    with pytest.raises(ValueError, match="fingerprint"):
        names.segment_name("not-hex!", "table")
    with pytest.raises(ValueError, match="fingerprint"):
        names.segment_name("abc", "table")  # too short to be one
    with pytest.raises(ValueError, match="kind"):
        names.segment_name(FP, "bogus")


def test_shm_dir_follows_the_environment(isolated, monkeypatch):
    assert names.shm_dir() == str(isolated)
    monkeypatch.delenv("COORDL_SHM_DIR")
    assert names.shm_dir() == "/dev/shm"


@given(
    fp=st.text("0123456789abcdef", min_size=8, max_size=64),
    kind=st.sampled_from(sorted(names.KINDS)),
    ident=st.none() | st.integers(0, 10**9) | st.text("abcXYZ019_-", min_size=1, max_size=12),
)
def test_names_round_trip(fp, kind, ident):
    name = names.segment_name(fp, kind, ident)
    assert name.startswith(f"{names.PREFIX}.")
    assert names.parse_name(name) == (fp, kind, None if ident is None else str(ident))


# -- 7. modes and names of everything in the shm folder -------------------------------------------
def test_every_segment_is_private_and_named_by_the_one_function(isolated, cache_layout):
    sizes = np.full(40, 700)
    cache_layout(4096)
    old = os.umask(0)  # the most permissive umask must not widen anything
    try:
        cache = NodeCache(FP, sizes, 20_000, keep=True, directory=str(isolated))
        area = StagingArea(
            "sweep",
            0,
            {},
            batch_size=2,
            batches_per_pass=5,
            sample_shape=(3, 4, 4),
            dtype="uint8",
            epoch=0,
            bound=4 * 4096,
            directory=str(isolated),
        )
    finally:
        os.umask(old)
    try:
        for i in range(40):
            views = cache.reserve_many([i])[0]
            if views is None:
                continue
            for v in views:
                v[:] = i
            cache.publish_many([i])
        entries = os.listdir(isolated)
        kinds = set()
        for e in entries:
            mode = os.stat(os.path.join(isolated, e)).st_mode
            assert stat.S_ISREG(mode), e
            assert stat.S_IMODE(mode) == 0o600, f"{e} has mode {oct(stat.S_IMODE(mode))}"
            parsed = names.parse_name(e)
            assert parsed is not None, f"{e} is not named by names.segment_name"
            fp, kind, ident = parsed
            assert fp in (FP, area.fingerprint) and kind in names.KINDS
            assert names.segment_name(fp, kind, ident) == e
            kinds.add(kind)
        assert kinds == set(names.KINDS)  # every kind a cache or a staging area makes is listed, and seen here
        assert sum(1 for e in entries if names.parse_name(e)[1] == "chunk") == 5
        (info,) = [g for g in reaper.list_groups(str(isolated)) if g.fingerprint == FP]
        mine = [e for e in entries if names.parse_name(e)[0] == FP]
        assert (info.fingerprint, info.files, info.in_use, info.keep) == (FP, len(mine), True, True)
        assert set(info.kinds) == {names.parse_name(e)[1] for e in mine}
    finally:
        cache.close()
        area.close()
    assert reaper.reap(str(isolated)) == []  # kept
    (removed,) = reaper.reap(str(isolated), include_kept=True)
    assert removed.fingerprint == FP and removed.keep
    assert os.listdir(isolated) == []


def test_reaper_ignores_files_that_are_not_coordls(isolated):
    foreign = ["sem.mp-1234", "coordl.nothex.table", f"coordl.{FP}.unknownkind", "torch_1234_5678"]
    for e in foreign:
        with open(os.path.join(isolated, e), "w"):
            pass
    try:
        assert reaper.list_groups(str(isolated)) == []
        assert reaper.reap(str(isolated), include_kept=True) == []
        assert sorted(os.listdir(isolated)) == sorted(foreign)
    finally:
        for e in foreign:
            os.unlink(os.path.join(isolated, e))


# -- 5c. the reaper after kill -9 ------------------------------------------------------------------
def _cache_user(directory, fp, role, ready, release, q):
    """Opens a cache; fills some items, or leaves one half-written, then waits to be killed or released."""

    def body():
        sizes = np.arange(100, 140)
        cache_module.DEFAULT_CHUNK_BYTES = 1024  # a spawned process: the parent's cache_layout does not reach it
        cache = NodeCache(fp, sizes, int(sizes.sum()), directory=directory)
        for i in range(10):
            views = cache.reserve_many([i])[0]
            if views is not None:
                for v in views:
                    v[:] = 7
                cache.publish_many([i])
        if role == "half":
            views = cache.reserve_many([20])[0]
            views[0][: len(views[0]) // 2] = 9
        return cache

    try:
        cache = body()
        q.put(("ok", role))
    except BaseException:  # noqa: BLE001
        q.put(("error", traceback.format_exc()))
        return
    ready.set()
    if role == "live":
        release.wait(3 * WAIT)
        cache.close()
    else:
        time.sleep(3 * WAIT)  # killed here


def test_reap_after_kill9_of_all_users_spares_a_group_in_use(isolated, procs):
    d = str(isolated)
    q, release = CTX.Queue(), CTX.Event()
    started = []
    for fp, role in ((FP_DEAD, "fill"), (FP_DEAD, "half"), (FP_LIVE, "live")):
        ready = CTX.Event()
        started.append((procs(_cache_user, d, fp, role, ready, release, q), ready))
        assert result(q) == role and ready.wait(WAIT)  # one after the other: "half" attaches to "fill"'s cache
    (filler, _), (half, _), (live, _) = started
    kill9(filler)
    kill9(half)
    dead = files_of(d, FP_DEAD)
    assert {names.parse_name(e)[1] for e in dead} >= {"lock", "init", "table", "chunk"}
    live_files = files_of(d, FP_LIVE)
    assert live_files

    groups = {g.fingerprint: g for g in reaper.list_groups(d)}
    assert not groups[FP_DEAD].in_use and groups[FP_LIVE].in_use
    assert groups[FP_DEAD].bytes > 0

    removed = reaper.reap(d)
    assert [g.fingerprint for g in removed] == [FP_DEAD]
    assert removed[0].bytes > 0 and removed[0].files == len(dead)
    assert files_of(d, FP_DEAD) == []
    assert files_of(d, FP_LIVE) == live_files  # untouched while a live process uses it
    assert reaper.reap(d, include_kept=True) == []
    assert files_of(d, FP_LIVE) == live_files

    release.set()
    live.join(WAIT)
    assert live.exitcode == 0
    assert os.listdir(d) == []  # its last user removed it


def test_attaching_to_a_group_whose_users_were_all_killed_starts_clean(isolated, procs, cache_layout):
    d = str(isolated)
    q, release, ready = CTX.Queue(), CTX.Event(), CTX.Event()
    p = procs(_cache_user, d, FP_DEAD, "half", ready, release, q)
    assert result(q) == "half" and ready.wait(WAIT)
    kill9(p)
    sizes = np.arange(100, 140)
    cache_layout(1024)
    cache = NodeCache(FP_DEAD, sizes, int(sizes.sum()), directory=d)  # alone: recovers
    try:
        assert cache.resident_items == 10
        assert all(np.all(cache.get(i) == 7) for i in range(10))
        assert cache.get(20) is None
        views = cache.reserve_many([20])[0]  # the dead writer's entry is writable again
        assert views is not None
        for v in views:
            v[:] = 5
        cache.publish_many([20])
        assert np.all(cache.get(20) == 5) and len(cache.get(20)) == sizes[20]
    finally:
        cache.close()
    assert os.listdir(d) == []


# -- 10. concurrent join/leave ------------------------------------------------------------------------
def _join_leave(directory, fp, cycles, seed, start, meet, q):
    def body():
        rng = random.Random(seed)
        stats = {"alone": 0, "last": 0, "errors": []}
        start.wait(WAIT)
        for c in range(cycles):
            m = group.Membership(fp, directory)
            table = m.path("table")

            def setup(alone, c=c, m=m, table=table):
                exists = os.path.exists(table)
                if alone:
                    stats["alone"] += 1
                    if exists:  # every last user removed the group on leaving
                        stats["errors"].append(f"cycle {c}: alone, but the previous group was not removed")
                    fd = os.open(table, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
                    os.write(fd, str(os.getpid()).encode())
                    os.close(fd)
                elif not exists:
                    stats["errors"].append(f"cycle {c}: joined a live group that has no table")

            m.join(setup)
            if c == cycles // 2:
                meet.wait(WAIT)  # every member attached at once here: the cycles do overlap
            for _ in range(rng.randint(1, 3)):  # while attached, the group stays whole
                for kind in ("lock", "init", "table"):
                    if not os.path.exists(m.path(kind)):
                        stats["errors"].append(f"cycle {c}: {kind} vanished while attached")
                time.sleep(rng.random() * 0.003)
            if m.leave(remove_if_last=True):
                stats["last"] += 1
            time.sleep(rng.random() * 0.002)
        return stats

    report(q, body)


def _reap_loop(directory, stop, start, q):
    def body():
        start.wait(WAIT)
        n = 0
        while not stop.is_set():
            reaper.reap(directory)
            n += 1
            time.sleep(0.001)
        return n

    report(q, body)


def test_concurrent_join_leave_keeps_the_group_whole(isolated, procs):
    d, cycles = str(isolated), 30
    start, meet, q, rq, stop = CTX.Barrier(4), CTX.Barrier(3), CTX.Queue(), CTX.Queue(), CTX.Event()
    members = [procs(_join_leave, d, FP, cycles, seed, start, meet, q) for seed in range(3)]
    reaping = procs(_reap_loop, d, stop, start, rq)  # `coordl cache clean` running meanwhile
    out = [result(q, 60) for _ in members]
    stop.set()
    assert result(rq) > 0
    for p in members + [reaping]:
        p.join(WAIT)
        assert p.exitcode == 0
    errors = [e for o in out for e in o["errors"]]
    assert errors == []
    alone, last = sum(o["alone"] for o in out), sum(o["last"] for o in out)
    assert alone == last  # every group that was created was removed by its last user, exactly once
    assert 1 <= alone <= 3 * cycles - 2  # at the meeting, two of the three joins found a live group
    assert os.listdir(d) == []


def test_membership_alone_and_last(isolated):
    d = str(isolated)
    a, b = group.Membership(FP, d), group.Membership(FP, d)
    seen = []
    a.join(seen.append)
    b.join(seen.append)
    assert seen == [True, False]
    with pytest.raises(RuntimeError, match="already"):
        a.join(seen.append)
    with group.try_lock_unused(FP, d) as unused:
        assert not unused
    assert b.leave(remove_if_last=True) is False
    called = []
    assert a.leave(remove_if_last=True, on_last=lambda: called.append(files_of(d, FP))) is True
    assert called and called[0]  # on_last ran before the removal
    assert os.listdir(d) == []
    assert a.leave(remove_if_last=True) is False  # idempotent


def test_join_whose_setup_fails_is_not_attached(isolated):
    d = str(isolated)
    m = group.Membership(FP, d)

    def boom(alone):
        raise OSError("setup failed")

    with pytest.raises(OSError, match="setup failed"):
        m.join(boom)
    assert os.listdir(d) == []  # alone: what the failed setup left is removed
    assert m.leave(remove_if_last=True) is False  # not attached

    other = group.Membership(FP, d)
    other.join(lambda alone: os.close(own.create_exclusive(other.path("table"))))  # 0600, as coordl makes it
    try:
        with pytest.raises(OSError, match="setup failed"):
            m.join(boom)  # not alone: the others' files stay
        assert files_of(d, FP) == sorted(names.segment_name(FP, k) for k in ("init", "lock", "table"))
        with group.try_lock_unused(FP, d) as unused:
            assert not unused
    finally:
        assert other.leave(remove_if_last=True) is True  # the failed joiner holds no lock
    assert os.listdir(d) == []


def waiting_for_lock(file: str) -> None:
    """Returns once a process waits for a ``flock`` on ``file`` (``major:minor:inode``): the kernel
    lists the waiter in /proc/locks, marked ``->``. Fails after WAIT seconds (a hang guard)."""
    deadline = time.monotonic() + WAIT
    while True:
        with open("/proc/locks") as f:
            if any(line.split()[1:3] == ["->", "FLOCK"] and line.split()[6] == file for line in f):
                return
        assert time.monotonic() < deadline, f"no process waited for the lock on {file} within {WAIT} s"
        time.sleep(0.001)


def test_list_groups_racing_the_last_leave_leaves_nothing(isolated):
    d = str(isolated)
    m = group.Membership(FP, d)
    m.join(lambda alone: os.close(own.create_exclusive(m.path("table"))))  # 0600, as coordl makes it
    listed = []
    lister = threading.Thread(target=lambda: listed.append(reaper.list_groups(d)), name="test-lister")

    st = os.stat(m.path("init"))
    init = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"  # as /proc/locks names it

    def while_leaving():  # the last user holds the group's init lock here, just before removing the group
        lister.start()
        waiting_for_lock(init)  # the lister has seen the group's files and now waits for the init lock

    assert m.leave(remove_if_last=True, on_last=while_leaving) is True
    lister.join(WAIT)
    left = sorted(os.listdir(d))
    with contextlib.suppress(FileNotFoundError):
        group.remove_group(FP, d)
    assert listed == [[]]  # the group was gone by the time it could be looked at: not listed
    assert left == [], f"listing the groups left {left} behind"
