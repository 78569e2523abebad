"""The local-storage tier (Cache(disk=...)) on an s3:// dataset 4x the memory cache behind a slow store.

The store: moto's S3 server behind ``S3Server``'s counting proxy, ``--latency`` before each request,
bodies at ``--bandwidth`` (all connections together); the dataset uploaded as files and as LitData's
and Mosaic's chunks (conversions timed apart). ``--repeat`` rounds, ABBA, each configuration in a
fresh process (its own shm, index, TMPDIR and folders; page cache dropped unless ``--no-drop``),
``--epochs`` epochs, batch 64: ``no-tier`` (``Cache(size=M)``, M = ``--memory`` of the dataset);
``tier`` (``disk=Disk(folder in --tier-root)``); ``tier-direct`` (``direct=True``); ``local`` (the
same loader on the local folder: the bound); ``litdata``, ``mosaic`` (:mod:`.disk_tier_baselines`,
caches 4x their chunks). After a tier's run its entries are read back from ``--read-threads``
threads. Per epoch: seconds, GETs and bytes, coordl's counters, CPU, the device's reads and writes,
the page cache and the configuration's files in it (``fincore``); ratios of the tiers' steady
samples/s to the others'.

    python -m benchmarks disk_tier            # ~15 min on 2 cores; --smoke: 48 small photos, no Mosaic, ~35 s
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks import disk_tier_baselines
from benchmarks.harness import cli, dataset, jobs, limits, measure, report
from benchmarks.harness.report import log, mb
from benchmarks.s3 import Meter

CONFIGS = ("no-tier", "tier", "tier-direct", "local", "litdata", "mosaic")
BASELINES = ("local", "no-tier", "litdata", "mosaic")  # (b) / each
BUCKET = "coordl-disk-tier"
SMOKE = ["--data", "/var/tmp/coordl-bench/disk-tier-smoke", "--images", "48", "--classes", "4", "--width", "160"]
SMOKE += ["--height", "120", "--epochs", "2", "--repeat", "1", "--chunk", "1MB", "--configs", ",".join(CONFIGS[:-1])]
SMOKE += ["--out", os.path.join(tempfile.gettempdir(), "disk_tier_smoke.json")]


# -- what the machine holds -------------------------------------------------------------------------
def meminfo() -> dict:
    """``/proc/meminfo``'s page cache (without shared memory), shared memory and dirty pages, in bytes."""
    m = {ln.split(":")[0]: int(ln.split()[1]) * 1024 for ln in Path("/proc/meminfo").read_text().splitlines()}
    return {"page_cache": m["Cached"] - m["Shmem"], "shmem": m["Shmem"], "dirty": m["Dirty"]}


def resident(folder: str | None) -> int | None:
    """Bytes of the files under ``folder`` in the page cache (util-linux ``fincore``); None without either."""
    if folder is None or shutil.which("fincore") is None:
        return None
    files, cmd = [os.path.join(d, f) for d, _, names in os.walk(folder) for f in names], ["fincore", "--bytes"]
    cmd += ["--noheadings", "--raw", "--output", "RES"]
    outs = (subprocess.run(cmd + files[k : k + 500], capture_output=True, text=True) for k in range(0, len(files), 500))
    return sum(int(x) for out in outs for x in out.stdout.split())


def device_io(dev: tuple[int, int]) -> tuple[int, int]:
    """Bytes read from and written to block device ``dev`` so far (``/proc/diskstats`` columns 6 and 10)."""
    for line in Path("/proc/diskstats").read_text().splitlines():
        p = line.split()
        if (int(p[0]), int(p[1])) == dev:
            return int(p[5]) * 512, int(p[9]) * 512
    return 0, 0


def tier_capacity(folder: str, direct: bool, threads: int, drop: bool) -> dict:
    """Reads every entry of the tier under ``folder`` once, in a shuffled order, from ``threads`` threads, as
    the tier reads (``O_DIRECT`` into an aligned buffer, or a read whose pages are dropped behind it), after
    dropping the page cache unless ``drop`` is False: the disk's rate for the tier's entries."""
    entry = re.compile(r"[0-9a-f]{32}")  # an entry's name; the tier's ledger, users and tmp/ are not read
    files = [os.path.join(d, f) for d, _, names in os.walk(folder) for f in names if entry.fullmatch(f)]
    random.Random(0).shuffle(files)
    if drop:
        limits.drop_page_cache()

    def read(path: str) -> int:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | (os.O_DIRECT if direct else 0))
        try:
            size = os.fstat(fd).st_size
            if direct:
                with mmap.mmap(-1, -(-size // 4096) * 4096 or 4096) as buf:  # page-aligned
                    return os.preadv(fd, [buf], 0)
            n = len(os.pread(fd, size, 0))
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            return n
        finally:
            os.close(fd)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        total = sum(pool.map(read, files))
    seconds = time.perf_counter() - t0
    out = {"threads": threads, "direct": direct, "files": len(files), "bytes": total, "seconds": seconds}
    return out | {"bytes_per_s": total / seconds, "files_per_s": len(files) / seconds}


# -- the parent -------------------------------------------------------------------------------------
def run_one(args, server, name: str, ctx: dict) -> dict:
    """One configuration in a fresh child; per epoch its figures, the proxy's counts and the machine's memory."""
    work = tempfile.mkdtemp(dir=args.tier_root, prefix="coordl-disk-tier-run-")
    shm = tempfile.mkdtemp(dir="/dev/shm", prefix="coordl-disk-tier-")
    tmp = tempfile.mkdtemp(prefix="coordl-dt-")  # short: sockets of DataLoader workers go there (108 bytes at most)
    base = {"batch": args.batch, "epochs": args.epochs}
    if name in ("litdata", "mosaic"):
        conv = ctx["conversions"][name]
        local = os.path.join(work, "cache")
        spec = {**base, "kind": name, "url": conv["url"], "local": local, "workers": args.workers}
        spec["cache_limit"] = 4 * conv["bytes"]
    else:
        local = None if name == "no-tier" else ctx["data"] if name == "local" else os.path.join(work, "tier")
        url = ctx["data"] if name == "local" else ctx["url"]
        tier = local if name.startswith("tier") else None
        if tier is not None:
            os.makedirs(tier, exist_ok=True)  # Disk(path) must exist: the tier is its sub-folder
        spec = {**base, "kind": "coordl", "url": url, "memory": ctx["memory"], "tier": tier}
        spec["direct"] = name == "tier-direct"
    env = {**os.environ, **server.env(), "S3_ENDPOINT_URL": server.endpoint, "COORDL_SHM_DIR": shm}
    env.update(COORDL_INDEX_DIR=os.path.join(work, "index"), TMPDIR=tmp)
    spec_file = Path(work) / "spec.json"
    spec_file.write_text(json.dumps(spec))
    shm_before = set(os.listdir("/dev/shm"))
    run = {"config": name, "epochs": [], "dropped_page_cache": None}
    if not args.no_drop:
        run["dropped_page_cache"] = limits.drop_page_cache() or True
    meter, dev = Meter(server), ctx["device"]
    io_was, mem_was = device_io(dev), meminfo()

    def heard(event: str, msg: dict) -> None:
        nonlocal io_was, mem_was
        counts = meter.read()
        if event == "created":
            run.update(msg, create_requests=counts)
        else:
            io_now, mem = device_io(dev), meminfo()
            msg.update(counts, loader_cpu_s=msg.pop("cpu_s"), resident_bytes=resident(local), meminfo=mem)
            msg["device_read"], msg["device_written"] = (a - b for a, b in zip(io_now, io_was))
            msg["page_cache_delta"] = mem["page_cache"] - mem_was["page_cache"]
            run["epochs"].append(msg)
        io_was, mem_was = device_io(dev), meminfo()

    try:
        code, err, done = jobs.converse(jobs.scenario_command("disk_tier", "--one", str(spec_file)), heard, env=env)
        run["close_s"] = done.get("close_s")
        if name.startswith("tier") and code == 0 and args.read_threads:
            direct = name == "tier-direct"  # the disk's rate for the tier's entries, the loader gone
            run["tier_read"] = [tier_capacity(local, direct, t, not args.no_drop) for t in args.read_threads]
    finally:
        leftovers = sorted(n for n in set(os.listdir("/dev/shm")) - shm_before if not n.startswith("coordl-"))
        for folder in (shm, work, tmp):
            shutil.rmtree(folder, ignore_errors=True)
    run["shm_left"] = leftovers  # new in /dev/shm (Mosaic's segments; another program's too): reported, not removed
    if code != 0 or len(run["epochs"]) < args.epochs:
        run["error"] = jobs.error_text(err) or f"exit status {code}"
    elif short := [(e["epoch"], e["samples"]) for e in run["epochs"] if e["samples"] != ctx["files"]]:
        run["error"] = f"epochs delivered other than {ctx['files']} samples (epoch, samples): {short}\n{err[-2000:]}"
    return run


def convert(args, server, kind: str, data: str, work: str) -> dict:
    """``kind``'s chunks of the dataset, made in a child (timed), uploaded straight to moto (timed)."""
    out, tmp, t0 = os.path.join(work, kind), tempfile.mkdtemp(prefix="coordl-dt-"), time.perf_counter()
    try:  # the conversion alone, and its imports, timed in the child
        cmd = jobs.scenario_command("disk_tier", "--convert", kind, data, out, args.chunk)
        timed = jobs.run_json(cmd, env={**os.environ, "TMPDIR": tmp})
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    r = {"seconds": timed["convert_s"], "import_s": timed["import_s"], "process_s": time.perf_counter() - t0}
    files = [p for p in Path(out).rglob("*") if p.is_file()]
    r |= {"files": len(files), "chunks": sum(p.suffix in (".bin", ".mds") for p in files)}
    r |= {"bytes": sum(p.stat().st_size for p in files), "url": f"s3://{BUCKET}/{kind}"}
    t0 = time.perf_counter()
    server.upload_tree(out, BUCKET, kind)
    shutil.rmtree(out)
    return r | {"upload_s": time.perf_counter() - t0}


def summarise(runs: dict[str, list[dict]]) -> dict:
    """Per configuration: median, min, max of every figure per epoch, and of the steady samples/s of each run."""
    fields = ("seconds", "samples_per_s", "gets", "get_bytes", "loader_cpu_s", "device_read", "device_written")
    fields += ("resident_bytes", "page_cache_delta")
    counters = ("storage_reads", "storage_bytes", "cache_hits", "disk_reads", "disk_bytes", "disk_admitted")
    counters += ("disk_cache_bytes", "stall_fetch_s", "stall_prep_s", "read_s", "prep_s")

    def extra(ok):
        figures = {"create_s": [r["create_s"] for r in ok], "steady_samples_per_s": [steady(r) for r in ok]}
        return {k: measure.spread_all(v) for k, v in figures.items()}

    return measure.rounds(runs, fields, counters, measure.spread_all, extra)


def steady(run: dict) -> float:
    """Samples/s over the epochs after the first."""
    rest = run["epochs"][1:]
    return sum(e["samples"] for e in rest) / sum(e["seconds"] for e in rest)


def ratios(runs: dict[str, list[dict]], summary: dict) -> dict:
    """Steady samples/s of (b) over each baseline: of the medians, and per round (runs of one round are neighbours)."""
    out = {}
    for tier in ("tier", "tier-direct"):
        for base in BASELINES:
            if summary.get(tier, {}).get("ok") and summary.get(base, {}).get("ok"):
                med = summary[tier]["steady_samples_per_s"]["median"] / summary[base]["steady_samples_per_s"]["median"]
                rounds = {r["round"]: steady(r) for r in runs[base] if "error" not in r}
                per = [steady(r) / rounds[r["round"]] for r in runs[tier] if "error" not in r and r["round"] in rounds]
                out[f"{tier}/{base}"] = {"of_medians": med, "per_round": per}
    return out


COLUMNS = {"samples/s": ("samples_per_s", 1, "{:.0f}"), "s": ("seconds", 1, "{:.1f}"), "GETs": ("gets", 1, "{:.0f}")}
COLUMNS |= {"store MB": ("get_bytes", 1e6, "{:.1f}"), "cache hits": ("cache_hits", 1, "{:.0f}")}
COLUMNS |= {"tier reads": ("disk_reads", 1, "{:.0f}"), "device MB read": ("device_read", 1e6, "{:.0f}")}
COLUMNS |= {"device MB written": ("device_written", 1e6, "{:.0f}")}
COLUMNS |= {"local files in page cache MB": ("resident_bytes", 1e6, "{:.1f}")}
COLUMNS |= {"page cache delta MB": ("page_cache_delta", 1e6, "{:.1f}")}


def table(result: dict) -> str:
    c, rows, lines = result["config"], [], [""]
    for name, s in result["summary"].items():
        if not s["ok"]:
            rows.append([name, "-", f"failed: {s['errors'][0].splitlines()[-1][:150]}"])
        for ep in s.get("epochs", []):
            cells = (report.spread(ep.get(k), f, k == "samples_per_s", sc) for k, sc, f in COLUMNS.values())
            rows.append([name, ep["epoch"], *cells])
        if s["ok"]:
            lines.append(f"steady samples/s {name}: {report.spread(s['steady_samples_per_s'], rng=True)}")
    for key, r in result["ratios"].items():
        lines.append(f"{key}: {r['of_medians']:.3f} (per round: {', '.join(f'{x:.3f}' for x in r['per_round'])})")
    for name, rs in result["runs"].items():
        reads = [x for r in rs for x in r.get("tier_read", [])]
        for threads in sorted({x["threads"] for x in reads}):
            rates = [x["bytes_per_s"] / 1e6 for x in reads if x["threads"] == threads]
            files = statistics.median(x["files_per_s"] for x in reads if x["threads"] == threads)
            lines.append(
                f"{name} entries read back, {threads} thread(s), page cache dropped: {statistics.median(rates):.0f} "
                f"MB/s ({', '.join(f'{x:.0f}' for x in rates)}), {files:.0f} entries/s"
            )
    for name, conv in result["conversions"].items():
        lines.append(
            f"{name} conversion: {conv['seconds']:.1f} s ({conv['process_s']:.1f} s with Python's start and imports), "
            f"{conv['chunks']} chunks, {mb(conv['bytes'])} MB; upload {conv['upload_s']:.1f} s"
        )
    head = f"memory cache {mb(c['memory_bytes'])} MB; {c['latency_s'] * 1e3:g} ms per request, "
    head += f"{c['bandwidth_bps'] / 1e6:g} MB/s; {c['repeat']} round(s); medians [min-max]\n"
    return head + report.table(["config", "epoch", *COLUMNS], rows) + "\n".join(lines)


def options(p) -> None:
    dataset.add_dataset_options(p, data="/var/tmp/coordl-bench/disk-tier", images=2000, classes=20)
    p.add_argument("--smoke", action="store_true", help="a tiny dataset, 2 epochs, 1 round: " + " ".join(SMOKE))
    p.add_argument("--latency", type=float, default=0.02, help="seconds added before each request (default: 0.02)")
    p.add_argument("--bandwidth", default="20MB", help="the store's bandwidth per second, all GETs together (20MB)")
    p.add_argument("--memory", type=float, default=0.25, help="the memory cache, a fraction of the dataset's bytes")
    p.add_argument("--tier-root", default="/var/tmp", help="where the tier (and the run's folders) go (/var/tmp)")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--workers", type=int, default=2, help="LitData's and Mosaic's DataLoader workers (default: 2)")
    chunk = "LitData's chunk_bytes and Mosaic's size_limit (default: 8MB, ~28 chunks: with a few 64MB ones LitData's "
    p.add_argument("--chunk", default="8MB", help=chunk + "2 workers share chunks, which it reads whole per item)")
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"a subset of {','.join(CONFIGS)}")
    threads = "after a tier's run, read its entries once from this many threads, for each (default: 1,8; '': none)"
    p.add_argument("--read-threads", type=lambda t: [int(x) for x in t.split(",") if x], default=[1, 8], help=threads)
    p.add_argument("--no-drop", action="store_true", help="do not drop the page cache before each run")
    p.add_argument("--one", help=argparse.SUPPRESS)  # a child: one configuration, its spec in this JSON file
    p.add_argument("--convert", nargs=4, help=argparse.SUPPRESS)  # a child: KIND SRC OUT SIZE, one conversion


def run(args) -> dict | None:
    if args.one:
        return disk_tier_baselines.child(json.loads(Path(args.one).read_text()), jobs.Parent())
    if args.convert:
        return jobs.say(**disk_tier_baselines.convert(*args.convert))
    if args.smoke:  # the smoke's dataset, where the command line did not name one
        vars(args).update(vars(cli.parser("disk_tier", sys.modules[__name__]).parse_args(SMOKE + args._argv)))

    from coordl.units import parse_bytes
    from coordl_testing.s3server import S3Server

    names = [n for n in args.configs.split(",") if n]
    if unknown := set(names) - set(CONFIGS):
        raise SystemExit(f"unknown configurations {sorted(unknown)}: pick from {','.join(CONFIGS)}")
    data = dataset.dataset_from_args(args)
    log(f"dataset: {dataset.describe(data)}")
    ctx = {"data": data["root"], "url": f"s3://{BUCKET}/raw/train", "conversions": {}}
    ctx["memory"], ctx["files"] = int(args.memory * data["total_bytes"]), data["files"]
    ctx["device"] = measure.device_of(args.tier_root)
    t_start = time.time()
    work = tempfile.mkdtemp(dir=args.tier_root, prefix="coordl-disk-tier-convert-")
    try:
        with S3Server(bandwidth_bps=parse_bytes(args.bandwidth)) as server:
            moto_pid = server._proc.pid
            server.create_bucket(BUCKET)
            t0 = time.perf_counter()
            server.upload_tree(data["root"], BUCKET, "raw/train")
            upload_s = time.perf_counter() - t0
            for kind in ("litdata", "mosaic"):
                if kind in names:
                    ctx["conversions"][kind] = conv = convert(args, server, kind, data["root"], work)
                    log(f"{kind}: converted in {conv['seconds']:.1f} s ({conv['chunks']} chunks), ", end="")
                    log(f"uploaded in {conv['upload_s']:.1f} s")
            server.latency_s = args.latency
            runs = measure.in_rounds(names, args.repeat, lambda name: run_one(args, server, name, ctx), log)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    summary = summarise(runs)
    # the options are in the result's own field; cgroups None: no memory or blkio limit, the page cache measured
    config = {"latency_s": args.latency, "bandwidth_bps": parse_bytes(args.bandwidth), "repeat": args.repeat}
    config |= {"memory_bytes": ctx["memory"], "tier_device": "{}:{}".format(*ctx["device"]), "cgroups": None}
    result = {
        "smoke": args.smoke,
        "fincore": shutil.which("fincore") is not None,
        "config": config | {"url": ctx["url"]},
    }
    result |= {"dataset": data, "upload_s": upload_s, "conversions": ctx["conversions"], "moto_pid": moto_pid}
    result |= {"wall_s": time.time() - t_start, "runs": runs, "summary": summary, "ratios": ratios(runs, summary)}
    return result
