"""Object detection: COCO datasets the tests write (solid rectangles at known boxes on noise), the
SSD recipes' pixels and boxes, and every rule of the loader on them.

The datasets are PNG, so a rectangle's pixels are exactly its category's colour: a delivered box is
checked against the pixels delivered with it, and against the box drawn.
"""

from __future__ import annotations

import json
import math
import multiprocessing
import os
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import coordl
from childproc import report, result
from coordl import AnnotationError, CoordLoader, SampleError, SSDTrain, SSDVal, draws
from coordl.detection import crops
from coordl.detection.boxes import Boxes
from coordl.prep.recipes import IMAGENET_MEAN, IMAGENET_STD
from coordl.tools.datagen.coco import make_coco, write_shards

CTX = multiprocessing.get_context("spawn")
N = 48
SIZE = 64
BS = 8
PLAIN = dict(brightness=(1.0, 1.0), contrast=(1.0, 1.0), saturation=(1.0, 1.0), hue=(0.0, 0.0))
MEAN = torch.tensor(IMAGENET_MEAN).view(3, 1, 1) * 255
STD = torch.tensor(IMAGENET_STD).view(3, 1, 1) * 255


@pytest.fixture(scope="module")
def coco(tmp_path_factory):
    """48 PNG images of 96-160 x 80-140 pixels, 0 to 3 rectangles each, a tenth of them crowd boxes."""
    root = tmp_path_factory.mktemp("coco")
    return make_coco(root, N, seed=3, width=(96, 160), height=(80, 140), boxes=(0, 3), crowd=0.1, image_format="png")


def _index(coco, **kw):
    return coordl.Index.from_coco(coco.images, coco.annotations, **kw)


def _loader(data, recipe, **kw):
    kw.setdefault("shuffle", True)
    kw.setdefault("cache", 0)
    return CoordLoader(data, batch_size=BS, pipeline=recipe, device_id=None, return_index=True, seed=11, prep=1, **kw)


def _pixels(image: torch.Tensor) -> torch.Tensor:
    return image * STD + MEAN


def _inside(box, margin: int = 2):
    """The output pixels strictly inside a box, ``margin`` pixels in (a resize blends its edges)."""
    x1, y1, x2, y2 = box.tolist()
    return (
        int(math.ceil(y1)) + margin,
        int(math.floor(y2)) - margin,
        int(math.ceil(x1)) + margin,
        int(math.floor(x2)) - margin,
    )


def _truth(coco, image_id):
    t = coco.truth(image_id)
    kept = [(x1, y1, x2, y2, c) for x1, y1, x2, y2, c, crowd in t.boxes if not crowd]
    return t.width, t.height, kept


# -- the index -----------------------------------------------------------------------------------
def test_the_index_holds_each_image_s_boxes_in_id_order_without_crowd_boxes(coco, tmp_path):
    index = _index(coco)
    assert len(index) == N and index.boxes.image_ids.tolist() == sorted(coco.image_ids)
    for i, image_id in enumerate(index.boxes.image_ids.tolist()):
        width, height, kept = _truth(coco, image_id)
        xyxy, labels = index.boxes.of(i)
        assert index.boxes.image_sizes[i].tolist() == [width, height]
        assert xyxy.tolist() == [[x1, y1, x2, y2] for x1, y1, x2, y2, _ in kept]
        assert labels.tolist() == [c for *_, c in kept]
        assert index.paths[i] == coco.path(image_id)
    assert (index.boxes.counts == 0).any(), "the set has images without a box: they are kept"
    assert index.boxes.skipped == {"images": 0, "boxes": 0, "annotations": 0}
    again = _index(coco)
    assert again.saved_path == index.saved_path and again.fingerprint == index.fingerprint
    assert np.array_equal(again.boxes.xyxy, index.boxes.xyxy) and again.boxes.categories == coco_categories(coco)
    assert len(_index(coco, skip_empty=True)) == int((index.boxes.counts > 0).sum())


def coco_categories(coco) -> dict:
    doc = json.loads(Path(coco.annotations).read_text())
    return {c["id"]: c["name"] for c in doc["categories"]}


def test_boxes_are_part_of_the_fingerprint(coco, tmp_path):
    index = _index(coco)
    doc = json.loads(Path(coco.annotations).read_text())
    moved = next(a for a in doc["annotations"] if not a["iscrowd"])
    moved["bbox"][0] += 1
    other = tmp_path / "moved.json"
    other.write_text(json.dumps(doc))
    assert coordl.Index.from_coco(coco.images, other).fingerprint != index.fingerprint


# -- the pure plan: the reference algorithm, one sample and one try at a time ----------------------
def _reference(recipe, boxes: Boxes, seed: int, epoch: int, i: int):
    """SSD300 v1.1's crop as the module docstring states it, in plain Python: (window, flip, boxes)."""
    t = recipe.tries
    u = [float(v) for v in draws.uniforms(seed, epoch, [i], crops.columns(recipe))[0]]
    width, height = (int(v) for v in boxes.image_sizes[i])
    xyxy, labels = boxes.of(i)
    options = [None, *recipe.thresholds, -math.inf]
    window = (0, 0, width, height)
    for k in range(t):
        option = options[min(int(u[k] * len(options)), len(options) - 1)]
        if option is None:
            break
        lo, hi = recipe.scaling
        w, h = lo + (hi - lo) * u[t + k], lo + (hi - lo) * u[2 * t + k]
        if not recipe.aspect[0] <= w / h <= recipe.aspect[1]:
            continue
        left, top = u[3 * t + k] * (1 - w), u[4 * t + k] * (1 - h)
        x0, y0 = math.floor(left * width), math.floor(top * height)
        x1, y1 = math.floor((left + w) * width), math.floor((top + h) * height)
        if x1 <= x0 or y1 <= y0:
            continue
        ious, centres = [], []
        for bx0, by0, bx1, by1 in xyxy.astype(float).tolist():
            inter = max(0.0, min(bx1, x1) - max(bx0, x0)) * max(0.0, min(by1, y1) - max(by0, y0))
            ious.append(inter / ((bx1 - bx0) * (by1 - by0) + (x1 - x0) * (y1 - y0) - inter))
            cx, cy = (bx0 + bx1) / 2, (by0 + by1) / 2
            centres.append(x0 < cx < x1 and y0 < cy < y1)
        if all(iou > option for iou in ious) and any(centres):
            window = (x0, y0, x1 - x0, y1 - y0)
            break
    flip = u[5 * t] < recipe.flip
    wx, wy, ww, wh = window
    out = []
    for (bx0, by0, bx1, by1), label in zip(xyxy.astype(float).tolist(), labels.tolist()):
        cx, cy = (bx0 + bx1) / 2, (by0 + by1) / 2
        if not (wx < cx < wx + ww and wy < cy < wy + wh):
            continue
        a = (min(max(bx0, wx), wx + ww) - wx) * recipe.size / ww
        b = (min(max(by0, wy), wy + wh) - wy) * recipe.size / wh
        c = (min(max(bx1, wx), wx + ww) - wx) * recipe.size / ww
        d = (min(max(by1, wy), wy + wh) - wy) * recipe.size / wh
        if flip:
            a, c = recipe.size - c, recipe.size - a
        out.append(([a, b, c, d], label))
    return window, flip, out


@st.composite
def _samples(draw):
    count = draw(st.integers(1, 6))
    sizes, boxes, labels = [], [], []
    for _ in range(count):
        w, h = draw(st.integers(8, 400)), draw(st.integers(8, 400))
        sizes.append((w, h))
        mine = []
        for _ in range(draw(st.integers(0, 5))):
            x0, y0 = draw(st.integers(0, w - 2)), draw(st.integers(0, h - 2))
            mine.append((x0, y0, draw(st.integers(x0 + 1, w)), draw(st.integers(y0 + 1, h))))
        boxes.append(np.array(mine, np.float32).reshape(-1, 4))
        labels.append(np.arange(len(mine), dtype=np.int64) + 1)
    return Boxes.from_lists(boxes, labels, sizes, list(range(count)))


@settings(max_examples=60, deadline=None, derandomize=True)
@given(boxes=_samples(), seed=st.integers(0, 2**31), epoch=st.integers(0, 50), tries=st.sampled_from([1, 3, 50]))
@example(  # found by hypothesis: 73 * (300 / 73) is 300.00000000000006, and a flip made it -5.7e-14
    boxes=Boxes.from_lists([np.array([[0.0, 0.0, 112.0, 3.0]], np.float32)], [np.array([1])], [(193, 8)], [0]),
    seed=24000,
    epoch=19,
    tries=3,
)
def test_the_plan_is_the_reference_algorithm_sample_by_sample(boxes, seed, epoch, tries):
    recipe = SSDTrain(size=300, tries=tries)
    ids = np.arange(len(boxes))
    p = crops.plan(recipe, boxes, seed, epoch, ids)
    at = np.concatenate([[0], np.cumsum(p.counts)])
    for i in ids.tolist():
        window, flip, expected = _reference(recipe, boxes, seed, epoch, i)
        assert tuple(p.windows[i].tolist()) == window and bool(p.flips[i]) == flip
        got = p.xyxy[at[i] : at[i + 1]]
        assert p.labels[at[i] : at[i + 1]].tolist() == [label for _, label in expected]
        np.testing.assert_allclose(got, np.array([b for b, _ in expected], np.float32).reshape(-1, 4), rtol=1e-6)
        assert ((got >= 0) & (got <= recipe.size)).all()
        assert (got[:, 2] >= got[:, 0]).all() and (got[:, 3] >= got[:, 1]).all()
    # One sample's plan does not depend on the batch it is planned in.
    alone = crops.plan(recipe, boxes, seed, epoch, ids[-1:])
    assert np.array_equal(alone.windows[0], p.windows[-1]) and np.array_equal(alone.xyxy, p.xyxy[at[-2] :])


def test_the_crop_draws_every_option_over_many_samples():
    boxes = Boxes.from_lists(
        [np.array([[40, 40, 80, 90]], np.float32)] * 400, [np.array([1])] * 400, [(200, 150)] * 400, range(400)
    )
    p = crops.plan(SSDTrain(), boxes, 0, 0, np.arange(400))
    whole = (p.windows == [0, 0, 200, 150]).all(axis=1)
    assert 0.1 < whole.mean() < 0.6  # "no crop" is one option in seven, and failed tries end there too
    assert 0.35 < p.flips.mean() < 0.65
    assert (p.counts == 1).all()  # a crop always keeps a box: this image has one
    colour = p.colour
    for k, (lo, hi) in enumerate([(0.875, 1.125), (0.5, 1.5), (0.5, 1.5), (-18, 18)]):
        assert lo <= colour[:, k].min() < colour[:, k].max() <= hi


# -- the recipes' pixels and boxes ---------------------------------------------------------------
def test_ssd_val_delivers_every_drawn_box_scaled_to_the_output_within_half_a_pixel(coco):
    index = _index(coco)
    seen = []
    with _loader(index, SSDVal(size=SIZE), shuffle=False) as loader:
        for images, targets, ids in loader:
            assert images.shape[1:] == (3, SIZE, SIZE) and images.dtype == torch.float32
            for target, i in zip(targets, ids.tolist()):
                image_id = int(index.boxes.image_ids[i])
                width, height, kept = _truth(coco, image_id)
                assert target["image_id"] == image_id
                scale = np.array([SIZE / width, SIZE / height] * 2)
                drawn = np.array([b[:4] for b in kept], np.float64).reshape(-1, 4) * scale
                assert target["boxes"].dtype == torch.float32 and target["labels"].dtype == torch.int64
                assert np.abs(target["boxes"].numpy() - drawn).max(initial=0) < 0.5
                assert target["labels"].tolist() == [b[4] for b in kept]
                seen.append(i)
    assert seen == list(range(N))


def _check_boxes_over_their_rectangles(coco, recipe, epochs=2):
    """Every delivered box lies in the image, over pixels of its rectangle (its label's colour, or
    with the colour twist one colour); returns how many boxes, crops and flips were seen."""
    index = _index(coco)
    checked = cropped = 0
    with _loader(index, recipe) as loader:
        for epoch in range(epochs):
            loader.set_epoch(epoch)
            for images, targets, ids in loader:
                p = crops.plan(recipe, index.boxes, 11, epoch, ids.numpy())
                cropped += int((p.windows[:, 2:] != index.boxes.image_sizes[ids.numpy()]).any(axis=1).sum())
                for image, target in zip(images, targets):
                    px = _pixels(image)
                    for box, label in zip(target["boxes"], target["labels"].tolist()):
                        assert (box >= 0).all() and (box <= SIZE).all() and box[2] > box[0] and box[3] > box[1]
                        y0, y1, x0, x1 = _inside(box)
                        if y1 <= y0 or x1 <= x0:
                            continue
                        region = px[:, y0:y1, x0:x1].reshape(3, -1)
                        if recipe.twists_colour:  # one colour, whichever the twist made of it
                            assert (region - region[:, :1]).abs().max() < 1.01, "a box over more than its rectangle"
                        else:
                            colour = torch.tensor(coco.colours[label], dtype=torch.float32)[:, None]
                            assert (region - colour).abs().max() < 0.01, "a box over pixels not of its label's colour"
                        checked += 1
    return checked, cropped


def test_ssd_train_boxes_lie_over_their_rectangles_pixels_as_crops_and_flips_move_them(coco):
    checked, cropped = _check_boxes_over_their_rectangles(coco, SSDTrain(size=SIZE, **PLAIN))
    assert checked > 100 and cropped > 10


def test_with_the_colour_twist_each_box_still_covers_one_colour(coco):
    checked, _ = _check_boxes_over_their_rectangles(coco, SSDTrain(size=SIZE), epochs=1)
    assert checked > 50


# -- the loader's rules --------------------------------------------------------------------------
def _record(loader, out: dict, epoch: int, limit=None) -> list[int]:
    """Iterates ``loader`` (``limit`` batches at most), recording ``(image, boxes, labels)`` by
    ``(epoch, sample)``; returns the samples in delivery order."""
    got = []
    for k, (images, targets, ids) in enumerate(loader):
        for image, target, i in zip(images, targets, ids.tolist()):
            item = (image.clone(), target["boxes"].clone(), target["labels"].clone())
            previous = out.setdefault((epoch, i), item)
            assert all(torch.equal(a, b) for a, b in zip(previous, item)), f"sample {i} delivered twice, differently"
            got.append(i)
        if limit is not None and k + 1 == limit:
            break
    return got


def test_every_epoch_is_exactly_once_with_fresh_crops_and_the_same_crops_for_the_same_seed(coco):
    index = _index(coco)
    runs = []
    for _ in range(2):
        out = {}
        with _loader(index, SSDTrain(size=SIZE)) as loader:
            for epoch in range(2):
                loader.set_epoch(epoch)
                assert sorted(_record(loader, out, epoch)) == list(range(N))
        runs.append(out)
    for key, (image, boxes, labels) in runs[0].items():
        other = runs[1][key]
        assert torch.equal(image, other[0]) and torch.equal(boxes, other[1]) and torch.equal(labels, other[2])
    same = sum(torch.equal(runs[0][(0, i)][0], runs[0][(1, i)][0]) for i in range(N))
    assert same == 0, f"{same} samples got the same pixels in two epochs"


def test_a_run_resumed_from_2_ranks_on_3_delivers_the_uninterrupted_runs_images_and_boxes(coco):
    index, recipe = _index(coco), SSDTrain(size=SIZE)
    reference: dict = {}
    with _loader(index, recipe) as loader:
        for epoch in (0, 1):
            loader.set_epoch(epoch)
            _record(loader, reference, epoch)
    out: dict = {}
    before = [_loader(index, recipe, shard=coordl.Shard(rank=r, world_size=2)) for r in range(2)]
    first = []
    try:
        for loader in before:
            first += _record(loader, out, 0, limit=1)
        state = json.loads(json.dumps(before[0].state_dict()))
    finally:
        for loader in before:
            loader.close()
    after = [_loader(index, recipe, shard=coordl.Shard(rank=r, world_size=3)) for r in range(3)]
    rest = {0: [], 1: []}
    try:
        for loader in after:
            loader.load_state_dict(state)
            for epoch in (0, 1):
                loader.set_epoch(epoch)
                rest[epoch] += _record(loader, out, epoch)
    finally:
        for loader in after:
            loader.close()
    for key, item in out.items():
        assert all(torch.equal(a, b) for a, b in zip(item, reference[key])), f"{key} differs from the reference"
    assert set(first + rest[0]) == set(range(N)) and set(rest[1]) == set(range(N))
    assert len(first + rest[0]) - N < 3  # beyond padding, nothing twice


def test_each_later_epoch_reads_exactly_the_samples_the_cache_does_not_hold(coco):
    index = _index(coco)
    budget = int(index.total_bytes * 0.5)
    with _loader(index, SSDTrain(size=SIZE), cache=budget) as loader:
        stats = []
        for epoch in range(3):
            loader.set_epoch(epoch)
            for _ in loader:
                pass
            stats.append(loader.stats())
    assert stats[0]["storage_reads"] == N and 0 < stats[0]["cache_items"] < N
    for s in stats[1:]:
        assert s["storage_reads"] == N - s["cache_items"] and s["cache_hits"] == s["cache_items"]
        assert s["storage_bytes"] == index.total_bytes - s["cache_bytes"]


def test_the_decoded_tier_gives_the_same_images_and_boxes(coco):
    index = _index(coco)
    got = []
    for cache in (0, coordl.Cache(size="256MB", decoded="128MB")):
        out = {}
        with _loader(index, SSDTrain(size=SIZE), cache=cache) as loader:
            for epoch in range(2):
                loader.set_epoch(epoch)
                _record(loader, out, epoch)
            stats = loader.stats()
        got.append(out)
    assert stats["decoded_hits"] == N, "the second epoch came from the decoded tier"
    for key, item in got[0].items():
        assert all(torch.equal(a, b) for a, b in zip(item, got[1][key])), f"{key} differs with the decoded tier"


def test_collate_fn_lays_out_the_batch_and_ids_follow_it(coco):
    def padded(samples):
        images = torch.stack([s[0] for s in samples])
        boxes = torch.zeros(len(samples), 4, 4)
        for k, (_, t) in enumerate(samples):
            boxes[k, : len(t["boxes"])] = t["boxes"]
        return images, boxes

    index = _index(coco)
    with _loader(index, SSDVal(size=SIZE), shuffle=False, collate_fn=padded) as loader:
        images, boxes, ids = next(iter(loader))
    assert images.shape == (BS, 3, SIZE, SIZE) and boxes.shape == (BS, 4, 4) and ids.tolist() == list(range(BS))
    assert loader.collate_fn is padded


def test_recipes_and_datasets_that_do_not_fit_are_refused(coco, tiny_dataset):
    with pytest.raises(ValueError, match="this dataset has none: give it a detection index"):
        CoordLoader(str(tiny_dataset), batch_size=4, pipeline="ssd-train", device_id=None)
    with pytest.raises(ValueError, match="would not move with the pixels: use pipeline='ssd-train'"):
        CoordLoader(_index(coco), batch_size=4, pipeline="imagenet-train", device_id=None)


# -- HP groups, tar shards, two nodes ---------------------------------------------------------------
def _member(images, annotations, group, q, start):
    def body():
        index = coordl.Index.from_coco(images, annotations)
        out = []
        with _loader(index, SSDTrain(size=SIZE), hp_group=group) as loader:
            start.wait(30)
            for epoch in range(2):
                loader.set_epoch(epoch)
                for x, targets, ids in loader:
                    for image, t, i in zip(x, targets, ids.tolist()):
                        out.append((epoch, i, float(image.double().sum()), t["boxes"].tolist(), t["labels"].tolist()))
            stats = loader.stats()
        return out, stats

    report(q, body)


def test_hp_group_trials_share_the_crops_and_deliver_a_plain_loaders_images_and_boxes(coco, procs, isolated):
    index = _index(coco)
    plain = {}
    with _loader(index, SSDTrain(size=SIZE)) as loader:
        for epoch in range(2):
            loader.set_epoch(epoch)
            for x, targets, ids in loader:
                for image, t, i in zip(x, targets, ids.tolist()):
                    plain[(epoch, i)] = (float(image.double().sum()), t["boxes"].tolist(), t["labels"].tolist())
    start, q = CTX.Barrier(2), CTX.Queue()
    for _ in range(2):
        procs(_member, coco.images, coco.annotations, "detect", q, start)
    members = [result(q, 180) for _ in range(2)]
    for out, _ in members:
        assert Counter((e, i) for e, i, *_ in out) == Counter(plain.keys()), "an epoch missed or repeated a sample"
        for epoch, i, total, boxes, labels in out:
            assert (total, boxes, labels) == plain[(epoch, i)], f"sample {i} of epoch {epoch} differs"
    assert sum(s["consumed_shared"] for _, s in members) > 0, "the trials shared nothing"


def test_tar_shards_with_json_members_deliver_the_coco_folder_s_images_and_boxes(coco, tmp_path):
    shards = write_shards(coco, tmp_path / "shards", per_shard=10)
    folder, tars = {}, {}
    for data, out in ((_index(coco), folder), (str(tmp_path / "shards" / "shard-{000000..000004}.tar"), tars)):
        with _loader(data, "ssd-train") as loader:
            for epoch in range(2):
                loader.set_epoch(epoch)
                _record(loader, out, epoch)
    assert len(shards) == 5 and folder.keys() == tars.keys()
    for key, item in folder.items():
        assert all(torch.equal(a, b) for a, b in zip(item, tars[key])), f"{key} differs over the shards"
    index = coordl.Index.from_tars(shards, boxes=True)
    assert index.boxes.image_ids.tolist() == sorted(coco.image_ids)


def test_two_nodes_with_peers_deliver_every_sample_once_with_its_boxes(coco, tmp_path):
    from test_peers import _logs, _records, _run_nodes

    out = tmp_path / "out"
    args = ["--epochs", "2", "--cache", "0.6", "--coco", coco.annotations, "--size", str(SIZE)]
    codes = _run_nodes(Path(coco.images), out, 2, args, loopback=True)
    assert codes == [0, 0], _logs(out)
    recs = _records(out, 2)
    index = _index(coco)
    for epoch in range(2):
        seen = Counter(i for r in recs for b in r["epochs"][epoch]["batches"] for i in b)
        assert sorted(seen) == list(range(N)) and set(seen.values()) == {1}, f"epoch {epoch} not exactly-once"
        p = crops.plan(SSDTrain(size=SIZE), index.boxes, 5, epoch, np.arange(N))
        at = np.concatenate([[0], np.cumsum(p.counts)])
        for r in recs:
            for i, boxes in r["epochs"][epoch]["boxes"].items():
                assert boxes == p.xyxy[at[int(i)] : at[int(i) + 1]].tolist(), f"sample {i}'s boxes"
    steady = [r["epochs"][1]["stats"] for r in recs]
    assert sum(s["storage_reads"] for s in steady) == 0 and sum(s["peer_reads"] for s in steady) > 0


# -- bad input ------------------------------------------------------------------------------------
@pytest.fixture
def small(tmp_path):
    """A writable COCO set of 6 JPEG images and its parsed annotations, to break."""
    c = make_coco(tmp_path / "set", 6, seed=5, boxes=(1, 2), width=(64, 96), height=(64, 96))
    return c, json.loads(Path(c.annotations).read_text())


def _write(doc, path: Path) -> Path:
    path.write_text(json.dumps(doc))
    return path


def _breaks(small, tmp_path, change):
    c, doc = small
    image_id = change(doc)
    return c, _write(doc, tmp_path / "broken.json"), image_id


def _missing_image(doc):
    name = doc["images"][0]["file_name"]
    doc["images"][0]["file_name"] = "gone-" + name
    return doc["images"][0]["id"]


def _flat_box(doc):
    doc["annotations"][0]["bbox"][3] = 0
    return doc["annotations"][0]["image_id"]


def _box_outside(doc):
    ann = doc["annotations"][0]
    width = next(i["width"] for i in doc["images"] if i["id"] == ann["image_id"])
    ann["bbox"][0] = width - ann["bbox"][2] + 3
    return ann["image_id"]


def _unknown_image(doc):
    doc["annotations"][0]["image_id"] = 999
    return 999


def _unknown_category(doc):
    doc["annotations"][0]["category_id"] = 42
    return doc["annotations"][0]["image_id"]


@pytest.mark.parametrize(
    "change,kind,words",
    [
        (_missing_image, "images", "which is not in"),
        (_flat_box, "boxes", "has no area"),
        (_box_outside, "boxes", "reaches outside its"),
        (_unknown_image, "annotations", "which the file does not list"),
        (_unknown_category, "annotations", "not in the file's"),
    ],
    ids=["missing image", "box of no area", "box outside", "unknown image", "unknown category"],
)
def test_bad_annotations_are_named_or_skipped_and_counted(small, tmp_path, change, kind, words):
    c, path, image_id = _breaks(small, tmp_path, change)
    with pytest.raises(AnnotationError, match=words) as e:
        coordl.Index.from_coco(c.images, path)
    assert str(path) in str(e.value) and f"image {image_id}" in str(e.value) and e.value.image_id == image_id
    index = coordl.Index.from_coco(c.images, path, on_error="skip")
    assert index.boxes.skipped[kind] == 1 and sum(index.boxes.skipped.values()) == 1
    with _loader(index, SSDVal(size=32)) as loader:
        delivered = sum(len(ids) for _, _, ids in loader)
        assert loader.stats()["index_skipped"][kind] == 1
    assert delivered == len(index) == (5 if kind == "images" else 6)


def test_a_file_name_outside_the_images_root_is_refused_by_name_or_skipped(small, tmp_path, caplog):
    """An absolute ``file_name`` and one that climbs out with ``..`` name real image files outside
    the root: refused, the message naming them and the root, or left out with a warning; a name that
    steps down and back (``sub/../x``) stays inside and is taken."""
    c, doc = small
    images = sorted(doc["images"], key=lambda i: i["id"])
    for k, image in enumerate(images[:2]):
        shutil.copy(os.path.join(c.images, image["file_name"]), tmp_path / f"planted-{k}.jpg")
    climbing = os.path.relpath(tmp_path / "planted-0.jpg", c.images)  # ../../planted-0.jpg
    absolute = str(tmp_path / "planted-1.jpg")
    images[0]["file_name"], images[1]["file_name"] = climbing, absolute
    os.mkdir(os.path.join(c.images, "sub"))
    images[2]["file_name"] = "sub/../" + images[2]["file_name"]
    path = _write(doc, tmp_path / "outside.json")
    with pytest.raises(ValueError, match="2 images have a file_name outside the images' root") as e:
        coordl.Index.from_coco(c.images, path)
    assert isinstance(e.value, AnnotationError) and e.value.image_id == images[0]["id"]
    assert all(s in str(e.value) for s in (repr(climbing), repr(absolute), c.images, str(path)))
    with pytest.raises(AnnotationError, match="outside the images' root"):
        coordl.datasets.CocoDetection(c.images, path)
    with caplog.at_level("WARNING", logger="coordl"):
        index = coordl.Index.from_coco(c.images, path, on_error="skip")
    warned = [r.getMessage() for r in caplog.records if "outside the images' root" in r.getMessage()]
    assert len(warned) == 1 and all(s in warned[0] for s in (repr(climbing), repr(absolute), c.images))
    assert index.boxes.skipped["images"] == 2 and len(index) == 4
    assert index.boxes.image_ids.tolist() == [i["id"] for i in images[2:]]
    assert not any("planted" in p for p in index.paths)
    with _loader(index, SSDVal(size=32)) as loader:
        ids = sorted(i for _, _, batch in loader for i in batch.tolist())
        assert ids == [0, 1, 2, 3] and loader.stats()["index_skipped"]["images"] == 2
    dataset = coordl.datasets.CocoDetection(c.images, path, on_error="skip")
    assert dataset.ids == [i["id"] for i in images[2:]]


def test_a_file_that_is_not_json_is_refused_with_its_name(small, tmp_path):
    c, _ = small
    bad = tmp_path / "instances_bad.json"
    bad.write_text('{"images": [')
    for on_error in ("raise", "skip"):
        with pytest.raises(AnnotationError, match="is not a COCO annotations file: not JSON") as e:
            coordl.Index.from_coco(c.images, bad, on_error=on_error)
        assert str(bad) in str(e.value)
    with pytest.raises(AnnotationError, match="needs the lists 'images' and 'annotations'"):
        coordl.Index.from_coco(c.images, _write({"images": {}}, tmp_path / "x.json"))


def test_an_image_of_another_size_than_its_annotations_is_named_or_skipped(small, tmp_path):
    c, doc = small
    first = sorted(doc["images"], key=lambda i: i["id"])[0]
    first["width"] += 8
    path = _write(doc, tmp_path / "resized.json")
    for recipe in (SSDTrain(size=32), SSDVal(size=32)):
        with _loader(coordl.Index.from_coco(c.images, path), recipe, shuffle=False) as loader:
            with pytest.raises(SampleError, match=r"its annotations say \d+x\d+: its boxes would not be") as e:
                list(loader)
            assert e.value.path == os.path.join(c.images, first["file_name"])
        with _loader(coordl.Index.from_coco(c.images, path), recipe, on_error="skip") as loader:
            ids = [i for _, _, batch in loader for i in batch.tolist()]
            assert sorted(ids) == [1, 2, 3, 4, 5] and loader.stats()["skipped"] == 1


def test_a_json_member_with_a_bad_box_is_named_or_skipped(small, tmp_path):
    c, _ = small
    shards = write_shards(c, tmp_path / "shards", per_shard=3)
    # Rewrite the first shard with a box of no area in its first sample's member.
    import tarfile

    first = Path(shards[0])
    members = []
    with tarfile.open(first) as t:
        for m in t.getmembers():
            data = t.extractfile(m).read()
            if m.name.endswith(".json") and not any(name.endswith(".json") for name, _ in members):
                doc = json.loads(data)
                doc["annotations"][0]["bbox"][2] = -1
                data = json.dumps(doc).encode()
            members.append((m.name, data))
    broken = tmp_path / "broken"
    broken.mkdir()
    shutil.copy(shards[1], broken / "shard-000001.tar")
    with tarfile.open(broken / "shard-000000.tar", "w") as t:
        import io

        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
    with pytest.raises(AnnotationError, match="has no area") as e:
        coordl.Index.from_tars(str(broken), boxes=True)
    assert "shard-000000.tar:" in str(e.value)
    index = coordl.Index.from_tars(str(broken), boxes=True, skip=True)
    assert index.boxes.skipped["boxes"] == 1 and len(index) == 6


def test_coco_images_in_s3_deliver_the_local_folder_s_images_and_boxes(coco, s3_server, monkeypatch):
    s3_server.create_bucket("coordl-coco")
    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)
    s3_server.upload_tree(coco.images, "coordl-coco", "train")
    remote = coordl.Index.from_coco("s3://coordl-coco/train", coco.annotations)
    assert remote.etags is not None and list(remote.sizes) == list(_index(coco).sizes)
    local, store = {}, {}
    for data, out in ((_index(coco), local), (remote, store)):
        with _loader(data, SSDTrain(size=SIZE), cache=1.0) as loader:
            for epoch in range(2):
                loader.set_epoch(epoch)
                _record(loader, out, epoch)
            reads = loader.stats()["storage_reads"]
        assert reads == 0  # the second epoch came from the node's cache
    for key, item in local.items():
        assert all(torch.equal(a, b) for a, b in zip(item, store[key])), f"{key} differs from s3://"
    doc = json.loads(Path(coco.annotations).read_text())
    doc["images"][0]["file_name"] = "missing.png"
    with pytest.raises(AnnotationError, match="which is not in s3://coordl-coco/train"):
        coordl.Index.from_coco("s3://coordl-coco/train", _write(doc, Path(coco.root) / "missing.json"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_on_a_gpu_images_and_boxes_arrive_on_the_device_with_the_cpu_path_s_boxes(coco):
    """The GPU path (nvJPEG's decoder, DALI's GPU operators): the images and targets on the device,
    the same boxes as the CPU path's (they are planned outside the pipeline), pixels close to its."""
    index = _index(coco)
    got = {}
    for device in (None, 0):
        out = {}
        with CoordLoader(index, batch_size=BS, pipeline=SSDTrain(size=SIZE), device_id=device, return_index=True) as ld:
            for images, targets, ids in ld:
                if device is not None:
                    assert images.is_cuda and all(t["boxes"].is_cuda for t in targets)
                for image, t, i in zip(images, targets, ids.tolist()):
                    out[i] = (image.cpu(), t["boxes"].cpu(), t["labels"].cpu())
        got[device] = out
    assert got[None].keys() == got[0].keys() == set(range(N))
    for i, (image, boxes, labels) in got[None].items():
        assert torch.equal(boxes, got[0][i][1]) and torch.equal(labels, got[0][i][2])
        # Another decoder and other resize kernels: the same picture, not the same bits.
        assert (image - got[0][i][0]).abs().mean() < 0.1, f"sample {i}: the GPU's pixels are not the CPU's"
