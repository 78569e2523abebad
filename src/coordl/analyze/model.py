"""DS-Analyzer's model: training speed from the measured rates, and what more resources buy.

The measured rates (all global, over every rank of the job):

- ``G``: samples/s the training step ingests with synthetic batches (no fetch, no prep);
- ``P``: samples/s the loader alone delivers from data held in its cache (prep only);
- ``R``: samples/s of training on data held in the cache (prep and compute together, no
  fetch): the paper's phase 2;
- ``S``: bytes/s read from storage (random reads, all I/O threads);
- ``C``: bytes/s read from the cache.

The fetch rate at a cache of ``x`` of the dataset (the paper's equation 2, in bytes since
samples differ in size; MinIO never evicts, so ``x`` of the bytes hit every epoch)::

    F(x) = 1 / (b * x / C + b * (1 - x) / S)        b = mean bytes per sample

and training runs at ``min(F, R)``. The paper uses ``min(F, P, G)``; ``R`` is at most
``min(P, G)`` and equals it only when prep and compute run on separate hardware (a GPU
trains while CPUs prepare). When both run on the CPU they share its cores and
``R`` is close to ``1 / (1/P + 1/G)``; measuring ``R`` covers both cases, and the what-if
for cores uses whichever of the two explains the measured ``R``.

A local-storage tier (``Cache(disk=...)``) of ``D`` bytes read at ``Sd`` bytes/s serves the bytes
the memory cache does not hold, up to ``D`` (``d = min(1, D / dataset) - x``), in every epoch after
the first: ``F = 1 / (b x / C + b d / Sd + b (1 - x - d) / S)``.

Remote CPUs (:class:`coordl.RayPrep`) run the same pipeline, so each prepares at phase P's rate
per local CPU, ``p = P / prep CPUs``. Only their share crosses the network, ``B`` bytes a sample
(the pipeline's output, plus the encoded bytes when the trainer ships them), over a link of
``L`` bytes/s per node::

    P(N) = P + min(N * p, nodes * L / B)

and training runs at ``min(F(x), R(P(N)))``, ``R`` following ``P`` as in the cores' what-if.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from coordl.tiers.model import TierRates, best_tier_split, tier_sweep, tier_throughput

__all__ = ["DETACHED_WHEN_SLOWER", "Model", "Rates", "bottleneck", "describe_bottleneck", "stall_split"]

#: An ``hp_group`` member whose training is this many times slower per sample than the others' falls a
#: whole staging ring behind and is detached: it prepares its own batches (coordl.staging.ring.SLOWER).
DETACHED_WHEN_SLOWER = 1.25


@dataclass
class Rates:
    """Measured rates and the facts of the job they were measured on."""

    G: float  # samples/s
    P: float  # samples/s
    R: float  # samples/s
    S: float  # bytes/s
    C: float  # bytes/s
    F: float  # samples/s measured in the fetch phase (cold cache, the job's cache budget)
    sample_bytes: float  # mean bytes per sample of the dataset
    dataset_samples: int
    dataset_bytes: int
    cache_bytes: int  # the job's cache budget (per node)
    prep_threads: int  # threads (DALI) or workers (torch backend) per rank
    ranks: int = 1
    nodes: int = 1
    decoded_speedup: float = 0.0  # prep from decoded images (mixed batches) over P, encoded bytes alone (0: unknown)
    decoded_sample_bytes: float = 0.0  # mean bytes of a decoded image
    decoded_only_speedup: float = 0.0  # prep when the tier holds every sample, over P (0: as decoded_speedup)
    prep_cpus: float = 0.0  # CPUs phase P's prep used, whole job (0: ranks x prep_threads)
    output_sample_bytes: float = 0.0  # the pipeline's output per sample (0: not measured)
    result_sample_bytes: float = 0.0  # what an actor sends back per sample (0: output_sample_bytes)
    ships_encoded: bool = False  # the trainer ships actors the encoded bytes (RayPrep(reads="trainer"))

    def as_dict(self) -> dict:
        return asdict(self)


def stall_split(step_rate: float, G: float, R: float) -> dict:
    """The paper's differential split of a step at ``step_rate`` samples/s into fractions.

    Compute is what a step costs with synthetic data (``1/G``); prep stall what caching all
    data still adds (``1/R - 1/G``); fetch stall the rest. Fractions sum to 1.
    """
    t = 1.0 / step_rate
    t_g = 1.0 / G
    t_r = max(1.0 / R, t_g)
    if t < t_r:  # measured faster than with all data cached: noise; no fetch stall
        return {"compute": t_g / t_r, "prep": (t_r - t_g) / t_r, "fetch": 0.0}
    return {"compute": t_g / t, "prep": (t_r - t_g) / t, "fetch": (t - t_r) / t}


def bottleneck(split: dict, threshold: float = 0.05) -> str:
    """The stage that limits the speed: ``"fetch"``, ``"prep"`` or ``"compute"``.

    A fetch stall exists only when storage is slower than training on cached data, so it
    comes first: faster fetching (more cache, more bandwidth) is then what speeds training
    up. Otherwise prep, if it costs more than ``threshold`` of the step, else compute.
    """
    if split["fetch"] > threshold:
        return "fetch"
    return "prep" if split["prep"] > threshold else "compute"


def describe_bottleneck(split: dict) -> str:
    """A sentence: ``fetch-bound: 41% of the time is spent waiting for storage``."""
    b = bottleneck(split)
    pct = lambda k: f"{100 * split[k]:.0f}%"  # noqa: E731
    if b == "fetch":
        return f"fetch-bound: {pct('fetch')} of the time is spent waiting for storage"
    if b == "prep":
        return f"prep-bound: {pct('prep')} of the time is spent waiting for decoding and augmentation"
    return (
        f"compute-bound: the training step takes {pct('compute')} of the time; data stalls are "
        f"{100 * (split['fetch'] + split['prep']):.0f}%"
    )


class Model:
    """Predictions from :class:`Rates`."""

    def __init__(self, rates: Rates):
        self.r = rates
        r = rates
        self.G = r.G
        # R is measured in the regime predictions are about (training on data in memory), so
        # it is used as measured, even when noise puts it above G; the stall split caps it.
        self.R = r.R
        # How prep and compute share the machine: the model that explains the measured R,
        # scaled to match it exactly.
        overlapped = min(r.P, r.G)
        shared = 1.0 / (1.0 / r.P + 1.0 / r.G)
        self.sharing = (
            "overlapped" if abs(math.log(self.R / overlapped)) <= abs(math.log(self.R / shared)) else "shared"
        )
        self._calibration = self.R / (overlapped if self.sharing == "overlapped" else shared)

    # -- fetch ------------------------------------------------------------------------------
    def fetch_rate(self, x: float, S: float | None = None) -> float:
        """F(x) in samples/s for a cache holding ``x`` (0..1) of the dataset's bytes."""
        S = self.r.S if S is None else S
        b = self.r.sample_bytes
        x = min(max(x, 0.0), 1.0)
        t = b * x / self.r.C + b * (1.0 - x) / S
        return math.inf if t <= 0 else 1.0 / t

    def throughput(self, x: float, *, S: float | None = None, R: float | None = None) -> float:
        """Predicted training samples/s in epochs after the first, cache fraction ``x``."""
        return min(self.fetch_rate(x, S), self.R if R is None else R)

    def paper_throughput(self, x: float) -> float:
        """The paper's ``min(F, P, G)``."""
        return min(self.fetch_rate(x), self.r.P, self.r.G)

    def cache_fraction(self) -> float:
        """The job's cache budget as a fraction of the dataset."""
        return min(1.0, self.r.cache_bytes / self.r.dataset_bytes) if self.r.dataset_bytes else 0.0

    def cache_to_remove_fetch_stalls(self) -> float:
        """The smallest cache fraction at which F(x) >= R (0 when storage alone keeps up)."""
        b, S, C = self.r.sample_bytes, self.r.S, self.r.C
        need = 1.0 / self.R  # seconds per sample the fetch may take
        if b / S <= need:
            return 0.0
        return min(1.0, (b / S - need) / (b / S - b / C))

    def bound(self, x: float) -> str:
        """The bottleneck at cache fraction ``x``: ``"fetch"``, ``"prep"`` or ``"compute"``."""
        return bottleneck(self.steady_split(x))

    def steady_split(self, x: float) -> dict:
        return stall_split(self.throughput(x), self.G, self.R)

    def sweep(self, fractions) -> list[dict]:
        return [
            {
                "cache_fraction": round(x, 4),
                "cache_bytes": int(x * self.r.dataset_bytes),
                "predicted_samples_per_s": self.throughput(x),
                "fetch_samples_per_s": self.fetch_rate(x),
                "paper_min_F_P_G": self.paper_throughput(x),
                "bound": self.bound(x),
            }
            for x in fractions
        ]

    # -- cores ------------------------------------------------------------------------------
    def R_with_prep(self, P: float, G: float | None = None) -> float:
        """Training rate with no fetch stalls if prep ran at ``P`` (and compute at ``G``)."""
        G = self.G if G is None else G
        base = min(P, G) if self.sharing == "overlapped" else 1.0 / (1.0 / P + 1.0 / G)
        return self._calibration * base

    def with_cores(self, factor: float) -> dict:
        """More (or fewer) prep threads: P scales with them (DALI and workers scale near-linearly)."""
        P = self.r.P * factor
        R = self.R_with_prep(P)
        x = self.cache_fraction()
        return {
            "factor": factor,
            "prep_threads_per_rank": self.r.prep_threads * factor,
            "P": P,
            "R": R,
            "predicted_samples_per_s": self.throughput(x, R=R),
        }

    # -- storage ----------------------------------------------------------------------------
    def with_bandwidth(self, factor: float) -> dict:
        S = self.r.S * factor
        x = self.cache_fraction()
        return {"storage_bytes_per_s": S, "predicted_samples_per_s": self.throughput(x, S=S)}

    # -- the local-storage tier ---------------------------------------------------------------
    def with_disk(self, size_bytes: float, disk_bytes_per_s: float) -> dict:
        """A local-storage tier of ``size_bytes`` (per node) read at ``disk_bytes_per_s``, under this
        job's memory cache, in the epochs after the first: the memory serves ``x`` of the bytes, the
        tier ``d = min(1, size / dataset) - x`` more (it holds the memory's samples too: each tier is
        filled once, inclusive), the store the rest::

            F = 1 / (b * x / C + b * d / D + b * (1 - x - d) / S)
        """
        r = self.r
        x = self.cache_fraction()
        d = max(0.0, min(1.0, size_bytes / r.dataset_bytes) - x) if r.dataset_bytes else 0.0
        b = r.sample_bytes
        t = b * (x / r.C + d / disk_bytes_per_s + max(0.0, 1.0 - x - d) / r.S)
        fetch = math.inf if t <= 0 else 1.0 / t
        return {
            "disk_bytes": size_bytes,
            "disk_bytes_per_s": disk_bytes_per_s,
            "disk_fraction": d,
            "fetch_samples_per_s": fetch,
            "predicted_samples_per_s": min(fetch, self.R),
        }

    # -- the decoded tier -------------------------------------------------------------------
    def decoded_split(self, budget: float | None = None, points: int = 5) -> dict | None:
        """The job at ``budget`` bytes per node (default: its cache budget) split between
        encoded bytes and decoded images: predicted samples/s at ``points`` splits, and the
        split the model recommends (``Cache(decoded=...)``). None when prep from decoded images was
        not measured (GPU decoding, a recipe on encoded bytes, the torch backend)."""
        r = self.r
        if not r.decoded_speedup or not r.decoded_sample_bytes:
            return None
        budget = r.cache_bytes if budget is None else budget
        tier = TierRates(
            samples=r.dataset_samples,
            encoded_bytes=r.sample_bytes,
            decoded_bytes=r.decoded_sample_bytes,
            storage=r.S,
            cache=r.C,
            prep_encoded=r.P,
            prep_decoded=r.P * r.decoded_speedup,
            prep_decoded_only=r.P * r.decoded_only_speedup,
        )
        best = best_tier_split(tier, budget, prep=self.R_with_prep)
        return {
            "budget_bytes": int(budget),
            "what_if": tier_sweep(tier, budget, points, prep=self.R_with_prep),
            "recommended_decoded_cache": best,
            "recommended_samples_per_s": tier_throughput(tier, budget, best, prep=self.R_with_prep),
        }

    # -- nodes with the partitioned cache ---------------------------------------------------
    def with_nodes(self, n: int, network_bytes_per_s: float) -> dict:
        """``n`` nodes like this one, each with this job's cache budget and storage.

        Each node trains on ``1/n`` of every epoch. Without peers a node hits its own cache
        (``x``); with the partitioned cache the nodes together hold ``min(1, n*x)`` and a node
        finds ``1/n`` of that locally and the rest at peers over the network; with
        locality-aware assignment each node trains on the items it holds, so peers serve
        almost nothing.
        """
        b, C, S = self.r.sample_bytes, self.r.C, self.r.S
        x = self.cache_fraction()
        agg = min(1.0, n * x)

        def rate(local: float, peer: float) -> float:
            storage = max(0.0, 1.0 - local - peer)
            t = b * (local / C + peer / network_bytes_per_s + storage / S)
            return n * min(1.0 / t, self.R / self.r.nodes)

        return {
            "nodes": n,
            "aggregate_cache_fraction": agg,
            "no_peers": rate(x, 0.0),
            "partitioned": rate(agg / n, agg * (n - 1) / n),
            "locality_aware": rate(agg, 0.0),
        }

    # -- remote CPUs (RayPrep) -------------------------------------------------------------
    def local_prep_cpus(self) -> float:
        """CPUs the job's prep ran on in phase P (each rank's threads, at most its CPUs)."""
        return self.r.prep_cpus or self.r.ranks * max(1, self.r.prep_threads)

    def remote_cpu_rate(self) -> float:
        """Samples/s one remote CPU prepares: phase P's rate per local prep CPU (same pipeline)."""
        return self.r.P / self.local_prep_cpus()

    def remote_sample_bytes(self) -> float:
        """Bytes one remotely prepared sample puts on the network (0: not measured)."""
        r = self.r
        back = r.result_sample_bytes or r.output_sample_bytes
        if not back:
            return 0.0
        return back + (r.sample_bytes if r.ships_encoded else 0.0)

    def with_remote_cpus(self, n: int, network_bytes_per_s: float) -> dict:
        """Prep on ``n`` remote CPUs besides this job's own: ``P + min(n * p, nodes * L / B)``.

        ``network_samples_per_s`` is None when the output's bytes were not measured (no cap).
        """
        cpus = n * self.remote_cpu_rate()
        b = self.remote_sample_bytes()
        link = self.r.nodes * network_bytes_per_s / b if b else math.inf
        remote = min(cpus, link)
        P = self.r.P + remote
        R = self.R_with_prep(P)
        predicted = self.throughput(self.cache_fraction(), R=R)
        return {
            "remote_cpus": n,
            "remote_samples_per_s": remote,
            "network_samples_per_s": None if math.isinf(link) else link,
            "network_bound": cpus > link,
            "P": P,
            "R": R,
            "predicted_samples_per_s": predicted,
            "bound": bottleneck(stall_split(predicted, self.G, R)),
        }

    # -- HP jobs with coordinated prep ------------------------------------------------------
    def with_hp_jobs(self, n: int) -> dict:
        """``n`` jobs of this kind on this node, sharing its cache, storage and CPUs.

        Independent jobs each fetch and prepare every sample: storage and prep are shared
        ``n`` ways. With coordinated prep (``hp_group``) each batch is fetched and prepared
        once for all. Compute is shared too when it runs on the CPU (``shared`` sharing).
        Batch sizes do not matter: members of any batch sizes share one stream of samples.
        """
        x = self.cache_fraction()
        F = self.fetch_rate(x)
        P, G = self.r.P, self.G
        if self.sharing == "shared":  # compute on the CPU: n steps per sample share the cores
            G_job = G / n
            alone = self._calibration / (n / P + n / G)
            coord = self._calibration / (1.0 / P + n / G)
        else:  # one accelerator per job
            G_job = G
            alone = self._calibration * min(P / n, G)
            coord = self._calibration * min(P, G)
        independent = min(F / n, alone, G_job)
        coordinated = min(F, coord, G_job)
        return {
            "jobs": n,
            "independent_per_job": independent,
            "coordinated_per_job": coordinated,
            "speedup": coordinated / independent,
        }

    def with_hp_slow_job(self, n: int, slower: float) -> dict:
        """``n`` jobs of this kind on this node, one of which trains ``slower`` times slower per
        sample (a bigger model), alone or in an ``hp_group``.

        In a group, a member at most :data:`DETACHED_WHEN_SLOWER` times slower is waited for: the
        group moves at its pace. A slower one falls a whole staging ring behind and is detached:
        it prepares its own batches, taking their share of fetch and prep, and the others go on at
        theirs. With one accelerator per job, the slow job's own stream takes ``s`` samples/s of
        the node's fetch and prep and the group has the rest; with compute on the CPU, the cores
        are shared by the ``n`` processes alike (CFS), ``n - 1`` of them the group's.
        """
        x = self.cache_fraction()
        F = self.fetch_rate(x)
        P, G, cal = self.r.P, self.G, self._calibration
        lockstep = slower <= DETACHED_WHEN_SLOWER
        if self.sharing == "shared":  # per sample: prep 1/P CPU-s, each job's step 1/G (the slow one's slower/G)
            fast_alone = min(F / n, cal / n / (1 / P + 1 / G))
            slow_alone = min(F / n, cal / n / (1 / P + slower / G))
            if lockstep:
                fast = slow = min(F, cal / (1 / P + (n - 1 + slower) / G))
            else:
                slow = min(F / n, cal / n / (1 / P + slower / G))
                fast = min(F - slow, cal * (n - 1) / n / (1 / P + (n - 1) / G))
        else:  # one accelerator per job
            fast_alone = min(F / n, cal * min(P / n, G))
            slow_alone = min(F / n, cal * min(P / n, G / slower))
            if lockstep:
                fast = slow = min(F, cal * min(P, G / slower))
            else:
                slow = min(F / 2, cal * min(P / 2, G / slower))
                fast = min(F - slow, cal * min(P - slow, G))
        return {
            "jobs": n,
            "slower": slower,
            "detached": not lockstep,
            "independent_fast_per_job": fast_alone,
            "independent_slow": slow_alone,
            "coordinated_fast_per_job": fast,
            "coordinated_slow": slow,
        }
