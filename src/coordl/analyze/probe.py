"""The part of DS-Analyzer that runs inside the user's training script.

``coordl analyze`` runs the script once per phase with ``COORDL_ANALYZE`` set to a JSON
spec (``phase``, ``steps``, ``warmup``, ``out``, ``run``, ...) and this package's ``boot``
folder first on ``PYTHONPATH``, whose ``sitecustomize`` calls :func:`install` when the
interpreter starts: ``coordl.CoordLoader`` is then :class:`AnalyzedLoader`, a loader whose first
pass the script iterates is the phase's pass:

- ``G``: one real batch, then the same tensors again and again: the step's own rate;
- ``P``: a subset of the dataset that fits in a private cache is read once, then the loader
  alone runs ``steps`` batches of it (rate P), the script trains on ``steps`` more (rate R),
  and a loop over the cached bytes gives the cache read rate C;
- ``S``: this rank's random samples read from storage with the loader's I/O threads, with
  their pages dropped first (bytes/s);
- ``F``: a cold private cache with the job's budget and dropped pages: the script trains on
  the epoch's first batches as it would (rate F, and the accounting's stall split).

Each rank writes ``phase-<P>-rank<r>.json`` into ``out`` and then ends the process with
``SystemExit(0)``, so a run takes ``warmup + steps`` steps whatever the script's epochs.

The loader itself knows nothing of the analyzer. A phase sees it through :class:`Target`: its
public ``schedule``, ``world``, ``position``, ``resources`` and ``open_pass``, the one entry by
which a phase runs passes of the loader's own pipeline; a phase that needs a cold cache runs them
on resources over a private cache (``resources.with_cache``) instead of changing the loader's.
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Protocol

import numpy as np

import coordl
from coordl import cpus, sampler
from coordl.fetch import samples
from coordl.fetch.cache import NodeCache
from coordl.fetch.spec import CacheSpec
from coordl.loader import CoordLoader
from coordl.passes import Pass, Step
from coordl.prep.site import site
from coordl.threads import daemon_pool

__all__ = ["ENV", "AnalyzedLoader", "Target", "batch_bytes", "claim", "install", "spec"]

log = logging.getLogger(__name__)

ENV = "COORDL_ANALYZE"
# Batches a measured pass runs beyond its last measured step, so that the pipeline is still
# working ahead when the measurement ends, as it was when it began (no drain at the end).
TAIL = 6
STORAGE_PART = 16  # samples per read task of phase S, as the loader reads a batch's misses in parts
_claimed = False


def spec() -> dict | None:
    """The analysis this process is part of, or None."""
    raw = os.environ.get(ENV)
    if not raw:
        return None
    try:
        s = json.loads(raw)
    except ValueError:
        raise ValueError(f"{ENV} is not valid JSON; it is set by `coordl analyze`") from None
    for key in ("phase", "steps", "warmup", "out", "run"):
        if key not in s:
            raise ValueError(f"{ENV} lacks {key!r}; it is set by `coordl analyze`")
    return s


class Target(Protocol):
    """What a phase uses of the loader it measures (``CoordLoader`` provides it)."""

    backend: str
    options: object  # coordl.options.Options
    schedule: object  # coordl.schedule.Schedule
    position: object  # coordl.position.Position
    resources: object  # coordl.resources.Resources
    tiers: object  # coordl.tiers.plan.TierPlan
    world: object  # coordl.world.World
    batch_size: int
    seed: int
    num_threads: int
    num_workers: int
    device_id: int | None

    def open_pass(self, batches, *, resources=None, **hooks) -> Pass: ...

    def close(self) -> None: ...


class AnalyzedLoader(CoordLoader):
    """A :class:`~coordl.CoordLoader` whose first pass the script iterates, in the whole process,
    is the phase's (:func:`claim`); every other pass is the loader's own."""

    def __iter__(self):
        phase = claim(self)
        return phase if phase is not None else super().__iter__()


def install() -> None:
    """Makes ``coordl.CoordLoader`` the :class:`AnalyzedLoader`, when this process runs a phase
    (``COORDL_ANALYZE`` is set). Called at interpreter start-up, before the script imports coordl's
    names, by the ``sitecustomize`` of ``coordl/analyze/boot``."""
    if spec() is not None:
        coordl.CoordLoader = AnalyzedLoader


def claim(loader: Target):
    """The phase's pass when ``loader`` is the one this process analyses, else None."""
    global _claimed
    if _claimed:
        return None
    s = spec()
    if s is None:
        return None
    _claimed = True
    phases = {"G": SyntheticPass, "P": PrepPass, "S": StoragePass, "F": FetchPass}
    log.info("coordl analyze: phase %s on %r", s["phase"], loader)
    return phases[s["phase"]](loader, s)


class _Phase(Pass):
    """A pass the script iterates; the measurement is made, written, and the process ends."""

    def __init__(self, loader: Target, s: dict):
        self.target = loader
        self.spec = s
        self.steps = int(s["steps"])
        self.warmup = int(s["warmup"])
        super().__init__(epoch=loader.position.epoch, start=0, length=self.warmup + self.steps, owner=loader)
        self.bs = loader.batch_size
        self.rank = loader.world.rank
        self.res = loader.resources  # the resources the phase's passes use
        self._private = None  # the resources over a cold cache, of a phase that needs one
        self.calls: list[float] = []  # when the script asked for each batch
        self.result: dict = {}

    def _step(self) -> Step | None:
        return Step(self._next_batch(), self.bs, 0)

    def _next_batch(self):
        raise NotImplementedError

    # -- helpers ------------------------------------------------------------------------------
    def _order(self, epoch: int) -> np.ndarray:
        """This rank's ids for ``epoch`` in the loader's order."""
        w = self.target.world
        return self.target.schedule.shard(epoch, w.rank, w.world_size)

    def _real_pass(self, batches: list[np.ndarray]) -> Pass:
        """A pass of the loader's own pipeline over ``batches``."""
        return self.target.open_pass(batches, resources=self.res)

    def _private_cache(self, budget: int) -> None:
        """Runs the phase's passes on a cold cache of ``budget`` bytes, private to this run."""
        index = self.target.resources.index
        name = f"analyze:{self.spec['run']}:{self.spec['phase']}"
        spec = CacheSpec.for_dataset(index, budget, private=name) if budget > 0 else None
        self.res = self._private = self.target.resources.with_cache(spec)

    def _rate(self, times: list[float]) -> float:
        """Samples/s over the measured steps of ``times`` (one timestamp per step, plus the end)."""
        n = len(times) - 1 - self.warmup
        if n < 1:
            return 0.0
        dt = times[-1] - times[self.warmup]
        return n * self.bs / dt if dt > 0 else 0.0

    def _finish_phase(self):
        ld = self.target
        res = ld.resources
        out = {
            "phase": self.spec["phase"],
            "rank": ld.world.rank,
            "world_size": ld.world.world_size,
            "local_rank": ld.world.local_rank,
            "local_world_size": ld.world.local_world_size,
            "batch_size": self.bs,
            "warmup": self.warmup,
            "steps": self.steps,
            "backend": ld.backend,
            "device": "cpu" if ld.device_id is None else f"cuda:{ld.device_id}",
            "prep_threads": ld.num_workers if ld.backend == "torch" else ld.num_threads,
            "cpus": cpus.available(),
            "io_threads": res.io_threads or max(1, ld.num_workers),
            "dataset_samples": len(res.index),
            "dataset_bytes": int(res.index.total_bytes),
            "cache_budget": int(ld.tier_plan.encoded_budget),
            "pid": os.getpid(),
        }
        out.update(self.result)
        path = os.path.join(self.spec["out"], f"phase-{self.spec['phase']}-rank{ld.world.rank}.json")
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(out, f, indent=1)
        os.replace(tmp, path)
        self.close()
        if self._private is not None:
            self._private.close()  # leaves the private cache, stops its workers
        ld.close()  # stops the pipeline and leaves the cache before the script ends
        log.info("coordl analyze: phase %s measured; ending the script", self.spec["phase"])
        raise SystemExit(0)


class SyntheticPass(_Phase):
    """Phase G: the same batch over and over, already where the loader puts batches."""

    def __init__(self, loader, s):
        super().__init__(loader, s)
        first = self._order(loader.position.epoch)[: self.bs]
        p = self._real_pass([first])
        self.batch = next(p)
        p.close()

    def _next_batch(self):
        self.calls.append(time.perf_counter())
        if len(self.calls) > self.warmup + self.steps:
            g = self._rate(self.calls)
            self.result = {"samples_per_s": g, "step_s": self.bs / g if g else 0.0}
            self._finish_phase()
        return self.batch


class _Timed(_Phase):
    """Hands the script the batches of a real pass, timing each request."""

    _pass: Pass | None = None

    def _shutdown(self) -> None:
        if self._pass is not None:
            self._pass.close()

    def _drive(self, batches: list[np.ndarray]):
        """Hands the script ``warmup + steps`` batches of a pass over ``batches`` (which has more)."""
        self._pass = self._real_pass(batches)
        self._n = min(len(batches), self.warmup + self.steps)

    def _next_batch(self):
        self.calls.append(time.perf_counter())
        if len(self.calls) > self._n:
            self._done()
        try:
            return next(self._pass)
        except StopIteration:
            self._done()

    def _done(self):
        raise NotImplementedError


class PrepPass(_Timed):
    """Phase P: prep on cached data, alone (P) and with the script's step (R); then C."""

    def __init__(self, loader, s):
        super().__init__(loader, s)
        ld = loader
        index = ld.resources.index
        k = int(s.get("subset_batches", 16)) * self.bs
        world = ld.world.world_size
        order = sampler.epoch_order(len(index), ld.seed, 0, True)[: k * world]
        budget = int(index.sizes[order].sum()) + 4096 * len(order)
        self._private_cache(budget)
        mine = sampler.shard(order, ld.world.rank, world, True)
        self.subset = mine
        rng = np.random.default_rng(ld.seed + 1)
        n = self.warmup + self.steps + TAIL

        def cycle():
            reps = -(-n * self.bs // max(1, len(mine))) + 1
            ids = np.concatenate([rng.permutation(mine) for _ in range(reps)])[: n * self.bs]
            return [ids[i : i + self.bs] for i in range(0, len(ids), self.bs)]

        # 1. fill the cache (and warm the pipeline), unmeasured
        fill = [mine[i : i + self.bs] for i in range(0, len(mine), self.bs)]
        for _ in self._real_pass(fill):
            pass
        # 2. P: the loader alone on cached data
        times = [time.perf_counter()]
        p = self._real_pass(cycle())
        out = out_uint8 = 0
        for batch in p:
            if len(times) == 1:  # what one sample of the pipeline's output weighs, for the remote CPUs' what-if
                out, out_uint8 = batch_bytes(batch)
            times.append(time.perf_counter())
            if len(times) > self.warmup + self.steps:
                break
        stats = p.stats().as_dict()
        p.close()
        self.result["P_samples_per_s"] = self._rate(times)
        self.result["P_cache_hit_fraction"] = stats["cache_hits"] / max(1, stats["cache_hits"] + stats["storage_reads"])
        self.result["subset_samples"] = int(len(order))
        self.result["subset_bytes"] = int(index.sizes[order].sum())
        self.result["output_sample_bytes"] = out / self.bs
        self.result["output_uint8_sample_bytes"] = out_uint8 / self.bs
        self.result.update(site(ld.options.prep).report_fields())
        self.result.update(_decoded_rates(ld))
        # 3. R: the script's step on cached data (the pass below)
        self._drive(cycle())

    def _done(self):
        self.result["R_samples_per_s"] = self._rate(self.calls)
        self._pass.close()
        self.result["C_bytes_per_s"] = _cache_read_rate(self.res.cache, self.subset)
        self._finish_phase()


class FetchPass(_Timed):
    """Phase F: training from a cold cache of the job's budget, the epoch's first batches."""

    def __init__(self, loader, s):
        super().__init__(loader, s)
        ld = loader
        self._private_cache(ld.tier_plan.encoded_budget)
        w = ld.world
        batches = ld.schedule.batches(ld.position.epoch, w.rank, w.world_size)[: self.warmup + self.steps + TAIL]
        if len(batches) < self.warmup + self.steps + TAIL:  # a short epoch: measure what there is
            tail = min(TAIL, len(batches) // 4)
            self.warmup = min(self.warmup, len(batches) // 5)
            self.steps = len(batches) - self.warmup - tail
        _drop_pages(ld.resources.index, np.concatenate(batches))
        self._drive(batches)

    def _done(self):
        s = self._pass.stats().as_dict()
        self._pass.close()
        self.result.update(
            samples_per_s=self._rate(self.calls),
            stall_s=s["stall_s"],
            stall_fetch_s=s["stall_fetch_s"],
            stall_prep_s=s["stall_prep_s"],
            elapsed_s=s["elapsed_s"],
            storage_bytes=s["storage_bytes"],
            storage_reads=s["storage_reads"],
            cache_hits=s["cache_hits"],
        )
        self._finish_phase()


class StoragePass(_Phase):
    """Phase S: random reads of this rank's samples from storage, pages dropped first."""

    def _next_batch(self):
        ld = self.target
        ids = self._order(ld.position.epoch + 7919)[: (self.warmup + self.steps) * self.bs]
        limit = float(self.spec.get("storage_seconds", 20.0))
        index = ld.resources.index
        _drop_pages(index, ids)
        threads = ld.resources.io_threads or 8
        done_bytes = done_items = 0

        def read(part: np.ndarray) -> int:
            # As the loader reads misses: a part per task, an object store's part all in flight at once.
            buffers = [[np.empty(int(index.sizes[i]), dtype=np.uint8)] for i in part.tolist()]
            failed = samples.read_many(index, part, buffers, drop_page_cache=True)
            if failed:
                raise next(iter(failed.values()))
            return int(index.sizes[part].sum())

        t0 = time.perf_counter()
        with daemon_pool(threads, "coordl-analyze-io") as pool:
            futures = []
            for a in range(0, len(ids), STORAGE_PART):  # keep the threads busy, stop submitting after the time limit
                part = ids[a : a + STORAGE_PART]
                futures.append((len(part), pool.submit(read, part)))
                if len(futures) >= 2 * threads:
                    n, f = futures.pop(0)
                    done_bytes += f.result()
                    done_items += n
                    if time.perf_counter() - t0 > limit:
                        break
            for n, f in futures:
                done_bytes += f.result()
                done_items += n
        dt = time.perf_counter() - t0
        self.result = {
            "S_bytes_per_s": done_bytes / dt,
            "S_samples_per_s": done_items / dt,
            "read_items": done_items,
            "read_bytes": done_bytes,
            "seconds": dt,
        }
        self._finish_phase()


def batch_bytes(batch) -> tuple[int, int]:
    """Bytes of a batch's arrays and tensors (in tuples, lists and dicts), as they are and with
    floating-point ones at one byte an element (``RayPrep(output="uint8")``'s pixels)."""
    if isinstance(batch, dict):
        batch = list(batch.values())
    if isinstance(batch, (tuple, list)):
        parts = [batch_bytes(b) for b in batch]
        return sum(a for a, _ in parts), sum(u for _, u in parts)
    nbytes = getattr(batch, "nbytes", None)
    if nbytes is None:  # not an array: a path, an id, None
        return 0, 0
    dtype = batch.dtype
    floating = dtype.is_floating_point if hasattr(dtype, "is_floating_point") else np.dtype(dtype).kind == "f"
    elements = batch.numel() if hasattr(batch, "numel") else batch.size
    return int(nbytes), int(elements if floating else nbytes)


def _decoded_rates(ld) -> dict:
    """Prep from decoded images against prep from encoded bytes (in batches that mix both, and
    when the tier holds every sample), and a decoded image's bytes, for the decoded tier's what-if
    (DALI on the CPU with a recipe that takes decoded images)."""
    from coordl.tiers import plan

    w = ld.world
    if plan.refusal(ld.backend, ld.device_id, ld.recipe, w.world_size > w.local_world_size) is not None:
        return {}
    from coordl.prep import calibrate

    r = calibrate.measure(
        ld.recipe, ld.resources.index, num_threads=ld.num_threads, seed=ld.seed + 2, batch_size=ld.batch_size
    )
    return {
        "decoded_speedup": r.decoded / r.encoded,
        "decoded_only_speedup": r.decoded_only / r.encoded,
        "decoded_sample_bytes": r.decoded_bytes,
    }


def _cache_read_rate(cache: NodeCache | None, ids: np.ndarray, min_seconds: float = 0.25) -> float:
    """Bytes/s of copying cached samples out of the cache (memory bandwidth, as the paper)."""
    if cache is None:
        return 0.0
    views = [v for v in (cache.get(int(i)) for i in ids) if v is not None]
    if not views:
        return 0.0
    buf = np.empty(max(len(v) for v in views), dtype=np.uint8)
    total, t0 = 0, time.perf_counter()
    while True:
        for v in views:
            buf[: len(v)] = v
            total += len(v)
        dt = time.perf_counter() - t0
        if dt >= min_seconds:
            return total / dt


def _drop_pages(index, ids) -> None:
    """Evicts the files of ``ids`` (their members' bytes, in tar shards) from the OS page cache, so
    that reading them hits the device (objects in a store have no pages here).

    A member's range is widened to whole pages: the kernel leaves a page it is asked to drop only
    in part, so a member of a few KB (inside one or two pages) would stay cached, and a larger one
    would keep its first and last pages. Its neighbours' bytes in those pages go too.
    """
    if index.in_store:
        return
    page = os.sysconf("SC_PAGE_SIZE")
    for i in np.unique(ids).tolist():
        path, offset, size = index.location(i)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            if index.shards is None:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # the whole file
            else:
                start = offset - offset % page
                os.posix_fadvise(fd, start, -(-(offset + size - start) // page) * page, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
