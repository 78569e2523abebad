"""What a loader's passes share: the index, the node's cache, the fetcher, thread pools, peers, the pipeline.

:class:`Resources` is a frozen record with public attributes, made complete when the first pass
starts; passes receive it (never the loader).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

from coordl import compat, env, lifecycle
from coordl.fetch.cache import NodeCache
from coordl.fetch.decoded import DecodedTier
from coordl.fetch.fetcher import Fetcher
from coordl.fetch.spec import CacheSpec
from coordl.index import Index
from coordl.threads import DaemonPool, daemon_pool

__all__ = ["Resources"]

log = logging.getLogger(__name__)

PEER_THREADS = 8  # requests to other nodes' caches in flight at once


@dataclass(frozen=True)
class Resources:
    """The collaborators of a loader's passes, made complete in one place when its first pass
    starts (the job's world is known then), and closed once.

    Attributes:
        index: the dataset.
        cache: this process's attachment to the node's cache, or None (the loader's: it closes it).
        decoded: this process's attachment to the node's decoded tier, or None (the loader's too).
        cache_spec: how the torch backend's worker processes attach to the node's cache (None: no cache).
        fetcher: bytes of samples through the cache.
        io_threads: threads of ``pool``.
        pool: threads reading misses from storage (DALI backend), or None; daemon threads, so that
            the interpreter's exit never waits for them before ``atexit`` closes the loader.
        peers: the partitioned cache (:class:`~coordl.fetch.peer.PeerGroup`), or None.
        peer_pool: threads waiting for other nodes' caches, or None.
        prep: the DALI pipeline runner (:class:`~coordl.prep.dali.DaliPrep`), or None.
        dataloader: the torch backend's ``DataLoader`` over the node's cache, or None.
    """

    index: Index
    cache: NodeCache | None
    decoded: DecodedTier | None
    cache_spec: CacheSpec | None
    fetcher: Fetcher
    io_threads: int = 0
    pool: DaemonPool | None = None
    peers: object = None
    peer_pool: DaemonPool | None = None
    prep: object = None
    dataloader: object = None
    remote: object = None  # the actors of remote prep (coordl.remote.actors.RemotePrep), or None
    delivery: object = None  # how the DALI backend's batches reach the loop (coordl.delivery.Delivery)
    borrowed: bool = False  # made by with_cache: closing stops only its cache and its own workers

    @classmethod
    def open(
        cls,
        index: Index,
        cache: NodeCache | None,
        decoded: DecodedTier | None,
        cache_spec: CacheSpec | None,
        *,
        world,
        io_threads: int,
        disk=None,
        disk_spec=None,
        peers=None,
        prep: dict | None = None,
        dataloader: dict | None = None,
        remote: dict | None = None,
        delivery=None,
    ) -> Resources:
        """Makes every collaborator, in one place; if one fails, those made already are stopped.

        Args:
            index, cache, decoded, cache_spec: the dataset and the node's caches (the loader's).
            disk, disk_spec: the node's local-storage tier (the loader's attachment, and how the torch
                backend's workers open theirs), or None.
            world: this process's place in the job.
            io_threads: threads reading from storage (0: none, the torch backend's workers read).
            peers: the partitioned cache's :class:`~coordl.Peers` when it runs (None: off).
            prep: the arguments of the DALI pipeline runner (:class:`~coordl.prep.dali.DaliPrep`;
                None: the torch backend).
            dataloader: the torch backend's ``dataset``, ``on_error``, ``options`` (its
                :class:`~coordl.config.TorchOptions`) and ``generator`` (None: DALI).
            remote: the arguments of :meth:`RemotePrep.for_loader
                <coordl.remote.actors.RemotePrep.for_loader>` but ``index`` and ``items`` (None: no
                remote prep); its actors start now.
            delivery: the DALI backend's :class:`~coordl.delivery.Delivery` (None: the torch backend).
        """
        made = []  # what needs stopping if a later part fails
        try:
            fetcher = Fetcher(index, cache, drop_page_cache=cache is not None, decoded=decoded, disk=disk)
            pool = peer_pool = group = runner = loader = actors = None
            if io_threads:
                pool = daemon_pool(io_threads, "coordl-io")
                made.append(pool.shutdown)
            if peers is not None:
                peer_pool = daemon_pool(PEER_THREADS, "coordl-peer")
                made.append(peer_pool.shutdown)
                group = _peer_group(peers, world, index, cache)
                made.append(group.close)
            if prep is not None:
                from coordl.prep.dali import DaliPrep

                runner = DaliPrep(rank=world.rank, tiered=decoded is not None, boxes=index.boxes, **prep)
                made.append(runner.close)
                lifecycle.before_dali_exit()
            if dataloader is not None:
                # lazy: the torch backend is a pass above (it receives these Resources); only a
                # loader with backend="torch" opens its DataLoader
                from coordl.backends import torch as tb

                d = dataloader
                items = tb.Items(d["dataset"], fetcher, cache_spec, d["on_error"], disk_spec)
                loader = tb.make_dataloader(items, tb.EpochBatches(), d["options"], d["generator"])
            if remote is not None:
                # lazy: RayPrep's actors are a pass above; only a loader with prep=RayPrep starts them
                from coordl.remote.actors import RemotePrep

                items = loader.dataset if loader is not None else None
                actors = RemotePrep.for_loader(index=index, items=items, **remote)
                made.append(actors.close)
            return cls(
                index=index,
                cache=cache,
                decoded=decoded,
                cache_spec=cache_spec,
                fetcher=fetcher,
                io_threads=io_threads,
                pool=pool,
                peers=group,
                peer_pool=peer_pool,
                prep=runner,
                dataloader=loader,
                remote=actors,
                delivery=delivery,
            )
        except BaseException:
            for stop in reversed(made):
                stop()
            raise

    def fetch_ahead(self, batches: list, config, stop):
        """A :class:`~coordl.fetch.ahead.FetchAhead` over ``batches`` with these pools, peers and
        the loader's ``config`` (its ``batches_ahead`` and ``on_error``), ending when ``stop`` is set."""
        from coordl.fetch.ahead import FetchAhead

        return FetchAhead(
            self.fetcher,
            batches,
            self.index.labels,
            self.pool,
            threads=self.io_threads,
            depth=config.batches_ahead,
            on_error=config.on_error,
            stop=stop,
            peers=self.peers,
            peer_pool=self.peer_pool,
        )

    def with_cache(self, spec: CacheSpec | None) -> Resources:
        """These resources over another cache, attached from ``spec`` (DS-Analyzer's cold, private
        one; None: none): the same pools and pipeline, a fetcher of its own, and on the torch
        backend a ``DataLoader`` whose workers read through it; no decoded tier and no peers.
        Their :meth:`close` leaves that cache and stops those workers, and nothing they share."""
        cache = spec.attach(self.index.sizes) if spec is not None else None
        fetcher = Fetcher(self.index, cache, drop_page_cache=cache is not None)
        dataloader = self.dataloader
        if dataloader is not None:
            # lazy: the torch backend is a pass above (it receives these Resources)
            from coordl.backends import torch as tb

            dataloader = tb.over_cache(dataloader, fetcher, spec)
        return dataclasses.replace(
            self,
            cache=cache,
            decoded=None,
            cache_spec=spec,
            fetcher=fetcher,
            peers=None,
            dataloader=dataloader,
            remote=None,
            borrowed=True,
        )

    def close(self) -> None:
        """Stops the workers, threads and pipeline. Idempotent. The caches are the loader's, but for
        the one resources made by :meth:`with_cache` attached to, which they leave."""
        self.fetcher.closing.set()  # requests still waiting for an object store give up now
        if self.dataloader is not None:
            compat.shutdown_dataloader_workers(self.dataloader)  # persistent workers
        if self.borrowed:
            if self.cache is not None:
                self.cache.close()
            return
        try:
            if self.remote is not None:
                self.remote.close()  # its actors end now
            for pool in (self.peer_pool, self.pool):
                if pool is not None:
                    pool.shutdown(wait=True, cancel_futures=True)
            if self.peers is not None:
                self.peers.close()  # may linger, serving the other nodes (Peers(linger)): Ctrl-C stops it
        finally:
            if self.prep is not None:
                self.prep.close()


def _peer_group(options, world, index: Index, cache: NodeCache | None):
    """This rank's part in the partitioned cache (see :class:`coordl.Peers`)."""
    from coordl.fetch.peer import PeerGroup

    port = options.port if options.port is not None else env.integer("COORDL_PEER_PORT", 0, minimum=0)
    return PeerGroup(
        world,
        index,
        cache,
        timeout=options.timeout,
        retry_after=options.retry_after,
        linger=options.linger,
        interface=options.interface,
        port=port,
    )
