"""A CoordLoader seen as a ``DataLoader``: the attributes that scripts and frameworks read.

PyTorch's ImageNet example, PyTorch Lightning and many training scripts read ``len(loader.sampler)``
(this rank's samples), ``len(loader.batch_sampler)``, ``loader.batch_size``, ``loader.collate_fn``...
and call ``loader.sampler.set_epoch(epoch)``, as they would on a ``DataLoader`` with a
``DistributedSampler``. :class:`DataLoaderAttributes` answers them from the loader's settings
(``config``, ``torch_options``); the sampler views answer from its schedule and position. None
holds state of its own.
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
        """``DistributedSampler``'s: the shards are cut rather than padded (``Shard(pad=False)``)."""
        return self._loader.schedule.shard_drop_last

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
    """``DataLoader``'s attributes on a :class:`~coordl.CoordLoader`, read-only but for
    ``worker_init_fn`` (frameworks set it before a pass)."""

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
    in_order = property(lambda self: True)
    hp_group = property(lambda self: self.options.hp_group.name if self.options.hp_group is not None else None)

    @property
    def worker_init_fn(self):
        """The torch backend's ``worker_init_fn``; settable before a pass, as frameworks do."""
        return self.torch_options.worker_init_fn

    @worker_init_fn.setter
    def worker_init_fn(self, fn) -> None:
        self.torch_options = dataclasses.replace(self.torch_options, worker_init_fn=fn)
        if self._resources is not None and self._resources.dataloader is not None:
            self._resources.dataloader.worker_init_fn = fn  # its workers start with the next pass

    @property
    def collate_fn(self):
        """The ``collate_fn`` given; else the torch backend's ``default_collate``, and None with DALI
        (whose batches are tensors already)."""
        if self.torch_options.collate_fn is not None:
            return self.torch_options.collate_fn
        if self.backend == "dali":
            return None
        from torch.utils.data import default_collate

        return default_collate

    @property
    def prefetch_factor(self) -> int | None:
        """As ``DataLoader``'s: batches each worker loads ahead (2 with workers, None without; None with DALI,
        which reads ``Fetch(batches_ahead)`` batches ahead)."""
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
