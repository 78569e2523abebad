"""Where a process's sample bytes came from: :class:`FetchCounters`, values that add."""

from __future__ import annotations

from dataclasses import dataclass, fields

__all__ = ["FetchCounters"]


@dataclass
class FetchCounters:
    """Where one process's bytes came from since the counters were reset.

    Counters add as values: ``a + b`` is a new one, field by field; ``a += b`` adds ``b`` into
    ``a``; ``a + {"storage_reads": 3}`` takes another process's :meth:`as_dict` (a worker's or an
    actor's, sent back with its batch).
    """

    cache_hits: int = 0
    cache_hit_bytes: int = 0
    storage_reads: int = 0
    storage_bytes: int = 0
    storage_ns: int = 0  # time spent in storage reads, summed over threads
    admitted: int = 0
    peer_reads: int = 0  # samples received from other nodes' caches
    peer_bytes: int = 0
    peer_ns: int = 0  # time spent in peer requests, summed over threads
    decoded_hits: int = 0  # samples served as decoded images from the node's decoded tier
    decoded_hit_bytes: int = 0
    decoded_admitted: int = 0  # images this process decoded and put into the decoded tier
    disk_reads: int = 0  # samples read from the node's local-storage tier
    disk_bytes: int = 0
    disk_ns: int = 0  # time spent reading it, summed over threads
    disk_admitted: int = 0  # samples from the store or a peer that this process handed to the tier's writer
    disk_repaired: int = 0  # of those, samples whose entry was damaged (cut, flipped): written again
    disk_replaced: int = 0  # of those, samples whose entry held another version (stale): replaced

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def __add__(self, other: FetchCounters | dict) -> FetchCounters:
        out = FetchCounters(**vars(self))
        out += other
        return out

    def __iadd__(self, other: FetchCounters | dict) -> FetchCounters:
        # On every read of the fetcher: its fields as they are (vars), and only those that count.
        for key, value in (other if isinstance(other, dict) else vars(other)).items():
            if value:
                setattr(self, key, getattr(self, key) + value)
        return self
