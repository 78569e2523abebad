"""Tests for coordl.tools.datagen.coco: deterministic COCO detection datasets of coloured rectangles."""

from __future__ import annotations

import io
import json
import os
import tarfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from coordl.tools.datagen.coco import CATEGORY_COLOURS, GAP, CocoSet, make_coco, write_shards

PHOTOS = Path(__file__).resolve().parents[2] / "shared" / "photos"
needs_photos = pytest.mark.skipif(not PHOTOS.is_dir(), reason=f"{PHOTOS} not found")


def files_of(root: Path) -> dict[str, bytes]:
    """Map each file's path relative to root to its bytes."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def pixels(coco: CocoSet, image_id: int) -> np.ndarray:
    with Image.open(coco.path(image_id)) as im:
        assert im.size == (coco.truth(image_id).width, coco.truth(image_id).height)
        return np.asarray(im.convert("RGB"), dtype=np.int16)


def all_boxes(coco: CocoSet) -> list[tuple[int, int, int, int, int, int]]:
    return [b for i in coco.image_ids for b in coco.truth(i).boxes]


def test_the_json_is_coco_and_matches_the_truth(tmp_path: Path) -> None:
    coco = make_coco(tmp_path, 12, seed=1, boxes=(1, 5), width=(60, 90), height=(50, 70))
    assert coco.root == str(tmp_path)
    assert coco.images == str(tmp_path / "train")
    assert coco.annotations == str(tmp_path / "annotations" / "instances_train.json")
    doc = json.loads(Path(coco.annotations).read_text())
    assert {"images", "annotations", "categories", "info"} <= set(doc)

    ids = [e["id"] for e in doc["images"]]
    assert sorted(ids) == coco.image_ids == list(range(1, 13))
    assert ids != coco.image_ids  # shuffled: readers must sort by id
    for e in doc["images"]:
        assert set(e) == {"id", "file_name", "width", "height"}
        assert e["file_name"] == f"{e['id']:012d}.jpg"
        assert (tmp_path / "train" / e["file_name"]).is_file()
        assert 60 <= e["width"] <= 90 and 50 <= e["height"] <= 70
        assert (e["width"], e["height"]) == (coco.truth(e["id"]).width, coco.truth(e["id"]).height)
    assert sorted(os.listdir(coco.images)) == [f"{i:012d}.jpg" for i in range(1, 13)]

    assert [c["id"] for c in doc["categories"]] == [1, 2, 3, 7]
    assert all(set(c) == {"id", "name", "supercategory"} for c in doc["categories"])
    assert coco.colours == dict(zip([1, 2, 3, 7], CATEGORY_COLOURS))

    anns = doc["annotations"]
    assert len({a["id"] for a in anns}) == len(anns) == len(all_boxes(coco)) > 0
    truth_from_json: dict[int, list] = {i: [] for i in coco.image_ids}
    for a in anns:
        assert {"id", "image_id", "category_id", "bbox", "area", "iscrowd"} <= set(a)
        x, y, w, h = a["bbox"]
        assert all(isinstance(v, int) for v in a["bbox"])
        assert a["area"] == w * h and w >= 12 and h >= 12 and a["iscrowd"] == 0
        assert a["category_id"] in coco.colours
        truth_from_json[a["image_id"]].append((x, y, x + w, y + h, a["category_id"], a["iscrowd"]))
    assert {i: tuple(b) for i, b in truth_from_json.items()} == {i: coco.truth(i).boxes for i in coco.image_ids}
    assert coco.total_bytes == sum(os.path.getsize(coco.path(i)) for i in coco.image_ids)


def test_rerun_is_byte_identical_and_skipped_when_present(tmp_path: Path) -> None:
    first = make_coco(tmp_path / "a", 6, seed=4, crowd=0.5)
    again = make_coco(tmp_path / "b", 6, seed=4, crowd=0.5)
    files = files_of(tmp_path / "a")
    assert files == files_of(tmp_path / "b")
    assert (first.truths, first.total_bytes) == (again.truths, again.total_bytes)

    mtimes = {p: p.stat().st_mtime_ns for p in (tmp_path / "a").rglob("*")}
    assert make_coco(tmp_path / "a", 6, seed=4, crowd=0.5) == first
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "a").rglob("*")} == mtimes  # nothing rewritten

    # Other arguments regenerate, and drop the files of images the new set lacks.
    other = make_coco(tmp_path / "a", 3, seed=5)
    assert sorted(os.listdir(other.images)) == [f"{i:012d}.jpg" for i in (1, 2, 3)]
    assert files_of(tmp_path / "a") != files


def test_png_rectangles_are_exact_and_apart(tmp_path: Path) -> None:
    coco = make_coco(tmp_path, 10, image_format="png", boxes=(3, 6), width=(80, 120), height=(80, 120), min_side=8)
    assert all(p.endswith(".png") for p in os.listdir(coco.images))
    assert len(all_boxes(coco)) >= 25
    for i in coco.image_ids:
        img, truth = pixels(coco, i), coco.truth(i)
        owner = np.full((truth.height, truth.width), -1)
        for k, (x1, y1, x2, y2, category_id, _) in enumerate(truth.boxes):
            assert 0 <= x1 and x2 <= truth.width and 0 <= y1 and y2 <= truth.height
            assert x2 - x1 >= 8 and y2 - y1 >= 8
            assert (img[y1:y2, x1:x2] == coco.colours[category_id]).all()
            assert (owner[y1:y2, x1:x2] == -1).all()
            owner[y1:y2, x1:x2] = k
        for k, (x1, y1, x2, y2, *_) in enumerate(truth.boxes):
            # GAP pixels around a rectangle hold background, whatever is drawn over it.
            near = owner[max(0, y1 - GAP) : y2 + GAP, max(0, x1 - GAP) : x2 + GAP]
            assert set(np.unique(near)) <= {-1, k}


def test_jpeg_rectangles_have_their_colour_on_average(tmp_path: Path) -> None:
    coco = make_coco(tmp_path, 12, boxes=(2, 5), categories=tuple(range(1, len(CATEGORY_COLOURS) + 1)))
    assert len(all_boxes(coco)) >= 24
    for i in coco.image_ids:
        img = pixels(coco, i)
        for x1, y1, x2, y2, category_id, _ in coco.truth(i).boxes:
            mean = img[y1:y2, x1:x2].reshape(-1, 3).mean(axis=0)
            assert np.abs(mean - coco.colours[category_id]).max() < 5, (i, category_id, mean)


@needs_photos
def test_photo_backgrounds(tmp_path: Path) -> None:
    coco = make_coco(tmp_path, 4, photos_dir=PHOTOS, boxes=(1, 3), image_format="png")
    for i in coco.image_ids:
        img = pixels(coco, i)
        for x1, y1, x2, y2, category_id, _ in coco.truth(i).boxes:
            assert (img[y1:y2, x1:x2] == coco.colours[category_id]).all()
    info = json.loads(Path(coco.annotations).read_text())["info"]["arguments"]
    assert info["photos"] and str(PHOTOS) not in json.dumps(info)  # contents, not a path


def test_crowd_and_empty_images(tmp_path: Path) -> None:
    plain = make_coco(tmp_path / "plain", 8, boxes=(1, 4))
    crowd = make_coco(tmp_path / "crowd", 8, boxes=(1, 4), crowd=1.0)
    assert all_boxes(crowd) and all(b[5] == 1 for b in all_boxes(crowd))
    assert [b[:5] for b in all_boxes(crowd)] == [b[:5] for b in all_boxes(plain)]  # the flags only
    doc = json.loads(Path(crowd.annotations).read_text())
    assert all(a["iscrowd"] == 1 for a in doc["annotations"])

    empty = make_coco(tmp_path / "empty", 5, boxes=(0, 0), split="val2017")
    assert empty.annotations.endswith(os.path.join("annotations", "instances_val2017.json"))
    assert all_boxes(empty) == [] and json.loads(Path(empty.annotations).read_text())["annotations"] == []
    assert len(os.listdir(empty.images)) == 5


def test_shards_hold_every_sample_in_id_order(tmp_path: Path) -> None:
    coco = make_coco(tmp_path / "ds", 7, boxes=(0, 3), image_format="png")
    paths = write_shards(coco, tmp_path / "shards", per_shard=3)
    assert [os.path.basename(p) for p in paths] == [f"shard-{k:06d}.tar" for k in range(3)]
    names, samples = [], {}
    for path in paths:
        with tarfile.open(path) as tar:
            for member in tar.getmembers():
                names.append(member.name)
                data = tar.extractfile(member).read()
                key, ext = member.name.split(".")
                samples.setdefault(key, {})[ext] = data
    keys = [f"{i:012d}" for i in coco.image_ids]
    assert names == [f"{k}.{ext}" for k in keys for ext in ("png", "json")]
    for image_id, key in zip(coco.image_ids, keys):
        assert samples[key]["png"] == Path(coco.path(image_id)).read_bytes()
        meta = json.loads(samples[key]["json"])
        truth = coco.truth(image_id)
        assert (meta["image_id"], meta["width"], meta["height"]) == (image_id, truth.width, truth.height)
        boxes = [(*a["bbox"], a["category_id"], a["iscrowd"]) for a in meta["annotations"]]
        assert boxes == [(x1, y1, x2 - x1, y2 - y1, c, k) for x1, y1, x2, y2, c, k in truth.boxes]
        with Image.open(io.BytesIO(samples[key]["png"])) as im:
            assert im.size == (truth.width, truth.height)

    # Deterministic bytes; a smaller rerun drops the shards it no longer writes.
    first = [Path(p).read_bytes() for p in paths]
    assert [Path(p).read_bytes() for p in write_shards(coco, tmp_path / "shards", per_shard=3)] == first
    assert write_shards(coco, tmp_path / "shards", per_shard=50) == [str(tmp_path / "shards" / "shard-000000.tar")]
    assert os.listdir(tmp_path / "shards") == ["shard-000000.tar"]


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"num_images": 0}, ValueError, "num_images must be >= 1, got 0"),
        ({"seed": -1}, ValueError, "seed must be >= 0, got -1"),
        ({"width": (50, 40)}, ValueError, "width must be a (min, max) pair with 1 <= min <= max, got (50, 40)"),
        ({"boxes": 3}, ValueError, "boxes must be a (min, max) pair with 0 <= min <= max, got 3"),
        ({"categories": (1, 1)}, ValueError, "categories must be 1 to 8 distinct ids >= 1, got (1, 1)"),
        ({"image_format": "gif"}, ValueError, "image_format must be 'jpg' or 'png', got 'gif'"),
        ({"crowd": 1.5}, ValueError, "crowd must be a probability between 0 and 1, got 1.5"),
        ({"split": "../x"}, ValueError, "split must be a folder name such as 'train' or 'val2017', got '../x'"),
        ({"quality": 0}, ValueError, "quality must be between 1 and 100, got 0"),
        ({"min_side": 0}, ValueError, "min_side must be >= 1, got 0"),
        ({"seed": 1.5}, TypeError, "seed must be an integer, got 1.5"),
    ],
)
def test_bad_arguments_are_refused(tmp_path: Path, kwargs: dict, error: type, message: str) -> None:
    args = {"root": tmp_path, "num_images": 2} | kwargs
    with pytest.raises(error) as e:
        make_coco(**args)
    assert str(e.value) == message
    assert not os.listdir(tmp_path)


def test_bad_shard_size_is_refused(tmp_path: Path) -> None:
    coco = make_coco(tmp_path / "ds", 1)
    with pytest.raises(ValueError, match=r"per_shard must be >= 1, got 0"):
        write_shards(coco, tmp_path / "shards", per_shard=0)
