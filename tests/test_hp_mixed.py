"""HP groups without lockstep: members of different batch sizes and ``drop_last``, and members that
fall a whole ring behind (docs/hp-search.md).

Members are real spawned processes sharing a real staging area in the test's shm folder; each is
checked against a plain loader (no group) of its own batch size: the same batches, in the same
order, with the same images.
"""

from __future__ import annotations

import multiprocessing
import os
import time

import numpy as np
import pytest
import torch

import coordl
from childproc import WAIT, report, result
from conftest import make_tree
from coordl import CoordLoader, GroupConfigError, ImageNetTrain
from coordl.staging.area import StagingArea
from coordl.staging.layout import default_unit, slot_stride

CTX = multiprocessing.get_context("spawn")
RECIPE = ImageNetTrain(size=16)
N = 120  # samples in tiny_dataset
SAMPLE_BYTES = 3 * 16 * 16 * 4


def _loader(root, batch_size, drop_last, **kw):
    return CoordLoader(
        root,
        batch_size=batch_size,
        drop_last=drop_last,
        pipeline=RECIPE,
        shuffle=True,
        return_index=True,
        prep=1,
        fetch=coordl.Fetch(threads=2),
        **kw,
    )


def _member(root, group, batch_size, drop_last, epochs, per_sample_s, start, q):
    """Runs ``epochs`` epochs in ``group``, training ``per_sample_s`` a sample; reports per epoch the
    batches' ids, each sample's image sum, whether each batch was a view of a staged batch (a
    mapping of the slot, not memory torch allocated), and the stats."""

    def body():
        out = {"ids": [], "sums": [], "views": [], "stats": []}
        with _loader(root, batch_size, drop_last, hp_group=group) as loader:
            start.wait(WAIT)
            for e in range(epochs):
                loader.set_epoch(e)
                ids, sums, views = [], {}, []
                for x, _, i in loader:
                    ids.append(i.tolist())
                    sums.update(zip(i.tolist(), x.double().sum(dim=(1, 2, 3)).tolist(), strict=True))
                    views.append(not x.untyped_storage().resizable())  # memory torch did not allocate
                    x.mul_(0)  # a consumer's writes must not reach the other members
                    time.sleep(per_sample_s * len(i))  # the training step
                out["ids"].append(ids)
                out["sums"].append(sums)
                out["views"].append(views)
                out["stats"].append(loader.stats())
        return out

    report(q, body)


def _plain(root, batch_size, drop_last, order_epochs) -> dict:
    """A plain loader's batches and per-sample image sums for each order epoch."""
    got = {}
    with _loader(root, batch_size, drop_last) as loader:
        for e in sorted(set(order_epochs)):
            loader.set_epoch(e)
            ids, sums = [], {}
            for x, _, i in loader:
                ids.append(i.tolist())
                sums.update(zip(i.tolist(), x.double().sum(dim=(1, 2, 3)).tolist(), strict=True))
            got[e] = (ids, sums)
    return got


def _check_against_plain(root, out, batch_size, drop_last) -> None:
    """Every epoch of ``out`` has a plain loader's batches of its batch size for the epoch's order,
    and the same images."""
    orders = [s["order_epoch"] for s in out["stats"]]
    assert orders == sorted(set(orders)), f"an order came twice (the same augmentation twice): {orders}"
    plain = _plain(root, batch_size, drop_last, orders)
    for e, order in enumerate(orders):
        ids, sums = plain[order]
        assert out["ids"][e] == ids, f"batch {batch_size}, epoch {e}: not the plain loader's batches"
        assert sorted(out["sums"][e]) == sorted(sums)
        np.testing.assert_allclose([out["sums"][e][k] for k in sums], list(sums.values()), rtol=1e-6)


# -- batch sizes ---------------------------------------------------------------------------
MIX = [(8, False), (4, True), (12, False), (16, True)]  # staged as 8: views, views, copies, copies


def test_members_of_any_batch_size_and_drop_last_share_one_stream(tiny_dataset, isolated, procs):
    group = coordl.HPGroup("mix", stage_batch=8)
    start, qs = CTX.Barrier(len(MIX)), [CTX.Queue() for _ in MIX]
    for (b, dl), q in zip(MIX, qs, strict=True):
        procs(_member, str(tiny_dataset), group, b, dl, 2, 0.0005, start, q)  # the same pace per sample
    outs = [result(q, 120) for q in qs]
    for (b, dl), out in zip(MIX, outs, strict=True):
        _check_against_plain(str(tiny_dataset), out, b, dl)
        sizes = {len(batch) for ids in out["ids"] for batch in ids}
        assert sizes == ({b} if dl or N % b == 0 else {b, N % b})
        views = [v for epoch in out["views"] for v in epoch]
        if 8 % b == 0:  # batches inside one staged batch: views of it, no copy
            assert all(views), f"batch {b}: a batch inside a staged one was copied"
        else:
            assert not any(views), f"batch {b}: a batch across staged ones is not a view"
    # One stream for the group: each staged batch of a pass made once (work-ahead may add a pass),
    # and every member took batches that another made.
    produced = sum(s["produced"] for o in outs for s in o["stats"])
    assert 2 * 15 <= produced <= 3 * 15
    assert all(sum(s["consumed_shared"] for s in o["stats"]) > 0 for o in outs)
    assert not any(s["detached"] for o in outs for s in o["stats"])


# -- the default staged batch: a sweep of power-of-two batch sizes ---------------------------------
SWEEP = (16, 64, 128)
SWEEP_N = 1040  # 8 staged batches of 128 and a partial ninth: the default stages 128 whoever comes first


@pytest.fixture(scope="module")
def sweep_dataset(tmp_path_factory):
    return make_tree(tmp_path_factory.mktemp("sweep") / "train", classes=4, per_class=SWEEP_N // 4)


def _trial(root, batch_size, epochs, before, entered, start, q):
    """A trial of ``hp_group="sweep"`` (the shorthand) that joins the group once ``before`` is set (the
    trial ahead of it in the start order is a member), sets ``entered``, and starts consuming with the
    others; reports per epoch its ids, whether each batch was a view, and the stats."""

    def body():
        out = {"ids": [], "views": [], "stats": []}
        with _loader(root, batch_size, False, hp_group="sweep") as loader:
            if before is not None:
                assert before.wait(WAIT)
            it = iter(loader)  # the first of them makes the group's staging area
            entered.set()
            start.wait(WAIT)
            for e in range(epochs):
                if e:
                    loader.set_epoch(e)
                    it = iter(loader)
                ids, views = [], []
                for x, _, i in it:
                    ids.append(i.tolist())
                    views.append(not x.untyped_storage().resizable())  # memory torch did not allocate
                out["ids"].append(ids)
                out["views"].append(views)
                out["stats"].append(loader.stats())
        return out

    report(q, body)


@pytest.mark.parametrize("order", [SWEEP, SWEEP[::-1]], ids=["smallest-first", "largest-first"])
def test_a_sweep_of_power_of_two_batch_sizes_gets_views_with_the_shorthand_whoever_starts_first(
    sweep_dataset, isolated, procs, order
):
    """issue 47: with ``hp_group="sweep"`` the first trial's batch size once set the staged batch, so a
    trial of a larger batch got a copy of every batch when a smaller one happened to start first."""
    entered = [CTX.Event() for _ in order]
    start, qs = CTX.Barrier(len(order)), [CTX.Queue() for _ in order]
    for k, (b, q) in enumerate(zip(order, qs, strict=True)):
        procs(_trial, str(sweep_dataset), b, 2, entered[k - 1] if k else None, entered[k], start, q)
    outs = {b: result(q, 240) for b, q in zip(order, qs, strict=True)}
    for b, out in outs.items():
        for epoch, (ids, views) in enumerate(zip(out["ids"], out["views"], strict=True)):
            flat = [i for batch in ids for i in batch]
            assert sorted(flat) == list(range(SWEEP_N)), f"batch {b}, epoch {epoch}: not every sample once"
            assert [len(batch) for batch in ids] == [b] * (SWEEP_N // b) + [SWEEP_N % b][: SWEEP_N % b]
            assert all(views), f"batch {b}, epoch {epoch}: {views.count(False)} of {len(views)} batches copied"
    for out in outs.values():
        for s in out["stats"]:
            assert s["stage_batch"] == 128
            assert s["staging_bound"] == 16 * slot_stride(128, (3, 16, 16), "float32")  # the 16 slots of "auto"
            assert not s["detached"]
        assert sum(s["consumed_shared"] for s in out["stats"]) > 0  # one stream for the group


def test_the_default_staged_batch_doubles_the_first_batch_size_within_its_limits():
    shape, f32, auto, free = (3, 224, 224), "float32", "auto", 100 << 30
    per = slot_stride(1, shape, f32)
    assert default_unit(16, 10**6, shape, f32, auto, free) == 128  # 16 slots of 256 pass 2 GiB
    assert default_unit(16, 10**6, shape, "uint8", auto, free) == 256  # at most 256 samples
    assert default_unit(512, 10**6, shape, f32, auto, free) == 512  # never below the first batch size
    assert default_unit(24, 10**6, shape, f32, auto, free) == 192  # a multiple of it: its batches stay views
    assert default_unit(16, 1000, shape, f32, auto, free) == 64  # at most an eighth of a pass
    assert default_unit(16, 10**6, shape, f32, 16 * 32 * per + 4096, free) == 32  # 16 slots of the bound
    assert default_unit(16, 10**6, shape, f32, 15 * 16 * per, free) == 16  # a small bound: as given
    assert default_unit(16, 10**6, shape, f32, auto, 2 * 16 * 32 * per) == 32  # half the free shm
    for b in (1, 2, 4, 8, 16, 32, 64, 128):  # power-of-two firsts agree: the order of the trials is no matter
        assert default_unit(b, 10**6, shape, f32, auto, free) == 128


def test_a_batch_spanning_more_staged_batches_than_the_ring_holds_is_refused(tiny_dataset, isolated):
    group = coordl.HPGroup("span", stage_batch=2, staging=4 * slot_stride(2, (3, 16, 16), "float32"))
    with _loader(str(tiny_dataset), 2, False, hp_group=group) as first:
        next(iter(first))
        with _loader(str(tiny_dataset), 8, False, hp_group=group) as big:
            message = "stages batches of 2 samples in 4 slots; a batch of 8 spans up to 5 of them and needs 7 slots"
            with pytest.raises(GroupConfigError, match=message):
                next(iter(big))


# -- a slow member -------------------------------------------------------------------------
def test_a_slow_member_is_detached_makes_the_rest_alone_and_gets_its_batches_exactly(tiny_dataset, isolated, procs):
    staging = 5 * slot_stride(8, (3, 16, 16), "float32")  # 5 slots: a pass is 15 staged batches
    group = coordl.HPGroup("slow", staging=staging)
    start, qs = CTX.Barrier(3), [CTX.Queue() for _ in range(3)]
    paces = (0.0002, 0.0002, 0.004)  # the third trains 20x slower per sample
    for pace, q in zip(paces, qs, strict=True):
        procs(_member, str(tiny_dataset), group, 8, False, 3, pace, start, q)
    fast_a, fast_b, slow = (result(q, 120) for q in qs)
    for out in (fast_a, fast_b, slow):
        _check_against_plain(str(tiny_dataset), out, 8, False)
    assert not any(s["detached"] for o in (fast_a, fast_b) for s in o["stats"])
    first = slow["stats"][0]
    assert first["detached"] and first["alone_batches"] > 0  # a whole ring behind in its first epoch
    assert first["batches"] == 15


def _area(name, **kw):
    return StagingArea(
        name,
        0,
        {"dataset": "x"},
        batch_size=2,
        batches_per_pass=10,
        sample_shape=(3, 4, 4),
        dtype="uint8",
        epoch=0,
        bound=4 * 4096,
        **kw,
    )


def _full_ring(name):
    """Two members of a 4-slot ring: the fast one made and consumed batches 0-3, the slow one none."""
    fast, slow = _area(name), _area(name)
    fast.enroll(0, may_rebase=False)
    slow.enroll(0, may_rebase=False)
    for _ in range(4):
        fast.publish(fast.claim(block=False), 2)
    for q in range(4):
        fast.release(fast.take(q))
    return fast, slow


def test_only_a_member_a_whole_ring_behind_that_trains_slower_is_detached(isolated):
    fast, slow = _full_ring("lag")
    try:
        assert fast.claim(block=False) is None  # full: the slow member still needs batch 0
        assert fast.detach_laggards(4) == []  # no pace known yet: it is waited for
        fast.set_pace(0.001)
        slow.set_pace(0.00124)  # a whole ring behind, but less than 1.25x slower: waited for
        assert fast.detach_laggards(4) == []
        assert fast.detach_laggards(3) == []  # batch 3 is made: nobody waits for room
        slow.set_pace(0.002)
        assert fast.detach_laggards(4) == [os.getpid()]
        assert slow.detached and slow.take(0) is None  # it finishes its pass alone
        assert fast.claim(block=False).q == 4  # the ring moves on without it
        slow.finish_pass(10)
        start, continues = slow.enroll(1, may_rebase=False, after=0)
        assert (start, continues) == (10, False) and not slow.detached  # it rejoins at the next pass
    finally:
        slow.close()
        fast.close()


def test_a_member_holding_the_oldest_batch_s_tensor_is_behind_too(isolated):
    fast, slow = _full_ring("held")
    try:
        held = slow.take(0)  # its cursor moved on, but its tensor still maps batch 0's slot
        fast.set_pace(0.001)
        slow.set_pace(0.01)
        assert fast.detach_laggards(4) == [os.getpid()]
        assert fast.claim(block=False) is None  # the slot stays until the tensor lets it go
        slow.release(held)
        assert fast.claim(block=False).q == 4
    finally:
        slow.close()
        fast.close()


def test_stage_batch_is_checked():
    with pytest.raises(ValueError, match=r"HPGroup\(stage_batch\) must be a positive int, got 0"):
        coordl.HPGroup("x", stage_batch=0)
    assert coordl.HPGroup("x", stage_batch=64).stage_batch == 64


def test_a_view_is_private_to_the_member_and_outlives_the_slot(tiny_dataset, isolated):
    """A batch handed as a view of a staged one: writes stay in this process, and the tensor keeps
    its values after the member moved on (the slot was unshared before it was reused)."""
    group = coordl.HPGroup("view", stage_batch=8, staging=4 * slot_stride(8, (3, 16, 16), "float32"))
    with _loader(str(tiny_dataset), 4, False, hp_group=group) as loader:
        kept = []
        for x, _, _ in loader:
            kept.append((x, x.clone()))
        for x, copy in kept:
            torch.testing.assert_close(x, copy)


@pytest.mark.parametrize("batch_size", [4, 12])  # inside one staged batch; across two
def test_uint8_staged_batches_cut_and_normalised_by_the_member_match_the_pipeline(
    tiny_dataset, isolated, monkeypatch, batch_size
):
    """The path a member on a GPU takes (uint8 rows, normalised by the member), on the CPU."""
    val = coordl.ImageNetVal(size=16, resize=20)  # deterministic, so both ways must agree
    kw = {"pipeline": val, "shuffle": False, "return_index": True, "prep": 1}
    with CoordLoader(str(tiny_dataset), batch_size=batch_size, **kw) as plain:
        want = [(x, i) for x, _, i in plain]
    monkeypatch.setenv("COORDL_HP_STAGE_UINT8", "1")
    group = coordl.HPGroup("u8-cut", stage_batch=8)
    with CoordLoader(str(tiny_dataset), batch_size=batch_size, hp_group=group, **kw) as grouped:
        got = [(x, i) for x, _, i in grouped]
    assert [i.tolist() for _, i in got] == [i.tolist() for _, i in want]
    for (g, _), (w, _) in zip(got, want, strict=True):
        assert g.dtype == torch.float32 and g.shape == w.shape
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-5)
