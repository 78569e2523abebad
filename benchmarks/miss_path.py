"""The miss path and the overhead: how the bytes reach DALI's decoder, coordl's ways against DALI's own.

One recipe (``--recipe small``: decode, resize to 16 px square; ``imagenet-train``), batch and DALI threads, in
this process; the modes differ in how the encoded bytes reach the decoder: ``dali-reader``
(``fn.readers.file(shuffle_after_epoch=True)``), ``memory`` (``fn.external_source`` from a Python list),
``no-cache`` (coordl, ``cache=0``), ``filling`` (coordl's first epoch, a new cache of half the dataset),
``warm`` (coordl's second epoch, all cached). Files in the page cache (``--cold``: dropped) before each epoch,
timed from its first batch to its last; modes ABBA, ``--reps`` times.

    python -m benchmarks miss_path --data /var/tmp/coordl-bench/tiny --images 40000 --width 32 --height 32
    python -m benchmarks miss_path --recipe imagenet-train --modes warm,memory,dali-reader --batch-size 64 \\
        --data /var/tmp/coordl-bench/bench --images 4436 --classes 100 --width 400 --height 350 --reps 8
"""

import itertools
import statistics
import time

import numpy as np

import coordl
from benchmarks.harness import dataset, limits, measure, report
from benchmarks.loaders import dali_imagenet_train, dali_iterator

MODES = ("dali-reader", "memory", "no-cache", "filling", "warm")
BASES = ("dali-reader", "memory")  # DALI without coordl: the ratios' denominators
COUNTERS = ("storage_reads", "storage_bytes", "cache_hits", "cache_items", "cache_bytes")


def dali_ops(args, jpegs, decoder="cpu", device="cpu"):
    """The recipe's DALI operators on the encoded batch ``jpegs``."""
    from nvidia.dali import fn, types

    if args.recipe == "imagenet-train":
        return dali_imagenet_train(jpegs)
    images = fn.decoders.image(jpegs, device=decoder, output_type=types.RGB)
    return fn.resize(images, device=device, resize_x=16, resize_y=16)


def coordl_loader(args, cache: float) -> coordl.CoordLoader:
    recipe = lambda encoded, ctx: dali_ops(args, encoded, ctx.decoder_device, ctx.device)  # noqa: E731
    recipe = coordl.ImageNetTrain() if args.recipe == "imagenet-train" else recipe
    kw = {"pipeline": recipe, "device_id": None, "cache": cache, "prep": args.threads, "shuffle": True}
    return coordl.CoordLoader(args.data, batch_size=args.batch_size, **kw)


def dali_pipeline(args, source=None):
    """DALI's file reader over ``--data``, or, given ``source`` (a generator function of one epoch's
    ``(encoded, labels)`` batches), ``external_source``: the recipe, as torch batches."""
    from nvidia.dali import fn, pipeline_def, types

    @pipeline_def(batch_size=args.batch_size, num_threads=args.threads, device_id=None, seed=1, prefetch_queue_depth=2)
    def pipe():
        if source is None:
            jpegs, labels = fn.readers.file(file_root=args.data, shuffle_after_epoch=True, name="Reader")
        else:
            kw = {"num_outputs": 2, "batch": True, "cycle": "raise", "dtype": [types.UINT8, types.INT64]}
            jpegs, labels = fn.external_source(source=source, **kw)
        return dali_ops(args, jpegs), labels

    return dali_iterator(pipe(), reader="Reader" if source is None else None)


def from_memory(args, index):
    """``external_source`` fed every encoded sample from a Python list, a new permutation each epoch."""
    encoded, labels = [np.fromfile(p, dtype=np.uint8) for p in index.paths], np.asarray(index.labels)
    epochs = itertools.count()

    def epoch():
        order = np.random.default_rng(next(epochs)).permutation(len(encoded))
        for ids in np.array_split(order, range(args.batch_size, len(order), args.batch_size)):
            yield [encoded[i] for i in ids], labels[ids]

    return dali_pipeline(args, epoch)


def timed(batches) -> tuple[float, int]:
    """Samples per second from the first batch to the last (the first batch's samples not counted)."""
    sizes = (len(b[0]["images"] if isinstance(b, list) else b[0]) for b in batches)  # DALI's dicts or coordl's
    n = first = next(sizes)
    t0 = time.perf_counter()
    n += sum(sizes)
    return (n - first) / (time.perf_counter() - t0), n


def run(args) -> dict | None:
    modes = args.modes.split(",")
    if unknown := set(modes) - set(MODES):
        raise SystemExit(f"unknown modes: {', '.join(sorted(unknown))}")
    data, index = dataset.dataset_from_args(args), coordl.Index.scan(args.data, index_dir="")
    paths, n = list(index.paths), len(index)
    kept = {"dali-reader": lambda: dali_pipeline(args), "memory": lambda: from_memory(args, index)}
    kept = {m: kept[m]() for m in BASES if m in modes}  # DALI's pipelines, made once
    prepare = (lambda: limits.evict(args.data)) if args.cold else (lambda: limits.read_through(paths))
    runs, details = {m: [] for m in modes}, {m: [] for m in modes}
    for pipe in kept.values():
        timed(pipe)  # the first epoch: DALI's threads and buffers
    for rep, mode in measure.alternate(modes, args.reps):
        stats = {}
        if mode in kept:
            prepare()
            rate, got = timed(kept[mode])
        else:  # a new loader and a new cache: every coordl epoch starts with an empty one
            with coordl_loader(args, {"no-cache": 0, "filling": 0.5, "warm": 1.0}[mode]) as ld:
                if mode == "warm":
                    timed(ld)  # fills the cache
                    assert ld.stats()["cache_items"] == n, "the cache did not take the whole dataset"
                prepare()
                rate, got = timed(ld)
                stats = {k: v for k, v in ld.stats().items() if k in COUNTERS}
        assert got == n, f"{mode}: {got} samples of {n}"
        assert mode != "warm" or stats["storage_reads"] == 0, "a warm epoch read storage"
        assert mode != "filling" or stats["storage_reads"] == n, "a filling epoch found samples cached"
        runs[mode].append(round(rate, 1))
        details[mode].append(stats)
        print(f"rep {rep} {mode:12s} {rate:9.1f} samples/s {stats}", flush=True)
    med = {m: statistics.median(v) for m, v in runs.items()}
    out = {"dataset": data, "samples_per_s": runs, "median": med, "stats": details}
    for base in (b for b in BASES if b in med):
        out[f"ratio_to_{base.replace('-', '_')}"] = {m: round(med[m] / med[base], 3) for m in modes if m != base}
    return out


def options(p) -> None:
    dataset.add_dataset_options(p, data="/var/tmp/coordl-bench/tiny", images=40000, classes=100, width=32, height=32)
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--threads", type=int, default=2, help="DALI threads (default: 2)")
    p.add_argument("--recipe", choices=("small", "imagenet-train"), default="small", help="(default: small)")
    p.add_argument("--cold", action="store_true", help="drop the dataset from the page cache before each epoch")
    p.add_argument("--reps", type=int, default=5)
    modes = "dali-reader,no-cache,filling,warm"
    p.add_argument("--modes", default=modes, help=f"comma-separated, of {', '.join(MODES)} (default: {modes})")


def table(r: dict) -> str:
    ratios = [r.get(f"ratio_to_{base.replace('-', '_')}", {}) for base in BASES]
    rows = [[m, v, *(x.get(m) for x in ratios)] for m, v in r["median"].items()]
    return report.table(["mode", "median samples/s", *(f"x {base}" for base in BASES)], rows)
