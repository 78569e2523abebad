"""Epoch time and storage bytes of coordl vs DataLoader and DALI, with short memory and slow storage, or warm.

    python -m benchmarks run --data /var/tmp/coordl-bench/bench --size 500MB --classes 100
    python -m benchmarks run --warm --loaders coordl-torch,coordl,torch --out benchmarks/results   # torch_backend.json

Per scenario (a cache fraction and a storage bandwidth; ``fits``: no limits, the working sets and the prep rate P)
and loader (:mod:`benchmarks.loaders`), a child in its own memory and blkio cgroup; ``results.json``, ``.md`` and
``.png`` in ``--out``, the method in docs/benchmarks.md. ``--warm`` (was ``torch_backend``): the loaders in this
process, everything in memory, ``--reps`` epochs each ABBA, coordl-torch / torch (target >= 0.95) in
``--out``/torch_backend.json (benchmarks/README.md).
"""

import argparse
import json
import os
import re
import resource
import statistics
import time
from pathlib import Path

from benchmarks.harness import cli, dataset, jobs, limits, measure, report
from benchmarks.harness.report import log
from benchmarks.loaders import COORDL_LOADERS, LOADERS, MEASURE_WHEN_MADE, Loader, epoch_row
from coordl.index import Index
from coordl.shm.limits import MIN_MARGIN
from coordl.units import format_bytes, parse_bytes

OUT = str(cli.RESULTS / "run")  # a folder: results.json, results.md, results.png
DEFAULT_LOADERS = ("torch", "dali-shuffle", "dali-seq", "dali-epoch-shuffle", "coordl")
# Pipelines of the same ops, whose fastest rate is the prep rate P: DALI's, else Pillow's.
PIPELINES_OF_P = (("dali-shuffle", "dali-seq", "dali-epoch-shuffle", "coordl"), ("torch", "coordl-torch"))
SHOWN = ("seconds", "samples_per_s", "device_bytes", "wait_s", "storage_bytes", "cache_hits")  # per epoch, in the log


def parse_bandwidth(spec: str) -> tuple[float, str] | None:
    """``"0.25P"`` -> (0.25, "P") (a fraction of the prep rate); ``"20MB"`` -> (20e6, "B/s"); ``"none"`` -> None."""
    if spec.strip().lower() in ("none", "0", "off"):
        return None
    m = re.fullmatch(r"([0-9.]+)\s*[pP]", spec.strip())
    return (float(m.group(1)), "P") if m else (float(parse_bytes(spec.strip())), "B/s")


def resolve_bandwidth(cell: dict, prep_bps: float | None) -> int | None:
    if cell["bandwidth"] is None:
        return None
    value, unit = cell["bandwidth"]
    if unit == "P" and prep_bps is None:
        raise SystemExit(f"scenario {cell['name']} needs the prep rate: keep the 'fits' scenario or pass --prep-rate")
    return int(value * prep_bps) if unit == "P" else int(value)


def usage(cgroup: str) -> tuple[int, int]:
    """The cgroup's usage and its unmapped file page cache (the page-cache loaders' data; libraries are mapped)."""
    stat = dict(line.split() for line in Path(cgroup, "memory.stat").read_text().splitlines())
    cache, rss = int(stat["total_cache"]), int(stat["total_rss"])
    return rss + cache, max(0, cache - int(stat["total_shmem"]) - int(stat["total_mapped_file"]))


def memory(cgroup: str | None, samples: list) -> dict:
    """An epoch's memory: its cgroup's peak (reset per epoch) and mean :func:`usage`, else the process tree's peak."""
    if not cgroup:
        kb = sum(resource.getrusage(who).ru_maxrss for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
        return {"peak_memory_bytes": kb * 1024, "peak_memory_kind": "rss"}
    mean = [sum(x[i] for x in samples) // len(samples) for i in (0, 1)] if samples else usage(cgroup)
    peak = {"peak_memory_bytes": int(Path(cgroup, "memory.max_usage_in_bytes").read_text())}
    return peak | {"peak_memory_kind": "cgroup", "mean_memory_bytes": mean[0], "mean_file_cache_bytes": mean[1]}


def job(args) -> None:
    """The child (:class:`jobs.Parent`): the loader and warm-up batches, ``ready``, then epochs (0: the cold one)."""
    parent, dev = jobs.Parent(), tuple(int(x) for x in args.device.split(":"))
    loader = Loader(args.job, args.data, args.batch_size, args.workers, 0, args.cache_bytes)
    batches = loader.batches()
    warm = sum(len(next(batches)[0]) for _ in range(args.warmup_batches))
    parent.say(event="ready")  # the runner sets the limits before its 'go'
    parent.wait()
    compute = (lambda _: time.sleep(args.compute_ms / 1000)) if args.compute_ms else None  # a stand-in GPU
    for e in range(args.epochs):
        if args.memcg:
            Path(args.memcg, "memory.max_usage_in_bytes").write_text("0")
        sampler = measure.Sampler(lambda: usage(args.memcg), 0.1) if args.memcg else None
        row = {"epoch": e} | epoch_row(batches if e == 0 else loader.batches(), dev, compute, warm if e == 0 else 0)
        row |= memory(args.memcg, sampler.stop() if sampler else [])
        if (counters := loader.counters()) is not None:
            row["counters"] = counters  # epoch 0's include the warm-up batches
        parent.say(event="epoch", **row)
        parent.wait()
    loader.close()
    parent.say(event="done")


def run_one(args, cell: dict, loader: str, data: dict, dev, caps: dict, bandwidth: int | None, k: int) -> dict:
    cache_bytes, fits = round(cell["cache"] * data["total_bytes"]), cell["name"] == "fits"
    kw = {"job": loader, "data": data["root"], "batch_size": args.batch_size, "workers": args.workers}
    kw |= {"epochs": args.fit_epochs if fits else args.epochs, "cache_bytes": cache_bytes}
    kw |= {"compute_ms": args.compute_ms, "warmup_batches": args.warmup_batches, "device": f"{dev[0]}:{dev[1]}"}
    run = {"scenario": cell["name"], "loader": loader, "cache_fraction": cell["cache"], "cache_bytes": cache_bytes}
    run |= {"bandwidth_bps": bandwidth, "epochs": []}
    limits.drop_page_cache(3)  # libraries the child loads are read (and charged to it) alike for every loader
    lim = limits.Limits(f"coordl-bench-{os.getpid()}-{k}", caps["memory"], caps["blkio"])  # either may be absent

    def on_message(event: str, msg: dict) -> None:
        if event == "ready":
            limits.drop_page_cache(3)
            if lim.memory and not fits:
                limit_memory(args, run, lim)
            lim.throttle(dev, bandwidth)
            return
        run["epochs"].append(msg)
        shown = {**msg, **msg.get("counters", {})}
        log(f"  epoch {msg['epoch']}: " + ", ".join(f"{k} {shown[k]}" for k in SHOWN if k in shown))

    try:
        if loader in MEASURE_WHEN_MADE:
            lim.throttle(dev, bandwidth)  # it measures the storage when it is made: the throttle must be there then
        command = jobs.scenario_command("run", *jobs.flags(**kw, memcg=lim.memory_path))
        status, err, _ = jobs.converse(command, on_message, preexec_fn=lim.join)
        if status:
            tail = jobs.error_text(err).splitlines()[-1:]
            run["error"] = f"the child exited with status {status}" + "".join(f": {t}" for t in tail)
    except Exception as e:  # noqa: BLE001 - recorded, the sweep goes on
        run["error"] = f"{type(e).__name__}: {e}"
    finally:
        lim.remove()
    if "error" in run:
        log(f"  FAILED: {run['error']}")
    steady(args, run, data, fits and lim.memory)
    return run


def limit_memory(args, run: dict, lim: limits.Limits) -> None:
    """Working set ('fits', else after warm-up) + cache + slack (coordl's, with its margin; docs/benchmarks.md)."""
    coordl = run["loader"] in COORDL_LOADERS
    ws, source = args.working_sets.get(run["loader"]), "fits-peak"
    if ws is None:  # coordl's cache is not its working set
        ws, source = lim.usage() - (lim.stat("total_shmem") if coordl else 0), "after-warmup"
    run["working_set_bytes"], run["working_set_source"] = ws, source
    need = ws + run["cache_bytes"] + (args.slack if coordl else args.baseline_slack)
    run["memory_limit_bytes"] = max(need + MIN_MARGIN, -(-need * 10 // 9)) if coordl else need
    lim.limit_memory(run["memory_limit_bytes"])


def steady(args, run: dict, data: dict, working_set: bool) -> None:
    """The steady epochs' median time and rate, mean bytes and waits; with ``working_set``, the loader's memory
    with the dataset cached less the dataset: coordl's peak (its cache cannot shrink), the others' mean."""
    if not (es := run["epochs"][1:]):
        return
    if working_set:
        if run["loader"] in COORDL_LOADERS:
            ws = max(e["peak_memory_bytes"] for e in es) - es[-1]["counters"]["cache_budget"]
        else:
            ws = max(e["mean_memory_bytes"] for e in es) - data["page_bytes"]
        args.working_sets[run["loader"]] = run["working_set_bytes"] = ws
    s = run["steady"] = {k: statistics.median(e[k] for e in es) for k in ("seconds", "samples_per_s")}
    s |= {k: sum(e[k] for e in es) / len(es) for k in ("device_bytes", "wait_s")}
    s["peak_memory_bytes"] = max(e["peak_memory_bytes"] for e in es)
    if all("mean_file_cache_bytes" in e for e in es):
        s["mean_page_cache_bytes"] = sum(e["mean_file_cache_bytes"] for e in es) / len(es)
    if c := es[-1].get("counters"):
        s |= {"coordl_cache_bytes": c["cache_bytes"]}
        s["coordl_storage_bytes"] = sum(e["counters"]["storage_bytes"] for e in es) / len(es)


def prep_rate(runs: list[dict]) -> float | None:
    """P in samples/s: the fastest steady rate in 'fits' of the DALI pipelines, else of the Pillow ones."""
    for family in PIPELINES_OF_P:
        if ok := [r for r in runs if r["scenario"] == "fits" and r["loader"] in family and "steady" in r]:
            return max(r["steady"]["samples_per_s"] for r in ok)
    return None


def summarise(result: dict) -> list[dict]:
    """Per scenario: the best baseline, coordl and coordl's torch backend, their bytes vs the minimum, coordl's
    speedup over the best baseline and its bound, coordl-torch's over ``torch`` (which runs the same Python)."""
    total, p, out = result["dataset"]["total_bytes"], result.get("prep_rate_samples_per_s"), []
    for cell in result["scenarios"]:
        runs = {r["loader"]: r["steady"] for r in result["runs"] if r["scenario"] == cell["name"] and "steady" in r}
        if not runs:
            continue
        minimum, bw = total - round(cell["cache"] * total), cell.get("bandwidth_bps")
        row = {"scenario": cell["name"], "cache_fraction": cell["cache"], "bandwidth_bps": bw, "minimum_bytes": minimum}
        if base := {name: s["seconds"] for name, s in runs.items() if name not in COORDL_LOADERS}:
            row["best_baseline"] = min(base, key=base.get)
            row["best_baseline_s"] = base[row["best_baseline"]]
        for key, mine in ((k.replace("-", "_"), runs[k]) for k in ("coordl", "coordl-torch") if k in runs):
            row |= {f"{key}_s": mine["seconds"], f"{key}_device_bytes": mine["device_bytes"]}
            row[f"{key}_storage_bytes"] = mine.get("coordl_storage_bytes")
            if minimum:
                row[f"{key}_device_over_min"] = mine["device_bytes"] / minimum
        if "coordl_s" in row and base:
            row["speedup_vs_best"] = row["best_baseline_s"] / row["coordl_s"]
        if "coordl_s" in row and p:
            row["bound_s"] = max((1 - cell["cache"]) * total / bw if bw else 0.0, result["dataset"]["files"] / p)
            row["coordl_over_bound"] = row["coordl_s"] / row["bound_s"]
        if "coordl_torch_s" in row and "torch" in runs:
            row["torch_s"] = runs["torch"]["seconds"]
            row["coordl_torch_speedup_vs_torch"] = row["torch_s"] / row["coordl_torch_s"]
        out.append(row)
    return out


def fmt_bw(bps: int | None) -> str:
    return "unthrottled" if not bps else f"{format_bytes(bps, 'MB', digits=0)}/s"


def markdown(result: dict) -> str:
    """The conditions, a row per run and a row per scenario (coordl against the best baseline and the bound)."""
    d, p, lim = result["dataset"], result.get("prep_rate_samples_per_s"), result["limits"]
    applied = ", ".join(k for k in ("memory", "blkio", "drop_caches") if lim[k]) or "none"
    lines = [f"Dataset: {dataset.describe(d)}, {d['classes']} classes, at `{d['root']}`; limits applied: {applied}."]
    lines += [f"Prep rate P = {p:.0f} samples/s = {format_bytes(p * d['mean_bytes'], 'MB')}/s."] if p else []
    lines += [*(f"**NOTE:** {n}" for n in lim["notes"]), ""]
    rows = []
    for r in result["runs"]:
        s, minimum = r.get("steady"), d["total_bytes"] * (1 - r["cache_fraction"])
        where = [r["scenario"], fmt_bw(r["bandwidth_bps"]), f"{r['cache_fraction']:.0%}", r["loader"]]
        if s is None:
            rows.append([*where, f"failed: {r.get('error', '?')}"] + [None] * 8)
            continue
        held = s.get("coordl_cache_bytes", s.get("mean_page_cache_bytes"))
        over = f"{s['device_bytes'] / minimum:.3f}" if minimum > 500_000 else None
        cells = [r["epochs"][0]["seconds"], s["seconds"], round(s["samples_per_s"]), report.mb(s["device_bytes"])]
        cells += [over, s["wait_s"], report.mb(held, 0), report.mb(s["peak_memory_bytes"], 0)]
        rows.append([*where, *cells, report.mb(r.get("memory_limit_bytes"), 0)])
    head = "scenario|storage|cache|loader|cold s|steady s|samples/s|device MB/epoch|vs minimum|waiting s"
    lines += [report.table(head + "|data in memory MB|peak MB|limit MB", rows), ""]
    keys = "best_baseline best_baseline_s coordl_s speedup_vs_best coordl_device_over_min bound_s coordl_over_bound"
    keys = [*keys.split(), "coordl_torch_speedup_vs_torch"]
    rows = [
        [r["scenario"], fmt_bw(r["bandwidth_bps"]), f"{r['cache_fraction']:.0%}", *map(r.get, keys)]
        for r in result["summary"]
    ]
    head = "scenario|storage|cache|best baseline|its s|coordl s|speedup|coordl device/min|bound s|coordl/bound"
    return "\n".join([*lines, report.table(head + "|coordl-torch vs torch", rows)]) + "\n"


def draw(plt, result: dict):
    """Steady epoch time and device bytes per scenario, a bar per loader; the minimum bytes dashed."""
    cells, total = result["scenarios"], result["dataset"]["total_bytes"]
    done = {(r["scenario"], r["loader"]): r["steady"] for r in result["runs"] if "steady" in r}
    loaders = [name for name in LOADERS if any(name == n for _, n in done)]
    fig, axes = plt.subplots(2, 1, figsize=(3 + 1.2 * len(cells), 7))
    width, at = 0.8 / max(1, len(loaders)), range(len(cells))
    metrics = (("seconds", 1, "steady epoch s"), ("device_bytes", 1e6, "device MB per steady epoch"))
    for ax, (metric, scale, label) in zip(axes, metrics):
        for j, name in enumerate(loaders):
            got = {i: done[c["name"], name][metric] / scale for i, c in enumerate(cells) if (c["name"], name) in done}
            ax.bar([i + (j - (len(loaders) - 1) / 2) * width for i in got], list(got.values()), width, label=name)
        ax.set(xticks=at, xticklabels=[f"{c['name']}\n{fmt_bw(c.get('bandwidth_bps'))}" for c in cells], ylabel=label)
    lows = [total * (1 - c["cache"]) / 1e6 for c in cells]  # what the cache does not hold
    axes[1].hlines(lows, [i - 0.45 for i in at], [i + 0.45 for i in at], "k", "--", label="minimum")
    axes[1].legend(fontsize=8)
    fig.suptitle(f"{result['dataset']['files']} images, {format_bytes(total, 'MB')}; memory = working set + cache")
    return fig


def warm(args, data: dict, dev: tuple[int, int]) -> dict:
    """``--warm``: a warm-up epoch of every loader (coordl's caches then hold the dataset: checked), then ``--reps``
    epochs each, ABBA, in this process. coordl-torch first: coordl drops the page cache of what it reads."""
    total, files, made = data["total_bytes"], data["files"], {}
    try:
        for name in args.loaders:
            made[name] = Loader(name, args.data, args.batch_size, args.workers, 0, cache_bytes=total)
        warmup = {name: epoch_row(loader.batches(), dev) for name, loader in made.items()}
        if (held := made["coordl-torch"].counters()["cache_items"]) != files:
            raise RuntimeError(f"coordl's cache holds {held} of {files} samples: free /dev/shm (`coordl cache ls`)")
        epochs = []
        for rep, name in measure.alternate(args.loaders, args.reps):
            epochs.append(row := {"rep": rep, "loader": name, **epoch_row(made[name].batches(), dev)})
            if row["samples"] != files:
                raise RuntimeError(f"{name} delivered {row['samples']} samples in an epoch of {files}")
            if (counters := made[name].counters()) is not None:
                row["counters"] = counters
            log(f"[warm] rep {rep} {name:12s} {row['samples_per_s']:8.1f} samples/s, device {row['device_bytes']} B")
    finally:
        for loader in made.values():
            loader.close()
    median = {name: statistics.median(e["samples_per_s"] for e in epochs if e["loader"] == name) for name in made}
    out = {"cache_bytes": total, "reps": args.reps, "warmup": warmup, "epochs": epochs, "median_samples_per_s": median}
    ratio = round(median["coordl-torch"] / median["torch"], 4)
    return out | {"ratio_coordl_torch_over_torch": ratio, "target_ratio": 0.95}


def table(result: dict) -> str:
    """``--warm``'s figures: a row per loader, and coordl-torch / torch."""
    w, rows = result["warm"], []
    for name, median in w["median_samples_per_s"].items():
        es = [e for e in w["epochs"] if e["loader"] == name]
        rates = ", ".join(f"{e['samples_per_s']:.0f}" for e in es)
        rows.append([name, median, rates, report.mb(max(e["device_bytes"] for e in es))])
    ratio = f"**coordl-torch / torch: {w['ratio_coordl_torch_over_torch']:.3f}** (target >= {w['target_ratio']})"
    return report.table("loader|median samples/s|samples/s per epoch|device MB per epoch (max)", rows) + f"\n\n{ratio}"


def out_path(args) -> Path:
    return Path(args.out) / "torch_backend.json"  # --warm's; the sweep writes its own files


def options(p) -> None:
    dataset.add_dataset_options(p, data="/var/tmp/coordl-bench/bench", images=None, size="500MB", classes=100)
    p.add_argument("--warm", action="store_true", help="the loaders in this process, everything in memory")
    p.add_argument("--reps", type=int, default=4, help="--warm's timed epochs per loader, ABBA")
    p.add_argument("--loaders", default=",".join(DEFAULT_LOADERS), help=f"a subset of {','.join(LOADERS)}")
    p.add_argument("--cache", default="0.25,0.5,0.75", help="cache fractions of the dataset (memory for caching)")
    p.add_argument("--bandwidth", default="0.25P,0.5P,2P", help="storage throttles: '20MB' (per second), or '0.5P'")
    p.add_argument("--no-fit", action="store_true", help="skip the everything-fits scenario (needs --prep-rate)")
    p.add_argument("--prep-rate", type=float, help="prep rate P in samples/s, instead of measuring it")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--fit-epochs", type=int, default=6, help="epochs of the 'fits' scenario (the overhead check)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--workers", type=int, default=os.cpu_count(), help="worker processes / DALI threads per loader")
    p.add_argument("--compute-ms", type=float, default=0.0, help="a fixed compute step per batch (a stand-in GPU)")
    p.add_argument("--warmup-batches", type=int, default=3)
    p.add_argument("--no-memory-limit", action="store_true", help="no memory cgroup (the throttle still applies)")
    p.add_argument("--slack", type=parse_bytes, default=32 << 20, help="coordl's memory beyond working set + cache")
    p.add_argument("--baseline-slack", type=parse_bytes, default=0, help="the others' (their page cache uses it)")
    p.add_argument("--resume", action="store_true", help="keep the runs already in OUT/results.json")
    for name, kind in (("--job", str), ("--cache-bytes", int), ("--device", str), ("--memcg", str)):
        p.add_argument(name, type=kind, help=argparse.SUPPRESS)  # the child's: its loader, budget, MAJ:MIN, cgroup


def run(args) -> dict | None:
    if args.job:
        return job(args)
    args.cache = [float(c) for c in args.cache.split(",") if c]
    args.bandwidth, args.loaders = ([x for x in a.split(",") if x] for a in (args.bandwidth, args.loaders))
    if unknown := set(args.loaders) - set(LOADERS):
        raise SystemExit(f"unknown loaders {sorted(unknown)}; choose from {', '.join(LOADERS)}")
    if args.warm and not {"torch", "coordl-torch"} <= set(args.loaders):
        raise SystemExit("--warm compares coordl-torch with torch: give both in --loaders (coordl-torch,coordl,torch)")
    if args.warm:
        data, dev = dataset.dataset_from_args(args), measure.device_of(args.data)
        return {"dataset": data, "warm": warm(args, data, dev)}
    out, caps = Path(args.out), limits.probe()
    out.mkdir(parents=True, exist_ok=True)
    if args.no_memory_limit and caps["memory"]:
        caps["memory"] = False
        caps["notes"].append("--no-memory-limit: no memory cgroup, every loader may cache the whole dataset")
    for n in caps["notes"]:
        log("NOTE:", n)
    data, dev, args.working_sets = dataset.dataset_from_args(args), measure.device_of(args.data), {}
    data["page_bytes"] = int((-(-Index.scan(args.data, index_dir="").sizes // 4096) * 4096).sum())  # whole 4 KiB pages
    log(f"dataset: {dataset.describe(data)}; device {dev[0]}:{dev[1]}")
    cells = [] if args.no_fit else [{"name": "fits", "cache": 1.0, "bandwidth": None}]
    cells += [
        {"name": f"{b}@{c:g}", "cache": c, "bandwidth": parse_bandwidth(b)} for b in args.bandwidth for c in args.cache
    ]
    result = {"dataset": data, "limits": caps, "scenarios": cells, "runs": [], "working_sets": args.working_sets}
    path, done = out / "results.json", {}
    old = json.loads(path.read_text()) if args.resume and path.exists() else {}
    if old.get("dataset", {}).get("total_bytes") == data["total_bytes"]:
        done = {(r["scenario"], r["loader"]): r for r in old["results"]["runs"] if "steady" in r}
        args.working_sets.update(old["results"].get("working_sets", {}))
    p_rate = args.prep_rate
    for ci, cell in enumerate(cells):
        if cell["name"] != "fits" and p_rate is None and (p_rate := prep_rate(result["runs"])):
            log(f"prep rate P = {p_rate:.0f} samples/s = {format_bytes(p_rate * data['mean_bytes'], 'MB')}/s")
        result["prep_rate_samples_per_s"] = p_rate
        cell["bandwidth_bps"] = bw = resolve_bandwidth(cell, p_rate * data["mean_bytes"] if p_rate else None)
        for loader in args.loaders if ci % 2 == 0 else args.loaders[::-1]:  # ABBA across the scenarios
            if not (r := done.get((cell["name"], loader))):
                log(f"[{cell['name']}] {loader}: cache {cell['cache']:.0%}, storage {fmt_bw(bw)}")
                r = run_one(args, cell, loader, data, dev, caps, bw, len(result["runs"]))
            result["runs"].append(r)
            cli.save(args, result, path)
    result["summary"] = summarise(result)
    if why := report.plot(out / "results.png", lambda plt: draw(plt, result)):
        caps["notes"].append(why)
    cli.save(args, result, path)
    (out / "results.md").write_text(markdown(result))
    print(markdown(result))
    log(f"wrote {path}, {out / 'results.md'}, {out / 'results.png'}")
