"""Always-on accounting of where a loader's time goes: cheap enough to leave on.

Per step, the consumer's wait for its batch is recorded, and split into *fetch-bound*
(the pipeline was waiting for sample bytes) and *prep-bound* (it was decoding and
augmenting) where the pipeline can tell: a :class:`BusyClock` runs while the pipeline's
driver waits for storage, and the part of a consumer's wait during which that clock ran is
fetch-bound. A step costs two ``perf_counter`` calls and an append.
"""

from __future__ import annotations

import sys
import time
from array import array

import numpy as np

from coordl.units import format_bytes

__all__ = ["BusyClock", "StepWaits", "epoch_line", "standing_fields"]


class BusyClock:
    """Total time one thread spends in a state, readable from another thread mid-state."""

    __slots__ = ("_since", "_total")

    def __init__(self):
        self._total = 0.0
        self._since: float | None = None

    def enter(self) -> None:
        self._since = time.perf_counter()

    def leave(self) -> None:
        since, self._since = self._since, None
        if since is not None:
            self._total += time.perf_counter() - since

    def total(self) -> float:
        """Seconds spent in the state so far, counting the one in progress."""
        since, total = self._since, self._total
        return total + (time.perf_counter() - since if since is not None else 0.0)


class StepWaits:
    """The consumer's wait for each batch of a pass, and its fetch/prep split."""

    def __init__(self):
        self.waits = array("d")
        self.total = 0.0
        self.fetch = 0.0
        self.prep = 0.0

    def record(self, wait: float, fetch: float | None = None, prep: float | None = None) -> None:
        """One step's wait; ``fetch`` (and ``prep``) are its attributed parts, None when unknown.

        With only ``fetch`` given, the rest of the wait is prep-bound.
        """
        self.waits.append(wait)
        self.total += wait
        if fetch is None:
            return
        fetch = min(max(fetch, 0.0), wait)
        self.fetch += fetch
        self.prep += wait - fetch if prep is None else min(max(prep, 0.0), wait - fetch)

    def add_tail(self, wait: float) -> None:
        """Time waited for the end of the pass (not a step): counted, not a step."""
        self.total += wait

    def summary(self, elapsed_s: float) -> dict:
        w = np.frombuffer(self.waits, dtype=np.float64) if len(self.waits) else np.zeros(1)
        p50, p95 = np.percentile(w, [50, 95])
        return {
            "stall_s": self.total,
            "stall_fetch_s": self.fetch,
            "stall_prep_s": self.prep,
            "compute_s": max(0.0, elapsed_s - self.total),
            "wait_p50_s": float(p50),
            "wait_p95_s": float(p95),
            "wait_max_s": float(w.max()),
        }


def epoch_line(s: dict, rank: int) -> str:
    """One line summing up an epoch's ``stats()``."""
    el = s["elapsed_s"]
    pct = 100 * s["stall_s"] / el if el > 0 else 0.0
    line = (
        f"coordl: epoch {s['epoch']} rank {rank}: {s['samples']} samples in {el:.2f} s ({s['samples_per_s']:.0f}/s); "
        f"waited {s['stall_s']:.2f} s ({pct:.0f}%: fetch {s['stall_fetch_s']:.2f} s, prep {s['stall_prep_s']:.2f} s); "
        f"cache {s['cache_hits']} hits {format_bytes(s['cache_hit_bytes'], 'MB')}"
    )
    if s["peer_reads"]:
        line += f", peers {s['peer_reads']} reads {format_bytes(s['peer_bytes'], 'MB')}"
    line += f", storage {s['storage_reads']} reads {format_bytes(s['storage_bytes'], 'MB')}"
    if s["skipped"]:
        line += f", skipped {s['skipped']}"
    return line


def print_epoch_line(s: dict, rank: int) -> None:
    print(epoch_line(s, rank), file=sys.stderr, flush=True)


def standing_fields(index, disk_tier) -> dict:
    """What a loader's ``stats()`` adds to its pass's counters, whatever pass ran: what the index's
    check found changed (``index_changed``), what indexing a detection dataset left out
    (``index_skipped``), and what the local-storage tier holds and may hold (``disk_cache_bytes``,
    ``disk_cache_budget``)."""
    out = {"index_changed": index.changed}
    if index.boxes is not None:
        out["index_skipped"] = dict(index.boxes.skipped)
    if disk_tier is not None and not disk_tier.closed:
        out["disk_cache_bytes"], out["disk_cache_budget"] = disk_tier.used(), disk_tier.budget
    return out
