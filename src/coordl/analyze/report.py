"""DS-Analyzer's report: built from the phases' measurements, printed, saved as JSON, plotted."""

from __future__ import annotations

import json
import math
import os

from coordl.analyze.model import Model, Rates, bottleneck, describe_bottleneck, stall_split
from coordl.units import format_bytes

__all__ = ["build", "rates_from", "table", "plot", "save_json"]

DEFAULT_FRACTIONS = [i / 20 for i in range(21)]


def rates_from(phases: dict[str, list[dict]]) -> Rates:
    """Job-wide rates from the per-rank results of phases G, P, S and F (ranks run together)."""
    total = lambda phase, key: sum(r[key] for r in phases[phase])  # noqa: E731
    any_rank = phases["F"][0]
    p = phases["P"][0]
    # RayPrep(output="uint8") sends the pixels before normalisation: one byte an element.
    uint8 = p.get("remote_output") == "uint8"
    world, local = any_rank["world_size"], any_rank["local_world_size"]
    return Rates(
        G=total("G", "samples_per_s"),
        P=total("P", "P_samples_per_s"),
        R=total("P", "R_samples_per_s"),
        S=total("S", "S_bytes_per_s"),
        C=total("P", "C_bytes_per_s"),
        F=total("F", "samples_per_s"),
        sample_bytes=any_rank["dataset_bytes"] / any_rank["dataset_samples"],
        dataset_samples=any_rank["dataset_samples"],
        dataset_bytes=any_rank["dataset_bytes"],
        cache_bytes=any_rank["cache_budget"],
        prep_threads=any_rank["prep_threads"],
        ranks=world,
        nodes=max(1, world // max(1, local)),
        decoded_speedup=p.get("decoded_speedup", 0.0),
        decoded_sample_bytes=p.get("decoded_sample_bytes", 0.0),
        decoded_only_speedup=p.get("decoded_only_speedup", 0.0),
        # Each rank's prep threads, at most the CPUs it may use (files from before "cpus": the threads).
        prep_cpus=sum(min(max(1, r["prep_threads"]), r.get("cpus", math.inf)) for r in phases["P"]),
        output_sample_bytes=p.get("output_sample_bytes", 0.0),
        result_sample_bytes=p.get("output_uint8_sample_bytes" if uint8 else "output_sample_bytes", 0.0),
        ships_encoded=p.get("remote_reads") == "trainer",
    )


def build(
    rates: Rates,
    phases: dict[str, list[dict]] | None = None,
    *,
    command: list[str] | None = None,
    fractions=DEFAULT_FRACTIONS,
    cores=(0.5, 2, 4),
    bandwidth=(0.5, 2, 4),
    nodes=(2, 4),
    hp_jobs=(2, 4),
    network_bytes_per_s: float = 1.25e9,
    remote_cpus=None,
    disk_bytes_per_s=(0.5e9, 2e9),
) -> dict:
    """The report as a JSON-able dict (see the DS-Analyzer guide for every key).

    ``remote_cpus``: the what-if's numbers of remote CPUs (None: 1, 2 and 4 times the job's own
    prep CPUs); ``network_bytes_per_s``: each node's link, for the nodes' and remote CPUs' what-ifs;
    ``disk_bytes_per_s``: the local-storage tier's read rates of its what-if (a SATA SSD, an NVMe
    drive), a tier holding half the dataset and all of it.
    """
    m = Model(rates)
    if remote_cpus is None:
        remote_cpus = [k * max(1, round(m.local_prep_cpus())) for k in (1, 2, 4)]
    x = m.cache_fraction()
    measured = stall_split(rates.F, m.G, m.R)
    steady = m.steady_split(x)
    need = m.cache_to_remove_fetch_stalls()
    report = {
        "command": command or [],
        "config": {
            "ranks": rates.ranks,
            "nodes": rates.nodes,
            "prep_threads_per_rank": rates.prep_threads,
            "dataset_samples": rates.dataset_samples,
            "dataset_bytes": rates.dataset_bytes,
            "sample_bytes": rates.sample_bytes,
            "cache_budget_bytes": rates.cache_bytes,
            "cache_fraction": x,
        },
        "rates": {"G": rates.G, "P": rates.P, "R": rates.R, "F": rates.F, "S": rates.S, "C": rates.C},
        "units": {
            "G": "samples/s",
            "P": "samples/s",
            "R": "samples/s",
            "F": "samples/s",
            "S": "bytes/s",
            "C": "bytes/s",
        },
        "stall": measured,
        "bottleneck": bottleneck(measured),
        "summary": describe_bottleneck(measured),
        "steady_state": {
            "cache_fraction": x,
            "predicted_samples_per_s": m.throughput(x),
            "stall": steady,
            "bottleneck": bottleneck(steady),
            "summary": describe_bottleneck(steady),
        },
        "model_check": {
            "cold_predicted_samples_per_s": m.throughput(0.0),
            "cold_measured_samples_per_s": rates.F,
        },
        "cache_to_remove_fetch_stalls": {"fraction": need, "bytes": int(need * rates.dataset_bytes)},
        "model": {"sharing": m.sharing, "formula": "min(F(x), R), F(x) = 1 / (b*x/C + b*(1-x)/S)"},
        "what_if": m.sweep(fractions),
        "what_if_cores": [m.with_cores(f) for f in cores],
        "what_if_bandwidth": [m.with_bandwidth(f) for f in bandwidth],
        "what_if_disk": [
            m.with_disk(share * rates.dataset_bytes, speed) for share in (0.5, 1.0) for speed in disk_bytes_per_s
        ],
        "what_if_nodes": [m.with_nodes(n, network_bytes_per_s) for n in nodes],
        "network_bytes_per_s": network_bytes_per_s,
        "what_if_hp_jobs": [m.with_hp_jobs(n) for n in hp_jobs],
        "what_if_hp_slow_job": m.with_hp_slow_job(3, 3.0),
        "remote_prep": {
            "local_prep_cpus": m.local_prep_cpus(),
            "per_cpu_samples_per_s": m.remote_cpu_rate(),
            "output_sample_bytes": rates.output_sample_bytes,
            "network_sample_bytes": m.remote_sample_bytes(),
            "ships_encoded": rates.ships_encoded,
        },
        "what_if_remote_cpus": [m.with_remote_cpus(n, network_bytes_per_s) for n in remote_cpus],
        "what_if_decoded": m.decoded_split(),
    }
    if phases is not None:
        f = phases.get("F", [])
        el = sum(r["elapsed_s"] for r in f)
        if el > 0:
            report["stall_observed"] = {  # the loader's own accounting during the fetch phase
                "wait": sum(r["stall_s"] for r in f) / el,
                "fetch": sum(r["stall_fetch_s"] for r in f) / el,
                "prep": sum(r["stall_prep_s"] for r in f) / el,
            }
        report["phases"] = phases
    return report


def _rate(v: float) -> str:
    return f"{v:,.0f} samples/s" if v < 1e7 else "unbounded"


def _bw(v: float) -> str:
    return f"{v / 1e9:.2f} GB/s" if v >= 1e9 else f"{v / 1e6:.1f} MB/s"


def _pct(v: float) -> str:
    return f"{100 * v:.0f}%"


def table(r: dict) -> str:
    """The report for a terminal."""
    c, rt = r["config"], r["rates"]
    b = c["sample_bytes"]
    lines = [
        f"Dataset {c['dataset_samples']:,} samples, {c['dataset_bytes'] / 1e6:,.1f} MB "
        f"({b / 1e3:.0f} kB each); {c['ranks']} rank(s) on {c['nodes']} node(s); "
        f"cache budget {c['cache_budget_bytes'] / 1e6:,.1f} MB per node ({_pct(c['cache_fraction'])} of the dataset)",
        "",
        "Measured rates (whole job)",
        f"  G  ingestion, synthetic batches        {_rate(rt['G'])}",
        f"  P  prep, loader alone on cached data   {_rate(rt['P'])}  ({c['prep_threads_per_rank']} threads per rank)",
        f"  R  training on cached data             {_rate(rt['R'])}",
        f"  S  storage reads                       {_bw(rt['S'])}  ({_rate(rt['S'] / b)})",
        f"  C  cache reads                         {_bw(rt['C'])}",
        f"  F  training from a cold cache          {_rate(rt['F'])}",
        "",
        f"Step time, cold cache (measured): compute {_pct(r['stall']['compute'])}, prep stall "
        f"{_pct(r['stall']['prep'])}, fetch stall {_pct(r['stall']['fetch'])}",
        f"Bottleneck: {r['summary']}.",
    ]
    s = r["steady_state"]
    lines += [
        f"Later epochs, cache {_pct(s['cache_fraction'])} full (predicted): {_rate(s['predicted_samples_per_s'])}; "
        f"compute {_pct(s['stall']['compute'])}, prep stall {_pct(s['stall']['prep'])}, "
        f"fetch stall {_pct(s['stall']['fetch'])}: {s['summary']}.",
    ]
    need = r["cache_to_remove_fetch_stalls"]
    if need["fraction"] <= 0:
        lines.append("Storage alone keeps up: no cache is needed to remove fetch stalls.")
    else:
        lines.append(
            f"A cache of {_pct(need['fraction'])} of the dataset ({need['bytes'] / 1e6:,.0f} MB per node) "
            "removes fetch stalls."
        )
    lines += ["", "What if the cache held (epochs after the first):", "  cache   predicted      bound"]
    for w in r["what_if"]:
        if round(w["cache_fraction"] * 100) % 25 == 0 or abs(w["cache_fraction"] - c["cache_fraction"]) < 1e-9:
            lines.append(f"  {_pct(w['cache_fraction']):>5}   {w['predicted_samples_per_s']:>9,.0f}/s   {w['bound']}")
    lines += ["", "What if (at this cache budget):"]
    for w in r["what_if_cores"]:
        lines.append(f"  prep on {w['factor']:g}x the cores: {_rate(w['predicted_samples_per_s'])}")
    for w in r["what_if_bandwidth"]:
        lines.append(f"  storage at {_bw(w['storage_bytes_per_s'])}: {_rate(w['predicted_samples_per_s'])}")
    for w in r.get("what_if_disk", []):
        lines.append(
            f"  a local-storage tier of {format_bytes(w['disk_bytes'])} at {_bw(w['disk_bytes_per_s'])} "
            f"(Cache(disk=...)): {_rate(w['predicted_samples_per_s'])}"
        )
    for w in r["what_if_nodes"]:
        lines.append(
            f"  {w['nodes']} nodes ({_pct(w['aggregate_cache_fraction'])} cached together): no peers "
            f"{_rate(w['no_peers'])}, partitioned cache {_rate(w['partitioned'])}, locality-aware "
            f"{_rate(w['locality_aware'])}"
        )
    lines += _remote_lines(r)
    for w in r["what_if_hp_jobs"]:
        lines.append(
            f"  {w['jobs']} HP-search jobs: {_rate(w['independent_per_job'])} each alone, "
            f"{_rate(w['coordinated_per_job'])} each with hp_group ({w['speedup']:.2f}x)"
        )
    w = r.get("what_if_hp_slow_job")
    if w is not None:
        lines.append(
            f"  {w['jobs']} HP-search jobs, one training {w['slower']:g}x slower: alone "
            f"{_rate(w['independent_fast_per_job'])} each fast one, {_rate(w['independent_slow'])} the slow one; "
            f"with hp_group "
            f"{_rate(w['coordinated_fast_per_job'])} and {_rate(w['coordinated_slow'])}"
            + (" (it is detached and prepares its own batches)" if w["detached"] else "")
        )
    d = r.get("what_if_decoded")
    if d is not None:
        lines += ["", f"What if the cache budget ({d['budget_bytes'] / 1e6:,.0f} MB per node) held decoded images:"]
        for w in d["what_if"]:
            lines.append(
                f"  with {w['decoded_bytes'] / 1e9:,.2f} GB of decoded images: {_rate(w['predicted_samples_per_s'])}"
            )
        lines.append(
            f"  recommended: cache=coordl.Cache(decoded={d['recommended_decoded_cache']}) "
            f"({_rate(d['recommended_samples_per_s'])})"
        )
    mc = r["model_check"]
    lines += [
        "",
        f"Model check: cold cache predicted {_rate(mc['cold_predicted_samples_per_s'])}, "
        f"measured {_rate(mc['cold_measured_samples_per_s'])}.",
    ]
    return "\n".join(lines)


def _remote_lines(r: dict) -> list[str]:
    rp = r["remote_prep"]
    b = rp["network_sample_bytes"]
    link = "no network cap (output bytes not measured)"
    if b:
        link = f"{b / 1e3:,.0f} kB a sample over {_bw(r['network_bytes_per_s'])} per node"
    lines = [
        f"  prep also on remote CPUs (RayPrep), each at the local rate per CPU, "
        f"{rp['per_cpu_samples_per_s']:,.0f} samples/s; {link}:"
    ]
    for w in r["what_if_remote_cpus"]:
        cap = f", the network caps them at {_rate(w['network_samples_per_s'])}" if w["network_bound"] else ""
        pred = _rate(w["predicted_samples_per_s"])
        n = w["remote_cpus"]
        lines.append(f"    {n} remote CPU{'' if n == 1 else 's'}: {pred} ({w['bound']}-bound{cap})")
    return lines


def save_json(r: dict, path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(r, f, indent=1)
    os.replace(tmp, path)


def plot(r: dict, path: str, measured: list[tuple[float, float]] | None = None, title: str | None = None) -> None:
    """A PNG like the paper's figure 11: predicted F, P, G (and R) and throughput against cache size.

    ``measured``: extra ``(cache_fraction, samples_per_s)`` points measured in steady epochs.
    Raises ImportError when matplotlib is not installed.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    w = r["what_if"]
    xs = [100 * p["cache_fraction"] for p in w]
    rt = r["rates"]
    top = 1.6 * max(rt["P"], min(rt["G"], 3 * rt["P"]), rt["R"])
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    ax.plot(
        xs, [min(p["fetch_samples_per_s"], 10 * top) for p in w], color="tab:blue", label="F: fetch rate (predicted)"
    )
    ax.axhline(rt["P"], color="tab:orange", linestyle="--", label=f"P: prep rate ({rt['P']:,.0f}/s)")
    if rt["G"] < top:
        ax.axhline(rt["G"], color="tab:green", linestyle="--", label=f"G: ingestion rate ({rt['G']:,.0f}/s)")
    ax.axhline(rt["R"], color="tab:purple", linestyle=":", label=f"R: training on cached data ({rt['R']:,.0f}/s)")
    ax.plot(
        xs,
        [p["predicted_samples_per_s"] for p in w],
        color="black",
        linewidth=2.2,
        label="predicted training speed min(F, R)",
    )
    ax.plot([0], [rt["F"]], "s", color="tab:red", label="measured, cold cache")
    if measured:
        mx, my = zip(*sorted(measured), strict=True)
        ax.plot([100 * v for v in mx], my, "o", color="tab:red", markersize=7, label="measured, later epochs")
    ax.axvline(100 * r["config"]["cache_fraction"], color="grey", linewidth=0.8)
    ax.set_xlim(0, 100)
    ax.set_ylim(0, top)
    ax.set_xlabel("cache size (% of the dataset)")
    ax.set_ylabel("samples/s")
    ax.set_title(title or "coordl analyze: training speed against cache size")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7.5, loc="lower right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
