"""The decoded tier: decoded images in shared memory beside the encoded tier, shared by every job
of the node, under the MinIO cache's guarantees.

It is a :class:`~coordl.fetch.cache.NodeCache` of its own (its own group of segments, its own
budget taken out of ``Cache(size)``) whose items are RGB ``uint8`` images, ``(H, W, 3)``, the
decoder's output at the file's resolution, or (a tier of audio clips, ``item="waveform"``) float32
waveforms, ``(samples,)``, each clip downmixed and resampled at the recipe's rate. An image's
size is known only once it is decoded, so an entry is first *claimed* (``EMPTY -> WRITING``, no
bytes yet) by the process that will decode it, and given bytes when it is filled; every other
process sees a miss until it is published, and then the same immutable pixels. A claim left by a
killed process is reclaimed like a half-written item: by the next process that attaches alone.
"""

from __future__ import annotations

import logging
import os
import threading

import numpy as np

from coordl.fetch.cache import EMPTY, NO_OFFSET, WRITING, NodeCache

__all__ = ["DECODED_ENTRY", "DecodedTier"]

log = logging.getLogger(__name__)

DECODED_ENTRY = np.dtype([("offset", "<u8"), ("length", "<u4"), ("state", "<u4"), ("height", "<u4"), ("width", "<u4")])
CHANNELS = 3
#: What a tier's items are: their dtype and channels (an image is ``(height, width, 3)`` uint8; a
#: waveform ``(height,)`` float32, its width 1).
ITEMS = {"image": (np.dtype(np.uint8), CHANNELS), "waveform": (np.dtype(np.float32), 1)}


class DecodedTier(NodeCache):
    """A node-wide tier of one dataset's decoded images.

    Args:
        fingerprint: names its segments (not the encoded tier's).
        num_items: samples in the dataset.
        budget: bytes it may hold (used by the process that creates it).
        min_size: the smallest image there can be, in bytes (the tier is full once less is left).
        **kwargs: as :class:`~coordl.fetch.cache.NodeCache` (``keep``, ``directory``, ``dataset``).
    """

    MAGIC = b"COORDLD1"
    ENTRY_DTYPE = DECODED_ENTRY

    def __init__(
        self, fingerprint: str, num_items: int, budget: int, *, min_size: int = 1, item: str = "image", **kwargs
    ):
        self.item = item
        self._dtype, self._channels = ITEMS[item]
        self._claims: set[int] = set()  # ids this attachment claimed and has not filled or given up
        self._claims_lock = threading.Lock()
        super().__init__(fingerprint, np.zeros(num_items, dtype=np.uint64), budget, min_size=min_size, **kwargs)

    @property
    def full(self) -> bool:
        """Whether the tier takes no more images (its budget or the room ran out)."""
        return bool(self._header["full"]) if self._header is not None else True

    def images(self, ids: np.ndarray) -> list[np.ndarray]:
        """Read-only ``(H, W, 3)`` uint8 images (or ``(samples,)`` float32 waveforms) of ``ids``,
        which must all be published (:meth:`ready_mask`): views of shared memory (a copy for one
        spanning two chunks)."""
        ids = np.asarray(ids, dtype=np.int64)
        heights = self._entries["height"][ids].tolist()
        widths = self._entries["width"][ids].tolist()
        if self.item == "waveform":
            return [v.view(self._dtype) for v in self.views(ids)]
        return [v.reshape(h, w, CHANNELS) for v, h, w in zip(self.views(ids), heights, widths, strict=True)]

    def claim_many(self, ids: np.ndarray) -> np.ndarray:
        """Claims the distinct ``ids`` for this process to decode and fill: a mask of those it got.

        Only ``EMPTY`` entries are claimed; once the tier is full, only those that own bytes
        already (reclaimed after a crash) are. Each claim ends in :meth:`fill_many` or
        :meth:`abort_claims` (or :meth:`release_claims`).
        """
        ids = np.asarray(ids, dtype=np.int64)
        got = np.zeros(len(ids), dtype=bool)
        candidates = np.flatnonzero(self._state[ids] == EMPTY)
        if self._header["full"]:
            candidates = candidates[self._offset[ids[candidates]] != NO_OFFSET]
        if not len(candidates):
            return got
        with self._locked():
            candidates = candidates[self._state[ids[candidates]] == EMPTY]
            self._state[ids[candidates]] = WRITING
        got[candidates] = True
        with self._claims_lock:
            self._claims.update(ids[candidates].tolist())
        return got

    def fill_many(self, ids: np.ndarray, images: list[np.ndarray]) -> np.ndarray:
        """Publishes the decoded ``images`` of ``ids``, which this process claimed, as far as the
        budget and the room allow; the others are given up. Returns a mask of those published."""
        ids = np.asarray(ids, dtype=np.int64)
        mine = self._take_claims(ids)
        ids, images = ids[mine], [im for im, m in zip(images, mine.tolist(), strict=True) if m]
        done = np.zeros(len(mine), dtype=bool)
        if not len(ids):
            return done
        wave = self.item == "waveform"
        shapes = np.array([(im.shape[0], 1) if wave else im.shape[:2] for im in images], dtype=np.int64).reshape(-1, 2)
        lengths = shapes[:, 0] * shapes[:, 1] * self._channels * self._dtype.itemsize
        ok = np.array([self._fits(im) for im in images], dtype=bool)
        with self._locked():
            owns = self._offset[ids] != NO_OFFSET
            e = self._entries
            same = (
                (e["length"][ids] == lengths) & (e["height"][ids] == shapes[:, 0]) & (e["width"][ids] == shapes[:, 1])
            )
            changed = owns & ~same & ok
            for i in ids[changed].tolist():
                log.warning("coordl: sample %d decodes to another size than before; the file changed", i)
            ok &= ~changed
            new = np.flatnonzero(ok & ~owns)
            e["length"][ids[new]] = lengths[new]
            e["height"][ids[new]] = shapes[new, 0]
            e["width"][ids[new]] = shapes[new, 1]
            granted = np.flatnonzero(ok & owns)
            if len(new) and not self._header["full"]:
                fit = new[self._allocate_many(ids[new], np.arange(len(new)))]
                granted = np.concatenate([granted, fit])
                if len(fit) < len(new):
                    # Full: what is not in this tier by now goes to the encoded tier, and is not
                    # decoded in vain, epoch after epoch, for want of room here.
                    self._header["full"] = 1
            unused = np.setdiff1d(np.arange(len(ids)), granted)
            e["length"][ids[np.intersect1d(unused, new)]] = 0  # no bytes: no size either
            self._state[ids[unused]] = EMPTY
            offsets = self._offset[ids[granted]].tolist()
        for k, offset in zip(granted.tolist(), offsets, strict=True):
            pos = 0
            flat = np.ascontiguousarray(images[k]).reshape(-1).view(np.uint8)
            for part in self._data.writable(offset, int(lengths[k])):
                part[:] = flat[pos : pos + len(part)]
                pos += len(part)
        self.publish_many(np.sort(ids[granted]))
        done[np.flatnonzero(mine)[granted]] = True
        return done

    def _fits(self, item: np.ndarray) -> bool:
        """Whether ``item`` is one of this tier's: an ``(H, W, 3)`` uint8 image, or a 1-D float32 waveform."""
        if item.dtype != self._dtype:
            return False
        return item.ndim == 1 if self.item == "waveform" else item.ndim == 3 and item.shape[2] == CHANNELS

    def abort_claims(self, ids: np.ndarray) -> None:
        """Gives up this process's claims among ``ids`` (bytes they own stay theirs)."""
        ids = np.asarray(ids, dtype=np.int64)
        mine = ids[self._take_claims(ids)]
        if len(mine):
            self.abort_many(mine)

    def release_claims(self) -> None:
        """Gives up every claim this process still holds."""
        with self._claims_lock:
            ids, self._claims = np.array(sorted(self._claims), dtype=np.int64), set()
        if len(ids) and self._header is not None:
            self.abort_many(ids)

    def _take_claims(self, ids: np.ndarray) -> np.ndarray:
        with self._claims_lock:
            mine = np.array([i in self._claims for i in ids.tolist()], dtype=bool)
            self._claims.difference_update(ids[mine].tolist())
        return mine

    def close(self) -> None:
        if self._header is not None and self._table_fd is not None and os.getpid() == self._pid:
            self.release_claims()
        super().close()
