"""Plans a loader's node-wide cache: how much of :attr:`Cache.size <coordl.Cache.size>` holds
encoded bytes and how much decoded images (:attr:`Cache.decoded <coordl.Cache.decoded>`).

The first job on a node decides the split (from what it asks for, or from rates it measures
with ``"auto"``); jobs that come later attach to the tiers that exist. Planning takes values
(the index, the options, why a tier is refused, a function that measures rates), never a loader.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from coordl.fetch.budget import resolve_budget
from coordl.fetch.cache import HEADER, MAGIC
from coordl.fetch.decoded import DecodedTier
from coordl.fetch.spec import CacheSpec, warn_off
from coordl.index import Index
from coordl.options import AUTO, Cache
from coordl.shm import names, own
from coordl.tiers.model import TierRates, best_tier_split, tier_throughput
from coordl.units import format_bytes

__all__ = ["TierPlan", "plan", "refusal"]

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
    why: str = ""  # how the split was decided, for the log and ``loader.tier_plan``
    rates: dict | None = None  # what "auto" measured
    predicted: dict = field(default_factory=dict)  # samples/s the model expects, by decoded bytes
    threads: int | None = None  # DALI threads "auto" chose (Lobster's rule), when it was asked to

    def open(self, sizes: np.ndarray) -> tuple:
        """Attaches to the node's encoded and decoded tiers (each None when it has no budget),
        making them if this is their first job.

        A tier another user took one of the names of (:class:`~coordl.shm.own.ForeignFileError`)
        is off for this run: None, its spec and budget cleared (so that no worker attaches to it),
        and one warning names the files."""
        opened: dict[str, object] = {}
        found, off = [], []
        try:
            for tier in ("encoded", "decoded"):
                spec = getattr(self, tier)
                try:
                    opened[tier] = spec.open(sizes) if spec is not None else None
                except own.ForeignFileError as e:
                    found += e.found
                    off.append("node cache" if tier == "encoded" else "decoded tier")
                    opened[tier] = None
                    setattr(self, tier, None)
                    setattr(self, f"{tier}_budget", 0)
        except BaseException:
            for cache in opened.values():
                if cache is not None:
                    cache.close()
            raise
        if found:
            warn_off("the " + " and its ".join(off) + (" are" if len(off) > 1 else " is"), found)
        return opened["encoded"], opened["decoded"]

    def as_dict(self) -> dict:
        return {
            "encoded_budget": self.encoded_budget,
            "decoded_budget": self.decoded_budget,
            "why": self.why,
            "rates": self.rates,
            "predicted": self.predicted,
            "threads": self.threads,
        }


def refusal(backend: str, device_id, recipe, multinode: bool) -> str | None:
    """Why a loader cannot use a decoded tier (None: it can)."""
    if backend != "dali":
        return "the torch backend decodes in its dataset's transform; the decoded tier serves DALI recipes"
    if device_id is not None:
        return (
            "the decoded tier holds the CPU decoder's images, and the GPU decoder's differ from them; "
            "on a GPU, decoding is nvJPEG's (see docs/decoded-tier.md)"
        )
    if not recipe.takes_decoded:
        return (
            "the recipe is a function of the encoded bytes; wrap a function of the decoded images in "
            "coordl.DecodedRecipe to use the decoded tier"
        )
    if multinode:
        return "with several nodes, the partitioned cache shares encoded bytes between them"
    return None


def existing_budget(spec: CacheSpec) -> int | None:
    """The budget of the tier ``spec`` names if it is on this node already, else None."""
    path = os.path.join(spec.directory, names.segment_name(spec.fingerprint, "table"))
    try:
        fd = own.open_own(path, write=False)
    except OSError:  # none, or another user's (a ForeignFileError): not read
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


def plan(
    index: Index,
    cache: Cache,
    *,
    why_not: str | None,
    measure: Callable[[], object],
    form: dict | None = None,
) -> TierPlan:
    """The node's tiers for a loader.

    Args:
        index: the dataset.
        cache: the loader's cache options: the node's budget (both tiers together), the decoded
            tier's share (``"auto"``, 0 or bytes) and ``keep``.
        why_not: why this loader cannot use a decoded tier (None: it can; see :func:`refusal`).
        measure: ``() -> PrepRates`` (:func:`coordl.prep.calibrate.measure` of the loader's recipe),
            called for ``"auto"`` when the node has no tiers yet. When its rates carry the thread
            counts it tried, the plan's :attr:`TierPlan.threads` is the one it chose.
        form: what the recipe's decoded items are (:meth:`coordl.prep.protocol.Recipe.decoded_form`: images
            capped at ``max_short_side``, or waveforms): each form is a decoded tier of its own.

    Raises:
        ValueError: a decoded tier was asked for (in bytes) where ``why_not`` refuses it.
    """
    form = dict(form or {})
    keep, size, request = cache.keep, cache.size, cache.decoded
    if isinstance(size, float):  # a fraction of the dataset's files
        size = int(size * index.total_bytes)
    if why_not is not None:
        if request not in (0, AUTO):
            raise ValueError(f"Cache(decoded={request!r}): {why_not}; pass Cache(decoded=0)")
        request = 0
    directory = names.shm_dir()
    encoded_spec = CacheSpec.for_dataset(index, 0, keep=keep)
    decoded_spec = CacheSpec.for_dataset(index, 0, keep=keep, tier="decoded", **form)
    have_decoded = existing_budget(decoded_spec) if request != 0 else None
    if have_decoded is not None:  # another job made it: attach to it
        budget = _encoded_only(index, size, have_decoded)
        return _plan(index, keep, form, budget, have_decoded, "attached to the node's decoded tier")
    if request == 0:
        return _plan(index, keep, form, _encoded_only(index, size, 0), 0, "Cache(decoded=0)")
    total = index.total_bytes
    if request != AUTO:
        node = resolve_budget(size, total + request, directory, num_items=2 * len(index))
        decoded = min(node, request)
        return _plan(index, keep, form, node - decoded, decoded, f"Cache(decoded={request!r})")
    if existing_budget(encoded_spec) is not None:
        return _plan(index, keep, form, _encoded_only(index, size, 0), 0, "the node's cache has no decoded tier")
    rates = measure()
    n = len(index)
    whole = n * rates.decoded_bytes * WHOLE_MARGIN
    cap = int(max(total, whole))
    node = resolve_budget(size, cap, directory, num_items=2 * len(index))
    model = TierRates(
        samples=n,
        encoded_bytes=total / n,
        decoded_bytes=rates.decoded_bytes,
        storage=rates.storage,
        cache=math.inf,
        prep_encoded=rates.encoded,
        prep_decoded=rates.decoded,
        prep_decoded_only=rates.decoded_only,
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
    out = _plan(index, keep, form, node - decoded, decoded, why)
    out.rates = rates.as_dict()
    out.predicted = predicted
    if rates.thread_rates:  # measured with several thread counts: it chose one
        out.threads = rates.threads
    return out


def _encoded_only(index: Index, size, decoded: int) -> int:
    budget = resolve_budget(size, index.total_bytes, names.shm_dir(), num_items=len(index))
    if decoded and size != AUTO:
        budget = max(0, budget - decoded)  # the decoded tier's share comes out of the cache's size
    return budget


def _plan(index: Index, keep: bool, form: dict, encoded: int, decoded: int, why: str) -> TierPlan:
    log.info("coordl: cache tiers: %s encoded, %s decoded (%s)", format_bytes(encoded), format_bytes(decoded), why)
    return TierPlan(
        encoded=CacheSpec.for_dataset(index, encoded, keep=keep) if encoded > 0 else None,
        encoded_budget=encoded,
        decoded=CacheSpec.for_dataset(index, decoded, keep=keep, tier="decoded", **form) if decoded > 0 else None,
        decoded_budget=decoded,
        why=why,
    )
