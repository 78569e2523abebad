"""The trainer's reads for actors that cannot read the dataset (``RayPrep(reads="trainer")``):
submitted ahead, on the loader's I/O threads, so that an actor never waits for a read that could
have been made while it prepared its last unit.

A dispatching thread (the pass's remote thread, an HP group member's remote producer) claims the
units those actors will take next and submits their reads at once (:meth:`TrainerReads.submit`);
when an actor has room, it takes the oldest (:meth:`TrainerReads.take`), whose bytes are then
usually read already. The reads of several units run at once, where a thread reading one unit
at a time, between handing units out, made the actors wait for each read in turn.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf

import numpy as np

from coordl.fetch.ahead import Stopped

__all__ = ["TrainerReads"]


class TrainerReads:
    """Units whose bytes the trainer is reading, oldest first, each with the caller's key.

    Args:
        ahead: the DALI backend's :class:`~coordl.fetch.ahead.FetchAhead` (it reads on the loader's
            I/O pool, and skips or raises as ``on_error`` says); None: the torch backend's.
        fetcher: the torch backend's fetcher, whose ``gather`` runs on ``pool`` (read failures
            travel to the actor in ``Unit.errors``).
        pool: threads for the torch backend's reads.
        stop: set when the caller stops: a wait for a read ends.
        carry_skipped: each unit carries the samples its own read skipped (``Unit.skipped``); off
            where the caller counts its fetcher's skipped samples itself.
    """

    def __init__(self, ahead=None, *, fetcher=None, pool=None, stop=None, carry_skipped: bool = False):
        self._ahead = ahead
        self._fetcher = fetcher
        self._pool = pool
        self._stop = stop
        self._carry = carry_skipped
        self._queue: collections.deque = collections.deque()  # (unit, key, its reads)

    def __len__(self) -> int:
        return len(self._queue)

    def submit(self, unit, key) -> None:
        """Starts reading ``unit``'s bytes (its ``ids``)."""
        if self._ahead is not None:
            reads = self._ahead.submit(unit.ids, unit.number)
        else:
            reads = self._pool.submit(self._fetcher.gather, np.asarray(unit.ids, dtype=np.int64))
        self._queue.append((unit, key, reads))

    def take(self) -> tuple:
        """``(unit, key)`` of the oldest unit, its bytes in ``unit.data``, once read.

        Raises:
            SampleError: a sample cannot be read and ``on_error="raise"`` (DALI backend).
            Stopped: the caller stopped while waiting.
        """
        unit, key, reads = self._queue.popleft()
        if self._ahead is not None:
            skipped = len(self._ahead.skipped)
            raw = self._ahead.receive(reads)
            unit.ids, unit.data = raw.ids, raw.data
            if self._carry:  # what this read skipped, not what the fetcher ever skipped
                unit.skipped = list(self._ahead.skipped[skipped:])
        else:
            unit.data, unit.errors = self._result(reads)
        return unit, key

    def _result(self, future: cf.Future):
        while True:
            try:
                return future.result(timeout=0.1)
            except cf.TimeoutError:
                if self._stop is not None and self._stop.is_set():
                    raise Stopped() from None

    def keys(self) -> list:
        """The keys of the units not taken."""
        return [key for _, key, _ in self._queue]

    def cancel(self) -> None:
        """Gives up the reads not taken (those running finish; their bytes are dropped)."""
        for _, _, reads in self._queue:
            futures = [reads] if isinstance(reads, cf.Future) else [f for _, f in reads.reads]
            for f in futures:
                f.cancel()
        self._queue.clear()
