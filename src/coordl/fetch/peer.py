"""The partitioned cache: every node's MinIO cache serves the other nodes' misses over TCP.

Every rank of a multi-node job runs a :class:`PeerServer` on its node's cache, bound to the
one address the other nodes reach it at (:func:`advertised_address`). At the start of every
pass, :meth:`PeerGroup.sync` is one ``all_gather`` on a gloo group of ``torch.distributed``:
each rank contributes its server's address, and the first rank of each node its node's
cache bitmap (which samples are cached there); rank 0 adds the job's secret. Every rank then
knows the same holder map, so the locality-aware plan (:mod:`coordl.placement`) is the same
everywhere without further messages. A local miss held by another node is fetched from it by
:class:`PeerClient` in one request per batch and node (see :mod:`coordl.fetch.wire`); anything
a peer does not deliver within ``timeout`` comes from storage, and that peer is skipped for
``retry_after`` seconds.
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
from coordl.fetch import wire

__all__ = ["PeerClient", "PeerGroup", "PeerServer", "advertised_address"]

log = logging.getLogger(__name__)

MAX_REQUEST_BYTES = 8 << 20  # bytes one request may ask for: what a connection has in flight
MAX_CONNECTIONS = 256
BODY_TIMEOUT = 10.0


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


# -- server -------------------------------------------------------------------------------
class PeerServer:
    """Serves this node's cached samples to authenticated peers, one thread per connection.

    Args:
        cache: the node's MinIO cache.
        dataset: the index fingerprint (part of the handshake: peers of another dataset fail it).
        num_items: samples in the dataset (requests for others are malformed).
        host: the address to bind (and only that one).
        port: the port, 0 for any free one.
    """

    def __init__(self, cache, dataset: str, num_items: int, host: str, port: int = 0):
        self.cache = cache
        self.dataset = dataset
        self._n = num_items
        self._secret: bytes | None = None
        self._ready = threading.Event()
        self._lock = threading.Lock()
        self.served_reads = 0
        self.served_bytes = 0
        self.rejected = 0  # connections closed for failing the handshake or breaking the protocol
        self._conns: set[socket.socket] = set()
        self._closed = False
        self._sock = socket.create_server((host, port), family=socket.AF_INET, backlog=64)
        self.address = self._sock.getsockname()[:2]
        self._thread = threading.Thread(target=self._accept, name="coordl-peer-server", daemon=True)
        self._thread.start()

    def set_secret(self, secret: bytes) -> None:
        """Starts answering: connections wait (at most the handshake timeout) until this is known."""
        self._secret = secret
        self._ready.set()

    def counters(self) -> tuple[int, int]:
        with self._lock:
            return self.served_reads, self.served_bytes

    def _accept(self) -> None:
        lifecycle.quiet_thread()  # and the connection threads it starts
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                if self._closed:
                    return
                time.sleep(0.01)
                continue
            with self._lock:
                full = len(self._conns) >= MAX_CONNECTIONS
                if not full:
                    self._conns.add(conn)
            if full:
                conn.close()
                continue
            threading.Thread(target=self._serve, args=(conn,), name="coordl-peer-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            if not self._ready.wait(wire.HANDSHAKE_TIMEOUT):
                raise wire.WireError("not ready: the job's secret is not known yet")
            wire.server_handshake(conn, self._secret, self.dataset)
            while not self._closed:
                ids = wire.read_request(conn, self._n, BODY_TIMEOUT)
                if ids is None:
                    return
                self._answer(conn, ids)
        except (OSError, wire.WireError, TimeoutError, ValueError) as e:
            with self._lock:
                self.rejected += 1
            log.debug("coordl: peer connection closed: %s", e)
        except Exception:  # noqa: BLE001 - a connection must never take the server down
            log.exception("coordl: peer connection failed")
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def _answer(self, conn: socket.socket, ids: np.ndarray) -> None:
        lengths = np.full(len(ids), -1, dtype="<i8")
        parts = []
        for k, i in enumerate(ids.tolist()):
            data = self.cache.get(i)
            if data is not None:
                lengths[k] = len(data)
                parts.append(data)
        conn.settimeout(BODY_TIMEOUT)
        reads, nbytes = len(parts), int(lengths[lengths > 0].sum())
        # Counted before sending, so that a peer that has the answer sees it counted; taken back
        # if the send fails.
        with self._lock:
            self.served_reads += reads
            self.served_bytes += nbytes
        try:
            conn.sendall(b"".join([wire.HEAD.pack(wire.RESPONSE, len(ids)), lengths.tobytes(), *parts]))
        except BaseException:
            with self._lock:
                self.served_reads -= reads
                self.served_bytes -= nbytes
            raise

    def close(self) -> None:
        """Stops accepting and closes every connection."""
        if self._closed:
            return
        self._closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._thread.join(timeout=5)


# -- client -------------------------------------------------------------------------------
class PeerClient:
    """Fetches samples from other nodes' servers, reusing connections.

    Args:
        servers: node -> the ``(host, port)`` of that node's servers.
        secret: the job's secret.
        dataset: the index fingerprint.
        sizes: every sample's size (a response's lengths are checked against it).
        timeout: seconds a request (connecting included) may take before its samples come
            from storage.
        retry_after: seconds a node that failed is left alone.
        prefer: which of a node's servers to use (this rank's number, to spread the load).
    """

    def __init__(
        self,
        servers: dict[int, list[tuple[str, int]]],
        secret: bytes,
        dataset: str,
        sizes: np.ndarray,
        *,
        timeout: float,
        retry_after: float,
        prefer: int = 0,
    ):
        self.servers = servers
        self.secret = secret
        self.dataset = dataset
        self.sizes = np.asarray(sizes, dtype=np.int64)
        self.timeout = timeout
        self.retry_after = retry_after
        self.prefer = prefer
        self._idle: dict[tuple[str, int], list[socket.socket]] = defaultdict(list)
        self._down_until: dict[int, float] = {}
        self._lock = threading.Lock()
        self.failures = 0

    def alive(self, node: int) -> bool:
        """False while every server of ``node`` is being left alone after a failure."""
        now = time.monotonic()
        return any(self._down_until.get(a, 0.0) <= now for a in self.servers.get(node, ()))

    def fetch(self, node: int, ids: np.ndarray) -> dict[int, np.ndarray]:
        """The bytes of those of ``ids`` that ``node`` holds; missing ids are the caller's to read.

        A server that refuses the connection (its rank has left) is skipped for another of the
        node's servers; any other failure (a timeout, a broken frame) leaves the whole node alone.
        """
        got: dict[int, np.ndarray] = {}
        addrs = self.servers.get(node, [])
        for k in range(len(addrs)):
            addr = addrs[(self.prefer + k) % len(addrs)]
            if self._down_until.get(addr, 0.0) > time.monotonic():
                continue
            rest = ids if not got else ids[~np.isin(ids, list(got))]
            try:
                self._fetch_from(addr, rest, got)
                return got
            except (OSError, wire.WireError, TimeoutError) as e:
                refused = isinstance(e, ConnectionRefusedError)
                until = time.monotonic() + self.retry_after
                with self._lock:
                    self.failures += 1
                    for a in [addr] if refused else addrs:
                        self._down_until[a] = until
                log.warning(
                    "coordl: peer node %d (%s:%d) failed (%s); reading its samples from storage for %.0f s",
                    node,
                    addr[0],
                    addr[1],
                    e or type(e).__name__,
                    self.retry_after,
                )
                if not refused:
                    break
        return got

    def _fetch_from(self, addr: tuple[str, int], ids: np.ndarray, got: dict) -> None:
        sock = None
        try:
            for part in self._requests(ids):
                deadline = time.monotonic() + self.timeout
                if sock is None:
                    sock = self._checkout(addr, deadline)
                sock.sendall(wire.pack_request(part))
                self._receive(sock, part, got, deadline)
        except BaseException:
            if sock is not None:
                sock.close()
            raise
        if sock is not None:
            with self._lock:
                self._idle[addr].append(sock)

    def _requests(self, ids: np.ndarray):
        """Cuts ``ids`` into requests of at most :data:`MAX_REQUEST_BYTES` and :data:`wire.MAX_IDS` ids."""
        start, total = 0, 0
        for k, i in enumerate(ids.tolist()):
            size = int(self.sizes[i])
            if k > start and (total + size > MAX_REQUEST_BYTES or k - start >= wire.MAX_IDS):
                yield ids[start:k]
                start, total = k, 0
            total += size
        if start < len(ids):
            yield ids[start:]

    def _checkout(self, addr: tuple[str, int], deadline: float) -> socket.socket:
        with self._lock:
            if self._idle[addr]:
                return self._idle[addr].pop()
        sock = socket.create_connection(addr, timeout=max(0.01, deadline - time.monotonic()))
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            wire.client_handshake(sock, self.secret, self.dataset, deadline)
        except BaseException:
            sock.close()
            raise
        return sock

    def _receive(self, sock: socket.socket, ids: np.ndarray, got: dict, deadline: float) -> None:
        magic, count = wire.HEAD.unpack(wire.recv_exact(sock, wire.HEAD.size, deadline))
        if magic != wire.RESPONSE or count != len(ids):
            raise wire.WireError(f"malformed response (magic {magic!r}, count {count} for {len(ids)})")
        lengths = np.frombuffer(wire.recv_exact(sock, 8 * count, deadline), dtype="<i8")
        held = lengths >= 0
        if not np.array_equal(lengths[held], self.sizes[ids[held]]):
            raise wire.WireError("a response's sample sizes do not match the index")
        buf = np.empty(int(lengths[held].sum()), dtype=np.uint8)
        wire.recv_into_exact(sock, memoryview(buf), deadline)
        offset = 0
        for i, n in zip(ids[held].tolist(), lengths[held].tolist()):
            got[i] = buf[offset : offset + n]
            offset += n

    def close(self) -> None:
        with self._lock:
            for conns in self._idle.values():
                for s in conns:
                    s.close()
            self._idle.clear()


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

    Args:
        world: this rank's place in the job.
        index: the dataset.
        cache: the node's MinIO cache (None: this node holds nothing and serves nothing).
        timeout, retry_after: see :class:`PeerClient`.
        interface: see :func:`advertised_address`.
        port: the server's port (0: any free one).
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
    ):
        self.world = world
        self.index = index
        self.cache = cache
        self.timeout = timeout
        self.retry_after = retry_after
        self.group = _group()
        self.server: PeerServer | None = None
        self.client: PeerClient | None = None
        self.holder = np.full(len(index), -1, dtype=np.int64)
        self.rank_nodes = np.zeros(world.world_size, dtype=np.int64)
        self.node = 0
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
            self.server.set_secret(secret)
        if self.client is None:
            self.client = PeerClient(
                dict(servers),
                secret,
                self.index.fingerprint,
                self.index.sizes,
                timeout=self.timeout,
                retry_after=self.retry_after,
                prefer=w.rank,
            )
        else:
            self.client.servers = dict(servers)

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
        if self.server is not None:
            self.server.close()
        if self.client is not None:
            self.client.close()
