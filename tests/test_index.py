"""The index follows torchvision ImageFolder's rules, is saved, reused and rebuilt when the tree changes."""

import os
from pathlib import Path

import numpy as np
import pytest

import coordl.index
from coordl.index import IMG_EXTENSIONS, Index


def reference_imagefolder(root):
    """torchvision's documented rules, written independently: classes are the sorted
    sub-folders; samples walk each class folder (os.walk, following links) in sorted
    order, files sorted, kept if their lower-cased name ends with an image extension."""
    classes = sorted(e.name for e in os.scandir(root) if e.is_dir())
    samples = []
    for label, cls in enumerate(classes):
        for dirpath, _, files in sorted(os.walk(os.path.join(root, cls), followlinks=True)):
            for f in sorted(files):
                if f.lower().endswith(IMG_EXTENSIONS):
                    samples.append((os.path.join(dirpath, f), label))
    return classes, samples


def test_scan_matches_imagefolder_rules(dataset_copy):
    root = dataset_copy
    (root / "class_01" / "nested" / "deeper").mkdir(parents=True)
    (root / "class_01" / "nested" / "deeper" / "x.JPEG").write_bytes((root / "class_00" / "img_0000.jpg").read_bytes())
    (root / "class_01" / "nested" / "a.png").write_bytes(b"not checked at scan time")
    (root / "class_02" / "notes.txt").write_text("ignored")
    (root / "class_03" / "B.Jpg").write_bytes(b"12345")
    (root / "loose.jpg").write_bytes(b"files in the root are not samples")
    classes, samples = reference_imagefolder(root)
    index = Index.scan(root)
    assert list(index.classes) == classes
    assert list(zip(index.paths, index.labels.tolist(), strict=True)) == samples
    assert index.sizes.tolist() == [os.path.getsize(p) for p, _ in samples]
    assert index.total_bytes == sum(index.sizes.tolist())


def test_saved_index_is_reused_without_listing_the_tree(dataset_copy, monkeypatch):
    first = Index.scan(dataset_copy)
    assert list(Path(os.environ["COORDL_INDEX_DIR"]).glob("index-*.npz"))

    def no_scan(*a, **k):
        raise AssertionError("the tree was listed again")

    monkeypatch.setattr(coordl.index, "_scan", no_scan)
    again = Index.scan(dataset_copy)
    assert again.fingerprint == first.fingerprint and again.paths == first.paths


def test_changed_tree_is_rescanned(dataset_copy):
    first = Index.scan(dataset_copy)
    extra = dataset_copy / "class_02" / "zzz_new.jpg"
    extra.write_bytes((dataset_copy / "class_00" / "img_0000.jpg").read_bytes())
    second = Index.scan(dataset_copy)
    assert str(extra) in second.paths and len(second) == len(first) + 1
    assert second.fingerprint != first.fingerprint
    (dataset_copy / "class_99").mkdir()
    (dataset_copy / "class_99" / "a.jpg").write_bytes(b"x")
    third = Index.scan(dataset_copy)
    assert third.classes[-1] == "class_99"


def test_clear_errors_name_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "missing")):
        Index.scan(tmp_path / "missing")
    (tmp_path / "flat").mkdir()
    (tmp_path / "flat" / "a.jpg").write_bytes(b"x")
    with pytest.raises(FileNotFoundError, match="no class folders"):
        Index.scan(tmp_path / "flat")
    (tmp_path / "t" / "good").mkdir(parents=True)
    (tmp_path / "t" / "good" / "a.jpg").write_bytes(b"x")
    (tmp_path / "t" / "empty").mkdir()
    (tmp_path / "t" / "textonly").mkdir()
    (tmp_path / "t" / "textonly" / "readme.txt").write_text("x")
    with pytest.raises(FileNotFoundError, match="empty, textonly"):
        Index.scan(tmp_path / "t")
    os.symlink(tmp_path / "nowhere.jpg", tmp_path / "t" / "good" / "broken.jpg")
    (tmp_path / "t" / "empty" / "a.jpg").write_bytes(b"x")
    (tmp_path / "t" / "textonly" / "a.jpg").write_bytes(b"x")
    with pytest.raises(FileNotFoundError, match="broken.jpg"):
        Index.scan(tmp_path / "t")


def test_from_list_keeps_order_and_checks_input(tiny_dataset, tmp_path):
    classes, samples = reference_imagefolder(tiny_dataset)
    pairs = list(reversed(samples[:10]))
    index = Index.from_list(pairs)
    assert list(index.paths) == [p for p, _ in pairs]
    assert index.labels.tolist() == [lab for _, lab in pairs]
    with pytest.raises(FileNotFoundError, match="nope.jpg"):
        Index.from_list([(tmp_path / "nope.jpg", 0)])
    with pytest.raises(ValueError, match="non-negative int"):
        Index.from_list([(samples[0][0], -1)])
    with pytest.raises(ValueError, match="empty"):
        Index.from_list([])
    with pytest.raises(ValueError, match="pairs"):
        Index.from_list(["just-a-path.jpg"])


def test_fingerprint_depends_on_content_not_on_object():
    a = Index.build(["/a", "/b"], [0, 1], [10, 20])
    assert a.fingerprint == Index.build(["/a", "/b"], np.array([0, 1]), [10, 20]).fingerprint
    assert a.fingerprint != Index.build(["/a", "/b"], [0, 1], [10, 21]).fingerprint
    assert a.fingerprint != Index.build(["/b", "/a"], [0, 1], [10, 20]).fingerprint
