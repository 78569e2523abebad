"""The pass of a loader with remote prep: units of work to Ray actors and to the local pipeline,
batches to the training loop in order.

Three threads share a :class:`~coordl.remote.handout.Units`: the *remote* thread hands units to the
ready actors (two each, so none idles between units), with their bytes read ahead on the I/O
pool for actors that cannot read the dataset (:mod:`coordl.remote.shipping`), collects their
results, and runs again the units of an actor that died; the *local* thread (``RayPrep(local=True)``) runs units through
the loader's own pipeline (DALI, or the torch backend's ``DataLoader``), taking the next one
whenever it has room; the consumer takes results in order. Neither thread holds the pass or the
loader, so a pass the consumer drops is collected and closed.
"""

from __future__ import annotations

import collections
import logging
import threading
import time

import numpy as np
import torch

from coordl import compat, lifecycle
from coordl.errors import CoordlError
from coordl.fetch.ahead import FetchAhead, Stopped
from coordl.fetch.fetcher import FetchCounters
from coordl.passes import Pass, Step
from coordl.remote.actors import START_TIMEOUT_S, RemotePrep
from coordl.remote.cluster import DEPTH, Dispatch
from coordl.remote.handout import EMPTY, LOCAL, REMOTE, Rate, Units
from coordl.remote.shipping import TrainerReads
from coordl.remote.worker import Arrays, Done, Unit
from coordl.threads import daemon_pool

__all__ = ["EMPTY_REMOTE_STATS", "RayPass", "own_tensor", "own_tensors"]

#: A remote pass's own figures (``stats()`` has them, zero, before the first pass).
EMPTY_REMOTE_STATS = {
    "remote_units": 0,
    "local_units": 0,
    "remote_workers": 0,
    "remote_retried": 0,
    "remote_lost_s": 0.0,
    "remote_result_bytes": 0,
    "remote_shipped_bytes": 0,
}

log = logging.getLogger(__name__)


class Tally:
    """What the runners did in one pass, beside the trainer's own fetcher's counters."""

    def __init__(self):
        self.lock = threading.Lock()
        self.counters = FetchCounters()  # actors' reads, and the local torch workers'
        self.read_s = 0.0
        self.prep_s = 0.0
        self.remote_units = 0
        self.local_units = 0
        self.lost_s = 0.0  # actor time lost to actors that died
        self.result_bytes = 0  # prepared batches that came over from actors
        self.shipped_bytes = 0  # encoded bytes the trainer sent to actors
        self.skipped: list[tuple[int, str, str]] = []

    def ratio(self) -> float:
        """Units the actors made per unit the local pipeline made, so far."""
        return self.remote_units / max(1, self.local_units)

    def add(self, counters: dict, read_s: float, prep_s: float, skipped) -> None:
        with self.lock:
            self.counters += counters or {}
            self.read_s += read_s
            self.prep_s += prep_s
            self.skipped += list(skipped)


class RayPass(Pass):
    """One pass whose units run on Ray actors and (``local``) the loader's pipeline.

    Args:
        resources: the loader's collaborators; ``resources.remote`` is the
            :class:`~coordl.remote.actors.RemotePrep`, ``resources.prep`` / ``resources.dataloader``
            the local pipeline.
        config: the loader's settings.
        batches: sample ids of each batch, in delivery order.
        backend: ``"dali"`` or ``"torch"``.
        order_epoch: the epoch whose order ``batches`` follow (it keys the draws).
        persistent: the torch backend's local workers outlive the pass.
        pin_memory: the torch backend's ``pin_memory_device`` when ``pin_memory=True`` (``""``: the
            current one): batches from actors are pinned as the local workers' are. None: not pinned.
        **hooks: ``epoch``, ``start``, ``owner``, ``on_batch``, ``on_end``, ``on_stop`` (see :class:`Pass`).
    """

    def __init__(
        self,
        resources,
        config,
        batches: list[np.ndarray],
        *,
        backend: str,
        order_epoch: int,
        persistent: bool = False,
        pin_memory: str | None = None,
        **hooks,
    ):
        super().__init__(length=len(batches), cache=resources.cache, **hooks)
        self._res = resources
        self._backend = backend
        self._return_index = config.return_index
        self._order_epoch = order_epoch
        self._pin = pin_memory
        self._remote: RemotePrep = resources.remote
        self._n = 0
        self._tally = Tally()
        self._rate = Rate()
        resources.fetcher.reset_counters()
        self._prep0 = resources.prep.waiting.total() if resources.prep is not None else 0.0
        remote, tally, local = self._remote, self._tally, self._remote.options.local
        depth = _local_depth(backend, config, resources.dataloader) if local else 0
        # The local pipeline may also hold the results the loop has not taken while it waits for
        # an actor's unit (in order): two per actor's, as the actors hold two each.
        # (The threads hold the units, and so the bound's callable: it must not hold the pass.)
        self._units = Units(
            len(batches),
            lambda: remote.bound(depth, tally.ratio()),
            self.stop_event,
            local_depth=depth + DEPTH + 2 if depth else None,
        )
        self._ahead = None
        if backend == "dali":
            self._ahead = resources.fetch_ahead([], config, self.stop_event)  # units come as they are claimed
        args = (self._units, batches, order_epoch, self.stop_event, self._tally)
        self._threads = [
            threading.Thread(
                target=_drive_remote,
                args=(self._remote, self._ahead, resources.fetcher, local, self._rate, *args),
                name="coordl-ray",
                daemon=True,
            )
        ]
        if local and backend == "dali":
            target, extra = _drive_local_dali, (resources.prep, self._ahead, resources.index.paths)
        elif local:
            target, extra = _drive_local_torch, (resources.dataloader, config.seed, persistent)
        if local:
            self._threads.append(threading.Thread(target=target, args=(*extra, *args), name="coordl-prep", daemon=True))
        # started by the first batch asked for

    def _runners_left(self) -> bool:
        """Whether a thread of this pass that makes units (for the actors, or here) still runs."""
        return any(t.is_alive() for t in self._threads)

    def _step(self) -> Step | None:
        if self._threads[0].ident is None:
            for t in self._threads:
                t.start()
        t0 = time.perf_counter()
        while self._n < self.length:
            result = self._units.take(self._n, self._runners_left)
            self._n += 1
            step = self._to_step(result)
            if step is not None:
                self._rate.add(time.perf_counter() - t0)
                return step
            if self._on_batch is not None:  # every sample skipped: received, as a DataLoader skips nothing
                self._on_batch(self.start + self._n)
        self._rate.add(time.perf_counter() - t0)
        return None

    def _to_step(self, result) -> Step | None:
        position = self.start + self._n
        if result is EMPTY:
            return None
        if isinstance(result, Done):
            if result.fetched is not None:
                result.fetched.batch = own_tensors(result.fetched.batch, pinned=self._pin is not None)
                if self._pin is not None and result.fetched.batch is not None:  # as the local workers' are
                    result.fetched.pin_memory(self._pin or None)  # what came pickled; the arrays are pinned
                return self._torch_step(result.fetched, position)
            if result.images is None:
                return None
            images = self._from_actor(result.images)
            labels, ids = torch.from_numpy(np.array(result.labels)), torch.from_numpy(np.array(result.ids))
        elif self._backend == "torch":
            return self._torch_step(result, position)
        else:
            images, labels, ids = result
        return Step(self._res.delivery(images, labels, ids, self._order_epoch), len(labels), position)

    def _torch_step(self, fetched, position: int) -> Step | None:
        from coordl.backends.torch import failure_error
        from coordl.delivery import with_ids

        if fetched.failure is not None:
            raise failure_error(fetched.failure)
        if fetched.batch is None:
            return None
        out = fetched.batch
        if self._return_index:
            out = with_ids(out, torch.tensor(fetched.ids, dtype=torch.int64))
        return Step(out, len(fetched.ids), position)

    def _from_actor(self, images: np.ndarray) -> torch.Tensor:
        """An actor's images as the local pipeline gives them: a tensor of its own (Ray's array is
        a read-only view of the object store), on the trainer's device, normalised if sent as uint8.

        One copy out of the store: on a GPU trainer into pinned memory, from which the copy to the
        GPU runs asynchronously; on the CPU into the tensor the loop gets, cast to float32 on the
        way when it is normalised here."""
        remote = self._remote
        gpu = remote.device_id is not None
        t = own_tensor(images, dtype=torch.float32 if remote.normalize is not None and not gpu else None, pinned=gpu)
        if gpu:
            t = t.to(f"cuda:{remote.device_id}", non_blocking=True)
        if remote.normalize is not None:  # in place, as an HP group's consumer normalises (2.6x faster)
            t = remote.normalize(t)
        return t

    def _counters(self) -> FetchCounters:
        return self._res.fetcher.counters + self._tally.counters

    def _figures(self) -> dict:
        t, remote, prep = self._tally, self._remote, self._res.prep
        skipped = list(t.skipped)
        prep_s = t.prep_s
        if self._ahead is not None:
            skipped += self._ahead.skipped
        if prep is not None:
            prep_s += prep.waiting.total() - self._prep0
        return {
            "fetch_wait_s": self._ahead.wait_s if self._ahead is not None else 0.0,
            "read_s": self._res.fetcher.counters.storage_ns / 1e9 + t.read_s,
            "prep_s": prep_s,
            "skipped_paths": [p for _, p, _ in skipped],
            "extra": {
                "remote_units": t.remote_units,
                "local_units": t.local_units,
                "remote_workers": len(remote.pool.ready),
                "remote_retried": self._units.retried,
                "remote_lost_s": t.lost_s,
                "remote_result_bytes": t.result_bytes,
                "remote_shipped_bytes": t.shipped_bytes,
            },
        }

    def _shutdown(self) -> None:
        self.stop_event.set()
        if self._res.peers is not None:  # after the requests in flight, the other nodes hear it is done
            self._res.peers.pass_done()
        me = threading.current_thread()
        for t in self._threads:
            if t is not me and t.ident is not None:
                lifecycle.join(t)  # at most the SIGTERM deadline while the process is ending


def _local_depth(backend: str, config, dataloader) -> int:
    """Units the local pipeline holds to keep busy: its fetches ahead and DALI's queue, or the
    DataLoader's prefetch."""
    if backend == "dali":
        from coordl.prep.dali import QUEUE_DEPTH

        return config.batches_ahead + 1 + QUEUE_DEPTH
    workers = dataloader.num_workers
    return workers * (dataloader.prefetch_factor or 2) if workers else 1


def _drive_remote(
    remote: RemotePrep, ahead, fetcher, local: bool, rate: Rate, units: Units, batches, order_epoch, stop, tally: Tally
) -> None:
    """The remote thread: units to ready actors, results back, re-runs after a death."""
    lifecycle.quiet_thread()
    pool = remote.pool
    dispatch = Dispatch(pool)
    pixels = remote.normalize is not None
    since = time.monotonic()  # when the pool last had a ready actor
    io = None if ahead is not None else daemon_pool(DEPTH, "coordl-ray-reads")  # the torch backend's reads
    reads = TrainerReads(ahead, fetcher=fetcher, pool=io, stop=stop)

    def read_ahead() -> None:
        """Reads submitted for the units the actors reading through the trainer take next: as many
        as they hold (within the remote bound, which counts these units)."""
        want = DEPTH * sum(info["reads"] == "trainer" for info in pool.ready.values())
        while len(reads) < want:
            n = units.claim(REMOTE, block=False)
            if n is None:
                return
            reads.submit(Unit(n, batches[n], order_epoch, pixels=pixels), n)

    def next_unit(info):
        if not reads and info["reads"] == "trainer":
            read_ahead()
        if reads:  # read already (an actor that reads for itself takes them too)
            unit, n = reads.take()
            with tally.lock:
                tally.shipped_bytes += sum(len(x) for x in unit.data if x is not None)
            read_ahead()
            return unit, n
        n = units.claim(REMOTE, block=False)
        return None if n is None else (Unit(n, batches[n], order_epoch, pixels=pixels), n)

    try:
        while not units.finished():
            remote.scale(rate, units.ready())
            dispatch.fill(next_unit)
            read_ahead()
            if pool.ready:
                since = time.monotonic()
            elif reads:  # read for actors that are gone: the local pipeline, or the next actor, runs them
                for n in reversed(reads.keys()):
                    units.give_back(n)
                reads.cancel()
            if not local and time.monotonic() - since > START_TIMEOUT_S:
                raise CoordlError(
                    f"coordl: no RayPrep actor has been ready for {START_TIMEOUT_S:.0f} s and RayPrep(local=False): "
                    "the cluster has no free CPUs for them (see `ray status`)"
                )
            if not dispatch:
                units.wait(0.05)
                continue
            for actor, n, lost, done, died in dispatch.results(timeout=0.05):
                if died:
                    with tally.lock:
                        tally.lost_s += lost
                    units.retry(n)
                    remote.died(actor, done, lost)
                    continue
                if isinstance(done, BaseException):
                    raise done
                if units.put(n, done):
                    with tally.lock:
                        tally.remote_units += 1
                        tally.result_bytes += _nbytes(done.images if done.fetched is None else done.fetched.batch)
                    tally.add(done.counters, done.read_s, done.prep_s, done.skipped)
    except Stopped:
        return
    except BaseException as e:  # noqa: BLE001 - the consumer raises it
        if not stop.is_set():
            units.fail(e)
    finally:
        dispatch.cancel()
        reads.cancel()
        if io is not None:
            io.shutdown(wait=False, cancel_futures=True)


def _drive_local_dali(prep, ahead: FetchAhead, paths, units: Units, batches, order_epoch, stop, tally: Tally) -> None:
    """The local thread (DALI): runs of the pipeline over the units it takes, each run ending
    when no unit is free now (so that DALI hands back what it holds)."""
    lifecycle.quiet_thread()
    try:
        while not stop.is_set():
            first = units.claim(LOCAL, block=True)
            if first is None:
                return
            fed: collections.deque[int] = collections.deque()
            feed = _local_feed(first, units, ahead, batches, order_epoch, fed, stop)
            for images, labels, ids, number in prep.epoch(feed, paths.__getitem__, order_epoch):
                while fed and fed[0] != number:  # fed before it and not returned: every sample skipped
                    units.put(fed.popleft(), EMPTY)
                if fed:
                    fed.popleft()
                if units.put(number, (images, labels, ids)):
                    with tally.lock:
                        tally.local_units += 1
            while fed:
                units.put(fed.popleft(), EMPTY)
    except Stopped:
        return
    except BaseException as e:  # noqa: BLE001 - the consumer raises it
        if not stop.is_set():
            units.fail(e)


def _local_feed(first: int, units: Units, ahead: FetchAhead, batches, order_epoch: int, fed, stop):
    pending = collections.deque([ahead.submit(batches[first], first)])
    while pending and not stop.is_set():
        while len(pending) <= ahead.depth:
            n = units.claim(LOCAL, block=False)
            if n is None:
                break
            pending.append(ahead.submit(batches[n], n))
        raw = ahead.receive(pending.popleft())
        raw.epoch = order_epoch
        fed.append(raw.number)
        yield raw


class _Run:
    """The local DataLoader's batches for one run: the units the local thread takes while it can."""

    def __init__(self, first: int, units: Units, batches, seed: int, order_epoch: int, numbers, stop):
        self._args = (first, units, batches, seed, order_epoch, numbers, stop)

    def __len__(self) -> int:
        units = self._args[1]
        return units.count

    def __iter__(self):
        from coordl.backends.torch import Batch

        n, units, batches, seed, order_epoch, numbers, stop = self._args
        while n is not None and not stop.is_set():
            numbers.append(n)
            yield Batch(batches[n].tolist(), seed, order_epoch)
            n = units.claim(LOCAL, block=False)


def _drive_local_torch(
    dataloader, seed: int, persistent: bool, units: Units, batches, order_epoch, stop, tally: Tally
) -> None:
    """The local thread (torch backend): runs of the loader's DataLoader over the units it takes."""
    lifecycle.quiet_thread()
    try:
        while not stop.is_set():
            first = units.claim(LOCAL, block=True)
            if first is None:
                return
            numbers: collections.deque[int] = collections.deque()
            dataloader.batch_sampler.batches = _Run(first, units, batches, seed, order_epoch, numbers, stop)
            it = iter(dataloader)
            try:
                for fetched in it:
                    tally.add(fetched.counters, fetched.read_s, fetched.prep_s, fetched.skipped)
                    if units.put(numbers.popleft(), fetched):
                        with tally.lock:
                            tally.local_units += 1
                    if stop.is_set():
                        return
            finally:
                if not persistent:
                    compat.shutdown_iterator_workers(it)
    except BaseException as e:  # noqa: BLE001 - the consumer raises it
        if not stop.is_set():
            units.fail(e)


def own_tensor(array: np.ndarray, *, dtype: torch.dtype | None = None, pinned: bool = False) -> torch.Tensor:
    """``array`` (a read-only view of Ray's object store) as a tensor of its own, in one copy: into
    memory torch allocates (page-locked when ``pinned``), cast to ``dtype`` on the way."""
    out = torch.empty(array.shape, dtype=dtype or torch.from_numpy(np.empty(0, array.dtype)).dtype, pin_memory=pinned)
    np.copyto(out.numpy(), array)
    return out


def own_tensors(batch, *, pinned: bool = False):
    """:func:`~coordl.remote.worker.as_tensors` in one copy per array (:func:`own_tensor`, pinned
    when ``pinned``): a collated batch's arrays, in tuples, lists, dicts and namedtuples, as tensors
    of their own."""
    if isinstance(batch, Arrays):
        return own_tensor(batch.array, pinned=pinned)
    if isinstance(batch, dict):
        items = {k: own_tensors(v, pinned=pinned) for k, v in batch.items()}
        try:
            return type(batch)(items)
        except TypeError:  # a mapping type that is not made from a dict: as default_collate, a dict
            return items
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(own_tensors(v, pinned=pinned) for v in batch))
    if isinstance(batch, (tuple, list)):
        return type(batch)(own_tensors(v, pinned=pinned) for v in batch)
    return batch


def _nbytes(batch) -> int:
    """Bytes of the arrays and tensors in a batch (nested in tuples, lists and dicts)."""
    if isinstance(batch, (np.ndarray, torch.Tensor)):
        return int(batch.nbytes)
    if isinstance(batch, Arrays):  # a tensor on its way
        return int(batch.array.nbytes)
    if isinstance(batch, dict):
        return sum(_nbytes(v) for v in batch.values())
    if isinstance(batch, (list, tuple)):
        return sum(_nbytes(v) for v in batch)
    return 0
