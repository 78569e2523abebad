"""The decoded tier: steady samples/s against the cache's split beside the model's, and concurrent jobs.

The dataset held in memory (the encoded tier holds it all): prep is measured, ``imagenet-train`` 224 on
the CPU, each run a fresh process (:func:`job`) with a shm folder of its own. **split**: one job, its
budget the files plus ``f`` of the decoded images (``decoded_cache``), ``f`` in ``--fractions``; ``"auto"``
with a budget for the whole decoded dataset and for half; ``"auto"`` and ``0`` with
``ImageNetTrain(max_short_side=N)`` (a change to the data); epoch 0 fills, the median of the rest is the
steady rate, beside the model's (from the rates ``"auto"`` measured); ``--repeat`` rounds, each starting
elsewhere. **jobs**: ``--jobs`` jobs at once, own seeds: makespan with ``decoded_cache=0``, with the
decoded dataset in the tier, and as an ``hp_group``.

    python -m benchmarks decoded_tier --data /var/tmp/coordl-bench/bench --images 4436 --classes 100

Writes ``decoded_tier.json`` and ``decoded_tier.png`` to the folder ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks.harness import cli, dataset, jobs, limits, measure, report
from benchmarks.harness.report import log

OUT = str(cli.RESULTS)  # a folder: decoded_tier.json, decoded_tier.png
RATES = ("decoded_bytes", "storage", "encoded", "decoded", "decoded_only")  # of loader.tier_plan
DECODE = RATES[2:]  # the prep rates TierRates takes after storage and cache
KEYS = ("decoded_hits", "decoded_admitted", "cache_hits", "storage_reads", "decoded_cache_bytes", "cache_bytes")


def job(a: dict) -> None:
    """A child: the loader ``a`` describes, its epochs (with ``KEYS`` of its stats) and tier plan, said as JSON."""
    import coordl

    kw = {"pipeline": coordl.ImageNetTrain(max_short_side=a.get("cap")), "device_id": None, "shuffle": True}
    kw |= {"cache": coordl.Cache(size=a["cache_bytes"], decoded=a["decoded_cache"]), "prep": a.get("threads")}
    with coordl.CoordLoader(
        a["data"], batch_size=a["batch"], seed=a["seed"], hp_group=a.get("hp_group"), **kw
    ) as loader:
        tiers, es = loader.tier_plan.as_dict(), measure.epochs(loader, a["epochs"], keys=KEYS)
    jobs.say(tiers=tiers, epochs=[{**e.pop("stats"), **e, "samples_per_s": e["samples"] / e["seconds"]} for e in es])


def at_once(args, specs: list[dict]) -> list[dict]:
    """A child (:func:`job`) per spec, all at once, sharing one fresh shm folder; what each said."""
    base = {"data": args.data, "batch": args.batch, "threads": args.threads, "seed": 0}
    commands = [jobs.scenario_command("decoded_tier", "--job", json.dumps(base | s)) for s in specs]
    with (
        tempfile.TemporaryDirectory(dir="/dev/shm", prefix="coordl-bench-") as shm,
        ThreadPoolExecutor(len(specs)) as pool,
    ):
        return list(pool.map(lambda c: jobs.run_json(c, env={**os.environ, "COORDL_SHM_DIR": shm}), commands))


def each(rates) -> str:
    return ", ".join(f"{v:.0f}" for v in rates)


def decoded_bytes(root: str, cap: int | None = None) -> int:
    """The decoded dataset's bytes (RGB, each image at its own resolution, or capped at a shorter
    side of ``cap`` as ``ImageNetTrain(max_short_side=cap)`` does, to a pixel), from the headers."""
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


def configs(args, dataset_bytes: int, decoded: int) -> dict:
    """The split's configurations by name; threads None: ``"auto"`` chooses DALI's threads too."""
    whole = {"cache_bytes": dataset_bytes + decoded, "decoded_cache": "auto", "threads": None}
    out = {"auto": whole, "auto-half": whole | {"cache_bytes": decoded // 2}}  # a node budget for half of it
    for f in args.fractions:
        out[f] = {"cache_bytes": dataset_bytes + int(f * decoded), "decoded_cache": int(f * decoded)}
    for cap in args.max_short_side:  # images capped at a shorter side of cap: a change to the data
        out |= {f"capped-auto-{cap}": whole | {"cap": cap}, f"capped-0-{cap}": whole | {"decoded_cache": 0, "cap": cap}}
    return out


def split(args, dataset_bytes: int, decoded: int) -> dict:
    from coordl.analyze.model import TierRates, tier_throughput

    kws = configs(args, dataset_bytes, decoded)
    names, repeats = list(kws), {f: [] for f in kws}
    for rep in range(args.repeat):  # every configuration once a round
        for f in names[rep % len(names) :] + names[: rep % len(names)]:
            (r,) = at_once(args, [kws[f] | {"epochs": args.epochs}])
            per_epoch = [e["samples_per_s"] for e in r["epochs"]]
            repeats[f].append({"steady_samples_per_s": (steady := statistics.median(per_epoch[1:])), **r})
            log(f"  [{rep + 1}/{args.repeat}] {f!s:>16}: {steady:7.1f} samples/s  (epochs: {each(per_epoch)})")
    n = repeats["auto"][0]["epochs"][0]["samples"]

    def rates_of(f) -> dict:  # the median of what the runs of f measured when their loaders were made
        return {k: statistics.median(x["tiers"]["rates"][k] for x in repeats[f]) for k in RATES}

    def model_of(r: dict, decoded_bytes: float) -> TierRates:
        return TierRates(n, dataset_bytes / n, decoded_bytes, r["storage"], float("inf"), *(r[k] for k in DECODE))

    # The model with the rates "auto" measured and the decoded dataset's true size ("auto" knows it
    # from a few samples); a capped run is another dataset, which its "auto" runs' rates predict.
    rates, capped, runs = rates_of("auto"), {c: decoded_bytes(args.data, c) for c in args.max_short_side}, []
    model = model_of(rates, decoded / n)
    for f, kw in kws.items():
        own = model_of(rates_of(f"capped-auto-{kw['cap']}"), capped[kw["cap"]] / n) if "cap" in kw else model
        y = statistics.median(r["tiers"]["decoded_budget"] for r in repeats[f])
        threads = repeats[f][0]["tiers"].get("threads") or kw.get("threads") or args.threads
        steady = [r["steady_samples_per_s"] for r in repeats[f]]
        run = {"fraction": f, **kw, "threads": threads, "steady_samples_per_s": statistics.median(steady)}
        run |= {"steady_each": steady, "predicted_samples_per_s": tier_throughput(own, kw["cache_bytes"], y)}
        run |= {"repeats": repeats[f], "tiers": repeats[f][0]["tiers"]}
        run["error"] = run["steady_samples_per_s"] / run["predicted_samples_per_s"] - 1
        runs.append(run)
        log(f"  {f!s:>16}: measured {run['steady_samples_per_s']:6.0f} (each: {each(steady)}), ", end="")
        log(f"predicted {run['predicted_samples_per_s']:6.0f} samples/s ({run['error']:+.1%})")
    curve = [
        {"decoded_bytes": int(y), "predicted_samples_per_s": tier_throughput(model, dataset_bytes + y, y)}
        for y in (decoded * k / 50 for k in range(51))
    ]
    return {"runs": runs, "rates": rates, "predicted_curve": curve}


def concurrent(args, dataset_bytes: int, decoded: int) -> list[dict]:
    out, whole = [], {"cache_bytes": dataset_bytes + decoded, "decoded_cache": decoded}
    kws = {"decoded_cache=0": {"cache_bytes": dataset_bytes, "decoded_cache": 0}, "decoded tier": whole}
    kws["hp_group"] = kws["decoded_cache=0"] | {"hp_group": "bench"}
    for n in args.jobs:
        for name, kw in kws.items():
            t0 = time.perf_counter()
            specs = [kw | {"epochs": args.job_epochs, "seed": 0 if "hp_group" in kw else k} for k in range(n)]
            results = at_once(args, specs)
            out.append({"jobs": n, "config": name, "makespan_s": time.perf_counter() - t0, "results": results})
            log(f"  {n} jobs, {name:>15}: makespan {out[-1]['makespan_s']:6.1f} s")
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
    p.add_argument("--jobs", type=int, nargs="*", default=[2, 4], help="concurrent jobs (none: only the split)")
    p.add_argument("--job-epochs", type=int, default=5)
    cap = 'also ImageNetTrain(max_short_side=N), a change to the data, with "auto" and decoded_cache=0 (default: 256)'
    p.add_argument("--max-short-side", type=int, nargs="*", default=[256], help=cap)
    p.add_argument("--repeat", type=int, default=3, help="rounds of the split's runs (the median is reported)")
    p.add_argument("--job", help=argparse.SUPPRESS)  # a child: one loader, its spec in JSON


def run(args) -> dict | None:
    if args.job:
        return job(json.loads(args.job))
    data = dataset.dataset_from_args(args)
    args.data = data["root"]
    # into the page cache: this benchmark measures prep, not storage
    dataset_bytes = limits.read_through(f for f in Path(args.data).rglob("*") if f.is_file())
    decoded = decoded_bytes(args.data)
    log(f"dataset: {dataset.describe(data)}; decoded {decoded / 1e9:.2f} GB ({decoded / dataset_bytes:.1f}x)")
    result = {"dataset": data, "dataset_bytes": dataset_bytes, "decoded_bytes": decoded, "batch": args.batch}
    log("split (one job):")
    result |= {"threads": args.threads, "split": split(args, dataset_bytes, decoded)}
    log("concurrent jobs:")
    result["jobs"] = concurrent(args, dataset_bytes, decoded)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    report.plot(Path(args.out) / "decoded_tier.png", lambda plt: draw(plt, result))
    return result


def out_path(args) -> Path:
    return Path(args.out) / "decoded_tier.json"
