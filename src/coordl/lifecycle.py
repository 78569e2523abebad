"""Ends a process's loaders before the interpreter does, whatever the script did.

A training script may break out of its loop, raise, call ``sys.exit``, be interrupted, get
SIGTERM (Slurm and Kubernetes preemption) or fork, and never call ``close()``. The process must
still end as it would without coordl: the same exit status, nothing printed by coordl or DALI,
and its shared memory released by itself. So:

- every loader is registered here (weakly); at exit, :func:`close_all` closes the live ones
  *before* DALI's own exit hook (which asserts that no pipeline is left and otherwise aborts
  the process): :func:`before_dali_exit` moves coordl's hook to run first after DALI is imported;
  then what the loaders used to the last moment ends, while the interpreter is still whole
  (:func:`at_exit`: the event loop, the object store's clients), so that no thread of coordl's or
  of a client's runtime runs into the interpreter's finalization;
- SIGTERM, when the script has not chosen a handler, closes the loaders and then ends the
  process by SIGTERM as it would have ended anyway (exit status -15 / 143); a handler the script
  (or its framework) installs later replaces coordl's, and if it calls coordl's in turn, that call
  does nothing and changes nothing (:func:`terminating` stays False: the script may go on). The
  handler itself only parks the main thread: the loaders are closed on a thread of their own
  (``coordl-sigterm``) within :data:`SIGTERM_DEADLINE_S`, after which the process ends whatever is
  left. The main thread may have been interrupted inside one of coordl's locks; it never
  runs again, so the closing thread does not wait for such a lock (:class:`coordl.threads.OwnedLock`
  asks :func:`parked`), and threads are joined with a deadline (:func:`join`). An HP group's
  staging mutex is the exception: the records it guards are shared with other processes and may be
  half changed, so nobody of this process enters it again and the member is given up to the others
  (:meth:`StagingArea.close <coordl.staging.area.StagingArea.close>`);
- in a child made by ``fork``, the parent's loaders belong to the parent: the child never
  closes them, and hooks registered with :func:`on_fork_child` (DALI's pipelines) make sure
  the child's exit does not touch the parent's threads.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import threading
import weakref

__all__ = [
    "SIGTERM_DEADLINE_S",
    "WATCH_THREAD",
    "at_exit",
    "before_dali_exit",
    "close_all",
    "join",
    "making",
    "on_fork_child",
    "parked",
    "quiet_thread",
    "terminating",
    "track",
]

log = logging.getLogger(__name__)

_live: weakref.WeakSet = weakref.WeakSet()
_making: list = []  # what the main thread is making (its owner does not know it yet), innermost last
_after: list = []  # run at exit once the loaders are closed, the last registered first (at_exit)
_installed = False
_terminating = False
_parked = threading.Event()  # set while the main thread waits in the SIGTERM handler for the closing
_handling = threading.Event()  # set once coordl's SIGTERM handler has begun (in the main thread)
_wake_lock = threading.Lock()  # the handler's start and the watcher's resend of SIGTERM, one at a time
_wake: tuple[int, int] | None = None  # the wakeup pipe coordl gave the interpreter (read end, write end)
_watcher: threading.Thread | None = None  # reads it (_resend_sigterm)

#: The thread that resends a SIGTERM the main thread did not get (:func:`_watch_sigterm`): one for
#: the process's life, started with its first loader.
WATCH_THREAD = "coordl-sigterm-watch"

#: How long the SIGTERM handler lets the loaders close before the process ends by SIGTERM anyway.
SIGTERM_DEADLINE_S = 1.5


def track(loader) -> None:
    """Registers ``loader`` (anything with ``close()``) to be closed at exit and on SIGTERM."""
    _live.add(loader)
    _install()
    _install_sigterm()


def at_exit(hook) -> None:
    """Runs ``hook()`` at exit after :func:`close_all` has closed the loaders, however the two were
    registered (the hooks themselves run the last registered first): for what the loaders use to
    the last moment (this process's event loop, the object store's clients). A forked child
    inherits the hooks: a hook ends only what its own process made."""
    _after.append(hook)
    _install()


def _install() -> None:
    global _installed
    if not _installed:
        _installed = True
        atexit.register(_exit)
        os.register_at_fork(
            before=_before_fork, after_in_parent=_after_fork_in_parent, after_in_child=_after_fork_in_child
        )


def quiet_thread() -> None:
    """Called first in every thread coordl starts: the process's SIGINT and SIGTERM go to another
    thread. Python runs signal handlers in the main thread only, and a signal the kernel hands to a
    thread that is not waiting in a system call does not wake a main thread that is (a script
    sleeping, or blocked on a lock), so the handler would run late. Threads started by these
    threads (DALI's, the pools') inherit the mask."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})


@contextlib.contextmanager
def making(thing):
    """Closes ``thing`` on SIGTERM while the block that makes it runs: a signal that parks the main
    thread there (in a constructor, before its owner holds ``thing``) would otherwise leave what
    ``thing`` made so far (shared memory, a group membership) to the next process. ``thing.close()``
    must then undo whatever part of it is made."""
    _making.append(thing)
    try:
        yield thing
    finally:
        _making.remove(thing)


def parked(owner: int | None) -> bool:
    """Whether the thread ``owner`` (a thread's ident) is the main thread parked in the SIGTERM
    handler: it never runs again, so a lock it holds will never be released and what it guards is
    not being changed (the closing thread may go on without that lock)."""
    return owner is not None and _parked.is_set() and owner == threading.main_thread().ident


def join(thread: threading.Thread, timeout: float | None = None) -> None:
    """``thread.join(timeout)``, at most until the SIGTERM deadline while the process is ending."""
    if _terminating:
        timeout = SIGTERM_DEADLINE_S if timeout is None else min(timeout, SIGTERM_DEADLINE_S)
    thread.join(timeout)


def terminating() -> bool:
    """Whether this process is closing its loaders because of SIGTERM (then nothing waits for
    other processes: a preempted job has seconds to end)."""
    return _terminating


def before_dali_exit() -> None:
    """Makes :func:`close_all` run before every exit hook registered so far (DALI's included)."""
    atexit.unregister(_exit)
    atexit.register(_exit)


def _exit() -> None:
    close_all()
    for hook in reversed(_after):
        try:
            hook()
        except Exception as e:  # noqa: BLE001 - at exit, one hook's failure must not stop the others
            log.debug("coordl: %r at exit failed: %s", hook, e)
    _stop_watch()


def close_all() -> None:
    """Closes every live loader of this process (not those a forked child inherited), and what
    the main thread was making when SIGTERM parked it (:func:`making`), innermost first."""
    for loader in [*reversed(_making), *_live]:
        try:
            loader.close()
        except Exception as e:  # noqa: BLE001 - at exit, one loader's failure must not stop the others
            log.debug("coordl: closing %r at exit failed: %s", loader, e)


_child_hooks: list = []


def on_fork_child(hook) -> None:
    """Runs ``hook()`` in every child this process forks from now on."""
    _child_hooks.append(hook)


_blocked_for_fork = False


def _before_fork() -> None:
    # A signal that reaches a child before the interpreter has set itself up after fork is lost
    # (CPython clears the flags of signals caught by Python handlers), so a Pool.terminate() right
    # after a fork would wait forever for a worker that never saw its SIGTERM. With SIGTERM blocked
    # across the fork, the child receives it once it runs SIGTERM's default action again.
    global _blocked_for_fork
    if signal.getsignal(signal.SIGTERM) is _on_sigterm:
        _blocked_for_fork = signal.SIGTERM not in signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})


def _after_fork_in_parent() -> None:
    global _blocked_for_fork
    if _blocked_for_fork:
        _blocked_for_fork = False
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})


def _after_fork_in_child() -> None:
    global _blocked_for_fork
    _live.clear()
    _making.clear()
    for hook in _child_hooks:
        hook()
    _forget_wakeup_in_child()
    # The child has no loaders of its own yet: SIGTERM does what it did before coordl handled it.
    if signal.getsignal(signal.SIGTERM) is _on_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if _blocked_for_fork:
        _blocked_for_fork = False
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})


def _forget_wakeup_in_child() -> None:
    """The wakeup pipe is the parent's (its watcher would resend the child's SIGTERM to the parent)."""
    global _wake
    fds, _wake = _wake, None
    _handling.clear()
    if fds is not None and _give_back_wakeup(fds[1]):
        for fd in fds:
            os.close(fd)


def _stop_watch() -> None:
    """At exit, once the loaders are closed: the wakeup pipe given back and its watcher ended, so that
    no thread of coordl's runs into the interpreter's finalization."""
    global _wake
    fds, _wake = _wake, None
    if fds is None or not _give_back_wakeup(fds[1]):
        return
    os.close(fds[1])  # the watcher reads the pipe's end and returns
    if _watcher is not None:
        _watcher.join(1.0)
    os.close(fds[0])


def _give_back_wakeup(ours: int) -> bool:
    """Unsets the interpreter's wakeup fd if it is still ``ours``; False where this thread cannot (not
    the main thread): the pipe must then stay open, so that no file takes the number written to."""
    try:
        now = signal.set_wakeup_fd(-1)
    except ValueError:
        return False
    if now not in (-1, ours):  # someone else's since: theirs it stays
        signal.set_wakeup_fd(now)
    return True


def _install_sigterm() -> None:
    """Closes the loaders on SIGTERM, when the script left SIGTERM's default action in place."""
    if threading.current_thread() is not threading.main_thread():
        return
    try:
        if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
            return
        signal.signal(signal.SIGTERM, _on_sigterm)
    except ValueError:  # not the main interpreter
        return
    _watch_sigterm()


def _watch_sigterm() -> None:
    """Python runs a signal's handler in the main thread, but the kernel may hand the process's
    SIGTERM to any thread that does not block it. coordl's threads block it (:func:`quiet_thread`);
    a library's need not (OpenBLAS starts one when numpy is imported). A main thread asleep in a
    long step would then run coordl's handler only when it wakes, a minute later perhaps: a
    preempted job killed before it closed. So coordl gives the interpreter a wakeup pipe (unless
    someone has: asyncio's loop sets its own), into which whichever thread got a signal writes
    its number, and a thread of its own reads it: a SIGTERM the main thread has not begun to
    handle within 50 ms is sent again, to the main thread, whose sleep or system call it ends."""
    global _wake, _watcher
    if _wake is not None:
        return
    r, w = os.pipe2(os.O_CLOEXEC)
    os.set_blocking(w, False)
    theirs = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    if theirs != -1:  # someone else's: theirs it stays
        signal.set_wakeup_fd(theirs)
        os.close(r)
        os.close(w)
        return
    _wake = (r, w)
    _watcher = threading.Thread(target=_resend_sigterm, args=(r,), name=WATCH_THREAD, daemon=True)
    _watcher.start()


def _resend_sigterm(fd: int) -> None:
    quiet_thread()
    main = threading.main_thread().ident
    while True:
        try:
            got = os.read(fd, 512)  # a byte per signal caught: its number
        except OSError:  # closed in a forked child
            return
        if not got:
            return
        if signal.SIGTERM not in got or _handling.wait(0.05):
            continue
        with _wake_lock:
            if not _handling.is_set() and signal.getsignal(signal.SIGTERM) is _on_sigterm:
                signal.pthread_kill(main, signal.SIGTERM)


def _on_sigterm(signum, frame) -> None:
    global _terminating
    if signal.getsignal(signal.SIGTERM) is not _on_sigterm:
        # A handler installed after coordl's called it (PyTorch Lightning chains to the handler it
        # replaced): that handler decides how the process ends, and the exit closes the loaders as
        # any exit does. Nothing changes here: a script that goes on keeps loaders that work as before.
        return
    _handling.set()
    with _wake_lock:  # a SIGTERM resent after this point would end the process before its loaders closed
        _terminating = True
        # The default action from now on, as if coordl had never handled it: the process ends by SIGTERM.
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    # The main thread stops here, wherever it was (perhaps inside a lock of coordl's): a thread of
    # its own closes the loaders, which never waits for what the main thread holds.
    _parked.set()
    closer = threading.Thread(target=_close_on_sigterm, name="coordl-sigterm", daemon=True)
    closer.start()
    closer.join(SIGTERM_DEADLINE_S)
    os.kill(os.getpid(), signal.SIGTERM)


def _close_on_sigterm() -> None:
    quiet_thread()
    close_all()
