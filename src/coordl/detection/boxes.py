"""Every sample's boxes and their labels, as flat arrays: a detection index's targets.

No Python object per sample or per box: sample ``i``'s boxes are rows ``offsets[i]`` to
``offsets[i + 1]`` of ``xyxy`` (float32, ``x1, y1, x2, y2`` in pixels of the image as stored,
``x2 > x1``, ``y2 > y1``, inside the image) and ``labels`` (int64, the dataset's category ids).
Each sample also has its image's size as the annotations give it (``width, height``) and its
image id. A saved index maps these arrays from its file (:mod:`coordl.indexfile`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

__all__ = ["Boxes"]


@dataclass(frozen=True, eq=False)
class Boxes:
    """The boxes of every sample of an index.

    Attributes:
        offsets: int64 ``(samples + 1,)``: sample ``i``'s boxes are rows ``offsets[i]:offsets[i + 1]``.
        xyxy: float32 ``(boxes, 4)``: ``x1, y1, x2, y2`` in pixels of the stored image.
        labels: int64 ``(boxes,)``: each box's category id, as the annotations give it.
        image_sizes: int64 ``(samples, 2)``: each image's ``width, height`` as the annotations give it.
        image_ids: int64 ``(samples,)``: each image's id in the annotations.
        categories: category id -> name.
        skipped: what indexing left out with ``on_error="skip"``: ``{"images": n, "boxes": n,
            "annotations": n}`` (missing images, boxes of no area or outside their image,
            annotations of an unknown image or category).
    """

    offsets: np.ndarray
    xyxy: np.ndarray
    labels: np.ndarray
    image_sizes: np.ndarray
    image_ids: np.ndarray
    categories: dict = field(default_factory=dict)
    skipped: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.image_ids)

    @property
    def counts(self) -> np.ndarray:
        """How many boxes each sample has (int64)."""
        return np.diff(self.offsets)

    def of(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """Sample ``i``'s boxes and labels (views)."""
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        return self.xyxy[a:b], self.labels[a:b]

    def gather(self, ids) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The boxes of samples ``ids``, one after the other: ``(xyxy, labels, counts)``."""
        ids = np.asarray(ids, dtype=np.int64)
        starts, counts = self.offsets[ids], self.offsets[ids + 1] - self.offsets[ids]
        rows = _ranges(starts, counts)
        return self.xyxy[rows], self.labels[rows], counts

    def subset(self, keep: np.ndarray) -> Boxes:
        """The boxes of samples ``keep`` (positions, in order), as a table of their own."""
        xyxy, labels, counts = self.gather(keep)
        return Boxes(
            np.concatenate([[0], np.cumsum(counts)]).astype(np.int64),
            xyxy,
            labels,
            self.image_sizes[keep],
            self.image_ids[keep],
            dict(self.categories),
            dict(self.skipped),
        )

    def hash_into(self, h) -> None:
        """Feeds the table to a hash (the index's fingerprint): every array, little-endian."""
        for a, dtype in (
            (self.offsets, "<i8"),
            (self.xyxy, "<f4"),
            (self.labels, "<i8"),
            (self.image_sizes, "<i8"),
            (self.image_ids, "<i8"),
        ):
            h.update(np.ascontiguousarray(a, dtype=dtype))

    @classmethod
    def from_lists(
        cls,
        boxes: Sequence[np.ndarray],
        labels: Sequence[np.ndarray],
        image_sizes,
        image_ids,
        categories: dict | None = None,
        skipped: dict | None = None,
    ) -> Boxes:
        """A table from per-sample arrays (``(n, 4)`` boxes and ``(n,)`` labels each)."""
        counts = np.array([len(b) for b in boxes], dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        xyxy = np.concatenate([np.asarray(b, np.float32).reshape(-1, 4) for b in boxes]) if len(boxes) else None
        labs = np.concatenate([np.asarray(x, np.int64).reshape(-1) for x in labels]) if len(labels) else None
        return cls(
            offsets,
            xyxy if xyxy is not None else np.zeros((0, 4), np.float32),
            labs if labs is not None else np.zeros(0, np.int64),
            np.asarray(image_sizes, dtype=np.int64).reshape(-1, 2),
            np.asarray(image_ids, dtype=np.int64).reshape(-1),
            dict(categories or {}),
            dict(skipped or {}),
        )


def _ranges(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """The concatenation of ``arange(s, s + c)`` for each start and count, without a loop."""
    total = int(counts.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    ends = np.cumsum(counts)
    # Each row's position within its sample, plus that sample's start.
    within = np.arange(total, dtype=np.int64) - np.repeat(ends - counts, counts)
    return np.repeat(starts, counts) + within
