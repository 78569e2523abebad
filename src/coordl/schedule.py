"""Pure: this rank's batches of a pass, from the dataset size, the order settings and the world.

The one place where order -> shard -> batches is composed. Every pass asks it: the DALI and
torch passes, an HP group's producer and consumer, and DS-Analyzer's phases. With the
partitioned cache's holder map, the batches follow locality-aware assignment
(:func:`coordl.placement.locality_batches`): the same global batches, split by what each node
caches.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from coordl import placement, sampler

__all__ = ["Locality", "Schedule"]


@dataclass(frozen=True)
class Locality:
    """Who caches what, for locality-aware assignment: ``holder[i]`` is the node serving sample
    ``i`` (-1: none), ``rank_nodes[r]`` the node of rank ``r``."""

    holder: np.ndarray
    rank_nodes: np.ndarray


@dataclass(frozen=True)
class Schedule:
    """The order settings of a loader: which samples each batch of a pass holds.

    Attributes:
        samples: samples in the dataset.
        batch_size: samples per batch and rank.
        shuffle: reshuffle every epoch, seeded by ``(seed, epoch)``.
        drop_last: drop each rank's last incomplete batch (``DataLoader``'s).
        seed: the seed of the order.
        shard_drop_last: shard without padding, dropping the order's tail
            (``DistributedSampler``'s ``drop_last``).
    """

    samples: int
    batch_size: int
    shuffle: bool
    drop_last: bool
    seed: int
    shard_drop_last: bool = False

    def order(self, epoch: int, base: int = 0) -> np.ndarray:
        """The global order of ``epoch``, from position ``base`` on."""
        order = sampler.epoch_order(self.samples, self.seed, epoch, self.shuffle)
        return order[base:] if base else order

    def shard(self, epoch: int, rank: int, world_size: int) -> np.ndarray:
        """Rank ``rank``'s samples of ``epoch``, in delivery order (``DistributedSampler``'s shard)."""
        return sampler.shard(self.order(epoch), rank, world_size, self.shard_drop_last)

    def shard_size(self, world_size: int, base: int = 0) -> int:
        """Samples per rank and epoch (of a plan from ``base`` on)."""
        return sampler.shard_size(self.samples - base, world_size, self.shard_drop_last)

    def num_batches(self, world_size: int, base: int = 0) -> int:
        """Batches per rank and epoch (of a plan from ``base`` on)."""
        return sampler.num_batches(self.shard_size(world_size, base), self.batch_size, self.drop_last)

    def batches(
        self,
        epoch: int,
        rank: int,
        world_size: int,
        start: int = 0,
        locality: Locality | None = None,
        base: int = 0,
    ) -> list[np.ndarray]:
        """Rank ``rank``'s batches of ``epoch`` from batch number ``start`` on.

        ``base`` > 0 plans the epoch's samples from that position of its order on (the samples
        not yet received when the epoch was interrupted at another world size), padded or cut as
        ``DistributedSampler`` pads or cuts an epoch.
        """
        order = self.order(epoch, base)
        if locality is not None:
            return placement.locality_batches(
                order,
                rank,
                world_size,
                self.batch_size,
                self.drop_last,
                locality.holder,
                locality.rank_nodes,
                start=start,
                shard_drop_last=self.shard_drop_last,
            )
        shard = sampler.shard(order, rank, world_size, self.shard_drop_last)
        return sampler.batches(shard, self.batch_size, self.drop_last, start=start)
