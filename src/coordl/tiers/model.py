"""Pure: the model of a node's cache split between encoded bytes and decoded images.

From measured rates (prep from encoded bytes and from decoded images, a decoded image's bytes,
storage and cache read rates), :func:`tier_throughput` predicts a job's samples/s for a split
and :func:`best_tier_split` picks one. The loader's ``Cache(decoded="auto")`` plans with it
(:mod:`coordl.tiers.plan`); DS-Analyzer's what-if for the decoded tier uses it too.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["TierRates", "best_tier_split", "tier_sweep", "tier_throughput"]


@dataclass(frozen=True)
class TierRates:
    """What the split of a node's cache between encoded bytes and decoded images depends on.

    Prep rates are one rank's (its DALI threads); bytes are means per sample.
    """

    samples: int  # in the dataset
    encoded_bytes: float
    decoded_bytes: float
    storage: float  # bytes/s read from storage
    cache: float  # bytes/s read from the encoded tier
    prep_encoded: float  # samples/s from encoded bytes: decode and augment
    prep_decoded: float  # samples/s from decoded images: augment only (in batches that mix both)
    prep_decoded_only: float = 0.0  # samples/s when the tier holds every sample (0: as prep_decoded)


def tier_throughput(r: TierRates, budget: float, decoded: float, prep=None) -> float:
    """Predicted samples/s in epochs after the first, with ``decoded`` of the node's ``budget``
    bytes holding decoded images and the rest encoded bytes.

    The decoded tier holds a fraction ``xd`` of the samples, the encoded tier ``xe`` of the
    others, storage serves the rest::

        xd = min(1, decoded / (n * d))      xe = min(1 - xd, (budget - decoded) / (n * b))
        F  = 1 / (b * xe / C + b * (1 - xd - xe) / S)                       (fetch)
        P  = 1 / (xd / P_decoded + (1 - xd) / P_encoded)     for xd < 1      (prep)

    When the tier holds every sample, prep runs a pipeline of decoded images alone, without the
    per-sample conditionals of batches that mix both: ``P_decoded_only``. The job runs at
    ``min(F, prep(P))``, where ``prep`` maps the loader's prep rate to the job's (DS-Analyzer's
    ``R`` for a measured training step; the loader alone by default). A decoded image costs no
    fetch: it is a view of shared memory, read by the augmentation.
    """
    n, b, d = r.samples, r.encoded_bytes, r.decoded_bytes
    decoded = min(max(decoded, 0.0), budget)
    xd = min(1.0, decoded / (n * d)) if n * d > 0 else 0.0
    xe = min(1.0 - xd, (budget - decoded) / (n * b)) if n * b > 0 else 0.0
    t_fetch = b * xe / r.cache + b * max(0.0, 1.0 - xd - xe) / r.storage
    if xd >= 1.0:
        t_prep = 1.0 / (r.prep_decoded_only or r.prep_decoded)
    else:
        t_prep = xd / r.prep_decoded + (1.0 - xd) / r.prep_encoded
    rate = 1.0 / t_prep if prep is None else prep(1.0 / t_prep)
    return rate if t_fetch <= 0 else min(1.0 / t_fetch, rate)


def tier_sweep(r: TierRates, budget: float, points: int = 101, prep=None) -> list[dict]:
    """Predicted samples/s at evenly spaced decoded shares of ``budget`` (up to the decoded dataset)."""
    top = min(budget, r.samples * r.decoded_bytes)
    out = []
    for k in range(points):
        y = top * k / (points - 1)
        out.append(
            {
                "decoded_bytes": int(y),
                "encoded_bytes": int(budget - y),
                "predicted_samples_per_s": tier_throughput(r, budget, y, prep),
            }
        )
    return out


def best_tier_split(r: TierRates, budget: float, tolerance: float = 0.001, prep=None) -> int:
    """The decoded share of ``budget`` the model prefers: the smallest within ``tolerance`` of the
    best predicted throughput, so that memory goes to decoded images only where they speed the
    job up (an I/O-bound job keeps encoded bytes, which keep its storage reads at the minimum)."""
    sweep = tier_sweep(r, budget, 201, prep)
    best = max(p["predicted_samples_per_s"] for p in sweep)
    return next(p["decoded_bytes"] for p in sweep if p["predicted_samples_per_s"] >= (1.0 - tolerance) * best)
