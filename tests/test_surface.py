"""The constructor a user reads: DataLoader's parameters with DataLoader's meanings and defaults,
one option object per feature (with its shorthand), the pre-processing named rather than
defaulted, and earlier spellings refused with the new one named."""

from __future__ import annotations

import dataclasses
import inspect
import os
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest
from torch.utils.data import DataLoader, DistributedSampler

import coordl
from coordl import CoordLoader, sampler
from coordl.renamed import RENAMED

VAL = coordl.ImageNetVal(size=16, resize=18)


def _loader(root, **kw):
    kw.setdefault("pipeline", VAL)
    kw.setdefault("device_id", None)
    kw.setdefault("prep", 1)
    kw.setdefault("cache", 0)
    kw.setdefault("return_index", True)
    return CoordLoader(root, **kw)


# -- the signature ------------------------------------------------------------------------------
def test_at_most_30_parameters_and_each_feature_takes_one():
    params = inspect.signature(CoordLoader).parameters
    assert len(params) <= 30, list(params)
    features = {"cache": coordl.Cache, "peers": coordl.Peers, "hp_group": coordl.HPGroup}
    features |= {"shard": coordl.Shard, "prep": coordl.Prep, "fetch": coordl.Fetch}
    for name, option in features.items():
        assert name in params, name
        assert dataclasses.is_dataclass(option) and option.__dataclass_params__.frozen, option
    # No feature's tuning stands beside its option object, nor shares a name of DataLoader's but
    # timeout (Peers(timeout), a peer's, beside DataLoader's; Shard's tail is pad, not drop_last).
    tuning = {f.name for option in features.values() for f in dataclasses.fields(option)}
    assert tuning & set(params) == {"timeout"}, sorted(tuning & set(params))
    assert not set(RENAMED) & set(params)


def test_dataloaders_parameters_keep_dataloaders_defaults():
    ours = inspect.signature(CoordLoader).parameters
    theirs = inspect.signature(DataLoader).parameters
    for name, p in theirs.items():
        if name in ("self", "dataset"):
            continue
        assert name in ours, f"DataLoader's {name} is missing"
        want = False if name == "shuffle" else p.default  # DataLoader's None means no shuffling
        assert ours[name].default == want, (name, ours[name].default, want)
        assert ours[name].kind == p.kind, (name, ours[name].kind, p.kind)  # positional where DataLoader's are


def test_option_objects_are_frozen_validated_and_have_shorthands():
    with pytest.raises(dataclasses.FrozenInstanceError):
        coordl.Cache().size = 0
    assert coordl.Cache.of("40GB") == coordl.Cache(size=40 * 10**9)
    assert coordl.Cache.of(0.5).size == 0.5 and coordl.Cache.of(False).size == 0
    assert coordl.Peers.of(False) == coordl.Peers(enabled=False)
    assert coordl.HPGroup.of("sweep") == coordl.HPGroup("sweep")
    assert coordl.Prep.of(4) == coordl.Prep(threads=4)
    assert coordl.Cache(size=" Auto ").size == "auto"  # "auto" is recognised once, here
    with pytest.raises(TypeError, match=r"Cache\(decoded\)=0.5: give bytes"):
        coordl.Cache(decoded=0.5)  # a float is a fraction of the dataset only for Cache(size)
    with pytest.raises(ValueError, match="rank 2 is not in a world of size 2"):
        coordl.Shard(rank=2, world_size=2)
    with pytest.raises(ValueError, match=r"Peers\(timeout\)"):
        coordl.Peers(timeout=0)
    with pytest.raises(ValueError, match=r"Fetch\(threads\)"):
        coordl.Fetch(threads=0)


# -- errors that name what to do ----------------------------------------------------------------
def test_the_pre_processing_is_named_not_defaulted(tiny_dataset):
    with pytest.raises(ValueError) as e:
        CoordLoader(tiny_dataset, batch_size=4)
    assert "pipeline='imagenet-train'" in str(e.value) and "pipeline='imagenet-val'" in str(e.value)


@pytest.mark.parametrize("name", sorted(RENAMED))
def test_an_earlier_spelling_is_refused_with_the_new_one(tiny_dataset, name):
    with pytest.raises(TypeError) as e:
        CoordLoader(tiny_dataset, pipeline=VAL, **{name: 1})
    assert f"{name}= any more: pass {RENAMED[name]}" in str(e.value)
    assert RENAMED[name].split("=")[0] in {"cache", "prep", "fetch", "shard", "peers", "hp_group", "data"}


def test_the_shards_tail_is_named_by_what_it_does():
    """``Shard(pad)`` says what it does beside ``CoordLoader(drop_last)``; coordl 0.1's
    ``Shard(drop_last)`` is refused with the new spelling."""
    assert coordl.Shard().pad is True and coordl.Shard(0, world_size=2, pad=False).pad is False
    renamed = r"coordl.Shard does not take drop_last= any more: pass pad= \(drop_last=True is pad=False\)"
    with pytest.raises(TypeError, match=renamed):
        coordl.Shard(rank=0, world_size=2, drop_last=True)
    with pytest.raises(TypeError, match=r"Shard\(pad\) must be a bool"):
        coordl.Shard(pad=1)


def test_the_loaders_tiers_are_named_apart_from_the_package_and_the_option(tiny_dataset):
    """``loader.node_cache`` (a NodeCache, attached) is not ``cache=`` (a Cache, asked for), and
    ``loader.tier_plan`` does not shadow the package ``coordl.tiers``."""
    from coordl.fetch.cache import NodeCache
    from coordl.tiers.plan import TierPlan

    with _loader(tiny_dataset, batch_size=16, cache=10**6) as loader:
        assert isinstance(loader.node_cache, NodeCache) and isinstance(loader.tier_plan, TierPlan)
        assert isinstance(loader.options.cache, coordl.Cache)
        assert loader.decoded_tier is None and loader.disk_tier is None
        assert not hasattr(loader, "cache") and not hasattr(loader, "tiers")


def test_num_workers_means_worker_processes_only(tiny_dataset):
    with pytest.raises(ValueError, match=r"DALI decodes .* on threads .*prep=coordl.Prep\(threads=N\)"):
        CoordLoader(tiny_dataset, pipeline=VAL, num_workers=4)
    with pytest.raises(ValueError, match="prep= sets DALI's threads"):
        CoordLoader(coordl.datasets.ImageFolder(tiny_dataset), prep=2)


# -- DataLoader's meanings ------------------------------------------------------------------------
def test_shuffle_is_off_by_default_as_with_dataloader(tiny_dataset):
    with _loader(tiny_dataset, batch_size=16) as loader:
        assert [i for _, _, ids in loader for i in ids.tolist()] == list(range(len(loader.index)))
    with _loader(tiny_dataset, batch_size=16, shuffle=True) as loader:
        assert [i for _, _, ids in loader for i in ids.tolist()] == sampler.epoch_order(120, 0, 0).tolist()


@pytest.mark.parametrize("shard_drop_last", [False, True])
@pytest.mark.parametrize("drop_last", [False, True])
def test_drop_last_is_dataloaders_and_the_tail_is_distributed_samplers(tiny_dataset, drop_last, shard_drop_last):
    """Every rank's batches are those of DataLoader(batch_size, drop_last) over
    DistributedSampler(drop_last=not Shard(pad)), unshuffled: 120 samples over 7 ranks in batches of 5."""
    world, bs = 7, 5
    for rank in range(world):
        shard = coordl.Shard(rank=rank, world_size=world, pad=not shard_drop_last)
        with _loader(tiny_dataset, batch_size=bs, drop_last=drop_last, shard=shard) as loader:
            ours = [ids.tolist() for _, _, ids in loader]
            assert len(loader) == len(ours) and len(loader.sampler) == sum(map(len, ours)) or drop_last
        ds = range(120)
        ref = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=False, drop_last=shard_drop_last)
        theirs = [b.tolist() for b in DataLoader(ds, batch_size=bs, sampler=ref, drop_last=drop_last)]
        assert ours == theirs, (rank, ours, theirs)


def test_the_options_are_what_the_loader_holds(tiny_dataset):
    with _loader(tiny_dataset, cache="100KB", peers=False, prep=2, fetch=coordl.Fetch(threads=3)) as loader:
        o = loader.options
        assert o.cache == coordl.Cache(size=10**5) and o.peers.enabled is False
        assert o.prep.threads == 2 == loader.num_threads and o.fetch.threads == 3
        assert loader.resources.io_threads == 3 and loader.node_cache.budget == 10**5


# -- the epoch order is coordl's own, and versioned -----------------------------------------------
def test_the_epoch_order_is_pinned():
    """Version 1 of the order, pinned: a change of the algorithm (or of numpy) that changes it must
    come with a new sampler.ORDER_VERSION, which states saved before refuse."""
    assert sampler.ORDER_VERSION == 1
    assert sampler.epoch_order(10, 0, 0).tolist() == [5, 4, 2, 9, 7, 6, 1, 3, 0, 8]
    assert sampler.epoch_order(10, 0, 1).tolist() == [1, 3, 2, 0, 8, 7, 6, 5, 9, 4]
    assert sampler.epoch_order(10, 1, 0).tolist() == [6, 2, 4, 9, 3, 1, 5, 7, 0, 8]
    big = sampler.epoch_order(1_000_003, 2**63 + 5, 12)
    assert big[:5].tolist() == PINNED_HEAD and int(big[-1]) == PINNED_LAST
    assert np.array_equal(np.sort(big), np.arange(1_000_003))
    # The augmentation's draws (a function of seed, epoch and sample), pinned as well.
    want = [[0.9322649836540222, 0.6246998906135559], [0.739122748374939, 0.7359805703163147]]
    assert coordl.draws.uniforms(0, 0, [0, 1], 2).tolist() == want


PINNED_HEAD = [398980, 549947, 707343, 606752, 293811]
PINNED_LAST = 115920


#: ``draws.uniforms(seed, epoch, ids, count)`` as multiples of 2**-24 (each draw is one, exactly).
PINNED_UNIFORMS = [
    ((0, 0, [0, 1, 2], 3), [[15640811, 10480725, 10779627], [12400422, 12347705, 3815142], [25916, 169765, 13557098]]),
    ((7, 3, [5, 119, 0], 2), [[3515452, 4716831], [16413560, 10620531], [5468391, 9603692]]),
    (
        (2**63 + 5, 12, [1_000_002, 17], 4),
        [[2277782, 12254748, 10648313, 4566373], [3722842, 7549966, 6259569, 1069505]],
    ),
    ((-1, 1, [3], 3), [[4037239, 841542, 15703700]]),
]
PINNED_SEEDS = [
    ((0, 0, [0, 1, 2]), [387799389155498907, 6183000471980860322, 4780009980873452742]),
    ((7, 3, [5, 119, 0]), [433663975062295115, 6766241625871569150, 3106819152094812665]),
    ((2**63 + 5, 12, [1_000_002, 17]), [4875228163150923561, 3469933670699401354]),
    ((-1, 1, [3]), [8478865193121018411]),
]


@pytest.mark.parametrize(("key", "want"), PINNED_UNIFORMS)
def test_the_augmentation_draws_are_pinned(key, want):
    """The golden values of ``coordl.draws.uniforms``: every crop window and flip of every sample
    comes from these numbers, so a change of them changes every augmentation of every epoch
    (and makes a resumed run's images differ from the run it resumes). Such a change is a new
    version of the draws and needs a bump like ``sampler.ORDER_VERSION``'s, never a new literal
    pasted here. Exact equality: each draw is a multiple of 2**-24, exact in float32."""
    got = coordl.draws.uniforms(*key)
    assert got.dtype == np.float32 and got.shape == (len(key[2]), key[3])
    assert np.array_equal(got, np.array(want, dtype=np.float64) * 2.0**-24)


@pytest.mark.parametrize(("key", "want"), PINNED_SEEDS)
def test_the_sample_seeds_are_pinned(key, want):
    """The golden values of ``coordl.draws.sample_seeds`` (the seed of a torch-backend transform's
    generator): a change of them changes every such augmentation and needs a version bump like
    ``sampler.ORDER_VERSION``'s, not new literals."""
    got = coordl.draws.sample_seeds(*key)
    assert got.dtype == np.uint64 and np.array_equal(got, np.array(want, dtype=np.uint64))


def test_the_generator_seeds_are_pinned():
    """``coordl.draws.mix``, which seeds the generators coordl seeds: pinned likewise."""
    assert coordl.draws.mix(0) == 16294208416658607535
    assert coordl.draws.mix(1, 2, 3) == 15020427595393229491
    assert coordl.draws.mix(-1, 2**64 - 1) == 7136257342804621622  # a negative int is its two's complement


@pytest.mark.parametrize(
    ("n", "seed", "epoch", "want"),
    [
        (12, 7, 5, [2, 11, 10, 0, 6, 1, 4, 7, 9, 5, 8, 3]),
        (20, 123456789, 2**40, [17, 1, 12, 19, 2, 0, 5, 14, 15, 13, 7, 10, 18, 3, 6, 11, 16, 9, 8, 4]),
    ],
)
def test_the_epoch_order_is_pinned_for_more_seeds_and_epochs(n, seed, epoch, want):
    """More golden orders of version 1 (:data:`coordl.sampler.ORDER_VERSION`), at other lengths,
    seeds and a large epoch: a change needs a new ORDER_VERSION."""
    assert sampler.ORDER_VERSION == 1
    assert np.array_equal(sampler.epoch_order(n, seed, epoch), np.array(want))


def test_the_state_names_the_order_version(tiny_dataset):
    with _loader(tiny_dataset, batch_size=8, shuffle=True) as loader:
        next(iter(loader))
        state = loader.state_dict()
    assert state["order"] == sampler.ORDER_VERSION and state["version"] == 3


# -- warnings point at the user's line ------------------------------------------------------------
def test_a_budget_shrunk_to_fit_warns_at_the_users_line(tiny_dataset, monkeypatch):
    from coordl.fetch import budget

    monkeypatch.setattr(budget, "headroom", lambda total: total)  # nothing is free: any budget is shrunk
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with _loader(tiny_dataset, cache="1GB") as loader:
            assert loader.node_cache is None
    shrunk = [w for w in caught if "does not fit" in str(w.message)]
    assert shrunk and all(w.filename == __file__ for w in shrunk), [(w.filename, w.lineno) for w in caught]


# -- the default threads follow the CPUs the process may use --------------------------------------
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to leave one")
def test_default_threads_follow_the_cpu_affinity(tiny_dataset):
    code = textwrap.dedent(f"""
        import coordl
        with coordl.CoordLoader({str(tiny_dataset)!r}, pipeline="imagenet-val", device_id=None, cache=0) as ld:
            print(ld.num_threads)
    """)
    out = subprocess.run(["taskset", "-c", "0", sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-1] == "1"  # os.cpu_count() says 2 here


# -- one probe pipeline finds the bad samples of a failed batch -----------------------------------
def test_bad_samples_are_found_with_one_probe_pipeline(dataset_copy, monkeypatch):
    from coordl.prep import dali

    bad = sorted(dataset_copy.rglob("*.jpg"))[5]
    bad.write_bytes(bad.read_bytes()[:200])
    built = []
    real = dali._probe_pipeline
    monkeypatch.setattr(dali, "_probe_pipeline", lambda *a: built.append(1) or real(*a))
    with _loader(dataset_copy, batch_size=16, on_error="skip") as loader:
        seen = [i for _, _, ids in loader for i in ids.tolist()]
    assert len(seen) == 119 and loader.stats()["skipped"] == 1
    assert len(built) <= 2  # one probe, and one more after the sample that failed; not one per sample


def test_nothing_is_called_minio_in_the_code():
    from coordl.fetch import cache

    assert not hasattr(cache, "MinIOCache") and hasattr(cache, "NodeCache")


def test_option_fields_after_the_first_are_given_by_name():
    # HPGroup("x", 64) was a 64-byte staging bound, refused only at the first pass.
    for cls, first in (
        (coordl.HPGroup, "sweep"),
        (coordl.Cache, "40GB"),
        (coordl.Peers, "auto"),
        (coordl.Shard, 0),
        (coordl.RayPrep, "auto"),
        (coordl.Fetch, 4),
        (coordl.Disk, "/tmp"),
    ):
        cls(first)  # the first field by position, as its shorthand
        with pytest.raises(TypeError, match="positional argument"):
            cls(first, 64)
    assert coordl.HPGroup("sweep", staging="4GB").staging == 4 * 10**9


def _docstring_args(obj) -> dict[str, str]:
    """``name -> its text`` of the ``Args:`` section of ``obj``'s docstring."""
    doc = inspect.getdoc(obj)
    args = doc.split("Args:\n", 1)[1]
    out: dict[str, str] = {}
    name = None
    for line in args.splitlines():
        if line and not line.startswith(" "):
            break  # the section ends
        if line.startswith("    ") and not line.startswith("     ") and ":" in line:
            name, _, text = line.strip().partition(":")
            out[name] = text
        elif name is not None:
            out[name] += " " + line.strip()
    return out


def test_the_loaders_docstring_names_every_recipe_data_kind_and_prep_site():
    """CoordLoader's docstring says what the code takes: every recipe ``pipeline=`` names, every
    built-in recipe class of the public API and the protocol, every kind of ``data=`` the sources
    tell apart, and both places ``prep=`` may run (its annotation too)."""
    from coordl.prep.recipes import NAMED, Recipe
    from coordl.sources import DATA_KINDS

    args = _docstring_args(CoordLoader)
    pipeline = args["pipeline"]
    missing = [f'"{name}"' for name in NAMED if f'``"{name}"``' not in pipeline]
    public = {n: getattr(coordl, n) for n in coordl.__all__}
    classes = [n for n, v in public.items() if isinstance(v, type) and issubclass(v, Recipe)]
    assert "Recipe" in classes and len(classes) >= 8, classes
    missing += [f"coordl.{n}" for n in classes if f":class:`coordl.{n}`" not in pipeline]
    missing += [f"data: {kind}" for kind in DATA_KINDS if kind not in args["data"].replace("``", "")]
    missing += [f"prep: {kind}" for kind in ("coordl.Prep", "coordl.RayPrep") if kind not in args["prep"]]
    annotation = str(inspect.signature(CoordLoader.__init__).parameters["prep"].annotation)
    missing += [f"prep's annotation: {kind}" for kind in ("Prep", "RayPrep") if kind not in annotation.split(" | ")]
    assert not missing, f"CoordLoader's docstring (or annotation) leaves out: {missing}"
    assert "(images, labels)" not in inspect.getdoc(CoordLoader).splitlines()[0]
