"""The store as the last link of the fetcher's chain: files, ``s3://`` objects and tar shards, read
through :mod:`coordl.fetch.samples`; and how long its reads take per CPU second they cost (the pace
that sizes the read-ahead's concurrency)."""

from __future__ import annotations

import threading
import time

import numpy as np

from coordl.fetch import samples
from coordl.fetch.chain import STORE, Job

__all__ = ["Pace", "StoreLink"]


class StoreLink:
    """The store: it holds every sample. What it fails to read is recorded in the job (``failed``).

    Args:
        index: the dataset.
        drop_page_cache: advise the kernel to drop the pages read from the page cache.
        stop: when set, requests still waiting for an object store end (as failures).
    """

    code, cached = STORE, True

    def __init__(self, index, *, drop_page_cache: bool, stop):
        self.index = index
        self.drop_page_cache = drop_page_cache
        self.stop = stop
        self.pace = Pace()

    def holds(self, ids: np.ndarray) -> np.ndarray:
        return np.ones(len(ids), dtype=bool)

    def read_into(self, job: Job, ks: np.ndarray) -> None:
        """Reads ``ks`` into their buffers, timing the call (:class:`Pace`, for one of enough files).

        Raises:
            StoreError: the object store refused the job's credentials.
        """
        paced = len(ks) >= Pace.MIN_FILES
        w0, c0, q0 = _clocks() if paced else (0, 0, 0)
        t0 = time.perf_counter_ns()
        failed = samples.read_many(
            self.index, job.ids[ks], job.into(ks), drop_page_cache=self.drop_page_cache, stop=self.stop
        )
        job.counters.storage_ns += time.perf_counter_ns() - t0
        if paced:
            w1, c1, q1 = _clocks()
            self.pace.add((w1 - w0) - (q1 - q0), c1 - c0)
        ok = np.ones(len(ks), dtype=bool)
        ok[list(failed)] = False
        job.failed.update({int(ks[j]): e for j, e in failed.items()})
        job.served(ks[ok], STORE)
        job.counters.storage_reads += int(ok.sum())
        job.counters.storage_bytes += int(job.sizes[ks[ok]].sum())

    def admit(self, job: Job) -> None:
        """Nothing: the store is the source."""


class Pace:
    """Storage reads' time, less their thread's waits for a CPU, against the thread's time on a CPU,
    averaged over recent calls: how long a read takes, on idle cores, per CPU second it costs."""

    MIN_FILES = 16  # a call of fewer files is not measured (it would cost more than it tells)
    WEIGHT = 0.2  # of the latest call in the running averages

    def __init__(self):
        self._wall = self._busy = 0.0
        self._lock = threading.Lock()

    def add(self, wall_ns: int, busy_ns: int) -> None:
        """``wall_ns``: a call's time less its waits for a CPU; ``busy_ns``: its time on a CPU."""
        with self._lock:
            if self._busy == 0:
                self._wall, self._busy = float(wall_ns), float(max(busy_ns, 1))
            else:
                w = self.WEIGHT
                self._wall += w * (wall_ns - self._wall)
                self._busy += w * (max(busy_ns, 1) - self._busy)

    def ratio(self) -> float | None:
        return self._wall / self._busy if self._busy else None


def _schedstat() -> tuple[int, int]:
    """This thread's time spent runnable, waiting for a CPU, and how many times it got one
    (``/proc/thread-self/schedstat``'s second and third fields; zeros where there is none)."""
    try:
        with open("/proc/thread-self/schedstat", "rb") as f:
            _, waited, runs = f.read().split()[:3]
        return int(waited), int(runs)
    except (OSError, ValueError):
        return 0, 0


def _clocks() -> tuple[int, int, int]:
    """The wall clock, and at the same instant this thread's time on a CPU and its time spent
    runnable, waiting for one. What a read's wall time has beyond the two, it spent waiting for
    the storage (or for the GIL, while another thread holds it).

    The kernel adds a wait to the thread's total only when the thread gets a CPU again, so a
    thread preempted between reading the total and the clock would count that wait in one and
    not the other (a busy machine preempts at exactly such system calls): the clock is read
    between two readings of the total that saw no preemption in between."""
    for _ in range(4):
        waited, runs = _schedstat()
        wall, cpu = time.perf_counter_ns(), time.thread_time_ns()
        waited2, runs2 = _schedstat()
        if runs2 == runs:
            break
    return wall, cpu, waited2
