"""The loaders the benchmarks compare (:class:`Loader`), on the CPU or delivering to a GPU, the model they train,
an epoch timed. Every loader runs the same ImageNet training augmentation, batch size and CPU workers
(docs/benchmarks.md): ``torch`` (``DataLoader``, Pillow, :class:`TrainAugment`), DALI's file reader in three orders
and :mod:`benchmarks.gpu`'s ``dali`` (decoded whole, ``mixed`` on a GPU), ``coordl`` (on a GPU: decoding there),
``coordl-auto`` (``decoded="auto"``), ``coordl-cpu`` (batches copied to the GPU) and ``coordl-torch``.
"""

import math
import random
import runpy
from pathlib import Path

import numpy as np

from benchmarks.harness import measure

LOADERS = ("torch", "dali-shuffle", "dali-seq", "dali-epoch-shuffle", "coordl", "coordl-auto", "coordl-torch")
COORDL_LOADERS = ("coordl", "coordl-auto", "coordl-torch")  # the loaders with a MinIO cache in shared memory
MEASURE_WHEN_MADE = ("coordl-auto",)  # they measure the storage when made: the runner throttles them from the start
MEAN, STD, SIZE = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225), 224
SHUFFLE = {"random_shuffle": True}  # DALI's file reader's orders:
DALI_READERS = {"dali-shuffle": SHUFFLE, "dali-seq": {}, "dali-epoch-shuffle": {"shuffle_after_epoch": True}}
DALI_READERS["dali"] = SHUFFLE
COUNTERS = "cache_hits storage_reads storage_bytes cache_bytes cache_items cache_budget stall_s fetch_wait_s"
COUNTERS = (*COUNTERS.split(), "decoded_hits", "decoded_cache_budget")
MODELS = Path(__file__).resolve().parents[1] / "examples" / "imagenet" / "models.py"


def random_resized_crop(width: int, height: int, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3)) -> tuple[int, int, int, int]:
    """torchvision's ``RandomResizedCrop.get_params``: (left, top, w, h) of the crop."""
    area, log_ratio = width * height, (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target, aspect = area * random.uniform(*scale), math.exp(random.uniform(*log_ratio))
        w, h = round(math.sqrt(target * aspect)), round(math.sqrt(target / aspect))
        if 0 < w <= width and 0 < h <= height:
            return random.randint(0, width - w), random.randint(0, height - h), w, h
    # fallback: the whole image, centre-cropped to the ratio range
    w, h = min(width, round(height * ratio[1])), min(height, round(width / ratio[0]))
    return (width - w) // 2, (height - h) // 2, w, h


class TrainAugment:
    """The Pillow loaders' training augmentation of an RGB ``PIL.Image``: random-resized crop resized to 224
    (bilinear, one ``resize`` with a box), horizontal flip with probability 0.5, CHW float32, normalised; the
    same work per sample in ``torch`` and ``coordl-torch``, and a class that a ``DataLoader`` can pickle."""

    def __call__(self, im):
        import torch
        from PIL import Image

        x, y, w, h = random_resized_crop(*im.size)
        im = im.resize((SIZE, SIZE), Image.BILINEAR, box=(x, y, x + w, y + h))
        if random.random() < 0.5:
            im = im.transpose(Image.FLIP_LEFT_RIGHT)
        t = torch.from_numpy(np.array(im, dtype=np.uint8)).permute(2, 0, 1).float().div_(255)
        return t.sub_(torch.tensor(MEAN).view(3, 1, 1)).div_(torch.tensor(STD).view(3, 1, 1))


class PillowImageFolder:
    """An ImageFolder-style dataset that opens each file by path, Pillow decodes it to RGB, then ``transform``."""

    def __init__(self, root: str, transform):
        from coordl.index import Index  # coordl's scan, in torchvision ImageFolder's order, not saved anywhere

        index = Index.scan(root, index_dir="")
        self.samples = list(zip(index.paths, index.labels.tolist()))
        self.transform = transform

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int):
        from PIL import Image

        path, label = self.samples[i]
        with Image.open(path) as im:
            return self.transform(im.convert("RGB")), label


def dataloader(dataset, batch_size: int, workers: int, seed: int, **kw):
    """The DataLoader every Pillow baseline uses: shuffled (seeded), persistent workers."""
    import torch

    kw |= {"num_workers": workers, "persistent_workers": workers > 0, "generator": torch.Generator().manual_seed(seed)}
    return torch.utils.data.DataLoader(dataset, batch_size, shuffle=True, **kw)


def dali_iterator(pipe, names=("images", "labels"), reader: str | None = "Reader"):
    """The pipeline built, and its torch iterator: the last batch partial, reset at each epoch's end."""
    from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy

    pipe.build()  # a second build() does nothing
    kw = {"reader_name": reader} if reader else {}
    return DALIGenericIterator(pipe, list(names), last_batch_policy=LastBatchPolicy.PARTIAL, auto_reset=True, **kw)


def dali_imagenet_train(jpegs, size: int = SIZE, decode: str | None = None):
    """``imagenet-train``'s ops in DALI: a random-area crop decoded (``decode``, "cpu" or "mixed": decoded whole
    there, then ``fn.random_resized_crop``), resized to ``size``, flipped with probability 0.5, CHW float normalised."""
    from nvidia.dali import fn, types

    crop = {"random_area": [0.08, 1.0], "random_aspect_ratio": [3 / 4, 4 / 3]}
    if decode is None:
        images = fn.decoders.image_random_crop(jpegs, device="cpu", output_type=types.RGB, **crop)
        images = fn.resize(images, resize_x=size, resize_y=size)
    else:
        images = fn.decoders.image(jpegs, device=decode, output_type=types.RGB)
        images = fn.random_resized_crop(images, size=[size, size], **crop)
    mirror = fn.random.coin_flip(probability=0.5)
    mean, std = [m * 255 for m in MEAN], [s * 255 for s in STD]
    return fn.crop_mirror_normalize(images, dtype=types.FLOAT, output_layout="CHW", mirror=mirror, mean=mean, std=std)


class Loader:
    """Loader ``kind`` (of :data:`LOADERS`, or ``dali`` / ``coordl-cpu``) over the folder ``data``: ``n``,
    ``batches(epoch)`` (``(images, labels)`` on GPU ``device_id``; None: on the CPU), ``counters()`` (coordl's,
    else None) and ``close()``. ``cache_bytes`` is the coordl loaders' cache budget (None: coordl's default)."""

    def __init__(self, kind, data, batch_size, workers, seed, cache_bytes=None, device_id: int | None = None):
        self.kind, self.device_id, gpu = kind, device_id, device_id is not None
        if kind == "torch":
            self.n = len(dataset := PillowImageFolder(data, TrainAugment()))
            self.loader = dataloader(dataset, batch_size, workers, seed, pin_memory=gpu)
        elif kind in DALI_READERS:
            from nvidia.dali import fn, pipeline_def

            decode = ("mixed" if gpu else "cpu") if kind == "dali" else None

            @pipeline_def(batch_size=batch_size, num_threads=workers, device_id=device_id, seed=seed)
            def pipe():
                jpegs, labels = fn.readers.file(file_root=data, name="Reader", **DALI_READERS[kind])
                return dali_imagenet_train(jpegs, decode=decode), labels.gpu() if gpu else labels

            self.loader = dali_iterator(p := pipe())
            self.n = p.reader_meta("Reader")["epoch_size"]
        elif kind in ("coordl", "coordl-auto", "coordl-cpu", "coordl-torch"):
            import coordl  # not in the baselines' children: their memory is theirs alone

            kw = {"seed": seed, "shuffle": True, "batch_size": batch_size}
            if cache_bytes is not None:  # coordl-auto: the budget split by the model
                kw["cache"] = coordl.Cache(size=cache_bytes, decoded="auto" if kind == "coordl-auto" else 0)
            if kind == "coordl-torch":
                from coordl.datasets import ImageFolder

                kw |= {"num_workers": workers, "persistent_workers": workers > 0}
                self.loader = coordl.CoordLoader(ImageFolder(data, transform=TrainAugment()), **kw)
            else:
                kw |= {"device_id": device_id if kind == "coordl" else None, "prep": workers}
                self.loader = coordl.CoordLoader(data, pipeline="imagenet-train", **kw)
            self.n = len(self.loader.index)
        else:
            raise ValueError(f"unknown loader {kind!r}; choose from {', '.join(LOADERS)}, dali, coordl-cpu")

    def batches(self, epoch: int | None = None):
        """One epoch's ``(images, labels)`` (coordl's set to ``epoch`` first, when given), on the GPU if any."""
        if epoch is not None and self.kind.startswith("coordl"):
            self.loader.set_epoch(epoch)
        dali = self.kind in DALI_READERS
        for batch in self.loader:
            images, labels = (batch[0]["images"], batch[0]["labels"].flatten().long()) if dali else batch
            if self.device_id is not None:
                to = {"device": f"cuda:{self.device_id}", "non_blocking": self.kind == "torch"}
                images, labels = (t if t.is_cuda else t.to(**to) for t in (images, labels))
            yield images, labels

    def counters(self) -> dict | None:
        stats = self.loader.stats() if self.kind.startswith("coordl") else None
        return stats and {k: stats[k] for k in COUNTERS}

    def close(self) -> None:
        if self.kind.startswith("coordl"):
            self.loader.close()
        del self.loader


def model(arch: str, classes: int):
    """``examples/imagenet/models.py``'s ``create``: ``(model, where it came from)`` (torchvision's or its plan)."""
    return runpy.run_path(str(MODELS))["create"](arch, classes)


def epoch_row(batches, dev: tuple[int, int], step=None, more: int = 0) -> dict:
    """One epoch of ``batches`` timed (:func:`measure.timed`; ``more`` samples, delivered before it, counted in):
    seconds, samples, samples/s, seconds waiting for batches, and the bytes the device ``dev`` delivered."""
    before, t = measure.sectors_read(dev), measure.timed(batches, step)
    n, s = t["samples"] + more, t["seconds"]
    row = {"seconds": round(s, 3), "samples": n, "samples_per_s": round(n / s, 1), "wait_s": round(t["wait_s"], 3)}
    return row | {"device_bytes": measure.sectors_read(dev) - before}
