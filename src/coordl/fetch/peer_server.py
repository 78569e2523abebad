"""A rank's server of the partitioned cache: it serves its node's cache to the other nodes' ranks.

One thread accepts, one thread serves each connection (see :mod:`coordl.fetch.wire` for the
protocol); :meth:`PeerServer.close` stops accepting, shuts every connection and joins their
threads (within :data:`CLOSE_S`, the SIGTERM deadline while the process is ending), so that the
cache, closed after it, is never read by a late answer: a request that comes after is refused
(its connection is closed), never an exception.

Every authenticated connection speaks for one rank of another node, so the server also knows
which of them are still in the current pass: a rank is done with pass ``p`` once it has said so
(a done frame), and gone once every connection of its has closed before it said so (the kernel
closes them when its process dies). :meth:`PeerServer.linger` waits on that
when the loader closes, so that a node whose script ends first keeps serving the others.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections import Counter

import numpy as np

from coordl import lifecycle
from coordl.fetch import wire

__all__ = ["PeerServer"]

log = logging.getLogger(__name__)

MAX_CONNECTIONS = 256
BODY_TIMEOUT = 10.0
CLOSE_S = 5.0  # how long close() waits for the accepting thread and then the connections' threads


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
        self._changed = threading.Condition(self._lock)  # a rank finished a pass or left
        self.served_reads = 0
        self.served_bytes = 0
        self.rejected = 0  # connections closed for failing the handshake or breaking the protocol
        self._conns: set[socket.socket] = set()  # open connections
        # Connection threads not yet seen ended: one that has left _conns may still be finishing,
        # and close() joins it too.
        self._threads: list[threading.Thread] = []
        self._peers: frozenset[int] | None = None  # the ranks of other nodes (None: any rank)
        self._pass = 0  # the pass this node is in
        self._done: dict[int, int] = {}  # rank -> the last pass it said it finished
        self._gone: dict[int, int] = {}  # rank -> the pass in which its last connection closed first
        self._open: Counter[int] = Counter()  # rank -> its authenticated connections now open
        self._last_frame = time.monotonic()
        self._closed = False
        self._sock = socket.create_server((host, port), family=socket.AF_INET, backlog=64)
        self.address = self._sock.getsockname()[:2]
        self._thread = threading.Thread(target=self._accept, name="coordl-peer-server", daemon=True)
        self._thread.start()

    def set_secret(self, secret: bytes) -> None:
        """Starts answering: connections wait (at most the handshake timeout) until this is known."""
        self._secret = secret
        self._ready.set()

    def expect(self, peers, passes: int) -> None:
        """The ranks of the other nodes (only they may connect), and the pass this node is in."""
        with self._lock:
            self._peers = frozenset(int(r) for r in peers)
            self._pass = passes

    def counters(self) -> tuple[int, int]:
        with self._lock:
            return self.served_reads, self.served_bytes

    def pending(self, passes: int) -> list[int]:
        """The ranks of other nodes that may still ask for samples in pass ``passes``: they have
        not said they finished it, and they are connected, or have not left in it."""
        with self._lock:
            return self._pending(passes)

    def _pending(self, passes: int) -> list[int]:
        def busy(r: int) -> bool:
            return self._done.get(r, 0) < passes and (self._open[r] > 0 or self._gone.get(r, 0) < passes)

        return [r for r in sorted(self._peers or ()) if busy(r)]

    def linger(self, passes: int, bound: float) -> list[int]:
        """Keeps serving until no rank of the other nodes may still ask for samples in pass
        ``passes`` (see :meth:`pending`), or none has sent a frame for ``bound`` seconds (counted
        from this call at the earliest).

        Returns:
            the ranks it stopped waiting for (empty: all were done or gone).
        """
        start = time.monotonic()
        with self._changed:
            while True:
                waiting = self._pending(passes)
                left = max(start, self._last_frame) + bound - time.monotonic()
                if not waiting or left <= 0 or self._closed:
                    return waiting
                self._changed.wait(left)

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
            thread = threading.Thread(target=self._serve, args=(conn,), name="coordl-peer-conn", daemon=True)
            with self._lock:
                refused = self._closed or len(self._conns) >= MAX_CONNECTIONS
                if not refused:
                    self._conns.add(conn)
                    self._threads = [t for t in self._threads if t.is_alive()]
                    self._threads.append(thread)
                    thread.start()  # under the lock: close() joins every thread it finds there
            if refused:
                conn.close()

    def _serve(self, conn: socket.socket) -> None:
        rank = None
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            if not self._ready.wait(wire.HANDSHAKE_TIMEOUT):
                raise wire.WireError("not ready: the job's secret is not known yet")
            if self._closed:  # close() woke it: refused
                return
            who = wire.server_handshake(conn, self._secret, self.dataset)
            with self._lock:
                if self._peers is not None and who not in self._peers:
                    raise wire.WireError(f"rank {who} is not a rank of another node")
                rank = who
                self._open[rank] += 1
            while not self._closed:
                frame = wire.read_frame(conn, self._n, BODY_TIMEOUT)
                if frame is None or self._closed:  # a request read as the server closes is refused
                    return
                self._last_frame = time.monotonic()
                if isinstance(frame, wire.Done):
                    with self._changed:
                        self._done[rank] = max(self._done.get(rank, 0), frame.passes)
                        self._changed.notify_all()
                else:
                    self._answer(conn, frame)
        except (OSError, wire.WireError, TimeoutError, ValueError) as e:
            with self._lock:
                self.rejected += 1
            log.debug("coordl: peer connection closed: %s", e)
        except Exception as e:  # noqa: BLE001 - a connection must never take the server down
            if self._closed:  # a thread close() stopped waiting for: refused, whatever it met
                log.debug("coordl: peer connection refused as the server closed: %r", e)
            else:
                log.exception("coordl: peer connection failed")
        finally:
            with self._changed:
                self._conns.discard(conn)
                if rank is not None:
                    self._open[rank] -= 1
                    if self._open[rank] == 0 and self._done.get(rank, 0) < self._pass:
                        self._gone[rank] = self._pass  # left in its pass: killed, or gave up on this node
                    self._changed.notify_all()
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
        """Stops accepting, shuts every connection and joins their threads (at most
        :data:`CLOSE_S` in all, the SIGTERM deadline while the process is ending). Idempotent."""
        with self._changed:
            if self._closed:
                return
            self._closed = True
            self._changed.notify_all()
        self._ready.set()  # a connection waiting for the secret is refused now
        end = time.monotonic() + CLOSE_S
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        lifecycle.join(self._thread, CLOSE_S)
        with self._lock:
            # No connection is added from now on: closed, under the lock.
            conns, threads = list(self._conns), list(self._threads)
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for thread in threads:
            lifecycle.join(thread, max(0.0, end - time.monotonic()))
