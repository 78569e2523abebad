"""How many entries of a global batch a split moves between nodes: the measure locality-aware plans are held to.

:func:`coordl.placement.plan` splits a global batch so that ranks take what their own node caches; ``tests/
test_placement.py`` checks that its split moves the least any equal split can, and ``benchmarks/multinode.py``
compares it with plain sharding and with the peer reads the loader counted. The loader itself never needs the
number, so it is here, beside the tests, and not in the package.
"""

from __future__ import annotations

import numpy as np

__all__ = ["traffic"]


def traffic(batch: np.ndarray, holder: np.ndarray, rank_nodes: np.ndarray, parts: list[np.ndarray]) -> int:
    """How many entries of the split ``parts`` of ``batch`` a rank receives from another node's cache.

    An entry counts when it is cached (``holder >= 0``, as :func:`coordl.placement.holders` gives) on a node other
    than that of the rank it goes to; uncached entries come from storage and do not count.

    Raises:
        ValueError: ``parts`` is not one array per rank, or not a split of ``batch``.
    """
    rank_nodes = np.asarray(rank_nodes, dtype=np.int64)
    if len(parts) != len(rank_nodes):
        raise ValueError(f"parts must hold one array per rank ({len(rank_nodes)}), got {len(parts)}")
    got = np.concatenate([np.asarray(p, dtype=np.int64) for p in parts])
    if not np.array_equal(np.sort(got), np.sort(np.asarray(batch, dtype=np.int64))):
        raise ValueError("parts must be a split of batch: together, a permutation of its entries")
    src = np.asarray(holder)[got]
    dest = np.repeat(rank_nodes, [len(p) for p in parts])
    return int(np.count_nonzero((src >= 0) & (src != dest)))
