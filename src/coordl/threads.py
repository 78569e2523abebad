"""Thread primitives that never hold up the interpreter's exit: a signal that calls back when set, a
pool of daemon threads, and this process's event loop on a daemon thread, ended at exit.

Why daemon threads: at exit, Python joins every non-daemon thread (and ``concurrent.futures``
joins its pools' threads) *before* it runs the ``atexit`` hooks that close the loaders a script
left open. A pool thread waiting for a stuck request would hold the process until the request
timed out. With daemon threads, the exit goes on to :func:`coordl.lifecycle.close_all`, whose
loaders set their :class:`Signal`, which abandons the requests; ``close()`` then joins the
threads it owns, as it always does. The event loop ends after them (:func:`coordl.lifecycle.at_exit`):
what still runs on it is cancelled and awaited, its thread is joined and it is closed, while the
interpreter is whole: a daemon thread left running into the interpreter's finalization (with a
client's native runtime calling back into it) can abort the process and lose its exit status.

Imports nothing else from coordl but :mod:`coordl.lifecycle` (which imports nothing of coordl).
"""

from __future__ import annotations

import concurrent.futures as cf
import itertools
import logging
import os
import queue
import threading
from collections.abc import Callable
from concurrent.futures.thread import BrokenThreadPool
from typing import TYPE_CHECKING

from coordl import lifecycle

if TYPE_CHECKING:
    import asyncio

__all__ = ["LOOP_THREAD", "DaemonPool", "OwnedLock", "Signal", "daemon_pool", "end_loop", "event_loop"]

log = logging.getLogger(__name__)

LOOP_THREAD = "coordl-loop"  # the name of the event loop's thread (one per process, until its exit)
LOOP_EXIT_S = 2.0  # at exit, how long the loop's cancelled work and then its thread are waited for


class OwnedLock:
    """A lock that knows which thread holds it, so that the closing on SIGTERM never waits for one
    the interrupted main thread holds: that thread is parked in the handler and never runs again
    (:func:`coordl.lifecycle.parked`), so the closing thread goes on as if it held the lock (what the
    lock guards is not being changed by anyone else: the main thread was its holder). Everywhere
    else it is an ordinary, non-reentrant lock; a context manager."""

    __slots__ = ("_bypassed", "_lock", "owner")

    def __init__(self):
        self._lock = threading.Lock()
        self._bypassed = threading.local()  # this thread went on without the lock
        self.owner: int | None = None

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if not blocking or timeout >= 0:
            got = self._lock.acquire(blocking, timeout)
        else:
            while not (got := self._lock.acquire(timeout=0.05)):
                if lifecycle.parked(self.owner):
                    self._bypassed.on = True
                    return True
        if got:
            self.owner = threading.get_ident()
        return got

    def release(self) -> None:
        if getattr(self._bypassed, "on", False):
            self._bypassed.on = False
            return
        self.owner = None
        self._lock.release()

    def locked(self) -> bool:
        return self._lock.locked()

    def __enter__(self):
        self.acquire()
        return self

    def __exit__(self, *exc):
        self.release()


class Signal(threading.Event):
    """An event that also calls back: ``set()`` runs the callbacks registered with :meth:`add`.

    Thread-safe. Callbacks run once, in the thread that sets the signal, outside any lock; a
    callback registered after the signal was set runs at once, in the registering thread, so that
    none is missed whatever the order. Callbacks should be quick and not block (schedule work
    elsewhere, e.g. with ``loop.call_soon_threadsafe``).
    """

    def __init__(self):
        super().__init__()
        self._lock = OwnedLock()
        self._callbacks: dict[int, Callable[[], object]] = {}
        self._handles = itertools.count()

    def add(self, callback: Callable[[], object]) -> int | None:
        """Calls ``callback()`` when the signal is set (now, if it is).

        Returns:
            a handle for :meth:`remove`, or None when the callback already ran.
        """
        with self._lock:
            if not self.is_set():
                handle = next(self._handles)
                self._callbacks[handle] = callback
                return handle
        callback()
        return None

    def remove(self, handle: int | None) -> None:
        """Forgets a callback that has not run yet (a handle of None, or an unknown one, is ignored)."""
        with self._lock:
            self._callbacks.pop(handle, None)

    def set(self) -> None:
        """Sets the flag (waking :meth:`wait`) and runs the callbacks; the first that raised raises after all ran."""
        with self._lock:
            super().set()
            callbacks, self._callbacks = list(self._callbacks.values()), {}
        first = None
        for callback in callbacks:
            try:
                callback()
            except Exception as e:  # noqa: BLE001 - every callback runs; the first failure is raised below
                first = first or e
        if first is not None:
            raise first


class DaemonPool(cf.Executor):
    """A thread pool whose threads are daemons: ``concurrent.futures.ThreadPoolExecutor``'s
    ``submit``/``map``/``shutdown``, less what coordl does not use.

    Threads start as work arrives, up to ``max_workers``, and live until :meth:`shutdown`.

    Args:
        max_workers: the most threads.
        thread_name_prefix: the threads are named ``<prefix>_<k>``.
        initializer: called first in every thread; if it raises, the pool is broken: pending and
            later work fails with ``BrokenThreadPool``.
    """

    def __init__(
        self,
        max_workers: int,
        *,
        thread_name_prefix: str = "coordl-pool",
        initializer: Callable[[], object] | None = None,
    ):
        if max_workers < 1:
            raise ValueError(f"max_workers must be at least 1, got {max_workers}")
        self._max = max_workers
        self._prefix = thread_name_prefix
        self._initializer = initializer
        self._work: queue.SimpleQueue = queue.SimpleQueue()
        self._idle = threading.Semaphore(0)  # threads waiting for work
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._shutdown = False
        self._broken: str | None = None

    def submit(self, fn, /, *args, **kwargs) -> cf.Future:
        with self._lock:
            if self._broken is not None:
                raise BrokenThreadPool(self._broken)
            if self._shutdown:
                raise RuntimeError("cannot schedule new futures after shutdown")
            future: cf.Future = cf.Future()
            self._work.put((future, fn, args, kwargs))
            if not self._idle.acquire(blocking=False) and len(self._threads) < self._max:
                name = f"{self._prefix}_{len(self._threads)}"
                thread = threading.Thread(target=self._serve, name=name, daemon=True)
                thread.start()
                self._threads.append(thread)
            return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Stops the threads once the work queued before is done (cancelled first, with ``cancel_futures``)."""
        with self._lock:
            self._shutdown = True
            if cancel_futures:
                self._drain(None)
            for _ in self._threads:
                self._work.put(None)  # one stop per thread, behind the work already queued
            threads = list(self._threads)
        if wait:
            for thread in threads:
                if thread is not threading.current_thread():
                    thread.join()

    def _drain(self, why: str | None) -> None:
        """Cancels (or, with ``why``, fails) the work still queued; leaves the stops."""
        stops = 0
        while True:
            try:
                item = self._work.get_nowait()
            except queue.Empty:
                break
            if item is None:
                stops += 1
            elif why is None:
                item[0].cancel()
            elif item[0].set_running_or_notify_cancel():
                item[0].set_exception(BrokenThreadPool(why))
        for _ in range(stops):
            self._work.put(None)

    def _serve(self) -> None:
        if self._initializer is not None:
            try:
                self._initializer()
            except BaseException as e:  # noqa: BLE001 - reported to every future of the pool
                with self._lock:
                    self._broken = f"a thread of {self._prefix} failed to start: {e!r}"
                    self._drain(self._broken)
                return
        while True:
            item = self._work.get()
            if item is None:
                return
            future, fn, args, kwargs = item
            del item
            if future.set_running_or_notify_cancel():
                try:
                    result = fn(*args, **kwargs)
                except BaseException as e:  # noqa: BLE001 - the future carries it to whoever waits
                    future.set_exception(e)
                    del e
                else:
                    future.set_result(result)
                    del result
            del future, fn, args, kwargs  # no reference to finished work while idle
            self._idle.release()


def daemon_pool(threads: int, name: str) -> DaemonPool:
    """A pool of ``threads`` daemon threads named ``name`` that never take the process's signals
    (every thread coordl starts: see the module docstring and :func:`coordl.lifecycle.quiet_thread`)."""
    return DaemonPool(max(1, threads), thread_name_prefix=name, initializer=lifecycle.quiet_thread)


_loop: asyncio.AbstractEventLoop | None = None
_loop_thread: threading.Thread | None = None
_loop_lock = threading.Lock()
_loop_ended = False  # this process is exiting: its loop has ended and none starts again
_end_registered = False  # end_loop is an exit hook (a forked child inherits it)


def _after_fork_in_child() -> None:
    # The parent's loop runs on a thread the child does not have: the child starts its own when it
    # needs one. The parent's loop object is dropped, not closed (it says it is running).
    global _loop, _loop_thread, _loop_lock
    _loop, _loop_thread, _loop_lock = None, None, threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


def event_loop() -> asyncio.AbstractEventLoop:
    """This process's event loop, running on a daemon thread (:data:`LOOP_THREAD`) until the process
    exits (:func:`end_loop`); started on first use, and again in a forked child. Submit work with
    ``asyncio.run_coroutine_threadsafe(coro, event_loop())``; never block in it.

    Raises:
        RuntimeError: the process is exiting and its loop has ended.
    """
    global _loop, _loop_thread, _end_registered
    with _loop_lock:
        if _loop_ended:
            raise RuntimeError("coordl: this process is exiting: its event loop has ended")
        if _loop is None:
            import asyncio  # here: most processes never need a loop

            loop = asyncio.new_event_loop()
            thread = threading.Thread(target=_run_loop, args=(loop,), name=LOOP_THREAD, daemon=True)
            thread.start()
            _loop, _loop_thread = loop, thread
            if not _end_registered:
                _end_registered = True
                lifecycle.at_exit(end_loop)  # after the loaders, which may still read through it
        return _loop


def end_loop() -> None:
    """Ends this process's loop (an exit hook, once the loaders are closed): the work still on it
    is cancelled and awaited, the loop stops, its thread is joined and the loop is closed, each
    waited for at most :data:`LOOP_EXIT_S`. Idempotent; :func:`event_loop` refuses from then on."""
    global _loop, _loop_thread, _loop_ended
    with _loop_lock:
        loop, thread = _loop, _loop_thread
        _loop, _loop_thread, _loop_ended = None, None, True
    if loop is None or thread is None:
        return
    import asyncio

    if thread.is_alive():
        cancelled = asyncio.run_coroutine_threadsafe(_cancel_all(), loop)
        try:
            cancelled.result(LOOP_EXIT_S)
        except Exception as e:  # noqa: BLE001 - the loop stops anyway; its thread is a daemon
            log.debug("coordl: cancelling the event loop's work at exit failed: %r", e)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(LOOP_EXIT_S)
    if not thread.is_alive():
        loop.close()


async def _cancel_all() -> None:
    import asyncio

    me = asyncio.current_task()
    tasks = [t for t in asyncio.all_tasks() if t is not me]
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await asyncio.get_running_loop().shutdown_asyncgens()


def _run_loop(loop: asyncio.AbstractEventLoop) -> None:
    import asyncio

    lifecycle.quiet_thread()
    asyncio.set_event_loop(loop)
    loop.run_forever()
