"""The loaders the benchmark compares, and the child process that runs one of them.

Every loader runs the same ImageNet training augmentation (random-resized crop to 224 with
scale 0.08-1 and aspect 3/4-4/3, horizontal flip, normalise, CHW float32) with the same
batch size and the same number of CPU workers/threads:

``torch``
    ``torch.utils.data.DataLoader`` over an ImageFolder-style dataset that opens each file by
    path; Pillow (or Pillow-SIMD when installed) decodes in ``workers`` worker processes and
    :class:`TrainAugment` augments; shuffled by ``RandomSampler``, persistent workers.
``dali-shuffle``
    ``fn.readers.file(random_shuffle=True)``: DALI shuffles the file list once (a fixed
    seed) and samples from a 1024-sample buffer, so every epoch reads the files in the
    same random order.
``dali-seq``
    ``fn.readers.file()`` with its default sequential reading (files in sorted order). The
    file reader has no buffer-only shuffle: samples arrive in file order, which changes
    nothing for I/O and throughput but would not do for training.
``dali-epoch-shuffle``
    ``fn.readers.file(shuffle_after_epoch=True)``: a fresh permutation every epoch, the
    access pattern of PyTorch's sampler.
``coordl``
    ``coordl.CoordLoader`` with its MinIO cache at the given budget.
``coordl-auto``
    ``coordl`` with ``decoded_cache="auto"``: the same budget, split between encoded bytes and
    decoded images as the model predicts is fastest.
``coordl-torch``
    ``coordl.CoordLoader`` over ``coordl.datasets.ImageFolder(data, transform=TrainAugment())``:
    coordl's torch backend, whose ``DataLoader`` workers read the bytes through the MinIO cache
    (at the given budget), decode them with Pillow and run the same :class:`TrainAugment` as
    ``torch``; ``workers`` worker processes, persistent workers.

Run as a module (``python -m benchmarks.loaders``), this is the child the runner
(``benchmarks.run``) starts in a memory and blkio cgroup, with ``--data`` the dataset the
runner made. It builds the loader, runs a few warm-up batches (imports, worker processes, DALI's
buffers), prints ``{"ready": ...}``, waits for ``go`` on stdin (the runner then drops the
page cache, sets the memory limit and the throttle), finishes epoch 0 and runs the other
epochs, printing one JSON line per epoch. Epoch 0 is therefore short of the warm-up
batches; it is reported as the cold epoch, not used for steady-state figures.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import sys
import threading
import time

import numpy as np

from benchmarks.harness import measure
from benchmarks.harness.jobs import say

LOADERS = ("torch", "dali-shuffle", "dali-seq", "dali-epoch-shuffle", "coordl", "coordl-auto", "coordl-torch")
COORDL_LOADERS = ("coordl", "coordl-auto", "coordl-torch")  # the loaders with a MinIO cache in shared memory
# Loaders that measure the storage when they are made: the runner throttles them from their start.
MEASURE_WHEN_MADE = ("coordl-auto",)
MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)
SIZE = 224


# -- torch: DataLoader + Pillow ---------------------------------------------------------------
def image_folder(root: str):
    """The dataset's files and labels in torchvision ImageFolder's order (coordl's scan follows
    ImageFolder's rules, checked against them in tests/test_index.py); not saved anywhere."""
    from coordl.index import Index

    return Index.scan(root, index_dir="")


def random_resized_crop(width: int, height: int, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3)) -> tuple[int, int, int, int]:
    """torchvision's ``RandomResizedCrop.get_params``: (left, top, w, h) of the crop."""
    area = width * height
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target = area * random.uniform(*scale)
        aspect = math.exp(random.uniform(*log_ratio))
        w = round(math.sqrt(target * aspect))
        h = round(math.sqrt(target / aspect))
        if 0 < w <= width and 0 < h <= height:
            return random.randint(0, width - w), random.randint(0, height - h), w, h
    # fallback: the whole image, centre-cropped to the ratio range
    aspect = width / height
    if aspect < ratio[0]:
        w, h = width, round(width / ratio[0])
    elif aspect > ratio[1]:
        h, w = height, round(height * ratio[1])
    else:
        w, h = width, height
    return (width - w) // 2, (height - h) // 2, w, h


class TrainAugment:
    """The Pillow loaders' training augmentation of an RGB ``PIL.Image``: random-resized crop
    resized to 224 (bilinear, one ``resize`` with a box), horizontal flip with probability 0.5,
    CHW float32, normalised. ``torch`` and ``coordl-torch`` both run it, so they do the same
    work per sample; a module-level class, so a ``DataLoader`` can pickle it for its workers."""

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
    """An ImageFolder-style dataset that opens each file by path: Pillow decode to RGB (as
    torchvision's ``pil_loader`` and coordl's ``pil_decode`` do), then ``transform``."""

    def __init__(self, root: str, transform):
        index = image_folder(root)
        self.samples = list(zip(index.paths, index.labels.tolist()))
        self.transform = transform

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int):
        from PIL import Image

        path, label = self.samples[i]
        with Image.open(path) as im:
            image = im.convert("RGB")
        return self.transform(image), label


def dataloader(dataset, batch_size: int, workers: int, seed: int, **kw):
    """The DataLoader every Pillow baseline uses: shuffled (seeded), persistent workers."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    return torch.utils.data.DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=True,
        num_workers=workers,
        persistent_workers=workers > 0,
        generator=generator,
        **kw,
    )


class TorchLoader:
    def __init__(self, data: str, batch_size: int, workers: int, seed: int):
        self.dataset = PillowImageFolder(data, TrainAugment())
        self.loader = dataloader(self.dataset, batch_size, workers, seed)

    def __len__(self) -> int:
        return len(self.dataset)

    def epoch(self):
        for images, _ in self.loader:
            yield images

    def counters(self) -> dict | None:
        return None

    def close(self) -> None:
        del self.loader


# -- DALI's own file reader ---------------------------------------------------------------------
def dali_imagenet_train(jpegs, size: int = SIZE):
    """``imagenet-train``'s ops in DALI, for the DALI baselines: a random-area crop decoded, resized
    to ``size``, flipped with probability 0.5, normalised to CHW float."""
    from nvidia.dali import fn, types

    images = fn.decoders.image_random_crop(
        jpegs, device="cpu", output_type=types.RGB, random_area=[0.08, 1.0], random_aspect_ratio=[3 / 4, 4 / 3]
    )
    images = fn.resize(images, resize_x=size, resize_y=size)
    mirror = fn.random.coin_flip(probability=0.5)
    mean, std = [m * 255 for m in MEAN], [s * 255 for s in STD]
    return fn.crop_mirror_normalize(images, dtype=types.FLOAT, output_layout="CHW", mirror=mirror, mean=mean, std=std)


class DaliLoader:
    READERS = {
        "dali-shuffle": {"random_shuffle": True},
        "dali-seq": {},
        "dali-epoch-shuffle": {"shuffle_after_epoch": True},
    }

    def __init__(self, kind: str, data: str, batch_size: int, workers: int, seed: int):
        from nvidia.dali import fn, pipeline_def
        from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy

        reader = self.READERS[kind]

        @pipeline_def(batch_size=batch_size, num_threads=workers, device_id=None, seed=seed, prefetch_queue_depth=2)
        def pipe():
            jpegs, labels = fn.readers.file(file_root=data, name="Reader", **reader)
            return dali_imagenet_train(jpegs), labels

        p = pipe()
        p.build()
        self.n = p.reader_meta("Reader")["epoch_size"]
        self.it = DALIGenericIterator(
            p, ["images", "labels"], reader_name="Reader", last_batch_policy=LastBatchPolicy.PARTIAL, auto_reset=True
        )

    def __len__(self) -> int:
        return self.n

    def epoch(self):
        for batch in self.it:
            yield batch[0]["images"]

    def counters(self) -> dict | None:
        return None

    def close(self) -> None:
        del self.it


# -- coordl -------------------------------------------------------------------------------------
class CoordlLoader:
    def __init__(self, data: str, batch_size: int, workers: int, seed: int, cache_bytes: int, decoded_cache=0):
        import coordl

        self.loader = coordl.CoordLoader(
            data,
            batch_size=batch_size,
            device_id=None,
            seed=seed,
            cache=coordl.Cache(size=cache_bytes, decoded=decoded_cache),
            prep=workers,
            shuffle=True,
            pipeline="imagenet-train",
        )

    def __len__(self) -> int:
        return len(self.loader.index)

    def epoch(self):
        for images, _ in self.loader:
            yield images

    def counters(self) -> dict | None:
        s = self.loader.stats()
        keys = (
            "cache_hits",
            "storage_reads",
            "storage_bytes",
            "cache_bytes",
            "cache_items",
            "cache_budget",
            "stall_s",
            "fetch_wait_s",
            "decoded_hits",
            "decoded_cache_budget",
        )
        return {k: s[k] for k in keys}

    def close(self) -> None:
        self.loader.close()


class CoordlTorchLoader(CoordlLoader):
    """coordl's torch backend: ``CoordLoader`` over coordl's ``ImageFolder`` with :class:`TrainAugment`."""

    def __init__(self, data: str, batch_size: int, workers: int, seed: int, cache_bytes: int):
        import coordl
        from coordl.datasets import ImageFolder

        dataset = ImageFolder(data, transform=TrainAugment())
        self.loader = coordl.CoordLoader(
            dataset,
            batch_size=batch_size,
            num_workers=workers,
            persistent_workers=workers > 0,
            seed=seed,
            cache=cache_bytes,
            shuffle=True,
        )


def make(kind: str, data: str, batch_size: int, workers: int, seed: int, cache_bytes: int):
    """A loader of ``kind`` (one of ``LOADERS``); ``cache_bytes`` is the budget of the coordl loaders' cache."""
    if kind == "torch":
        return TorchLoader(data, batch_size, workers, seed)
    if kind in DaliLoader.READERS:
        return DaliLoader(kind, data, batch_size, workers, seed)
    if kind == "coordl":
        return CoordlLoader(data, batch_size, workers, seed, cache_bytes)
    if kind == "coordl-auto":  # the same budget, split between encoded bytes and decoded images by the model
        return CoordlLoader(data, batch_size, workers, seed, cache_bytes, decoded_cache="auto")
    if kind == "coordl-torch":
        return CoordlTorchLoader(data, batch_size, workers, seed, cache_bytes)
    raise ValueError(f"unknown loader {kind!r}; choose from {', '.join(LOADERS)}")


# -- the child process --------------------------------------------------------------------------
class MemoryMeter:
    """Memory of this process's v1 memory cgroup during an epoch: the kernel's peak
    (``max_usage_in_bytes``, reset per epoch) and, sampled every 0.1 s from ``memory.stat``,
    the mean usage and the mean unmapped file page cache (what the page-cache loaders hold
    of the dataset; libraries are mapped). Without
    a cgroup: the peak resident set of this process and its children (``ru_maxrss``)."""

    def __init__(self, cgroup: str | None):
        self.cgroup = cgroup
        self.samples: list[tuple[int, int]] = []
        self._stop = threading.Event()
        self._thread = None

    def _stat(self) -> tuple[int, int]:
        with open(os.path.join(self.cgroup, "memory.stat")) as f:
            stat = dict(line.split() for line in f)
        cache, rss = int(stat["total_cache"]), int(stat["total_rss"])
        unmapped = cache - int(stat["total_shmem"]) - int(stat["total_mapped_file"])
        return rss + cache, max(0, unmapped)

    def _sample(self) -> None:
        while not self._stop.wait(0.1):
            self.samples.append(self._stat())

    def start(self) -> None:
        if not self.cgroup:
            return
        with open(os.path.join(self.cgroup, "memory.max_usage_in_bytes"), "w") as f:
            f.write("0")
        self.samples = []
        self._stop.clear()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def stop(self) -> dict:
        if not self.cgroup:
            import resource

            kb = (
                resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
                + resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
            )
            return {"peak_memory_bytes": kb * 1024, "peak_memory_kind": "rss"}
        self._stop.set()
        self._thread.join()
        samples = self.samples or [self._stat()]
        with open(os.path.join(self.cgroup, "memory.max_usage_in_bytes")) as f:
            peak = int(f.read())
        return {
            "peak_memory_bytes": peak,
            "peak_memory_kind": "cgroup",
            "mean_memory_bytes": sum(u for u, _ in samples) // len(samples),
            "mean_file_cache_bytes": sum(c for _, c in samples) // len(samples),
        }


def child(args) -> int:
    dev = tuple(int(x) for x in args.device.split(":"))
    memory = MemoryMeter(args.memcg)
    t_build = time.perf_counter()
    loader = make(args.loader, args.data, args.batch_size, args.workers, args.seed, args.cache_bytes)
    epoch = loader.epoch()
    samples = 0
    for _ in range(args.warmup_batches):
        samples += next(epoch).shape[0]
    extra = loader.counters() or {}
    say(
        ready=True,
        build_s=round(time.perf_counter() - t_build, 2),
        warmup_samples=samples,
        cache_bytes=extra.get("cache_bytes", 0),
    )
    if sys.stdin.readline().strip() != "go":
        loader.close()
        return 1
    for e in range(args.epochs):
        if e:
            epoch, samples = loader.epoch(), 0
        memory.start()
        before = measure.sectors_read(dev)
        wait = 0.0
        t0 = time.perf_counter()
        while True:
            t = time.perf_counter()
            try:
                images = next(epoch)
            except StopIteration:
                break
            wait += time.perf_counter() - t
            samples += images.shape[0]
            if args.compute_ms:
                time.sleep(args.compute_ms / 1000)
        seconds = time.perf_counter() - t0
        disk = measure.sectors_read(dev) - before
        row = {
            "epoch": e,
            "seconds": round(seconds, 3),
            "samples": samples,
            "samples_per_s": round(samples / seconds, 1),
            "device_bytes": disk,
            "wait_s": round(wait, 3),
            **memory.stop(),
        }
        counters = loader.counters()
        if counters is not None:
            row["counters"] = counters  # epoch 0's include the warm-up batches
        say(**row)
    loader.close()
    say(done=True)
    return 0


def main() -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.loaders",
        description="one benchmark loader in a child process (started by benchmarks.run)",
    )
    p.add_argument("--loader", choices=LOADERS, required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cache-bytes", type=int, default=0)
    p.add_argument("--compute-ms", type=float, default=0.0)
    p.add_argument("--warmup-batches", type=int, default=3)
    p.add_argument("--device", required=True, help="MAJ:MIN of the dataset's block device")
    p.add_argument("--memcg", help="this process's v1 memory cgroup folder, for per-epoch peaks")
    return child(p.parse_args())


if __name__ == "__main__":
    sys.exit(main())
