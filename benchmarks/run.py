"""Epoch time and storage bytes of coordl vs DataLoader and DALI, with short memory and slow storage.

    python -m benchmarks run --data /var/tmp/coordl-bench/bench --size 500MB --classes 100

Per scenario (a cache fraction of the dataset and a storage bandwidth) and loader
(``benchmarks.loaders``), a child (``--job LOADER``) runs the same loop for several epochs in its own
memory and blkio cgroup: it makes its loader and runs warm-up batches; the runner drops the page cache,
sets the memory limit to ``working set + slack + cache fraction * dataset`` (so every loader gets the
same memory for data: the page cache, or coordl's cache) and throttles the dataset's device
(``coordl-auto``, which measures storage when made, from its start); the child then reports per epoch
seconds, samples/s, device bytes (``/proc/diskstats``), waits, peak memory and coordl's counters. The
first scenario, ``fits`` (whole dataset's memory, no throttle), is the overhead check and measures the
prep rate P (fastest steady DALI pipeline, else Pillow one) that bandwidths such as ``0.25P`` refer to.

Writes ``results.json`` (after every run: ``--resume``), ``results.md`` and ``results.png`` to
``--out``. Without root or v1 cgroups it says so (also in the JSON) and runs unlimited.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import select
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.harness import cli, dataset, jobs, limits, measure, report
from benchmarks.harness.report import log
from benchmarks.loaders import COORDL_LOADERS, LOADERS, MEASURE_WHEN_MADE, Loader, image_folder
from coordl.shm.limits import MIN_MARGIN
from coordl.units import format_bytes, parse_bytes

OUT = str(cli.RESULTS / "run")  # a folder: results.json, results.md, results.png
DEFAULT_LOADERS = ("torch", "dali-shuffle", "dali-seq", "dali-epoch-shuffle", "coordl")
# Pipelines of the same ops, whose fastest rate is the prep rate P: DALI's, else Pillow's.
PIPELINES_OF_P = (("dali-shuffle", "dali-seq", "dali-epoch-shuffle", "coordl"), ("torch", "coordl-torch"))


# -- scenarios ------------------------------------------------------------------------------------
def parse_bandwidth(spec: str) -> tuple[float, str] | None:
    """``"0.25P"`` -> (0.25, "P") (a fraction of the prep rate); ``"20MB"`` -> (20e6, "B/s");
    ``"none"`` -> None (unthrottled)."""
    if spec.strip().lower() in ("none", "0", "off"):
        return None
    m = re.fullmatch(r"([0-9.]+)\s*[pP]", spec.strip())
    return (float(m.group(1)), "P") if m else (float(parse_bytes(spec.strip())), "B/s")


def scenarios(args) -> list[dict]:
    cells = [] if args.no_fit else [{"name": "fits", "cache": 1.0, "bandwidth": None}]
    for spec in args.bandwidth:
        cells += [{"name": f"{spec}@{c:g}", "cache": c, "bandwidth": parse_bandwidth(spec)} for c in args.cache]
    return cells


def resolve_bandwidth(cell: dict, prep_bps: float | None) -> int | None:
    if cell["bandwidth"] is None:
        return None
    value, unit = cell["bandwidth"]
    if unit == "P" and prep_bps is None:
        raise SystemExit(f"scenario {cell['name']} needs the prep rate: keep the 'fits' scenario or pass --prep-rate")
    return int(value * prep_bps) if unit == "P" else int(value)


# -- the child: one loader, in the cgroups ---------------------------------------------------------
def memory(cgroup: str | None, samples: list) -> dict:
    """An epoch's memory: its v1 memory cgroup's peak (``max_usage_in_bytes``, reset per epoch) and the means
    of ``samples`` of :func:`usage`; without a cgroup, the peak resident set of this process and its children."""
    if not cgroup:
        kb = sum(resource.getrusage(who).ru_maxrss for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
        return {"peak_memory_bytes": kb * 1024, "peak_memory_kind": "rss"}
    samples = samples or [usage(cgroup)]
    mean = [sum(x[i] for x in samples) // len(samples) for i in (0, 1)]
    peak = int(Path(cgroup, "memory.max_usage_in_bytes").read_text())
    return {"peak_memory_bytes": peak, "peak_memory_kind": "cgroup", "mean_memory_bytes": mean[0]} | {
        "mean_file_cache_bytes": mean[1]
    }


def usage(cgroup: str) -> tuple[int, int]:
    """The cgroup's usage and its unmapped file page cache (what the page-cache loaders hold of the
    dataset; libraries are mapped), from ``memory.stat``."""
    stat = dict(line.split() for line in Path(cgroup, "memory.stat").read_text().splitlines())
    cache, rss = int(stat["total_cache"]), int(stat["total_rss"])
    return rss + cache, max(0, cache - int(stat["total_shmem"]) - int(stat["total_mapped_file"]))


def job(args) -> None:
    """Makes the loader, runs the warm-up batches, says ``ready``, waits for ``go`` on stdin (the runner
    drops the page cache, sets the memory limit and throttle), then says one line per epoch. Epoch 0
    (short of the warm-up batches) is the cold epoch, left out of the steady figures."""
    dev, t0 = tuple(int(x) for x in args.device.split(":")), time.perf_counter()
    loader = Loader(args.job, args.data, args.batch_size, args.workers, args.seed, args.cache_bytes)
    batches, samples = loader.epoch(), 0
    for _ in range(args.warmup_batches):
        samples += next(batches).shape[0]
    cache = (loader.counters() or {}).get("cache_bytes", 0)
    jobs.say(ready=True, build_s=round(time.perf_counter() - t0, 2), warmup_samples=samples, cache_bytes=cache)
    if sys.stdin.readline().strip() == "go":
        for e in range(args.epochs):
            if e:
                batches, samples = loader.epoch(), 0
            if args.memcg:
                Path(args.memcg, "memory.max_usage_in_bytes").write_text("0")
            sampler = measure.Sampler(lambda: usage(args.memcg), 0.1) if args.memcg else None
            before, wait, start = measure.sectors_read(dev), 0.0, time.perf_counter()
            while True:
                t = time.perf_counter()
                if (images := next(batches, None)) is None:
                    break
                wait += time.perf_counter() - t
                samples += images.shape[0]
                if args.compute_ms:
                    time.sleep(args.compute_ms / 1000)
            seconds = time.perf_counter() - start
            row = {"epoch": e, "seconds": round(seconds, 3), "samples": samples}
            row |= {"samples_per_s": round(samples / seconds, 1), "device_bytes": measure.sectors_read(dev) - before}
            row |= {"wait_s": round(wait, 3), **memory(args.memcg, sampler.stop() if sampler else [])}
            if (counters := loader.counters()) is not None:
                row["counters"] = counters  # epoch 0's include the warm-up batches
            jobs.say(**row)
    loader.close()
    jobs.say(done=True)


# -- the runner ---------------------------------------------------------------------------------
def message(proc: subprocess.Popen, timeout: float, log_path: Path) -> dict:
    """The child's next JSON line (other lines are a library's chatter); at most ``timeout`` s for each line."""
    while True:
        if not select.select([proc.stdout], [], [], timeout)[0]:
            raise TimeoutError(f"no word from the child for {timeout:.0f} s")
        if not (line := proc.stdout.readline()):
            raise RuntimeError(f"the child exited with status {proc.wait()}; see {log_path}")
        if line.startswith(b"{"):
            return json.loads(line)


def coordl_limit(need: int) -> int:
    """The smallest memory limit that leaves ``need`` bytes beside the margin coordl keeps free
    under a limit and never fills with data (:func:`coordl.shm.limits.margin`: 10%, at least 256 MiB)."""
    return max(need + MIN_MARGIN, -(-need * 10 // 9))


def run_one(args, cell: dict, loader: str, data: dict, dev, caps: dict, bandwidth: int | None, k: int) -> dict:
    cache_bytes, fits = int(round(cell["cache"] * data["total_bytes"])), cell["name"] == "fits"
    use = caps["memory"] or caps["blkio"]
    lim = limits.Limits(f"coordl-bench-{os.getpid()}-{k}", caps["memory"], caps["blkio"]) if use else None
    kw = {"batch_size": args.batch_size, "workers": args.workers, "epochs": args.fit_epochs if fits else args.epochs}
    kw |= {
        "seed": args.seed,
        "cache_bytes": cache_bytes,
        "compute_ms": args.compute_ms,
        "memcg": lim and lim.memory_path,
    }
    kw |= {"warmup_batches": args.warmup_batches, "data": data["root"], "device": f"{dev[0]}:{dev[1]}"}
    log_path = Path(args.out) / "logs" / f"{cell['name'].replace('/', '_')}-{loader}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    if caps["drop_caches"]:  # libraries the child loads are read (and charged to it) alike for every loader
        limits.drop_page_cache(3)
    if lim and loader in MEASURE_WHEN_MADE:
        lim.throttle(dev, bandwidth)  # it measures the storage when it is made: the throttle must be there then
    run = {"scenario": cell["name"], "loader": loader, "cache_fraction": cell["cache"], "cache_bytes": cache_bytes}
    run |= {"bandwidth_bps": bandwidth, "epochs": []}
    with open(log_path, "w") as err:
        command = jobs.scenario_command("run", *jobs.flags(job=loader, **kw))
        popen = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE, "stderr": err, "bufsize": 0}
        proc = subprocess.Popen(command, preexec_fn=lim.join if lim else None, **popen)
        try:
            run["ready"] = message(proc, args.timeout, log_path)
            if caps["drop_caches"]:
                limits.drop_page_cache(3)
            if lim and lim.memory and not fits:
                run["working_set_bytes"], run["working_set_source"] = ws = working_set(args, loader, lim)
                # coordl's cache is fixed at the budget: the slack only keeps its peaks from the OOM
                # killer. The page cache would use any slack for data, so the others get none.
                coordl = loader in COORDL_LOADERS
                limit = (
                    coordl_limit(ws[0] + cache_bytes + args.slack)
                    if coordl
                    else ws[0] + cache_bytes + args.baseline_slack
                )
                lim.limit_memory(limit)
                run["memory_limit_bytes"] = limit
            if lim:
                lim.throttle(dev, bandwidth)
            proc.stdin.write(b"go\n")
            proc.stdin.flush()
            while not (msg := message(proc, args.timeout, log_path)).get("done"):
                run["epochs"].append(msg)
                c = msg.get("counters") or {}
                log(
                    f"  epoch {msg['epoch']}: {msg['seconds']:7.2f} s  {msg['samples_per_s']:7.1f} samples/s  "
                    f"device {format_bytes(msg['device_bytes'], 'MB'):>10}  wait {msg['wait_s']:6.2f} s"
                    + (
                        f"  coordl storage {format_bytes(c['storage_bytes'], 'MB')}, hits {c['cache_hits']}"
                        if c
                        else ""
                    )
                )
        except Exception as e:  # noqa: BLE001 - recorded, the sweep goes on
            run["error"] = f"{type(e).__name__}: {e}"
            log(f"  FAILED: {run['error']}")
        finally:
            proc.kill()
            proc.wait()
            if lim:
                lim.remove()
    steady = run["epochs"][1:]
    if steady and fits and lim and lim.memory:
        # The loader's own memory, with the whole dataset cached, less the dataset. coordl's
        # cache cannot shrink under pressure, so it needs room for its peak; the page cache
        # shrinks and grows around the other loaders' working set, so their mean is what
        # leaves them the same cache on average.
        if loader in COORDL_LOADERS:
            ws = max(e["peak_memory_bytes"] for e in steady) - steady[-1]["counters"]["cache_budget"]
        else:
            ws = max(e["mean_memory_bytes"] for e in steady) - data["page_bytes"]
        args.working_sets[loader] = run["working_set_bytes"] = ws
    if steady:
        mean = {k: sum(e[k] for e in steady) / len(steady) for k in ("device_bytes", "wait_s")}
        run["steady"] = {k: statistics.median(e[k] for e in steady) for k in ("seconds", "samples_per_s")} | mean
        run["steady"]["peak_memory_bytes"] = max(e["peak_memory_bytes"] for e in steady)
        if all("mean_file_cache_bytes" in e for e in steady):
            run["steady"]["mean_page_cache_bytes"] = sum(e["mean_file_cache_bytes"] for e in steady) / len(steady)
        if steady[-1].get("counters"):
            run["steady"]["coordl_cache_bytes"] = steady[-1]["counters"]["cache_bytes"]
            run["steady"]["coordl_storage_bytes"] = sum(e["counters"]["storage_bytes"] for e in steady) / len(steady)
    return run


def working_set(args, loader: str, lim: limits.Limits) -> tuple[int, str]:
    """The memory the loader needs for itself, without any cached data: measured in the 'fits'
    scenario (peak with the dataset cached, less the dataset), else its usage after warm-up."""
    if loader in args.working_sets:
        return args.working_sets[loader], "fits-peak"
    own = lim.stat("total_shmem") if loader in COORDL_LOADERS else 0  # coordl's cache is not its working set
    return lim.usage() - own, "after-warmup"


# -- analysis ---------------------------------------------------------------------------------------
def prep_rate(runs: list[dict]) -> float | None:
    """P in samples/s: the fastest steady rate with everything in memory of the DALI pipelines,
    or of the Pillow pipelines (``torch``, ``coordl-torch``) when no DALI pipeline ran."""
    for family in PIPELINES_OF_P:
        ok = [r for r in runs if r["scenario"] == "fits" and r["loader"] in family and "steady" in r]
        if ok:
            return max(r["steady"]["samples_per_s"] for r in ok)
    return None


def summarise(result: dict) -> list[dict]:
    """Per scenario: the best baseline, coordl, their ratio, bytes vs the minimum, the bound;
    and coordl's torch backend against ``torch``, the baseline that runs the same Python."""
    total, p, out = result["dataset"]["total_bytes"], result.get("prep_rate_samples_per_s"), []
    for cell in result["scenarios"]:
        runs = {r["loader"]: r for r in result["runs"] if r["scenario"] == cell["name"] and "steady" in r}
        base = [r for name, r in runs.items() if name not in COORDL_LOADERS]
        if not runs:
            continue
        minimum = total - int(round(cell["cache"] * total))
        row = {"scenario": cell["name"], "cache_fraction": cell["cache"], "bandwidth_bps": cell.get("bandwidth_bps")}
        row["minimum_bytes"] = minimum
        if base:
            best = min(base, key=lambda r: r["steady"]["seconds"])
            row.update(best_baseline=best["loader"], best_baseline_s=best["steady"]["seconds"])
        if mine := runs.get("coordl", {}).get("steady"):
            row |= {"coordl_s": mine["seconds"], "coordl_device_bytes": mine["device_bytes"]}
            row["coordl_storage_bytes"] = mine.get("coordl_storage_bytes")
            if minimum:
                row["coordl_device_over_min"] = mine["device_bytes"] / minimum
            if base:
                row["speedup_vs_best"] = row["best_baseline_s"] / row["coordl_s"]
            if p:
                bw = cell.get("bandwidth_bps")
                row["bound_s"] = max((1 - cell["cache"]) * total / bw if bw else 0.0, result["dataset"]["files"] / p)
                row["coordl_over_bound"] = row["coordl_s"] / row["bound_s"]
        if mine := runs.get("coordl-torch", {}).get("steady"):
            row["coordl_torch_s"] = mine["seconds"]
            if minimum:
                row["coordl_torch_device_over_min"] = mine["device_bytes"] / minimum
            if "torch" in runs:
                row["torch_s"] = runs["torch"]["steady"]["seconds"]
                row["coordl_torch_speedup_vs_torch"] = row["torch_s"] / row["coordl_torch_s"]
        out.append(row)
    return out


def fmt_bw(bps: int | None) -> str:
    return "unthrottled" if not bps else f"{format_bytes(bps, 'MB', digits=0)}/s"


def markdown(result: dict) -> str:
    """The conditions, a row per run and a row per scenario (coordl against the best baseline and the bound)."""
    d, a, yes = result["dataset"], result["args"], {k: "yes" if v else "NO" for k, v in result["limits"].items()}
    p = result.get("prep_rate_samples_per_s")
    lines = [
        f"Dataset: {dataset.describe(d)}, {d['classes']} classes, at `{d['root']}`.",
        f"Batch {a['batch_size']}, {a['workers']} workers/threads per loader, {a['epochs']} epochs ({a['fit_epochs']} "
        "when everything fits; epoch 0 cold, the rest steady: median time, mean bytes), compute step "
        f"{a['compute_ms']} ms/batch.",
        f"Limits: memory cgroup {yes['memory']}, blkio throttle {yes['blkio']}, page cache dropped "
        f"{yes['drop_caches']}; slack {format_bytes(a['slack'], 'MiB', digits=0)}.",
        *([f"Prep rate P = {p:.0f} samples/s = {format_bytes(p * d['mean_bytes'], 'MB')}/s."] if p else []),
        *(f"**NOTE:** {n}" for n in result["limits"]["notes"]),
        "",
    ]
    rows = []
    for cell in result["scenarios"]:
        minimum = d["total_bytes"] * (1 - cell["cache"])
        for r in (r for r in result["runs"] if r["scenario"] == cell["name"]):
            s, where = r.get("steady"), [cell["name"], fmt_bw(r["bandwidth_bps"]), f"{cell['cache']:.0%}", r["loader"]]
            if s is None:
                rows.append([*where, f"failed: {r.get('error', '?')}"] + [None] * 8)
                continue
            held = s.get("coordl_cache_bytes", s.get("mean_page_cache_bytes"))
            cells = [r["epochs"][0]["seconds"], s["seconds"], round(s["samples_per_s"]), report.mb(s["device_bytes"])]
            cells += [
                f"{s['device_bytes'] / minimum:.3f}" if minimum > 500_000 else None,
                s["wait_s"],
                report.mb(held, 0),
            ]
            rows.append(
                [*where, *cells, report.mb(s["peak_memory_bytes"], 0), report.mb(r.get("memory_limit_bytes"), 0)]
            )
    head = "scenario|storage|cache|loader|cold s|steady s|samples/s|device MB/epoch|vs minimum|waiting s"
    lines += [report.table(head + "|data in memory MB|peak MB|limit MB", rows), ""]
    keys = "best_baseline_s coordl_s speedup_vs_best coordl_device_over_min bound_s coordl_over_bound".split()
    where = [[r["scenario"], fmt_bw(r["bandwidth_bps"]), f"{r['cache_fraction']:.0%}"] for r in result["summary"]]
    rows = [
        [*w, r.get("best_baseline"), *map(r.get, keys), r.get("coordl_torch_speedup_vs_torch")]
        for w, r in zip(where, result["summary"])
    ]
    head = "scenario|storage|cache|best baseline|its s|coordl s|speedup|coordl device/min|bound s|coordl/bound"
    return "\n".join([*lines, report.table(head + "|coordl-torch vs torch", rows)]) + "\n"


def draw(plt, result: dict):
    """Steady epoch time and device bytes per loader, a column per storage bandwidth, a group per cache."""
    groups: dict[str, list[dict]] = {}
    for cell in result["scenarios"]:
        groups.setdefault("fits" if cell["name"] == "fits" else fmt_bw(cell.get("bandwidth_bps")), []).append(cell)
    loaders = [name for name in LOADERS if any(r["loader"] == name for r in result["runs"])]
    done = {(r["scenario"], r["loader"]): r["steady"] for r in result["runs"] if "steady" in r}
    fig, axes = plt.subplots(2, len(groups), figsize=(4.2 * len(groups), 7), squeeze=False)
    width, total = 0.8 / max(1, len(loaders)), result["dataset"]["total_bytes"]
    for col, (key, cells) in enumerate(groups.items()):
        for row, (metric, scale, label) in enumerate(
            (("seconds", 1, "steady epoch s"), ("device_bytes", 1e6, "device MB per steady epoch"))
        ):
            ax = axes[row][col]
            for j, name in enumerate(loaders):
                at = [
                    (i, done[c["name"], name][metric] / scale) for i, c in enumerate(cells) if (c["name"], name) in done
                ]
                ax.bar([i + (j - (len(loaders) - 1) / 2) * width for i, _ in at], [y for _, y in at], width, label=name)
            for i, cell in enumerate(cells if row else []):  # the minimum: what the cache does not hold
                minimum = total * (1 - cell["cache"]) / 1e6
                ax.hlines(minimum, i - 0.45, i + 0.45, "k", "--", label="minimum" if i == 0 else None)
            ax.set_xticks(range(len(cells)), [f"cache {c['cache']:.0%}" for c in cells])
            ax.set_title("" if row else key)
            ax.set_ylabel(label)
            axes[row][0].legend(fontsize=8)
    fig.suptitle(
        f"{result['dataset']['files']} images, {format_bytes(total, 'MB', digits=0)}; memory = working set + cache"
    )
    return fig


# -- the command -----------------------------------------------------------------------------------
def options(p) -> None:
    dataset.add_dataset_options(p, data="/var/tmp/coordl-bench/bench", images=None, size="500MB", classes=100)
    p.add_argument(
        "--loaders", default=",".join(DEFAULT_LOADERS), help=f"comma-separated subset of {','.join(LOADERS)}"
    )
    p.add_argument("--cache", default="0.25,0.5,0.75", help="cache fractions of the dataset (memory for caching)")
    bandwidth = "storage throttles: '20MB' (per second), or a multiple of P, '0.5P'"
    p.add_argument("--bandwidth", default="0.25P,0.5P,2P", help=bandwidth)
    p.add_argument("--no-fit", action="store_true", help="skip the everything-fits scenario (needs --prep-rate)")
    p.add_argument("--prep-rate", type=float, help="prep rate P in samples/s, instead of measuring it")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--fit-epochs", type=int, default=6, help="epochs of the 'fits' scenario (the overhead check)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--workers", type=int, default=os.cpu_count(), help="worker processes / DALI threads per loader")
    p.add_argument("--compute-ms", type=float, default=0.0, help="a fixed compute step per batch (a stand-in GPU)")
    p.add_argument("--warmup-batches", type=int, default=3)
    no_limit = "no memory cgroup (the throttle and the page-cache drops still apply): for smoke runs on tiny datasets"
    p.add_argument("--no-memory-limit", action="store_true", help=no_limit)
    slack = "memory beyond coordl's peak working set + cache (OOM headroom)"
    p.add_argument("--slack", type=parse_bytes, default=32 << 20, help=slack)
    slack = "memory beyond a baseline's working set + cache (default none: its page cache would use it for data)"
    p.add_argument("--baseline-slack", type=parse_bytes, default=0, help=slack)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=1800, help="seconds without word from a child before giving up")
    p.add_argument("--resume", action="store_true", help="keep the runs already in OUT/results.json")
    for name, kind in (("--job", str), ("--cache-bytes", int), ("--device", str), ("--memcg", str)):
        p.add_argument(name, type=kind, help=argparse.SUPPRESS)  # the child's: its loader, budget, MAJ:MIN, cgroup


def run(args) -> None:
    if args.job:
        return job(args)
    args.cache = [float(c) for c in args.cache.split(",") if c]
    args.bandwidth = [b for b in args.bandwidth.split(",") if b]
    args.loaders = [n for n in args.loaders.split(",") if n]
    if unknown := set(args.loaders) - set(LOADERS):
        raise SystemExit(f"unknown loaders {sorted(unknown)}; choose from {', '.join(LOADERS)}")
    out, caps = Path(args.out), limits.probe()
    out.mkdir(parents=True, exist_ok=True)
    if args.no_memory_limit and caps["memory"]:
        caps["memory"] = False
        caps["notes"].append("--no-memory-limit: no memory cgroup, every loader may cache the whole dataset")
    for n in caps["notes"]:
        log("NOTE:", n)
    data, dev, args.working_sets = dataset.dataset_from_args(args), measure.device_of(args.data), {}
    data["page_bytes"] = int((-(-image_folder(args.data).sizes // 4096) * 4096).sum())  # whole 4 KiB pages per file
    log(f"dataset: {dataset.describe(data)}; device {dev[0]}:{dev[1]}")
    options = {k: v for k, v in vars(args).items() if k != "working_sets" and not k.startswith("_")}
    result = {"args": options, "dataset": data, "limits": caps, "scenarios": scenarios(args), "runs": []}
    result["working_sets"], path, done = args.working_sets, out / "results.json", {}
    old = json.loads(path.read_text()) if args.resume and path.exists() else None
    if old and old["dataset"]["total_bytes"] == data["total_bytes"]:
        done = {(r["scenario"], r["loader"]): r for r in old["results"]["runs"] if "steady" in r}
        args.working_sets.update(old["results"].get("working_sets", {}))
    p_rate, k = args.prep_rate, 0
    for ci, cell in enumerate(result["scenarios"]):
        if cell["name"] != "fits" and p_rate is None and (p_rate := prep_rate(result["runs"])):
            log(f"prep rate P = {p_rate:.0f} samples/s = {format_bytes(p_rate * data['mean_bytes'], 'MB')}/s")
        result["prep_rate_samples_per_s"] = p_rate
        cell["bandwidth_bps"] = bw = resolve_bandwidth(cell, p_rate * data["mean_bytes"] if p_rate else None)
        for loader in args.loaders if ci % 2 == 0 else args.loaders[::-1]:  # ABBA across the scenarios
            if (cell["name"], loader) not in done:
                log(f"[{cell['name']}] {loader}: cache {cell['cache']:.0%}, storage {fmt_bw(bw)}")
            k += 1
            result["runs"].append(
                done.get((cell["name"], loader)) or run_one(args, cell, loader, data, dev, caps, bw, k)
            )
            cli.save(args, result, path)
    result["summary"] = summarise(result)
    cli.save(args, result, path)
    (out / "results.md").write_text(markdown(result))
    if why := report.plot(out / "results.png", lambda plt: draw(plt, result)):
        result["limits"]["notes"].append(why)
    print(markdown(result))
    log(f"wrote {path}, {out / 'results.md'}, {out / 'results.png'}")
