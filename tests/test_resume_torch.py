"""Exact and elastic resume on the torch backend: a sample's random transforms draw from torch's,
Python's and NumPy's global generators as a function of ``(seed, epoch, sample)``.

The transforms here are torchvision-style and draw from all three generators. Every tensor is
compared bit for bit with an uninterrupted single-rank run: after a resume at the same or
another world size, whatever the workers, the batch size or the rank. Ranks are loaders made
with ``rank=r, world_size=W`` in this process; under DDP every rank receives as many batches, so
here every rank takes the same number before the job "dies".
"""

from __future__ import annotations

import json
import math
import random
import shutil
import tempfile
from collections import Counter
from contextlib import contextmanager

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

import coordl
from coordl import CoordLoader
from coordl.datasets import ImageFolder
from recording import take

N = 120  # samples in tiny_dataset
BS = 8
SEED = 7
WORKERS = {
    "in-process": {"num_workers": 0},
    "workers": {"num_workers": 2, "persistent_workers": False},
    "persistent-workers": {"num_workers": 2, "persistent_workers": True},
}


# -- transforms written like torchvision's ------------------------------------------------------
def random_resized_crop(im: Image.Image, size: int = 12, scale=(0.25, 1.0), ratio=(3 / 4, 4 / 3)) -> Image.Image:
    """torchvision's ``RandomResizedCrop``: its ``get_params``, drawing from torch's generator."""
    w, h = im.size
    log_ratio = torch.log(torch.tensor(ratio))
    for _ in range(10):
        area = w * h * torch.empty(1).uniform_(scale[0], scale[1]).item()
        aspect = math.exp(torch.empty(1).uniform_(log_ratio[0], log_ratio[1]).item())
        cw, ch = round(math.sqrt(area * aspect)), round(math.sqrt(area / aspect))
        if 0 < cw <= w and 0 < ch <= h:
            top = torch.randint(0, h - ch + 1, size=(1,)).item()
            left = torch.randint(0, w - cw + 1, size=(1,)).item()
            return im.resize((size, size), Image.BILINEAR, box=(left, top, left + cw, top + ch))
    return im.resize((size, size), Image.BILINEAR)


def augment(im: Image.Image) -> torch.Tensor:
    """A PIL image to a uint8 tensor (3, 12, 12): crop and flip (torch), a quarter turn (Python's
    ``random``), a brightness shift (NumPy's global generator)."""
    im = random_resized_crop(im)
    if torch.rand(1) < 0.5:
        im = im.transpose(Image.FLIP_LEFT_RIGHT)
    x = torch.from_numpy(np.array(im, dtype=np.uint8)).permute(2, 0, 1)
    x = torch.rot90(x, random.choice([0, 1, 2, 3]), dims=(1, 2))
    return (x.int() + int(np.random.randint(0, 32))).clamp(0, 255).to(torch.uint8)


def _loader(root, workers: str = "in-process", transform=augment, **kw) -> CoordLoader:
    kw.setdefault("batch_size", BS)
    kw.setdefault("shuffle", True)
    data = ImageFolder(root, transform=transform)
    return CoordLoader(data, seed=SEED, return_index=True, **WORKERS[workers], **kw, cache=0)


def _check(out: dict, reference: dict) -> None:
    for key, tensor in out.items():
        assert torch.equal(tensor, reference[key]), f"sample {key[1]} of epoch {key[0]} differs from the reference"


@pytest.fixture(scope="module")
def reference(tiny_dataset, tmp_path_factory):
    """Epochs 0 and 1 of an uninterrupted single-rank run in the main process: tensor by (epoch, sample)."""
    shm = tempfile.mkdtemp(prefix="coordl-test-", dir="/dev/shm")
    try:
        with pytest.MonkeyPatch.context() as mp:  # what the function-scoped `isolated` fixture does
            mp.setenv("COORDL_SHM_DIR", shm)
            mp.setenv("COORDL_INDEX_DIR", str(tmp_path_factory.mktemp("index")))
            out = {}
            with _loader(str(tiny_dataset)) as loader:
                for epoch in (0, 1):
                    assert sorted(take(loader, out, epoch)) == list(range(N))
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    return out


# -- bit for bit, whoever delivers a sample ---------------------------------------------------------
@pytest.mark.parametrize("workers", sorted(WORKERS))
@pytest.mark.parametrize("before,after", [(1, 1), (2, 2), (1, 2), (2, 3), (4, 2)])
@settings(max_examples=3, deadline=None, derandomize=True)
@given(data=st.data())
def test_a_resumed_run_delivers_the_uninterrupted_runs_tensors(tiny_dataset, reference, workers, before, after, data):
    root, out = str(tiny_dataset), {}
    ranks = [_loader(root, workers, shard=coordl.Shard(rank=r, world_size=before)) for r in range(before)]
    try:
        cut = data.draw(st.integers(0, len(ranks[0]) - 1), label="batches before the interruption")
        first = []
        for loader in ranks:
            first += take(loader, out, 0, limit=cut)
        states = [json.loads(json.dumps(loader.state_dict())) for loader in ranks]
    finally:
        for loader in ranks:
            loader.close()
    assert all(s == states[0] for s in states) and (states[0]["epoch"], states[0]["batches"]) == (0, cut)
    rest, later = [], []
    ranks = [_loader(root, workers, shard=coordl.Shard(rank=r, world_size=after)) for r in range(after)]
    try:
        for loader in ranks:
            loader.load_state_dict(states[0])  # rank 0's state, on every new rank
            rest += take(loader, out, 0)
            assert loader.epoch == 1
            later += take(loader, out, 1)
    finally:
        for loader in ranks:
            loader.close()
    _check(out, reference)
    counts = Counter(first + rest)
    assert set(counts) == set(range(N)), "a sample of the interrupted epoch was not delivered"
    padding = (-N) % before + (after - 1)  # DistributedSampler's, in each plan at most world_size - 1
    assert sum(counts.values()) - N <= padding, "samples delivered twice beyond padding"
    assert sorted(set(later)) == list(range(N))  # the next epoch, at the new world size, is whole


@pytest.mark.parametrize("workers", sorted(WORKERS))
def test_the_tensors_do_not_depend_on_workers_batch_size_or_rank(tiny_dataset, reference, workers):
    out = {}
    for rank in range(3):
        with _loader(str(tiny_dataset), workers, batch_size=5, shard=coordl.Shard(rank=rank, world_size=3)) as loader:
            for epoch in (0, 1):
                take(loader, out, epoch)
    assert len(out) == 2 * N
    _check(out, reference)


def test_a_sample_is_augmented_differently_in_every_epoch(reference):
    same = [i for i in range(N) if torch.equal(reference[(0, i)], reference[(1, i)])]
    assert not same, f"samples {same} were augmented alike in epochs 0 and 1"
    assert len({reference[(0, i)].sum().item() for i in range(N)}) > N // 2  # and samples differ


def test_another_seed_augments_differently(tiny_dataset, reference):
    out = {}
    with CoordLoader(
        ImageFolder(tiny_dataset, transform=augment),
        batch_size=BS,
        seed=SEED + 1,
        shuffle=False,
        return_index=True,
        cache=0,
    ) as loader:
        take(loader, out, 0)
    same = [i for i in range(N) if torch.equal(out[(0, i)], reference[(0, i)])]
    assert not same, f"samples {same} were augmented alike with seeds {SEED} and {SEED + 1}"


# -- the user's own generators ----------------------------------------------------------------------
@contextmanager
def _kept_generators():
    """Puts this process's global generators back after a test that seeds them."""
    saved = torch.random.get_rng_state(), random.getstate(), np.random.get_state()
    try:
        yield
    finally:
        torch.random.set_rng_state(saved[0])
        random.setstate(saved[1])
        np.random.set_state(saved[2])


def _draws() -> list:
    """A few draws from each global generator, normals too (each caches its second number)."""
    return [
        torch.rand(3).tolist(),
        torch.randn(1).item(),
        random.random(),
        random.gauss(0, 1),
        np.random.rand(3).tolist(),
        float(np.random.standard_normal()),
    ]


def _streams(between) -> list:
    """The user's draws with ``between()`` run in the middle of them."""
    torch.manual_seed(1)
    random.seed(2)
    np.random.seed(3)
    before = _draws()
    between()
    return before + _draws() + _draws()


def _fails_on_sample_3(im):
    x = augment(im)
    if _fails_on_sample_3.calls == 3:
        raise RuntimeError("a transform's bug")
    _fails_on_sample_3.calls += 1
    return x


def test_in_process_transforms_leave_the_users_generators_as_they_were(tiny_dataset):
    root = str(tiny_dataset)

    def iterate():
        with _loader(root) as loader:
            take(loader, {}, 0, limit=3)  # a pass left mid-epoch
            take(loader, {}, 0)  # and a whole one
        _fails_on_sample_3.calls = 0
        with (
            _loader(root, transform=_fails_on_sample_3) as loader,
            pytest.raises(RuntimeError, match="a transform's bug"),
        ):
            next(iter(loader))  # the generators are put back after an error too

    with _kept_generators():
        alone = _streams(lambda: None)
        around_the_loader = _streams(iterate)
    assert around_the_loader == alone
