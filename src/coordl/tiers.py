"""Plans a loader's node-wide cache: how much of ``cache_bytes`` holds encoded bytes and how much
decoded images (``decoded_cache=``).

The first job on a node decides the split (from what it asks for, or from rates it measures
with ``"auto"``); jobs that come later attach to the tiers that exist.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass, field

import numpy as np

from coordl.analyze.model import TierRates, best_tier_split, tier_throughput
from coordl.fetch.budget import resolve_budget
from coordl.fetch.cache import HEADER, MAGIC
from coordl.fetch.decoded import DecodedTier
from coordl.index import Index
from coordl.prep.recipes import max_short_side, takes_decoded
from coordl.resources import CacheSpec
from coordl.shm import names
from coordl.units import format_bytes, parse_bytes

__all__ = ["TierPlan", "plan_for", "plan_tiers"]

log = logging.getLogger(__name__)

MIN_DECODED = 16 << 20  # a decoded tier smaller than this is not worth its pipeline
WHOLE_MARGIN = 1.1  # room for the whole decoded dataset: its size is estimated from a few samples


@dataclass
class TierPlan:
    """What a loader attaches to: the encoded tier and the decoded tier (either may be None)."""

    encoded: CacheSpec | None
    encoded_budget: int
    decoded: CacheSpec | None = None
    decoded_budget: int = 0
    why: str = ""  # how the split was decided, for the log and ``loader.tiers``
    rates: dict | None = None  # what "auto" measured
    predicted: dict = field(default_factory=dict)  # samples/s the model expects, by decoded bytes
    threads: int | None = None  # DALI threads "auto" chose (Lobster's rule), when the user set none

    def as_dict(self) -> dict:
        return {
            "encoded_budget": self.encoded_budget,
            "decoded_budget": self.decoded_budget,
            "why": self.why,
            "rates": self.rates,
            "predicted": self.predicted,
            "threads": self.threads,
        }


def check_request(request) -> int | float | str:
    """``decoded_cache`` as given, validated: ``"auto"``, 0, bytes, a size string or a fraction."""
    if request is False or request is None:
        return 0
    if isinstance(request, str) and request.strip().lower() == "auto":
        return "auto"
    if isinstance(request, float) and not 0.0 <= request <= 1.0:
        raise ValueError(f"decoded_cache as a float is a fraction of cache_bytes in [0, 1], got {request}")
    try:
        parse_bytes(request, 1)
    except (TypeError, ValueError) as e:
        raise type(e)(f"decoded_cache={request!r}: {e}, or 'auto', or 0 for none") from None
    return request


def refusal(backend: str, device_id, recipe, multinode: bool) -> str | None:
    """Why a loader cannot use a decoded tier (None: it can)."""
    if backend != "dali":
        return "the torch backend decodes in its dataset's transform; the decoded tier serves DALI recipes"
    if device_id is not None:
        return (
            "the decoded tier holds the CPU decoder's images, and the GPU decoder's differ from them; "
            "on a GPU, decoding is nvJPEG's (see docs/decoded-tier.md)"
        )
    if not takes_decoded(recipe):
        return (
            "the recipe is a function of the encoded bytes; wrap a function of the decoded images in "
            "coordl.DecodedRecipe to use the decoded tier"
        )
    if multinode:
        return "with several nodes, the partitioned cache shares encoded bytes between them"
    return None


def plan_for(loader, cache_bytes, decoded_cache, keep: bool, *, choose_threads: bool = False) -> TierPlan:
    """The tiers of a :class:`~coordl.CoordLoader` being made (its index, recipe, device, world).

    Args:
        choose_threads: the user set no thread count: ``"auto"`` also chooses DALI's
            (:attr:`TierPlan.threads`).
    """
    w = loader.world
    why_not = refusal(loader.backend, loader.device_id, loader.recipe, w.world_size > w.local_world_size)

    def measure():
        from coordl.prep import calibrate

        return calibrate.measure(
            loader.recipe,
            loader.index,
            num_threads=loader.num_threads,
            seed=loader.seed,
            batch_size=loader.config.batch_size,
            io_threads=loader.config.io_threads,
            choose_threads=choose_threads,
        )

    plan = plan_tiers(
        loader.index,
        cache_bytes,
        decoded_cache,
        keep,
        why_not=why_not,
        measure=measure,
        max_short_side=max_short_side(loader.recipe),
    )
    if plan.rates is not None and plan.rates.get("thread_rates"):  # measured, so chosen
        plan.threads = plan.rates["threads"]
    return plan


def existing_budget(spec: CacheSpec) -> int | None:
    """The budget of the tier ``spec`` names if it is on this node already, else None."""
    path = os.path.join(spec.directory, names.segment_name(spec.fingerprint, "table"))
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        raw = os.pread(fd, HEADER.itemsize, 0)
    finally:
        os.close(fd)
    if len(raw) < HEADER.itemsize:
        return None
    head = np.frombuffer(raw, dtype=HEADER)[0]
    if head["magic"] not in (MAGIC, DecodedTier.MAGIC):
        return None
    return int(head["budget"])


def plan_tiers(
    index: Index,
    cache_bytes,
    decoded_cache,
    keep: bool,
    *,
    why_not: str | None,
    measure,
    max_short_side: int | None = None,
) -> TierPlan:
    """The node's tiers for a loader.

    Args:
        index: the dataset.
        cache_bytes: the node's budget, as the user gives it (both tiers together).
        decoded_cache: ``"auto"``, 0, or the decoded tier's share (bytes, a size, a fraction of
            ``cache_bytes``).
        keep: ``keep_cache``.
        why_not: why this loader cannot use a decoded tier (None: it can).
        measure: ``() -> PrepRates``, called for ``"auto"`` when the node has no tiers yet.
        max_short_side: the recipe's cap on decoded images (a tier of its own).
    """
    form = {"max_short_side": max_short_side}
    request = check_request(decoded_cache)
    if isinstance(cache_bytes, float):  # a fraction of the dataset's files
        cache_bytes = parse_bytes(cache_bytes, index.total_bytes)
    if why_not is not None:
        if request not in (0, "auto"):
            raise ValueError(f"decoded_cache={decoded_cache!r}: {why_not}; pass decoded_cache=0")
        request = 0
    directory = names.shm_dir()
    encoded_spec = CacheSpec.for_dataset(index, 0, keep=keep)
    decoded_spec = CacheSpec.for_dataset(index, 0, keep=keep, tier="decoded", **form)
    have_decoded = existing_budget(decoded_spec) if request != 0 else None
    if have_decoded is not None:  # another job made it: attach to it
        budget = _encoded_only(index, cache_bytes, have_decoded)
        return _plan(index, keep, form, budget, have_decoded, "attached to the node's decoded tier")
    if request == 0:
        return _plan(index, keep, form, _encoded_only(index, cache_bytes, 0), 0, "decoded_cache=0")
    total = index.total_bytes
    if request != "auto":
        wanted = parse_bytes(request, None) if not isinstance(request, float) else None
        cap = total + wanted if wanted is not None else 1 << 62
        node = resolve_budget(cache_bytes, cap, directory, num_items=2 * len(index))
        decoded = min(node, parse_bytes(request, node))
        return _plan(index, keep, form, node - decoded, decoded, f"decoded_cache={decoded_cache!r}")
    if existing_budget(encoded_spec) is not None:
        return _plan(index, keep, form, _encoded_only(index, cache_bytes, 0), 0, "the node's cache has no decoded tier")
    rates = measure()
    n = len(index)
    whole = n * rates.decoded_bytes * WHOLE_MARGIN
    cap = int(max(total, whole))
    node = resolve_budget(cache_bytes, cap, directory, num_items=2 * len(index))
    model = TierRates(
        n,
        total / n,
        rates.decoded_bytes,
        rates.storage,
        math.inf,
        rates.encoded,
        rates.decoded,
        rates.decoded_only,
    )
    decoded = best_tier_split(model, node)
    if decoded >= int(n * rates.decoded_bytes):  # the sweep's points are whole bytes
        # The decoded dataset, as measured on a few samples: with a margin, so that it really
        # holds every image and each epoch runs the pipeline of decoded images alone.
        decoded = int(min(node, whole))
    if decoded < MIN_DECODED:
        decoded = 0
    predicted = {0: tier_throughput(model, node, 0), decoded: tier_throughput(model, node, decoded)}
    why = (
        f"auto: prep {rates.encoded:.0f} samples/s from encoded bytes, {rates.decoded_only:.0f} from decoded "
        f"images ({rates.decoded:.0f} in mixed batches; {rates.decoded_bytes / 1e3:.0f} KB each), storage "
        f"{rates.storage / 1e6:.0f} MB/s: "
        f"{format_bytes(decoded)} of {format_bytes(node)} decoded, predicted {predicted[decoded]:.0f} samples/s "
        f"(encoded only: {predicted[0]:.0f})"
    )
    plan = _plan(index, keep, form, node - decoded, decoded, why)
    plan.rates = rates.as_dict()
    plan.predicted = predicted
    return plan


def _encoded_only(index: Index, cache_bytes, decoded: int) -> int:
    budget = resolve_budget(cache_bytes, index.total_bytes, names.shm_dir(), num_items=len(index))
    if decoded and not (isinstance(cache_bytes, str) and cache_bytes.strip().lower() == "auto"):
        budget = max(0, budget - decoded)  # the decoded tier's share comes out of cache_bytes
    return budget


def _plan(index: Index, keep: bool, form: dict, encoded: int, decoded: int, why: str) -> TierPlan:
    log.info("coordl: cache tiers: %s encoded, %s decoded (%s)", format_bytes(encoded), format_bytes(decoded), why)
    return TierPlan(
        CacheSpec.for_dataset(index, encoded, keep=keep) if encoded > 0 else None,
        encoded,
        CacheSpec.for_dataset(index, decoded, keep=keep, tier="decoded", **form) if decoded > 0 else None,
        decoded,
        why,
    )
