"""The torch backend: coordl.datasets run by DataLoader workers that read through the node's cache.

The same guarantees as the DALI path (exactly-once, resume, cache sharing, storage bytes
after the first epoch, the bad-sample policy), with transforms written here, and
ImageFolder's classes, order and items checked against a reference written from
torchvision's documented rules.
"""

from __future__ import annotations

import io
import multiprocessing
import os
import signal
import wave

import numpy as np
import pytest
import torch
from PIL import Image

import coordl
from childproc import WAIT, report, result
from coordl import CoordLoader, SampleError
from coordl.datasets import DatasetFolder, FileDataset, ImageFolder
from test_loader import check_resume, flat

CTX = multiprocessing.get_context("spawn")
N = 120  # samples of the tiny dataset


def to_tensor(im: Image.Image) -> torch.Tensor:
    """A transform written here: fixed-size resize to a uint8 CHW tensor."""
    im = im.resize((16, 16), Image.BILINEAR)
    return torch.from_numpy(np.array(im, dtype=np.uint8)).permute(2, 0, 1)


def make(data, **kw):
    kw.setdefault("batch_size", 8)
    kw.setdefault("num_workers", 2)
    kw.setdefault("shuffle", True)
    kw.setdefault("return_index", True)
    if not isinstance(data, FileDataset):
        data = ImageFolder(data, transform=to_tensor)
    return CoordLoader(data, **kw)


def epoch_ids(loader):
    return [batch[2].tolist() for batch in loader]


# -- the reference: torchvision's ImageFolder, from its documentation -------------------------
REF_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


def reference_imagefolder(root, is_valid_file=None):
    """Classes are the sorted sub-folder names, indexed in that order; each class folder is
    walked with os.walk(followlinks=True), the walk sorted, the files of each folder sorted;
    a file counts if its lower-cased path ends with an image extension (or is_valid_file says
    so); an item is (pil_loader(path), class_index), pil_loader = Image.open(f).convert("RGB")."""
    classes = sorted(e.name for e in os.scandir(root) if e.is_dir())
    valid = is_valid_file or (lambda p: p.lower().endswith(REF_EXTENSIONS))
    samples = []
    for c in classes:
        for folder, _, files in sorted(os.walk(os.path.join(root, c), followlinks=True)):
            for f in sorted(files):
                path = os.path.join(folder, f)
                if valid(path):
                    samples.append((path, classes.index(c)))

    def item(i, transform=None, target_transform=None):
        path, target = samples[i]
        with open(path, "rb") as f:
            img = Image.open(f).convert("RGB")
        return (transform(img) if transform else img), (target_transform(target) if target_transform else target)

    return classes, samples, item


def test_imagefolder_matches_torchvision_rules(dataset_copy):
    root = dataset_copy
    (root / "class_01" / "nested" / "deeper").mkdir(parents=True)
    (root / "class_01" / "nested" / "deeper" / "x.JPEG").write_bytes((root / "class_00" / "img_0000.jpg").read_bytes())
    Image.new("L", (20, 10), 128).save(root / "class_01" / "nested" / "grey.png")  # becomes RGB
    (root / "class_02" / "notes.txt").write_text("ignored")
    (root / "loose.jpg").write_bytes(b"files in the root are not samples")
    classes, samples, item = reference_imagefolder(root)
    ds = ImageFolder(root)
    assert ds.classes == classes and ds.class_to_idx == {c: i for i, c in enumerate(classes)}
    assert ds.samples == samples and ds.imgs == samples and ds.targets == [t for _, t in samples]
    assert len(ds) == len(samples) == N + 2
    for i in [0, 37, len(ds) - 1] + [k for k, (p, _) in enumerate(samples) if "nested" in p]:
        img, target = ds[i]
        ref, ref_target = item(i)
        assert img.mode == "RGB" and target == ref_target
        assert np.array_equal(np.asarray(img), np.asarray(ref))
    double = ImageFolder(root, transform=to_tensor, target_transform=lambda t: t * 2)
    x, t = double[-1]
    rx, rt = item(len(ds) - 1, to_tensor, lambda t: t * 2)
    assert torch.equal(x, rx) and t == rt


def test_imagefolder_is_valid_file_allow_empty_and_errors(dataset_copy):
    only_even = lambda p: p.endswith(".jpg") and int(p[-8:-4]) % 2 == 0  # noqa: E731
    _, samples, _ = reference_imagefolder(dataset_copy, only_even)
    assert ImageFolder(dataset_copy, is_valid_file=only_even).samples == samples
    (dataset_copy / "class_99").mkdir()
    with pytest.raises(FileNotFoundError, match="class_99"):
        ImageFolder(dataset_copy)
    ds = ImageFolder(dataset_copy, allow_empty=True)
    assert ds.classes[-1] == "class_99" and len(ds) == N
    with pytest.raises(ValueError, match="Both extensions and is_valid_file"):
        DatasetFolder(dataset_copy, loader=lambda f: f.read())
    with pytest.raises(IndexError):
        ds[N]


def test_loader_batches_equal_the_reference_items_in_order(tiny_dataset):
    _, samples, item = reference_imagefolder(tiny_dataset)
    with make(tiny_dataset, shuffle=False, cache=0.5) as loader:
        assert len(loader) == N // 8
        got = list(loader)
    for k, (images, labels, ids) in enumerate(got):
        assert ids.tolist() == list(range(8 * k, 8 * k + 8))
        ref = [item(i, to_tensor) for i in ids.tolist()]
        assert torch.equal(images, torch.stack([x for x, _ in ref]))
        assert labels.dtype == torch.int64 and labels.tolist() == [t for _, t in ref]


@pytest.mark.parametrize("workers", [0, 2])
def test_every_epoch_is_exactly_once_in_a_fresh_order_like_the_dali_path(tiny_dataset, workers):
    with make(tiny_dataset, num_workers=workers, persistent_workers=workers > 0, cache=0.5) as loader:
        orders = [flat(epoch_ids(loader)) for _ in range(3)]
    assert all(sorted(o) == list(range(N)) for o in orders)
    assert len({tuple(o) for o in orders}) == 3
    dali = CoordLoader(
        tiny_dataset,
        batch_size=8,
        pipeline=coordl.ImageNetVal(size=16),
        device_id=None,
        return_index=True,
        cache=0,
        prep=1,
        shuffle=True,
    )
    with dali:
        assert [flat(epoch_ids(dali)) for _ in range(3)] == orders  # one sampler for both backends


def test_spawned_workers_attach_to_the_cache_themselves(tiny_dataset):
    with make(tiny_dataset, multiprocessing_context="spawn", persistent_workers=True, cache=1.0) as loader:
        for _ in range(2):
            assert sorted(flat(epoch_ids(loader))) == list(range(N))
        assert loader.stats()["cache_hits"] == N and loader.stats()["storage_reads"] == 0


@pytest.mark.parametrize("drop_last", [False, True])
def test_three_ranks_cover_the_dataset(tiny_dataset, drop_last):
    per_rank = []
    for rank in range(3):
        with make(
            tiny_dataset,
            drop_last=drop_last,
            batch_size=7,
            cache=0,
            shard=coordl.Shard(rank=rank, world_size=3, pad=not drop_last),
        ) as loader:
            per_rank.append(flat(epoch_ids(loader)))
    everything = sorted(i for ids in per_rank for i in ids)
    assert len({len(ids) for ids in per_rank}) == 1
    if drop_last:
        assert len(set(everything)) == len(everything) and len(everything) == 3 * ((N // 3) // 7 * 7)
    else:
        assert everything == list(range(N))  # 120 = 3 x 40: no padding needed


RESUME_CONFIGS = {
    "shuffle": dict(cache=0.3),
    "persistent-workers": dict(persistent_workers=True, cache=0.3),
    "in-process": dict(num_workers=0, shuffle=False, cache=0),
    "drop-last": dict(drop_last=True, batch_size=7, cache=0.3),
    "rank-1-of-3": dict(batch_size=5, cache=0.3, shard=coordl.Shard(rank=1, world_size=3)),
}


@pytest.mark.parametrize("config", sorted(RESUME_CONFIGS))
@pytest.mark.parametrize("stop_after", [0, 5])
def test_resume_mid_epoch_gives_exactly_the_remaining_batches(tiny_dataset, config, stop_after):
    check_resume(lambda: make(tiny_dataset, **RESUME_CONFIGS[config]), epoch=2, stop_after=stop_after)


def test_later_epochs_read_exactly_the_uncached_items(tiny_dataset):
    total = ImageFolder(tiny_dataset).index.total_bytes
    with make(tiny_dataset, cache=0.5) as loader:
        before = loader.stats()
        epoch_ids(loader)
        first = loader.stats()
        assert set(before) == set(first) and before["samples"] == 0
        assert first["storage_reads"] == N and first["storage_bytes"] == total
        assert 0 < first["admitted"] == first["cache_items"] < N
        for _ in range(2):
            epoch_ids(loader)
            s = loader.stats()
            assert s["cache_hits"] == s["cache_items"] == first["cache_items"]
            assert s["storage_reads"] == N - s["cache_items"]
            assert s["storage_bytes"] == total - s["cache_bytes"]  # exactly dataset - cache
            assert s["admitted"] == 0 and s["samples"] == N
    with make(tiny_dataset, cache=1.0) as loader:
        epoch_ids(loader)
        epoch_ids(loader)
        assert loader.stats()["storage_reads"] == 0 and loader.stats()["cache_hits"] == N


def _second_job(root, q):
    def body():
        with make(root, cache=1.0) as loader:
            assert sorted(flat(epoch_ids(loader))) == list(range(N))
            return loader.stats()

    report(q, body)


def test_workers_and_other_jobs_share_one_cache(tiny_dataset, isolated):
    with make(tiny_dataset, cache=1.0) as first:
        epoch_ids(first)  # two workers fill the node's cache
        budget = first.stats()["cache_budget"]
        chunks = [e for e in os.listdir(isolated) if ".chunk." in e]
        assert sum(os.path.getsize(isolated / c) for c in chunks) <= budget  # one copy, not one per worker
        q = CTX.Queue()
        p = CTX.Process(target=_second_job, args=(str(tiny_dataset), q))  # not a daemon: it has workers
        p.start()
        try:
            other = result(q, timeout=60)
        finally:
            p.join(WAIT)
            if p.is_alive():
                p.kill()
                p.join()
    assert other["storage_reads"] == 0 and other["cache_hits"] == N  # another job's workers hit it


def test_collate_fn_worker_init_fn_and_custom_batches(tiny_dataset, tmp_path):
    def collate(items):
        return {"x": torch.stack([x for x, _ in items]), "y": [t for _, t in items]}

    def init(worker_id):
        (tmp_path / f"worker{worker_id}").write_text(str(torch.utils.data.get_worker_info().num_workers))

    with make(tiny_dataset, collate_fn=collate, worker_init_fn=init, return_index=False, cache=0) as loader:
        batches = list(loader)
    assert all(set(b) == {"x", "y"} and b["x"].shape == (8, 3, 16, 16) for b in batches)
    assert sorted((tmp_path / f"worker{k}").read_text() for k in range(2)) == ["2", "2"]
    with make(tiny_dataset, collate_fn=collate, cache=0) as loader:
        b, ids = next(iter(loader))  # return_index on a batch that is not a tuple: (batch, ids)
        assert len(ids) == 8 and b["y"] == loader.index.labels[ids.numpy()].tolist()


def test_random_transforms_follow_seed_and_epoch(tiny_dataset):
    def noisy(im):
        return to_tensor(im).float() + torch.rand(1)

    def run(seed, epochs=2):
        with make(ImageFolder(tiny_dataset, transform=noisy), seed=seed, shuffle=False, cache=0) as loader:
            return [torch.cat([b[0] for b in loader]) for _ in range(epochs)]

    a, b, c = run(0), run(0), run(1)
    assert all(torch.equal(x, y) for x, y in zip(a, b))  # a rerun augments alike
    assert not torch.equal(a[0], a[1]) and not torch.equal(a[0], c[0])  # fresh per epoch and per seed


def corrupt(root):
    victims = sorted((root / "class_01").iterdir())[:2]
    for v in victims:
        v.write_bytes(b"this is not an image" * 20)
    return [str(v) for v in victims]


def test_bad_samples_raise_with_their_path_or_are_skipped(dataset_copy, caplog):
    bad = corrupt(dataset_copy)
    with make(dataset_copy, cache=0) as loader:
        with pytest.raises(SampleError, match="cannot decode sample") as info:
            epoch_ids(loader)
        assert info.value.path in bad and info.value.path in str(info.value)
        assert any("In the worker" in n for n in info.value.__notes__)
    with make(dataset_copy, on_error="skip", cache=0.5) as loader:
        bad_ids = {loader.index.paths.index(p) for p in bad}
        for _ in range(2):
            assert sorted(flat(epoch_ids(loader))) == sorted(set(range(N)) - bad_ids)
            s = loader.stats()
            assert s["skipped"] == 2 and sorted(s["skipped_paths"]) == sorted(bad) and s["samples"] == N - 2
    warned = [r.getMessage() for r in caplog.records if "coordl: skipping sample" in r.getMessage()]
    assert len(warned) == 4 and all(any(p in w for p in bad) for w in warned)  # 2 per epoch, with the path


def test_missing_and_changed_files(dataset_copy):
    ds = ImageFolder(dataset_copy, transform=to_tensor)  # indexed before the files change
    victim, grown = ds.index.paths[5], ds.index.paths[7]
    os.unlink(victim)
    with make(ds, cache=0) as loader:
        with pytest.raises(SampleError, match=victim):
            epoch_ids(loader)
    with make(ds, on_error="skip", cache=0) as loader:
        assert sorted(flat(epoch_ids(loader))) == [i for i in range(N) if i != 5]
    with open(grown, "ab") as f:
        f.write(b"\0" * 10)
    with make(ds, on_error="skip", cache=0) as loader:
        with pytest.raises(coordl.DatasetChangedError, match="changed after it was indexed"):
            epoch_ids(loader)  # never skipped


def test_a_transform_error_is_the_users_and_propagates(tiny_dataset):
    def broken(im):
        raise ZeroDivisionError("my transform is wrong")

    with make(ImageFolder(tiny_dataset, transform=broken), on_error="skip", cache=0) as loader:
        with pytest.raises(ZeroDivisionError, match="my transform is wrong"):
            epoch_ids(loader)


def _kill_once(flag):
    def transform(im):
        if torch.utils.data.get_worker_info() is not None and not os.path.exists(flag):
            open(flag, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)  # a worker dies mid-batch, mid-read
        return to_tensor(im)

    return transform


def test_a_killed_worker_fails_the_pass_and_the_next_one_is_whole(tiny_dataset, tmp_path):
    ds = ImageFolder(tiny_dataset, transform=_kill_once(str(tmp_path / "killed")))
    with make(ds, cache=0.5) as loader:
        with pytest.raises(RuntimeError, match="killed by signal|exited unexpectedly"):
            epoch_ids(loader)
        assert sorted(flat(epoch_ids(loader))) == list(range(N))  # the epoch again, exactly once
        epoch_ids(loader)
        s = loader.stats()
        assert s["storage_reads"] == N - s["cache_items"] and s["cache_hits"] == s["cache_items"] > 0


def write_wav(path, samples: np.ndarray, rate=8000):
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(samples.astype("<i2").tobytes())


def decode_wav(f) -> torch.Tensor:
    with wave.open(f) as w:
        return torch.from_numpy(np.frombuffer(w.readframes(w.getnframes()), "<i2").astype(np.float32) / 32768)


def test_general_form_audio_files(tmp_path):
    rng = np.random.default_rng(0)
    files = []
    for k in range(20):
        d = tmp_path / "audio" / ("dog" if k % 2 else "cat")
        d.mkdir(parents=True, exist_ok=True)
        write_wav(d / f"{k:02d}.wav", rng.integers(-3000, 3000, 800))
        files.append((str(d / f"{k:02d}.wav"), k % 2))
    listed = FileDataset(files, decode_wav, transform=lambda x: x[:400])
    folder = DatasetFolder(tmp_path / "audio", loader=decode_wav, extensions=".wav", transform=lambda x: x[:400])
    assert folder.classes == ["cat", "dog"] and len(folder) == 20
    for ds in (listed, folder):
        with CoordLoader(ds, batch_size=4, num_workers=2, shuffle=False, cache=1.0) as loader:
            for _ in range(2):
                batches = list(loader)
            assert loader.stats()["cache_hits"] == 20 and loader.stats()["storage_reads"] == 0
        x = torch.cat([b[0] for b in batches])
        assert x.shape == (20, 400)
        ref = torch.stack([decode_wav(io.BytesIO(open(p, "rb").read()))[:400] for p, _ in ds.samples])
        assert torch.equal(x, ref)


def test_argument_errors(tiny_dataset):
    ds = ImageFolder(tiny_dataset, transform=to_tensor)
    with pytest.raises(ValueError, match="decides the order"):
        CoordLoader(ds, batch_size=2, sampler=[0, 1], shuffle=True)
    with pytest.raises(ValueError, match="worker_init_fn apply to the torch backend"):
        CoordLoader(tiny_dataset, batch_size=2, worker_init_fn=print, cache=0, shuffle=True)
    # collate_fn lays out DALI's batches too (tests/test_detection.py checks what it receives).
    with CoordLoader(tiny_dataset, batch_size=2, collate_fn=list, cache=0, pipeline="imagenet-val") as loader:
        batch = next(iter(loader))
    assert isinstance(batch, list) and len(batch) == 2 and batch[0][0].shape == (3, 224, 224)
    with pytest.raises(ValueError, match="hp_group"):
        CoordLoader(ds, batch_size=2, hp_group="g", shuffle=True)
    with pytest.raises(ValueError, match="pipeline"):
        CoordLoader(ds, batch_size=2, pipeline="imagenet-val", shuffle=True)
    with pytest.raises(ValueError, match="num_workers"):
        CoordLoader(ds, batch_size=2, num_workers=-1, shuffle=True)

    class Plain(torch.utils.data.Dataset):
        def __len__(self):
            return 1

        def __getitem__(self, i):
            return i

    with pytest.raises(TypeError, match="coordl.datasets.ImageFolder, DatasetFolder or FileDataset"):
        CoordLoader(Plain(), batch_size=2, shuffle=True, pipeline="imagenet-train")


def test_a_torchvision_imagefolder_is_read_through_coordl(tiny_dataset):
    def default_loader(path):  # stands in for torchvision.datasets.folder.default_loader
        raise AssertionError("coordl opens the files, not this loader")

    default_loader.__module__ = "torchvision.datasets.folder"
    ours = ImageFolder(tiny_dataset)
    TV = type("ImageFolder", (torch.utils.data.Dataset,), {"__module__": "torchvision.datasets.folder"})
    tv = TV()
    tv.root, tv.classes, tv.class_to_idx = str(tiny_dataset), ours.classes, ours.class_to_idx
    tv.samples, tv.loader, tv.transform, tv.target_transform = ours.samples, default_loader, to_tensor, None
    with CoordLoader(tv, batch_size=8, shuffle=False, num_workers=2, cache=0) as loader:
        images, labels = next(iter(loader))
    assert torch.equal(images, torch.stack([to_tensor(ours[i][0]) for i in range(8)]))


class CollateBroke(ValueError):
    """A ``collate_fn``'s own error (at module level, so that workers can send it back)."""


def _broken_collate(items):
    raise CollateBroke(f"cannot collate {len(items)} items")


def _first_error(loader) -> tuple[type, str]:
    """The type and message of the error ``loader``'s first batch raises; only those are kept, so
    that the iterator and its workers go when this returns."""
    error = None
    try:
        next(iter(loader))
    except Exception as e:  # noqa: BLE001 - any: the caller compares it
        error = type(e), str(e)
        e.__traceback__ = None  # its frames hold the iterator in a cycle: freed now, not by a gc much later
    assert error is not None, "the first batch raised nothing"
    return error


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_collate_fn_error_is_raised_as_dataloader_raises_it(tiny_dataset, num_workers):
    plain = torch.utils.data.DataLoader(
        ImageFolder(tiny_dataset, transform=to_tensor),
        batch_size=8,
        num_workers=num_workers,
        collate_fn=_broken_collate,
    )
    expected, _ = _first_error(plain)
    with make(tiny_dataset, num_workers=num_workers, collate_fn=_broken_collate, cache=0) as loader:
        raised, message = _first_error(loader)
    assert raised is expected, f"{raised.__name__} where DataLoader raises {expected.__name__}"
    assert "cannot collate 8 items" in message
    if num_workers:  # DataLoader names the worker and carries its traceback in the message
        assert "in DataLoader worker process" in message and "_broken_collate" in message
