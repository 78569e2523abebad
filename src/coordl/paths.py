"""Many paths as one UTF-8 buffer and an offset table: a read-only sequence of ``str`` that
holds no Python object per path.

A tuple of a million ``str`` is ~170 MB of Python objects, and a process that reads them
writes their reference counts, so a forked ``DataLoader`` worker copies every page of them it
touches (pytorch/pytorch#13246). A :class:`PathTable` keeps two numpy buffers instead, in the
heap or mapped from a saved index, which neither reading nor forking writes; path ``i`` is
decoded when asked for.

Layout: ``blob`` is the paths' bytes (UTF-8, ``surrogateescape`` so that any file name
round-trips), joined by single NUL bytes, with none after the last, which is what the
index's fingerprint hashes. ``offsets`` (int64, one more than the paths) holds where each
path starts; path ``i`` is ``blob[offsets[i] : offsets[i + 1] - 1]``, so ``offsets[-1]`` is
``len(blob) + 1`` (or 0 when there are no paths). A path cannot hold a NUL byte.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Iterator, Sequence

import numpy as np

__all__ = ["PathTable"]

ENCODING = ("utf-8", "surrogateescape")  # os.fsencode's on Linux: every file name round-trips
_CHUNK = 4096  # offsets turned into Python ints at a time while iterating


class PathTable(Sequence):
    """The paths of an index: ``len``, ``[i]`` (a ``str``, decoded on each access), iteration,
    ``in``, ``.index()``, ``==`` (with another table or a list or tuple of ``str``); a slice is a
    ``list`` of ``str``.

    Attributes:
        blob: the paths' bytes joined by NUL (uint8, read-only when mapped from a file).
        offsets: where each path starts in ``blob``, and ``len(blob) + 1`` (int64).
    """

    __slots__ = ("_view", "blob", "offsets")

    def __init__(self, blob: np.ndarray, offsets: np.ndarray):
        # The caller vouches for the layout (from_strings makes it, a saved index's header is checked).
        self.blob = blob
        self.offsets = offsets
        self._view = memoryview(blob).cast("B")

    @classmethod
    def from_strings(cls, paths: Sequence[str]) -> PathTable:
        """A table of ``paths``, in order.

        Raises:
            ValueError: a path contains a NUL character.
        """
        paths = paths if isinstance(paths, (list, tuple)) else list(paths)
        joined = "\0".join(paths).encode(*ENCODING)
        blob = np.frombuffer(joined, dtype=np.uint8)
        ends = np.flatnonzero(blob == 0)
        if len(ends) != max(len(paths) - 1, 0):
            bad = next(p for p in paths if "\0" in p)
            raise ValueError(f"path {bad!r} contains a NUL character; a file path cannot")
        offsets = np.empty(len(paths) + 1, dtype=np.int64)
        offsets[0] = 0
        if paths:
            offsets[1:-1] = ends + 1
            offsets[-1] = len(blob) + 1
        return cls(blob, offsets)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        n = len(self.offsets) - 1
        j = operator.index(i)
        if j < 0:
            j += n
        if not 0 <= j < n:
            raise IndexError(f"path {i} is out of range for an index of {n} samples")
        off = self.offsets
        return str(self._view[off.item(j) : off.item(j + 1) - 1], *ENCODING)

    def encoded(self, ids: np.ndarray) -> list[bytes]:
        """The paths of ``ids`` as file-system bytes (``os.fsencode``'s), for ``os.open``: no decoding."""
        view = self._view
        starts = self.offsets[ids]
        ends = self.offsets[np.asarray(ids) + 1] - 1
        return [bytes(view[a:b]) for a, b in zip(starts.tolist(), ends.tolist())]

    def __iter__(self) -> Iterator[str]:
        view, off = self._view, self.offsets
        for start in range(0, len(off) - 1, _CHUNK):
            bounds = off[start : start + _CHUNK + 1].tolist()  # a few thousand ints at a time, not n
            for a, b in itertools.pairwise(bounds):
                yield str(view[a : b - 1], *ENCODING)

    def __eq__(self, other) -> bool:
        if isinstance(other, PathTable):
            return np.array_equal(self.offsets, other.offsets) and np.array_equal(self.blob, other.blob)
        if isinstance(other, (list, tuple)):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    __hash__ = None  # equal to a list, which has no hash

    def __reduce__(self):
        # Pickled (a spawned worker) as copies of the two arrays: still no str per path.
        return PathTable, (np.asarray(self.blob), np.asarray(self.offsets))

    def __repr__(self) -> str:
        return f"PathTable({len(self)} paths, {len(self.blob)} bytes)"
