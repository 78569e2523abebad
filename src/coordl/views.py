"""``loader.sampler`` and ``loader.batch_sampler``: a CoordLoader's order, seen as a ``DataLoader``'s.

Training scripts and frameworks read ``len(loader.sampler)`` (this rank's samples),
``len(loader.batch_sampler)`` and call ``loader.sampler.set_epoch(epoch)``, as they would on a
``DataLoader`` with a ``DistributedSampler``. The views answer from the loader's schedule and
position; they hold no state of their own.
"""

from __future__ import annotations

__all__ = ["BatchSamplerView", "SamplerView"]


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
        """``DistributedSampler``'s: the shards are cut rather than padded (``Shard(drop_last)``)."""
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
