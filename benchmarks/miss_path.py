"""The miss path and the overhead: how the bytes reach DALI's decoder, coordl's ways against DALI's own.

Every mode runs the same recipe (``--recipe small``: decode, resize to ``--resize`` square;
``imagenet-train``: random crop to ``--crop``, flip, normalise), batch size and DALI threads, torch
tensors out, in this process; what differs is how the encoded bytes reach the decoder:
``dali-reader`` (``fn.readers.file(shuffle_after_epoch=True)``); ``memory`` (every sample from a Python
list through ``fn.external_source``, a new order each epoch); ``no-cache`` (coordl, ``cache=0``: every
sample a miss); ``filling`` (coordl's first epoch with a new cache of ``--fill`` of the dataset: misses
read, half written to shared memory, every file read dropped from the page cache); ``warm`` (coordl's
second epoch, the whole dataset cached). Each timed epoch starts with the
files read into the page cache (``--cold``: dropped) and is timed from its first batch to its last;
modes ABBA, ``--reps`` times.

    python -m benchmarks miss_path --data /var/tmp/coordl-bench/tiny --images 40000 --width 32 --height 32

coordl's overhead over bare DALI, everything in memory (the ImageNet recipe, warm cache against
``external_source`` and the file reader):

    python -m benchmarks miss_path --recipe imagenet-train --modes warm,memory,dali-reader --batch-size 64 \\
        --data /var/tmp/coordl-bench/bench --images 4436 --classes 100 --width 400 --height 350 --reps 8

``--in-flight`` measures instead the storage reads the loader keeps in flight (at most ``Fetch(threads)``,
as :meth:`Fetcher.concurrency` asks), on idle cores and with one busy loop per core, for files in the page
cache and on a device throttled in a blkio cgroup (``--throttle``; root, cgroup v1), each epoch a child with
``cache=0``. The estimate must not depend on the load: a busy node still needs the slow device's reads.

    python -m benchmarks miss_path --in-flight --data /var/tmp/coordl-bench/inflight --images 4000 --batch-size 64
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import subprocess
import sys
import threading
import time

import numpy as np

import coordl
from benchmarks.harness import dataset, jobs, limits, measure
from benchmarks.loaders import dali_imagenet_train, dali_iterator
from coordl.units import parse_bytes

MODES = ("dali-reader", "memory", "no-cache", "filling", "warm")
BASES = ("dali-reader", "memory")  # DALI without coordl: the ratios' denominators


def dali_ops(args, jpegs, decoder="cpu", device="cpu"):
    """The recipe's DALI operators on the encoded batch ``jpegs``."""
    from nvidia.dali import fn, types

    if args.recipe == "imagenet-train":
        return dali_imagenet_train(jpegs, args.crop)
    images = fn.decoders.image(jpegs, device=decoder, output_type=types.RGB)
    return fn.resize(images, device=device, resize_x=args.resize, resize_y=args.resize)


def coordl_loader(args, cache, **kw) -> coordl.CoordLoader:
    if args.recipe == "imagenet-train":
        recipe = coordl.ImageNetTrain(size=args.crop)
    else:
        recipe = lambda encoded, ctx: dali_ops(args, encoded, ctx.decoder_device, ctx.device)  # noqa: E731
    kw |= {"pipeline": recipe, "device_id": None, "cache": cache, "prep": args.threads, "shuffle": True}
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
    n = first = 0
    t0 = None
    for batch in batches:
        images = batch[0]["images"] if isinstance(batch, list) else batch[0]
        if t0 is None:
            t0, first = time.perf_counter(), images.shape[0]
        n += images.shape[0]
    return (n - first) / (time.perf_counter() - t0), n


def epochs(args, data) -> dict:
    modes = args.modes.split(",")
    if unknown := set(modes) - set(MODES):
        raise SystemExit(f"unknown modes: {', '.join(sorted(unknown))}")
    index = coordl.Index.scan(args.data, index_dir="")
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
            with coordl_loader(args, {"no-cache": 0, "filling": args.fill, "warm": 1.0}[mode]) as ld:
                if mode == "warm":
                    timed(ld)  # fills the cache
                    assert ld.stats()["cache_items"] == n, "the cache did not take the whole dataset"
                prepare()
                rate, got = timed(ld)
                stats = ld.stats()
        assert got == n, f"{mode}: {got} samples of {n}"
        assert mode != "warm" or stats["storage_reads"] == 0, "a warm epoch read storage"
        assert mode != "filling" or stats["storage_reads"] == n, "a filling epoch found samples cached"
        keys = ("storage_reads", "storage_bytes", "cache_hits", "cache_items", "cache_bytes")
        runs[mode].append(round(rate, 1))
        details[mode].append({k: stats[k] for k in keys if k in stats})
        print(f"rep {rep} {mode:12s} {rate:9.1f} samples/s {details[mode][-1]}", flush=True)
    med = {m: statistics.median(v) for m, v in runs.items()}
    out = {"dataset": data, "samples_per_s": runs, "median": med, "stats": details}
    for base in (b for b in BASES if b in med):
        out[f"ratio_to_{base.replace('-', '_')}"] = {m: round(med[m] / med[base], 3) for m in modes if m != base}
    return out


# -- reads in flight, idle and busy ---------------------------------------------------------
def in_flight_epoch(args) -> None:
    """One epoch of a loader with ``cache=0`` (run in the child): what the fetcher estimated after
    each of its reads and how many reads ran at once, as the time-weighted mean while any ran."""
    from coordl.fetch.fetcher import Fetcher

    lock = threading.Lock()
    state = {"running": 0, "since": time.perf_counter(), "weighted": 0.0, "busy_s": 0.0, "estimates": []}
    read = Fetcher.read

    def step(delta):
        with lock:
            now = time.perf_counter()
            if state["running"]:
                state["weighted"] += state["running"] * (now - state["since"])
                state["busy_s"] += now - state["since"]
            state["running"] += delta
            state["since"] = now

    def counted(self, ids, admit=None):  # observation only: the read itself is the loader's
        step(+1)
        try:
            return read(self, ids, admit)
        finally:
            step(-1)
            state["estimates"].append(self.concurrency())

    Fetcher.read = counted
    parent = jobs.Parent()
    with coordl_loader(args, 0, fetch=coordl.Fetch(threads=args.fetch_threads)) as ld:
        for _ in ld:  # the first epoch: the pipeline, DALI's buffers and the estimate's start
            break
        parent.say(event="ready")
        parent.wait()  # the parent drops the page cache (or warms it) and starts the spinners
        rate, got = timed(ld)
        s = ld.stats()
    late = [e for e in state["estimates"][len(state["estimates"]) // 2 :] if e is not None]
    out = {"samples_per_s": round(rate, 1), "samples": got, "read_calls": len(state["estimates"])}
    out["storage_mb_per_s"] = round(s["storage_bytes"] / 1e6 / (got / rate), 2) if rate else None
    out["reads_in_flight"] = round(state["weighted"] / state["busy_s"], 2) if state["busy_s"] else None
    parent.say(event="epoch", **out, estimate=round(statistics.median(late), 2) if late else None)
    parent.wait()
    parent.say(event="done")


def in_flight_case(args, storage: str, load: str, paths: list[str]) -> dict:
    """One child's epoch on ``storage`` (the page cache or the throttled device), with the cores ``load``."""
    lim = limits.Limits(f"coordl-inflight-{os.getpid()}", False, storage == "throttled")
    spinners, got = [], {}

    def heard(event, msg):
        if event == "epoch":
            return got.update(msg)
        if storage == "throttled":
            limits.drop_page_cache()
            lim.throttle(measure.device_of(args.data), args.throttle)
        else:
            limits.read_through(paths)
        for _ in range(len(os.sched_getaffinity(0)) if load == "busy" else 0):
            spin = [sys.executable, "-c", "print('spinning', flush=True)\nwhile True: pass"]
            spinners.append(subprocess.Popen(spin, stdout=subprocess.PIPE))
            spinners[-1].stdout.readline()

    try:
        child = jobs.scenario_command("miss_path", "--in-flight-child", *args._argv)
        code, err, _ = jobs.converse(child, heard, preexec_fn=lim.join)
    finally:
        for s in spinners:
            s.kill()
            s.wait()
        lim.remove()
    if code or not got:
        raise SystemExit(f"the child failed ({code}):\n{jobs.error_text(err)}")
    return got


def in_flight(args, data) -> dict:
    caps = limits.probe()
    if args.throttle and not (caps["blkio"] and caps["drop_caches"]):
        raise SystemExit("--throttle needs root and a v1 blkio cgroup: " + "; ".join(caps["notes"]))
    paths = [os.path.join(d, f) for d, _, fs in os.walk(args.data) for f in fs]
    cases = [(s, c) for s in ["page-cache"] + (["throttled"] if args.throttle else []) for c in ("idle", "busy")]
    runs: dict[str, list] = {f"{s}/{c}": [] for s, c in cases}
    for rep, (storage, load) in measure.alternate(cases, args.reps):
        runs[f"{storage}/{load}"].append(got := in_flight_case(args, storage, load, paths))
        print(f"rep {rep} {storage:10s} {load:4s} {got}", flush=True)

    def med(key, k):
        values = [r[k] for r in runs[key] if r[k] is not None]
        return statistics.median(values) if values else None

    keys = ("estimate", "reads_in_flight", "samples_per_s", "storage_mb_per_s")
    return {"dataset": data, "runs": runs, "median": {key: {k: med(key, k) for k in keys} for key in runs}}


def options(p) -> None:
    dataset.add_dataset_options(p, data="/var/tmp/coordl-bench/tiny", images=40000, classes=100, width=32, height=32)
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--threads", type=int, default=2, help="DALI threads (default: 2)")
    p.add_argument("--recipe", choices=("small", "imagenet-train"), default="small", help="(default: small)")
    p.add_argument("--resize", type=int, default=16, help="the small recipe's output size in pixels (default: 16)")
    p.add_argument("--crop", type=int, default=224, help="imagenet-train's output size in pixels (default: 224)")
    p.add_argument("--fill", type=float, default=0.5, help="the filling epoch's cache budget (default: 0.5)")
    cold = "drop the files from the page cache before each epoch instead of reading them in"
    p.add_argument("--cold", action="store_true", help=cold)
    p.add_argument("--reps", type=int, default=5)
    modes = "dali-reader,no-cache,filling,warm"
    p.add_argument("--modes", default=modes, help=f"comma-separated, of {', '.join(MODES)} (default: {modes})")
    p.add_argument("--in-flight", action="store_true", help="measure the reads in flight, idle and busy (see above)")
    p.add_argument("--fetch-threads", type=int, default=16, help="Fetch(threads) of --in-flight (default: 16)")
    throttle = "--in-flight's device throttle in bytes per second (default: 20MB); 0: page cache only"
    p.add_argument("--throttle", type=parse_bytes, default=20 * 10**6, help=throttle)
    p.add_argument("--in-flight-child", action="store_true", help=argparse.SUPPRESS)


def run(args) -> dict | None:
    if args.in_flight_child:
        return in_flight_epoch(args)
    data = dataset.dataset_from_args(args)
    return (in_flight if args.in_flight else epochs)(args, data)


def out_path(args) -> str:
    """``--in-flight`` writes ``miss_path_in_flight.json`` where the epochs write ``miss_path.json``."""
    return args.out.replace("miss_path.json", "miss_path_in_flight.json") if args.in_flight else args.out


def table(r: dict) -> str:
    if "runs" in r:  # --in-flight
        return "\n".join(
            f"{key:22s} estimate {m['estimate']}, reads in flight {m['reads_in_flight']}, "
            f"{m['samples_per_s']} samples/s, {m['storage_mb_per_s']} MB/s from storage"
            for key, m in r["median"].items()
        )
    lines = ["median samples/s: " + ", ".join(f"{m} {v:.0f}" for m, v in r["median"].items())]
    for base in BASES:
        if ratios := r.get(f"ratio_to_{base.replace('-', '_')}"):
            lines.append(f"of {base}: " + ", ".join(f"{m} {x:.3f}x" for m, x in ratios.items()))
    return "\n".join(lines)
