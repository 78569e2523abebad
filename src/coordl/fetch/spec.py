"""How to attach to a node's cache (:class:`CacheSpec`): the loader, the torch backend's worker
processes and DS-Analyzer open caches the same way; and the reaping of what crashed jobs left.

A cache whose names another user took first (:class:`~coordl.shm.own.ForeignFileError`) is not
used: the run goes on without it, with one warning (:func:`warn_off`) naming those files."""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass

import numpy as np

from coordl.errors import warn
from coordl.fetch.cache import NodeCache
from coordl.fetch.decoded import DecodedTier
from coordl.index import Index
from coordl.shm import names, own, reaper

__all__ = ["CacheSpec", "reap_once", "warn_off"]

log = logging.getLogger(__name__)

_reaped: set[str] = set()


def reap_once(directory: str) -> None:
    """Reclaims, once per process and directory, what crashed jobs left in the shm directory."""
    if directory in _reaped:
        return
    _reaped.add(directory)
    try:
        for g in reaper.reap(directory):
            log.info("coordl: removed %d bytes of shared memory left by a dead job (%s)", g.bytes, g.fingerprint)
    except OSError as e:  # an unreadable directory is reported when the cache is opened
        log.debug("coordl: reaping %s failed: %s", directory, e)


def warn_off(what: str, found: list[own.Foreign]) -> None:
    """Warns that ``what`` (``"the node cache is"``, ...) is off for this run because of the files ``found``."""
    listing = "; ".join(map(str, found))
    warn(
        f"coordl: {what} off for this run: {listing}. These files are at its names in the shm directory but are "
        "not this user's own private files, and coordl never reads, writes or follows them; training goes on "
        "reading from storage. Remove them (`rm` as their owner or root) and the next run caches again"
    )


@dataclass(frozen=True)
class CacheSpec:
    """How to attach to one node-wide cache (picklable: worker processes attach by themselves)."""

    fingerprint: str
    budget: int
    keep: bool
    directory: str
    dataset: str
    tier: str = "encoded"  # or "decoded": the node's decoded images (a group of its own)
    item: str = "image"  # a decoded tier's items: "image" or "waveform" (coordl.fetch.decoded.ITEMS)

    @classmethod
    def for_dataset(
        cls,
        index: Index,
        budget: int,
        *,
        keep: bool = False,
        private: str = "",
        tier: str = "encoded",
        max_short_side: int | None = None,
        waveform: str | None = None,
    ) -> CacheSpec:
        """The cache of ``index`` for this user (segments are 0600, so two users get one each);
        ``private`` names a cache of its own (DS-Analyzer's cold runs); ``tier="decoded"`` the
        decoded tier beside it, of images capped at ``max_short_side`` when given (another tier:
        other pixels), or of ``waveform`` s (audio clips resampled as that key says: another rate
        or resampler is another tier)."""
        # The version, not the fingerprint alone: a cache kept from another version of a file is never attached.
        key = f"{index.version}:{os.getuid()}" + (f":{private}" if private else "")
        key += ":decoded" if tier == "decoded" else ""
        key += f":max_short_side={max_short_side}" if tier == "decoded" and max_short_side else ""
        key += f":waveform={waveform}" if tier == "decoded" and waveform else ""
        group = hashlib.sha256(key.encode()).hexdigest()[:16]
        item = "waveform" if waveform else "image"
        return cls(group, int(budget), keep, names.shm_dir(), index.version, tier, item)

    def attach(self, sizes: np.ndarray) -> NodeCache | None:
        """:meth:`open`, or None (with :func:`warn_off`) where another user took one of its names."""
        try:
            return self.open(sizes)
        except own.ForeignFileError as e:
            warn_off("the node cache is", list(e.found))
            return None

    def open(self, sizes: np.ndarray) -> NodeCache:
        """Attaches to the cache (creating it if this is its first user).

        Raises:
            ForeignFileError: a file at one of its names is not this user's own (nothing was read).
        """
        reap_once(self.directory)
        if self.tier == "decoded":
            return DecodedTier(
                self.fingerprint,
                len(sizes),
                self.budget,
                keep=self.keep,
                directory=self.directory,
                dataset=self.dataset,
                min_size=int(sizes.min()) if len(sizes) else 1,
                item=self.item,
            )
        return NodeCache(
            self.fingerprint, sizes, self.budget, keep=self.keep, directory=self.directory, dataset=self.dataset
        )
