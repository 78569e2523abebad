"""The loaders the benchmarks compare, and the child process that runs one of them.

Every loader runs the same ImageNet training augmentation (random-resized crop to 224, scale 0.08-1,
aspect 3/4-4/3, horizontal flip, normalise, CHW float32), batch size and CPU workers/threads:

- ``torch``: ``DataLoader`` over files opened by path, Pillow decode, :class:`TrainAugment`, shuffled,
  persistent workers;
- ``dali-shuffle``: ``fn.readers.file(random_shuffle=True)`` (a 1024-sample buffer over a file list
  shuffled once: every epoch reads in the same order); ``dali-seq``: its default sequential order (fine
  for I/O and throughput, not for training); ``dali-epoch-shuffle``: ``shuffle_after_epoch=True`` (a
  fresh permutation per epoch, PyTorch's sampler's access pattern);
- ``coordl``: ``CoordLoader`` with its MinIO cache at the budget; ``coordl-auto``: the same budget split
  between encoded bytes and decoded images by the model (``decoded_cache="auto"``); ``coordl-torch``:
  coordl's torch backend, ``ImageFolder(data, transform=TrainAugment())``, bytes through the cache.

Run as ``python -m benchmarks.loaders``, this is the child ``benchmarks.run`` starts in its cgroups: it
makes the loader, runs warm-up batches, prints ``{"ready": ...}``, waits for ``go`` on stdin (the runner
drops the page cache, sets the memory limit and throttle), then prints one JSON line per epoch. Epoch 0
(short of the warm-up batches) is the cold epoch, left out of the steady figures.
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

    kw |= {"num_workers": workers, "persistent_workers": workers > 0}
    return torch.utils.data.DataLoader(
        dataset, batch_size, shuffle=True, generator=torch.Generator().manual_seed(seed), **kw
    )


# -- DALI's own file reader ---------------------------------------------------------------------
def dali_iterator(pipe, names=("images", "labels"), reader: str | None = "Reader"):
    """The pipeline built, and its torch iterator: the last batch partial, reset at each epoch's end."""
    from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy

    pipe.build()  # a second build() does nothing
    kw = {"reader_name": reader} if reader else {}
    return DALIGenericIterator(pipe, list(names), last_batch_policy=LastBatchPolicy.PARTIAL, auto_reset=True, **kw)


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


DALI_READERS = {
    "dali-shuffle": {"random_shuffle": True},
    "dali-seq": {},
    "dali-epoch-shuffle": {"shuffle_after_epoch": True},
}
COUNTERS = (
    "cache_hits storage_reads storage_bytes cache_bytes cache_items cache_budget stall_s fetch_wait_s decoded_hits"
)
COUNTERS = (*COUNTERS.split(), "decoded_cache_budget")


class Loader:
    """One of ``LOADERS``: its size, ``epoch()`` (the batches' images), ``counters()`` (coordl's, else
    None) and ``close()``. ``cache_bytes`` is the budget of the coordl loaders' cache."""

    def __init__(self, kind: str, data: str, batch_size: int, workers: int, seed: int, cache_bytes: int = 0):
        self.kind = kind
        if kind in COORDL_LOADERS:
            import coordl  # not in the baselines' children: their memory is theirs alone
        if kind == "torch":
            self.n = len(dataset := PillowImageFolder(data, TrainAugment()))
            self.loader = dataloader(dataset, batch_size, workers, seed)
        elif kind in DALI_READERS:
            from nvidia.dali import fn, pipeline_def

            @pipeline_def(batch_size=batch_size, num_threads=workers, device_id=None, seed=seed, prefetch_queue_depth=2)
            def pipe():
                jpegs, labels = fn.readers.file(file_root=data, name="Reader", **DALI_READERS[kind])
                return dali_imagenet_train(jpegs), labels

            self.loader = dali_iterator(p := pipe())
            self.n = p.reader_meta("Reader")["epoch_size"]
        elif kind == "coordl-torch":
            from coordl.datasets import ImageFolder

            kw = {"num_workers": workers, "persistent_workers": workers > 0, "cache": cache_bytes}
            dataset = ImageFolder(data, transform=TrainAugment())
            self.loader = coordl.CoordLoader(dataset, batch_size=batch_size, seed=seed, shuffle=True, **kw)
        elif kind in COORDL_LOADERS:  # coordl-auto: the budget split between encoded and decoded by the model
            cache = coordl.Cache(size=cache_bytes, decoded="auto" if kind == "coordl-auto" else 0)
            kw = {"device_id": None, "seed": seed, "cache": cache, "prep": workers, "pipeline": "imagenet-train"}
            self.loader = coordl.CoordLoader(data, batch_size=batch_size, shuffle=True, **kw)
        else:
            raise ValueError(f"unknown loader {kind!r}; choose from {', '.join(LOADERS)}")
        if kind in COORDL_LOADERS:
            self.n = len(self.loader.index)

    def __len__(self) -> int:
        return self.n

    def epoch(self):
        for batch in self.loader:
            yield batch[0]["images"] if self.kind in DALI_READERS else batch[0]

    def counters(self) -> dict | None:
        return {k: self.loader.stats()[k] for k in COUNTERS} if self.kind in COORDL_LOADERS else None

    def close(self) -> None:
        if self.kind in COORDL_LOADERS:
            self.loader.close()
        del self.loader


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

            kb = sum(resource.getrusage(who).ru_maxrss for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
            return {"peak_memory_bytes": kb * 1024, "peak_memory_kind": "rss"}
        self._stop.set()
        self._thread.join()
        samples = self.samples or [self._stat()]
        with open(os.path.join(self.cgroup, "memory.max_usage_in_bytes")) as f:
            peak = int(f.read())
        mean = [sum(x[i] for x in samples) // len(samples) for i in (0, 1)]
        out = {"peak_memory_bytes": peak, "peak_memory_kind": "cgroup"}
        return out | {"mean_memory_bytes": mean[0], "mean_file_cache_bytes": mean[1]}


def child(args) -> int:
    dev = tuple(int(x) for x in args.device.split(":"))
    memory = MemoryMeter(args.memcg)
    t_build = time.perf_counter()
    loader = Loader(args.loader, args.data, args.batch_size, args.workers, args.seed, args.cache_bytes)
    epoch = loader.epoch()
    samples = 0
    for _ in range(args.warmup_batches):
        samples += next(epoch).shape[0]
    extra = loader.counters() or {}
    build_s = round(time.perf_counter() - t_build, 2)
    say(ready=True, build_s=build_s, warmup_samples=samples, cache_bytes=extra.get("cache_bytes", 0))
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
        }
        row |= {"device_bytes": disk, "wait_s": round(wait, 3), **memory.stop()}
        counters = loader.counters()
        if counters is not None:
            row["counters"] = counters  # epoch 0's include the warm-up batches
        say(**row)
    loader.close()
    say(done=True)
    return 0


def main() -> int:
    what = "one benchmark loader in a child process (started by benchmarks.run)"
    p = argparse.ArgumentParser(prog="python -m benchmarks.loaders", description=what)
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
