"""The pass contract: one pass over (part of) an epoch, iterated like a ``DataLoader`` pass.

Every way coordl delivers batches is a :class:`Pass`: the DALI pass
(:mod:`coordl.backends.dali`), the torch backend's (:mod:`coordl.backends.torch`), an HP
group member's (:mod:`coordl.staging.member`) and DS-Analyzer's phases
(:mod:`coordl.analyze.probe`). The base owns what they share:

- the clock, the per-step waits (:class:`~coordl.accounting.StepWaits`), the batch and sample
  counts, and the statistics (:class:`PassStats`, a typed record; ``stats()`` gives a dict);
- the hooks to the loader's position: ``on_batch(position)`` after every batch the consumer
  receives, ``on_end(pass)`` when the pass delivered its last batch, ``on_stop(pass)`` when it
  was abandoned;
- one way for a background thread's exception to reach the consumer with its original
  traceback (:class:`Channel`);
- ``close()``: idempotent, stops the background work; called on ``break`` (when the iterator is
  garbage collected), on an exception in the consumer's loop, and by the loader.

A subclass implements :meth:`Pass._step` (the next batch, or None at the end) and the
counter hooks. A pass keeps its ``owner`` (the loader) alive while the consumer holds the
pass, as a ``DataLoader`` iterator keeps its ``DataLoader``; its background threads reference
neither, so dropping both lets the garbage collector close them.
"""

from __future__ import annotations

import dataclasses
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from coordl.accounting import StepWaits
from coordl.errors import CoordlError
from coordl.fetch.fetcher import FetchCounters

__all__ = ["END", "Channel", "Pass", "PassStats", "Step"]

END = object()  # a background thread's last item


@dataclass
class PassStats:
    """What one pass did: where its bytes came from and where its time went (``CoordLoader.stats()``).

    Where the bytes came from: ``cache_hits``, ``cache_hit_bytes``, ``peer_reads``,
    ``peer_bytes``, ``storage_reads``, ``storage_bytes``, ``admitted`` (items this process
    put into the cache); the cache: ``cache_bytes`` (resident in the node's cache),
    ``cache_items``, ``cache_budget``. The decoded tier: ``decoded_hits`` and
    ``decoded_hit_bytes`` (images served decoded), ``decoded_admitted`` (images this process
    decoded into it), ``decoded_cache_bytes``, ``decoded_cache_items``, ``decoded_cache_budget``.
    The local-storage tier: ``disk_reads`` and ``disk_bytes`` (samples it served), ``disk_admitted``
    (samples read from storage that this process handed to its writer), of those ``disk_repaired``
    (their entry was damaged: cut, flipped) and ``disk_replaced`` (their entry held another version
    of the sample).
    Where the time went: ``elapsed_s``, ``stall_s``
    (the consumer waited for batches), split into ``stall_fetch_s`` (the pipeline was
    waiting for sample bytes) and ``stall_prep_s`` (it was decoding and augmenting; an HP
    group member's waits are not split), ``compute_s`` (the consumer's own time between
    batches), ``wait_p50_s``/``wait_p95_s``/``wait_max_s`` (per-step waits),
    ``fetch_wait_s`` (the pipeline waited for storage), ``read_s`` (storage reads, summed
    over threads; on the torch backend every read, over workers), ``prep_s`` (DALI: the
    pipeline waited for DALI's outputs; torch backend: decode, transforms and
    ``collate_fn``, summed over workers). Also ``epoch``, ``batches``, ``samples``,
    ``samples_per_s``, ``skipped`` and ``skipped_paths``.
    """

    epoch: int = 0
    batches: int = 0
    samples: int = 0
    cache_hits: int = 0
    cache_hit_bytes: int = 0
    storage_reads: int = 0
    storage_bytes: int = 0
    peer_reads: int = 0
    peer_bytes: int = 0
    peer_served_reads: int = 0
    peer_served_bytes: int = 0
    admitted: int = 0
    cache_bytes: int = 0
    cache_items: int = 0
    cache_budget: int = 0
    decoded_hits: int = 0
    decoded_hit_bytes: int = 0
    decoded_admitted: int = 0
    decoded_cache_bytes: int = 0
    decoded_cache_items: int = 0
    decoded_cache_budget: int = 0
    disk_reads: int = 0
    disk_bytes: int = 0
    disk_admitted: int = 0
    disk_repaired: int = 0
    disk_replaced: int = 0
    stall_s: float = 0.0
    stall_fetch_s: float = 0.0
    stall_prep_s: float = 0.0
    compute_s: float = 0.0
    wait_p50_s: float = 0.0
    wait_p95_s: float = 0.0
    wait_max_s: float = 0.0
    fetch_wait_s: float = 0.0
    read_s: float = 0.0
    prep_s: float = 0.0
    elapsed_s: float = 0.0
    samples_per_s: float = 0.0
    skipped: int = 0
    skipped_paths: list[str] = field(default_factory=list)
    extra: dict = field(default_factory=dict)  # a kind of pass's own figures (an HP group's)

    def as_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "extra"}
        d["skipped_paths"] = list(self.skipped_paths)
        d.update(self.extra)
        return d


@dataclass
class Step:
    """One batch as a pass hands it over.

    Attributes:
        out: what the consumer receives.
        samples: samples in it.
        position: batches of the epoch the consumer has received with this one.
        fetch: seconds of the wait for it that were spent waiting for sample bytes, or None
            when the pass cannot tell (then the wait is not split).
    """

    out: object
    samples: int
    position: int
    fetch: float | None = None


class Channel:
    """Hands a background thread's items, then its end or its failure, to the consumer, in order.

    The failure is the exception object itself, so the consumer raises it with the thread's
    traceback (the consumer's frames are added on top).
    """

    def __init__(self, maxsize: int, stop: threading.Event):
        self._queue: queue.Queue = queue.Queue(maxsize=maxsize)
        self._stop = stop
        self._failure: BaseException | None = None

    def put(self, item) -> bool:
        """Queues ``item``; False when the pass was stopped first."""
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def fail(self, error: BaseException) -> None:
        """The thread failed: the consumer raises ``error`` after the items queued before it."""
        self._failure = error
        self.put(_FAILED)

    def get(self, thread: threading.Thread | None = None):
        """The next item or :data:`END`; raises the thread's failure, or a :class:`CoordlError` if
        ``thread`` died without saying why."""
        while True:
            try:
                item = self._queue.get(timeout=0.1)
                break
            except queue.Empty:
                self.check()
                if thread is not None and not thread.is_alive() and self._queue.empty():
                    raise CoordlError("coordl's pre-processing thread stopped without a result") from None
        if item is _FAILED:
            self.check()
        return item

    def check(self) -> None:
        """Raises the failure of the thread, if it failed (for consumers that poll)."""
        if self._failure is not None:
            raise self._failure

    def drain(self) -> None:
        """Empties the queue, so that a thread blocked on a full queue sees its stop."""
        try:
            while True:
                self._queue.get_nowait()
        except queue.Empty:
            pass


_FAILED = object()


class Pass:
    """The base of every pass: see the module's docstring.

    Args:
        epoch: the epoch delivered.
        start: the epoch's batch the pass starts at (after a resume).
        length: batches this pass delivers at most.
        owner: kept alive while the pass is (the loader).
        on_batch: called with the epoch's delivered-batch count after each batch.
        on_end: called with the pass when it delivered its last batch.
        on_stop: called with the pass when it is closed before its end.
        cache: the node's cache, for the cache figures of the statistics (or None).
        decoded: the node's decoded tier, for its figures (or None).
    """

    def __init__(
        self,
        *,
        epoch: int,
        start: int,
        length: int,
        owner=None,
        on_batch: Callable[[int], None] | None = None,
        on_end: Callable[[Pass], None] | None = None,
        on_stop: Callable[[Pass], None] | None = None,
        cache=None,
        decoded=None,
    ):
        self.epoch = epoch
        self.start = start
        self.length = length
        self.active = True
        self.batches = 0
        self.samples = 0
        self.waits = StepWaits()
        self.stop_event = threading.Event()
        self._owner = owner
        self._on_batch, self._on_end, self._on_stop = on_batch, on_end, on_stop
        self._cache = cache
        self._decoded = decoded
        self._t0 = time.perf_counter()
        self._elapsed: float | None = None
        self._closed = False
        self._pid = os.getpid()  # a forked child's copy is the parent's: it never closes it

    # -- what a kind of pass provides ----------------------------------------------------------
    def _step(self) -> Step | None:
        """The next batch, or None when the pass has delivered its last one."""
        raise NotImplementedError

    def _counters(self) -> FetchCounters:
        """Where this pass's bytes came from so far."""
        return FetchCounters()

    def _figures(self) -> dict:
        """``fetch_wait_s``, ``read_s``, ``prep_s``, ``skipped_paths``, served peer reads/bytes, and
        any figures of the kind of pass (under ``extra``)."""
        return {}

    def _shutdown(self) -> None:
        """Stops the background work (idempotent; may be called from a finaliser)."""

    # -- the iterator ----------------------------------------------------------------------------
    def __iter__(self):
        return self

    def __len__(self) -> int:
        return max(0, self.length - self.batches)

    def __next__(self):
        if not self.active:
            raise StopIteration
        t0 = time.perf_counter()
        try:
            step = self._step()
        except BaseException:
            self.close()
            raise
        wait = time.perf_counter() - t0
        if step is None:
            self.waits.add_tail(wait)
            self._finish()
            raise StopIteration
        self.waits.record(wait, fetch=step.fetch)
        self.batches += 1
        self.samples += step.samples
        if self._on_batch is not None:
            self._on_batch(step.position)
        return step.out

    def _finish(self) -> None:
        self._elapsed = time.perf_counter() - self._t0
        self.active = False
        self._closed = True
        self._shutdown()
        if self._on_end is not None:
            self._on_end(self)

    # -- statistics --------------------------------------------------------------------------------
    @property
    def elapsed_s(self) -> float:
        return self._elapsed if self._elapsed is not None else time.perf_counter() - self._t0

    def stats(self) -> PassStats:
        """This pass's statistics so far (final once it has ended or been closed)."""
        return pass_stats(
            self.epoch,
            self._cache,
            self._counters(),
            decoded=self._decoded,
            batches=self.batches,
            samples=self.samples,
            waits=self.waits,
            elapsed_s=self.elapsed_s,
            **self._figures(),
        )

    # -- lifetime --------------------------------------------------------------------------------
    @property
    def forked(self) -> bool:
        """Whether this is a forked child's copy of the pass (whose threads and memberships are the parent's)."""
        return os.getpid() != self._pid

    def close(self) -> None:
        """Abandons the pass: stops its background work; idempotent. Nothing in a forked child,
        whose copy (collected at its exit) is the parent's pass: in an ``hp_group`` its shutdown
        would leave the group's pass in the parent's name."""
        if self._closed:
            return
        self._closed = True
        if self.forked:
            return
        was_active, self.active = self.active, False
        self.stop_event.set()
        self._shutdown()
        if self._elapsed is None:
            self._elapsed = time.perf_counter() - self._t0
        if was_active and self._on_stop is not None:
            self._on_stop(self)

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - never raise from a finaliser
            pass


# The counters a pass's statistics take as they are (the others, times in ns, become seconds).
_COUNTED = [
    f.name for f in dataclasses.fields(FetchCounters) if f.name in {g.name for g in dataclasses.fields(PassStats)}
]


def pass_stats(
    epoch: int,
    cache,
    c: FetchCounters,
    *,
    decoded=None,
    batches: int = 0,
    samples: int = 0,
    waits: StepWaits | None = None,
    elapsed_s: float = 0.0,
    fetch_wait_s: float = 0.0,
    read_s: float | None = None,
    prep_s: float = 0.0,
    skipped_paths: list[str] = (),
    served: tuple[int, int] = (0, 0),
    extra: dict | None = None,
) -> PassStats:
    """A pass's statistics from its counters (``read_s`` defaults to the counters' storage time)."""
    s = PassStats(
        epoch=epoch,
        batches=batches,
        samples=samples,
        **{name: getattr(c, name) for name in _COUNTED},  # where the bytes came from, as counted
        peer_served_reads=served[0],
        peer_served_bytes=served[1],
        cache_bytes=cache.resident_bytes if cache is not None else 0,
        cache_items=cache.resident_items if cache is not None else 0,
        cache_budget=cache.budget if cache is not None else 0,
        decoded_cache_bytes=decoded.resident_bytes if decoded is not None else 0,
        decoded_cache_items=decoded.resident_items if decoded is not None else 0,
        decoded_cache_budget=decoded.budget if decoded is not None else 0,
        fetch_wait_s=fetch_wait_s,
        read_s=c.storage_ns / 1e9 if read_s is None else read_s,
        prep_s=prep_s,
        elapsed_s=elapsed_s,
        samples_per_s=samples / elapsed_s if elapsed_s > 0 else 0.0,
        skipped=len(skipped_paths),
        skipped_paths=list(skipped_paths)[:100],
        extra=dict(extra or {}),
    )
    for key, value in (waits or StepWaits()).summary(elapsed_s).items():
        setattr(s, key, value)
    return s
