"""Epoch time and storage bytes of coordl vs DataLoader and DALI, with short memory and slow storage.

    python -m benchmarks run --data /var/tmp/coordl-bench/bench --size 500MB --classes 100

Per scenario (a cache fraction of the dataset and a storage bandwidth) and loader
(``benchmarks.loaders``), a child runs the same loop for several epochs in its own memory and blkio
cgroup: it makes its loader and runs warm-up batches; the runner drops the page cache, sets the memory
limit to ``working set + slack + cache fraction * dataset`` (so every loader gets the same memory for
data: the page cache, or coordl's cache) and throttles the dataset's device (``coordl-auto``, which
measures storage when made, from its start); the child then reports per epoch seconds, samples/s,
device bytes (``/proc/diskstats``), waits, peak memory and coordl's counters. The first scenario,
``fits`` (whole dataset's memory, no throttle), is the overhead check and measures the prep rate P
(fastest steady DALI pipeline, else Pillow one) that bandwidths such as ``0.25P`` refer to.

Writes ``results.json`` (after every run: ``--resume``), ``results.md`` and ``results.png`` to
``--out``. Without root or v1 cgroups it says so (also in the JSON) and runs unlimited.
"""

from __future__ import annotations

import json
import os
import queue
import re
import statistics
import subprocess
import threading
from pathlib import Path

from benchmarks.harness import cli, dataset, jobs, limits, measure, report
from benchmarks.harness.report import log
from benchmarks.loaders import COORDL_LOADERS, LOADERS, MEASURE_WHEN_MADE, image_folder
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
    spec = spec.strip()
    if spec.lower() in ("none", "0", "off"):
        return None
    m = re.fullmatch(r"([0-9.]+)\s*[pP]", spec)
    if m:
        return float(m.group(1)), "P"
    return float(parse_bytes(spec)), "B/s"


def scenarios(args) -> list[dict]:
    fits = {"name": "fits", "cache": 1.0, "bandwidth": None, "label": "fits in memory, unthrottled"}
    cells = [] if args.no_fit else [fits]
    for spec in args.bandwidth:
        cells += [
            {"name": f"{spec}@{c:g}", "cache": c, "bandwidth": parse_bandwidth(spec), "spec": spec} for c in args.cache
        ]
    return cells


def resolve_bandwidth(cell: dict, prep_bps: float | None) -> int | None:
    bw = cell["bandwidth"]
    if bw is None:
        return None
    value, unit = bw
    if unit == "P" and prep_bps is None:
        raise SystemExit(f"scenario {cell['name']} needs the prep rate: keep the 'fits' scenario or pass --prep-rate")
    return int(value * prep_bps) if unit == "P" else int(value)


# -- one run ---------------------------------------------------------------------------------------
class Child:
    """A loader child process with its stdout read by a thread (so waits can time out)."""

    def __init__(self, cmd: list[str], lim: limits.Limits | None, logfile: Path):
        self.log = open(logfile, "w")
        popen = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE, "stderr": self.log, "text": True}
        self.proc = subprocess.Popen(cmd, preexec_fn=lim.join if lim else None, **popen)
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def message(self, timeout: float) -> dict:
        while True:
            try:
                line = self.lines.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(f"no word from the child for {timeout:.0f} s") from None
            if line is None:
                raise RuntimeError(f"the child exited with status {self.proc.wait()}; see {self.log.name}")
            line = line.strip()
            if line.startswith("{"):
                return json.loads(line)

    def send(self, text: str) -> None:
        self.proc.stdin.write(text + "\n")
        self.proc.stdin.flush()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.log.close()


def coordl_limit(need: int) -> int:
    """The smallest memory limit that leaves ``need`` bytes beside the margin coordl keeps free
    under a limit and never fills with data (:func:`coordl.shm.limits.margin`: 10%, at least 256 MiB)."""
    return max(need + MIN_MARGIN, -(-need * 10 // 9))


def run_one(args, cell: dict, loader: str, data: dict, dev, caps: dict, bandwidth: int | None, k: int) -> dict:
    total = data["total_bytes"]
    cache_bytes = int(round(cell["cache"] * total))
    name = f"coordl-bench-{os.getpid()}-{k}"
    use_cgroups = caps["memory"] or caps["blkio"]
    lim = limits.Limits(name, caps["memory"], caps["blkio"]) if use_cgroups else None
    epochs = args.fit_epochs if cell["name"] == "fits" else args.epochs
    kw = {"batch_size": args.batch_size, "workers": args.workers, "epochs": epochs, "seed": args.seed}
    kw |= {"cache_bytes": cache_bytes, "compute_ms": args.compute_ms, "warmup_batches": args.warmup_batches}
    kw |= {"loader": loader, "data": data["root"], "device": f"{dev[0]}:{dev[1]}"}
    cmd = jobs.module_command("loaders", *jobs.flags(**kw))
    if lim and lim.memory_path:
        cmd += ["--memcg", lim.memory_path]
    logs = Path(args.out) / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    if caps["drop_caches"]:  # libraries the child loads are read (and charged to it) alike for every loader
        limits.drop_page_cache(3)
    if lim and loader in MEASURE_WHEN_MADE:
        lim.throttle(dev, bandwidth)  # it measures the storage when it is made: the throttle must be there then
    child = Child(cmd, lim, logs / f"{cell['name'].replace('/', '_')}-{loader}.log")
    run = {"scenario": cell["name"], "loader": loader, "cache_fraction": cell["cache"], "cache_bytes": cache_bytes}
    run |= {"bandwidth_bps": bandwidth, "epochs": []}
    try:
        run["ready"] = child.message(args.timeout)
        if caps["drop_caches"]:
            limits.drop_page_cache(3)
        if lim and lim.memory and cell["name"] != "fits":
            ws = working_set(args, loader, lim)
            run["working_set_bytes"], run["working_set_source"] = ws
            # coordl's cache is fixed at the budget: the slack only keeps its peaks from the OOM
            # killer. The page cache would use any slack for data, so the others get none.
            if loader in COORDL_LOADERS:
                run["memory_limit_bytes"] = coordl_limit(ws[0] + cache_bytes + args.slack)
            else:
                run["memory_limit_bytes"] = ws[0] + cache_bytes + args.baseline_slack
            lim.limit_memory(run["memory_limit_bytes"])
        if lim:
            lim.throttle(dev, bandwidth)
        child.send("go")
        while True:
            msg = child.message(args.timeout)
            if msg.get("done"):
                break
            run["epochs"].append(msg)
            c = msg.get("counters") or {}
            log(
                f"  epoch {msg['epoch']}: {msg['seconds']:7.2f} s  {msg['samples_per_s']:7.1f} samples/s  "
                f"device {format_bytes(msg['device_bytes'], 'MB'):>10}  wait {msg['wait_s']:6.2f} s"
                + (f"  coordl storage {format_bytes(c['storage_bytes'], 'MB')}, hits {c['cache_hits']}" if c else "")
            )
    except Exception as e:  # noqa: BLE001 - recorded, the sweep goes on
        run["error"] = f"{type(e).__name__}: {e}"
        log(f"  FAILED: {run['error']}")
    finally:
        child.close()
        if lim:
            lim.remove()
    steady = run["epochs"][1:]
    if steady and cell["name"] == "fits" and lim and lim.memory:
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
        mean = lambda key: sum(e[key] for e in steady) / len(steady)  # noqa: E731
        run["steady"] = {k: statistics.median(e[k] for e in steady) for k in ("seconds", "samples_per_s")}
        run["steady"] |= {"device_bytes": mean("device_bytes"), "wait_s": mean("wait_s")}
        run["steady"]["peak_memory_bytes"] = max(e["peak_memory_bytes"] for e in steady)
        if all("mean_file_cache_bytes" in e for e in steady):
            run["steady"]["mean_page_cache_bytes"] = mean("mean_file_cache_bytes")
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
    total = result["dataset"]["total_bytes"]
    files = result["dataset"]["files"]
    p = result.get("prep_rate_samples_per_s")
    out = []
    for cell in result["scenarios"]:
        runs = [r for r in result["runs"] if r["scenario"] == cell["name"] and "steady" in r]
        base = [r for r in runs if r["loader"] not in COORDL_LOADERS]
        mine = next((r for r in runs if r["loader"] == "coordl"), None)
        mine_torch = next((r for r in runs if r["loader"] == "coordl-torch"), None)
        torch_run = next((r for r in runs if r["loader"] == "torch"), None)
        if not runs:
            continue
        minimum = total - int(round(cell["cache"] * total))
        row = {"scenario": cell["name"], "cache_fraction": cell["cache"], "bandwidth_bps": cell.get("bandwidth_bps")}
        row["minimum_bytes"] = minimum
        if base:
            best = min(base, key=lambda r: r["steady"]["seconds"])
            row.update(best_baseline=best["loader"], best_baseline_s=best["steady"]["seconds"])
        if mine:
            steady = mine["steady"]
            row |= {"coordl_s": steady["seconds"], "coordl_device_bytes": steady["device_bytes"]}
            row["coordl_storage_bytes"] = steady.get("coordl_storage_bytes")
            if minimum:
                row["coordl_device_over_min"] = mine["steady"]["device_bytes"] / minimum
            if base:
                row["speedup_vs_best"] = row["best_baseline_s"] / row["coordl_s"]
            if p:
                bw = cell.get("bandwidth_bps")
                fetch = (1 - cell["cache"]) * total / bw if bw else 0.0
                row["bound_s"] = max(fetch, files / p)
                row["coordl_over_bound"] = row["coordl_s"] / row["bound_s"]
        if mine_torch:
            row["coordl_torch_s"] = mine_torch["steady"]["seconds"]
            if minimum:
                row["coordl_torch_device_over_min"] = mine_torch["steady"]["device_bytes"] / minimum
            if torch_run:
                row["torch_s"] = torch_run["steady"]["seconds"]
                row["coordl_torch_speedup_vs_torch"] = row["torch_s"] / row["coordl_torch_s"]
        out.append(row)
    return out


def fmt_bw(bps: int | None) -> str:
    return "unthrottled" if not bps else f"{format_bytes(bps, 'MB', digits=0)}/s"


def markdown(result: dict) -> str:
    d, a, yes = result["dataset"], result["args"], {k: "yes" if v else "NO" for k, v in result["limits"].items()}
    lines = [
        f"Dataset: {d['files']} files in {d['classes']} classes, {format_bytes(d['total_bytes'], 'MB')}, "
        f"mean {format_bytes(d['mean_bytes'], 'KB')} ({d['source']}) at `{d['root']}`.",
        f"Batch {a['batch_size']}, {a['workers']} workers/threads per loader, {a['epochs']} epochs ({a['fit_epochs']} "
        "when everything fits; epoch 0 cold, the rest steady: median time, mean bytes), compute step "
        f"{a['compute_ms']} ms/batch.",
        f"Limits: memory cgroup {yes['memory']}, blkio throttle {yes['blkio']}, page cache dropped "
        f"{yes['drop_caches']}; slack {format_bytes(a['slack'], 'MiB', digits=0)}.",
    ]
    if result.get("prep_rate_samples_per_s"):
        p = result["prep_rate_samples_per_s"]
        lines.append(
            f"Prep rate P = {p:.0f} samples/s = {format_bytes(p * d['mean_bytes'], 'MB')}/s "
            f"(fastest DALI pipeline, else fastest Pillow one; everything in memory)."
        )
    for n in result["limits"]["notes"]:
        lines.append(f"**NOTE:** {n}")
    lines += [
        "",
        "| scenario | storage | cache | loader | cold s | steady s | samples/s | device MB/epoch | "
        "vs minimum | waiting s | data in memory MB | peak MB | limit MB |",
        "|" + "---|" * 13,
    ]
    for cell in result["scenarios"]:
        minimum = d["total_bytes"] * (1 - cell["cache"])
        for r in (r for r in result["runs"] if r["scenario"] == cell["name"]):
            if "steady" not in r:
                lines.append(f"| {cell['name']} | | | {r['loader']} | failed: {r.get('error', '?')} |" + " |" * 8)
                continue
            s = r["steady"]
            vs = f"{s['device_bytes'] / minimum:.3f}" if minimum > 500_000 else "-"
            lim = report.mb(r.get("memory_limit_bytes") or None, digits=0)
            held = s.get("coordl_cache_bytes", s.get("mean_page_cache_bytes"))
            cells = [
                fmt_bw(r["bandwidth_bps"]),
                f"{cell['cache']:.0%}",
                r["loader"],
                f"{r['epochs'][0]['seconds']:.1f}",
            ]
            cells += [f"{s['seconds']:.2f}", f"{s['samples_per_s']:.0f}", report.mb(s["device_bytes"]), vs]
            cells += [f"{s['wait_s']:.1f}", report.mb(held, digits=0), report.mb(s["peak_memory_bytes"], digits=0), lim]
            lines.append(f"| {cell['name']} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "| scenario | storage | cache | best baseline | its s | coordl s | speedup | "
        "coordl device/min | bound s | coordl/bound |",
        "|" + "---|" * 10,
    ]
    for row in result["summary"]:
        g = row.get
        cells = [fmt_bw(g("bandwidth_bps")), f"{row['cache_fraction']:.0%}", g("best_baseline", "-")]
        cells += [_f(g("best_baseline_s")), _f(g("coordl_s")), f"{_f(g('speedup_vs_best'), 3)}x"]
        cells += [_f(g("coordl_device_over_min"), 3), _f(g("bound_s")), _f(g("coordl_over_bound"), 3)]
        lines.append(f"| {row['scenario']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _f(x, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def plot(result: dict, path: Path) -> str | None:
    return report.plot(path, lambda plt: draw(plt, result))


def draw(plt, result: dict):
    groups: dict[str, list[dict]] = {}
    for cell in result["scenarios"]:
        key = "fits" if cell["name"] == "fits" else fmt_bw(cell.get("bandwidth_bps"))
        groups.setdefault(key, []).append(cell)
    loaders = [name for name in LOADERS if any(r["loader"] == name for r in result["runs"])]
    done = {(r["scenario"], r["loader"]): r for r in result["runs"] if "steady" in r}
    fig, axes = plt.subplots(2, len(groups), figsize=(4.2 * len(groups), 7), squeeze=False)
    width = 0.8 / max(1, len(loaders))
    total = result["dataset"]["total_bytes"]
    for col, (key, cells) in enumerate(groups.items()):
        for row, metric in enumerate(("seconds", "device_bytes")):
            ax = axes[row][col]
            for j, name in enumerate(loaders):
                xs, ys = [], []
                for i, cell in enumerate(cells):
                    r = done.get((cell["name"], name))
                    if r:
                        xs.append(i + (j - (len(loaders) - 1) / 2) * width)
                        ys.append(r["steady"][metric] / (1e6 if metric == "device_bytes" else 1))
                ax.bar(xs, ys, width, label=name)
            if metric == "device_bytes":
                for i, cell in enumerate(cells):
                    label = "minimum" if i == 0 else None
                    ax.hlines(total * (1 - cell["cache"]) / 1e6, i - 0.45, i + 0.45, "k", "--", label=label)
            ax.set_xticks(range(len(cells)), [f"cache {c['cache']:.0%}" for c in cells])
            ax.set_title(key if row == 0 else "")
            ax.set_ylabel("steady epoch s" if metric == "seconds" else "device MB per steady epoch")
    axes[0][0].legend(fontsize=8)
    axes[1][0].legend(fontsize=8)
    fig.suptitle(
        f"{result['dataset']['files']} images, {format_bytes(total, 'MB', digits=0)}; memory = working set + cache"
    )
    return fig


# -- main ------------------------------------------------------------------------------------------
def options(p) -> None:
    dataset.add_dataset_options(p, data="/var/tmp/coordl-bench/bench", images=None, size="500MB", classes=100)
    loaders, bandwidth = ",".join(DEFAULT_LOADERS), "storage throttles: '20MB' (per second), or a multiple of P, '0.5P'"
    p.add_argument("--loaders", default=loaders, help=f"comma-separated subset of {','.join(LOADERS)}")
    p.add_argument("--cache", default="0.25,0.5,0.75", help="cache fractions of the dataset (memory for caching)")
    p.add_argument("--bandwidth", default="0.25P,0.5P,2P", help=bandwidth)
    p.add_argument("--no-fit", action="store_true", help="skip the everything-fits scenario (needs --prep-rate)")
    p.add_argument("--prep-rate", type=float, help="prep rate P in samples/s, instead of measuring it")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--fit-epochs", type=int, default=6, help="epochs of the 'fits' scenario (the overhead check)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--workers", type=int, default=os.cpu_count(), help="worker processes / DALI threads per loader")
    p.add_argument("--compute-ms", type=float, default=0.0, help="a fixed compute step per batch (a stand-in GPU)")
    p.add_argument("--warmup-batches", type=int, default=3)
    p.add_argument(
        "--no-memory-limit",
        action="store_true",
        help="no memory cgroup (the throttle and the page-cache drops still apply): for smoke runs on "
        "datasets smaller than a loader's memory swings, where any budget ends in the OOM killer",
    )
    slack = "memory beyond coordl's peak working set + cache (OOM headroom)"
    p.add_argument("--slack", type=parse_bytes, default=32 << 20, help=slack)
    slack = "memory beyond a baseline's working set + cache (default none: its page cache would use it for data)"
    p.add_argument("--baseline-slack", type=parse_bytes, default=0, help=slack + "; for smoke runs on tiny datasets")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=1800, help="seconds without word from a child before giving up")
    p.add_argument("--resume", action="store_true", help="keep the runs already in OUT/results.json")


def run(args) -> None:
    args.cache = [float(c) for c in args.cache.split(",") if c]
    args.bandwidth = [b for b in args.bandwidth.split(",") if b]
    args.loaders = [name for name in args.loaders.split(",") if name]
    unknown = set(args.loaders) - set(LOADERS)
    if unknown:
        raise SystemExit(f"unknown loaders {sorted(unknown)}; choose from {', '.join(LOADERS)}")

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    caps = limits.probe()
    if args.no_memory_limit and caps["memory"]:
        caps["memory"] = False
        caps["notes"].append("--no-memory-limit: no memory cgroup, every loader may cache the whole dataset")
    for n in caps["notes"]:
        log("NOTE:", n)
    data = dataset.dataset_from_args(args)
    dev = measure.device_of(args.data)
    # what the dataset occupies in the page cache: whole 4 KiB pages per file
    data["page_bytes"] = int((-(-image_folder(args.data).sizes // 4096) * 4096).sum())
    args.working_sets = {}
    log(f"dataset: {dataset.describe(data)}; device {dev[0]}:{dev[1]}")

    cells = scenarios(args)
    args_ = {k: v for k, v in vars(args).items() if k != "working_sets" and not k.startswith("_")}
    result = {"args": args_, "dataset": data, "limits": caps, "scenarios": cells, "working_sets": args.working_sets}
    result["runs"] = []
    path = out / "results.json"
    done: dict[tuple[str, str], dict] = {}
    if args.resume and path.exists():
        old = json.loads(path.read_text())
        if old["dataset"]["total_bytes"] == data["total_bytes"]:
            done = {(r["scenario"], r["loader"]): r for r in old["results"]["runs"] if "steady" in r}
            args.working_sets.update(old["results"].get("working_sets", {}))
    p_rate = args.prep_rate
    k = 0
    for ci, cell in enumerate(cells):
        if cell["name"] != "fits" and p_rate is None:
            p_rate = prep_rate(result["runs"])
            result["prep_rate_samples_per_s"] = p_rate
            if p_rate:
                log(f"prep rate P = {p_rate:.0f} samples/s = {format_bytes(p_rate * data['mean_bytes'], 'MB')}/s")
        bw = resolve_bandwidth(cell, p_rate * data["mean_bytes"] if p_rate else None)
        cell["bandwidth_bps"] = bw
        order = args.loaders if ci % 2 == 0 else args.loaders[::-1]  # ABBA across the scenarios
        for loader in order:
            if (cell["name"], loader) in done:
                result["runs"].append(done[(cell["name"], loader)])
                continue
            log(f"[{cell['name']}] {loader}: cache {cell['cache']:.0%}, storage {fmt_bw(bw)}")
            k += 1
            result["runs"].append(run_one(args, cell, loader, data, dev, caps, bw, k))
            cli.save(args, result, path)
    if p_rate and "prep_rate_samples_per_s" not in result:
        result["prep_rate_samples_per_s"] = p_rate
    result["summary"] = summarise(result)
    cli.save(args, result, path)
    md = markdown(result)
    (out / "results.md").write_text(md)
    why = plot(result, out / "results.png")
    if why:
        result["limits"]["notes"].append(why)
        log("NOTE:", why)
    print(md)
    for row in result["summary"]:
        if "speedup_vs_best" in row:
            print(
                f"{row['scenario']:>12}: coordl {row['coordl_s']:.2f} s vs {row['best_baseline']} "
                f"{row['best_baseline_s']:.2f} s -> {row['speedup_vs_best']:.2f}x"
                + (f"; {row['coordl_over_bound']:.2f}x the bound" if "coordl_over_bound" in row else "")
            )
        if "coordl_torch_speedup_vs_torch" in row:
            print(
                f"{row['scenario']:>12}: coordl-torch {row['coordl_torch_s']:.2f} s vs torch {row['torch_s']:.2f} s "
                f"-> {row['coordl_torch_speedup_vs_torch']:.2f}x"
            )
    log(f"wrote {path}, {out / 'results.md'}, {out / 'results.png'}")
