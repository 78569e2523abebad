"""coordl.threads: the signal, the daemon pool and the process's event loop, on real threads and a real fork."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
import threading
import time
from concurrent.futures.thread import BrokenThreadPool
from pathlib import Path

import pytest

from coordl.threads import LOOP_THREAD, DaemonPool, Signal, event_loop

SRC = Path(__file__).resolve().parents[1] / "src"


def test_a_signal_calls_back_once_whenever_the_callback_was_added():
    s, calls = Signal(), []
    first = s.add(lambda: calls.append("first"))
    gone = s.add(lambda: calls.append("removed"))
    s.remove(gone)
    assert calls == [] and not s.is_set()
    s.set()
    assert calls == ["first"] and s.is_set() and s.wait(0)
    s.set()  # again: nothing more runs
    assert calls == ["first"]
    assert s.add(lambda: calls.append("late")) is None  # added once set: runs at once, in this thread
    assert calls == ["first", "late"]
    s.remove(first)  # a handle that already ran, or None: nothing happens
    s.remove(None)


def test_a_signal_set_from_another_thread_runs_every_callback_added_concurrently():
    s = Signal()
    ran: list[int] = []
    lock = threading.Lock()

    def add(k: int) -> None:
        def callback():
            with lock:
                ran.append(k)

        s.add(callback)

    adders = [threading.Thread(target=add, args=(k,)) for k in range(200)]
    for t in adders[:100]:
        t.start()
    setter = threading.Thread(target=s.set)
    setter.start()
    for t in adders[100:]:
        t.start()
    for t in [*adders, setter]:
        t.join()
    assert sorted(ran) == list(range(200))  # each once: before set() by set(), after it at once


def test_a_failing_callback_does_not_stop_the_others():
    s, calls = Signal(), []
    s.add(lambda: 1 / 0)
    s.add(lambda: calls.append("ran"))
    with pytest.raises(ZeroDivisionError):
        s.set()
    assert calls == ["ran"] and s.is_set()


def test_a_daemon_pool_runs_work_on_named_daemon_threads_and_joins_them_at_shutdown():
    started = []
    pool = DaemonPool(
        3, thread_name_prefix="coordl-test", initializer=lambda: started.append(threading.current_thread())
    )
    gate = threading.Event()
    futures = [pool.submit(lambda k=k: (gate.wait(10), k)[1]) for k in range(6)]
    failing = pool.submit(lambda: 1 / 0)
    time.sleep(0.1)
    assert len(started) == 3  # no more threads than max_workers
    assert all(t.daemon and t.name.startswith("coordl-test_") for t in started)
    gate.set()
    assert [f.result(10) for f in futures] == list(range(6))
    assert isinstance(failing.exception(10), ZeroDivisionError)
    assert list(pool.map(lambda x: x * 2, range(4))) == [0, 2, 4, 6]
    pool.shutdown(wait=True)
    assert not any(t.is_alive() for t in started)
    with pytest.raises(RuntimeError, match="after shutdown"):
        pool.submit(print)


def test_shutdown_cancels_queued_work_when_asked_and_finishes_it_otherwise():
    for cancel in (True, False):
        pool = DaemonPool(1, thread_name_prefix="coordl-test")
        gate = threading.Event()
        running = pool.submit(gate.wait, 10)
        queued = [pool.submit(lambda k=k: k) for k in range(5)]
        time.sleep(0.05)
        threading.Timer(0.1, gate.set).start()
        pool.shutdown(wait=True, cancel_futures=cancel)
        assert running.result(0) is True
        if cancel:
            assert all(f.cancelled() for f in queued)
        else:
            assert [f.result(0) for f in queued] == list(range(5))


def test_a_pool_whose_initializer_fails_fails_its_work_instead_of_hanging():
    def broken():
        raise OSError("no thread for you")

    pool = DaemonPool(2, thread_name_prefix="coordl-test", initializer=broken)
    f = pool.submit(lambda: 1)
    with pytest.raises(BrokenThreadPool, match="no thread for you"):
        f.result(10)
    with pytest.raises(BrokenThreadPool):
        pool.submit(lambda: 1)
    pool.shutdown()


def test_the_event_loop_is_one_daemon_thread_for_the_process():
    loop = event_loop()
    assert event_loop() is loop
    (thread,) = [t for t in threading.enumerate() if t.name == LOOP_THREAD]
    assert thread.daemon

    async def where() -> str:
        await asyncio.sleep(0)
        return threading.current_thread().name

    assert asyncio.run_coroutine_threadsafe(where(), loop).result(10) == LOOP_THREAD


FORKED = """
import asyncio, os, threading
from coordl.threads import LOOP_THREAD, event_loop

async def where():
    return threading.get_native_id()

parent = asyncio.run_coroutine_threadsafe(where(), event_loop()).result(10)
pid = os.fork()
if pid == 0:
    child = asyncio.run_coroutine_threadsafe(where(), event_loop()).result(10)
    loops = [t for t in threading.enumerate() if t.name == LOOP_THREAD]
    os._exit(0 if child != parent and len(loops) == 1 else 1)
_, status = os.waitpid(pid, 0)
print("child", os.waitstatus_to_exitcode(status))
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_starts_an_event_loop_of_its_own():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(FORKED)], env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0 and proc.stdout.split() == ["child", "0"], proc.stderr


AT_EXIT = """
import asyncio, atexit, sys, threading
# Registered first, so it runs last: what is left when the interpreter starts to finalize.
atexit.register(lambda: print("at the end:", [t.name for t in threading.enumerate()][1:], loop.is_closed(),
                              stuck.cancelled(), flush=True))
from coordl import lifecycle
from coordl.threads import event_loop

loop = event_loop()
stuck = asyncio.run_coroutine_threadsafe(asyncio.sleep(3600), loop)  # never done by itself


class Loader:  # made after the loop, as a second loader of a script is: closed before the loop ends all the same
    def close(self):
        print("loader closed, the loop running:", loop.is_running(), flush=True)


loader = Loader()
lifecycle.track(loader)
sys.exit(3)
"""


def test_at_exit_the_event_loop_ends_after_the_loaders_close_and_before_the_interpreter_does():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, "-X", "dev", "-c", textwrap.dedent(AT_EXIT)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 3 and proc.stderr == "", proc.stderr
    # The loader closed while the loop still ran (it may read through it to the last); then the
    # loop's work was cancelled, its thread joined and the loop closed, before the interpreter's end.
    assert proc.stdout.splitlines() == ["loader closed, the loop running: True", "at the end: [] True True"]
