"""An s3:// dataset behind added latency: coordl at 0%, 50% and 100% cache against DALI's reader; clients' CPU per GET.

The store is moto's S3 server behind ``coordl_testing.s3server.S3Server``'s proxy on 127.0.0.1, which
waits ``--latency`` seconds before forwarding each request and counts what it forwards. The dataset is
uploaded once (not counted); then, in ``--repeat`` rounds in ABBA order, every configuration runs in a
fresh process (its own ``COORDL_SHM_DIR`` and ``COORDL_INDEX_DIR``), ``--epochs`` epochs each:

- ``coordl-0``, ``coordl-0.5``, ``coordl-1``: ``CoordLoader("s3://...", cache=f, pipeline="imagenet-train")``;
- ``dali-s3``: ``fn.readers.file(file_root="s3://...", random_shuffle=True)`` and the same recipe, as many
  threads as coordl; ``dali-local``: the same on the local copy (page cache warm), for reference;
- ``capacity-0`` and ``capacity-<latency>``: no loader, every object GET once with obstore, 64 in flight.

Per epoch: seconds, samples/s, the object GETs and bytes the proxy saw, listings, coordl's counters, and
the CPU seconds of the loader, the proxy and moto; per run the time to make the loader.

    python -m benchmarks s3 --data /var/tmp/coordl-bench/bench --images 4436 --classes 100   # ~16 min

``--clients`` measures instead the client CPU time per GET, obstore (coordl's data plane) against boto3: on
a machine whose cores also decode images, the CPU a client spends per request is taken from prep. Each
client GETs the same ``--objects`` objects, 64 in flight, into buffers of their sizes, in a process of its
own against moto's server (no proxy), rounds alternated; GETs/s is the server's bound as much as the
client's, CPU per GET the client's alone.

    python -m benchmarks s3 --clients --data /var/tmp/coordl-bench/bench --images 4436 --classes 100
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.harness import dataset, jobs, measure, report
from benchmarks.harness.report import log
from benchmarks.loaders import dali_imagenet_train, dali_iterator

CLIENTS = ("obstore", "boto3")


def _cpu() -> float:
    t = os.times()
    return t.user + t.system


def getter(client: str, bucket: str, keys: list[str], sizes: list[int]):
    """``get(ks)``: GETs the keys at positions ``ks`` with ``client`` into buffers of their sizes; with
    obstore through coordl's reads (``COORDL_S3_REQUESTS`` in flight), with boto3 from 64 threads."""
    buffers = [np.empty(s, dtype=np.uint8) for s in sizes]
    if client == "obstore":
        from coordl.s3 import reads

        def get(ks):
            urls, n = [f"s3://{bucket}/{keys[k]}" for k in ks], len(ks)
            failed = reads.read_many(urls, [sizes[k] for k in ks], [None] * n, [[buffers[k]] for k in ks])
            assert not failed, failed

        return get
    import concurrent.futures as cf

    from coordl.s3 import client as s3client

    s3, pool = s3client.boto3_client(), cf.ThreadPoolExecutor(64)

    def one(k: int) -> None:
        memoryview(buffers[k]).cast("B")[:] = s3.get_object(Bucket=bucket, Key=keys[k])["Body"].read()

    return lambda ks: list(pool.map(one, ks))


# -- the children: one configuration in a fresh process ----------------------------------------------
def _dali_pipeline(root: str, batch: int, threads: int):
    from nvidia.dali import fn, pipeline_def

    @pipeline_def(batch_size=batch, num_threads=threads, device_id=None, seed=1, prefetch_queue_depth=2)
    def pipe():
        jpegs, labels = fn.readers.file(file_root=root, random_shuffle=True, name="Reader")
        return dali_imagenet_train(jpegs), labels

    return pipe()


def child(spec: dict) -> None:
    """A coordl or DALI loader made, then ``epochs`` epochs; or every key GET once (``capacity``, one
    epoch; ``client``, its CPU per GET): each reported and awaited."""
    parent, kind = jobs.Parent(), spec["kind"]
    if kind in ("capacity", "client"):
        get, n = getter(spec.get("client", "obstore"), spec["bucket"], spec["keys"], spec["sizes"]), len(spec["keys"])
        get(range(8))  # the client made, its first connections open
        if kind == "capacity":
            parent.say(event="created", create_s=0.0, cpu_s=0.0, threads=None, import_s=0.0)
            parent.wait()
        t0, c0 = time.perf_counter(), _cpu()
        get(range(n))
        seconds, cpu = time.perf_counter() - t0, _cpu() - c0
        if kind == "client":  # its figures, the last line of its output
            return jobs.say(client=spec["client"], gets=n, cpu_ms_per_get=1e3 * cpu / n, gets_per_s=n / seconds)
        row = {"epoch": 0, "samples": n, "seconds": seconds, "samples_per_s": n / seconds, "cpu_s": cpu}
        parent.say(event="epoch", **row, bytes=sum(spec["sizes"]))
        parent.wait()
        return parent.say(event="done")
    # Every library either loader uses is imported before the clock starts (``import_s``): making
    # the loader (``create_s``) is then listing, indexing and building the pipeline.
    t0 = time.perf_counter()
    import boto3  # noqa: F401
    import nvidia.dali.fn  # noqa: F401
    import obstore  # noqa: F401
    import torch  # noqa: F401

    import coordl

    import_s = time.perf_counter() - t0
    t0, c0 = time.perf_counter(), _cpu()
    if kind == "coordl":
        kw = {"batch_size": spec["batch"], "cache": spec["cache"], "shuffle": True}
        loader = coordl.CoordLoader(spec["url"], device_id=None, pipeline="imagenet-train", **kw)
        threads, epoch = loader.num_threads, lambda: loader
    else:
        threads = spec["threads"]
        pipe = _dali_pipeline(spec["url"], spec["batch"], threads)
        pipe.build()  # lists the root (an s3:// one with ListObjectsV2)
        made = []  # the iterator, made at the first epoch: it starts the pipeline's read-ahead
        epoch = lambda: made[0] if made else made.append(dali_iterator(pipe)) or made[0]  # noqa: E731
    parent.say(
        event="created", create_s=time.perf_counter() - t0, cpu_s=_cpu() - c0, threads=threads, import_s=import_s
    )
    parent.wait()
    for e in range(spec["epochs"]):
        t0, c0 = time.perf_counter(), _cpu()
        n = sum(len(batch[1]) if kind == "coordl" else batch[0]["labels"].shape[0] for batch in epoch())
        seconds = time.perf_counter() - t0
        row = {"epoch": e, "samples": n, "seconds": seconds, "samples_per_s": n / seconds, "cpu_s": _cpu() - c0}
        if kind == "coordl":
            s = loader.stats()
            row["stats"] = {k: v for k, v in s.items() if k != "skipped_paths"}
            # read_s sums the time coordl's io threads spent in storage reads (each a call with many GETs in
            # flight): over the epoch's seconds, how many of those threads were reading on average
            row["threads_reading"] = s["read_s"] / seconds
        parent.say(event="epoch", **row)
        parent.wait()
    if kind == "coordl":
        loader.close()
    parent.say(event="done")


# -- the parent: the server, the rounds, the children ------------------------------------------------
def _moto_cpu(server) -> float | None:
    """moto's CPU seconds so far, None when it cannot be read."""
    proc = getattr(server, "_proc", None)
    return None if proc is None else measure.process_cpu_seconds(proc.pid)


class Meter:
    """What the server did between two readings: requests, bytes, CPU of the proxy and moto."""

    def __init__(self, server):
        self.server = server
        self.start()

    def start(self) -> None:
        self.server.reset()
        self.t_proxy, self.t_moto = _cpu(), _moto_cpu(self.server)

    def read(self) -> dict:
        s = self.server
        moto = _moto_cpu(s)
        out = {
            "gets": s.count("GET"),
            "get_bytes": s.bytes_sent("GET"),
            "other_requests": len(s.requests()) - s.count("GET"),
            "listing_requests": s.count("GET", objects_only=False) - s.count("GET"),
            "errors": sum(1 for r in s.requests() if r[2] >= 400 or r[2] == 0),
            "distinct_keys": len({r[1].split("?", 1)[0] for r in s.requests("GET") if r[2] < 300}),
            "proxy_cpu_s": _cpu() - self.t_proxy,
            "moto_cpu_s": None if moto is None or self.t_moto is None else moto - self.t_moto,
        }
        self.start()
        return out


def run_one(args, server, name: str, keys: list[str], sizes: list[int]) -> dict:
    """One configuration in a fresh child process; its per-epoch rows with the server's counts."""
    url, kind = f"s3://{args.bucket}/{args.prefix}", name.split("-", 1)[0]
    spec = {"kind": kind, "url": url, "batch": args.batch, "threads": args.threads, "epochs": args.epochs}
    spec |= {"bucket": args.bucket, "keys": keys, "sizes": sizes}
    if kind == "coordl":
        spec["cache"] = float(name.split("-", 1)[1])
    if name == "dali-local":
        spec["url"] = args.data
    server.latency_s = float(name.split("-", 1)[1]) if kind == "capacity" else args.latency
    shm = tempfile.mkdtemp(dir="/dev/shm", prefix="coordl-s3bench-")
    index = tempfile.mkdtemp(prefix="coordl-s3bench-index-")
    env = {**os.environ, **server.env(), "COORDL_SHM_DIR": shm, "COORDL_INDEX_DIR": index}
    env.pop("COORDL_S3_REQUESTS", None)
    if args.requests or kind == "capacity":
        env["COORDL_S3_REQUESTS"] = str(args.capacity_inflight if kind == "capacity" else args.requests)
    (spec_file := Path(index) / "spec.json").write_text(json.dumps(spec))
    meter = Meter(server)
    run = {"config": name, "latency_s": server.latency_s, "epochs": []}

    def heard(event: str, msg: dict) -> None:
        counts = meter.read()
        if event == "created":
            run.update(import_s=msg["import_s"], create_s=msg["create_s"], create_cpu_s=msg["cpu_s"])
            run.update(threads=msg["threads"], create_requests=counts)
        else:
            run["epochs"].append({**msg, "loader_cpu_s": msg.pop("cpu_s"), **counts})

    try:
        code, err, _ = jobs.converse(jobs.scenario_command("s3", "--one", str(spec_file)), heard, env=env)
    finally:
        server.latency_s = args.latency
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(index, ignore_errors=True)
    if code != 0 or len(run["epochs"]) < (1 if kind == "capacity" else args.epochs):
        run["error"] = jobs.error_text(err) or f"exit status {code}"
    return run


def summarise(runs: dict[str, list[dict]]) -> dict:
    """Per configuration and epoch: the median and range of every measured value over the rounds."""
    fields = "seconds samples_per_s gets get_bytes listing_requests loader_cpu_s proxy_cpu_s moto_cpu_s threads_reading"
    stats_fields = ("storage_reads", "storage_bytes", "cache_hits", "cache_items", "stall_fetch_s", "stall_prep_s")

    def extra(ok):
        figures = {"import_s": [r["import_s"] for r in ok], "create_s": [r["create_s"] for r in ok]}
        figures["create_listing_requests"] = [r["create_requests"]["listing_requests"] for r in ok]
        return {k: measure.spread_all(v) for k, v in figures.items()}

    return measure.rounds(runs, fields.split(), stats_fields, measure.spread_all, extra)


def table(result: dict) -> str:
    if "medians" in result:  # --clients
        ms = result["medians"].items()
        return "\n".join(
            f"{c:8s} median: {m['cpu_ms_per_get']:.2f} ms CPU per GET, {m['gets_per_s']:.0f} GET/s" for c, m in ms
        )
    cell, rows, caps = report.spread, [], []
    for name, s in result["summary"].items():
        for ep in s.get("epochs", []) if not name.startswith("capacity-") else []:
            first = ep["epoch"] == 0
            cpu = " / ".join(cell(ep.get(k), "{:.1f}") for k in ("loader_cpu_s", "proxy_cpu_s", "moto_cpu_s"))
            rows.append(
                [name, ep["epoch"], cell(ep["samples_per_s"], rng=True), cell(ep["seconds"], "{:.1f}")]
                + [cell(s["create_s"], "{:.1f}") if first else "", cell(ep.get("gets"))]
                + [
                    cell(ep.get("get_bytes"), "{:.1f}", scale=1e6),
                    cell(s["create_listing_requests"] if first else ep.get("listing_requests")),
                ]
                + [
                    cell(ep.get("storage_reads")),
                    cell(ep.get("cache_hits")),
                    cell(ep.get("threads_reading"), "{:.1f}"),
                    cpu,
                ]
            )
        if name.startswith("capacity-") and s["ok"]:
            ep = s["epochs"][0]
            caps.append(
                f"  latency {name.split('-', 1)[1]} s: {cell(ep['samples_per_s'], rng=True)} GETs/s, "
                f"{ep['get_bytes']['median'] / ep['seconds']['median'] / 1e6:.0f} MB/s; CPU s client / proxy / moto "
                + " / ".join(cell(ep.get(k), "{:.1f}") for k in ("loader_cpu_s", "proxy_cpu_s", "moto_cpu_s"))
            )
        if s["ok"] < s["rounds"]:
            caps += [f"{name}: {s['rounds'] - s['ok']} of {s['rounds']} run(s) failed:", s["errors"][0]]
    head = "config|epoch|samples/s|s|make s|object GETs|MB|listing reqs|storage_reads|cache_hits|io threads reading"
    lat = result["config"]["latency_s"]
    return "\n".join(
        [f"latency {lat * 1000:g} ms per request; {result['config']['repeat']} round(s); medians, [min-max]"]
        + [report.table(head + "|CPU s loader / proxy / moto", rows), ""]
        + [f"server capacity (obstore, {result['config']['capacity_inflight']} GETs in flight, every object once):"]
        + caps
    )


def options(p) -> None:
    dataset.add_dataset_options(p, data="/var/tmp/coordl-bench/bench", images=4436, classes=100)
    p.add_argument("--clients", action="store_true", help="the clients' CPU per GET instead (see above)")
    p.add_argument("--objects", type=int, default=1000, help="--clients: objects GET per run (default: 1000)")
    p.add_argument("--latency", type=float, default=0.02, help="seconds added before each request (default: 0.02)")
    p.add_argument("--epochs", type=int, default=2, help="epochs per run: the first and steady ones (default: 2)")
    p.add_argument("--repeat", type=int, default=3, help="rounds of every configuration (default: 3)")
    p.add_argument("--batch", type=int, default=64)
    caches = "coordl's cache_bytes, fractions of the dataset (default: 0 0.5 1)"
    p.add_argument("--caches", type=float, nargs="+", default=[0.0, 0.5, 1.0], help=caches)
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="DALI's threads (default: os.cpu_count())")
    p.add_argument("--requests", type=int, help="COORDL_S3_REQUESTS for coordl (default: coordl's own, 64)")
    p.add_argument("--capacity-inflight", type=int, default=64, help="GETs in flight for the capacity runs")
    p.add_argument("--bucket", default="coordl-bench")
    p.add_argument("--prefix", default="bench/train")
    p.add_argument("--skip-dali", action="store_true", help="only coordl (and the capacity runs)")
    p.add_argument("--skip-capacity", action="store_true")
    p.add_argument("--one", help=argparse.SUPPRESS)  # a child: one configuration, spec in this JSON file


def clients(args, server, keys: list[str], sizes: list[int]) -> dict:
    """Each client in a process of its own against moto alone (no proxy), rounds alternated."""
    folder = Path(tempfile.mkdtemp(prefix="coordl-s3-clients-"))
    env = {**os.environ, **server.env(), "AWS_ENDPOINT_URL": server.direct, "COORDL_S3_REQUESTS": "64"}
    rows = []
    try:
        for r, name in measure.alternate(list(CLIENTS), args.repeat):
            spec = {"kind": "client", "client": name, "bucket": args.bucket, "keys": keys, "sizes": sizes}
            (folder / "spec.json").write_text(json.dumps(spec))
            command = jobs.scenario_command("s3", "--one", str(folder / "spec.json"))
            rows.append(row := jobs.run_json(command, env=env, timeout=600) | {"round": r})
            log(f"round {r} {name:8s} {row['cpu_ms_per_get']:.2f} ms CPU per GET, {row['gets_per_s']:.0f} GET/s")
    finally:
        shutil.rmtree(folder)
    figures = ("cpu_ms_per_get", "gets_per_s")
    medians = {c: {k: statistics.median(x[k] for x in rows if x["client"] == c) for k in figures} for c in CLIENTS}
    return {"objects": len(keys), "in_flight": 64, "rows": rows, "medians": medians}


def run(args) -> dict | None:
    if args.one:
        return child(json.loads(Path(args.one).read_text()))  # a failure: exit 1
    from coordl_testing.s3server import S3Server

    data = dataset.dataset_from_args(args)
    args.data = data["root"]
    log(f"dataset: {dataset.describe(data)}")
    names = [f"coordl-{c:g}" for c in args.caches] + ([] if args.skip_dali else ["dali-s3", "dali-local"])
    names += [] if args.skip_capacity else ["capacity-0", f"capacity-{args.latency:g}"]
    t_start = time.time()
    with S3Server() as server:
        moto_pid = getattr(getattr(server, "_proc", None), "pid", None)
        server.create_bucket(args.bucket)
        t0 = time.perf_counter()
        keys = server.upload_tree(args.data, args.bucket, args.prefix)
        log(f"uploaded {len(keys)} objects to s3://{args.bucket}/{args.prefix} in {time.perf_counter() - t0:.1f} s")
        sizes = [Path(args.data, k[len(args.prefix) + 1 :]).stat().st_size for k in keys]
        if args.clients:
            return {"dataset": data, **clients(args, server, keys[: args.objects], sizes[: args.objects])}
        server.latency_s = args.latency
        # dali-s3 failed before: the reason is recorded, it is not tried again
        failed = lambda name, done: name == "dali-s3" and done and all("error" in r for r in done)  # noqa: E731
        one = lambda name: run_one(args, server, name, keys, sizes)  # noqa: E731
        runs = measure.in_rounds(names, args.repeat, one, log, failed)
    config = {"latency_s": args.latency, "epochs": args.epochs, "repeat": args.repeat, "batch": args.batch}
    config |= {"caches": args.caches, "dali_threads": args.threads, "coordl_s3_requests": args.requests or 64}
    config |= {"capacity_inflight": args.capacity_inflight, "url": f"s3://{args.bucket}/{args.prefix}"}
    config |= {"pipeline": "imagenet-train", "configurations": names}
    result = {"config": config, "dataset": data, "objects": len(keys), "moto_pid": moto_pid}  # moto: stopped at the end
    result |= {"wall_s": time.time() - t_start, "runs": runs, "summary": summarise(runs)}
    dali = result["summary"].get("dali-s3")
    if dali is not None:
        result["dali_s3"] = {"works": dali["ok"] > 0, "error": dali["errors"][0] if dali["errors"] else None}
    return result


def out_path(args) -> str:
    """``--clients`` writes ``s3_clients.json`` where the loaders write ``s3.json``."""
    return args.out.replace("s3.json", "s3_clients.json") if args.clients else args.out
