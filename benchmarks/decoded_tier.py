"""The decoded tier: steady samples/s against the cache's split beside the model's, and concurrent jobs.

    python -m benchmarks decoded_tier --data /var/tmp/coordl-bench/bench --images 4436 --classes 100

Prep alone (the files read once before, the encoded tier holds them all): ``imagenet-train`` at 224 on the CPU,
each run a fresh process with a shm folder of its own; the method is in docs/decoded-tier.md. **split**: one job
whose budget is the files plus ``f`` (``--fractions``) of the decoded images, ``"auto"`` with a budget for the
whole decoded dataset and for half, ``"auto"`` and ``0`` with ``ImageNetTrain(max_short_side=N)``: the median
of epochs 1.. beside :func:`coordl.analyze.model.tier_throughput` of the rates ``"auto"`` measured. **jobs**:
``--jobs`` jobs at once, own seeds: makespan with ``decoded_cache=0``, the decoded tier, and an ``hp_group``.
Writes ``decoded_tier.json`` and ``decoded_tier.png`` to the folder ``--out``.
"""

import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from benchmarks.harness import cli, dataset, limits, report
from benchmarks.harness.report import log

OUT = str(cli.RESULTS)  # a folder: decoded_tier.json, decoded_tier.png
DECODE = ("encoded", "decoded", "decoded_only")  # the prep rates TierRates takes after storage and cache

CHILD = textwrap.dedent(
    """
    import json, sys, time
    from coordl import CoordLoader
    from coordl import Cache, ImageNetTrain
    a = json.loads(sys.argv[1])
    loader = CoordLoader(a["data"], batch_size=a["batch"], pipeline=ImageNetTrain(max_short_side=a.get("cap")),
                         device_id=None, shuffle=True, prep=a.get("threads"), seed=a["seed"],
                         cache=Cache(size=a["cache_bytes"], decoded=a["decoded_cache"]), hp_group=a.get("hp_group"))
    out = {"tiers": loader.tier_plan.as_dict(), "epochs": []}
    for e in range(a["epochs"]):
        t0 = time.perf_counter()
        n = sum(len(labels) for _, labels in loader)
        dt = time.perf_counter() - t0
        s = loader.stats()
        out["epochs"].append({"samples": n, "seconds": dt, "samples_per_s": n / dt,
                              **{k: s[k] for k in ("decoded_hits", "decoded_admitted", "cache_hits", "storage_reads",
                                                   "decoded_cache_bytes", "cache_bytes")}})
    loader.close()
    print(json.dumps(out))
    """
)


def start(args, **kw) -> subprocess.Popen:
    shm = kw.pop("shm")
    spec = {"data": args.data, "batch": args.batch, "threads": args.threads, "seed": 0, **kw}
    env = {**os.environ, "COORDL_SHM_DIR": shm}
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE}
    return subprocess.Popen([sys.executable, "-c", CHILD, json.dumps(spec)], env=env, text=True, **pipes)


def finish(p: subprocess.Popen) -> dict:
    out, err = p.communicate()
    if p.returncode != 0:
        raise SystemExit(f"a benchmark job failed:\n{err[-3000:]}")
    return json.loads(out.strip().splitlines()[-1])


def decoded_bytes(root: str, cap: int | None = None) -> int:
    """The decoded dataset's RGB bytes from the headers (or capped as ``ImageNetTrain(max_short_side=cap)`` does)."""
    from PIL import Image

    total = 0
    for p in sorted(Path(root).rglob("*")):
        if p.is_file():
            with Image.open(p) as im:
                w, h = im.size
            if cap and min(w, h) > cap:
                w, h = (cap, round(h * cap / w)) if w < h else (round(w * cap / h), cap)
            total += w * h * 3
    return total


def split(args, dataset_bytes: int, decoded: int) -> dict:
    from coordl.analyze.model import TierRates, tier_throughput

    def config(f) -> dict:
        if f == "auto":  # DALI's threads chosen too
            return {"cache_bytes": dataset_bytes + decoded, "decoded_cache": "auto", "threads": None}
        if f == "auto-half":  # a node budget that holds half the decoded dataset
            return {"cache_bytes": decoded // 2, "decoded_cache": "auto", "threads": None}
        if str(f).startswith("capped"):  # images capped at a shorter side of N: a change to the data
            _, how, cap = f.split("-")
            dc = "auto" if how == "auto" else 0
            return {"cache_bytes": dataset_bytes + decoded, "decoded_cache": dc, "threads": None, "cap": int(cap)}
        y = int(f * decoded)
        return {"cache_bytes": dataset_bytes + y, "decoded_cache": y}

    names = ["auto", "auto-half", *args.fractions]
    names += [f"capped-{how}-{c}" for c in args.max_short_side for how in ("auto", "0")]
    repeats: dict = {f: [] for f in names}
    for rep in range(args.repeat):  # every configuration once a round: the machine's drift hits them alike
        for f in names[rep % len(names) :] + names[: rep % len(names)]:  # each round starts elsewhere
            kw = config(f)
            with tempfile.TemporaryDirectory(dir="/dev/shm", prefix="coordl-bench-") as shm:
                r = finish(start(args, shm=shm, epochs=args.epochs, **kw))
            steady = statistics.median(e["samples_per_s"] for e in r["epochs"][1:])
            repeats[f].append({"steady_samples_per_s": steady, "epochs": r["epochs"], "tiers": r["tiers"]})
            epochs = ", ".join(f"{e['samples_per_s']:.0f}" for e in r["epochs"])
            log(f"  [{rep + 1}/{args.repeat}] {f!s:>16}: {steady:7.1f} samples/s  (epochs: {epochs})")
    n = repeats["auto"][0]["epochs"][0]["samples"]

    def rates_of(f) -> dict:  # the median of what the runs of f measured when their loaders were made
        measured = [r["tiers"]["rates"] for r in repeats[f]]
        keys = ("decoded_bytes", "storage", "encoded", "decoded", "decoded_only")
        return {k: statistics.median(m[k] for m in measured) for k in keys}

    def model_of(r: dict, decoded_bytes: float) -> TierRates:
        return TierRates(n, dataset_bytes / n, decoded_bytes, r["storage"], float("inf"), *(r[k] for k in DECODE))

    # The model with the rates "auto" measured and the decoded dataset's true size: the fixed
    # shares are shares of it, where "auto" knows it only from a few samples.
    rates = rates_of("auto")
    n_decoded = {None: decoded, **{c: decoded_bytes(args.data, c) for c in args.max_short_side}}
    model = model_of(rates, decoded / n)
    runs = []
    for f in names:
        kw = config(f)
        # A capped run is another dataset: the capped "auto" runs' rates predict it.
        own = model_of(rates_of(f"capped-auto-{kw['cap']}"), n_decoded[kw["cap"]] / n) if "cap" in kw else model
        y = statistics.median(r["tiers"]["decoded_budget"] for r in repeats[f])
        threads = repeats[f][0]["tiers"].get("threads") or kw.get("threads") or args.threads
        steady = [r["steady_samples_per_s"] for r in repeats[f]]
        got, want = statistics.median(steady), tier_throughput(own, kw["cache_bytes"], y)
        run = {"fraction": f, **kw, "threads": threads, "steady_samples_per_s": got}
        run |= {"steady_each": steady, "predicted_samples_per_s": want}
        run |= {"repeats": repeats[f], "tiers": repeats[f][0]["tiers"], "error": got / want - 1}
        runs.append(run)
        each = ", ".join(f"{v:.0f}" for v in steady)
        log(f"  {f!s:>16}: measured {got:6.0f} (each: {each}), predicted {want:6.0f} samples/s ({run['error']:+.1%})")
    points = [decoded * k / 50 for k in range(51)]
    curve = [
        {"decoded_bytes": int(y), "predicted_samples_per_s": tier_throughput(model, dataset_bytes + y, y)}
        for y in points
    ]
    return {"runs": runs, "rates": rates, "predicted_curve": curve}


def concurrent(args, dataset_bytes: int, decoded: int) -> list[dict]:
    out = []
    for n in args.jobs:
        for name, kw in (
            ("decoded_cache=0", {"cache_bytes": dataset_bytes, "decoded_cache": 0}),
            ("decoded tier", {"cache_bytes": dataset_bytes + decoded, "decoded_cache": decoded}),
            ("hp_group", {"cache_bytes": dataset_bytes, "decoded_cache": 0, "hp_group": "bench"}),
        ):
            same = "hp_group" in kw  # the group's jobs share a seed
            with tempfile.TemporaryDirectory(dir="/dev/shm", prefix="coordl-bench-") as shm:
                t0 = time.perf_counter()
                procs = [start(args, shm=shm, epochs=args.job_epochs, seed=0 if same else k, **kw) for k in range(n)]
                results = [finish(p) for p in procs]
                makespan = time.perf_counter() - t0
            out.append({"jobs": n, "config": name, "makespan_s": makespan, "results": results})
            log(f"  {n} jobs, {name:>15}: makespan {makespan:6.1f} s")
    return out


def draw(plt, result: dict):
    """The model's curve of steady samples/s over the decoded tier's size, and the runs measured on it."""
    fig, ax = plt.subplots(figsize=(6.4, 4))
    curve, runs = result["split"]["predicted_curve"], result["split"]["runs"]
    x = [p["decoded_bytes"] / 1e9 for p in curve]
    ax.plot(x, [p["predicted_samples_per_s"] for p in curve], label="predicted (model)")
    marks = [(lambda f: isinstance(f, float), "o", "measured", {})]
    marks += [(lambda f: f == "auto", "*", '"auto"', {"ms": 12})]
    marks += [(lambda f: str(f).startswith("capped-auto"), "D", '"auto", max_short_side={} (other pixels)', {"ms": 8})]
    marks += [(lambda f: f == "auto-half", "^", '"auto", node budget = half the decoded dataset', {"ms": 9})]
    for chosen, marker, label, kw in marks:
        pts = [r for r in runs if chosen(r["fraction"])]
        xs, ys = [r["tiers"]["decoded_budget"] / 1e9 for r in pts], [r["steady_samples_per_s"] for r in pts]
        if pts:
            ax.plot(xs, ys, marker, label=label.format(str(pts[0]["fraction"]).rsplit("-", 1)[-1]), **kw)
    ax.set(xlabel="decoded tier (GB); encoded tier holds every file", ylabel="steady samples/s", ylim=(0, None))
    ax.set_title("imagenet-train 224, DALI on 2 CPU threads")
    ax.legend()
    return fig


def options(p) -> None:
    dataset.add_dataset_options(p, data="/var/tmp/coordl-bench/bench", images=4436, classes=100)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--threads", type=int, default=2, help="DALI threads per job")
    p.add_argument("--epochs", type=int, default=5, help="epochs per split run (the first fills)")
    p.add_argument("--fractions", type=float, nargs="+", default=[0.0, 0.25, 0.5, 0.75, 1.0])
    p.add_argument("--jobs", type=int, nargs="*", default=[2, 4], help="none: only the split")
    p.add_argument("--job-epochs", type=int, default=5)
    cap = 'also ImageNetTrain(max_short_side=N), a change to the data, with "auto" and decoded_cache=0 (default: 256)'
    p.add_argument("--max-short-side", type=int, nargs="*", default=[256], help=cap)
    p.add_argument("--repeat", type=int, default=3, help="rounds of the split's runs (the median is reported)")


def run(args) -> dict | None:
    data = dataset.dataset_from_args(args)
    args.data = data["root"]
    # into the page cache: this benchmark measures prep, not storage
    dataset_bytes = limits.read_through(f for f in Path(args.data).rglob("*") if f.is_file())
    decoded = decoded_bytes(args.data)
    log(f"dataset: {dataset.describe(data)}; decoded {decoded / 1e9:.2f} GB ({decoded / dataset_bytes:.1f}x)")
    result = {"dataset": data, "dataset_bytes": dataset_bytes, "decoded_bytes": decoded}
    result |= {"batch": args.batch, "threads": args.threads}
    log("split (one job):")
    result["split"] = split(args, dataset_bytes, decoded)
    log("concurrent jobs:")
    result["jobs"] = concurrent(args, dataset_bytes, decoded)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    report.plot(Path(args.out) / "decoded_tier.png", lambda plt: draw(plt, result))
    return result


def out_path(args) -> Path:
    return Path(args.out) / "decoded_tier.json"
