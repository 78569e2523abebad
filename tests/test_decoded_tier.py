"""The decoded tier's storage: claim, fill, publish; budget, immutability, crash recovery and the
memory limit. Real shared memory (the ``isolated`` folder) and real SIGKILL."""

from __future__ import annotations

import multiprocessing
import os
import signal
import stat
import time
import warnings

import numpy as np
import pytest

from coordl.fetch import cache as cache_module
from coordl.fetch.decoded import DecodedTier

CTX = multiprocessing.get_context("spawn")
FP = "00decade00decade"
CHUNK, SLICE = 256 << 10, 64 << 10  # small: a few images fill a slice, a few slices a chunk


@pytest.fixture(autouse=True)
def small_layout(cache_layout):
    cache_layout(CHUNK, SLICE)


def tier(shm, budget=1 << 20, n=16, **kw) -> DecodedTier:
    return DecodedTier(FP, n, budget, directory=str(shm), **kw)


def image(i: int, h: int = 20, w: int = 30) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, (h, w, 3), dtype=np.uint8)


def test_images_round_trip_bit_exact_and_read_only(isolated):
    t = tier(isolated)
    ids = np.arange(5)
    assert t.claim_many(ids).all()
    shapes = [(10 + i, 7 + 3 * i) for i in ids]
    done = t.fill_many(ids, [image(i, *s) for i, s in zip(ids, shapes)])
    assert done.all() and t.ready_mask(ids).all()
    for i, got in zip(ids, t.images(ids)):
        assert got.shape == (*shapes[i], 3) and np.array_equal(got, image(i, *shapes[i]))
        with pytest.raises(ValueError):
            got[0, 0, 0] = 1
    assert t.resident_items == 5 and t.resident_bytes == sum(h * w * 3 for h, w in shapes)
    assert all(stat.S_IMODE(os.stat(isolated / f).st_mode) == 0o600 for f in os.listdir(isolated))
    t.close()
    assert not os.listdir(isolated)


def test_published_images_never_change_and_are_not_claimed_again(isolated):
    t = tier(isolated)
    t.claim_many(np.array([3]))
    t.fill_many(np.array([3]), [image(3)])
    assert not t.claim_many(np.array([3])).any()
    assert not t.fill_many(np.array([3]), [image(99)]).any()  # not claimed: nothing written
    assert np.array_equal(t.images(np.array([3]))[0], image(3))
    t.close()


def test_fills_until_the_budget_then_is_full_and_claims_nothing(isolated):
    one = 20 * 30 * 3
    t = tier(isolated, budget=3 * one + 10)
    ids = np.arange(5)
    assert t.claim_many(ids).all()
    done = t.fill_many(ids, [image(i) for i in ids])
    assert done.tolist() == [True, True, True, False, False]
    assert t.full and t.resident_bytes == 3 * one
    assert not t.claim_many(np.arange(3, 16)).any()  # the rest go to the encoded tier
    assert t.ready_mask(ids).tolist() == [True, True, True, False, False]
    t.close()


def test_a_process_claims_each_id_at_most_once_against_another(isolated):
    a, b = tier(isolated), tier(isolated)
    ids = np.arange(16)
    got_a = a.claim_many(ids[::2])
    got_b = b.claim_many(ids)
    assert got_a.all() and not (got_b[::2]).any() and got_b[1::2].all()
    b.abort_claims(ids)  # only b's own claims are given up
    assert not a.claim_many(ids[::2]).any()
    a.close()
    b.close()


def _claim_fill_and_hang(shm: str, ready) -> None:
    os.environ["COORDL_SHM_DIR"] = shm
    # A spawned process: the parent's cache_layout does not reach it.
    cache_module.DEFAULT_CHUNK_BYTES, cache_module.DEFAULT_SLICE_BYTES = CHUNK, SLICE
    t = DecodedTier(FP, 16, 1 << 20, directory=shm)
    t.claim_many(np.array([1, 2]))
    t.fill_many(np.array([1]), [image(1)])
    ready.set()
    time.sleep(60)  # killed here, holding the claim of 2


def test_kill9_with_a_claim_is_a_miss_then_reclaimed_by_the_next_lone_attach(isolated):
    ready = CTX.Event()
    p = CTX.Process(target=_claim_fill_and_hang, args=(str(isolated), ready), daemon=True)
    p.start()
    assert ready.wait(30)
    other = tier(isolated, keep=True)  # so that the segments outlive it, as a run with keep_cache
    assert other.ready_mask(np.array([1, 2])).tolist() == [True, False]
    assert not other.claim_many(np.array([2])).any()  # still claimed by the (living) process
    os.kill(p.pid, signal.SIGKILL)
    p.join(10)
    other.close()
    fresh = tier(isolated)  # alone: reclaims what the dead process left half-done
    assert fresh.ready_mask(np.array([1, 2])).tolist() == [True, False]
    assert fresh.claim_many(np.array([2])).all()
    assert fresh.fill_many(np.array([2]), [image(2)]).all()
    assert np.array_equal(fresh.images(np.array([1]))[0], image(1))
    fresh.close()
    assert not os.listdir(isolated)


class Room:
    """A memory limit whose room runs out after ``left`` bytes."""

    def __init__(self, left: int):
        self.left = left

    def __call__(self, root: str = "/"):
        from coordl.shm.limits import Level, margin

        limit = 1 << 30
        level = Level("test limit", limit, limit - margin(limit) - self.left)
        self.left = max(0, self.left - (64 << 10))  # the slice about to be reserved
        return level


def test_stops_growing_before_the_memory_limit(isolated, memory_limit):
    room = Room(128 << 10)
    memory_limit(room)
    t = tier(isolated, budget=1 << 20)
    ids = np.arange(16)
    t.claim_many(ids)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        done = t.fill_many(ids, [image(i, 100, 100) for i in ids])
    assert 0 < done.sum() < 16 and t.full
    assert t.resident_bytes <= (128 << 10) + (64 << 10)
    assert any("memory limit" in str(x.message) for x in w)
    t.close()
