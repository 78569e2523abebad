"""The decoded tier seen from a training script: the same tensors with and without it, decoding
once per node for every epoch and every job, the stats per tier, and ``decoded_cache="auto"``.

Real DALI pipelines on the CPU, real shared memory, real processes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import coordl
from coordl import CoordLoader, DecodedRecipe, ImageNetTrain, ImageNetVal
from coordl.analyze.model import TierRates, best_tier_split, tier_throughput
from coordl.fetch import storage
from coordl.prep.dali import DECODED_ONLY, TIERED

BIG = "1GB"  # more than the decoded test datasets


def epochs(loader, n: int = 2) -> tuple[list[list[torch.Tensor]], list[dict]]:
    """Every batch's images (copied) of ``n`` epochs, and each epoch's stats."""
    out, stats = [], []
    for _ in range(n):
        out.append([images.clone() for images, _ in loader])
        stats.append(loader.stats())
    return out, stats


def assert_same(a, b) -> None:
    assert len(a) == len(b)
    for ea, eb in zip(a, b, strict=True):
        assert len(ea) == len(eb)
        for x, y in zip(ea, eb, strict=True):
            assert x.dtype == y.dtype and x.shape == y.shape
            assert torch.equal(x, y), "the decoded tier changed a delivered tensor"


def _flip_and_crop(images, ctx):
    from nvidia.dali import fn

    images = fn.flip(images, horizontal=ctx.random.coin_flip(0.5))
    return fn.resize(images, resize_x=24, resize_y=20)


@pytest.mark.parametrize(
    "pipeline",
    [
        ImageNetTrain(size=32),
        ImageNetTrain(size=24, dtype="uint8"),
        ImageNetVal(size=24, resize=28),
        ImageNetTrain(size=24, max_short_side=50),
        ImageNetVal(size=20, resize=24, max_short_side=50),
    ],
    ids=["train", "train-uint8", "val", "train-capped", "val-capped"],
)
def test_tensors_are_bit_for_bit_the_same_with_and_without_the_tier(tiny_dataset, pipeline):
    kw = dict(batch_size=16, pipeline=pipeline, seed=3, device_id=None, prep=2, shuffle=True)
    with CoordLoader(str(tiny_dataset), **kw, cache=coordl.Cache(decoded=0)) as plain:
        want, _ = epochs(plain)
    with CoordLoader(str(tiny_dataset), **kw, cache=coordl.Cache(size=BIG, decoded=BIG)) as tiered:
        got, stats = epochs(tiered)
    assert_same(want, got)
    n = len(tiered.index)
    # Epoch 0 decoded every image once into the tier; epoch 1 decoded none and read nothing.
    assert stats[0]["decoded_admitted"] == n and stats[0]["decoded_hits"] == 0
    assert stats[1]["decoded_hits"] == n and stats[1]["decoded_admitted"] == 0
    assert stats[1]["storage_reads"] == 0 and stats[1]["cache_hits"] == 0
    assert stats[1]["decoded_cache_items"] == n
    assert stats[1]["decoded_hit_bytes"] == stats[1]["decoded_cache_bytes"]
    # Epoch 1 came from the tier alone: the pipeline of the augmentation alone ran it.
    assert tiered.resources.prep.mode == DECODED_ONLY


@pytest.mark.parametrize("cap", [None, 50], ids=["file-resolution", "capped"])
def test_half_a_tier_serves_some_decoded_and_the_rest_encoded_alike(tiny_dataset, cap):
    kw = dict(batch_size=16, seed=5, device_id=None, pipeline=ImageNetTrain(size=32, max_short_side=cap), prep=2)
    kw["shuffle"] = True
    with CoordLoader(str(tiny_dataset), **kw, cache=coordl.Cache(decoded=0)) as plain:
        want, _ = epochs(plain, 3)
    full = sum(int(np.prod(s)) for s in _decoded_shapes(tiny_dataset, cap))
    budget = f"{full // 2}B"
    with CoordLoader(str(tiny_dataset), **kw, cache=coordl.Cache(size="1GB", decoded=budget)) as tiered:
        got, stats = epochs(tiered, 3)
    assert_same(want, got)
    n = len(tiered.index)
    s = stats[2]
    assert 0 < s["decoded_hits"] < n
    assert s["decoded_hits"] + s["cache_hits"] == n and s["storage_reads"] == 0
    assert s["decoded_cache_bytes"] <= s["decoded_cache_budget"] == full // 2
    assert tiered.resources.prep.mode == TIERED  # batches that mix both tiers


def _decoded_shapes(root: Path, cap: int | None = None) -> list[tuple[int, int, int]]:
    """Each image's decoded shape, capped at a shorter side of ``cap`` as the recipe caps it."""
    from PIL import Image

    shapes = []
    for p in sorted(root.rglob("*.jpg")):
        w, h = Image.open(p).size
        if cap and min(w, h) > cap:
            w, h = (cap, round(h * cap / w)) if w < h else (round(w * cap / h), cap)
        shapes.append((h, w, 3))
    return shapes


def test_a_decoded_recipe_uses_the_tier_and_a_callable_on_bytes_cannot(tiny_dataset):
    kw = dict(batch_size=16, seed=1, device_id=None, prep=2, shuffle=True)
    recipe = DecodedRecipe(_flip_and_crop)
    with CoordLoader(str(tiny_dataset), pipeline=recipe, **kw) as plain:
        want, _ = epochs(plain)
    with CoordLoader(str(tiny_dataset), pipeline=recipe, **kw, cache=coordl.Cache(size=BIG, decoded=BIG)) as tiered:
        got, stats = epochs(tiered)
    assert_same(want, got)
    assert stats[1]["decoded_hits"] == len(tiered.index)

    def on_bytes(encoded, ctx):
        return _flip_and_crop(__import__("nvidia.dali.fn", fromlist=["fn"]).decoders.image(encoded), ctx)

    with pytest.raises(ValueError, match="DecodedRecipe"):
        CoordLoader(str(tiny_dataset), pipeline=on_bytes, **kw, cache=coordl.Cache(decoded=BIG))
    with CoordLoader(str(tiny_dataset), pipeline=on_bytes, **kw, cache=coordl.Cache(decoded="auto")) as auto:
        assert auto.decoded_tier is None  # "auto" stays on encoded bytes, as the recipe must


def test_a_capped_tier_holds_the_capped_images_and_is_another_tier(tiny_dataset):
    kw = dict(batch_size=16, seed=4, device_id=None, cache=coordl.Cache(size=BIG, decoded=BIG), prep=2, shuffle=True)
    with CoordLoader(str(tiny_dataset), pipeline=ImageNetTrain(size=24, max_short_side=50), **kw) as capped:
        got = [images.clone() for images, _ in capped]
        images = capped.decoded_tier.images(np.arange(len(capped.index)))
        # Shorter side at most 50, the aspect kept, smaller images as they were.
        shapes = _decoded_shapes(tiny_dataset)
        assert any(min(h, w) <= 50 for h, w, _ in shapes) and any(min(h, w) > 50 for h, w, _ in shapes)
        assert [image.shape for image in images] == _decoded_shapes(tiny_dataset, 50)
        # A cap changes the data: the uncapped recipe has a tier of its own and delivers other tensors.
        with CoordLoader(str(tiny_dataset), pipeline=ImageNetTrain(size=24), **kw) as uncapped:
            other = [images.clone() for images, _ in uncapped]
            assert uncapped.tier_plan.decoded.fingerprint != capped.tier_plan.decoded.fingerprint
            assert uncapped.stats()["decoded_admitted"] == len(capped.index)  # it found none decoded
    assert not all(torch.equal(x, y) for x, y in zip(got, other, strict=True))


def test_max_short_side_is_validated():
    for bad in (0, -3, 2.5, "256", True):
        with pytest.raises(ValueError, match="max_short_side must be a positive int"):
            ImageNetTrain(max_short_side=bad)
    with pytest.raises(ValueError, match="max_short_side"):
        DecodedRecipe(_flip_and_crop, max_short_side=0)


def test_decoded_cache_is_refused_where_it_cannot_work_and_says_why(tiny_dataset):
    with pytest.raises(ValueError, match="torch backend"):
        CoordLoader(coordl.datasets.ImageFolder(str(tiny_dataset)), cache=coordl.Cache(decoded="1GB"), shuffle=True)
    # A float is a fraction of the dataset for Cache(size); the decoded tier's share is bytes, never a float.
    with pytest.raises(TypeError, match=r"Cache\(decoded\)=0.25: give bytes"):
        coordl.Cache(size="100MB", decoded=0.25)
    with pytest.raises(ValueError, match=r"Cache\(decoded\)='lots': cannot parse"):
        coordl.Cache(decoded="lots")


def test_the_tiers_share_of_the_cache_goes_to_the_tier(tiny_dataset):
    with CoordLoader(
        str(tiny_dataset),
        device_id=None,
        cache=coordl.Cache(size="100MB", decoded="25MB"),
        shuffle=True,
        pipeline="imagenet-train",
    ) as loader:
        # The tier's share comes out of the cache's size; the rest holds encoded bytes, never more
        # than the dataset's files.
        total = loader.index.total_bytes
        assert loader.tier_plan.decoded_budget == 25_000_000 and loader.tier_plan.encoded_budget == total
        assert loader.node_cache.budget == total and loader.decoded_tier.budget == 25_000_000
    with CoordLoader(
        str(tiny_dataset), device_id=None, cache=coordl.Cache(size="10MB", decoded="9.9MB"), pipeline="imagenet-train"
    ) as loader:
        assert loader.tier_plan.decoded_budget == 9_900_000 and loader.tier_plan.encoded_budget == 100_000


# -- shared by the jobs of a node --------------------------------------------------------------------
JOB = textwrap.dedent(
    """
    import json, sys
    import coordl
    from coordl import CoordLoader, ImageNetTrain
    root, seed, epochs, keep = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "keep"
    loader = CoordLoader(root, batch_size=8, pipeline=ImageNetTrain(size=24), seed=seed, device_id=None, prep=1,
                         shuffle=True, cache=coordl.Cache(size="1GB", decoded="1GB", keep=keep))
    out = []
    for e in range(epochs):
        for _ in loader:
            pass
        s = loader.stats()
        out.append({k: s[k] for k in ("decoded_admitted", "decoded_hits", "storage_reads", "samples")})
    print(json.dumps(out))
    """
)


def run_jobs(root: Path, *jobs: tuple[int, int, str]) -> list[list[dict]]:
    """Runs the training scripts at once; each one's per-epoch stats."""
    running = [
        subprocess.Popen(
            [sys.executable, "-c", JOB, str(root), str(seed), str(n), keep],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for seed, n, keep in jobs
    ]
    out = []
    for p in running:
        stdout, stderr = p.communicate(timeout=300)
        assert p.returncode == 0, stderr
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out


def test_independent_jobs_decode_each_image_once_per_node(tiny_dataset, isolated):
    n = len(list(tiny_dataset.rglob("*.jpg")))
    a, b = run_jobs(tiny_dataset, (1, 2, "no"), (2, 2, "no"))
    # Together they put every image into the tier exactly once, each in its own order.
    assert (
        a[0]["decoded_admitted"] + b[0]["decoded_admitted"] + a[1]["decoded_admitted"] + b[1]["decoded_admitted"] == n
    )
    assert a[0]["samples"] == b[0]["samples"] == n
    assert not os.listdir(isolated)


def test_a_later_job_finds_the_images_decoded(tiny_dataset, isolated):
    n = len(list(tiny_dataset.rglob("*.jpg")))
    (first,) = run_jobs(tiny_dataset, (1, 1, "keep"))
    assert first[0]["decoded_admitted"] == n
    (later,) = run_jobs(tiny_dataset, (7, 1, "no"))
    assert later[0] == {"decoded_admitted": 0, "decoded_hits": n, "storage_reads": 0, "samples": n}
    assert not os.listdir(isolated)  # the later job, the last to leave, removed both tiers


# -- "auto" --------------------------------------------------------------------------------------------
def test_the_model_keeps_encoded_bytes_when_storage_is_the_bottleneck():
    io_bound = TierRates(10_000, 100e3, 400e3, storage=5e6, cache=float("inf"), prep_encoded=500, prep_decoded=900)
    prep_bound = TierRates(10_000, 100e3, 400e3, storage=5e9, cache=float("inf"), prep_encoded=500, prep_decoded=900)
    dataset = 10_000 * 100e3
    assert best_tier_split(io_bound, dataset / 2) == 0  # half the files fit: every byte decoded is a read more
    assert best_tier_split(prep_bound, 10_000 * 400e3) == pytest.approx(10_000 * 400e3, rel=0.02)


def test_the_model_uses_the_decoded_only_rate_when_the_tier_holds_every_sample():
    r = TierRates(10_000, 100e3, 400e3, 5e9, float("inf"), 500, 900, prep_decoded_only=1200)
    budget = 10_000 * (100e3 + 400e3)
    assert tier_throughput(r, budget, 0) == pytest.approx(500)  # no tier
    assert tier_throughput(r, budget, 10_000 * 400e3) == pytest.approx(1200)  # every sample decoded
    half = tier_throughput(r, budget, 10_000 * 400e3 / 2)  # mixed batches: the mixed pipeline's rates
    assert half == pytest.approx(1 / (0.5 / 900 + 0.5 / 500))
    # Without the decoded-only rate, the mixed one stands in for it.
    whole = TierRates(10_000, 100e3, 400e3, 5e9, float("inf"), 500, 900)
    assert tier_throughput(whole, budget, 10_000 * 400e3) == pytest.approx(900)


@pytest.fixture(scope="module")
def photo_like(tmp_path_factory) -> Path:
    """Larger JPEGs, whose decoding costs more than their augmentation."""
    root = tmp_path_factory.mktemp("photo") / "train"
    rng = np.random.default_rng(0)
    from conftest import write_jpeg

    for c in range(2):
        (root / f"c{c}").mkdir(parents=True)
        for i in range(24):
            write_jpeg(root / f"c{c}" / f"{i}.jpg", rng, size=(640, 480), quality=95)
    return root


def test_auto_spends_memory_on_decoded_images_when_prep_is_the_bottleneck(photo_like):
    # Batches of 32: at 8, on busy cores, the mixed pipeline's per-batch cost hides what a decoded image
    # saves (193 against 194 samples/s from encoded bytes; 313-383 against 231-235 at 32).
    with CoordLoader(
        str(photo_like),
        batch_size=32,
        device_id=None,
        cache=coordl.Cache(size="1GB", decoded="auto"),
        prep=2,
        shuffle=True,
        pipeline="imagenet-train",
    ) as loader:
        rates = loader.tier_plan.rates
        assert rates["decoded"] > rates["encoded"]  # augmenting a decoded image is cheaper than decoding it
        assert rates["decoded_only"] > rates["encoded"]
        # The whole decoded dataset, with room to spare for an estimate made on a few images.
        whole = 48 * 640 * 480 * 3
        assert loader.decoded_tier is not None and loader.tier_plan.decoded_budget >= whole
        for _ in range(2):
            for _ in loader:
                pass
        assert loader.stats()["decoded_hits"] == 48 and loader.resources.prep.mode == DECODED_ONLY


def test_auto_keeps_encoded_bytes_when_storage_is_throttled(photo_like, monkeypatch):
    real = storage.read_many
    device = threading.Lock()

    def slow(paths, sizes, buffers, **kw):  # one storage device of about 2 MB/s, whatever the threads
        with device:
            time.sleep(sum(sizes) / 2e6)
        return real(paths, sizes, buffers, **kw)

    monkeypatch.setattr(storage, "read_many", slow)
    # Half the files fit: every byte of memory spent on decoded images is more read from storage.
    with CoordLoader(
        str(photo_like),
        batch_size=8,
        device_id=None,
        cache=coordl.Cache(size=0.5, decoded="auto"),
        prep=2,
        shuffle=True,
        pipeline="imagenet-train",
    ) as loader:
        assert loader.tier_plan.rates["storage"] < 5e6
        assert loader.decoded_tier is None and loader.tier_plan.decoded_budget == 0


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="one core leaves no thread count to choose")
def test_auto_chooses_the_fewest_threads_near_the_best_rate_unless_the_user_set_them(photo_like):
    kw = {
        "batch_size": 8,
        "cache": coordl.Cache(size="1GB", decoded="auto"),
        "device_id": None,
        "shuffle": True,
        "pipeline": "imagenet-train",
    }
    with CoordLoader(str(photo_like), **kw) as loader:
        tried = {int(t): r for t, r in loader.tier_plan.rates["thread_rates"].items()}
        assert 1 in tried and os.cpu_count() in tried
        best = max(tried.values())
        assert loader.num_threads == loader.tier_plan.threads == min(t for t, r in tried.items() if r >= 0.95 * best)
        assert loader.tier_plan.rates["threads"] == loader.num_threads
    with CoordLoader(str(photo_like), **kw, prep=1) as loader:
        assert loader.tier_plan.threads is None and loader.tier_plan.rates["thread_rates"] is None
        assert loader.num_threads == 1 and loader.tier_plan.rates["threads"] == 1
