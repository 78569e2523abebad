"""The local-storage tier as a link of the fetcher's chain (:mod:`coordl.fetch.chain`): it serves the
samples it holds whole and checked, and its writer takes every sample the links below it brought,
from the store or from another node's memory, so that the next epoch, job or run reads it here."""

from __future__ import annotations

import time

import numpy as np

from coordl.fetch.chain import DISK, PEERS, STORE, Job
from coordl.fetch.disk.entries import ABSENT, DAMAGED, GOOD, STALE
from coordl.fetch.disk.stamps import keys

__all__ = ["DiskLink"]


class DiskLink:
    """The node's local-storage tier (:class:`~coordl.fetch.disk.tier.DiskTier`) over ``index``."""

    code, cached = DISK, True

    def __init__(self, tier, index):
        self.tier = tier
        self.index = index
        self.peers_first = tier.peers_first

    def holds(self, ids: np.ndarray) -> np.ndarray:
        """The samples with an entry (checked when read), or in this process's writer queue."""
        return self.tier.present([self.index.paths[i] for i in np.asarray(ids).tolist()])

    def read_into(self, job: Job, ks: np.ndarray) -> None:
        """Reads the entries of ``ks``; one found stale or damaged is left to the links below, and
        then replaced (:meth:`admit`)."""
        names, stamps = keys(self.index, job.ids[ks])
        t0 = time.perf_counter_ns()
        found = self.tier.read_into(names, stamps, job.sizes[ks], job.into(ks))
        job.counters.disk_ns += time.perf_counter_ns() - t0
        got = found == GOOD
        job.served(ks[got], DISK)
        job.counters.disk_reads += int(got.sum())
        job.counters.disk_bytes += int(job.sizes[ks[got]].sum())
        job.found[ks] = found

    def admit(self, job: Job) -> None:
        """Hands the samples the store or a peer served to the tier's writer (a stale or damaged
        entry is replaced); those the tier was not asked about (asked after the peers) only when
        it has no entry for them. Nothing once this process stopped filling."""
        found = job.found
        ks = np.flatnonzero((job.by == STORE) | (job.by == PEERS))
        if not self.tier.filling or not len(ks):
            return
        unasked = ks[(job.asked[ks] & DISK) == 0]
        if len(unasked):
            ks = np.union1d(ks[(job.asked[ks] & DISK) != 0], unasked[~self.holds(job.ids[unasked])])
        if not len(ks):
            return
        names, stamps = keys(self.index, job.ids[ks])
        again = (found[ks] != ABSENT).tolist()
        self.tier.put(names, stamps, [job.data[k] for k in ks.tolist()], again)
        c = job.counters
        c.disk_admitted += len(ks)
        c.disk_repaired += int((found[ks] == DAMAGED).sum())
        c.disk_replaced += int((found[ks] == STALE).sum())
