"""The part of DS-Analyzer that runs inside the user's training script.

``coordl analyze`` runs the script once per phase with ``COORDL_ANALYZE`` set to a JSON
spec (``phase``, ``steps``, ``warmup``, ``out``, ``run``, ...). The first CoordLoader the
script iterates is then replaced, for that pass, by the phase's pass:

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
"""

from __future__ import annotations

import concurrent.futures as cf
import hashlib
import json
import logging
import os
import time

import numpy as np

from coordl import sampler
from coordl.fetch import Fetcher, storage
from coordl.fetch.cache import MinIOCache
from coordl.shm import names

__all__ = ["ENV", "claim", "spec"]

log = logging.getLogger(__name__)

ENV = "COORDL_ANALYZE"
# Batches a measured pass runs beyond its last measured step, so that the pipeline is still
# working ahead when the measurement ends, as it was when it began (no drain at the end).
TAIL = 6
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


def claim(loader):
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


class _Phase:
    """A pass the script iterates; the measurement is made, written, and the process ends."""

    active = True

    def __init__(self, loader, s: dict):
        self.loader = loader
        self.spec = s
        self.steps = int(s["steps"])
        self.warmup = int(s["warmup"])
        self.bs = loader.batch_size
        self.rank = loader.world.rank
        self.calls: list[float] = []  # when the script asked for each batch
        self.result: dict = {}

    def __iter__(self):
        return self

    def __len__(self) -> int:
        return self.warmup + self.steps

    def stats(self, complete: bool) -> dict:
        return self.loader._empty_stats()

    def close(self) -> None:
        pass

    # -- helpers ------------------------------------------------------------------------------
    def _order(self, epoch: int) -> np.ndarray:
        """This rank's ids for ``epoch`` in the loader's order."""
        ld = self.loader
        order = sampler.epoch_order(len(ld.index), ld.seed, epoch, ld.shuffle)
        return sampler.shard(order, ld.world.rank, ld.world.world_size, ld.drop_last)

    def _real_pass(self, batches: list[np.ndarray]):
        """A pass of the loader's own pipeline over ``batches``."""
        ld = self.loader
        ld._resume_from_started = 0
        if ld.backend == "torch":
            from coordl.prep.torch_backend import TorchPass

            return TorchPass(ld, ld._epoch, batches)
        from coordl.loader import _Pass

        return _Pass(ld, ld._epoch, batches)

    def _private_cache(self, budget: int) -> None:
        """Swaps the loader's cache for a cold one of ``budget`` bytes, private to this run."""
        ld = self.loader
        if ld.cache is not None:
            ld.cache.close()
        ld.cache = None
        if budget > 0:
            group = hashlib.sha256(f"{ld.index.fingerprint}:{os.getuid()}:analyze:{self.spec['run']}:"
                                   f"{self.spec['phase']}".encode()).hexdigest()[:16]  # fmt: skip
            ld.cache = MinIOCache(group, ld.index.sizes, budget, keep=False, directory=names.shm_dir(),
                                  dataset=ld.index.fingerprint)  # fmt: skip
        ld._fetcher = Fetcher(ld.index, ld.cache, drop_page_cache=ld.cache is not None)

    def _rate(self, times: list[float]) -> float:
        """Samples/s over the measured steps of ``times`` (one timestamp per step, plus the end)."""
        n = len(times) - 1 - self.warmup
        if n < 1:
            return 0.0
        dt = times[-1] - times[self.warmup]
        return n * self.bs / dt if dt > 0 else 0.0

    def _finish(self):
        ld = self.loader
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
            "io_threads": ld._pool._max_workers if ld._pool is not None else max(1, ld.num_workers),
            "dataset_samples": len(ld.index),
            "dataset_bytes": int(ld.index.total_bytes),
            "cache_budget": int(ld._analyze_budget),
            "pid": os.getpid(),
        }
        out.update(self.result)
        path = os.path.join(self.spec["out"], f"phase-{self.spec['phase']}-rank{ld.world.rank}.json")
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(out, f, indent=1)
        os.replace(tmp, path)
        self.active = False
        ld._iter = None
        ld.close()  # stops the pipeline and leaves the private cache before the script ends
        log.info("coordl analyze: phase %s measured; ending the script", self.spec["phase"])
        raise SystemExit(0)


class SyntheticPass(_Phase):
    """Phase G: the same batch over and over, already where the loader puts batches."""

    def __init__(self, loader, s):
        super().__init__(loader, s)
        first = self._order(loader._epoch)[: self.bs]
        p = self._real_pass([first])
        self.batch = next(p)
        p.close()

    def __next__(self):
        self.calls.append(time.perf_counter())
        if len(self.calls) > self.warmup + self.steps:
            g = self._rate(self.calls)
            self.result = {"samples_per_s": g, "step_s": self.bs / g if g else 0.0}
            self._finish()
        return self.batch


class _Timed(_Phase):
    """Hands the script the batches of a real pass, timing each request."""

    def _drive(self, batches: list[np.ndarray]):
        """Hands the script ``warmup + steps`` batches of a pass over ``batches`` (which has more)."""
        self._pass = self._real_pass(batches)
        self._n = min(len(batches), self.warmup + self.steps)

    def __next__(self):
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
        k = int(s.get("subset_batches", 16)) * self.bs
        world = ld.world.world_size
        order = sampler.epoch_order(len(ld.index), ld.seed, 0, True)[: k * world]
        budget = int(ld.index.sizes[order].sum()) + 4096 * len(order)
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
        for _ in p:
            times.append(time.perf_counter())
            if len(times) > self.warmup + self.steps:
                break
        stats = p.stats(complete=False)
        p.close()
        self.result["P_samples_per_s"] = self._rate(times)
        self.result["P_cache_hit_fraction"] = stats["cache_hits"] / max(1, stats["cache_hits"] + stats["storage_reads"])
        self.result["subset_samples"] = int(len(order))
        self.result["subset_bytes"] = int(ld.index.sizes[order].sum())
        # 3. R: the script's step on cached data (the pass below)
        self._drive(cycle())

    def _done(self):
        self.result["R_samples_per_s"] = self._rate(self.calls)
        self._pass.close()
        self.result["C_bytes_per_s"] = _cache_read_rate(self.loader.cache, self.subset)
        self._finish()


class FetchPass(_Timed):
    """Phase F: training from a cold cache of the job's budget, the epoch's first batches."""

    def __init__(self, loader, s):
        super().__init__(loader, s)
        ld = loader
        self._private_cache(ld._analyze_budget)
        ids = self._order(ld._epoch)
        batches = sampler.batches(ids, self.bs, ld.drop_last)[: self.warmup + self.steps + TAIL]
        if len(batches) < self.warmup + self.steps + TAIL:  # a short epoch: measure what there is
            tail = min(TAIL, len(batches) // 4)
            self.warmup = min(self.warmup, len(batches) // 5)
            self.steps = len(batches) - self.warmup - tail
        _drop_pages(ld.index.paths, np.concatenate(batches))
        self._drive(batches)

    def _done(self):
        s = self._pass.stats(complete=False)
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
        self._finish()


class StoragePass(_Phase):
    """Phase S: random reads of this rank's samples from storage, pages dropped first."""

    def __next__(self):
        ld = self.loader
        ids = self._order(ld._epoch + 7919)[: (self.warmup + self.steps) * self.bs]
        limit = float(self.spec.get("storage_seconds", 20.0))
        paths, sizes = ld.index.paths, ld.index.sizes
        _drop_pages(paths, ids)
        threads = ld._pool._max_workers if ld._pool is not None else 8
        done_bytes = done_items = 0
        t0 = time.perf_counter()
        with cf.ThreadPoolExecutor(threads) as pool:
            futures = []
            it = iter(ids.tolist())
            for i in it:  # keep the threads busy, stop submitting after the time limit
                futures.append(pool.submit(storage.read, paths[i], int(sizes[i]), drop_page_cache=True))
                if len(futures) >= 4 * threads:
                    f = futures.pop(0)
                    done_bytes += len(f.result())
                    done_items += 1
                    if time.perf_counter() - t0 > limit:
                        break
            for f in futures:
                done_bytes += len(f.result())
                done_items += 1
        dt = time.perf_counter() - t0
        self.result = {"S_bytes_per_s": done_bytes / dt, "S_samples_per_s": done_items / dt,
                       "read_items": done_items, "read_bytes": done_bytes, "seconds": dt}  # fmt: skip
        self._finish()


def _cache_read_rate(cache: MinIOCache | None, ids: np.ndarray, min_seconds: float = 0.25) -> float:
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


def _drop_pages(paths, ids) -> None:
    """Evicts the files of ``ids`` from the OS page cache, so that reading them hits the device."""
    for i in np.unique(ids).tolist():
        try:
            fd = os.open(paths[i], os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
