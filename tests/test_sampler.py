"""The sampler's pure functions: permutations, DistributedSampler-compatible shards, batches."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from coordl import sampler


@given(n=st.integers(1, 500), seed=st.integers(0, 2**63), epoch=st.integers(0, 1000))
def test_epoch_order_is_a_permutation_decided_by_seed_and_epoch(n, seed, epoch):
    a = sampler.epoch_order(n, seed, epoch)
    assert sorted(a.tolist()) == list(range(n))
    assert np.array_equal(a, sampler.epoch_order(n, seed, epoch))


def test_epochs_and_seeds_reshuffle():
    orders = {tuple(sampler.epoch_order(1000, 0, e)) for e in range(10)}
    assert len(orders) == 10
    assert not np.array_equal(sampler.epoch_order(1000, 0, 0), sampler.epoch_order(1000, 1, 0))
    assert np.array_equal(sampler.epoch_order(7, 0, 3, shuffle=False), np.arange(7))


@given(n=st.integers(1, 300), world=st.integers(1, 9), drop_last=st.booleans(), seed=st.integers(0, 99))
def test_shards_cover_the_epoch_exactly_once_up_to_padding(n, world, drop_last, seed):
    if drop_last and n < world:
        return
    order = sampler.epoch_order(n, seed, 0)
    shards = [sampler.shard(order, r, world, drop_last) for r in range(world)]
    sizes = {len(s) for s in shards}
    assert sizes == {sampler.shard_size(n, world, drop_last)}
    ids = np.concatenate(shards)
    counts = np.bincount(ids, minlength=n)
    if drop_last:
        assert counts.max() == 1 and counts.sum() == (n // world) * world
    else:
        assert counts.min() >= 1  # every sample at least once
        assert counts.sum() - n <= world - 1  # the only repeats are the padding


@settings(max_examples=50)
@given(n=st.integers(1, 200), world=st.integers(1, 6), drop_last=st.booleans())
def test_shards_match_torch_distributed_sampler(n, world, drop_last):
    if drop_last and n < world:
        return
    order = np.arange(n)
    for rank in range(world):
        ref = torch.utils.data.DistributedSampler(
            range(n), num_replicas=world, rank=rank, shuffle=False, drop_last=drop_last
        )
        assert sampler.shard(order, rank, world, drop_last).tolist() == list(ref)


@given(n=st.integers(0, 100), bs=st.integers(1, 17), drop_last=st.booleans(), start=st.integers(0, 10))
def test_batches_partition_the_shard(n, bs, drop_last, start):
    ids = np.arange(n)
    full = sampler.batches(ids, bs, drop_last)
    assert len(full) == sampler.num_batches(n, bs, drop_last)
    assert all(len(b) == bs for b in full[:-1])
    flat = np.concatenate(full) if full else np.array([], dtype=int)
    assert flat.tolist() == list(range(len(flat)))
    assert len(flat) == ((n // bs) * bs if drop_last else n)
    resumed = sampler.batches(ids, bs, drop_last, start=start)
    assert [b.tolist() for b in resumed] == [b.tolist() for b in full[start:]]


def cut_epoch(n: int, world: int, seed: int, epoch: int) -> tuple[list[np.ndarray], set[int]]:
    """coordl's shards of a shuffled epoch with ``Shard(pad=False)``, checked against
    ``DistributedSampler(drop_last=True)`` over a dataset of ``n`` samples; and the samples left out.

    ``DistributedSampler`` deals positions of its own order; coordl's order is its own
    (:func:`sampler.epoch_order`), so the unshuffled sampler's positions are taken through it: rank
    ``r`` gets ``order[r::world]`` of the order cut to a multiple of ``world``."""
    order = sampler.epoch_order(n, seed, epoch)
    shards, dealt = [], set()
    for rank in range(world):
        ref = list(
            torch.utils.data.DistributedSampler(range(n), num_replicas=world, rank=rank, shuffle=False, drop_last=True)
        )
        mine = sampler.shard(order, rank, world, drop_last=True)
        assert mine.tolist() == order[ref].tolist() == order[: len(ref) * world][rank::world].tolist()
        shards.append(mine)
        dealt.update(ref)
    left_out = set(range(n)) - set(np.concatenate(shards).tolist())
    assert left_out == set(order[sorted(set(range(n)) - dealt)].tolist())  # the positions the reference leaves out
    assert len(left_out) == n - len(dealt) == n % world  # as many as the reference leaves out: up to world - 1
    return shards, left_out


@settings(max_examples=50)
@given(n=st.integers(2, 300), world=st.integers(2, 9), seed=st.integers(0, 2**63), epoch=st.integers(0, 1000))
def test_cut_shards_are_distributed_samplers_over_the_epochs_order(n, world, seed, epoch):
    """docs/guarantees.md, Exactly once: ``Shard(pad=False)`` cuts the end of the epoch's order,
    as ``DistributedSampler(drop_last=True)`` cuts its own: ``floor(n / world)`` samples a rank,
    none twice, and the ``n % world`` samples at the end of the order left out."""
    if n < world:
        return
    shards, _ = cut_epoch(n, world, seed, epoch)
    ids = np.concatenate(shards)
    assert len(set(ids.tolist())) == len(ids) == (n // world) * world


@pytest.mark.parametrize("n, world", [(10, 3), (50, 3), (123, 4), (1000, 7)])
def test_cut_shards_leave_out_other_samples_every_epoch(n, world):
    """docs/guarantees.md, Exactly once: with ``Shard(pad=False)`` and shuffling, the samples
    left out are other ones every epoch: a fresh choice of the ``n % world`` at the end of a fresh
    order. An order is fixed by ``(seed, epoch)``, so for these seeds the counts below are exact,
    and the bounds are what chance allows (five standard deviations above the mean): a sampler
    that cuts the same samples every epoch has ``epochs - 1`` repeats and one sample left out
    every epoch. By chance two epochs in a row may leave out the same set, with probability
    ``1 / comb(n, n % world)`` (1 in 10 for 10 samples on 3 ranks)."""
    epochs, k = 300, n % world
    p_same = 1 / math.comb(n, k)
    p_out = k / n
    for seed in (0, 1, 12345):
        left = [cut_epoch(n, world, seed, epoch)[1] for epoch in range(epochs)]
        same = sum(a == b for a, b in zip(left, left[1:]))
        mean = (epochs - 1) * p_same
        assert same <= mean + 5 * math.sqrt(mean) + 1, f"seed {seed}: {same} epochs left out what the one before did"
        times = np.bincount([i for s in left for i in s], minlength=n)
        mean = epochs * p_out
        assert times.max() <= mean + 5 * math.sqrt(mean) + 1, f"seed {seed}: a sample left out in {times.max()} epochs"
