"""examples/detection/: train.py generates a COCO set, trains TinySSD on it with coordl's SSD
recipes, prints one line per epoch, and its loss falls; the box arithmetic it rests on (SSD's
matching, offsets, NMS, AP) is checked on hand-made boxes.

The script runs as users run it, in a process of its own, which inherits the test's private shm
folder (``COORDL_SHM_DIR``): it must leave nothing there.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "detection"
EPOCH = re.compile(r"^epoch (\d+)/(\d+): train loss ([\d.]+) \(box [\d.]+, class [\d.]+\), (\d+) batches, .*$", re.M)


def test_train_generates_the_data_prints_every_epoch_and_its_loss_falls(tmp_path):
    data = tmp_path / "coco"
    args = ["--data", str(data), "--images", "96", "--val-images", "32", "--epochs", "4", "--size", "96"]
    p = subprocess.run(
        [sys.executable, str(EXAMPLE / "train.py"), *args, "--threads", "2", "--seed", "1"],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    out = p.stdout
    for split, n in (("train", 96), ("val", 32)):
        assert len(list((data / split).glob("*.jpg"))) == n
        assert (data / "annotations" / f"instances_{split}.json").is_file()
    assert "=> TinySSD" in out and "4 classes (red, green, blue, yellow)" in out, out
    assert "96 training images, 32 validation images at 96x96" in out, out
    epochs = EPOCH.findall(out)
    assert [(int(e), int(n), int(b)) for e, n, _, b in epochs] == [(e, 4, 6) for e in range(1, 5)], out
    lines = EPOCH.finditer(out)
    for line in lines:  # the loader's stall split and the validation metrics, on every line
        text = line.group(0)
        assert re.search(r"waited for data [\d.]+ s \(\d+%\): fetch [\d.]+ s, prep [\d.]+ s", text), text
        assert re.search(r"\| val loss [\d.]+, mAP@0\.5 [\d.]+, recall@0\.5 [\d.]+ \(32 images, \d+ boxes\)", text), (
            text
        )
    losses = [float(loss) for _, _, loss, _ in epochs]
    assert losses[-1] < losses[0], out
    assert "left out" not in out, out


def test_a_generated_set_is_used_again_and_a_foreign_one_left_as_it_is(tmp_path):
    """make_coco's train set (same size) is found, not made again; a val set that make_coco did not
    make (its JSON has no ``info``, as a hand-made one) is used as it is, although ``--val-images``
    asks for another size: the script never rewrites or deletes a dataset it did not generate."""
    from coordl.tools.datagen.coco import make_coco

    data = tmp_path / "coco"
    train = make_coco(data, 32, seed=0, split="train")
    val = make_coco(data, 16, seed=1, split="val")
    doc = json.loads(Path(val.annotations).read_text())
    del doc["info"]
    Path(val.annotations).write_text(json.dumps(doc))
    stamps = {p: p.stat().st_mtime_ns for p in (Path(train.annotations), Path(val.annotations))}
    args = ["--data", str(data), "--images", "32", "--val-images", "8", "--epochs", "1", "--size", "64", "-b", "8"]
    p = subprocess.run([sys.executable, str(EXAMPLE / "train.py"), *args], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "=> made" not in p.stdout and "32 training images, 16 validation images" in p.stdout, p.stdout
    assert len(EPOCH.findall(p.stdout)) == 1 and "(16 images, " in p.stdout, p.stdout
    assert {p: p.stat().st_mtime_ns for p in stamps} == stamps
    assert len(list((data / "val").glob("*.jpg"))) == 16


def test_the_torchvision_models_need_torchvision(tmp_path):
    """Without torchvision (as in this repository's test environment) the script says what is
    missing before it makes any data; with it, SSDLite trains on the same loaders for an epoch."""
    data = tmp_path / "coco"
    cmd = [sys.executable, str(EXAMPLE / "train.py"), "--data", str(data)]
    if importlib.util.find_spec("torchvision") is None:
        p = subprocess.run([*cmd, "--model", "torchvision"], capture_output=True, text=True, timeout=60)
        assert p.returncode == 2 and "--model torchvision needs torchvision" in p.stderr, p.stderr
        assert not data.exists()
        return
    small = ["--images", "16", "--val-images", "8", "--epochs", "1", "-b", "8", "--size", "64"]
    p = subprocess.run([*cmd, "--model", "torchvision-ssdlite", *small], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "torchvision's SSD" in p.stdout and len(EPOCH.findall(p.stdout)) == 1, p.stdout
    assert "| val mAP@0.5 " in p.stdout, p.stdout  # torchvision's models give no loss in eval mode


@pytest.fixture(scope="module")
def example():
    """The example's modules (boxes, model, metrics), imported from its folder as train.py does."""
    names = ("boxes", "model", "metrics")
    saved = {n: sys.modules.pop(n) for n in names if n in sys.modules}
    sys.path.insert(0, str(EXAMPLE))
    try:
        yield {n: importlib.import_module(n) for n in names}
    finally:
        sys.path.remove(str(EXAMPLE))
        for n in names:
            sys.modules.pop(n, None)
        sys.modules.update(saved)


def test_offsets_decode_to_the_boxes_they_encode(example):
    b = example["boxes"]
    defaults = torch.tensor([[0.0, 0.0, 10.0, 10.0], [20.0, 30.0, 60.0, 50.0]])
    boxes = torch.tensor([[1.0, 2.0, 9.0, 13.0], [25.0, 28.0, 70.0, 44.0]])
    offsets = b.encode(boxes, defaults)
    assert torch.allclose(b.decode(offsets, defaults), boxes, atol=1e-4)
    # The variances: a box 1/10 of its default box's width to the right is an offset of 1.
    moved = b.encode(torch.tensor([[1.0, 0.0, 11.0, 10.0]]), defaults[:1])
    assert torch.allclose(moved, torch.tensor([[1.0, 0.0, 0.0, 0.0]]), atol=1e-6)


def test_match_gives_every_box_a_default_box_and_the_rest_by_iou(example):
    b = example["boxes"]
    defaults = torch.tensor([[0.0, 0, 10, 10], [0, 0, 12, 10], [50, 50, 60, 60], [100, 100, 110, 110]])
    boxes = torch.tensor([[0.0, 0, 11, 10], [52, 50, 70, 62]])  # the second overlaps its best by IoU 0.34
    matched, classes = b.match(defaults, boxes, torch.tensor([3, 1]))
    assert classes.tolist() == [3, 3, 1, 0]
    assert torch.equal(matched[:3], boxes[[0, 0, 1]]) and torch.equal(matched[3], defaults[3])
    matched, classes = b.match(defaults, torch.zeros(0, 4), torch.zeros(0, dtype=torch.int64))
    assert classes.tolist() == [0, 0, 0, 0] and torch.equal(matched, defaults)


def test_nms_keeps_the_best_of_each_overlapping_group(example):
    b = example["boxes"]
    boxes = torch.tensor([[0.0, 0, 10, 10], [1, 0, 11, 10], [20, 20, 30, 30], [0, 1, 10, 11], [21, 20, 31, 30]])
    scores = torch.tensor([0.5, 0.9, 0.3, 0.8, 0.4])
    assert b.nms(boxes, scores, 0.5).tolist() == [1, 4]
    assert b.nms(boxes, scores, 0.99).tolist() == [1, 3, 0, 4, 2]
    assert b.nms(torch.zeros(0, 4), torch.zeros(0), 0.5).tolist() == []


def test_the_loss_of_a_batch_with_and_without_boxes(example):
    m = example["model"]
    torch.manual_seed(0)
    net = m.TinySSD(num_classes=2, size=64)
    criterion = m.SSDLoss(net.defaults)
    scores, offsets = net(torch.randn(2, 3, 64, 64))
    assert scores.shape == (2, len(net.defaults), 3) and offsets.shape == (2, len(net.defaults), 4)
    boxes = [torch.tensor([[4.0, 6.0, 30.0, 40.0]]), torch.zeros(0, 4)]
    goal = criterion.targets(boxes, [torch.tensor([2]), torch.zeros(0, dtype=torch.int64)])
    positives = int((goal[1] > 0).sum())
    assert positives >= 1 and (goal[1][1] == 0).all()
    loss, box, cls = criterion(scores, offsets, *goal)
    assert torch.isfinite(loss) and loss > 0 and torch.isclose(loss, box + cls)
    loss.backward()  # and an image without boxes adds nothing: no positives, no mined negatives
    empty = criterion.targets([torch.zeros(0, 4)] * 2, [torch.zeros(0, dtype=torch.int64)] * 2)
    assert float(criterion(scores.detach(), offsets.detach(), *empty)[0]) == 0.0
    detections = m.detect(scores.detach(), offsets.detach(), net.defaults)
    assert len(detections) == 2 and all(d["boxes"].shape[1:] == (4,) for d in detections)


def test_average_precision_of_perfect_and_of_missing_detections(example):
    metrics = example["metrics"]
    truth = {"boxes": torch.tensor([[0.0, 0, 10, 10], [20, 20, 40, 40]]), "labels": torch.tensor([1, 2])}
    perfect = {"boxes": truth["boxes"], "scores": torch.tensor([0.9, 0.8]), "labels": truth["labels"]}
    found = metrics.Detections(num_classes=2)
    found.add([perfect], [truth])
    assert found.summary() == {"map50": 1.0, "recall50": 1.0, "boxes": 2, "images": 1}
    half = {"boxes": truth["boxes"], "scores": torch.tensor([0.9, 0.8]), "labels": torch.tensor([1, 1])}
    found = metrics.Detections(num_classes=2)
    found.add([half], [truth])
    s = found.summary()
    assert s["recall50"] == 0.5 and s["map50"] == 0.5  # class 1 found (AP 1), class 2 missed (AP 0)
