"""What the harness measures: CPU seconds of a process tree, the device's read counter, a loader's epochs, rates
over the steady epochs, medians, and the ABBA order configurations alternate in."""

import os
import statistics
import threading
import time
from pathlib import Path

STATS = ("storage_reads", "storage_bytes", "cache_hits", "cache_items", "stall_s", "prep_s", "produced")


def cpu_seconds(pid: int | None = None) -> float:
    """CPU seconds of process ``pid`` (default: this one; every thread), its live descendants and its
    reaped children."""
    stats = {}  # pid: ppid, utime + stime + cutime + cstime
    for name in filter(str.isdigit, os.listdir("/proc")):
        if f := _stat(name):
            stats[int(name)] = (int(f[1]), sum(int(x) for x in f[11:15]))
    children: dict[int, list[int]] = {}
    for p, (ppid, _) in stats.items():
        children.setdefault(ppid, []).append(p)
    total, todo = 0, [pid or os.getpid()]
    while todo:
        p = todo.pop()
        total += stats.get(p, (0, 0))[1]
        todo += children.get(p, [])
    return total / os.sysconf("SC_CLK_TCK")


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of one process, all its threads, not its children (0 when it is gone)."""
    f = _stat(pid)
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK") if f else 0.0


def _stat(pid) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` from the 3rd (state) on; None when the process is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def device_of(path: str) -> tuple[int, int]:
    st = os.stat(path)
    return os.major(st.st_dev), os.minor(st.st_dev)


def sectors_read(dev: tuple[int, int]) -> int:
    """Bytes read from the block device so far (``/proc/diskstats`` column 6, 512-byte sectors)."""
    with open("/proc/diskstats") as f:
        for line in f:
            parts = line.split()
            if (int(parts[0]), int(parts[1])) == dev:
                return int(parts[5]) * 512
    raise RuntimeError(f"device {dev} is not in /proc/diskstats")


def alternate(names: list, reps: int) -> list[tuple[int, object]]:
    """``(rep, name)`` in ABBA order: the names forward in even reps, backward in odd ones, so that
    neither drift nor the order in a rep favours one (A B C C B A A B C ...)."""
    return [(r, n) for r in range(reps) for n in (names if r % 2 == 0 else names[::-1])]


def epochs(loader, epochs: int, *, warmup: int = 0, step=None, keys=STATS) -> list[dict]:
    """Iterates ``loader`` for ``warmup + epochs`` epochs, each :func:`timed` (``step(batch)`` the training step), with
    the batch's shape and the loader's ``stats()`` (``keys``) if it has them."""
    out = []
    for epoch in range(warmup + epochs):
        if hasattr(loader, "set_epoch"):
            loader.set_epoch(epoch)
        e = {"warmup": epoch < warmup, **timed(iter(loader), step)}
        e["shape"] = (last := e.pop("last")) and list(getattr(last[0], "shape", [])) or None
        if hasattr(loader, "stats"):
            s = loader.stats()
            e["stats"] = {k: s.get(k) for k in keys}
        out.append(e)
    return out


def steady(run: dict) -> dict:
    """A run's samples/s and CPU seconds per sample over its epochs after the warm-up."""
    es = [e for e in run["epochs"] if not e["warmup"]]
    n = sum(e["samples"] for e in es)
    return {"samples_per_s": n / sum(e["seconds"] for e in es), "cpu_s_per_sample": sum(e["cpu_s"] for e in es) / n}


def medians(runs: dict[str, list[dict]], keys=("samples_per_s", "cpu_s_per_sample")) -> dict:
    """Per configuration, the median of each of ``keys`` over its runs."""
    return {name: {k: statistics.median(r[k] for r in rs) for k in keys} for name, rs in runs.items() if rs}


def ratios(median: dict, base: str = "coordl", keys=("samples_per_s", "cpu_s_per_sample")) -> dict:
    """``base/other`` for every other configuration: the ratio of each of ``keys``' medians."""
    others = [other for other in median if other != base] if base in median else []
    return {f"{base}/{other}": {k: median[base][k] / median[other][k] for k in keys} for other in others}


def spread(values: list[float]) -> dict:
    """The median, min and max of ``values``."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)} if values else {}


def spread_all(values: list[float]) -> dict:
    """:func:`spread`, and the values themselves."""
    return {**spread(values), "all": values}


def in_rounds(names: list[str], reps: int, run_one, log, skip=lambda name, done: False) -> dict[str, list[dict]]:
    """Runs ``run_one(name)`` for every name, ``reps`` rounds in ABBA order (each run's ``round`` set), unless
    ``skip(name, its runs so far)``; logs each run's epochs' samples/s and GETs, or its error.
    Returns the runs per name."""
    runs: dict[str, list[dict]] = {n: [] for n in names}
    for rnd, name in alternate(names, reps):
        if skip(name, runs[name]):
            continue
        r = run_one(name)
        r["round"] = rnd
        runs[name].append(r)
        epochs = ", ".join(f"{e['samples_per_s']:.0f}/s ({e['gets']} GETs)" for e in r["epochs"])
        said = f"FAILED: {r['error'].splitlines()[-1][:300]}" if "error" in r else epochs
        log(f"  [{rnd + 1}/{reps}] {name:>14}: {said}")
    return runs


def rounds(runs: dict[str, list[dict]], fields, counters=(), spread=spread, extra=None) -> dict:
    """Per configuration over its rounds: how many ran and failed (with the errors); ``extra(ok)`` of
    the runs that did not fail; and per epoch the spread of each of ``fields`` and of the ``stats``'
    ``counters`` that every round has."""
    out = {}
    for name, rs in runs.items():
        ok = [r for r in rs if "error" not in r]
        entry: dict = {"rounds": len(rs), "ok": len(ok), "errors": [r["error"] for r in rs if "error" in r]}
        if ok:
            entry.update(extra(ok) if extra else {})
            entry["epochs"] = []
            for e in range(min(len(r["epochs"]) for r in ok)):
                rows = [r["epochs"][e] for r in ok]
                ep = {"epoch": e, "samples": rows[0]["samples"]}
                ep.update({f: spread([x[f] for x in rows]) for f in fields if all(x.get(f) is not None for x in rows)})
                got = {f: [x["stats"][f] for x in rows if f in x.get("stats", {})] for f in counters}
                ep.update({f: spread(v) for f, v in got.items() if v and len(v) == len(rows)})
                entry["epochs"].append(ep)
        out[name] = entry
    return out


class Sampler:
    """Calls ``sample()`` every ``every`` seconds in a thread of its own until :meth:`stop`; ``values``
    holds what it returned (memory read from a cgroup while a loader runs, say)."""

    def __init__(self, sample, every: float):
        self.values: list = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(sample, every), daemon=True)
        self._thread.start()

    def _run(self, sample, every: float) -> None:
        while not self._stop.wait(every):
            self.values.append(sample())

    def take(self) -> list:
        """The values since the last ``take``."""
        values, self.values = self.values, []
        return values

    def stop(self) -> list:
        self._stop.set()
        self._thread.join()
        return self.values


def timed(batches, step=None, sync=lambda: None) -> dict:
    """One epoch of the iterator ``batches`` (tuples, the samples first) between two ``sync()``, ``step(batch)``
    after each batch: seconds, samples, seconds waiting in ``next()``, CPU seconds and the last batch."""
    sync()
    cpu, t0, n, wait, last = cpu_seconds(), time.perf_counter(), 0, 0.0, None
    while True:
        t = time.perf_counter()
        if (batch := next(batches, None)) is None:
            break
        wait += time.perf_counter() - t
        if step is not None:
            step(batch)
        n, last = n + len(batch[0]), batch
    sync()
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "samples": n, "wait_s": wait, "cpu_s": cpu_seconds() - cpu, "last": last}
