"""What runs in a Ray actor: one loader's prep, fed units of work.

:class:`PrepWorker` is a plain class (``cluster.py`` makes it a Ray actor), so that what it does
is the same code the loader runs locally: the DALI backend's :class:`~coordl.prep.dali.DaliPrep`
fed :class:`~coordl.fetch.ahead.RawBatch` es, or the torch backend's
:class:`~coordl.backends.torch.Items` and :class:`~coordl.backends.torch.Collate`. A unit's
samples are augmented with the draws of ``(seed, epoch, sample)``, so its tensors are the ones
the trainer's own pipeline would make.

Bytes come from the dataset where it lives, through the actor's node's cache (the MinIO policy,
one per node, shared by every actor and job there), or with the unit when the trainer read them.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import time
from dataclasses import dataclass, field

import numpy as np

__all__ = ["Arrays", "Done", "Job", "PrepWorker", "Unit", "as_arrays", "as_tensors", "can_read"]


@dataclass
class Unit:
    """One batch to prepare: which, of which epoch's order, and its bytes when the trainer read them."""

    number: int
    ids: np.ndarray
    epoch: int  # the epoch whose order the batch follows: it keys the samples' draws
    data: list | None = None  # encoded bytes per sample (the trainer read them), None: read here
    errors: dict | None = None  # the trainer's read failures (torch backend), by sample id
    skipped: list = field(default_factory=list)  # samples the trainer skipped reading (DALI backend)
    pixels: bool = False  # DALI: the recipe's uint8 pixels, before normalisation


@dataclass
class Done:
    """A prepared unit, as an actor returns it."""

    number: int
    images: np.ndarray | None = None  # DALI backend (None: every sample skipped)
    labels: np.ndarray | None = None
    ids: np.ndarray | None = None
    fetched: object = None  # torch backend: the collated :class:`~coordl.backends.torch.Fetched`
    skipped: list = field(default_factory=list)  # (id, path, why)
    counters: dict = field(default_factory=dict)
    read_s: float = 0.0
    prep_s: float = 0.0
    worker: str = ""


@dataclass(frozen=True)
class Job:
    """What every actor of a loader needs (sent once, through Ray's object store)."""

    backend: str  # "dali" or "torch"
    index: object
    seed: int
    batch_size: int
    on_error: str
    cache: object  # the loader's coordl.Cache: the node's cache on the actor's node
    reads: str  # RayPrep(reads)
    threads: int = 1
    recipe: object = None  # DALI
    items: object = None  # torch: the loader's Items (its dataset), and its collate_fn
    collate_fn: object = None
    worker_init_fn: object = None  # torch: called in each actor with its worker id, as in a DataLoader worker
    first_worker_id: int = 0  # the first actor's worker id (after the local DataLoader's workers)
    env: dict = field(default_factory=dict)  # COORDL_* and AWS_* of the trainer
    versions: dict = field(default_factory=dict)  # the trainer's (coordl.remote.versions), checked by each actor


class Arrays:
    """A torch tensor of a batch on its way from an actor, as a NumPy array: Ray sends arrays from
    its object store without pickling their bytes, where it would pickle a tensor whole (a copy on
    each side)."""

    __slots__ = ("array",)

    def __init__(self, array: np.ndarray):
        self.array = array


def as_arrays(batch):
    """``batch`` with its CPU tensors as :class:`Arrays` (in tuples, lists, dicts and namedtuples)."""
    import torch

    if isinstance(batch, torch.Tensor):
        if batch.device.type != "cpu" or batch.requires_grad or batch.dtype not in _numpy_dtypes():
            return batch  # pickled as it is
        return Arrays(batch.numpy())
    return _map(batch, as_arrays)


def as_tensors(batch):
    """:func:`as_arrays` undone: tensors of their own (Ray's arrays are read-only views of its store)."""
    import torch

    if isinstance(batch, Arrays):
        return torch.from_numpy(np.array(batch.array))
    return _map(batch, as_tensors)


def _map(batch, f):
    if isinstance(batch, dict):
        items = {k: f(v) for k, v in batch.items()}
        try:
            return type(batch)(items)
        except TypeError:  # a mapping type that is not made from a dict: as default_collate, a dict
            return items
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(f(v) for v in batch))
    if isinstance(batch, (tuple, list)):
        return type(batch)(f(v) for v in batch)
    return batch


def _numpy_dtypes() -> set:
    import torch

    return {torch.float16, torch.float32, torch.float64, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64}


def can_read(index, samples: int = 3) -> bool:
    """Whether this machine sees the dataset: ``s3://``, or local files of the index's sizes (tar
    shards that hold the index's members)."""
    if index.root and str(index.root).startswith("s3://"):
        return True
    n = len(index)
    if n == 0:
        return True
    for i in sorted({0, n // 2, n - 1})[:samples]:
        path, offset, size = index.location(i)
        try:
            actual = os.path.getsize(path)
            if actual < offset + size if index.shards is not None else actual != size:
                return False
        except OSError:
            return False
    return True


class PrepWorker:
    """One actor's prep (see the module's docstring); ``number``: which of the pool's actors it is."""

    def __init__(self, job: Job, number: int = 0):
        from coordl import lifecycle
        from coordl.fetch.fetcher import Fetcher
        from coordl.remote import versions

        versions.check(job.versions, job.backend, socket.gethostname())  # before anything of the job runs
        os.environ.update(job.env)
        self.job = job
        self.index = job.index
        self.reads = "trainer" if job.reads == "trainer" else "node" if can_read(self.index) else "trainer"
        if job.reads == "node" and self.reads != "node":
            raise RuntimeError(
                f"coordl: RayPrep(reads='node'), but {socket.gethostname()} cannot read the dataset "
                f"({self.index.paths[0] if len(self.index) else self.index.root}): mount it at the same path, "
                "or pass reads='trainer' or 'auto'"
            )
        self.spec = self._cache_spec() if self.reads == "node" else None
        self.cache = self.spec.attach(self.index.sizes) if self.spec is not None else None
        if self.cache is None:
            self.spec = None  # another user took its names (warned): this actor's torch items read storage
        from coordl.fetch import disk as disk_tier

        disk_spec = disk_tier.spec_for(job.cache.disk, self.index) if self.reads == "node" else None
        self.disk = disk_spec.open() if disk_spec is not None else None  # the local-storage tier of its node
        self.fetcher = Fetcher(self.index, self.cache, drop_page_cache=self.cache is not None, disk=self.disk)
        self.name = f"{socket.gethostname()}:{os.getpid()}"
        if job.backend == "dali":
            from coordl.threads import daemon_pool

            lifecycle.before_dali_exit()
            self._preps: dict = {}  # pixels -> DaliPrep
            self._prep_args = dict(
                batch_size=job.batch_size,
                num_threads=job.threads,
                device_id=None,
                seed=job.seed,
                on_error=job.on_error,
                boxes=self.index.boxes,
            )
            self.pool = daemon_pool(4, "coordl-io")
        else:
            from coordl.backends.torch import Collate, Items

            items = job.items
            self.items = Items(items.dataset, self.fetcher, self.spec, items.on_error)
            self.collate = Collate(job.collate_fn)
            if job.worker_init_fn is not None:
                job.worker_init_fn(job.first_worker_id + number)

    def _prep(self, pixels: bool):
        """The pipeline of the recipe, or (``pixels``) of its uint8 variant, made on first use."""
        if pixels not in self._preps:
            from coordl.prep.dali import DaliPrep

            recipe = self.job.recipe.pixels() if pixels else self.job.recipe
            self._preps[pixels] = DaliPrep(recipe, **self._prep_args)
        return self._preps[pixels]

    def _cache_spec(self):
        from coordl.tiers import plan as tiers

        cache = dataclasses.replace(self.job.cache, decoded=0)
        return tiers.plan(self.index, cache, why_not="remote prep", measure=lambda: None).encoded

    def close(self) -> None:
        """Leaves the node's cache (the last user removes it) and drops the pipelines: the trainer
        asks this before it ends the actor, which runs no exit handlers."""
        if self.cache is not None:
            self.cache.close()
            self.cache = None
        if self.disk is not None:
            self.disk.close(timeout=1.0)  # the trainer gives an actor 2 s to leave
        for prep in getattr(self, "_preps", {}).values():
            prep.close()

    def ready(self) -> dict:
        """Where this actor runs and how it reads (the trainer waits for it before handing units)."""
        return {"worker": self.name, "reads": self.reads, "cache": self.cache.budget if self.cache else 0}

    def run(self, unit: Unit) -> Done:
        t0 = time.perf_counter()
        done = self._run_dali(unit) if self.job.backend == "dali" else self._run_torch(unit)
        done.worker = self.name
        if done.prep_s == 0.0:
            done.prep_s = time.perf_counter() - t0 - done.read_s
        return done

    def _run_dali(self, unit: Unit) -> Done:
        import threading

        from coordl.fetch.ahead import FetchAhead, RawBatch

        labels = self.index.labels
        done = Done(unit.number, skipped=list(unit.skipped))
        t0 = time.perf_counter()
        if unit.data is None:
            ahead = FetchAhead(
                self.fetcher,
                [],
                labels,
                self.pool,
                threads=4,
                depth=1,
                on_error=self.job.on_error,
                stop=threading.Event(),
            )
            raw = ahead.collect(unit.ids, unit.number)
            done.skipped += ahead.skipped
        else:
            raw = RawBatch(unit.ids, unit.data, labels[unit.ids], number=unit.number)
        raw.epoch = unit.epoch
        done.read_s = time.perf_counter() - t0
        done.counters = self.fetcher.reset_counters().as_dict()
        prep = self._prep(unit.pixels)
        skipped0 = len(prep.skipped)
        for images, lab, ids, _ in prep.epoch(iter([raw]), self.index.paths.__getitem__, unit.epoch):
            done.images, done.labels, done.ids = images.numpy(), lab.numpy(), ids.numpy()
        done.skipped += prep.skipped[skipped0:]
        return done

    def _run_torch(self, unit: Unit) -> Done:
        from coordl.backends.torch import Batch

        batch = Batch(unit.ids.tolist(), self.job.seed, unit.epoch)
        fetched = self.collate(self.items.prepare(batch, unit.data, unit.errors))
        fetched.batch = as_arrays(fetched.batch)
        return Done(
            unit.number,
            fetched=fetched,
            skipped=list(fetched.skipped),
            counters=fetched.counters or {},
            read_s=fetched.read_s,
            prep_s=fetched.prep_s,
        )
