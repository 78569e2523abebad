"""Measures, on a few of the dataset's samples, what the split of the node's cache between encoded
bytes and decoded images depends on: prep from encoded bytes, prep from decoded images, the size
of a decoded image, and the storage's read rate.

It runs the job's own recipe in the same tiered DALI pipeline the loader uses, with the job's
thread count, so the rates are the ones the loader will see (about a second of work).
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import time
from dataclasses import asdict, dataclass

import numpy as np

from coordl.fetch import storage
from coordl.fetch.ahead import DECODE_KEEP, DECODED, ENCODED, RawBatch
from coordl.index import Index

__all__ = ["PrepRates", "measure"]

log = logging.getLogger(__name__)

MIN_SECONDS = 0.3  # of timed work per kind of prep


@dataclass(frozen=True)
class PrepRates:
    """Rates measured on ``samples`` samples (see :func:`measure`)."""

    encoded: float  # samples/s: decode and augment
    decoded: float  # samples/s: augment only
    encoded_bytes: float  # mean bytes of a sample's file
    decoded_bytes: float  # mean bytes of a decoded image
    storage: float  # bytes/s read from storage
    threads: int
    samples: int

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


def measure(recipe, index: Index, *, num_threads: int, seed: int, samples: int = 48, io_threads: int = 8) -> PrepRates:
    """Reads ``samples`` random samples (not cached, not counted in any epoch), then times the
    recipe on them from encoded bytes and from their decoded images.

    Raises:
        SampleError: a chosen sample cannot be read or decoded.
    """
    from coordl.prep.dali import DaliPrep

    rng = np.random.default_rng(seed)
    ids = np.sort(rng.choice(len(index), size=min(samples, len(index)), replace=False)).astype(np.int64)
    data, storage_rate = _read(index, ids, io_threads)
    batch = min(16, len(ids))
    prep = DaliPrep(recipe, batch_size=batch, num_threads=num_threads, device_id=None, seed=seed, tiered=True)
    try:
        labels = index.labels[ids]
        collect = _Collect()
        raw = _batches(ids, data, labels, DECODE_KEEP, batch)
        _run(prep, raw, index, collect)  # decodes them whole once, and builds the pipeline
        images = [collect.images[i] for i in ids.tolist()]
        encoded = _rate(prep, _batches(ids, data, labels, ENCODED, batch), index)
        decoded = _rate(prep, _batches(ids, images, labels, DECODED, batch), index)
    finally:
        prep.close()
    rates = PrepRates(
        encoded=encoded,
        decoded=decoded,
        encoded_bytes=float(np.mean([len(x) for x in data])),
        decoded_bytes=float(np.mean([x.nbytes for x in images])),
        storage=storage_rate,
        threads=num_threads,
        samples=len(ids),
    )
    log.info(
        "coordl: measured on %d samples with %d threads: prep %.0f samples/s from encoded bytes, %.0f from "
        "decoded images (%.1fx the bytes); storage %.1f MB/s",
        len(ids),
        num_threads,
        encoded,
        decoded,
        rates.decoded_bytes / max(rates.encoded_bytes, 1.0),
        storage_rate / 1e6,
    )
    return rates


def _read(index: Index, ids: np.ndarray, threads: int) -> tuple[list[np.ndarray], float]:
    sizes = index.sizes[ids]
    data = [np.empty(int(s), dtype=np.uint8) for s in sizes]
    paths = index.paths.encoded(ids)
    parts = np.array_split(np.arange(len(ids)), max(1, min(threads, len(ids))))

    def read(part):
        return storage.read_many(
            [paths[k] for k in part], sizes[part].tolist(), [[data[k]] for k in part], drop_page_cache=False
        )

    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(len(parts)) as pool:
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
        out.append(RawBatch(ids[a : a + size], list(data[a : a + size]), labels[a : a + size], 0, k))
    return out


def _run(prep, batches: list[RawBatch], index: Index, keep=None) -> int:
    n = 0
    for _, labels, _ in prep.epoch(iter(batches), index.paths.__getitem__, 0, keep):
        n += len(labels)
    return n


def _rate(prep, batches: list[RawBatch], index: Index) -> float:
    """Samples/s over repeated runs of ``batches`` (the first run warms up and is not timed)."""
    _run(prep, batches, index)
    done, t0 = 0, time.perf_counter()
    while True:
        done += _run(prep, batches, index)
        elapsed = time.perf_counter() - t0
        if elapsed >= MIN_SECONDS:
            return done / elapsed
