"""An s3:// dataset behind added latency: coordl at 0%, 50% and 100% cache against DALI's reader; clients' CPU per GET.

The store: moto behind ``coordl_testing.s3server.S3Server``'s counting proxy, ``--latency`` a request.
``--repeat`` rounds, ABBA, each configuration a fresh process of 2 epochs: ``coordl-<f>`` (``cache=f``,
``imagenet-train``), ``dali-s3`` (``fn.readers.file(file_root="s3://...")``, the same recipe), ``dali-local``
(the same on the local copy), ``capacity-0`` and ``capacity-<latency>`` (every object GET once, 64 in flight).
``--clients``: the client CPU per GET, obstore (coordl's) against boto3, each GETting ``--objects`` objects, 64 in
flight, from moto (no proxy), into s3_clients.json. What each epoch records: benchmarks/README.md.

    python -m benchmarks s3            # ~16 min; --clients ~40 s
"""

import argparse
import json
import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from benchmarks.harness import dataset, jobs, measure, report
from benchmarks.harness.report import log
from benchmarks.loaders import dali_imagenet_train, dali_iterator

CLIENTS = ("obstore", "boto3")
BUCKET, PREFIX, IN_FLIGHT = "coordl-bench", "bench/train", 64
EPOCHS, BATCH, CACHES, THREADS = 2, 64, (0.0, 0.5, 1.0), os.cpu_count()  # DALI as many threads as coordl
N, M, S = (1, "{:.0f}"), (1e6, "{:.1f}"), (1, "{:.1f}")  # a count, megabytes, seconds
COLUMNS = {"samples/s": ("samples_per_s", *N), "s": ("seconds", *S), "object GETs": ("gets", *N)}
COLUMNS |= {"MB": ("get_bytes", *M)} | {k: (k, *N) for k in ("listing_requests", "storage_reads", "cache_hits")}
COLUMNS |= {f"CPU s {p}": (f"{p}_cpu_s", *S) for p in ("loader", "proxy", "moto")}
PER_GET = {"cpu_ms_per_get": lambda r: 1e3 * r["epochs"][0]["loader_cpu_s"] / r["epochs"][0]["samples"]}
PER_GET["gets_per_s"] = lambda r: r["epochs"][0]["samples_per_s"]  # --clients: per run, of its one epoch


def getter(client: str, keys: list[str], sizes: list[int]):
    """``get(ks)``: GETs keys ``ks`` with ``client`` (obstore: coordl's reads; boto3: 64 threads) into buffers."""
    buffers = [np.empty(s, dtype=np.uint8) for s in sizes]
    if client == "obstore":
        from coordl.s3 import reads

        def get(ks):
            urls, n = [f"s3://{BUCKET}/{keys[k]}" for k in ks], len(ks)
            failed = reads.read_many(urls, [sizes[k] for k in ks], [None] * n, [[buffers[k]] for k in ks])
            assert not failed, failed

        return get
    from coordl.s3 import client as s3client

    s3, pool = s3client.boto3_client(), ThreadPoolExecutor(IN_FLIGHT)

    def one(k: int) -> None:
        memoryview(buffers[k]).cast("B")[:] = s3.get_object(Bucket=BUCKET, Key=keys[k])["Body"].read()

    return lambda ks: list(pool.map(one, ks))


def made(spec: dict, others=None):
    """``(epoch, threads, loader)``: ``epoch()`` runs one, returns its samples (``capacity``, ``client``: every key
    GET once; ``dali``: files, or tar ``shards``; ``others[kind](spec)``: another library's loader, in ``workers``
    DataLoader workers); ``loader``: coordl's (``Cache(size=cache, disk=tier)``) or None."""
    kind, n = spec["kind"], len(spec.get("keys", ()))
    if kind in (others or {}):
        dl = others[kind](spec)
        return lambda: sum(len(batch[1]) for batch in dl), spec["workers"], None  # (images, labels)
    if kind in ("capacity", "client"):
        get = getter(spec["client"], spec["keys"], spec["sizes"])
        get(range(8))  # the client made, its first connections open

        def epoch() -> int:
            get(range(n))
            return n

        return epoch, None, None
    if kind == "coordl":
        import coordl

        disk = coordl.Disk(spec["tier"], direct=spec["direct"]) if spec.get("tier") else None
        kw = {"batch_size": spec["batch"], "shuffle": True, "device_id": None, "pipeline": "imagenet-train"}
        loader = coordl.CoordLoader(spec["url"], cache=coordl.Cache(size=spec["cache"], disk=disk), **kw)
        return lambda: sum(len(batch[1]) for batch in loader), loader.num_threads, loader
    from nvidia.dali import fn, pipeline_def

    @pipeline_def(batch_size=spec["batch"], num_threads=spec["threads"], device_id=None, seed=1, prefetch_queue_depth=2)
    def pipe():
        if "shards" not in spec:
            jpegs, labels = fn.readers.file(file_root=spec["url"], random_shuffle=True, name="Reader")
            return dali_imagenet_train(jpegs), labels
        # tar shards; dont_use_mmap: read as the others do (a mapping keeps the shards' pages through drop_caches)
        kw = {"index_paths": spec["dali_index"], "ext": ["jpg", "cls"], "random_shuffle": True, "dont_use_mmap": True}
        jpegs, labels = fn.readers.webdataset(paths=spec["shards"], name="Reader", **kw)
        return dali_imagenet_train(jpegs), fn.pad(labels, axes=(0,), shape=(8,))  # the label's text, padded

    (p := pipe()).build()  # lists the root (an s3:// one with ListObjectsV2)
    it = [dali_iterator(p)] if "shards" in spec else []  # files: made at the first epoch (it starts the read-ahead)

    def epoch() -> int:
        it[:] = it or [dali_iterator(p)]
        return sum(len(batch[0]["labels"]) for batch in it[0])

    return epoch, spec["threads"], None


def child(spec: dict, others=None, cpu=time.process_time) -> None:
    """A child: its loader made (:func:`made`), its epochs each said to the parent and awaited (CPU: ``cpu()``)."""
    parent, t0, c0 = jobs.Parent(), time.perf_counter(), cpu()
    epoch, threads, loader = made(spec, others)  # its imports included
    parent.say(event="created", create_s=time.perf_counter() - t0, cpu_s=cpu() - c0, threads=threads)
    for e in range(spec["epochs"]):
        parent.wait()
        t0, c0 = time.perf_counter(), cpu()
        got = epoch()
        seconds = time.perf_counter() - t0
        row = {"epoch": e, "samples": got, "seconds": seconds, "samples_per_s": got / seconds, "cpu_s": cpu() - c0}
        if loader is not None:
            row["stats"] = {k: v for k, v in loader.stats().items() if k != "skipped_paths"}
        parent.say(event="epoch", **row)
    parent.wait()
    if loader is not None:
        loader.close()  # a tier's writer finishes what it was given
    parent.say(event="done")


class Meter:
    """What the server did between two readings: requests, bytes, CPU of the proxy and moto."""

    def __init__(self, server):
        self.server, self.moto = server, server._proc.pid
        self.start()

    def start(self) -> None:
        self.server.reset()
        self.t_proxy, self.t_moto = time.process_time(), measure.process_cpu_seconds(self.moto)

    def read(self) -> dict:
        s, cpu = self.server, time.process_time() - self.t_proxy
        out = {"gets": s.count("GET"), "get_bytes": s.bytes_sent("GET"), "proxy_cpu_s": cpu}
        out["listing_requests"] = s.count("GET", objects_only=False) - out["gets"]
        out["moto_cpu_s"] = measure.process_cpu_seconds(self.moto) - self.t_moto
        self.start()
        return out


def run_one(args, server, name: str, keys: list[str], sizes: list[int]) -> dict:
    """One configuration in a fresh child process; its per-epoch rows with the server's counts."""
    kind, setting = name.split("-", 1)
    spec = {"kind": kind, "url": args.data if name == "dali-local" else f"s3://{BUCKET}/{PREFIX}", "batch": BATCH}
    spec |= {"epochs": 1 if kind in ("capacity", "client") else EPOCHS, "keys": keys, "sizes": sizes}
    spec |= {"cache": float(setting) if kind == "coordl" else 0, "client": setting if kind == "client" else "obstore"}
    spec["threads"] = THREADS  # DALI's
    server.latency_s = float(setting) if kind == "capacity" else args.latency  # each run's own
    env = {**os.environ, **server.env(), "COORDL_S3_REQUESTS": str(IN_FLIGHT)}  # coordl's default, the clients' too
    if kind == "client":  # moto itself, no proxy
        env["AWS_ENDPOINT_URL"] = server.direct
    return {"config": name, "latency_s": server.latency_s} | run_child("s3", spec, Meter(server), env)


def run_child(scenario: str, spec: dict, meter, env: dict, created=lambda: None, **popen) -> dict:
    """``python -m benchmarks <scenario> --one <spec>`` (a :func:`child`, with an index and shm folder of its own),
    ``meter.read()`` after its loader is made (then ``created()``) and after each epoch: its making, epochs or error."""
    run, t0 = {"epochs": []}, time.perf_counter()

    def heard(event: str, msg: dict) -> None:
        counts = meter.read()
        if event == "created":
            run.update(made_s=time.perf_counter() - t0, create_s=msg["create_s"])
            run.update(create_cpu_s=msg["cpu_s"], threads=msg["threads"], create_requests=counts)
            created()
        else:
            run["epochs"].append({**msg, "loader_cpu_s": msg.pop("cpu_s"), **counts})

    with tempfile.TemporaryDirectory() as tmp, tempfile.TemporaryDirectory(dir="/dev/shm") as shm:
        (Path(tmp) / "spec.json").write_text(json.dumps(spec))
        command = jobs.scenario_command(scenario, "--one", f"{tmp}/spec.json")
        env = env | {"COORDL_INDEX_DIR": tmp, "COORDL_SHM_DIR": shm}
        code, err, _ = jobs.converse(command, heard, env=env, **popen)
    if code != 0 or len(run["epochs"]) < spec["epochs"]:
        run["error"] = jobs.error_text(err) or f"exit status {code}"
    return run


def summarise(runs: dict[str, list[dict]], fields, counters, **figures) -> dict:
    """Per configuration and epoch, the spread of ``fields`` and coordl's ``counters``; of ``figures`` (its runs')."""

    def extra(ok):
        return {k: measure.spread_all([f(r) for r in ok]) for k, f in figures.items()}

    return measure.rounds(runs, fields, counters, measure.spread_all, extra)


def epochs_table(summary: dict, columns: dict) -> str:
    """Per configuration and epoch, the medians of ``columns`` (heading: (field, scale, format); samples/s with
    [min-max]), then each configuration's failed runs and their first error."""
    rows, notes = [], []
    for name, s in summary.items():
        for ep in s.get("epochs", []):
            cells = (report.spread(ep.get(k), f, k == "samples_per_s", sc) for k, sc, f in columns.values())
            rows.append([name, ep["epoch"], *cells])
        if s["ok"] < s["rounds"]:
            notes += [f"{name}: {s['rounds'] - s['ok']} of {s['rounds']} run(s) failed:", s["errors"][0]]
    return "\n".join([report.table(["config", "epoch", *columns], rows), *notes])


def table(result: dict) -> str:
    if "config" not in result:  # --clients
        cells = ([n, *(report.spread(s.get(k), "{:.2f}", True) for k in PER_GET)] for n, s in result["summary"].items())
        return report.table("client|ms CPU per GET|GET/s", list(cells))
    what = f"latency {result['config']['latency_s'] * 1000:g} ms per request; {result['config']['repeat']} round(s)"
    server = f"server capacity: the capacity-* rows (obstore, {IN_FLIGHT} GETs in flight, every object once)"
    return "\n".join([f"{what}; medians, [min-max]", epochs_table(result["summary"], COLUMNS), server])


def options(p) -> None:
    dataset.add_dataset_options(p, data="/var/tmp/coordl-bench/bench", images=4436, classes=100)
    p.add_argument("--clients", action="store_true", help="the clients' CPU per GET instead (see above)")
    p.add_argument("--objects", type=int, default=1000, help="--clients: objects GET per run (default: 1000)")
    p.add_argument("--latency", type=float, default=0.02, help="seconds added before each request (default: 0.02)")
    p.add_argument("--repeat", type=int, default=3, help="rounds of every configuration (default: 3)")
    p.add_argument("--one", help=argparse.SUPPRESS)  # a child: one configuration, spec in this JSON file


def run(args) -> dict | None:
    if args.one:
        return child(json.loads(Path(args.one).read_text()))  # a failure: exit 1
    from coordl_testing.s3server import S3Server

    data = dataset.dataset_from_args(args)
    args.data = data["root"]
    names = [*(f"coordl-{c:g}" for c in CACHES), "dali-s3", "dali-local", "capacity-0", f"capacity-{args.latency:g}"]
    with S3Server() as server:
        moto_pid = server._proc.pid  # gone after the run: tests/test_benchmarks.py checks
        server.create_bucket(BUCKET)
        keys = server.upload_tree(args.data, BUCKET, PREFIX)
        sizes = [Path(args.data, k[len(PREFIX) + 1 :]).stat().st_size for k in keys]
        if args.clients:  # each client in a process of its own, against moto alone (run_one: no proxy)
            names, keys, sizes = [f"client-{c}" for c in CLIENTS], keys[: args.objects], sizes[: args.objects]
        runs = measure.in_rounds(names, args.repeat, lambda name: run_one(args, server, name, keys, sizes), log)
    if args.clients:
        summary = summarise(runs, (), (), **PER_GET)
        return {"dataset": data, "objects": len(keys), "in_flight": IN_FLIGHT, "runs": runs, "summary": summary}
    config = {"latency_s": args.latency, "epochs": EPOCHS, "repeat": args.repeat, "batch": BATCH, "caches": CACHES}
    config |= {"dali_threads": THREADS, "in_flight": IN_FLIGHT, "url": f"s3://{BUCKET}/{PREFIX}"}
    result = {"config": config | {"configurations": names}, "dataset": data, "objects": len(keys), "moto_pid": moto_pid}
    fields = "seconds samples_per_s gets get_bytes listing_requests loader_cpu_s proxy_cpu_s moto_cpu_s".split()
    counters = ("storage_reads", "storage_bytes", "cache_hits", "cache_items", "stall_fetch_s", "stall_prep_s")
    listing = {"create_listing_requests": lambda r: r["create_requests"]["listing_requests"]}  # making the loader
    result |= {"runs": runs, "summary": (summary := summarise(runs, fields, counters, **listing))}
    if dali := summary.get("dali-s3"):
        result["dali_s3"] = {"works": dali["ok"] > 0, "error": dali["errors"][0] if dali["errors"] else None}
    return result


def out_path(args) -> str:
    """``--clients`` writes ``s3_clients.json`` where the loaders write ``s3.json``."""
    return args.out.replace("s3.json", "s3_clients.json") if args.clients else args.out
