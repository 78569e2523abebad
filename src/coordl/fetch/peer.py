"""The partitioned cache: every node's MinIO cache serves the other nodes' misses over TCP.

Every rank of a multi-node job runs a :class:`~coordl.fetch.peer_server.PeerServer` on its
node's cache, bound to the one address the other nodes reach it at (:func:`advertised_address`).
At the start of every pass, :meth:`PeerGroup.sync` is one ``all_gather`` on a gloo group of ``torch.distributed``:
each rank contributes its server's address, and the first rank of each node its node's
cache bitmap (which samples are cached there); rank 0 adds the job's secret. Every rank then
knows the same holder map, so the locality-aware plan (:mod:`coordl.placement`) is the same
everywhere without further messages. A local miss held by another node is fetched from it by
:class:`~coordl.fetch.peer_client.PeerClient` in one request per batch and node (see :mod:`coordl.fetch.wire`); anything
a peer does not deliver within ``timeout`` comes from storage, and that peer is skipped for
``retry_after`` seconds. When a rank finishes a pass it tells every server of the other nodes
(:meth:`PeerGroup.pass_done`); a closing rank's server serves on until the other nodes' ranks
have finished theirs, or ``linger`` seconds of silence (:meth:`PeerGroup.close`).
"""

from __future__ import annotations

import ipaddress
import logging
import secrets
import socket
import threading
import time
from collections import defaultdict

import numpy as np

from coordl import env, lifecycle, placement
from coordl.errors import CoordlError
from coordl.fetch.peer_client import PeerClient
from coordl.fetch.peer_server import PeerServer

__all__ = ["PeerGroup", "advertised_address", "enabled", "refusal", "world_refusal"]

log = logging.getLogger(__name__)


# -- addresses ----------------------------------------------------------------------------
def _interface_address(name: str) -> str:
    import fcntl
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))  # SIOCGIFADDR
        except OSError as e:
            raise CoordlError(f"network interface {name!r} has no IPv4 address ({e.strerror or e})") from None
    return socket.inet_ntoa(packed[20:24])


def _is_loopback(host: str) -> bool:
    return ipaddress.ip_address(host).is_loopback


def advertised_address(interface: str | None = None) -> str:
    """The IPv4 address this node's servers bind to and other nodes connect to.

    In order: ``$COORDL_PEER_ADDR``; the address of ``interface`` (or
    ``$COORDL_PEER_IFNAME``, else ``$GLOO_SOCKET_IFNAME``); else the local address of the route
    to ``$MASTER_ADDR``. A loopback address is only used when given explicitly or when the
    master itself is on loopback (then every node is on this machine).

    Raises:
        CoordlError: no usable address (the message says what to set).
    """
    address = env.text("COORDL_PEER_ADDR")
    if address:
        return socket.gethostbyname(address)
    interface = interface or env.text("COORDL_PEER_IFNAME") or env.text("GLOO_SOCKET_IFNAME")
    if interface:
        return _interface_address(interface.split(",")[0])
    master = env.text("MASTER_ADDR")
    if not master:
        raise CoordlError(
            "the partitioned cache cannot tell which address other nodes reach this one at: MASTER_ADDR is not set; "
            "set COORDL_PEER_IFNAME (a network interface) or COORDL_PEER_ADDR"
        )
    master_ip = socket.gethostbyname(master)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((master_ip, 9))  # no packet is sent: this only asks the kernel for the route
        mine = s.getsockname()[0]
    if _is_loopback(mine) and not _is_loopback(master_ip):
        raise CoordlError(
            f"the route to MASTER_ADDR={master} gives the loopback address {mine}, which other nodes cannot reach; "
            "set COORDL_PEER_IFNAME to the interface the nodes share"
        )
    return mine


# -- the group ----------------------------------------------------------------------------
_gloo_group = None


def _group():
    """A gloo process group over all ranks (the default one when it is gloo already)."""
    global _gloo_group
    import torch.distributed as dist

    if dist.get_backend() == "gloo":
        return None
    if _gloo_group is None:
        _gloo_group = dist.new_group(backend="gloo")
    return _gloo_group


def refusal(options, backend: str, grouped: bool) -> str | None:
    """Why the partitioned cache never runs for a loader (None: it may), from what the loader is;
    checked once, when it is made. Where it runs is :func:`world_refusal`'s.

    Args:
        options: the loader's :class:`~coordl.Peers`.
        backend: ``"dali"`` or ``"torch"``.
        grouped: the loader is in an ``hp_group``.
    """
    if options.enabled is False:
        return "peers=False"
    if backend != "dali":
        return "it serves the DALI backend (a folder or a list of files), not the torch backend yet"
    if grouped:
        return "an hp_group shares prep within one node"
    return None


def world_refusal(world) -> str | None:
    """Why the partitioned cache does not run where a loader runs (None: it runs); checked once,
    when its first pass starts."""
    if not enabled(world):
        return (
            "the job runs on one node, or torch.distributed is not initialized (call "
            "torch.distributed.init_process_group before the first pass)"
        )
    return None


def enabled(world) -> bool:
    """Whether this job spans several nodes with ``torch.distributed`` initialized."""
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover
        return False
    return world.world_size > world.local_world_size and dist.is_available() and dist.is_initialized()


class PeerGroup:
    """One loader's part in the partitioned cache: its server, the holder map, a client.

    The end of a job: nodes rarely end their last pass together, and a node whose script ends
    first must not take its cache away from the others. So each rank tells every server of the
    other nodes when it has finished a pass (:meth:`pass_done`, and :meth:`close`), from a
    thread of its own that never holds up training; and :meth:`close` keeps this rank's server
    serving until every rank of the other nodes has finished the current pass (or closed its
    connections: it is gone), or no frame has come from them for ``linger`` seconds (a rank
    that is stuck, or that cannot reach this node).

    Args:
        world: this rank's place in the job.
        index: the dataset.
        cache: the node's MinIO cache (None: this node holds nothing and serves nothing).
        timeout, retry_after: see :class:`PeerClient`.
        interface: see :func:`advertised_address`.
        port: the server's port (0: any free one).
        linger: the most seconds :meth:`close` waits for silent ranks of other nodes to finish
            their pass (None: ``3 * timeout``).
    """

    def __init__(
        self,
        world,
        index,
        cache,
        *,
        timeout: float,
        retry_after: float,
        interface: str | None,
        port: int,
        linger: float | None = None,
    ):
        self.world = world
        self.index = index
        self.cache = cache
        self.timeout = timeout
        self.retry_after = retry_after
        self.linger = 3 * timeout if linger is None else linger
        self.group = _group()
        self.server: PeerServer | None = None
        self.client: PeerClient | None = None
        self.holder = np.full(len(index), -1, dtype=np.int64)
        self.rank_nodes = np.zeros(world.world_size, dtype=np.int64)
        self.node = 0
        self.passes = 0  # passes started (every rank starts as many: each starts with a collective)
        self._finished = 0  # the last pass this rank has finished
        self._wake = threading.Condition()  # for the herald: a pass ended, or the group closes
        self._herald: threading.Thread | None = None
        self._closing = False
        self._closed = False
        self._secret = secrets.token_bytes(32) if world.rank == 0 else None
        if cache is not None:
            try:
                host = advertised_address(interface)
                self.server = PeerServer(cache, index.fingerprint, len(index), host, port)
            except (CoordlError, OSError) as e:
                log.warning("coordl: this rank does not serve its node's cache to other nodes: %s", e)

    def sync(self) -> None:
        """Learns every node's server addresses and cached samples (a collective: every rank calls it)."""
        import torch.distributed as dist

        w = self.world
        # Every rank has finished its previous pass (and the storage reads that fill the cache)
        # before a node's bitmap is taken, so the holder map is the same however ranks are timed.
        dist.barrier(group=self.group)
        bitmap = None
        if w.local_rank == 0 and self.cache is not None:
            bitmap = np.packbits(self.cache.ready_mask(np.arange(len(self.index)))).tobytes()
        mine = {
            "rank": w.rank,
            "node": w.node_rank,
            "address": None if self.server is None else self.server.address,
            "bitmap": bitmap,
            "secret": self._secret,
            "dataset": self.index.fingerprint,
        }
        everyone: list = [None] * w.world_size
        dist.all_gather_object(everyone, mine, group=self.group)
        if any(e["dataset"] != self.index.fingerprint for e in everyone):
            raise CoordlError("the ranks of this job index different datasets; every rank must load the same files")
        nodes = sorted({e["node"] for e in everyone})
        dense = {node: k for k, node in enumerate(nodes)}
        self.node = dense[w.node_rank]
        self.rank_nodes = np.array([dense[e["node"]] for e in sorted(everyone, key=lambda e: e["rank"])], np.int64)
        bitmaps = np.zeros((len(nodes), len(self.index)), dtype=bool)
        servers: dict[int, list[tuple[str, int]]] = defaultdict(list)
        for e in everyone:
            if e["bitmap"] is not None:
                bits = np.unpackbits(np.frombuffer(e["bitmap"], np.uint8), count=len(self.index))
                bitmaps[dense[e["node"]]] |= bits.astype(bool)
            if e["address"] is not None and dense[e["node"]] != self.node:
                servers[dense[e["node"]]].append(tuple(e["address"]))
        self.holder = placement.holders(bitmaps)
        secret = next(e["secret"] for e in everyone if e["rank"] == 0)
        if self.server is not None:
            self.server.expect((e["rank"] for e in everyone if dense[e["node"]] != self.node), self.passes + 1)
            self.server.set_secret(secret)
        if self.client is None:
            self.client = PeerClient(
                dict(servers),
                secret,
                self.index.fingerprint,
                self.index.sizes,
                timeout=self.timeout,
                retry_after=self.retry_after,
                rank=w.rank,
                prefer=w.rank,
            )
            self._herald = threading.Thread(target=self._tell, name="coordl-peer-herald", daemon=True)
            self._herald.start()
        else:
            self.client.servers = dict(servers)
        with self._wake:
            self.passes += 1

    def pass_done(self) -> None:
        """Says that this rank has finished its current pass, or abandoned it: it asks other nodes
        nothing more until the next one. Never blocks (the herald thread tells them); idempotent.
        The loader calls it when a pass ends and when one is closed early."""
        with self._wake:
            self._finished = self.passes
            self._wake.notify()

    def _tell(self) -> None:
        """The herald thread: tells the servers of the other nodes each pass this rank finishes."""
        lifecycle.quiet_thread()
        told = 0
        while True:
            with self._wake:
                self._wake.wait_for(lambda t=told: self._closing or self._finished > t)
                finished, closing = self._finished, self._closing
            if finished > told:
                try:
                    self.client.tell_done(finished, time.monotonic() + self.timeout)
                except Exception:  # noqa: BLE001 - the servers then wait their linger, no more
                    log.exception("coordl: telling the other nodes that pass %d is done failed", finished)
                told = finished
            elif closing:
                return

    def remote(self, ids: np.ndarray) -> np.ndarray:
        """The node to ask for each of ``ids`` (-1: none, this node, or a node left alone)."""
        nodes = self.holder[ids]
        nodes[nodes == self.node] = -1
        if self.client is not None:
            for n in np.unique(nodes[nodes >= 0]).tolist():
                if not self.client.alive(n):
                    nodes[nodes == n] = -1
        else:
            nodes[:] = -1
        return nodes

    def served(self) -> tuple[int, int]:
        """Samples and bytes this rank's server has sent to peers."""
        return self.server.counters() if self.server is not None else (0, 0)

    def close(self) -> None:
        """Tells the other nodes this rank is done, serves them until they are (at most ``linger``
        seconds of silence), and stops. Idempotent.

        On SIGTERM (the job is being stopped), it does not wait for them.
        """
        if self._closed:
            return
        self._closed = True
        ending = lifecycle.terminating()
        try:
            if self._herald is not None:
                with self._wake:
                    self._finished, self._closing = self.passes, True
                    self._wake.notify()
                # It may be telling them about the previous pass first: two timeouts at most. On
                # SIGTERM, what it has told them in a moment.
                self._herald.join(1.0 if ending else 2 * self.timeout + 1)
            if self.client is not None:
                self.client.close()  # its connections close: this rank is gone, whatever it could tell
            if self.server is not None and self.passes and not ending:
                t0 = time.monotonic()
                waiting = self.server.linger(self.passes, self.linger)
                if waiting:
                    log.info(
                        "coordl: stopped serving this node's cache after %.0f s; ranks %s of other nodes had "
                        "not finished their pass and had sent nothing for %.0f s (Peers(linger))",
                        time.monotonic() - t0,
                        ",".join(map(str, waiting)),
                        self.linger,
                    )
        finally:
            if self.server is not None:
                self.server.close()
            if self.client is not None:
                self.client.close()
