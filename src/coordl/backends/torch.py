"""The torch backend: PyTorch's ``DataLoader`` workers read through the node's cache and run the
dataset's own Python decoding and transforms.

:class:`~coordl.CoordLoader` keeps what makes it coordl (the order of every epoch, sharding,
resume, the MinIO cache, statistics) and hands the rest to ``torch.utils.data.DataLoader``:
worker processes, prefetching, ``collate_fn``, ``pin_memory``, worker seeding, timeouts. The
``DataLoader`` gets

- a batch sampler holding this pass's batches (coordl's order, from the resume position), each
  a :class:`Batch`: the sample ids and the key of their random draws, ``(seed, order_epoch)``;
- :class:`Items`, whose ``__getitems__`` runs in a worker: it fetches each sample's bytes
  through a :class:`~coordl.fetch.fetcher.Fetcher` attached to the node's cache *by that worker*
  (a forked worker must not use its parent's locks), decodes them with the dataset, applies
  the transforms, and returns them with where the bytes came from;
- :class:`SampleDraws`, which seeds torch's, Python's and NumPy's global generators before each
  sample from :func:`coordl.draws.sample_seeds` and puts their states back after the batch, so
  that a sample's random transforms draw the same numbers in a given epoch whichever rank,
  world size, batch, worker or resume delivers it;
- :class:`Collate`, which calls the user's ``collate_fn`` in the worker and passes the
  accounting through, so the main process sums it without any shared counters.

A sample that cannot be read or decoded comes back as a failure record, raised in the main
process as the same :class:`~coordl.SampleError` the DALI path raises (``on_error="raise"``), or
left out of its batch (``"skip"``). Errors in transforms and ``collate_fn`` are the user's and
propagate as ``DataLoader`` reports them.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing.util
import os
import random
import time
import traceback

import numpy as np
import torch
from torch.utils.data import DataLoader, default_collate

from coordl import compat, draws
from coordl.datasets import as_file
from coordl.delivery import with_ids
from coordl.errors import CoordlError, DatasetChangedError, SampleError
from coordl.fetch.fetcher import FetchCounters, Fetcher
from coordl.fetch.spec import CacheSpec
from coordl.passes import Pass, Step

__all__ = [
    "Batch",
    "Collate",
    "EpochBatches",
    "Fetched",
    "Items",
    "SampleDraws",
    "TorchPass",
    "make_dataloader",
    "over_cache",
    "failure_error",
    "seed_for",
]

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Fetched:
    """One batch as a worker returns it: the collated batch and its accounting."""

    batch: object = None
    items: list | None = None
    ids: list[int] = dataclasses.field(default_factory=list)
    skipped: list[tuple[int, str, str]] = dataclasses.field(default_factory=list)  # (id, path, why)
    counters: dict | None = None
    read_s: float = 0.0
    prep_s: float = 0.0
    failure: tuple[str, str, str, int, str] | None = None  # (kind, message, path, id, worker traceback)

    def pin_memory(self, device=None) -> Fetched:
        """Called by the DataLoader's pinning thread: pins the batch, as it would pin a batch."""
        if self.batch is not None:
            self.batch = compat.pin_memory(self.batch, device)
        return self


@dataclasses.dataclass(frozen=True)
class Batch:
    """One batch as the batch sampler hands it to a worker: the sample ids and the key of their
    random draws. It travels with every batch because :class:`Items` reaches a persistent worker
    only once, when the worker starts."""

    ids: list[int]
    seed: int  # the loader's seed
    epoch: int  # the epoch whose order the batch follows


class SampleDraws:
    """The global generators a transform draws from, keyed per sample by ``(seed, epoch, sample)``.

    ``with SampleDraws(batch) as d:`` saves the states of torch's default CPU generator, Python's
    ``random`` and NumPy's legacy ``np.random``; ``d.seed(k)`` seeds all three for the batch's
    ``k``-th sample; leaving the block puts the saved states back (also on an error), so a
    process's own streams go on as if the batch had not been made. A plain list of ids has no
    key: then nothing is seeded or saved.

    The three seeds come from different bits of the sample's 63-bit seed, so the generators do
    not repeat each other's streams: torch's Mersenne Twister is seeded by the low 32 bits (it
    ignores the others), NumPy's by the high 32, Python's by all 63.
    """

    def __init__(self, batch: Batch | list[int]):
        keyed = isinstance(batch, Batch)
        self._seeds = draws.sample_seeds(batch.seed, batch.epoch, batch.ids).tolist() if keyed else None
        self._saved = None

    def __enter__(self) -> SampleDraws:
        if self._seeds is not None:
            # Saved once a batch: NumPy's get/set_state cost ~65 us together, seeding ~1.5 us.
            self._saved = (torch.default_generator.get_state(), random.getstate(), np.random.get_state())
        return self

    def seed(self, k: int) -> None:
        """Seeds the generators for the batch's ``k``-th sample (nothing for an unkeyed batch)."""
        if self._seeds is not None:
            s = self._seeds[k]
            torch.default_generator.manual_seed(s)  # not torch.manual_seed: that seeds every device (~125 us)
            random.seed(s)
            np.random.seed(s >> 31)

    def __exit__(self, *exc) -> None:
        if self._saved is not None:
            t, r, n = self._saved
            torch.default_generator.set_state(t)
            random.setstate(r)
            np.random.set_state(n)
            self._saved = None


class Items(torch.utils.data.Dataset):
    """The dataset as the DataLoader sees it: fetches, decodes and transforms a batch of ids."""

    def __init__(self, dataset, fetcher: Fetcher, cache: CacheSpec | None, on_error: str, disk=None):
        self.dataset = dataset
        self.index = dataset.index
        self.cache = cache
        self.disk = disk  # the local-storage tier's DiskSpec, or None
        self.on_error = on_error
        self._pid = os.getpid()
        self._fetcher: Fetcher | None = fetcher  # the loader's, used in its own process

    def __len__(self) -> int:
        return len(self.index)

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_fetcher"], state["_pid"] = None, None  # a spawned worker attaches by itself
        return state

    def fetcher(self) -> Fetcher:
        """This process's fetcher: a worker attaches to the node's cache on its first batch."""
        if self._pid != os.getpid() or self._fetcher is None:
            cache = self.cache.attach(self.index.sizes) if self.cache is not None else None
            disk = self.disk.open() if self.disk is not None else None
            if disk is not None:  # the samples it still has to write, when the worker ends
                multiprocessing.util.Finalize(disk, disk.close, exitpriority=10)
            self._fetcher = Fetcher(self.index, cache, drop_page_cache=cache is not None, disk=disk)
            self._pid = os.getpid()
        return self._fetcher

    def __getitem__(self, i: int):
        raise TypeError("coordl's torch backend fetches whole batches; use __getitems__")

    def __getitems__(self, batch: Batch | list[int]) -> Fetched:
        """Fetches, decodes and transforms a batch: a :class:`Batch` (its samples' random draws
        keyed by ``(seed, epoch, sample)``) or a list of ids (the generators left as they are)."""
        return self.prepare(batch)

    def prepare(self, batch: Batch | list[int], data: list | None = None, errors: dict | None = None) -> Fetched:
        """:meth:`__getitems__`, or (``data``) the same on bytes read elsewhere: the encoded bytes
        of each sample (None where reading failed, with the :class:`SampleError` in ``errors``)."""
        with SampleDraws(batch) as sample_draws:
            return self._fetch(batch.ids if isinstance(batch, Batch) else batch, sample_draws, data, errors)

    def _fetch(self, ids: list[int], sample_draws: SampleDraws, data=None, errors=None) -> Fetched:
        ds, paths = self.dataset, self.index.paths
        out = Fetched(items=[])
        t0 = time.perf_counter()
        if data is None:
            try:
                data, errors = self.fetcher().gather(np.asarray(ids, dtype=np.int64))
            except DatasetChangedError as e:
                out.failure = ("changed", str(e), "", -1, traceback.format_exc())
                data = []
        t_read, t_prep = time.perf_counter() - t0, 0.0
        for k, (i, raw) in enumerate(zip(ids, data)):
            if raw is None:
                e = errors[int(i)]
                if self._failed(out, i, str(e), "unreadable", "".join(traceback.format_exception(e))):
                    break
                continue
            t1 = time.perf_counter()
            sample_draws.seed(k)  # before decode: a decoder's draws (a random audio offset) are keyed too
            try:
                sample = ds.decode(as_file(raw, paths[i]))
            except Exception as e:  # noqa: BLE001 - any decoder's failure is this sample's
                message = f"cannot decode sample {i} ({paths[i]}): {type(e).__name__}: {e}"
                if self._failed(out, i, message, "undecodable"):
                    break
                t_prep += time.perf_counter() - t1
                continue
            out.items.append(ds.item(sample, i))  # a transform's error is the user's: it propagates
            out.ids.append(int(i))
            t_prep += time.perf_counter() - t1
        out.counters = self.fetcher().reset_counters().as_dict()
        out.read_s, out.prep_s = t_read, t_prep
        return out

    def _failed(self, out: Fetched, i: int, message: str, why: str, tb: str | None = None) -> bool:
        """Records a bad sample; True when the batch must stop (``on_error="raise"``). ``tb``: the
        failure's traceback, when it is not the exception being handled."""
        path = self.index.paths[i]
        if self.on_error == "raise":
            out.failure = ("sample", message, path, int(i), tb or traceback.format_exc())
            return True
        out.skipped.append((int(i), path, why))
        return False


class Collate:
    """Runs the user's ``collate_fn`` in the worker; an all-skipped batch collates to None."""

    def __init__(self, collate_fn=None):
        self.collate_fn = collate_fn or default_collate

    def __call__(self, fetched: Fetched) -> Fetched:
        if fetched.failure is None and fetched.items:
            t0 = time.perf_counter()
            fetched.batch = self.collate_fn(fetched.items)
            fetched.prep_s += time.perf_counter() - t0
        fetched.items = None
        return fetched


class EpochBatches:
    """The DataLoader's batch sampler: the batches of the current pass, set before each pass."""

    def __init__(self):
        self.batches: list[Batch] = []

    def __iter__(self):
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


def over_cache(dataloader: DataLoader, fetcher: Fetcher, cache: CacheSpec | None) -> DataLoader:
    """A DataLoader like ``dataloader`` (same dataset, settings and generator) whose workers read
    through another cache: ``cache``, which ``fetcher`` reads in this process."""
    items: Items = dataloader.dataset
    return DataLoader(
        Items(items.dataset, fetcher, cache, items.on_error),
        batch_sampler=EpochBatches(),
        num_workers=dataloader.num_workers,
        collate_fn=dataloader.collate_fn,
        pin_memory=dataloader.pin_memory,
        timeout=dataloader.timeout,
        worker_init_fn=dataloader.worker_init_fn,
        multiprocessing_context=dataloader.multiprocessing_context,
        generator=dataloader.generator,
        prefetch_factor=dataloader.prefetch_factor,
        persistent_workers=dataloader.persistent_workers,
        pin_memory_device=dataloader.pin_memory_device,
    )


def make_dataloader(items: Items, batch_sampler: EpochBatches, options, generator: torch.Generator) -> DataLoader:
    """The DataLoader that runs the backend's passes (built once, so persistent workers persist).

    Args:
        options: the loader's :class:`~coordl.config.TorchOptions`.
    """
    o = options
    return DataLoader(
        items,
        batch_sampler=batch_sampler,
        num_workers=o.num_workers,
        collate_fn=Collate(o.collate_fn),
        pin_memory=o.pin_memory,
        timeout=o.timeout,
        worker_init_fn=o.worker_init_fn,
        multiprocessing_context=o.multiprocessing_context,
        generator=generator,
        prefetch_factor=o.prefetch_factor,
        persistent_workers=o.persistent_workers,
        pin_memory_device=o.pin_memory_device,
    )


class TorchPass(Pass):
    """One pass of the torch backend over ``batches``, iterated like a DataLoader pass.

    Args:
        resources: the loader's collaborators; ``resources.dataloader`` runs the pass (its batch
            sampler, an :class:`EpochBatches`, is set to ``batches``).
        config: the loader's settings.
        batches: sample ids of each batch, in delivery order.
        persistent: the workers outlive the pass (``persistent_workers=True``).
        workers: the DataLoader's worker processes.
        order_epoch: the epoch whose order ``batches`` follow (default: ``epoch``); with
            ``config.seed`` it keys the samples' random draws (see :class:`SampleDraws`).
        **hooks: ``epoch``, ``start``, ``owner``, ``on_batch``, ``on_end``, ``on_stop`` (see :class:`Pass`).
    """

    def __init__(
        self,
        resources,
        config,
        batches: list[np.ndarray],
        *,
        persistent: bool,
        workers: int,
        order_epoch: int | None = None,
        **hooks,
    ):
        super().__init__(length=len(batches), cache=resources.cache, **hooks)
        self.order_epoch = self.epoch if order_epoch is None else order_epoch
        self._return_index = config.return_index
        self._persistent = persistent
        self._workers = max(1, workers)
        self._k = 0
        self._read_s = 0.0
        self._prep_s = 0.0
        self._skipped: list[tuple[int, str, str]] = []
        self._fetched = FetchCounters()
        seed = config.seed
        resources.dataloader.batch_sampler.batches = [Batch(b.tolist(), seed, self.order_epoch) for b in batches]
        self._it = iter(resources.dataloader)

    def _step(self) -> Step | None:
        read = prep = 0.0  # the worker time of the batches this step waited for
        t0 = time.perf_counter()
        while True:
            try:
                fetched: Fetched = next(self._it)
            except StopIteration:
                return None
            self._k += 1
            self._account(fetched)
            read, prep = read + fetched.read_s, prep + fetched.prep_s
            if fetched.failure is not None:
                raise failure_error(fetched.failure)
            if fetched.batch is not None:
                break  # else every sample of the batch was skipped: on to the next
            if self._on_batch is not None:
                self._on_batch(self.start + self._k)
        # A worker reads and then prepares each batch: the wait splits in the same proportion.
        wait = time.perf_counter() - t0
        out = fetched.batch
        if self._return_index:
            out = with_ids(out, torch.tensor(fetched.ids, dtype=torch.int64))
        fetch = wait * read / (read + prep) if read + prep > 0 else 0.0
        return Step(out, len(fetched.ids), self.start + self._k, fetch=fetch)

    def _account(self, f: Fetched) -> None:
        self._fetched += f.counters or {}
        self._read_s += f.read_s
        self._prep_s += f.prep_s
        for i, path, why in f.skipped:  # logged here: a worker's log records may go nowhere
            log.warning("coordl: skipping sample %d (%s): %s", i, path, why)
        self._skipped += f.skipped

    def _counters(self) -> FetchCounters:
        return self._fetched

    def _figures(self) -> dict:
        return {
            "fetch_wait_s": self._read_s / self._workers,
            "read_s": self._read_s,
            "prep_s": self._prep_s,
            "skipped_paths": [p for _, p, _ in self._skipped],
        }

    def _shutdown(self) -> None:
        """Stops the pass's workers (persistent workers stay for the next pass)."""
        it, self._it = self._it, None
        if it is not None and not self._persistent:
            compat.shutdown_iterator_workers(it)


def seed_for(seed: int, epoch: int, rank: int) -> int:
    """A 63-bit seed from ``(seed, epoch, rank)`` (:func:`coordl.draws.mix`)."""
    return draws.mix(seed, epoch, rank) >> 1


def failure_error(f: tuple[str, str, str, int, str]) -> CoordlError:
    kind, message, path, i, worker_tb = f
    e = DatasetChangedError(message) if kind == "changed" else SampleError(message, path=path, index=i)
    note = f"In the worker that read it:\n{worker_tb.rstrip()}"
    if hasattr(e, "add_note"):
        e.add_note(note)
    else:  # Python 3.10
        e.args = (f"{message}\n{note}",)
    return e
