"""The local-storage tier (Cache(disk=...)) on an s3:// dataset 4x the memory cache behind a slow store.

The store: moto behind ``S3Server``'s counting proxy, ``--latency`` a request, ``--bandwidth`` in all.
``--repeat`` rounds, ABBA, each configuration a fresh process (page cache dropped unless ``--no-drop``),
``--epochs`` epochs, batch 64: ``no-tier`` (``Cache(size=M)``, M = ``--memory`` of the dataset); ``tier``
(``disk=Disk(folder in --tier-root)``); ``tier-direct`` (``direct=True``); ``local`` (the local folder: the
bound); ``litdata``, ``mosaic`` (:mod:`.disk_tier_baselines`). Per epoch: GETs and bytes, coordl's counters,
CPU, the device's reads and writes, the page cache (``fincore``); after a tier's run, its entries read back
from ``--read-threads`` threads; the tiers' steady samples/s over the others'.

    python -m benchmarks disk_tier            # ~15 min on 2 cores; --smoke: 48 small photos, no Mosaic, ~35 s
"""

import argparse
import json
import mmap
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks import disk_tier_baselines, s3
from benchmarks.harness import cli, dataset, limits, measure, report
from benchmarks.harness.report import log, mb
from benchmarks.indexing import fresh
from coordl.fetch.storage import read_whole
from coordl.units import parse_bytes

CONFIGS = ("no-tier", "tier", "tier-direct", "local", "litdata", "mosaic")
BASELINES = ("local", "no-tier", "litdata", "mosaic")  # (b) / each
BUCKET = "coordl-disk-tier"
SMOKE = ["--data", "/var/tmp/coordl-bench/disk-tier-smoke", "--images", "48", "--classes", "4", "--width", "160"]
SMOKE += ["--height", "120", "--epochs", "2", "--repeat", "1", "--chunk", "1MB", "--configs", ",".join(CONFIGS[:-1])]
SMOKE += ["--out", os.path.join(tempfile.gettempdir(), "disk_tier_smoke.json")]
N, M = s3.N, s3.M  # a count, megabytes
COLUMNS = {"samples/s": ("samples_per_s", *N), "GETs": ("gets", *N), "store MB": ("get_bytes", *M)}
COLUMNS |= {"tier reads": ("disk_reads", *N), "CPU s": ("loader_cpu_s", *s3.S)}
COLUMNS |= {"device MB read": ("device_read", *M), "device MB written": ("device_written", *M)}
COLUMNS |= {"local files in page cache MB": ("resident_bytes", *M), "page cache delta MB": ("page_cache_delta", *M)}


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
    for p in (line.split() for line in Path("/proc/diskstats").read_text().splitlines()):
        if (int(p[0]), int(p[1])) == dev:
            return int(p[5]) * 512, int(p[9]) * 512
    return 0, 0


def tier_capacity(folder: str, direct: bool, threads: int, drop: bool) -> dict:
    """The disk's rate for the tier's entries under ``folder``: each read once, shuffled, from ``threads`` threads as
    the tier reads (``direct``: ``O_DIRECT``; else pages dropped behind), the page cache dropped first (``drop``)."""
    entry = re.compile(r"[0-9a-f]{32}")  # an entry's name; the tier's ledger, users and tmp/ are not read
    files = [os.path.join(d, f) for d, _, names in os.walk(folder) for f in names if entry.fullmatch(f)]
    random.Random(0).shuffle(files)
    if drop:
        limits.drop_page_cache()

    def read(path: str) -> int:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | (os.O_DIRECT if direct else 0))
        try:
            with mmap.mmap(-1, -(-os.fstat(fd).st_size // 4096) * 4096 or 4096) as buf:  # page-aligned
                return os.preadv(fd, [buf], 0) if direct else read_whole(fd, [buf], drop_page_cache=True)
        finally:
            os.close(fd)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        total = sum(pool.map(read, files))
    s = time.perf_counter() - t0
    out = {"threads": threads, "direct": direct, "files": len(files), "bytes": total, "seconds": s}
    return out | {"bytes_per_s": total / s, "files_per_s": len(files) / s}


class Meter(s3.Meter):
    """Between two readings: the store's counts (``s3.Meter``), the device's I/O, the page cache, ``folder``'s in it."""

    def __init__(self, server, device: tuple[int, int], folder: str | None):
        self.device, self.folder = device, folder
        super().__init__(server)

    def start(self) -> None:
        super().start()
        self.io, self.mem = device_io(self.device), meminfo()

    def read(self) -> dict:
        io, mem = device_io(self.device), meminfo()
        out = {"resident_bytes": resident(self.folder), "meminfo": mem}
        out["device_read"], out["device_written"] = (a - b for a, b in zip(io, self.io))
        out["page_cache_delta"] = mem["page_cache"] - self.mem["page_cache"]  # before super() starts anew
        return super().read() | out


def run_one(args, server, name: str, ctx: dict) -> dict:
    """One configuration in a fresh child; per epoch its figures, the proxy's counts and the machine's memory."""
    spec = {"batch": s3.BATCH, "epochs": args.epochs, "kind": "coordl", "url": ctx["url"], "cache": ctx["memory"]}
    # TMPDIR short: the sockets of DataLoader workers go there (108 bytes at most)
    with tempfile.TemporaryDirectory(dir=args.tier_root) as work, tempfile.TemporaryDirectory() as tmp:
        if name in ("litdata", "mosaic"):
            conv, local = ctx["conversions"][name], os.path.join(work, "cache")
            spec |= {"kind": name, "url": conv["url"], "local": local, "workers": args.workers}
            spec["cache_limit"] = 4 * conv["bytes"]
        else:
            local = {"no-tier": None, "local": ctx["data"]}.get(name, os.path.join(work, "tier"))
            spec |= {"tier": local if name.startswith("tier") else None, "direct": name == "tier-direct"}
            spec["url"] = ctx["data"] if name == "local" else ctx["url"]
            if spec["tier"]:
                os.makedirs(local)  # Disk(path) must exist: the tier is its sub-folder
        env = {**os.environ, **server.env(), "S3_ENDPOINT_URL": server.endpoint, "TMPDIR": tmp}
        run = {"config": name, "dropped_page_cache": None if args.no_drop else limits.drop_page_cache() or True}
        run |= s3.run_child("disk_tier", spec, Meter(server, ctx["device"], local), env)
        if name.startswith("tier") and "error" not in run:  # the disk's rate for the tier's entries, the loader gone
            run["tier_read"] = [tier_capacity(local, spec["direct"], t, not args.no_drop) for t in args.read_threads]
    short = [(e["epoch"], e["samples"]) for e in run["epochs"] if e["samples"] != ctx["files"]]
    if short and "error" not in run:
        run["error"] = f"epochs delivered other than {ctx['files']} samples (epoch, samples): {short}"
    return run


def convert(args, server, kind: str, data: str) -> dict:
    """``kind``'s chunks of the dataset, made in a child (the conversion timed there), uploaded straight to moto."""
    with tempfile.TemporaryDirectory(dir=args.tier_root) as work, tempfile.TemporaryDirectory() as tmp:
        how = {"how": "benchmarks.disk_tier_baselines:convert", "args": [kind, data, f"{work}/{kind}", args.chunk]}
        seconds = fresh(how, env={"TMPDIR": tmp})["convert_s"]  # TMPDIR: short, for the sockets of its workers
        files = [p for p in Path(work, kind).rglob("*") if p.is_file()]
        r = {"seconds": seconds, "files": len(files), "chunks": sum(p.suffix in (".bin", ".mds") for p in files)}
        server.upload_tree(f"{work}/{kind}", BUCKET, kind)
        return r | {"bytes": sum(p.stat().st_size for p in files), "url": f"s3://{BUCKET}/{kind}"}


def steady(run: dict) -> float:
    """Samples/s over the epochs after the first."""
    rest = run["epochs"][1:]
    return sum(e["samples"] for e in rest) / sum(e["seconds"] for e in rest)


def ratios(runs: dict[str, list[dict]], summary: dict) -> dict:
    """Steady samples/s of (b) over each baseline: of the medians, and per round (runs of one round are neighbours)."""
    out = {}
    for tier, base in ((t, b) for t in ("tier", "tier-direct") for b in BASELINES):
        if summary.get(tier, {}).get("ok") and summary.get(base, {}).get("ok"):
            med = summary[tier]["steady_samples_per_s"]["median"] / summary[base]["steady_samples_per_s"]["median"]
            rounds = {r["round"]: steady(r) for r in runs[base] if "error" not in r}
            per = [steady(r) / rounds[r["round"]] for r in runs[tier] if "error" not in r and r["round"] in rounds]
            out[f"{tier}/{base}"] = {"of_medians": med, "per_round": per}
    return out


def table(result: dict) -> str:
    """Per configuration and epoch, the medians; the steady rates, ratios, tiers read back and conversions below."""
    c, lines = result["config"], [""]
    for name, s in result["summary"].items():
        if s["ok"]:
            lines.append(f"steady samples/s {name}: {report.spread(s['steady_samples_per_s'], rng=True)}")
    for key, r in result["ratios"].items():
        lines.append(f"{key}: {r['of_medians']:.3f} (per round: {', '.join(f'{x:.3f}' for x in r['per_round'])})")
    for name, x in ((name, x) for name, rs in result["runs"].items() for r in rs for x in r.get("tier_read", [])):
        rate = f"{x['bytes_per_s'] / 1e6:.0f} MB/s ({x['files_per_s']:.0f} entries/s)"
        lines.append(f"{name}: entries read back from {x['threads']} thread(s), page cache dropped: {rate}")
    for name, conv in result["conversions"].items():
        lines.append(f"{name} conversion: {conv['seconds']:.1f} s, {conv['chunks']} chunks, {mb(conv['bytes'])} MB")
    head = f"memory cache {mb(c['memory_bytes'])} MB; {c['latency_s'] * 1e3:g} ms per request, "
    head += f"{c['bandwidth_bps'] / 1e6:g} MB/s; {c['repeat']} round(s); medians\n"
    return head + s3.epochs_table(result["summary"], COLUMNS) + "\n".join(lines)


def options(p) -> None:
    dataset.add_dataset_options(p, data="/var/tmp/coordl-bench/disk-tier", images=2000, classes=20)
    p.add_argument("--smoke", action="store_true", help="a tiny dataset, 2 epochs, 1 round: " + " ".join(SMOKE))
    p.add_argument("--latency", type=float, default=0.02, help="seconds added before each request (default: 0.02)")
    p.add_argument("--bandwidth", default="20MB", help="the store's bandwidth per second, all GETs together (20MB)")
    p.add_argument("--memory", type=float, default=0.25, help="the memory cache, a fraction of the dataset's bytes")
    p.add_argument("--tier-root", default="/var/tmp", help="where the tier (and the run's folders) go (/var/tmp)")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--workers", type=int, default=2, help="LitData's and Mosaic's DataLoader workers (default: 2)")
    p.add_argument("--chunk", default="8MB", help="LitData's chunk_bytes and Mosaic's size_limit (default: 8MB)")
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"a subset of {','.join(CONFIGS)}")
    threads = "after a tier's run, read its entries once from this many threads, for each (default: 1,8; '': none)"
    p.add_argument("--read-threads", type=lambda t: [int(x) for x in t.split(",") if x], default=[1, 8], help=threads)
    p.add_argument("--no-drop", action="store_true", help="do not drop the page cache before each run")
    p.add_argument("--one", help=argparse.SUPPRESS)  # a child: one configuration, its spec in JSON


def run(args) -> dict | None:
    if args.one:
        return s3.child(json.loads(Path(args.one).read_text()), disk_tier_baselines.LOADERS, measure.cpu_seconds)
    if args.smoke:  # the smoke's dataset, where the command line did not name one
        vars(args).update(vars(cli.parser("disk_tier", sys.modules[__name__]).parse_args(SMOKE + args._argv)))
    from coordl_testing.s3server import S3Server

    names = [n for n in args.configs.split(",") if n]
    if unknown := set(names) - set(CONFIGS):
        raise SystemExit(f"unknown configurations {sorted(unknown)}: pick from {','.join(CONFIGS)}")
    data = dataset.dataset_from_args(args)
    log(f"dataset: {dataset.describe(data)}")
    ctx = {"data": data["root"], "url": f"s3://{BUCKET}/raw/train", "conversions": {}, "files": data["files"]}
    ctx |= {"memory": int(args.memory * data["total_bytes"]), "device": measure.device_of(args.tier_root)}
    with S3Server(bandwidth_bps=parse_bytes(args.bandwidth)) as server:
        moto_pid = server._proc.pid  # gone after the run: tests/test_benchmarks.py checks
        server.create_bucket(BUCKET)
        server.upload_tree(data["root"], BUCKET, "raw/train")
        for kind in (k for k in ("litdata", "mosaic") if k in names):
            ctx["conversions"][kind] = conv = convert(args, server, kind, data["root"])
            log(f"{kind}: converted in {conv['seconds']:.1f} s ({conv['chunks']} chunks)")
        server.latency_s = args.latency
        runs = measure.in_rounds(names, args.repeat, lambda name: run_one(args, server, name, ctx), log)
    fields = ("seconds", "samples_per_s", "gets", "get_bytes", "loader_cpu_s", "device_read", "device_written")
    fields += ("resident_bytes", "page_cache_delta")
    counters = ("storage_reads", "storage_bytes", "cache_hits", "disk_reads", "disk_bytes", "disk_admitted")
    counters += ("disk_cache_bytes", "stall_fetch_s", "stall_prep_s", "read_s", "prep_s")
    summary = s3.summarise(runs, fields, counters, create_s=lambda r: r["create_s"], steady_samples_per_s=steady)
    config = {"latency_s": args.latency, "bandwidth_bps": parse_bytes(args.bandwidth), "repeat": args.repeat}
    config |= {"memory_bytes": ctx["memory"], "tier_device": "{}:{}".format(*ctx["device"])}
    result = {"smoke": args.smoke, "config": config | {"url": ctx["url"]}, "dataset": data, "moto_pid": moto_pid}
    result |= {"conversions": ctx["conversions"], "runs": runs, "summary": summary}
    return result | {"ratios": ratios(runs, summary)}
