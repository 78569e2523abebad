"""Pure functions from (seed, epoch, world) to the sample ids and batches of one rank.

Sharding follows ``torch.utils.data.DistributedSampler``: the epoch's order (a
permutation seeded by ``(seed, epoch)``, or ``0..n-1`` without shuffling) is cut
into ``world_size`` interleaved shards ``order[rank::world_size]``. With
``drop_last=False`` the order is first padded by repeating its head so every rank
gets ``ceil(n / world_size)`` samples (at most ``world_size - 1`` duplicates per
epoch); with ``drop_last=True`` its tail is dropped so every rank gets
``floor(n / world_size)`` and none is duplicated.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["batches", "epoch_order", "num_batches", "shard", "shard_size"]


def epoch_order(n: int, seed: int, epoch: int, shuffle: bool = True) -> np.ndarray:
    """The global order of an epoch: a permutation of ``range(n)`` decided by ``(seed, epoch)``."""
    if not shuffle:
        return np.arange(n, dtype=np.int64)
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed & (2**64 - 1), epoch])))
    return rng.permutation(n).astype(np.int64)


def shard_size(n: int, world_size: int, drop_last: bool) -> int:
    """How many samples each rank gets per epoch."""
    return n // world_size if drop_last else math.ceil(n / world_size)


def shard(order: np.ndarray, rank: int, world_size: int, drop_last: bool) -> np.ndarray:
    """This rank's samples of the epoch, in delivery order."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    n = len(order)
    per_rank = shard_size(n, world_size, drop_last)
    total = per_rank * world_size
    if total > n:
        order = np.resize(order, total)  # repeats the head, as DistributedSampler pads
    return np.ascontiguousarray(order[rank:total:world_size])


def num_batches(samples: int, batch_size: int, drop_last: bool) -> int:
    """Batches of ``batch_size`` in ``samples`` samples; a partial last one counts unless dropped."""
    return samples // batch_size if drop_last else math.ceil(samples / batch_size)


def batches(ids: np.ndarray, batch_size: int, drop_last: bool, start: int = 0) -> list[np.ndarray]:
    """Cuts ``ids`` into batches, beginning at batch number ``start``."""
    count = num_batches(len(ids), batch_size, drop_last)
    return [ids[k * batch_size : (k + 1) * batch_size] for k in range(start, count)]
