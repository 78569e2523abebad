"""CoordLoader's guarantees on the DALI CPU path: exactly-once, reshuffling, sharding,
resume, statistics and the corrupt-sample policy."""

import gc
import itertools
import json
import logging
import os
import re
import threading
import weakref

import numpy as np
import pytest
import torch

import coordl
from coordl import CoordLoader, SampleError, sampler

SMALL = coordl.ImageNetTrain(size=32)


def make(data, **kw):
    kw.setdefault("batch_size", 8)
    kw.setdefault("pipeline", SMALL)
    kw.setdefault("device_id", None)
    kw.setdefault("prep", 2)
    kw.setdefault("shuffle", True)
    kw.setdefault("return_index", True)
    return CoordLoader(data, **kw)


def epoch_ids(loader):
    out = []
    for batch in loader:
        out.append(batch[2].tolist())
    return out


def flat(batches):
    return [i for b in batches for i in b]


def test_batches_are_torch_tensors_with_the_right_labels(tiny_dataset):
    with make(tiny_dataset, batch_size=16) as loader:
        assert len(loader) == 8  # 120 / 16, last one partial
        sizes = []
        for images, labels, ids in loader:
            assert images.dtype == torch.float32 and images.shape[1:] == (3, 32, 32)
            assert labels.dtype == torch.int64 and ids.dtype == torch.int64
            assert labels.tolist() == loader.index.labels[ids.numpy()].tolist()
            sizes.append(len(labels))
        assert sizes == [16] * 7 + [8]
        # normalised with ImageNet mean/std: roughly zero-centred, not 0..255
        assert -3 < float(images.mean()) < 3 and float(images.std()) < 5


def test_every_epoch_visits_every_sample_once_in_a_fresh_order(tiny_dataset):
    with make(tiny_dataset, cache=0.5) as loader:
        orders = []
        for _ in range(3):
            ids = flat(epoch_ids(loader))
            assert sorted(ids) == list(range(120))
            orders.append(ids)
        assert loader.epoch == 3  # advances by itself after a complete pass
        assert len({tuple(o) for o in orders}) == 3


def test_same_seed_same_order_and_set_epoch(tiny_dataset):
    with make(tiny_dataset, cache=0) as a:
        a.set_epoch(5)
        first = epoch_ids(a)
    with make(tiny_dataset, cache=0) as b:
        b.set_epoch(5)
        assert epoch_ids(b) == first
        b.set_epoch(6)
        assert epoch_ids(b) != first
    with make(tiny_dataset, seed=1, cache=0) as c:
        c.set_epoch(5)
        assert epoch_ids(c) != first


def test_no_shuffle_is_index_order(tiny_dataset):
    with make(tiny_dataset, shuffle=False, cache=0) as loader:
        assert flat(epoch_ids(loader)) == list(range(120))


@pytest.mark.parametrize("drop_last", [False, True])
def test_three_ranks_cover_the_dataset(tiny_dataset, drop_last):
    n, world = 121, 3  # 121 samples: not a multiple of 3, exercises padding / dropping
    index = coordl.Index.scan(tiny_dataset)
    extra = coordl.Index.from_list(list(zip(index.paths, index.labels.tolist(), strict=True)) + [(index.paths[0], 0)])
    assert len(extra) == n
    loaders = [
        make(extra, drop_last=drop_last, batch_size=7, shard=coordl.Shard(rank=r, world_size=world, pad=not drop_last))
        for r in range(world)
    ]
    try:
        for epoch in range(2):
            shards = []
            for ld in loaders:
                ld.set_epoch(epoch)
                shards.append(flat(epoch_ids(ld)))
            lengths = {len(s) for s in shards}
            assert len(lengths) == 1
            counts = np.bincount(flat(shards), minlength=n)
            if drop_last:
                assert counts.max() == 1 and len(shards[0]) == (n // world) // 7 * 7
            else:
                assert counts.min() == 1 and counts.sum() - n == world * 41 - n  # padding only
            assert not set(shards[0]) & set(shards[1]) or not drop_last
    finally:
        for ld in loaders:
            ld.close()


def test_rank_and_world_come_from_the_environment(tiny_dataset, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with make(tiny_dataset, cache=0) as loader:
        assert (loader.world.rank, loader.world.world_size) == (1, 2)
        assert len(flat(epoch_ids(loader))) == 60


def check_resume(make_loader, epoch: int, stop_after: int) -> None:
    """The one resume check: stop after ``stop_after`` batches of ``epoch``, save the state
    through JSON, resume in a new loader, and compare with an uninterrupted run."""
    with make_loader() as ref:
        ref.set_epoch(epoch)
        expected = epoch_ids(ref)
        following = epoch_ids(ref)
    with make_loader() as first:
        first.set_epoch(epoch)
        it = iter(first)
        got = [next(it)[2].tolist() for _ in range(stop_after)]
        state = json.loads(json.dumps(first.state_dict()))  # survives a checkpoint file
    assert (state["epoch"], state["batches"]) == (epoch, stop_after)
    with make_loader() as second:
        second.load_state_dict(state)
        assert got + epoch_ids(second) == expected
        assert second.epoch == epoch + 1 and second.state_dict()["batches"] == 0
        assert epoch_ids(second) == following  # the epoch after a resumed one is the usual one


RESUME_CONFIGS = {
    "shuffle": dict(cache=0.3),
    "no-shuffle": dict(shuffle=False, cache=0),
    "drop-last": dict(drop_last=True, batch_size=7, cache=0.3),
    "rank-1-of-3": dict(batch_size=5, cache=0.3, shard=coordl.Shard(rank=1, world_size=3)),
    "skip-policy": dict(on_error="skip", seed=11, cache=0.3),
}


@pytest.mark.parametrize("config", sorted(RESUME_CONFIGS))
@pytest.mark.parametrize("stop_after", [0, 3, 8])
def test_resume_mid_epoch_gives_exactly_the_remaining_batches(tiny_dataset, config, stop_after):
    check_resume(lambda: make(tiny_dataset, **RESUME_CONFIGS[config]), epoch=2, stop_after=stop_after)


def test_resume_after_the_last_batch_does_not_replay_the_epoch(tiny_dataset):
    with make(tiny_dataset, cache=0) as a:
        a.set_epoch(4)
        it = iter(a)
        for _ in range(len(a)):
            next(it)
        state = a.state_dict()  # saved inside the loop, after the last batch
    assert (state["epoch"], state["batches"]) == (4, len(a))
    with make(tiny_dataset, cache=0) as b:
        b.load_state_dict(state)
        b.set_epoch(4)  # the training script's loop does this again after a restart
        assert epoch_ids(b) == []
        assert b.epoch == 5


def test_resume_refuses_a_different_configuration(tiny_dataset):
    with make(tiny_dataset, cache=0) as a:
        state = a.state_dict()
    with make(tiny_dataset, batch_size=4, cache=0) as b:
        with pytest.raises(ValueError, match="batch_size=8 but this loader has batch_size=4"):
            b.load_state_dict(state)
    with make(tiny_dataset, seed=3, cache=0) as c:
        with pytest.raises(ValueError, match="seed"):
            c.load_state_dict(state)
        with pytest.raises(ValueError, match="missing"):
            c.load_state_dict({"epoch": 0})
        bad = dict(state, seed=3, batches=999)
        with pytest.raises(ValueError, match="invalid position"):
            c.load_state_dict(bad)


@pytest.mark.parametrize(
    "change, field",
    [
        ({"drop_last": True}, "drop_last"),
        ({"shuffle": False}, "shuffle"),
        ({"shard": coordl.Shard(rank=0, world_size=1, pad=False)}, "shard_drop_last"),
        ({"pipeline": coordl.ImageNetVal(size=32, resize=36)}, "config"),  # another recipe: the fingerprint
    ],
)
def test_a_state_of_another_drop_last_shuffle_or_pipeline_is_refused(tiny_dataset, change, field):
    """docs/guarantees.md: a state resumes only a loader of the same configuration; the message names
    what differs."""
    with make(tiny_dataset, cache=0, shard=coordl.Shard(rank=0, world_size=1)) as a:
        state = a.state_dict()
    kw = {"cache": 0, "shard": coordl.Shard(rank=0, world_size=1), **change}
    with make(tiny_dataset, **kw) as b:
        with pytest.raises(ValueError, match=rf"cannot resume: state has {field}=.* but this loader has {field}="):
            b.load_state_dict(state)
        assert b.state_dict()["epoch"] == 0  # nothing was changed by the refused state


def test_every_coordl_error_is_a_coordl_error_and_a_runtime_error():
    """docs: ``except coordl.CoordlError`` catches all of coordl's own failures, which are RuntimeErrors
    (GroupConfigError is a ValueError too: a configuration that does not match)."""
    import inspect

    import coordl.errors

    classes = [c for _, c in inspect.getmembers(coordl.errors, inspect.isclass) if issubclass(c, BaseException)]
    assert {c.__name__ for c in classes} >= {"CoordlError", "SampleError", "StoreError", "DatasetChangedError"}
    for c in classes:
        assert issubclass(c, coordl.CoordlError) and issubclass(c, RuntimeError), c
        assert getattr(coordl, c.__name__) is c  # exported where users catch it
    assert issubclass(coordl.GroupConfigError, ValueError)


def test_augmentation_is_fresh_every_epoch_and_val_is_deterministic(tiny_dataset):
    def by_id(loader):
        out = {}
        for images, _, ids in loader:
            for img, i in zip(images, ids.tolist(), strict=True):
                out[i] = img
        return out

    with make(tiny_dataset, cache=0) as train:
        e0, e1 = by_id(train), by_id(train)
        same = sum(torch.equal(e0[i], e1[i]) for i in e0)
        assert same < 5  # random crops and flips differ between epochs
    val = coordl.ImageNetVal(size=32, resize=36)
    with make(tiny_dataset, pipeline=val, shuffle=False, cache=0) as ev:
        v0, v1 = by_id(ev), by_id(ev)
        assert all(torch.equal(v0[i], v1[i]) for i in v0)


def test_custom_dali_recipe(tiny_dataset):
    from nvidia.dali import fn, types

    def gray_thumbnails(encoded, ctx):
        images = fn.decoders.image(encoded, device=ctx.decoder_device, output_type=types.GRAY)
        return fn.resize(images, device=ctx.device, size=(16, 16))

    with make(tiny_dataset, pipeline=gray_thumbnails, batch_size=10, cache=0) as loader:
        images, labels, ids = next(iter(loader))
        assert images.dtype == torch.uint8 and tuple(images.shape) == (10, 16, 16, 1)


def test_stats_count_cache_and_storage(tiny_dataset):
    total = coordl.Index.scan(tiny_dataset).total_bytes
    with make(tiny_dataset, cache=0.5) as loader:
        rows = []
        for _ in range(3):
            epoch_ids(loader)
            rows.append(loader.stats())
    for key in (
        "epoch",
        "samples",
        "cache_hits",
        "storage_reads",
        "storage_bytes",
        "peer_reads",
        "peer_bytes",
        "cache_bytes",
        "stall_s",
    ):
        assert key in rows[0]
    assert rows[0]["storage_reads"] == 120 and rows[0]["storage_bytes"] == total
    assert 0 < rows[0]["cache_bytes"] <= rows[0]["cache_budget"] == total // 2
    for s in rows[1:]:
        assert s["samples"] == 120
        assert s["cache_hits"] == s["cache_items"]
        assert s["storage_reads"] == 120 - s["cache_items"]
        assert s["storage_bytes"] == total - s["cache_bytes"]
        assert s["stall_s"] >= 0 and s["admitted"] == 0


def test_cache_off_reads_everything_every_epoch(tiny_dataset):
    with make(tiny_dataset, cache=0) as loader:
        assert loader.node_cache is None
        epoch_ids(loader)
        epoch_ids(loader)
        assert loader.stats()["storage_reads"] == 120 and loader.stats()["cache_hits"] == 0
    assert not os.listdir(os.environ["COORDL_SHM_DIR"])


def corrupt(root, how):
    victims = sorted((root / "class_01").iterdir())[:2]
    for v in victims:
        data = v.read_bytes()
        v.write_bytes(data[: len(data) // 3] if how == "truncate" else b"this is not an image" * 20)
    return [str(v) for v in victims]


@pytest.mark.parametrize("how", ["truncate", "garbage"])
def test_corrupt_sample_raises_with_its_path(dataset_copy, how):
    bad = corrupt(dataset_copy, how)
    with make(dataset_copy, cache=0) as loader:
        with pytest.raises(SampleError) as info:
            epoch_ids(loader)
        assert info.value.path in bad and info.value.path in str(info.value)


@pytest.mark.parametrize("how", ["truncate", "garbage"])
def test_corrupt_samples_are_skipped_and_counted(dataset_copy, how):
    bad = corrupt(dataset_copy, how)
    with make(dataset_copy, on_error="skip", cache=0.5) as loader:
        bad_ids = {loader.index.paths.index(p) for p in bad}
        for _ in range(2):
            ids = flat(epoch_ids(loader))
            assert sorted(ids) == sorted(set(range(120)) - bad_ids)
            s = loader.stats()
            assert s["skipped"] == 2 and sorted(s["skipped_paths"]) == sorted(bad)
            assert s["samples"] == 118


def test_missing_or_changed_file(dataset_copy):
    index = coordl.Index.scan(dataset_copy)  # indexed before the files change
    victim, grown = index.paths[5], index.paths[7]
    os.unlink(victim)
    with make(index, cache=0) as loader:
        with pytest.raises(SampleError, match=victim):
            epoch_ids(loader)
    with make(index, on_error="skip", cache=0) as loader:
        ids = flat(epoch_ids(loader))
        assert sorted(ids) == [i for i in range(120) if i != 5]
        assert loader.stats()["skipped_paths"] == [victim]
    with open(grown, "ab") as f:
        f.write(b"\0" * 10)
    with make(index, on_error="skip", cache=0) as loader:
        with pytest.raises(coordl.DatasetChangedError, match=f"{grown} is .* changed after it was indexed"):
            epoch_ids(loader)  # a changed dataset is never silently skipped
    with make(dataset_copy, cache=0) as fresh:
        assert len(fresh.index) == 119  # a new scan sees the tree as it is now
        assert sorted(flat(epoch_ids(fresh))) == list(range(119))


def test_a_changed_size_alone_deletes_the_saved_file_list(dataset_copy):
    """A file rewritten in place (same name, other size) changes no folder's modification time, so
    the saved file list would still be reused: the DatasetChangedError must delete it, and the
    next start scans again and sees the new size (docs/guarantees.md, "A changed file")."""
    with make(dataset_copy, cache=0) as loader:
        saved, victim = loader.index.saved_path, loader.index.paths[7]
        old_size = int(loader.index.sizes[7])
        assert saved and os.path.exists(saved)
        folders = [os.path.dirname(victim), str(dataset_copy)]
        times = [os.stat(d).st_mtime_ns for d in folders]
        with open(victim, "r+b") as f:  # the same file, rewritten in place and longer
            f.seek(0, os.SEEK_END)
            f.write(b"\0" * 10)
        for d, t in zip(folders, times):
            os.utime(d, ns=(t, t))
        assert [os.stat(d).st_mtime_ns for d in folders] == times
        with pytest.raises(coordl.DatasetChangedError, match=f"{victim} is .* changed after it was indexed"):
            epoch_ids(loader)
    assert not os.path.exists(saved)
    again = coordl.Index.scan(dataset_copy)
    assert int(again.sizes[again.paths.index(victim)]) == old_size + 10


def test_breaking_out_and_closing_leaves_nothing_running(tiny_dataset):
    loader = make(tiny_dataset, cache=0.5)
    for k, _ in enumerate(loader):
        if k == 2:
            break
    # a new pass starts the epoch again, like DataLoader
    assert sorted(flat(epoch_ids(loader))) == list(range(120))
    it = iter(loader)
    next(it)
    loader.close()
    loader.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        iter(loader)


def test_argument_errors(tiny_dataset):
    with pytest.raises(ValueError, match="batch_size"):
        CoordLoader(tiny_dataset, batch_size=0, shuffle=True, pipeline="imagenet-train")
    with pytest.raises(ValueError, match="on_error"):
        CoordLoader(tiny_dataset, batch_size=2, on_error="ignore", shuffle=True, pipeline="imagenet-train")
    with pytest.raises(ValueError, match="unknown pipeline"):
        CoordLoader(tiny_dataset, batch_size=2, pipeline="imagenet-tran", cache=0, shuffle=True)
    with pytest.raises(TypeError, match="data must be"):
        CoordLoader(42, batch_size=2, shuffle=True, pipeline="imagenet-train")
    with pytest.raises(ValueError, match="cannot parse byte size"):
        CoordLoader(tiny_dataset, batch_size=2, cache="lots", shuffle=True, pipeline="imagenet-train")
    with make(tiny_dataset, cache=0) as loader:
        with pytest.raises(ValueError, match="epoch"):
            loader.set_epoch(-1)


def test_set_epoch_during_or_after_a_pass_applies_to_the_next_pass(tiny_dataset):
    with make(tiny_dataset, cache=0) as ref:
        ref.set_epoch(1)
        epoch1 = epoch_ids(ref)
        ref.set_epoch(7)
        epoch7 = epoch_ids(ref)
    with make(tiny_dataset, cache=0) as loader:
        loader.set_epoch(1)
        got = []
        for k, (_, _, ids) in enumerate(loader):
            got.append(ids.tolist())
            if k == 2:
                loader.set_epoch(7)  # like DistributedSampler: the running pass keeps its epoch
        assert got == epoch1
        assert epoch_ids(loader) == epoch7
        for k, _ in enumerate(loader):  # a step-limited epoch: break, then move on
            if k == 1:
                break
        loader.set_epoch(3)
        assert loader.state_dict()["epoch"] == 3 and loader.state_dict()["batches"] == 0
        assert sorted(flat(epoch_ids(loader))) == list(range(120)) and loader.epoch == 4


def test_skipped_whole_batch_keeps_the_resume_position(dataset_copy):
    index = coordl.Index.scan(dataset_copy)
    with make(index, shuffle=False, batch_size=10, on_error="skip", cache=0) as loader:
        for p in index.paths[10:20]:  # every sample of batch 1: same size, not a JPEG
            size = os.path.getsize(p)
            with open(p, "wb") as f:
                f.write((b"garbage" * size)[:size])
        it = iter(loader)
        assert next(it)[2].tolist() == list(range(10))
        assert next(it)[2].tolist() == list(range(20, 30))  # batch 1 was skipped whole
        assert loader.state_dict()["batches"] == 3  # position of batch 2, not a count of deliveries
        state = loader.state_dict()
    with make(index, shuffle=False, batch_size=10, on_error="skip", cache=0) as again:
        again.load_state_dict(state)
        assert flat(epoch_ids(again)) == list(range(30, 120))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_gpu_path_outputs_on_the_device(tiny_dataset):
    with make(tiny_dataset, device_id=0, cache=0.5) as loader:
        for _ in range(2):
            ids = []
            for images, labels, idx in loader:
                assert images.is_cuda and images.device.index == 0
                assert images.shape[1:] == (3, 32, 32) and images.dtype == torch.float32
                assert labels.tolist() == loader.index.labels[idx.numpy()].tolist()
                ids += idx.tolist()
            assert sorted(ids) == list(range(120))
        assert loader.stats()["cache_hits"] == loader.stats()["cache_items"] > 0


class RecipeBroke(ValueError):
    """A custom recipe's own error (a subclass, so that a wrapped or re-typed one is noticed)."""


def test_a_custom_recipes_error_is_raised_unchanged(tiny_dataset):
    def broken(encoded, ctx):
        raise RecipeBroke("the recipe cannot be built: 42")

    with pytest.raises(Exception) as raised:  # noqa: PT011 - its exact type is checked below
        with make(tiny_dataset, pipeline=broken, cache=0) as loader:
            next(iter(loader))
    assert raised.type is RecipeBroke and str(raised.value) == "the recipe cannot be built: 42"


def test_a_dali_operators_failure_reaches_the_loop_with_the_driver_threads_traceback(tiny_dataset):
    import traceback

    from nvidia.dali import fn

    def fails_at_run_time(encoded, ctx):  # builds; no image has 7 elements, so every run fails
        images = fn.decoders.image(encoded, device=ctx.decoder_device)
        return fn.reshape(images, shape=[7])

    with make(tiny_dataset, pipeline=fails_at_run_time, cache=0) as loader:
        with pytest.raises(RuntimeError, match="reshape") as raised:
            next(iter(loader))
    frames = [frame.name for frame in traceback.extract_tb(raised.value.__traceback__)]
    assert "_drive" in frames, f"the driver thread's frames are missing from the traceback: {frames}"
    assert frames[-1] != "check", "the traceback ends where the loop re-raised it, not where it failed"


def test_augmentation_is_fresh_every_epoch_though_the_bytes_come_from_the_cache(tiny_dataset):
    with make(tiny_dataset, cache="auto") as train:
        e0 = {i: img for images, _, ids in train for img, i in zip(images, ids.tolist(), strict=True)}
        e1 = {i: img for images, _, ids in train for img, i in zip(images, ids.tolist(), strict=True)}
        stats = train.stats()
    assert sorted(e0) == sorted(e1) == list(range(120))
    assert stats["epoch"] == 1 and stats["cache_hits"] == 120 and stats["storage_reads"] == 0, stats
    same = sum(torch.equal(e0[i], e1[i]) for i in e0)
    assert same < 5, f"{same} of 120 samples were augmented alike in two epochs from the cache"


def test_cut_shards_are_distributed_samplers_and_leave_out_other_samples_every_epoch(tiny_dataset):
    """docs/guarantees.md, Exactly once: with ``Shard(pad=False)`` and ``shuffle=True`` every
    rank delivers ``DistributedSampler(drop_last=True)``'s shard of the epoch's order, ``order[r::4]``
    of the order cut to a multiple of 4, and the ``123 % 4 = 3`` samples left out are other ones
    every epoch (for this seed: 3 epochs, 3 different sets; test_sampler.py checks the chance of a
    repeat over hundreds of epochs)."""
    n, world, epochs = 123, 4, 3
    index = coordl.Index.scan(tiny_dataset)
    pairs = list(zip(index.paths, index.labels.tolist(), strict=True))
    extra = coordl.Index.from_list(pairs + pairs[:3])
    assert len(extra) == n
    got = {}  # (epoch, rank) -> the ids rank delivered in epoch
    for rank in range(world):
        shard = coordl.Shard(rank=rank, world_size=world, pad=False)
        with make(extra, batch_size=8, cache=0, shard=shard) as loader:
            assert len(loader) == 4  # 30 samples a rank: 3 batches of 8 and one of 6
            for epoch in range(epochs):
                loader.set_epoch(epoch)
                got[epoch, rank] = flat(epoch_ids(loader))
            seed = loader.seed
    left_out = []
    for epoch in range(epochs):
        order = sampler.epoch_order(n, seed, epoch)
        dealt = set()
        for rank in range(world):
            ref = list(
                torch.utils.data.DistributedSampler(
                    range(n), num_replicas=world, rank=rank, shuffle=False, drop_last=True
                )
            )
            assert got[epoch, rank] == order[ref].tolist() == order[: 30 * world][rank::world].tolist()
            dealt.update(ref)
        seen = flat(got[epoch, r] for r in range(world))
        assert len(seen) == len(set(seen)) == 30 * world  # none twice
        left_out.append(set(range(n)) - set(seen))
        assert left_out[-1] == set(order[sorted(set(range(n)) - dealt)].tolist())  # the reference's cut
        assert len(left_out[-1]) == n - len(dealt) == 3
    assert len({frozenset(s) for s in left_out}) == epochs, f"epochs left out the same samples: {left_out}"


@pytest.mark.parametrize("how", ["truncate", "garbage"])
def test_an_undecodable_sample_raises_with_its_path_and_its_position_in_the_index(dataset_copy, how):
    """docs/guarantees.md, Corrupt files: on the DALI path an undecodable file (truncated, or not an
    image) raises ``SampleError: cannot decode sample 5 (/path): ...`` with ``.path`` and ``.index``,
    its position in ``loader.index``."""
    bad = corrupt(dataset_copy, how)
    with make(dataset_copy, cache=0) as loader:
        with pytest.raises(SampleError) as info:
            epoch_ids(loader)
        err = info.value
        assert err.path in bad, err.path
        assert isinstance(err.index, int) and loader.index.paths[err.index] == err.path, (err.index, err.path)
    message = str(err)
    assert message.startswith(f"cannot decode sample {err.index} ({err.path}): "), message
    assert "Pass on_error='skip'" in message, message


def skip_warnings(caplog) -> list[tuple[int, str]]:
    """(sample, path) of every ``coordl: skipping sample ...`` warning captured, in order."""
    out = []
    for record in caplog.records:
        match = re.match(r"coordl: skipping sample (\d+) \((.*?)\): ", record.getMessage())
        if match and record.name.startswith("coordl") and record.levelno == logging.WARNING:
            out.append((int(match[1]), match[2]))
    return out


def test_skipped_samples_are_logged_counted_and_tried_again_every_epoch(dataset_copy, caplog):
    """docs/guarantees.md, Corrupt files: with ``on_error="skip"`` on the DALI path, an undecodable
    sample is left out, a warning ``coordl: skipping sample ...`` is logged, it is counted in
    ``stats()["skipped"]`` and ``["skipped_paths"]``, and it is tried, and skipped, again every
    epoch: a file mended between epochs (same size, so the index still holds) is delivered again."""
    victims = sorted((dataset_copy / "class_02").iterdir())[:2]
    truncated, garbled = str(victims[0]), str(victims[1])
    original = victims[1].read_bytes()
    data = victims[0].read_bytes()
    victims[0].write_bytes(data[: len(data) // 3])
    victims[1].write_bytes((b"this is not an image" * len(original))[: len(original)])
    caplog.set_level(logging.WARNING, logger="coordl")
    with make(dataset_copy, on_error="skip", cache=0) as loader:
        ids_of = {p: loader.index.paths.index(p) for p in (truncated, garbled)}
        for epoch in range(2):
            caplog.clear()
            ids = flat(epoch_ids(loader))
            assert sorted(ids) == sorted(set(range(120)) - set(ids_of.values())), f"epoch {epoch}"
            assert sorted(skip_warnings(caplog)) == sorted((i, p) for p, i in ids_of.items()), f"epoch {epoch}"
            s = loader.stats()
            assert s["epoch"] == epoch and s["skipped"] == 2, s
            assert sorted(s["skipped_paths"]) == sorted(ids_of), s
            assert s["samples"] == 118, s
        victims[1].write_bytes(original)  # mended: tried again, it is delivered
        caplog.clear()
        ids = flat(epoch_ids(loader))
        assert sorted(ids) == sorted(set(range(120)) - {ids_of[truncated]})
        assert skip_warnings(caplog) == [(ids_of[truncated], truncated)]
        s = loader.stats()
        assert s["skipped"] == 1 and s["skipped_paths"] == [truncated], s


PASS_THREAD = (
    "coordl-prep"  # a DALI pass's driver thread (backends/dali.py); the loader's I/O pool lives with the loader
)


def pass_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name == PASS_THREAD}


def test_a_pass_the_script_holds_keeps_its_loader_alive(tiny_dataset):
    """docs/guarantees.md, When a script ends: "While the script still holds the pass, the pass keeps
    its loader alive, as a DataLoader iterator keeps its DataLoader": ``it = iter(CoordLoader(...))``
    with no other reference to the loader delivers the whole epoch exactly once, after a garbage
    collection; once the pass is dropped too, the loader is collected (and closed: the fixture
    checks that nothing is left)."""
    loader = make(tiny_dataset, cache=0)
    seed, held = loader.seed, weakref.ref(loader)
    it = iter(loader)
    del loader
    gc.collect()
    assert held() is not None, "the loader was collected while its pass is held"
    ids = [i for _, _, batch in it for i in batch.tolist()]
    assert ids == sampler.epoch_order(120, seed, 0).tolist()  # the whole epoch, once, in its order
    del it
    gc.collect()
    assert held() is None, "the loader outlived its pass"


def leave_early(loader, idiom: str) -> tuple[list[list[int]], set[threading.Thread]]:
    """Leaves a pass of ``loader`` after a few batches as a script does; returns the batches
    received and the pass threads seen running while it was held."""
    got, seen = [], set()
    if idiom == "break":
        for k, (_, _, ids) in enumerate(loader):
            got.append(ids.tolist())
            seen |= pass_threads()
            if k == 2:
                break
    elif idiom == "islice":
        for _, _, ids in itertools.islice(loader, 4):
            got.append(ids.tolist())
            seen |= pass_threads()
    elif idiom == "zip":
        for _, (_, _, ids) in zip(range(5), loader):
            got.append(ids.tolist())
            seen |= pass_threads()
    elif idiom == "dropped_generator":
        g = (ids.tolist() for _, _, ids in loader)
        got.append(next(g))
        got.append(next(g))
        seen |= pass_threads()
        del g
    elif idiom == "del_it":
        it = iter(loader)
        got.append(next(it)[2].tolist())
        seen |= pass_threads()
        held = weakref.ref(it)
        del it
        gc.collect()
        assert held() is None, "the pass outlived every reference to it"
    return got, seen


@pytest.mark.parametrize("idiom", ["break", "islice", "zip", "dropped_generator", "del_it"])
def test_a_pass_left_early_is_closed_and_the_next_pass_starts_the_epoch_again(tiny_dataset, idiom):
    """docs/guarantees.md, When a script ends: a pass left early (``break``, ``itertools.islice``,
    ``zip`` with something shorter, a generator over the loader that is dropped, ``del it``) is
    closed once nothing refers to it: after a garbage collection its thread has stopped. The loader
    stays usable: its next ``iter()`` starts the epoch again from its first batch."""
    with make(tiny_dataset, cache=0) as loader:
        loader.set_epoch(3)
        order = sampler.epoch_order(120, loader.seed, 3).tolist()
        got, seen = leave_early(loader, idiom)
        gc.collect()
        assert seen, f"no {PASS_THREAD} thread ran during the pass"
        alive = [t for t in seen if t.is_alive()]
        assert not alive, f"the pass left with {idiom} still runs {alive}"
        assert got and flat(got) == order[: len(flat(got))]
        assert loader.epoch == 3
        again = flat(epoch_ids(loader))
        assert again == order, "the next pass did not deliver epoch 3 from its first batch"
        assert loader.epoch == 4
