"""A kind of recipe of one's own, in this file alone: a grayscale classifier's recipe with a target of
its own, and a detection recipe of a user's. Neither touches the pipeline graph, the checks, staging
or delivery: each answers :class:`coordl.Recipe`'s questions, and works with the node's cache, the
decoded tier, an HP group of two trials sharing one staging area, and a resume.

``GrayFlip``'s batches are ``(images, {"label", "flipped"})``: uint8 ``(B, 1, size, size)`` grey
images, flipped with probability ``flip`` by a draw of ``ctx.random``, and whether each was
flipped, computed at delivery from the same draw (``coordl.draws``), so the target agrees with the
pixels on every path.
"""

from __future__ import annotations

import json
import multiprocessing
from collections import Counter
from dataclasses import dataclass

import numpy as np
import pytest
import torch

import coordl
from childproc import report, result
from coordl import CoordLoader, Recipe, SSDVal, draws

CTX = multiprocessing.get_context("spawn")
BS = 8
SEED = 5


@dataclass(frozen=True)
class GrayFlip(Recipe):
    """Grey ``size`` x ``size`` images, each flipped with probability ``flip``; the target is the
    label and whether the image was flipped."""

    size: int = 24
    flip: float = 0.5
    name = "gray-flip"

    def augment(self, images, ctx):
        from nvidia.dali import fn, types

        images = fn.resize(images, device=ctx.device, resize_x=self.size, resize_y=self.size)
        grey = fn.color_space_conversion(images, device=ctx.device, image_type=types.RGB, output_type=types.GRAY)
        mirror = ctx.random.coin_flip(self.flip)  # the sample's first draw
        return fn.crop_mirror_normalize(grey, device=ctx.device, dtype=types.UINT8, output_layout="CHW", mirror=mirror)

    def output(self):
        return (1, self.size, self.size), "uint8"

    def targets(self, labels, ids, *, boxes, seed, epoch, device):
        first = draws.uniforms(seed, epoch, np.asarray(ids, dtype=np.int64), 1)[:, 0]
        return {"label": labels, "flipped": torch.from_numpy(first < self.flip)}


@dataclass(frozen=True)
class GreyBoxes(Recipe):
    """A user's detection recipe: the whole image resized to ``size`` x ``size``, grey, and its
    boxes scaled with it."""

    size: int = 48
    target = "boxes"
    name = "grey-boxes"

    def augment(self, images, ctx):
        from nvidia.dali import fn, types

        images = fn.resize(images, device=ctx.device, resize_x=self.size, resize_y=self.size)
        return fn.transpose(
            fn.color_space_conversion(images, image_type=types.RGB, output_type=types.GRAY), perm=[2, 0, 1]
        )

    def targets(self, labels, ids, *, boxes, seed, epoch, device):
        out = []
        for i in np.asarray(ids, dtype=np.int64).tolist():
            xyxy, classes, _ = boxes.gather(np.array([i]))
            w, h = boxes.image_sizes[i]
            scale = np.array([self.size / w, self.size / h] * 2)
            out.append(
                {"boxes": torch.from_numpy((xyxy * scale).astype(np.float32)), "labels": torch.from_numpy(classes)}
            )
        return out


def _loader(data, recipe=GrayFlip(), **kw):
    kw.setdefault("cache", 0)
    return CoordLoader(data, batch_size=BS, pipeline=recipe, device_id=None, shuffle=True, seed=SEED, prep=2, **kw)


def _epochs(loader, epochs=2) -> dict:
    """``{(epoch, sample): (image, label, flipped)}`` of every delivered sample."""
    out = {}
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        for images, target, ids in loader:
            for image, label, flipped, i in zip(images, target["label"], target["flipped"], ids.tolist(), strict=True):
                assert (epoch, i) not in out, f"sample {i} twice in epoch {epoch}"
                out[(epoch, i)] = (image.clone(), int(label), bool(flipped))
    return out


def test_a_recipe_of_ones_own_delivers_its_pixels_and_its_target(tiny_dataset):
    with _loader(str(tiny_dataset), return_index=True) as loader:
        got = _epochs(loader)
        labels = loader.index.labels
    with _loader(str(tiny_dataset), GrayFlip(flip=0.0), return_index=True) as plain:
        unflipped = _epochs(plain)
    assert set(got) == {(e, i) for e in range(2) for i in range(len(labels))}
    flips = Counter()
    for key, (image, label, flipped) in got.items():
        assert image.shape == (1, 24, 24) and image.dtype == torch.uint8
        assert label == labels[key[1]]
        want = unflipped[key][0].flip(-1) if flipped else unflipped[key][0]
        assert torch.equal(image, want), f"sample {key}: its pixels and its 'flipped' target disagree"
        flips[flipped] += 1
    assert flips[True] and flips[False], "the recipe's draws never (or always) flipped"
    # Rule 3: a fresh draw every epoch.
    assert any(got[(0, i)][2] != got[(1, i)][2] for i in range(len(labels)))


def test_a_recipe_of_ones_own_uses_the_node_cache_and_the_decoded_tier(tiny_dataset):
    with _loader(str(tiny_dataset), return_index=True) as plain:
        want = _epochs(plain)
    for cache in (coordl.Cache(size="256MB"), coordl.Cache(size="256MB", decoded="128MB")):
        with _loader(str(tiny_dataset), return_index=True, cache=cache) as loader:
            got = _epochs(loader)
            stats = loader.stats()
        assert stats["storage_reads"] == 0, "the second epoch read storage"
        assert stats["cache_hits"] + stats.get("decoded_hits", 0) == len(loader.index)
        assert got.keys() == want.keys()
        for key, (image, label, flipped) in got.items():
            assert torch.equal(image, want[key][0]) and (label, flipped) == want[key][1:], f"{key} differs ({cache})"
    assert stats["decoded_hits"] == len(loader.index), "the decoded tier served nothing"


def _member(root, q, start):
    def body():
        with _loader(root, hp_group="grey", return_index=True) as loader:
            start.wait(30)
            out = {k: (float(v[0].double().sum()), v[1], v[2]) for k, v in _epochs(loader).items()}
            return out, loader.stats()

    report(q, body)


def test_a_recipe_of_ones_own_is_shared_by_an_hp_group(tiny_dataset, procs):
    with _loader(str(tiny_dataset), return_index=True) as plain:
        want = {k: (float(v[0].double().sum()), v[1], v[2]) for k, v in _epochs(plain).items()}
    start, q = CTX.Barrier(2), CTX.Queue()
    for _ in range(2):
        procs(_member, str(tiny_dataset), q, start)
    members = [result(q, 240) for _ in range(2)]
    for got, _ in members:
        assert got == want, "a trial's images or targets differ from a lone loader's"
    assert sum(s["consumed_shared"] for _, s in members) > 0, "the trials shared nothing"
    assert all(s["stage_batch"] > 0 for _, s in members)


def test_a_recipe_of_ones_own_resumes_exactly(tiny_dataset):
    with _loader(str(tiny_dataset), return_index=True) as whole:
        want = _epochs(whole)
    with _loader(str(tiny_dataset), return_index=True) as first:
        first.set_epoch(1)
        it = iter(first)
        seen = [next(it) for _ in range(3)]
        state = json.loads(json.dumps(first.state_dict()))
    with _loader(str(tiny_dataset), return_index=True) as second:
        second.load_state_dict(state)
        rest = list(second)
    got = {}
    for images, target, ids in seen + rest:
        for image, label, flipped, i in zip(images, target["label"], target["flipped"], ids.tolist(), strict=True):
            got[(1, i)] = (image, int(label), bool(flipped))
    assert got.keys() == {k for k in want if k[0] == 1}, "the resumed epoch missed or repeated a sample"
    for key, (image, label, flipped) in got.items():
        assert torch.equal(image, want[key][0]) and (label, flipped) == want[key][1:], f"{key} differs after resume"


def test_a_recipe_of_ones_own_is_part_of_the_resume_fingerprint(tiny_dataset):
    with _loader(str(tiny_dataset)) as loader:
        state = loader.state_dict()
    with _loader(str(tiny_dataset), GrayFlip(size=16)) as other, pytest.raises(ValueError):
        other.load_state_dict(state)


def test_a_users_detection_recipe_delivers_its_own_boxes(tmp_path):
    from coordl.tools.datagen.coco import make_coco

    coco = make_coco(tmp_path / "coco", 12, seed=2, width=(64, 96), height=(64, 96), boxes=(1, 2))
    index = coordl.Index.from_coco(coco.images, coco.annotations)
    with (
        _loader(index, GreyBoxes(), return_index=True) as mine,
        _loader(index, SSDVal(size=48), return_index=True) as ssd,
    ):
        theirs = {}
        for _, targets, ids in ssd:
            for t, i in zip(targets, ids.tolist(), strict=True):
                theirs[i] = t
        n = 0
        for images, targets, ids in mine:
            assert images.shape[1:] == (1, 48, 48)
            for t, i in zip(targets, ids.tolist(), strict=True):
                assert torch.equal(t["labels"], theirs[i]["labels"])
                assert torch.allclose(t["boxes"], theirs[i]["boxes"], atol=1e-3), f"sample {i}'s boxes"
                n += 1
    assert n == len(index)
    with pytest.raises(ValueError, match="moves boxes with the pixels"):
        CoordLoader([(p, 0) for p in index.paths[:4]], batch_size=2, pipeline=GreyBoxes(), device_id=None)


@dataclass(frozen=True)
class AsDecoded(Recipe):
    """The decoded image as it is (CHW), decoded with or without its EXIF orientation."""

    orient: bool = True

    @property
    def decoder(self):
        from coordl.prep.decoders import ImageDecoder

        return ImageDecoder(adjust_orientation=self.orient)

    def augment(self, images, ctx):
        from nvidia.dali import fn

        return fn.transpose(images, perm=[2, 0, 1])


def test_the_decoders_settings_come_from_the_recipe(tmp_path):
    """EXIF orientation is the recipe's choice (its decoder), on an index of classes too; before,
    the index decided it (boxes or not)."""
    from PIL import Image

    path = tmp_path / "turned.jpg"
    exif = Image.Exif()
    exif[0x0112] = 6  # stored landscape, shown rotated by 90 degrees
    Image.new("RGB", (40, 24), (200, 30, 30)).save(path, exif=exif)
    shapes = {}
    for orient in (True, False):
        with CoordLoader([(str(path), 0)], batch_size=1, pipeline=AsDecoded(orient), device_id=None) as loader:
            images, _ = next(iter(loader))
            shapes[orient] = tuple(images.shape[1:])
    assert shapes == {True: (3, 40, 24), False: (3, 24, 40)}


def test_importing_coordl_imports_neither_torch_nor_dali():
    """The recipes are imported with coordl; DALI's ops and torch only when a pipeline is built or a
    batch delivered (a trial that starts late shares less of its HP group)."""
    import subprocess
    import sys

    code = "import sys, coordl; print(sorted({'torch', 'nvidia.dali'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out
