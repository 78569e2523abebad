"""The parts of DataLoader's surface that training scripts use, on both backends.

PyTorch's ImageNet reference script (examples/imagenet/main.py) reads ``len(loader.sampler)``
(this rank's samples) and ``len(loader.dataset)`` (all of them) to size its distributed
validation, and calls ``sampler.set_epoch(epoch)`` every epoch. PyTorch Lightning reads
``loader.sampler``, ``loader.batch_sampler`` (whenever ``sampler`` exists), ``loader.dataset``
and ``loader.worker_init_fn``, and calls ``loader.sampler.set_epoch`` (see test_lightning.py).
Sharding is checked with ``rank=1, world_size=2`` given explicitly: no process group needed.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import coordl
from conftest import make_tree
from coordl import CoordLoader

N = 51  # 3 classes x 17: odd, so a rank's shard is padded without drop_last
RANK, WORLD = 1, 2
BATCH = 8


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return make_tree(tmp_path_factory.mktemp("surface") / "train", classes=3, per_class=17, varied=False)


def to_tensor(img):
    return torch.from_numpy(np.asarray(img.resize((16, 16))).copy()).permute(2, 0, 1)


def make(root, backend, **kw):
    kw.setdefault("batch_size", BATCH)
    kw.setdefault("cache", 0)
    kw.setdefault("shuffle", True)
    kw.setdefault("return_index", True)
    if backend == "dali":
        kw.setdefault("pipeline", coordl.ImageNetVal(size=16, resize=18))
        kw.setdefault("device_id", None)
        kw.setdefault("prep", 1)
        return CoordLoader(root, **kw)
    return CoordLoader(coordl.datasets.ImageFolder(root, transform=to_tensor), **kw)


def pass_ids(loader) -> list[int]:
    return [int(i) for batch in loader for i in batch[2]]


@pytest.mark.parametrize("backend", ["dali", "torch"])
@pytest.mark.parametrize("drop_last", [False, True])
def test_lengths_of_sampler_dataset_and_batch_sampler(root, backend, drop_last):
    per_rank = N // WORLD if drop_last else math.ceil(N / WORLD)
    batches = per_rank // BATCH if drop_last else math.ceil(per_rank / BATCH)
    with make(
        root, backend, drop_last=drop_last, shard=coordl.Shard(rank=RANK, world_size=WORLD, pad=not drop_last)
    ) as loader:
        got = {name: length_of(loader, name) for name in ("", "sampler", "dataset", "batch_sampler")}
    want = {"": batches, "sampler": per_rank, "dataset": N, "batch_sampler": batches}
    problems = [
        f"len(loader{'.' + name if name else ''}) is {got[name]}, not {want[name]}"
        for name in want
        if got[name] != want[name]
    ]
    if problems:
        pytest.fail(
            f"{backend} backend, rank {RANK} of {WORLD}, {N} samples, drop_last={drop_last} (sampler: this rank's "
            "samples; dataset: all of them; batch_sampler: as many as the loader's batches):\n  "
            + "\n  ".join(problems),
            pytrace=False,
        )
    # the ImageNet reference script's check for a remainder left out of distributed validation
    assert (got["sampler"] * WORLD < got["dataset"]) == drop_last


def length_of(loader, name: str):
    """``len(loader.<name>)``, or why there is none."""
    try:
        return len(getattr(loader, name) if name else loader)
    except (AttributeError, TypeError) as e:
        return f"<{type(e).__name__}: {e}>"


@pytest.mark.parametrize("backend", ["dali", "torch"])
def test_sampler_set_epoch_chooses_the_next_passs_order_like_set_epoch(root, backend):
    with make(root, backend, shard=coordl.Shard(rank=RANK, world_size=WORLD)) as a:
        a.sampler.set_epoch(3)
        via_sampler = pass_ids(a)
    with make(root, backend, shard=coordl.Shard(rank=RANK, world_size=WORLD)) as b:
        b.set_epoch(3)
        via_loader = pass_ids(b)
    with make(root, backend, shard=coordl.Shard(rank=RANK, world_size=WORLD)) as c:
        epoch0 = pass_ids(c)
    assert via_sampler == via_loader, "loader.sampler.set_epoch(e) must do what loader.set_epoch(e) does"
    assert via_sampler != epoch0, "set_epoch(3) left the order of epoch 0"


@pytest.mark.parametrize("backend", ["dali", "torch"])
def test_the_sampler_iterates_this_ranks_ids_of_the_next_pass(root, backend):
    with make(root, backend, shard=coordl.Shard(rank=RANK, world_size=WORLD)) as loader:
        loader.set_epoch(2)
        planned = [int(i) for i in loader.sampler]
        batches = [[int(i) for i in b] for b in loader.batch_sampler]
        assert planned == pass_ids(loader), "iterating loader.sampler gives the ids the next pass delivers"
        assert [i for b in batches for i in b] == planned and [len(b) for b in batches] == [BATCH] * 3 + [2]


_MISSING = object()


def attribute_problems(loader, expected: dict) -> list[str]:
    """Every attribute of ``expected`` (name -> (check, what it should be)) that is missing or off."""
    problems = []
    for name, (ok, want) in expected.items():
        value = getattr(loader, name, _MISSING)
        if value is _MISSING:
            problems.append(f"loader.{name} is missing (should be {want})")
        elif not ok(value):
            problems.append(f"loader.{name} is {value!r} (should be {want})")
    return problems


@pytest.mark.parametrize("backend", ["dali", "torch"])
def test_dataloader_attributes_exist_with_dataloader_like_values(root, backend):
    with make(root, backend) as loader:
        problems = attribute_problems(
            loader,
            {
                "batch_size": (lambda v: v == BATCH, BATCH),
                "drop_last": (lambda v: v is False, False),
                "num_workers": (lambda v: isinstance(v, int) and v >= 0, "an int >= 0"),
                "pin_memory": (lambda v: v is False, False),
                "collate_fn": (lambda v: v is None or callable(v), "None or a callable"),
                "generator": (lambda v: v is None or isinstance(v, torch.Generator), "None or a torch.Generator"),
                "persistent_workers": (lambda v: v is False, False),
                "prefetch_factor": (lambda v: v is None or (isinstance(v, int) and v > 0), "None or an int > 0"),
                "worker_init_fn": (lambda v: v is None, "None (Lightning sets it with seed_everything(workers=True))"),
                "timeout": (lambda v: v == 0, 0),
                "multiprocessing_context": (lambda v: v is None, None),
                "sampler": (lambda v: callable(getattr(v, "set_epoch", None)), "an object with set_epoch()"),
                "batch_sampler": (lambda v: v is not None, "an object (Lightning reads it whenever sampler exists)"),
                "dataset": (lambda v: v is not None, "an object with len()"),
            },
        )
    if problems:
        pytest.fail(f"{backend} backend:\n  " + "\n  ".join(problems), pytrace=False)


def my_collate(items):
    return torch.utils.data.default_collate(items)


def my_init(worker_id):
    pass


def test_torch_backend_keeps_the_users_dataset_and_dataloader_arguments(root):
    ds = coordl.datasets.ImageFolder(root, transform=to_tensor)
    g = torch.Generator()
    with CoordLoader(
        ds,
        batch_size=4,
        num_workers=2,
        collate_fn=my_collate,
        worker_init_fn=my_init,
        generator=g,
        prefetch_factor=3,
        persistent_workers=True,
        pin_memory=False,
        cache=0,
        shuffle=True,
    ) as loader:
        problems = attribute_problems(
            loader,
            {
                "dataset": (lambda v: v is ds, "the user's dataset object"),
                "num_workers": (lambda v: v == 2, 2),
                "collate_fn": (lambda v: v is my_collate, "the user's collate_fn"),
                "worker_init_fn": (lambda v: v is my_init, "the user's worker_init_fn"),
                "generator": (lambda v: v is g, "the user's generator"),
                "prefetch_factor": (lambda v: v == 3, 3),
                "persistent_workers": (lambda v: v is True, True),
                "pin_memory": (lambda v: v is False, False),
            },
        )
    if problems:
        pytest.fail("torch backend:\n  " + "\n  ".join(problems), pytrace=False)


def test_a_worker_init_fn_set_after_construction_is_used(root, tmp_path):
    """Lightning assigns ``loader.worker_init_fn`` after the loader is made (seed_everything(workers=True))."""
    marks = tmp_path / "marks"
    marks.mkdir()

    def init(worker_id):
        (marks / f"w{worker_id}").touch()

    with make(root, "torch", num_workers=2, multiprocessing_context="fork") as loader:
        loader.worker_init_fn = init
        pass_ids(loader)
    assert sorted(p.name for p in marks.iterdir()) == ["w0", "w1"]
