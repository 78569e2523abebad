"""The sampler's pure functions: permutations, DistributedSampler-compatible shards, batches."""

import numpy as np
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
