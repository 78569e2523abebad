"""The attributes of a ``DataLoader`` that scripts and frameworks read, on a CoordLoader.

Training scripts and frameworks read ``len(loader.sampler)`` (this rank's samples),
``len(loader.batch_sampler)`` and call ``loader.sampler.set_epoch(epoch)``, as they would on a
``DataLoader`` with a ``DistributedSampler``. The sampler views answer from the loader's schedule
and position; they hold no state of their own. :class:`DataLoaderAttributes` gives the loader
the rest (``batch_size``, ``num_workers``, ``collate_fn``, ...) from its configuration.
"""

from __future__ import annotations

import dataclasses

__all__ = ["BatchSamplerView", "DataLoaderAttributes", "SamplerView"]


class SamplerView:
    """This rank's samples of the loader's current epoch, like a ``DistributedSampler``."""

    def __init__(self, loader):
        self._loader = loader

    @property
    def epoch(self) -> int:
        return self._loader.epoch

    @property
    def num_replicas(self) -> int:
        return self._loader.world.world_size

    @property
    def rank(self) -> int:
        return self._loader.world.rank

    @property
    def shuffle(self) -> bool:
        return self._loader.shuffle

    @property
    def seed(self) -> int:
        return self._loader.seed

    @property
    def drop_last(self) -> bool:
        return self._loader.drop_last

    def set_epoch(self, epoch: int) -> None:
        """The same as ``loader.set_epoch(epoch)``."""
        self._loader.set_epoch(epoch)

    def __len__(self) -> int:
        return self._loader.schedule.shard_size(self.num_replicas)

    def __iter__(self):
        ld = self._loader
        return iter(ld.schedule.shard(ld.epoch, self.rank, self.num_replicas).tolist())

    def __repr__(self) -> str:
        return f"SamplerView(rank={self.rank}/{self.num_replicas}, epoch={self.epoch}, samples={len(self)})"


class BatchSamplerView:
    """This rank's batches of the loader's current epoch, like a ``BatchSampler`` over :class:`SamplerView`."""

    def __init__(self, loader):
        self._loader = loader
        self.sampler = SamplerView(loader)

    @property
    def batch_size(self) -> int:
        return self._loader.batch_size

    @property
    def drop_last(self) -> bool:
        return self._loader.drop_last

    def __len__(self) -> int:
        return len(self._loader)

    def __iter__(self):
        ld = self._loader
        w = ld.world
        return iter([b.tolist() for b in ld.schedule.batches(ld.epoch, w.rank, w.world_size)])

    def __repr__(self) -> str:
        return f"BatchSamplerView(batches={len(self)}, batch_size={self.batch_size})"


class DataLoaderAttributes:
    """``DataLoader``'s attributes, read from a loader's ``config``, ``torch_options``,
    ``group_options``, ``peer_options`` and ``resources``."""

    batch_size = property(lambda self: self.config.batch_size)
    drop_last = property(lambda self: self.config.drop_last)
    shuffle = property(lambda self: self.config.shuffle)
    seed = property(lambda self: self.config.seed)
    return_index = property(lambda self: self.config.return_index)
    on_error = property(lambda self: self.config.on_error)
    log_epochs = property(lambda self: self.config.log_epochs)
    num_workers = property(lambda self: self.torch_options.num_workers)
    pin_memory = property(lambda self: self.torch_options.pin_memory)
    timeout = property(lambda self: self.torch_options.timeout)
    multiprocessing_context = property(lambda self: self.torch_options.multiprocessing_context)
    persistent_workers = property(lambda self: self.torch_options.persistent_workers)
    pin_memory_device = property(lambda self: self.torch_options.pin_memory_device)
    hp_group = property(lambda self: self.group_options.name if self.group_options else None)
    locality_aware = property(lambda self: self.peer_options.locality_aware)
    cache = property(lambda self: self.resources.cache)
    decoded = property(lambda self: self.resources.decoded)  # the node's decoded tier, or None

    @property
    def worker_init_fn(self):
        """The torch backend's ``worker_init_fn``; settable before a pass, as frameworks do."""
        return self.torch_options.worker_init_fn

    @worker_init_fn.setter
    def worker_init_fn(self, fn) -> None:
        self.torch_options = dataclasses.replace(self.torch_options, worker_init_fn=fn)
        if self.resources.dataloader is not None:
            self.resources.dataloader.worker_init_fn = fn  # its workers start with the next pass

    @property
    def collate_fn(self):
        """The torch backend's ``collate_fn`` (``default_collate`` when none was given); None with DALI."""
        if self.backend == "dali":
            return None
        if self.torch_options.collate_fn is not None:
            return self.torch_options.collate_fn
        from torch.utils.data import default_collate

        return default_collate

    @property
    def prefetch_factor(self) -> int | None:
        """As ``DataLoader``'s: batches each worker loads ahead (2 with workers, None without)."""
        if self.backend == "dali":
            return self.config.prefetch_batches
        pf = self.torch_options.prefetch_factor
        return pf if pf is not None or self.num_workers == 0 else 2

    @property
    def sampler(self) -> SamplerView:
        """This rank's samples of the current epoch, as a ``DistributedSampler`` (``len``, ``iter``, ``set_epoch``)."""
        return SamplerView(self)

    @property
    def batch_sampler(self) -> BatchSamplerView:
        """This rank's batches of the current epoch (``len(loader.batch_sampler) == len(loader)``)."""
        return BatchSamplerView(self)
