"""``coordl analyze``: runs a training script in DS-Analyzer's phases and reports.

Each phase is one run of the user's unchanged command with ``COORDL_ANALYZE`` set and
``coordl/analyze/boot`` first on ``PYTHONPATH``, whose ``sitecustomize`` installs the probe in
every Python process of the command (see :mod:`coordl.analyze.probe`). The script's output goes
to ``<out>/phase-<P>.log``; every rank writes ``<out>/phase-<P>-rank<r>.json`` and ends itself
once its phase is measured.
"""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import time
import uuid

from coordl.analyze import report as rep
from coordl.errors import CoordlError

__all__ = ["AnalyzeError", "PHASES", "analyze", "run_phase"]

BOOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "boot")  # its sitecustomize installs the probe

PHASES = {
    "G": "ingestion rate: the script's step on synthetic batches",
    "P": "prep rate: a cached subset, the loader alone, then training on it",
    "S": "storage read rate: random reads, pages dropped",
    "F": "fetch: training from a cold cache with the job's budget",
}


class AnalyzeError(CoordlError):
    """A phase could not be measured (the message says why and where its log is)."""


def run_phase(
    command: list[str],
    phase: str,
    *,
    out: str,
    steps: int,
    warmup: int,
    run_id: str,
    timeout: float,
    extra: dict | None = None,
    echo=None,
) -> list[dict]:
    """Runs ``command`` for ``phase``; returns the ranks' results.

    Raises:
        AnalyzeError: the script failed, timed out, or ended without measuring.
    """
    for old in glob.glob(os.path.join(out, f"phase-{phase}-rank*.json")):
        os.remove(old)
    spec = {"phase": phase, "steps": steps, "warmup": warmup, "out": os.path.abspath(out), "run": run_id}
    spec.update(extra or {})
    path = os.pathsep.join(p for p in (BOOT, os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, COORDL_ANALYZE=json.dumps(spec), PYTHONPATH=path)
    log_path = os.path.join(out, f"phase-{phase}.log")
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        world, done_at = None, None
        while proc.poll() is None:
            time.sleep(0.2)
            results = _results(out, phase)
            if results and world is None:
                world = results[0]["world_size"]
            if world is not None and len(results) >= world and done_at is None:
                done_at = time.monotonic()
            late = done_at is not None and time.monotonic() - done_at > 60  # measured, but not ending
            if time.monotonic() > deadline or late:
                _kill(proc)
                if late:
                    break
                raise AnalyzeError(
                    f"phase {phase} did not finish within {timeout:.0f} s (--timeout); its output is in {log_path}"
                )
    results = _results(out, phase)
    world = results[0]["world_size"] if results else None
    if not results or len(results) < world:
        tail = _tail(log_path)
        if proc.returncode not in (0, None) and proc.returncode != -signal.SIGTERM:
            raise AnalyzeError(
                f"phase {phase}: the command failed with exit code {proc.returncode}; the end of {log_path}:\n{tail}"
            )
        got = f"{len(results)} of {world} ranks" if results else "no rank"
        raise AnalyzeError(
            f"phase {phase}: the command ended and {got} measured it. The script must iterate a coordl.CoordLoader "
            f"for at least --warmup + --steps = {warmup + steps} steps (or a whole epoch). The end of "
            f"{log_path}:\n{tail}"
        )
    return sorted(results, key=lambda r: r["rank"])


def analyze(
    command: list[str],
    *,
    out: str,
    steps: int = 100,
    warmup: int = 5,
    timeout: float = 900,
    subset_batches: int = 16,
    storage_seconds: float = 20.0,
    echo=print,
) -> dict[str, list[dict]]:
    """Runs the four phases; returns their per-rank results."""
    if not command:
        raise AnalyzeError("give the training command after --, e.g. coordl analyze -- python train.py")
    os.makedirs(out, exist_ok=True)
    run_id = uuid.uuid4().hex[:12]
    extra = {"subset_batches": subset_batches, "storage_seconds": storage_seconds}
    phases = {}
    for phase, what in PHASES.items():
        echo(f"phase {phase} ({what}) ...", flush=True)
        t0 = time.monotonic()
        phases[phase] = run_phase(
            command, phase, out=out, steps=steps, warmup=warmup, run_id=run_id, timeout=timeout, extra=extra
        )
        echo(f"  {_phase_line(phase, phases[phase])} ({time.monotonic() - t0:.0f} s)", flush=True)
    return phases


def _phase_line(phase: str, results: list[dict]) -> str:
    total = lambda key: sum(r[key] for r in results)  # noqa: E731
    if phase == "G":
        return f"G = {total('samples_per_s'):,.0f} samples/s"
    if phase == "P":
        return (
            f"P = {total('P_samples_per_s'):,.0f} samples/s, R = {total('R_samples_per_s'):,.0f} samples/s, "
            f"C = {total('C_bytes_per_s') / 1e9:.2f} GB/s"
        )
    if phase == "S":
        return f"S = {total('S_bytes_per_s') / 1e6:,.1f} MB/s"
    return f"F = {total('samples_per_s'):,.0f} samples/s from a cold cache"


def _results(out: str, phase: str) -> list[dict]:
    res = []
    for path in glob.glob(os.path.join(out, f"phase-{phase}-rank*.json")):
        try:
            with open(path) as f:
                res.append(json.load(f))
        except (OSError, ValueError):
            continue
    return res


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=10)
    except ProcessLookupError:
        return
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _tail(path: str, lines: int = 15) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:]).rstrip()
    except OSError:
        return "(no output)"


def main(args) -> int:
    """The ``coordl analyze`` subcommand."""
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    try:
        phases = analyze(
            command,
            out=args.out,
            steps=args.steps,
            warmup=args.warmup,
            timeout=args.timeout,
            subset_batches=args.subset_batches,
            storage_seconds=args.storage_seconds,
            echo=lambda *a, **k: print(*a, file=sys.stderr, **k),
        )
    except AnalyzeError as e:
        print(f"coordl analyze: error: {e}", file=sys.stderr)
        return 1
    rates = rep.rates_from(phases)
    report = rep.build(rates, phases, command=command, network_bytes_per_s=args.network_bandwidth)
    print()
    print(rep.table(report))
    json_path = args.json or os.path.join(args.out, "report.json")
    rep.save_json(report, json_path)
    print(f"\nJSON: {json_path}")
    png = args.plot or os.path.join(args.out, "report.png")
    try:
        rep.plot(report, png)
        print(f"plot: {png}")
    except ImportError:
        print("plot: skipped (pip install matplotlib)")
    return 0
