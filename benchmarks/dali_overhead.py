"""coordl's overhead over bare DALI: warm-cache CoordLoader vs the same DALI ops without coordl.

All three run the ImageNet training recipe (random-crop decode, resize, flip, normalise,
CHW float) with the same batch size, DALI threads and prefetch depth, and hand torch
tensors to the loop:

- ``coordl``: encoded samples from its MinIO cache (100% of the dataset, filled by a first
  epoch that is not timed);
- ``dali``: every encoded sample from a Python list in memory through
  ``fn.external_source`` and ``DALIGenericIterator``;
- ``dali-reader``: DALI's own ``fn.readers.file(shuffle_after_epoch=True)`` over the files
  in the (warm) page cache.

Epochs alternate ABBA (A B C C B A ...), so that drift on a shared machine hits all alike.

    python -m benchmarks dali_overhead --data /var/tmp/coordl-bench/train --reps 5
"""

from __future__ import annotations

import statistics
import time

import numpy as np

import coordl
from benchmarks import loaders
from benchmarks.harness import dataset, measure


def bare_dali(index, batch_size: int, threads: int, size: int):
    from nvidia.dali import fn, pipeline_def, types

    encoded = [np.fromfile(p, dtype=np.uint8) for p in index.paths]
    labels = index.labels
    n = len(encoded)

    class Source:
        """A callable source: one epoch of batches, then StopIteration, then the next epoch."""

        def __init__(self):
            self.epoch, self.k = 0, None

        def __call__(self):
            if self.k is None:
                self.order = np.random.default_rng(self.epoch).permutation(n)
                self.epoch += 1
                self.k = 0
            if self.k >= n:
                self.k = None
                raise StopIteration
            ids = self.order[self.k : self.k + batch_size]
            self.k += batch_size
            return [encoded[i] for i in ids], labels[ids]

    @pipeline_def(batch_size=batch_size, num_threads=threads, device_id=None, seed=1, prefetch_queue_depth=2)
    def pipe():
        jpegs, labs = fn.external_source(source=Source(), num_outputs=2, batch=True, dtype=[types.UINT8, types.INT64])
        return loaders.dali_imagenet_train(jpegs, size), labs

    return loaders.dali_iterator(pipe(), reader=None)


def time_epoch(it) -> tuple[float, int]:
    t0 = time.perf_counter()
    n = 0
    for batch in it:
        images = batch[0]["images"] if isinstance(batch, list) else batch[0] if isinstance(batch, tuple) else batch
        n += images.shape[0]
    return time.perf_counter() - t0, n


def options(p) -> None:
    dataset.add_dataset_options(p, data="/var/tmp/coordl-bench/train")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--crop", type=int, default=224, help="the recipe's output size in pixels (default: 224)")
    p.add_argument("--reps", type=int, default=5)


def run(args) -> dict | None:
    data = dataset.dataset_from_args(args)
    recipe = coordl.ImageNetTrain(size=args.crop)
    kw = {"pipeline": recipe, "device_id": None, "cache": 1.0, "prep": args.threads, "shuffle": True}
    loader = coordl.CoordLoader(args.data, batch_size=args.batch_size, **kw)
    bare = bare_dali(loader.index, args.batch_size, args.threads, args.crop)
    # DALI's own file reader, a fresh permutation every epoch, files in the (warm) page cache
    reader = loaders.Loader("dali-epoch-shuffle", args.data, args.batch_size, args.threads, seed=1)
    epochs = {"coordl": lambda: loader, "dali": lambda: bare, "dali-reader": reader.epoch}
    try:
        time_epoch(loader)  # fills the cache
        time_epoch(bare)  # warms the bare pipeline
        time_epoch(reader.epoch())  # and the reader's page cache
        assert loader.stats()["cache_items"] == len(loader.index), "cache did not take the whole dataset"
        runs = {name: [] for name in epochs}
        for rep, name in measure.alternate(list(epochs), args.reps):
            seconds, n = time_epoch(epochs[name]())
            assert n == len(loader.index)
            runs[name].append(n / seconds)
            print(f"rep {rep} {name:6s} {n / seconds:8.1f} samples/s")
        s = loader.stats()
        assert s["storage_reads"] == 0, "a warm epoch read storage"
    finally:
        loader.close()
    med = {k: statistics.median(v) for k, v in runs.items()}
    ratios = {"ratio_coordl_over_dali": round(med["coordl"] / med["dali"], 4)}
    ratios["ratio_coordl_over_dali_reader"] = round(med["coordl"] / med["dali-reader"], 4)
    return {"dataset": data, "samples_per_s": runs, "median": med, **ratios}


def table(r: dict) -> str:
    med = r["median"]
    return (
        f"median samples/s: coordl {med['coordl']:.1f}, bare DALI from memory {med['dali']:.1f}, DALI file reader "
        f"{med['dali-reader']:.1f}; ratios {r['ratio_coordl_over_dali']:.3f}, {r['ratio_coordl_over_dali_reader']:.3f}"
    )
