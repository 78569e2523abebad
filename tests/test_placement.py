"""Locality-aware assignment: holders, global batches, balanced plans, traffic, and gradient equivalence."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from coordl import placement, sampler
from coordl_testing.traffic import traffic


@st.composite
def worlds(draw):
    """A cluster: ``rank_nodes`` (1..8 ranks, 1..3 per node, sorted or shuffled) and the node count, which may include
    nodes that cache items but run no rank."""
    sizes, left = [], draw(st.integers(1, 8))
    while left:
        sizes.append(draw(st.integers(1, min(3, left))))
        left -= sizes[-1]
    rank_nodes = np.repeat(np.arange(len(sizes)), sizes)
    if draw(st.booleans()):
        rank_nodes = np.array(draw(st.permutations(rank_nodes.tolist())), dtype=np.int64)
    return rank_nodes, len(sizes) + draw(st.integers(0, 2))


@st.composite
def caches(draw, nodes, n):
    """Bitmaps ``(nodes, n)``: empty, full, or random with any density (so items held by several nodes too)."""
    kind = draw(st.sampled_from(["empty", "full", "random", "random"]))
    if kind != "random":
        return np.full((nodes, n), kind == "full")
    rng = np.random.default_rng(draw(st.integers(0, 2**32)))
    return rng.random((nodes, n)) < draw(st.floats(0, 1))


@st.composite
def epochs(draw):
    """An epoch's setting: world, holders, order, batch size and drop_last."""
    rank_nodes, nodes = draw(worlds())
    n = draw(st.integers(0, 80))
    bitmaps = draw(caches(nodes, n))
    order = sampler.epoch_order(n, draw(st.integers(0, 99)), draw(st.integers(0, 9)), shuffle=draw(st.booleans()))
    return rank_nodes, bitmaps, order, draw(st.integers(1, 6)), draw(st.booleans())


def plain(batch, world):
    return [batch[r::world] for r in range(world)]


def lower_bound(batch, holder, rank_nodes):
    """The least traffic of any equal split: node j keeps at most ``cap_j`` of its entries, the rest must move."""
    node = holder[batch]
    held = np.bincount(node[node >= 0], minlength=rank_nodes.max() + 1)
    cap = len(batch) // len(rank_nodes) * np.bincount(rank_nodes, minlength=len(held))
    return int(np.maximum(held - cap[: len(held)], 0).sum())


def is_subsequence(part, batch):
    it = iter(batch.tolist())
    return all(any(x == y for y in it) for x in part.tolist())


@given(bitmaps=st.integers(0, 5).flatmap(lambda nodes: st.integers(0, 40).flatmap(lambda n: caches(nodes, n))))
def test_holders_picks_the_i_mod_count_th_holder(bitmaps):
    got = placement.holders(bitmaps)
    assert got.dtype == np.int64 and got.shape == (bitmaps.shape[1],)
    for i in range(bitmaps.shape[1]):
        nodes = np.flatnonzero(bitmaps[:, i])
        assert got[i] == (nodes[i % len(nodes)] if len(nodes) else -1)


def test_holders_spreads_replicas_and_keeps_sole_holders():
    assert placement.holders(np.ones((3, 7), bool)).tolist() == [0, 1, 2, 0, 1, 2, 0]
    bitmaps = np.array([[1, 0, 0, 1], [0, 0, 1, 1]], bool)
    assert placement.holders(bitmaps).tolist() == [0, -1, 1, 1]


@given(setting=epochs(), start=st.integers(0, 4))
def test_global_batches_are_what_plain_sharding_interleaves(setting, start):
    rank_nodes, _, order, bs, drop_last = setting
    world = len(rank_nodes)
    if drop_last and len(order) < world:
        return
    glob = placement.global_batches(order, world, bs, drop_last, start, shard_drop_last=drop_last)
    for r in range(world):
        mine = sampler.batches(sampler.shard(order, r, world, drop_last), bs, drop_last, start)
        assert len(mine) == len(glob)
        for g, b in zip(glob, mine):
            assert np.array_equal(g[r::world], b)
            assert len(g) == len(b) * world


@settings(max_examples=150, deadline=None)
@given(setting=epochs())
def test_plan_is_an_equal_ordered_split_with_least_traffic(setting):
    rank_nodes, bitmaps, order, bs, drop_last = setting
    world = len(rank_nodes)
    holder = placement.holders(bitmaps)
    for g in placement.global_batches(order, world, bs, drop_last, shard_drop_last=drop_last):
        parts = placement.plan(g, holder, rank_nodes)
        assert len(parts) == world
        assert all(len(p) == len(g) // world for p in parts)  # every local batch as big as plain sharding's
        assert np.array_equal(np.sort(np.concatenate(parts)), np.sort(g))  # a permutation, repeats included
        assert all(is_subsequence(p, g) for p in parts)  # global-batch order kept
        again = placement.plan(g.copy(), holder.copy(), rank_nodes.copy())
        assert all(np.array_equal(a, b) for a, b in zip(parts, again))  # deterministic
        # Every surplus entry (and every entry cached only by rank-less nodes) moves, nothing else does: optimal.
        moved = traffic(g, holder, rank_nodes, parts)
        assert moved == lower_bound(g, holder, rank_nodes)
        assert moved <= traffic(g, holder, rank_nodes, plain(g, world))
        for j in np.unique(rank_nodes):  # node j keeps as many of its entries as fit
            held = np.count_nonzero(holder[g] == j)
            local = sum(np.count_nonzero(holder[parts[r]] == j) for r in np.flatnonzero(rank_nodes == j))
            assert local == min(held, len(g) // world * np.count_nonzero(rank_nodes == j))


@settings(max_examples=75, deadline=None)
@given(setting=epochs(), start=st.integers(0, 3))
def test_locality_batches_cover_the_epoch_like_plain_sharding(setting, start):
    rank_nodes, bitmaps, order, bs, drop_last = setting
    world = len(rank_nodes)
    if drop_last and len(order) < world:
        return
    holder = placement.holders(bitmaps)
    ours = [
        placement.locality_batches(order, r, world, bs, drop_last, holder, rank_nodes, shard_drop_last=drop_last)
        for r in range(world)
    ]
    theirs = [sampler.batches(sampler.shard(order, r, world, drop_last), bs, drop_last) for r in range(world)]
    for mine, ref in zip(ours, theirs):
        assert [len(b) for b in mine] == [len(b) for b in ref]
    flat = np.concatenate([b for mine in ours for b in mine] + [np.empty(0, np.int64)])
    ref = np.concatenate([b for mine in theirs for b in mine] + [np.empty(0, np.int64)])
    assert np.array_equal(np.sort(flat), np.sort(ref))  # exactly once per epoch, padding included
    later = placement.locality_batches(
        order, 0, world, bs, drop_last, holder, rank_nodes, start, shard_drop_last=drop_last
    )
    assert len(later) == len(ours[0][start:])
    assert all(np.array_equal(a, b) for a, b in zip(later, ours[0][start:]))


@given(setting=epochs(), everything_on_one_node=st.booleans())
def test_a_cache_that_tells_nothing_apart_gives_plain_sharding(setting, everything_on_one_node):
    rank_nodes, _, order, bs, drop_last = setting
    world = len(rank_nodes)
    if everything_on_one_node:  # a single node holding everything: kept entries are dealt round-robin
        rank_nodes = np.zeros(world, np.int64)
    holder = np.full(len(order), 0 if everything_on_one_node else -1)
    for g in placement.global_batches(order, world, bs, drop_last, shard_drop_last=drop_last):
        assert all(np.array_equal(a, b) for a, b in zip(placement.plan(g, holder, rank_nodes), plain(g, world)))


def test_plan_worked_example():
    # 3 ranks (0, 1 on node 0; 2 on node 1), local batch 4; node 2 runs no rank.
    batch = np.arange(12)
    holder = np.array([0, 0, 0, 0, 0, 0, 0, 1, 1, -1, -1, 2])
    parts = placement.plan(batch, holder, np.array([0, 0, 1]))
    # Node 0 keeps its 7 round-robin; the uncached 9, 10 and node 2's 11 go round-robin to ranks with room.
    assert [p.tolist() for p in parts] == [[0, 2, 4, 6], [1, 3, 5, 9], [7, 8, 10, 11]]
    assert traffic(batch, holder, np.array([0, 0, 1]), parts) == 1


def test_balance_moves_the_largest_surplus_to_the_largest_deficit_first():
    # 4 nodes with one rank each, local batch 4: node 0 holds 0..8, node 1 holds 9..11, 12..15 are uncached.
    holder = np.array([0] * 9 + [1] * 3 + [-1] * 4)
    parts = placement.plan(np.arange(16), holder, np.arange(4))
    # Rank 0 keeps 0..3 (node 0's surplus: 4..8), rank 1 keeps 9..11. The uncached go round-robin to ranks with room:
    # 12 -> 1, 13 -> 2, 14 -> 3, 15 -> 2, leaving deficits 2 (rank 2) and 3 (rank 3). Balance fills the largest
    # deficit first from the front of the surplus: 4, 5, 6 -> rank 3, then 7, 8 -> rank 2.
    assert [p.tolist() for p in parts] == [[0, 1, 2, 3], [9, 10, 11, 12], [7, 8, 13, 15], [4, 5, 6, 14]]
    assert traffic(np.arange(16), holder, np.arange(4), parts) == 5


def test_traffic_of_random_placement_is_small():
    """The paper's simulation (Fig. 6): a dataset evenly partitioned over p nodes, one rank per node, local batch 64.

    Measured over 256 global batches each, mean (median) fraction moved: p=2 3.5% (3.1%), p=4 4.0% (3.9%), p=8 4.7%
    (4.7%); the paper's median for local batch 64 is about 4.8%, approached as p grows.
    """
    rng = np.random.default_rng(7)
    for p in (2, 4, 8):
        n = p * 4096
        holder = np.empty(n, np.int64)
        holder[rng.permutation(n)] = np.repeat(np.arange(p), n // p)
        rank_nodes = np.arange(p)
        fractions = [
            traffic(g, holder, rank_nodes, placement.plan(g, holder, rank_nodes)) / len(g)
            for epoch in range(4)
            for g in placement.global_batches(
                sampler.epoch_order(n, 0, epoch), p, 64, drop_last=True, shard_drop_last=True
            )
        ]
        assert np.mean(fractions) < 0.10, (p, np.mean(fractions))


def test_gradients_sum_to_those_of_plain_sharding():
    """The paper's Theorem 1: a plan permutes a global batch among ranks, so the summed gradient is unchanged."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3)).double()
    rng = np.random.default_rng(1)
    n = 200
    x = torch.from_numpy(rng.standard_normal((n, 8)))
    y = torch.from_numpy(rng.integers(0, 3, n))

    def summed(parts):
        total = [torch.zeros_like(w) for w in model.parameters()]
        for ids in parts:  # one backward per rank, then the all-reduce sum
            loss = torch.nn.functional.cross_entropy(model(x[ids]), y[ids], reduction="sum")
            total = [t + g for t, g in zip(total, torch.autograd.grad(loss, list(model.parameters())))]
        return total

    for nodes, per_node in ((2, 3), (3, 1), (4, 2)):
        rank_nodes = np.repeat(np.arange(nodes), per_node)
        world = len(rank_nodes)
        holder = placement.holders(rng.random((nodes, n)) < 0.4)
        order = sampler.epoch_order(n, 3, nodes)
        for g in placement.global_batches(order, world, 5, drop_last=False)[:4]:
            parts = placement.plan(g, holder, rank_nodes)
            assert any(not np.array_equal(a, b) for a, b in zip(parts, plain(g, world)))  # the split does differ
            for ours, ref in zip(summed(parts), summed(plain(g, world))):
                torch.testing.assert_close(ours, ref, rtol=1e-9, atol=0)


def test_caller_mistakes_raise_value_errors():
    holder = np.zeros(10, np.int64)
    with pytest.raises(ValueError, match="split evenly among the 3 ranks"):
        placement.plan(np.arange(7), holder, np.array([0, 0, 1]))
    with pytest.raises(ValueError, match="rank_nodes"):
        placement.plan(np.arange(4), holder, np.array([], np.int64))
    with pytest.raises(ValueError, match="rank_nodes"):
        placement.plan(np.arange(4), holder, np.array([0.0, 1.0]))
    with pytest.raises(ValueError, match=">= 0"):
        placement.plan(np.arange(4), holder, np.array([0, -1]))
    with pytest.raises(ValueError, match="length of holder"):
        placement.plan(np.arange(8, 12), holder, np.array([0, 1]))
    with pytest.raises(ValueError, match="node id or -1"):
        placement.plan(np.arange(4), np.full(10, -2), np.array([0, 1]))
    with pytest.raises(ValueError, match="2-D"):
        placement.holders(np.ones(5, bool))
    with pytest.raises(ValueError, match="world_size and batch_size"):
        placement.global_batches(np.arange(10), 0, 2, False)
    with pytest.raises(ValueError, match="rank must be in"):
        placement.locality_batches(np.arange(10), 2, 2, 2, False, holder, np.array([0, 1]))
    with pytest.raises(ValueError, match="each of the 3 ranks"):
        placement.locality_batches(np.arange(10), 0, 3, 2, False, holder, np.array([0, 1]))
    with pytest.raises(ValueError, match="one array per rank"):
        traffic(np.arange(4), holder, np.array([0, 1]), [np.arange(4)])
    with pytest.raises(ValueError, match="split of batch"):
        traffic(np.arange(4), holder, np.array([0, 1]), [np.arange(2), np.arange(2)])
