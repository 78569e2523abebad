"""The partitioned cache's client: a rank's requests to other nodes' caches, and its word that a
pass is done.

:class:`PeerClient` asks another node for the samples it holds in one request per batch (cut into
requests of at most :data:`MAX_REQUEST_BYTES`), reusing connections; what a node does not deliver
within ``timeout`` comes from storage, and a node that failed is left alone for ``retry_after``
seconds. At the end of a pass it tells every server of the other nodes (:meth:`PeerClient.tell_done`).
Frames are :mod:`coordl.fetch.wire`'s.
"""

from __future__ import annotations

import itertools
import logging
import socket
import threading
import time
from collections import defaultdict

import numpy as np

from coordl.fetch import wire

__all__ = ["MAX_REQUEST_BYTES", "PeerClient"]

log = logging.getLogger(__name__)

MAX_REQUEST_BYTES = 8 << 20  # bytes one request may ask for: what a connection has in flight


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
        rank: this rank (the servers know each connection by it).
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
        rank: int = 0,
        prefer: int = 0,
    ):
        self.servers = servers
        self.secret = secret
        self.dataset = dataset
        self.sizes = np.asarray(sizes, dtype=np.int64)
        self.timeout = timeout
        self.retry_after = retry_after
        self.rank = rank
        self.prefer = prefer
        self._idle: dict[tuple[str, int], list[socket.socket]] = defaultdict(list)
        self._down_until: dict[int, float] = {}
        self._lock = threading.Lock()
        self._quiet = threading.Condition(self._lock)  # no fetch in flight
        self._inflight = 0
        self._closed = False
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
        with self._lock:
            self._inflight += 1
        try:
            return self._fetch(node, ids)
        finally:
            with self._quiet:
                self._inflight -= 1
                self._quiet.notify_all()

    def _fetch(self, node: int, ids: np.ndarray) -> dict[int, np.ndarray]:
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

    def tell_done(self, passes: int, deadline: float) -> list[tuple[str, int]]:
        """Tells every server of the other nodes that this rank has finished pass ``passes``, once
        the requests it still has in flight are answered. A server it has no connection to gets a
        connection of its own for this, closed at once; one that turns the connection away (too
        many at once, as every rank tells at the end of a pass) is asked again until ``deadline``;
        one that is gone (refused) or silent (until ``deadline``) is not.

        Returns:
            the servers it could not tell.
        """
        with self._quiet:
            self._quiet.wait_for(lambda: self._inflight == 0, max(0.0, deadline - time.monotonic()))
        frame = wire.pack_done(passes)
        servers = self.servers  # the group may hand over a new map meanwhile
        addrs = [a for node in sorted(servers) for a in servers[node]]
        with self._lock:
            addrs.sort(key=lambda a: not self._idle[a])  # those connected first: telling them costs nothing
        failed: list[tuple[str, int]] = []
        for attempt in itertools.count():
            again = []
            for addr in addrs:
                try:
                    self._send(addr, frame, deadline)
                except (OSError, wire.WireError, TimeoutError) as e:
                    log.debug("coordl: could not tell peer %s:%d (%s)", addr[0], addr[1], e or type(e).__name__)
                    gone = isinstance(e, (ConnectionRefusedError, TimeoutError))
                    (failed if gone else again).append(addr)
            addrs = again
            pause = min(0.05 * 2**attempt, 1.0)
            if not addrs or time.monotonic() + pause >= deadline:
                return failed + addrs
            time.sleep(pause)

    def _send(self, addr: tuple[str, int], frame: bytes, deadline: float) -> None:
        """Sends ``frame`` to ``addr`` on a kept connection, else on a new one closed after it."""
        with self._lock:
            sock = self._idle[addr].pop() if self._idle[addr] else None
        if sock is not None:
            try:
                sock.settimeout(max(0.01, deadline - time.monotonic()))
                sock.sendall(frame)
            except OSError:
                sock.close()  # stale: the server went away since (a new one is tried below)
            else:
                self._keep(addr, sock)
                return
        if time.monotonic() >= deadline:
            raise TimeoutError("peer too slow")
        with self._checkout(addr, deadline, fresh=True) as sock:
            sock.sendall(frame)

    def _keep(self, addr: tuple[str, int], sock: socket.socket) -> None:
        """Puts a connection back for the next request (closes it once the client is closed)."""
        with self._lock:
            if not self._closed:
                self._idle[addr].append(sock)
                return
        sock.close()

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
            self._keep(addr, sock)

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

    def _checkout(self, addr: tuple[str, int], deadline: float, *, fresh: bool = False) -> socket.socket:
        with self._lock:
            if self._idle[addr] and not fresh:
                return self._idle[addr].pop()
        sock = socket.create_connection(addr, timeout=max(0.01, deadline - time.monotonic()))
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            wire.client_handshake(sock, self.secret, self.dataset, deadline, self.rank)
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
        """Closes the kept connections (the servers see this rank leave)."""
        with self._lock:
            self._closed = True
            for conns in self._idle.values():
                for s in conns:
                    s.close()
            self._idle.clear()
