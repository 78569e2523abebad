"""Pure: coordl's random numbers, as functions of their key: the epoch order's keys, the random
numbers of a sample's augmentation, and the seeds of generators coordl seeds.

Every random decision of pre-processing (a crop window, a flip, a transform's draws from
torch's RNG) comes from here, keyed by the loader's seed, the epoch whose order is being
delivered and the sample's position in the index. Nothing else enters: not the rank, the world
size, the batch a sample lands in, where a resume started, or which member of an HP group
decoded it. So a sample gets the same augmentation in a given epoch wherever and whenever it is
delivered, and different augmentation in every epoch.

The numbers are SplitMix64 steps over the key (:func:`mix` for one value, :func:`_keys` for a
whole batch at once with numpy), each kind of number in a domain of its own. They do not depend
on numpy's generators, whose streams numpy does not promise to keep between versions, so they
are the same with every numpy and on every machine.
"""

from __future__ import annotations

import numpy as np

__all__ = ["mix", "order_keys", "sample_seeds", "uniforms"]

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_MASK = 2**64 - 1


def _step(x: np.ndarray, v) -> np.ndarray:
    """One SplitMix64 step of ``x`` absorbing ``v`` (uint64 arrays or scalars)."""
    with np.errstate(over="ignore"):
        x = (x ^ v) + _GOLDEN
        x = (x ^ (x >> np.uint64(30))) * _M1
        x = (x ^ (x >> np.uint64(27))) * _M2
        return x ^ (x >> np.uint64(31))


#: The domains of the numbers: the same key in two domains gives unrelated numbers.
AUGMENT = 0x636F6F72646C  # "coordl": a sample's augmentation
ORDER = 0x6F72646572  # "order": the epoch order


def mix(*values: int) -> int:
    """A 64-bit number from ``values`` (ints; negative ones as two's complement): one SplitMix64
    step per value, starting from 0. The seeds coordl gives generators come from here."""
    x = np.uint64(0)
    for v in values:
        x = _step(x, np.uint64(v & _MASK))
    return int(x)


def _keys(seed: int, epoch: int, ids, domain: int = AUGMENT) -> np.ndarray:
    x = _step(np.uint64(seed & _MASK), np.uint64(domain))
    x = _step(x, np.uint64(epoch & _MASK))
    return _step(np.full(len(ids), x, dtype=np.uint64), np.asarray(ids, dtype=np.int64).astype(np.uint64))


def order_keys(seed: int, epoch: int, n: int) -> np.ndarray:
    """The sort key of each of the ``n`` samples in ``epoch``'s order (uint64; see
    :func:`coordl.sampler.epoch_order`)."""
    return _keys(seed, epoch, np.arange(n, dtype=np.int64), ORDER)


def sample_seeds(seed: int, epoch: int, ids) -> np.ndarray:
    """A 63-bit seed per sample: uint64 array (as ``torch.manual_seed`` takes), one per id."""
    return _keys(seed, epoch, ids) >> np.uint64(1)


def uniforms(seed: int, epoch: int, ids, count: int) -> np.ndarray:
    """``count`` uniform numbers in ``[0, 1)`` per sample: float32 array ``(len(ids), count)``.

    Column ``k`` of sample ``i`` is the ``k``-th draw of ``(seed, epoch, i)``; each is a multiple
    of ``2**-24``, exact in float32.
    """
    keys = _keys(seed, epoch, ids)
    streams = np.arange(count, dtype=np.uint64)
    bits = _step(keys[:, None], streams[None, :]) >> np.uint64(40)
    return (bits.astype(np.float32) * np.float32(2.0**-24)).astype(np.float32)
