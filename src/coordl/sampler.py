"""Pure functions from (seed, epoch, world) to the sample ids and batches of one rank.

The epoch's order is a permutation decided by ``(seed, epoch)`` with an algorithm of coordl's
own (:func:`epoch_order`, version :data:`ORDER_VERSION`, saved in every ``state_dict()``), or
``0..n-1`` without shuffling. Sharding follows ``torch.utils.data.DistributedSampler``: the
order is cut into ``world_size`` interleaved shards ``order[rank::world_size]``. With the
shard's ``drop_last=False`` (``DistributedSampler``'s default) the order is first padded by
repeating its head so every rank gets ``ceil(n / world_size)`` samples (at most
``world_size - 1`` duplicates per epoch); with ``drop_last=True`` its tail is dropped so every
rank gets ``floor(n / world_size)`` and none is duplicated. A shard is then cut into batches,
whose own ``drop_last`` (``DataLoader``'s) drops a last incomplete one.
"""

from __future__ import annotations

import math

import numpy as np

from coordl import draws

__all__ = ["ORDER_VERSION", "batches", "epoch_order", "num_batches", "shard", "shard_size"]

#: The version of :func:`epoch_order`'s algorithm. A saved position means "the first k samples of
#: this order", so a state resumes only where the order is the same: another version is refused.
#: Version 1 replaced numpy's ``Generator.permutation``, whose streams numpy does not promise
#: across its versions.
ORDER_VERSION = 1


def epoch_order(n: int, seed: int, epoch: int, shuffle: bool = True) -> np.ndarray:
    """The global order of an epoch: a permutation of ``range(n)`` decided by ``(seed, epoch)``.

    Version 1 (:data:`ORDER_VERSION`): sample ``i`` gets the key ``SplitMix64(seed, ORDER,
    epoch, i)`` (:func:`coordl.draws.order_keys`), and the order is the ids sorted by key, ties
    (two equal 64-bit keys, about one epoch in 10^7 at a million samples) by id. It is a uniformly
    random permutation, computed with numpy's integer arithmetic and sort only, so it is the same
    with every numpy and on every machine (0.1 s for a million samples).
    """
    if not shuffle:
        return np.arange(n, dtype=np.int64)
    keys = draws.order_keys(seed, epoch, n)
    order = np.argsort(keys)  # unique keys: any sort gives this order
    ranked = keys[order]
    if n > 1 and (ranked[1:] == ranked[:-1]).any():
        order = np.argsort(keys, kind="stable")  # equal keys in id order, as the version says
    return order.astype(np.int64, copy=False)


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
