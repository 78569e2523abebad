"""Client CPU time per GET: obstore (coordl's data plane) against boto3, on the same objects.

Why coordl reads with obstore: on a machine whose cores also decode images, the CPU a client spends
per request is taken from pre-processing. Each client runs in a process of its own against moto's
S3 server (another process, no proxy), GETs the same objects with 64 requests in flight into
buffers of their sizes, and reports its own CPU time (user + system, all threads) per GET and
its GETs per second. The server shares the machine's cores, so GETs/s is the server's bound as
much as the client's; CPU per GET is the client's alone. Rounds alternate the clients.

    python -m benchmarks s3_clients --data /var/tmp/coordl-bench/bench --images 4436 --classes 100 --objects 1000
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import time
from pathlib import Path

from benchmarks.harness import dataset, jobs, measure

CLIENTS = ("obstore", "boto3")
BUCKET = "coordl-clients"


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _one(client: str, keys: list[str], sizes: list[int]) -> dict:
    """GETs every key once with ``client`` in this process; its CPU time and wall time."""
    import numpy as np

    buffers = [np.empty(s, dtype=np.uint8) for s in sizes]
    if client == "obstore":
        from coordl.s3 import reads

        urls = [f"s3://{BUCKET}/{k}" for k in keys]
        reads.read_many(urls[:8], sizes[:8], [None] * 8, [[b] for b in buffers[:8]])  # the clients, made
        c0, t0 = _cpu(), time.perf_counter()
        failed = reads.read_many(urls, sizes, [None] * len(urls), [[b] for b in buffers])
        c1, t1 = _cpu(), time.perf_counter()
        assert not failed, failed
    else:
        import concurrent.futures as cf

        from coordl.s3 import client as s3client

        s3 = s3client.boto3_client()

        def get(k: int) -> None:
            body = s3.get_object(Bucket=BUCKET, Key=keys[k])["Body"].read()
            memoryview(buffers[k]).cast("B")[:] = body

        with cf.ThreadPoolExecutor(64) as pool:
            list(pool.map(get, range(8)))
            c0, t0 = _cpu(), time.perf_counter()
            list(pool.map(get, range(len(keys))))
            c1, t1 = _cpu(), time.perf_counter()
    gets = len(keys)
    return {"client": client, "gets": gets, "cpu_ms_per_get": 1e3 * (c1 - c0) / gets, "gets_per_s": gets / (t1 - t0)}


def options(p) -> None:
    dataset.add_dataset_options(p, data="/var/tmp/coordl-bench/bench", images=4436, classes=100)
    p.add_argument("--objects", type=int, default=1000, help="objects of the dataset to GET per run")
    p.add_argument("--repeat", type=int, default=3, help="rounds of both clients")
    p.add_argument("--one", default="", help=argparse.SUPPRESS)  # a client's run, in a process of its own


def run(args) -> dict | None:
    if args.one:
        job = json.loads(Path(args.one).read_text())
        return jobs.say(**_one(job["client"], job["keys"], job["sizes"]))

    from coordl_testing.s3server import S3Server

    data = dataset.dataset_from_args(args)
    files = sorted(f for f in Path(args.data).rglob("*") if f.is_file())[: args.objects]
    keys = [str(f.relative_to(args.data)) for f in files]
    sizes = [f.stat().st_size for f in files]
    print(f"dataset: {dataset.describe(data)}; {len(keys)} objects, {sum(sizes) / 1e6:.1f} MB per run")
    rows = []
    with S3Server() as server:
        server.create_bucket(BUCKET)
        client = server.client()
        for f, k in zip(files, keys):
            client.upload_file(str(f), BUCKET, k)
        job = Path(f"/tmp/coordl-s3-clients-{os.getpid()}.json")
        job.write_text(json.dumps({"keys": keys, "sizes": sizes}))
        env = {**os.environ, **server.env(), "AWS_ENDPOINT_URL": server.direct}  # no proxy: the client alone
        try:
            for r, name in measure.alternate(list(CLIENTS), args.repeat):
                job.write_text(json.dumps({"client": name, "keys": keys, "sizes": sizes}))
                row = jobs.run_json(jobs.scenario_command("s3_clients", "--one", str(job)), env=env, timeout=600)
                rows.append(row | {"round": r})
                print(f"round {r} {name:8s} {row['cpu_ms_per_get']:.2f} ms CPU per GET, {row['gets_per_s']:.0f} GET/s")
        finally:
            job.unlink(missing_ok=True)

    def median(name, m):
        return statistics.median(x[m] for x in rows if x["client"] == name)

    medians = {name: {m: median(name, m) for m in ("cpu_ms_per_get", "gets_per_s")} for name in CLIENTS}
    return {"dataset": data, "objects": len(keys), "in_flight": 64, "rows": rows, "medians": medians}


def table(r: dict) -> str:
    return "\n".join(
        f"{name:8s} median: {m['cpu_ms_per_get']:.2f} ms CPU per GET, {m['gets_per_s']:.0f} GET/s"
        for name, m in r["medians"].items()
    )
