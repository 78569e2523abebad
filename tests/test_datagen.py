"""Tests for coordl.tools.datagen: deterministic ImageNet-like dataset generation."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from PIL import Image

from coordl.tools.datagen import DatasetSummary, dataset, make_dataset, workers

PHOTOS = Path(__file__).resolve().parents[2] / "shared" / "photos"
needs_photos = pytest.mark.skipif(not PHOTOS.is_dir(), reason=f"{PHOTOS} not found")


def files_of(root: Path) -> dict[str, bytes]:
    """Map each file's path relative to root to its bytes."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def recount(root: Path) -> tuple[int, int, int, int]:
    """Return (files, classes, total bytes, total pixels) counted on disk."""
    classes = [d for d in root.iterdir() if d.is_dir()]
    files = [f for d in classes for f in d.iterdir()]
    pixels = 0
    for f in files:
        with Image.open(f) as im:
            pixels += im.width * im.height
    return len(files), len(classes), sum(f.stat().st_size for f in files), pixels


def test_tree_shape(tmp_path: Path) -> None:
    root = tmp_path / "ds"
    make_dataset(root, num_images=23, num_classes=4, seed=3, progress=False)

    names = sorted(d.name for d in root.iterdir())
    assert names == ["n00000000", "n00000001", "n00000002", "n00000003"]
    assert all((root / n).is_dir() for n in names)
    counts = {n: len(list((root / n).iterdir())) for n in names}
    assert counts == {"n00000000": 6, "n00000001": 6, "n00000002": 6, "n00000003": 5}
    for i in range(23):
        cls = f"n{i % 4:08d}"
        path = root / cls / f"{cls}_{i:06d}.JPEG"
        assert path.is_file()
        with Image.open(path) as im:
            assert im.format == "JPEG"
            assert im.mode == "RGB"
            w, h = im.size
        assert 0.85 * 400 - 1 <= w <= 1.15 * 400 + 1
        assert 0.85 * 350 - 1 <= h <= 1.15 * 350 + 1


def test_sizes_vary_and_options(tmp_path: Path) -> None:
    root = tmp_path / "ds"
    make_dataset(root, num_images=12, num_classes=1, size=(64, 48), quality=75, ext=".jpg", progress=False)
    files = sorted((root / "n00000000").iterdir())
    assert [f.name for f in files] == [f"n00000000_{i:06d}.jpg" for i in range(12)]
    sizes = set()
    for f in files:
        with Image.open(f) as im:
            im.load()  # full decode: the file is a complete JPEG
            sizes.add(im.size)
            assert 54 <= im.width <= 74 and 40 <= im.height <= 56
    assert len(sizes) > 6  # jittered independently per image


def test_deterministic(tmp_path: Path) -> None:
    a = make_dataset(tmp_path / "a", num_images=8, num_classes=2, seed=7, progress=False)
    b = make_dataset(tmp_path / "b", num_images=8, num_classes=2, seed=7, progress=False)
    c = make_dataset(tmp_path / "c", num_images=8, num_classes=2, seed=8, progress=False)
    fa, fb, fc = (files_of(tmp_path / n) for n in "abc")
    assert fa == fb
    assert (a.total_bytes, a.bytes_per_pixel) == (b.total_bytes, b.bytes_per_pixel)
    assert fa.keys() == fc.keys()
    assert all(fa[k] != fc[k] for k in fa)
    assert c.total_bytes != a.total_bytes


def test_parallel_matches_sequential(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(workers, "cpu_count", lambda: 1)
    seq = make_dataset(tmp_path / "seq", num_images=20, num_classes=3, progress=False)
    monkeypatch.setattr(workers, "cpu_count", lambda: 2)
    monkeypatch.setattr(workers, "PARALLEL_MIN_IMAGES", 1)
    par = make_dataset(tmp_path / "par", num_images=20, num_classes=3, progress=False)
    assert files_of(tmp_path / "seq") == files_of(tmp_path / "par")
    assert (seq.total_bytes, seq.bytes_per_pixel) == (par.total_bytes, par.bytes_per_pixel)


def test_second_call_is_a_noop(tmp_path: Path) -> None:
    root = tmp_path / "ds"
    first = make_dataset(root, num_images=10, num_classes=3, progress=False)
    before = {p: p.stat().st_mtime_ns for p in root.rglob("*")}
    second = make_dataset(root, num_images=10, num_classes=3, progress=False)
    assert second == first
    assert {p: p.stat().st_mtime_ns for p in root.rglob("*")} == before


def test_resumes_interrupted_run(tmp_path: Path) -> None:
    ref = tmp_path / "ref"
    make_dataset(ref, num_images=10, num_classes=2, progress=False)
    root = tmp_path / "ds"
    make_dataset(root, num_images=10, num_classes=2, progress=False)
    missing = root / "n00000001" / "n00000001_000005.JPEG"
    missing.unlink()
    stale = root / "n00000001" / "n00000001_000005.JPEG.12345.tmp"
    stale.write_bytes(b"\xff\xd8 truncated")
    make_dataset(root, num_images=10, num_classes=2, progress=False)
    assert not stale.exists()
    assert files_of(root) == files_of(ref)


def test_growing_the_dataset_keeps_existing_files(tmp_path: Path) -> None:
    root = tmp_path / "ds"
    make_dataset(root, num_images=6, num_classes=3, progress=False)
    summary = make_dataset(root, num_images=9, num_classes=3, progress=False)
    assert summary.files == 9
    make_dataset(tmp_path / "ref", num_images=9, num_classes=3, progress=False)
    assert files_of(root) == files_of(tmp_path / "ref")


def test_refuses_foreign_root(tmp_path: Path) -> None:
    root = tmp_path / "ds"
    root.mkdir()
    (root / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="not empty") as err:
        make_dataset(root, num_images=4, num_classes=2, progress=False)
    assert str(root) in str(err.value)
    assert sorted(p.name for p in root.iterdir()) == ["notes.txt"]


def test_refuses_other_arguments_in_root(tmp_path: Path) -> None:
    root = tmp_path / "ds"
    make_dataset(root, num_images=6, num_classes=2, seed=0, progress=False)
    before = files_of(root)
    with pytest.raises(ValueError, match=re.escape(str(root))):
        make_dataset(root, num_images=6, num_classes=2, seed=1, progress=False)
    with pytest.raises(ValueError, match=re.escape(str(root))):
        make_dataset(root, num_images=6, num_classes=2, quality=80, progress=False)
    with pytest.raises(ValueError, match=re.escape(str(root))):
        make_dataset(root, num_images=4, num_classes=2, progress=False)  # 2 extra files
    with pytest.raises(ValueError, match=re.escape(str(root))):
        make_dataset(root, num_images=6, num_classes=3, progress=False)
    (root / "n00000000" / "n00000000_000000.JPEG").write_bytes(b"not a jpeg")
    with pytest.raises(ValueError, match="n00000000_000000"):
        make_dataset(root, num_images=6, num_classes=2, seed=0, progress=False)
    assert files_of(root).keys() == before.keys()


def test_root_is_a_file(tmp_path: Path) -> None:
    path = tmp_path / "file"
    path.write_text("x")
    with pytest.raises(ValueError, match=re.escape(str(path))):
        make_dataset(path, num_images=1, num_classes=1, progress=False)


def test_empty_existing_root_is_used(tmp_path: Path) -> None:
    root = tmp_path / "empty"
    root.mkdir()
    summary = make_dataset(root, num_images=2, num_classes=1, progress=False)
    assert summary.files == 2


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_images": 0}, "num_images"),
        ({"num_images": 5, "num_classes": 0}, "num_classes"),
        ({"num_images": 3, "num_classes": 4}, "num_classes must be <= num_images"),
        ({"num_images": 1, "num_classes": 1, "quality": 0}, "quality"),
        ({"num_images": 1, "num_classes": 1, "grain": -1.0}, "grain"),
        ({"num_images": 1, "num_classes": 1, "seed": -1}, "seed"),
        ({"num_images": 1, "num_classes": 1, "ext": "JPEG"}, "ext"),
        ({"num_images": 1, "num_classes": 1, "size": (4, 300)}, "size"),
    ],
)
def test_bad_arguments(tmp_path: Path, kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make_dataset(tmp_path / "ds", progress=False, **kwargs)
    assert not (tmp_path / "ds").exists()


def test_bad_photos_dir(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        make_dataset(tmp_path / "ds", num_images=1, num_classes=1, photos_dir=tmp_path / "nope", progress=False)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no photographs"):
        make_dataset(tmp_path / "ds", num_images=1, num_classes=1, photos_dir=tmp_path / "empty", progress=False)


def test_summary_matches_disk(tmp_path: Path) -> None:
    root = tmp_path / "ds"
    summary = make_dataset(root, num_images=15, num_classes=4, progress=False)
    files, classes, total_bytes, pixels = recount(root)
    assert summary.root == str(root.resolve())
    assert (summary.files, summary.classes, summary.total_bytes) == (files, classes, total_bytes)
    assert summary.mean_bytes == pytest.approx(total_bytes / files)
    assert summary.bytes_per_pixel == pytest.approx(total_bytes / pixels)


def test_summary_str() -> None:
    s = DatasetSummary(
        root="/data/x", files=2000, classes=10, total_bytes=221_400_000, mean_bytes=110_700.0, bytes_per_pixel=0.79
    )
    assert str(s) == ("2000 files in 10 classes, 221.4 MB, mean 110.7 KB, 0.79 bytes/pixel at /data/x")


def test_progress_goes_to_stderr(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    make_dataset(tmp_path / "ds", num_images=3, num_classes=1, progress=True)
    out, err = capsys.readouterr()
    assert out == ""
    assert "3/3" in err
    make_dataset(tmp_path / "ds2", num_images=3, num_classes=1, progress=False)
    assert capsys.readouterr() == ("", "")


def test_synthetic_bytes_per_pixel(tmp_path: Path) -> None:
    root = tmp_path / "ds"
    summary = make_dataset(root, num_images=40, progress=False)
    assert 0.5 <= summary.bytes_per_pixel <= 1.2, str(summary)
    files, classes, total_bytes, pixels = recount(root)
    assert summary.bytes_per_pixel == pytest.approx(total_bytes / pixels)


@needs_photos
def test_photos_bytes_per_pixel(tmp_path: Path) -> None:
    root = tmp_path / "ds"
    summary = make_dataset(root, num_images=40, photos_dir=PHOTOS, progress=False)
    assert 0.5 <= summary.bytes_per_pixel <= 1.2, str(summary)
    assert (summary.files, summary.classes) == (40, 10)
    files, classes, total_bytes, pixels = recount(root)
    assert summary.total_bytes == total_bytes
    assert summary.bytes_per_pixel == pytest.approx(total_bytes / pixels)


@needs_photos
def test_photos_deterministic_and_distinct_from_synthetic(tmp_path: Path) -> None:
    make_dataset(tmp_path / "a", num_images=4, num_classes=2, photos_dir=PHOTOS, grain=10, progress=False)
    make_dataset(tmp_path / "b", num_images=4, num_classes=2, photos_dir=PHOTOS, grain=10, progress=False)
    make_dataset(tmp_path / "c", num_images=4, num_classes=2, grain=10, progress=False)
    fa, fb, fc = (files_of(tmp_path / n) for n in "abc")
    assert fa == fb
    assert all(fa[k] != fc[k] for k in fa)
    # A photo-mode folder is not mistaken for the synthetic dataset of the same name.
    with pytest.raises(ValueError):
        make_dataset(tmp_path / "a", num_images=4, num_classes=2, grain=10, progress=False)


# --------------------------------------------------------------------------
# total_bytes: a dataset of a requested size

SMALL = {"size": (64, 56), "progress": False}  # ~4 KB per image


def sizes_by_index(root: Path) -> dict[int, int]:
    """Map each image's index (from its file name) to its size in bytes."""
    found = {}
    for f in root.rglob("*"):
        if f.is_file():
            found[int(f.stem.rsplit("_", 1)[1])] = f.stat().st_size
    return found


def stats_of(root: Path) -> dict[Path, tuple[int, int]]:
    """Map every path under root to its (inode, mtime_ns)."""
    return {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in root.rglob("*")}


def test_total_bytes_reaches_target_with_fewest_images(tmp_path: Path) -> None:
    target = 300_000
    root = tmp_path / "ds"
    summary = make_dataset(root, total_bytes=target, num_classes=3, **SMALL)
    sizes = sizes_by_index(root)
    n = summary.files
    assert sorted(sizes) == list(range(n))  # images 0..n-1, nothing past them
    assert sum(sizes.values()) >= target
    assert sum(sizes[i] for i in range(n - 1)) < target  # n - 1 images would not do
    files, classes, total_bytes, pixels = recount(root)
    assert (summary.files, summary.classes, summary.total_bytes) == (files, classes, total_bytes)
    assert summary.mean_bytes == pytest.approx(total_bytes / files)
    assert summary.bytes_per_pixel == pytest.approx(total_bytes / pixels)
    # The same images as asking for n of them.
    make_dataset(tmp_path / "ref", num_images=n, num_classes=3, **SMALL)
    assert files_of(root) == files_of(tmp_path / "ref")


def test_total_bytes_deterministic_whatever_the_rounds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = 250_000
    a = make_dataset(tmp_path / "a", total_bytes=target, num_classes=4, seed=5, **SMALL)
    # Many small rounds with no margin, written by a pool of workers.
    monkeypatch.setattr(dataset, "FIRST_ROUND", 3)
    monkeypatch.setattr(dataset, "ROUND_MARGIN", -0.5)
    monkeypatch.setattr(workers, "cpu_count", lambda: 2)
    monkeypatch.setattr(workers, "PARALLEL_MIN_IMAGES", 1)
    rounds = []
    generate = workers.generate
    monkeypatch.setattr(workers, "generate", lambda *args: rounds.append(1) or generate(*args))
    b = make_dataset(tmp_path / "b", total_bytes=target, num_classes=4, seed=5, **SMALL)
    assert len(rounds) > 3
    assert a == DatasetSummary(**{**b.__dict__, "root": a.root})
    assert files_of(tmp_path / "a") == files_of(tmp_path / "b")
    c = make_dataset(tmp_path / "c", total_bytes=target, num_classes=4, seed=6, **SMALL)
    assert files_of(tmp_path / "c") != files_of(tmp_path / "a")
    assert c.total_bytes >= target


def test_total_bytes_second_call_is_a_noop(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "ds"
    first = make_dataset(root, total_bytes=120_000, num_classes=3, **SMALL)
    before = stats_of(root)
    monkeypatch.setattr(workers, "generate", lambda *args: pytest.fail("generated again"))
    second = make_dataset(root, total_bytes=120_000, num_classes=3, **SMALL)
    assert second == first
    assert stats_of(root) == before


def test_total_bytes_trims_overshoot(tmp_path: Path) -> None:
    # The first round (64 images) overshoots a small target: the extra files go.
    root = tmp_path / "ds"
    summary = make_dataset(root, total_bytes=50_000, num_classes=2, **SMALL)
    assert 2 <= summary.files < dataset.FIRST_ROUND
    assert sorted(sizes_by_index(root)) == list(range(summary.files))
    # Files of a larger dataset of the same arguments are trimmed too; the rest are kept.
    big = tmp_path / "big"
    make_dataset(big, num_images=40, num_classes=2, **SMALL)
    before = stats_of(big)
    trimmed = make_dataset(big, total_bytes=50_000, num_classes=2, **SMALL)
    assert trimmed == DatasetSummary(**{**summary.__dict__, "root": str(big)})
    assert files_of(big) == files_of(root)
    after = stats_of(big)
    assert all(after[p] == before[p] for p in after if p.is_file())  # kept files untouched


def test_total_bytes_grows_an_existing_dataset(tmp_path: Path) -> None:
    root = tmp_path / "ds"
    make_dataset(root, num_images=10, num_classes=2, **SMALL)
    before = stats_of(root)
    summary = make_dataset(root, total_bytes=150_000, num_classes=2, **SMALL)
    assert summary.files > 10 and summary.total_bytes >= 150_000
    after = stats_of(root)
    assert all(after[p] == before[p] for p in before if p.is_file())
    make_dataset(tmp_path / "ref", total_bytes=150_000, num_classes=2, **SMALL)
    assert files_of(root) == files_of(tmp_path / "ref")


def test_total_bytes_refuses_other_arguments_in_root(tmp_path: Path) -> None:
    root = tmp_path / "ds"
    make_dataset(root, num_images=6, num_classes=2, seed=0, **SMALL)
    before = stats_of(root)
    with pytest.raises(ValueError, match="not empty"):
        make_dataset(root, total_bytes=50_000, num_classes=2, seed=1, **SMALL)
    with pytest.raises(ValueError, match="not empty"):
        make_dataset(root, total_bytes=50_000, num_classes=3, seed=0, **SMALL)
    assert stats_of(root) == before


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({}, "exactly one of num_images and total_bytes"),
        ({"num_images": 5, "total_bytes": 10_000}, "exactly one of num_images and total_bytes"),
        ({"total_bytes": 0}, "total_bytes must be >= 1"),
        ({"total_bytes": 10_000, "num_classes": 0}, "num_classes"),
        ({"total_bytes": 10_000, "quality": 101}, "quality"),
    ],
)
def test_total_bytes_bad_arguments(tmp_path: Path, kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make_dataset(tmp_path / "ds", progress=False, **kwargs)
    assert not (tmp_path / "ds").exists()


def test_total_bytes_must_be_an_integer(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="total_bytes"):
        make_dataset(tmp_path / "ds", total_bytes=1e6, progress=False)  # type: ignore[arg-type]
    assert not (tmp_path / "ds").exists()


def test_total_bytes_too_small_for_the_classes(tmp_path: Path) -> None:
    # One ~4 KB image already exceeds 1000 bytes: 1 image < 5 classes.
    root = tmp_path / "ds"
    with pytest.raises(ValueError, match=r"reached with 1 image, fewer than num_classes=5"):
        make_dataset(root, total_bytes=1000, num_classes=5, **SMALL)
    assert not root.exists()  # what the call wrote is gone
    # In an existing dataset, the files that were there are left alone.
    make_dataset(root, num_images=5, num_classes=5, **SMALL)
    before = stats_of(root)
    with pytest.raises(ValueError, match="fewer than num_classes=5"):
        make_dataset(root, total_bytes=1000, num_classes=5, **SMALL)
    assert stats_of(root) == before


def test_total_bytes_progress_in_bytes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    make_dataset(tmp_path / "ds", total_bytes=30_000, num_classes=1, size=(64, 56), progress=True)
    out, err = capsys.readouterr()
    assert out == ""
    assert "make_dataset" in err and "100%" in err and "30.0k/30.0k" in err
    make_dataset(tmp_path / "ds", total_bytes=30_000, num_classes=1, size=(64, 56), progress=True)
    assert capsys.readouterr() == ("", "")  # nothing to do: no bar
