"""Measures, on a few of the dataset's samples, what the split of the node's cache between encoded
bytes and decoded images depends on: prep from encoded bytes, prep from decoded images, the size
of a decoded image, and the storage's read rate; and, when asked, how many DALI threads prep needs.

It runs the job's own recipe in the DALI pipelines the loader runs (encoded bytes alone, batches
that mix encoded bytes and decoded images, decoded images alone), fed without a break as the
loader feeds them (a pipeline started and drained every few batches runs at half its steady
rate), so the rates are the ones the loader will see. The three rates are taken in turn, in
:data:`ROUNDS` rounds, and each is the median of its rounds: the cores' load drifts by more than 10%
over a few seconds (other processes, the machine's own work), and rates taken one after the other
would each see a different load, which can order them wrongly.

The thread count is Lobster's rule (Liu et al., ATC'22): the fewest threads whose prep rate is
within :data:`THREADS_WITHIN` of the best measured; the cores left over are the storage's.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass

import numpy as np

from coordl.fetch import samples
from coordl.fetch.ahead import DECODE_KEEP, DECODED, ENCODED, RawBatch
from coordl.index import Index
from coordl.threads import daemon_pool

__all__ = ["PrepRates", "measure"]

log = logging.getLogger(__name__)

MIN_SECONDS = 0.4  # of timed work per round of a rate
ROUNDS = 3  # rounds per rate, taken in turn with the other rates; the rate is their median
THREAD_SECONDS = 1.0  # of timed work per thread count tried: a rate over 0.3 s varies by +-15% here
WARM_BATCHES = 2  # batches run before the clock starts (the pipeline's queue filling)
BATCH = 64  # samples per batch fed to the pipeline, by default
MAX_BATCH = 256
MIN_SAMPLES = 64
THREADS_WITHIN = 0.05  # Lobster: the fewest threads within 5% of the best prep rate


@dataclass(frozen=True)
class PrepRates:
    """Rates measured on ``samples`` samples (see :func:`measure`).

    A loader runs one of three pipelines for an epoch: encoded bytes alone (no decoded tier),
    batches that mix encoded bytes and decoded images (a tier that holds part of the epoch), or
    decoded images alone (a tier that holds all of it), which needs none of the per-sample
    conditionals of the mixed one.
    """

    encoded: float  # samples/s: decode and augment (the plain pipeline; the mixed one's encoded
    # branch runs as fast: 938 against 954 and 822 against 815 samples/s here, within the noise)
    decoded: float  # samples/s: augment only, in the mixed pipeline
    encoded_bytes: float  # mean bytes of a sample's file
    decoded_bytes: float  # mean bytes of a decoded image
    storage: float  # bytes/s read from storage
    threads: int  # DALI threads the rates were measured with
    samples: int
    thread_rates: dict[int, float] | None = None  # prep from encoded bytes by thread count, when chosen
    decoded_only: float = 0.0  # samples/s: the pipeline of decoded images alone (0: not measured)

    def as_dict(self) -> dict:
        return asdict(self)


class _Collect:
    """Takes the full decoded images a tiered pipeline hands back (the tier's place)."""

    def __init__(self):
        self.images: dict[int, np.ndarray] = {}

    def fill(self, ids, images) -> None:
        for i, image in zip(ids.tolist(), images):
            self.images[i] = np.array(image)

    def abort(self, ids) -> None:
        pass

    def release(self) -> None:
        pass


def measure(
    recipe,
    index: Index,
    *,
    num_threads: int,
    seed: int,
    batch_size: int = BATCH,
    samples: int | None = None,
    io_threads: int = 8,
    choose_threads: bool = False,
) -> PrepRates:
    """Reads ``samples`` random samples (not cached, not counted in any epoch), then times the
    recipe on them from encoded bytes and from their decoded images.

    Args:
        batch_size: the loader's (a pipeline's rate depends on it); at most :data:`MAX_BATCH`.
        samples: how many (default: two batches, at least :data:`MIN_SAMPLES`).
        num_threads: DALI's threads; with ``choose_threads``, the most to try.
        choose_threads: also time prep from encoded bytes with 1, 2, 4, ... ``num_threads``
            threads, and measure with the fewest within :data:`THREADS_WITHIN` of the best
            (:attr:`PrepRates.threads`).

    Raises:
        SampleError: a chosen sample cannot be read or decoded.
    """
    batch_size = max(1, min(batch_size, MAX_BATCH))
    if samples is None:
        samples = max(MIN_SAMPLES, 2 * batch_size)
    rng = np.random.default_rng(seed)
    ids = np.sort(rng.choice(len(index), size=min(samples, len(index)), replace=False)).astype(np.int64)
    data, storage_rate = _read(index, ids, io_threads)
    batch = min(batch_size, len(ids))
    labels = index.labels[ids]
    encoded_batches = _batches(ids, data, labels, ENCODED, batch)
    thread_rates = None
    if choose_threads and num_threads > 1:
        counts = sorted({min(1 << k, num_threads) for k in range(num_threads.bit_length() + 1)})
        thread_rates = {}
        for t in counts:
            prep = _prep(recipe, batch, t, seed, index.boxes, tiered=False)
            try:
                thread_rates[t] = _rate(prep, encoded_batches, index, seconds=THREAD_SECONDS)
            finally:
                prep.close()
        best = max(thread_rates.values())
        num_threads = min(t for t, r in thread_rates.items() if r >= (1.0 - THREADS_WITHIN) * best)
        log.info(
            "coordl: DALI threads: %d (prep from encoded bytes, samples/s by threads: %s)",
            num_threads,
            ", ".join(f"{t}: {r:.0f}" for t, r in thread_rates.items()),
        )
    plain = _prep(recipe, batch, num_threads, seed, index.boxes, tiered=False)
    prep = None
    try:
        prep = _prep(recipe, batch, num_threads, seed, index.boxes)
        collect = _Collect()
        _run(prep, _batches(ids, data, labels, DECODE_KEEP, batch), index, collect)  # each decoded whole once
        images = [collect.images[i] for i in ids.tolist()]
        decoded_batches = _batches(ids, images, labels, DECODED, batch)
        rounds = [
            (
                _rate(plain, encoded_batches, index),
                _rate(prep, decoded_batches, index),
                _rate(prep, decoded_batches, index, all_decoded=True),
            )
            for _ in range(ROUNDS)
        ]
        encoded, decoded, decoded_only = (float(x) for x in np.median(np.array(rounds), axis=0))
    finally:
        plain.close()
        if prep is not None:
            prep.close()
    rates = PrepRates(
        encoded=encoded,
        decoded=decoded,
        encoded_bytes=float(np.mean([len(x) for x in data])),
        decoded_bytes=float(np.mean([x.nbytes for x in images])),
        storage=storage_rate,
        threads=num_threads,
        samples=len(ids),
        thread_rates=thread_rates,
        decoded_only=decoded_only,
    )
    log.info(
        "coordl: measured on %d samples with %d threads: prep %.0f samples/s from encoded bytes, %.0f from "
        "decoded images (%.0f in a mixed batch; %.1fx the bytes); storage %.1f MB/s",
        len(ids),
        num_threads,
        encoded,
        decoded_only,
        decoded,
        rates.decoded_bytes / max(rates.encoded_bytes, 1.0),
        storage_rate / 1e6,
    )
    return rates


def _prep(recipe, batch: int, threads: int, seed: int, boxes, *, tiered: bool = True):
    from coordl.prep.dali import DaliPrep

    return DaliPrep(
        recipe,
        batch_size=batch,
        num_threads=threads,
        device_id=None,
        seed=seed,
        role="calibrate",
        tiered=tiered,
        boxes=boxes,
    )


def _read(index: Index, ids: np.ndarray, threads: int) -> tuple[list[np.ndarray], float]:
    sizes = index.sizes[ids]
    data = [np.empty(int(s), dtype=np.uint8) for s in sizes]
    parts = np.array_split(np.arange(len(ids)), max(1, min(threads, len(ids))))

    def read(part):
        return samples.read_many(index, ids[part], [[data[k]] for k in part], drop_page_cache=False)

    t0 = time.perf_counter()
    with daemon_pool(len(parts), "coordl-calibrate") as pool:
        for part, failed in zip(parts, pool.map(read, parts)):
            for k, e in failed.items():
                i = int(ids[part[k]])
                raise OSError(f"cannot read sample {i} ({index.paths[i]}) to measure prep: {e}") from e
    dt = time.perf_counter() - t0
    return data, float(sizes.sum()) / max(dt, 1e-9)


def _batches(ids, data, labels, kind: int, size: int) -> list[RawBatch]:
    out = []
    for a in range(0, len(ids), size):
        k = np.full(len(ids[a : a + size]), kind, dtype=np.int8)
        out.append(RawBatch(ids=ids[a : a + size], data=list(data[a : a + size]), labels=labels[a : a + size], kind=k))
    return out


def _run(prep, batches: list[RawBatch], index: Index, keep=None) -> int:
    n = 0
    for _, labels, _, _ in prep.epoch(iter(batches), index.paths.__getitem__, 0, keep):
        n += len(labels)
    return n


def _rate(
    prep, batches: list[RawBatch], index: Index, *, all_decoded: bool = False, seconds: float = MIN_SECONDS
) -> float:
    """Samples/s of ``prep`` fed ``batches`` over and over without a break for ``seconds``, once its
    queue is full."""

    def forever():
        while True:
            yield from batches

    done, t0, elapsed = 0, 0.0, 0.0
    outputs = prep.epoch(forever(), index.paths.__getitem__, 0, all_decoded=all_decoded)
    try:
        for k, (_, labels, _, _) in enumerate(outputs):
            if k < WARM_BATCHES:
                t0 = time.perf_counter()
                continue
            done += len(labels)
            elapsed = time.perf_counter() - t0
            if elapsed >= seconds:
                break
    finally:
        outputs.close()  # the pipeline, stopped mid-epoch, is rebuilt by the next run
    return done / elapsed
