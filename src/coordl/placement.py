"""Pure functions from cache bitmaps to locality-aware assignment: which rank trains on which entry of a global batch.

After the first epoch every rank knows, for every node, a bitmap of the items that node's cache holds. Locality-aware
assignment (Yang & Cong, "Accelerating Data Loading in Deep Neural Network Training", section V) keeps the global batch
sequence of :mod:`coordl.sampler` and changes only which rank gets which entry of each global batch: a rank takes the
entries its own node caches, and a greedy balance (the paper's Algorithm 1) moves the rest so that every rank's local
batch keeps the size plain sharding gives it. The ranks' gradients therefore still sum to the same global gradient (the
paper's Theorem 1). Every rank computes the same plan from the same inputs; nothing here is random.
"""

from __future__ import annotations

import heapq

import numpy as np

from coordl import sampler

__all__ = ["global_batches", "holders", "locality_batches", "plan"]


def holders(bitmaps: np.ndarray) -> np.ndarray:
    """The node that serves each item.

    Args:
        bitmaps: Boolean array ``(nodes, n)``; ``bitmaps[j, i]`` says node ``j`` caches item ``i``.

    Returns:
        int64 array ``(n,)``: the serving node of item ``i``, or -1 if no node holds it. An item held by several nodes
        is served by the ``(i % count)``-th of its holders in increasing node order, which spreads replicated items
        evenly over their holders.
    """
    bitmaps = np.asarray(bitmaps, dtype=bool)
    if bitmaps.ndim != 2:
        raise ValueError(f"bitmaps must be a 2-D (nodes, n) array, got shape {bitmaps.shape}")
    nodes, n = bitmaps.shape
    want = np.arange(n) % np.maximum(bitmaps.sum(axis=0), 1)  # which of its holders serves each item
    out = np.full(n, -1, dtype=np.int64)
    seen = np.zeros(n, dtype=np.int64)  # holders met so far, node by node: O(n) memory, not O(nodes * n)
    for j in range(nodes):
        out[bitmaps[j] & (seen == want)] = j
        seen += bitmaps[j]
    return out


def global_batches(
    order: np.ndarray,
    world_size: int,
    batch_size: int,
    drop_last: bool,
    start: int = 0,
    *,
    shard_drop_last: bool = False,
) -> list[np.ndarray]:
    """The global batches of an epoch, beginning at batch number ``start``.

    Global batch ``k`` is the contiguous slice of the (padded or truncated) epoch order that plain sharding spreads
    over the ranks, so ``sampler.batches(sampler.shard(order, r, W, shard_drop_last), B, drop_last)[k]`` equals
    ``global_batches(order, W, B, drop_last, shard_drop_last=shard_drop_last)[k][r::W]`` for every rank ``r``. Each
    has ``batch_size * world_size`` entries, except a partial last one when ``drop_last=False``, which still splits
    evenly among the ranks. ``drop_last`` drops each rank's last incomplete batch (``DataLoader``'s),
    ``shard_drop_last`` the order's tail instead of padding it (``DistributedSampler``'s ``drop_last``).
    """
    if world_size < 1 or batch_size < 1:
        raise ValueError(f"world_size and batch_size must be >= 1, got {world_size} and {batch_size}")
    order = np.asarray(order)
    per_rank = sampler.shard_size(len(order), world_size, shard_drop_last)
    total = per_rank * world_size
    padded = np.resize(order, total) if total > len(order) else order[:total]  # the padding of sampler.shard
    step, count = batch_size * world_size, sampler.num_batches(per_rank, batch_size, drop_last)
    return [padded[k * step : (k + 1) * step] for k in range(start, count)]


def plan(batch: np.ndarray, holder: np.ndarray, rank_nodes: np.ndarray) -> list[np.ndarray]:
    """Splits one global batch among the ranks, each taking what its own node caches.

    Entries are handled by position, so an id the padding repeats counts once per occurrence. With
    ``local = len(batch) // W``:

    1. Node level: node ``j`` may keep ``cap_j = local * (ranks on node j)`` entries. The entries it serves, in batch
       order, go to node ``j`` up to its cap; the rest are its surplus (in batch order).
    2. Within node ``j``, the kept entries are dealt round-robin to its ranks in increasing rank order.
    3. Each rank's deficit is ``local`` minus what it got. Entries no rank's node can serve (``holder`` -1, or a holder
       node that runs no rank) are dealt round-robin, in batch order, over the ranks in increasing rank order,
       skipping ranks whose deficit is filled. This spreads storage reads evenly, and with an empty cache the plan is
       exactly plain sharding, ``batch[r::W]``.
    4. The paper's Algorithm 1 (Balance): with a heap of node surpluses and a heap of rank deficits, repeatedly take
       the largest surplus and the largest deficit (ties: lowest node id, lowest rank) and move
       ``min(surplus, deficit)`` entries from the front of that node's surplus to that rank.
    5. Each rank's entries are returned in global-batch order.

    Only surplus entries and entries held by rank-less nodes leave their cache for another node, which is the least
    any equal split can move: ``traffic(...) == sum_j max(0, held_j - cap_j)``.

    Args:
        batch: Sample ids of one global batch; ``len(batch)`` must be a multiple of ``len(rank_nodes)``.
        holder: The serving node of every item, as returned by :func:`holders` (-1 for none).
        rank_nodes: ``rank_nodes[r]`` is the node of rank ``r``.

    Returns:
        ``W`` arrays of ``local`` ids each, one per rank; together they are a permutation of ``batch``.
    """
    batch = np.asarray(batch, dtype=np.int64)
    holder = np.asarray(holder)
    rank_nodes = _check_rank_nodes(rank_nodes)
    world, size = len(rank_nodes), batch.size
    if batch.ndim != 1 or size % world:
        raise ValueError(
            f"a global batch must be 1-D and split evenly among the {world} ranks, got shape {batch.shape}; "
            "cut the epoch with global_batches() using the same world size"
        )
    local = size // world
    if size == 0:
        return [batch[:0].copy() for _ in range(world)]
    if batch.min() < 0 or batch.max() >= len(holder):
        raise ValueError(
            f"batch ids must be in [0, {len(holder)}) (the length of holder), got {batch.min()}..{batch.max()}"
        )
    node = holder[batch].astype(np.int64)
    if node.min() < -1:
        raise ValueError(f"holder entries must be a node id or -1, got {node.min()}")
    num_nodes = max(int(rank_nodes.max()), int(node.max())) + 1
    ranks_on = np.bincount(rank_nodes, minlength=num_nodes)
    cap = np.append(local * ranks_on, 0)

    # Step 1: group positions by serving node (stable: batch order within a node); key num_nodes = nobody serves it.
    key = np.where((node >= 0) & (ranks_on[np.maximum(node, 0)] > 0), node, num_nodes)
    by_node = np.argsort(key, kind="stable")
    counts = np.bincount(key, minlength=num_nodes + 1)
    first = np.concatenate(([0], np.cumsum(counts)))
    sorted_key = key[by_node]
    index = np.arange(size) - first[sorted_key]  # an entry's index among its node's entries
    kept = index < cap[sorted_key]

    # Step 2: deal each node's kept entries round-robin over its ranks.
    owner = np.full(size, -1, dtype=np.int64)
    node_ranks = np.argsort(rank_nodes, kind="stable")
    rank_first = np.concatenate(([0], np.cumsum(ranks_on)))
    j, i = sorted_key[kept], index[kept]
    owner[by_node[kept]] = node_ranks[rank_first[j] + i % ranks_on[j]]
    deficit = local - np.bincount(owner[by_node[kept]], minlength=world)

    # Step 3: uncached entries, round-robin over the ranks that still have room (slot = (round, rank)).
    pool = by_node[first[num_nodes] :]
    if len(pool):
        slot_rank = np.repeat(np.arange(world), deficit)
        slot_round = np.arange(len(slot_rank)) - np.repeat(np.cumsum(deficit) - deficit, deficit)
        taken = slot_rank[np.lexsort((slot_rank, slot_round))[: len(pool)]]
        owner[pool] = taken
        deficit -= np.bincount(taken, minlength=world)

    # Step 4: Algorithm 1. Total surplus equals total remaining deficit, so the deficit heap outlasts the surplus heap.
    over = np.flatnonzero(counts[:num_nodes] > cap[:num_nodes])
    surplus = [(int(cap[n] - counts[n]), int(n)) for n in over]  # negated: heapq is a min-heap
    needy = [(-int(d), r) for r, d in enumerate(deficit.tolist()) if d > 0]
    heapq.heapify(surplus)
    heapq.heapify(needy)
    front = {int(n): int(first[n] + cap[n]) for n in over}
    while surplus:
        (s, n), (d, r) = surplus[0], needy[0]
        m = min(-s, -d)
        owner[by_node[front[n] : front[n] + m]] = r
        front[n] += m
        _shrink(surplus, s + m, n)
        _shrink(needy, d + m, r)

    # Step 5: a stable sort by rank keeps global-batch order within each rank; every rank has exactly `local`.
    return list(batch[np.argsort(owner, kind="stable")].reshape(world, local))


def locality_batches(
    order: np.ndarray,
    rank: int,
    world_size: int,
    batch_size: int,
    drop_last: bool,
    holder: np.ndarray,
    rank_nodes: np.ndarray,
    start: int = 0,
    *,
    shard_drop_last: bool = False,
) -> list[np.ndarray]:
    """This rank's batches of the epoch under locality-aware assignment, beginning at batch number ``start``.

    Batch ``k`` is ``plan(global_batches(...)[k], holder, rank_nodes)[rank]``: the same global batches as plain
    sharding, with the same local batch sizes, split by what each node caches.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    if len(rank_nodes) != world_size:
        raise ValueError(f"rank_nodes must name the node of each of the {world_size} ranks, got {len(rank_nodes)}")
    cut = global_batches(order, world_size, batch_size, drop_last, start, shard_drop_last=shard_drop_last)
    return [plan(g, holder, rank_nodes)[rank] for g in cut]


def _check_rank_nodes(rank_nodes: np.ndarray) -> np.ndarray:
    rank_nodes = np.asarray(rank_nodes)
    if rank_nodes.ndim != 1 or len(rank_nodes) == 0 or not np.issubdtype(rank_nodes.dtype, np.integer):
        raise ValueError(
            f"rank_nodes must be a non-empty 1-D integer array (the node of each rank), got {rank_nodes!r}"
        )
    if rank_nodes.min() < 0:
        raise ValueError(f"node ids in rank_nodes must be >= 0, got {rank_nodes.min()}")
    return rank_nodes.astype(np.int64, copy=False)


def _shrink(heap: list[tuple[int, int]], negated: int, ident: int) -> None:
    """Replaces the top of ``heap`` by ``(negated, ident)``, or pops it when nothing is left (``negated == 0``)."""
    if negated:
        heapq.heapreplace(heap, (negated, ident))
    else:
        heapq.heappop(heap)
