"""The units of work of one pass and who runs them: hand-out in order, a bound on units in
flight, re-runs, and delivery in order, exactly once.

A pass's batches are units ``0..n-1``. Whoever is free takes the next one (:meth:`Units.claim`):
the local pipeline, or an actor of the pool. A unit whose runner died goes back to the front
(:meth:`Units.retry`) and is run again by the next one free. Results arrive in any order and
any number of times (:meth:`Units.put`): the first is kept, later ones are dropped, and the
consumer takes them in order (:meth:`Units.take`), so every unit is delivered once.

Remote claims are bounded: a remote runner gets a unit only while fewer than ``bound`` units
claimed by remote runners are not yet taken, so that prepared batches never pile up in the
object store while the training loop is busy. Local claims have a bound of their own,
``local_depth`` (the units the local pipeline holds to keep busy), so that the local pipeline,
whose results wait in memory too, never prepares the rest of the epoch ahead of a slow loop.
Units in flight are thus at most ``bound + local_depth``. The local pipeline never waits for
room while it holds units (the consumer may be waiting for one of them, a deadlock): a run of it
claims without waiting and ends when none is free, handing back what it holds, and only then
waits (``claim(block=True)``).
"""

from __future__ import annotations

import collections
import threading
import time

__all__ = ["EMPTY", "LOCAL", "REMOTE", "Units"]

LOCAL, REMOTE = "local", "remote"
EMPTY = object()  # the result of a unit whose every sample was skipped (on_error="skip")


class Units:
    """The units of one pass (see the module's docstring).

    Args:
        count: units in the pass.
        bound: a callable giving the most units claimed and not yet taken, for remote claims.
        stop: set when the pass stops: every wait ends.
        local_depth: the most units claimed and not yet taken, for local claims (None: no bound).
    """

    def __init__(self, count: int, bound, stop: threading.Event, local_depth: int | None = None):
        self.count = count
        self.local_depth = local_depth
        self._bound = bound
        self._stop = stop
        self._cond = threading.Condition()
        self._next = 0  # the next unit never claimed
        self._retry: collections.deque[int] = collections.deque()
        self._done: dict[int, object] = {}  # results not yet taken
        self._finished: set[int] = set()  # units with a result (taken or not)
        self._taken = 0  # units the consumer has taken
        self._remote: set[int] = set()  # units remote runners claimed that the consumer has not taken
        self._local: set[int] = set()  # units the local pipeline claimed that the consumer has not taken
        self._failure: BaseException | None = None
        self.claimed = {LOCAL: 0, REMOTE: 0}  # units each kind of runner claimed (re-runs too)
        self.retried = 0

    # -- runners -------------------------------------------------------------------------------
    def claim(self, who: str, *, block: bool) -> int | None:
        """The next unit for a runner, or None: with ``block``, only when every unit has a result
        (or the pass stopped); without, also when none is free now (remote: the window is full)."""
        with self._cond:
            while True:
                n = self._free(who)
                if n is not None:
                    self.claimed[who] += 1
                    (self._remote if who == REMOTE else self._local).add(n)
                    return n
                if not block or self._over():
                    return None
                self._cond.wait(0.1)

    def _free(self, who: str) -> int | None:
        while self._retry:
            n = self._retry.popleft()
            if n not in self._finished:
                return n
        if self._next >= self.count:
            return None
        if who == REMOTE and len(self._remote) >= self._bound():
            return None
        if who == LOCAL and self.local_depth is not None and len(self._local) >= self.local_depth:
            return None
        self._next += 1
        return self._next - 1

    def _over(self) -> bool:
        return self._stop.is_set() or self._failure is not None or len(self._finished) >= self.count

    def put(self, n: int, result) -> bool:
        """Unit ``n``'s result; False when it had one already (then this one is dropped)."""
        with self._cond:
            if n in self._finished:
                return False
            self._finished.add(n)
            if n >= self._taken:
                self._done[n] = result
            self._cond.notify_all()
            return True

    def retry(self, n: int) -> None:
        """Unit ``n``'s runner died: it is handed out again, before any new unit."""
        with self._cond:
            self._remote.discard(n)
            if n not in self._finished and n not in self._retry:
                self._retry.appendleft(n)
                self.retried += 1
                self._cond.notify_all()

    def give_back(self, n: int) -> None:
        """A remote runner's claim of unit ``n``, never run (its bytes were read ahead for actors
        that are gone): handed out again before any new unit, not counted as a re-run."""
        with self._cond:
            self._remote.discard(n)
            if n not in self._finished and n not in self._retry:
                self._retry.appendleft(n)
                self._cond.notify_all()

    def fail(self, error: BaseException) -> None:
        """A runner failed for good: the consumer raises ``error`` when it asks for a unit."""
        with self._cond:
            if self._failure is None:
                self._failure = error
            self._cond.notify_all()

    def finished(self) -> bool:
        with self._cond:
            return self._over()

    def wait(self, timeout: float) -> None:
        """Waits for a change (a result, a re-run, a unit taken), at most ``timeout`` seconds."""
        with self._cond:
            self._cond.wait(timeout)

    # -- the consumer ----------------------------------------------------------------------------
    def take(self, n: int, alive=None):
        """Unit ``n``'s result, waiting for it; raises a runner's failure. ``alive()`` False: the
        runners are gone without a result (then a :class:`~coordl.errors.CoordlError`)."""
        from coordl.errors import CoordlError

        with self._cond:
            while n not in self._done:
                if self._failure is not None:
                    raise self._failure
                if self._stop.is_set():
                    raise CoordlError("coordl: the pass was closed while waiting for a batch")
                if alive is not None and not alive():
                    raise CoordlError(f"coordl: nobody is left to prepare batch {n} (the prep threads stopped)")
                self._cond.wait(0.1)
            self._taken = n + 1
            self._remote.discard(n)
            self._local.discard(n)
            self._cond.notify_all()
            return self._done.pop(n)

    def in_flight(self) -> int:
        """Units claimed and not yet taken."""
        with self._cond:
            return self._next - self._taken

    def remote_in_flight(self) -> int:
        """Units remote runners claimed and the consumer has not taken (at most the bound)."""
        with self._cond:
            return len(self._remote)

    def ready(self) -> int:
        """Results waiting for the consumer."""
        with self._cond:
            return len(self._done)


class Rate:
    """Seconds the consumer waited, over a sliding window of wall time (for ``workers="auto"``)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._t0 = time.perf_counter()
        self._wait = 0.0

    def add(self, seconds: float) -> None:
        with self._lock:
            self._wait += seconds

    def take(self) -> tuple[float, float]:
        """(waited, elapsed) since the last call."""
        with self._lock:
            now = time.perf_counter()
            out = (self._wait, now - self._t0)
            self._t0, self._wait = now, 0.0
            return out
