"""The miss path: coordl reading samples from storage against DALI's own file reader.

Every mode runs the same small recipe (decode, resize to ``--resize`` square), batch size and DALI threads
on files in the page cache, torch tensors out; what differs is how the bytes reach the decoder:
``dali-reader`` (``fn.readers.file(shuffle_after_epoch=True)``); ``no-cache`` (coordl, ``cache=0``: every
sample a miss); ``filling`` (coordl's first epoch with a new cache of ``--fill`` of the dataset: misses read,
half written to shared memory, every file read dropped from the page cache); ``warm`` (coordl's second
epoch, the whole dataset cached). Each timed epoch starts with the files read into the page cache
(``--cold``: dropped), runs in this process, and is timed from its first batch to its last; modes ABBA.

    python -m benchmarks miss_path --data /var/tmp/coordl-bench/tiny --images 40000 --width 32 --height 32

``--in-flight`` measures instead the storage reads the loader keeps in flight (at most ``Fetch(threads)``,
as :meth:`Fetcher.concurrency` asks), on idle cores and with one busy loop per core, for files in the page
cache and on a device throttled in a blkio cgroup (``--throttle``; root, cgroup v1), each epoch a child with
``cache=0``. The estimate must not depend on the load: a busy node still needs the slow device's reads.

    python -m benchmarks miss_path --in-flight --data /var/tmp/coordl-bench/inflight --images 4000 --batch-size 64
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import coordl
from benchmarks.harness import dataset, jobs, limits, measure
from benchmarks.loaders import dali_iterator
from coordl.units import parse_bytes

MODES = ("dali-reader", "no-cache", "filling", "warm")


def small_recipe(size: int):
    """decode + resize to ``size`` x ``size``: little work per sample, so the bytes' path shows."""
    from nvidia.dali import fn, types

    def recipe(encoded, ctx):
        images = fn.decoders.image(encoded, device=ctx.decoder_device, output_type=types.RGB)
        return fn.resize(images, device=ctx.device, resize_x=size, resize_y=size)

    return recipe


def dali_reader(root: str, batch_size: int, threads: int, size: int):
    from nvidia.dali import fn, pipeline_def, types

    @pipeline_def(batch_size=batch_size, num_threads=threads, device_id=None, seed=1, prefetch_queue_depth=2)
    def pipe():
        jpegs, labels = fn.readers.file(file_root=root, shuffle_after_epoch=True, name="reader")
        images = fn.decoders.image(jpegs, device="cpu", output_type=types.RGB)
        return fn.resize(images, resize_x=size, resize_y=size), labels

    return dali_iterator(pipe(), reader="reader")


def warm_page_cache(paths) -> None:
    """Reads every file once, so that the epoch finds it in the page cache."""
    limits.read_through(paths)


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


# -- reads in flight, idle and busy ---------------------------------------------------------
def in_flight_epoch(args) -> dict:
    """One epoch of a loader with ``cache=0`` (run in the child): what the fetcher estimated after
    each of its reads and how many reads ran at once, as the time-weighted mean while any ran."""
    import threading

    from coordl.fetch.fetcher import Fetcher

    lock = threading.Lock()
    state = {"running": 0, "since": time.perf_counter(), "weighted": 0.0, "busy_s": 0.0, "estimates": []}
    read = Fetcher.read

    def counted(self, ids, admit=None):  # observation only: the read itself is the loader's
        def step(delta):
            with lock:
                now = time.perf_counter()
                if state["running"]:
                    state["weighted"] += state["running"] * (now - state["since"])
                    state["busy_s"] += now - state["since"]
                state["running"] += delta
                state["since"] = now

        step(+1)
        try:
            return read(self, ids, admit)
        finally:
            step(-1)
            state["estimates"].append(self.concurrency())

    Fetcher.read = counted
    kw = {"pipeline": small_recipe(args.resize), "device_id": None, "cache": 0, "prep": args.threads}
    kw |= {"fetch": coordl.Fetch(threads=args.fetch_threads), "shuffle": True}
    ld = coordl.CoordLoader(args.data, batch_size=args.batch_size, **kw)
    try:
        for _ in ld:  # the first epoch: the pipeline, DALI's buffers and the estimate's start
            break
        print(json.dumps({"ready": True}), flush=True)
        sys.stdin.readline()  # the parent drops the page cache (or warms it) and starts the spinners
        rate, got = timed(ld)
        s = ld.stats()
    finally:
        ld.close()
    late = [e for e in state["estimates"][len(state["estimates"]) // 2 :] if e is not None]
    out = {"samples_per_s": round(rate, 1), "samples": got, "read_calls": len(state["estimates"])}
    out["storage_mb_per_s"] = round(s["storage_bytes"] / 1e6 / (got / rate), 2) if rate else None
    out["reads_in_flight"] = round(state["weighted"] / state["busy_s"], 2) if state["busy_s"] else None
    return out | {"estimate": round(statistics.median(late), 2) if late else None}


def where(data: dict) -> dict:
    """What a result says of where it ran: the dataset, the CPUs this process may use, the coordl it imported."""
    return {"dataset": data, "cpus_allowed": len(os.sched_getaffinity(0)), "coordl": str(Path(coordl.__file__).parent)}


def in_flight(args, data) -> dict:
    import subprocess

    caps = limits.probe()
    if args.throttle and not (caps["blkio"] and caps["drop_caches"]):
        raise SystemExit("--throttle needs root and a v1 blkio cgroup: " + "; ".join(caps["notes"]))
    device = measure.device_of(args.data)
    paths = [os.path.join(d, f) for d, _, fs in os.walk(args.data) for f in fs]
    storages = ["page-cache"] + (["throttled"] if args.throttle else [])
    loads = ["idle", "busy"]
    child = jobs.scenario_command("miss_path", "--in-flight-child", *args._argv)
    runs: dict[str, list] = {f"{s}/{c}": [] for s in storages for c in loads}
    for rep, (storage, load) in measure.alternate([(s, c) for s in storages for c in loads], args.reps):
        lim = limits.Limits(f"coordl-inflight-{os.getpid()}", False, storage == "throttled")
        spinners = []
        try:
            proc = subprocess.Popen(
                child, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, preexec_fn=lim.join
            )
            assert json.loads(proc.stdout.readline()) == {"ready": True}
            if storage == "throttled":
                limits.drop_page_cache()
                lim.throttle(device, args.throttle)
            else:
                warm_page_cache(paths)
            if load == "busy":
                spin = "print('spinning', flush=True)\nwhile True: pass"
                for _ in range(len(os.sched_getaffinity(0))):
                    spinners.append(subprocess.Popen([sys.executable, "-c", spin], stdout=subprocess.PIPE))
                for s in spinners:
                    s.stdout.readline()
            proc.stdin.write("go\n")
            proc.stdin.flush()
            result = json.loads(proc.stdout.readline())
            assert proc.wait(timeout=600) == 0, f"the child failed ({proc.returncode})"
        finally:
            for s in spinners:
                s.kill()
                s.wait()
            lim.remove()
        runs[f"{storage}/{load}"].append(result)
        print(f"rep {rep} {storage:10s} {load:4s} {result}", flush=True)

    def med(key, k):
        values = [r[k] for r in runs[key] if r[k] is not None]
        return statistics.median(values) if values else None

    keys = ("estimate", "reads_in_flight", "samples_per_s", "storage_mb_per_s")
    return {**where(data), "runs": runs, "median": {key: {k: med(key, k) for k in keys} for key in runs}}


def options(p) -> None:
    dataset.add_dataset_options(p, data="/var/tmp/coordl-bench/tiny", images=40000, classes=100, width=32, height=32)
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--threads", type=int, default=2, help="DALI threads (default: 2)")
    p.add_argument("--resize", type=int, default=16, help="the recipe's output size in pixels (default: 16)")
    p.add_argument("--fill", type=float, default=0.5, help="the filling epoch's cache budget (default: 0.5)")
    cold = "drop the files from the page cache before each epoch instead of reading them in"
    p.add_argument("--cold", action="store_true", help=cold)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    p.add_argument("--in-flight", action="store_true", help="measure the reads in flight, idle and busy (see above)")
    p.add_argument("--fetch-threads", type=int, default=16, help="Fetch(threads) of --in-flight (default: 16)")
    throttle = "--in-flight's device throttle in bytes per second (default: 20MB); 0: page cache only"
    p.add_argument("--throttle", type=parse_bytes, default=20 * 10**6, help=throttle)
    p.add_argument("--in-flight-child", action="store_true", help=argparse.SUPPRESS)


def run(args) -> dict | None:
    if args.in_flight_child:
        return jobs.say(**in_flight_epoch(args))
    data = dataset.dataset_from_args(args)
    if args.in_flight:
        return in_flight(args, data)
    modes = [m for m in args.modes.split(",") if m]
    if unknown := set(modes) - set(MODES):
        raise SystemExit(f"unknown modes: {', '.join(sorted(unknown))}")
    recipe = small_recipe(args.resize)

    def loader(cache_bytes):
        kw = {"pipeline": recipe, "device_id": None, "cache": cache_bytes, "prep": args.threads, "shuffle": True}
        return coordl.CoordLoader(args.data, batch_size=args.batch_size, **kw)

    index = loader(0)
    paths = list(index.index.paths)
    index.close()
    n = len(paths)

    reader = dali_reader(args.data, args.batch_size, args.threads, args.resize) if "dali-reader" in modes else None
    prepare = (lambda: limits.evict(args.data)) if args.cold else (lambda: warm_page_cache(paths))

    def epoch(mode: str) -> tuple[float, dict]:
        prepare()
        if mode == "dali-reader":
            rate, got = timed(reader)
            return rate, {}
        ld = loader({"no-cache": 0, "filling": args.fill, "warm": 1.0}[mode])
        try:
            if mode == "warm":
                timed(ld)  # fills the cache
                assert ld.stats()["cache_items"] == n, "the cache did not take the whole dataset"
                prepare()
            rate, got = timed(ld)
            s = ld.stats()
        finally:
            ld.close()  # and the cache with it: every loader starts with an empty one
        assert mode != "warm" or s["storage_reads"] == 0, "a warm epoch read storage"
        assert mode != "filling" or s["storage_reads"] == n, "a filling epoch found samples cached"
        assert got == n, f"{mode}: {got} samples of {n}"
        keys = ("storage_reads", "storage_bytes", "cache_hits", "cache_items", "cache_bytes")
        return rate, {k: s[k] for k in keys if k in s}

    runs = {m: [] for m in modes}
    details = {m: [] for m in modes}
    if reader is not None:
        timed(reader)  # the reader's first epoch: its threads and buffers
    for rep, mode in measure.alternate(modes, args.reps):
        rate, stats = epoch(mode)
        runs[mode].append(round(rate, 1))
        details[mode].append(stats)
        print(f"rep {rep} {mode:12s} {rate:9.1f} samples/s {stats}", flush=True)
    med = {m: statistics.median(v) for m, v in runs.items()}
    ratios = {m: round(med[m] / med["dali-reader"], 3) for m in modes if "dali-reader" in med and m != "dali-reader"}
    return {**where(data), "samples_per_s": runs, "median": med, "ratio_to_dali_reader": ratios, "stats": details}


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
    return (
        "median samples/s: "
        + ", ".join(f"{m} {v:.0f}" for m, v in r["median"].items())
        + "\nof DALI's reader: "
        + ", ".join(f"{m} {x:.3f}x" for m, x in r["ratio_to_dali_reader"].items())
    )
