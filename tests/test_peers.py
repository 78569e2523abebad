"""The partitioned cache: peer servers and clients on real sockets, and real multi-node jobs.

Multi-node tests launch ``tests/multinode_train.py`` with torchrun, one "node" per network
namespace with its own tmpfs at /dev/shm (``coordl_testing.netns``), as a user would on
several machines. Where namespaces are unavailable (not root), each node gets its own
loopback address and shm folder instead.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

import coordl
from coordl import CoordLoader, sampler
from coordl.errors import CoordlError
from coordl.fetch import wire
from coordl.fetch.ahead import FetchAhead
from coordl.fetch.cache import NodeCache
from coordl.fetch.fetcher import Fetcher
from coordl.fetch.peer import PeerGroup, advertised_address
from coordl.fetch.peer_client import PeerClient
from coordl.fetch.peer_server import PeerServer
from coordl.index import Index
from coordl_testing import netns

HERE = Path(__file__).resolve().parent

SECRET = b"s" * 32
WAIT = 30  # seconds the test waits for the other side to reach a point (a hang guard)
N = 120  # samples in tiny_dataset
GUARD = 1.5  # seconds on top of a bound for reading the rest from storage on a busy machine (a hang guard)
LEFT_ALONE = "reading its samples from storage"  # in the warning of a peer that failed


# -- one server, in this process ---------------------------------------------------------------
@pytest.fixture
def served(tiny_dataset, isolated):
    """A cache holding the even samples of the tiny dataset, served on 127.0.0.1."""
    index = Index.scan(tiny_dataset)
    cache = NodeCache("ab" * 8, index.sizes, index.total_bytes, directory=str(isolated), dataset=index.fingerprint)
    fetcher = Fetcher(index, cache, drop_page_cache=False)
    for i in range(0, len(index), 2):
        fetcher.fetch(i)
    server = PeerServer(cache, index.fingerprint, len(index), "127.0.0.1")
    server.set_secret(SECRET)
    yield index, server
    server.close()
    cache.close()


def _client(index, server, secret=SECRET, timeout=2.0):
    return PeerClient({1: [server.address]}, secret, index.fingerprint, index.sizes, timeout=timeout, retry_after=30)


def _raw(server) -> socket.socket:
    s = socket.create_connection(server.address, timeout=5)
    s.settimeout(5)
    return s


def _drain(s: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection."""
    out = b""
    while True:
        try:
            chunk = s.recv(65536)
        except (ConnectionResetError, TimeoutError):
            return out
        if not chunk:
            return out
        out += chunk


def test_an_authenticated_peer_gets_exactly_the_cached_bytes_in_one_request(served):
    index, server = served
    client = _client(index, server)
    ids = np.arange(20, dtype=np.int64)
    got = client.fetch(1, ids)
    assert sorted(got) == list(range(0, 20, 2))  # only what the node holds
    for i, data in got.items():
        assert data.tobytes() == Path(index.paths[i]).read_bytes()
    assert server.counters() == (10, sum(int(index.sizes[i]) for i in got))
    again = client.fetch(1, ids)  # the connection is reused
    assert sorted(again) == sorted(got)
    assert len(client._idle[server.address]) == 1
    client.close()


def test_a_request_larger_than_the_bound_is_split(served, monkeypatch):
    index, server = served
    import coordl.fetch.peer_client as peer

    monkeypatch.setattr(peer, "MAX_REQUEST_BYTES", int(index.sizes.max()) * 3)
    client = _client(index, server)
    parts = list(client._requests(np.arange(0, N, 2)))
    assert len(parts) > 10 and all(index.sizes[p].sum() <= peer.MAX_REQUEST_BYTES or len(p) == 1 for p in parts)
    assert len(client.fetch(1, np.arange(0, N, 2))) == N // 2
    client.close()


def test_a_client_without_the_secret_gets_nothing(served):
    index, server = served
    client = _client(index, server, secret=b"x" * 32)
    assert client.fetch(1, np.arange(10)) == {}
    assert not client.alive(1) and server.rejected == 1  # and is not retried on every item:
    assert client.fetch(1, np.arange(10)) == {}
    assert server.rejected == 1  # (the server counts a refused handshake before it closes the connection)
    # A raw client that skips the handshake and sends a request: only the server's hello comes back.
    s = _raw(server)
    s.sendall(wire.pack_request(np.arange(4)) + b"\0" * 64)
    reply = _drain(s)
    s.close()
    assert len(reply) == wire.HELLO.size and reply.startswith(b"CDLH")
    assert server.counters() == (0, 0)


@pytest.mark.parametrize(
    "frame",
    [
        b"GARBAGE!" * 8,
        wire.HEAD.pack(b"CDLQ", 0),
        wire.HEAD.pack(b"CDLQ", wire.MAX_IDS + 1) + b"\0" * 64,
        wire.HEAD.pack(b"CDLQ", 2**32 - 1),
        wire.pack_request(np.array([1, N + 5])),
        wire.HEAD.pack(b"CDLQ", 3) + b"\1" * 5,  # a truncated body, then silence
    ],
    ids=["garbage", "zero-count", "too-many", "huge-count", "id-out-of-range", "truncated"],
)
def test_malformed_frames_close_the_connection_and_the_server_keeps_serving(served, frame, monkeypatch):
    index, server = served
    import coordl.fetch.peer_server as peer_server

    monkeypatch.setattr(peer_server, "BODY_TIMEOUT", 0.5)
    s = _raw(server)
    magic, version, nonce = wire.HELLO.unpack(wire.recv_exact(s, wire.HELLO.size))
    s.sendall(wire.client_proof(SECRET, index.fingerprint, nonce, 1))
    wire.recv_exact(s, wire.MAC)  # authenticated
    s.sendall(frame)
    assert _drain(s) == b""  # nothing but a closed connection
    s.close()
    assert server.rejected == 1 and server.counters() == (0, 0)
    client = _client(index, server)
    assert len(client.fetch(1, np.array([0, 2, 4]))) == 3
    client.close()


def test_many_junk_connections_do_not_take_the_server_down(served):
    index, server = served
    junk = []
    for k in range(50):
        s = _raw(server)
        s.sendall(os.urandom(k * 7 + 1))
        junk.append(s)
    for s in junk:
        s.close()
    client = _client(index, server)
    assert len(client.fetch(1, np.arange(0, 40, 2))) == 20
    client.close()


def _conn_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "coordl-peer-conn"]


def test_closing_a_server_joins_its_connection_threads_even_one_waiting_for_the_secret(tiny_dataset, isolated):
    """A connection that came before the job's secret was known waits for it (up to the
    handshake's timeout); ``close()`` refuses it and joins its thread before it returns."""
    index = Index.scan(tiny_dataset)
    cache = NodeCache("ab" * 8, index.sizes, index.total_bytes, directory=str(isolated), dataset=index.fingerprint)
    server = PeerServer(cache, index.fingerprint, len(index), "127.0.0.1")  # no secret yet
    s = _raw(server)
    try:
        _until(lambda: len(_conn_threads()) == 1, "the server starts the connection's thread")
        t0 = time.monotonic()
        server.close()
        assert _conn_threads() == []  # joined, not left waiting for the secret
        assert time.monotonic() - t0 < wire.HANDSHAKE_TIMEOUT / 2
        assert _drain(s) == b""  # refused: the connection closed, nothing said
    finally:
        s.close()
        server.close()
        cache.close()


def _hammer(server, index, out: Counter) -> None:
    """One authenticated peer asking for samples in a loop until its connection is closed."""
    try:
        s = _raw(server)
        _, _, nonce = wire.HELLO.unpack(wire.recv_exact(s, wire.HELLO.size))
        s.sendall(wire.client_proof(SECRET, index.fingerprint, nonce, 1))
        wire.recv_exact(s, wire.MAC)
    except (OSError, wire.WireError):
        out["refused"] += 1  # the server closed before this peer was in
        return
    ids = np.arange(0, len(index), 2)
    with s:
        while True:
            try:
                s.sendall(wire.pack_request(ids))
                head = wire.recv_exact(s, wire.HEAD.size + 8 * len(ids), time.monotonic() + WAIT)
                lengths = np.frombuffer(head[wire.HEAD.size :], "<i8")
                wire.recv_exact(s, int(lengths[lengths > 0].sum()), time.monotonic() + WAIT)
                out["answered"] += 1
            except (OSError, wire.WireError):  # refused: the connection was closed
                out["refused"] += 1
                return


def test_a_request_that_comes_as_the_server_closes_is_refused_and_never_reads_the_closed_cache(
    tiny_dataset, isolated, caplog
):
    """Peers asking without pause while the server closes and then the cache (as a loader closes):
    the server's connection threads are joined before ``close()`` returns, so no late answer
    reads the closed cache; each peer sees its connection closed, no exception is logged."""
    index = Index.scan(tiny_dataset)
    caplog.set_level(logging.DEBUG, logger="coordl.fetch.peer_server")
    out: Counter = Counter()
    for _ in range(10):
        cache = NodeCache("ab" * 8, index.sizes, index.total_bytes, directory=str(isolated), dataset=index.fingerprint)
        fetcher = Fetcher(index, cache, drop_page_cache=False)
        for i in range(0, len(index), 2):
            fetcher.fetch(i)
        server = PeerServer(cache, index.fingerprint, len(index), "127.0.0.1")
        server.set_secret(SECRET)
        peers = [threading.Thread(target=_hammer, args=(server, index, out), daemon=True) for _ in range(8)]
        for t in peers:
            t.start()
        _until(lambda: out["answered"] >= 8, "the peers are being answered")
        server.close()
        cache.close()  # right after, as a loader's resources close
        for t in peers:
            t.join(WAIT)
        assert not any(t.is_alive() for t in peers)
    errors = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert errors == [], [r.getMessage() for r in errors]
    assert out["refused"] == 10 * 8  # every peer's connection was closed, whatever it was doing


def test_a_silent_peer_costs_one_timeout_then_is_left_alone(tiny_dataset):
    index = Index.scan(tiny_dataset)
    listener = socket.create_server(("127.0.0.1", 0))  # accepts (backlog) but never answers
    timeout = 0.5
    try:
        client = PeerClient(
            {1: [listener.getsockname()]}, SECRET, index.fingerprint, index.sizes, timeout=timeout, retry_after=30
        )
        t0 = time.monotonic()
        assert client.fetch(1, np.arange(8)) == {}
        assert timeout <= time.monotonic() - t0 < timeout + GUARD
        assert not client.alive(1) and client.failures == 1
        t0 = time.monotonic()
        assert client.fetch(1, np.arange(8)) == {}
        assert time.monotonic() - t0 < timeout  # no second timeout...
        assert _backlog(listener) == 1  # ...because it was not even asked: one connection in all
    finally:
        listener.close()


def _backlog(listener: socket.socket) -> int:
    """How many connections wait in ``listener``'s queue (taken out and closed)."""
    listener.setblocking(False)
    n = 0
    while True:
        try:
            conn, _ = listener.accept()
        except BlockingIOError:
            return n
        conn.close()
        n += 1


def test_a_peer_that_is_gone_fails_fast(tiny_dataset):
    index = Index.scan(tiny_dataset)
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    client = PeerClient({1: [("127.0.0.1", port)]}, SECRET, index.fingerprint, index.sizes, timeout=5, retry_after=30)
    t0 = time.monotonic()
    assert client.fetch(1, np.arange(8)) == {}
    assert time.monotonic() - t0 < 1.0


class _HolderMap:
    """What :meth:`PeerGroup.remote` reads, for a job of two nodes in which node 1 (a server the test
    runs) holds the samples ``held``: the holder map, this node's number (0) and the client. Its
    ``remote`` is the product's, so that a node left alone is not asked, as in a loader."""

    remote = PeerGroup.remote

    def __init__(self, n: int, held: np.ndarray, client: PeerClient):
        self.holder = np.full(n, -1, dtype=np.int64)
        self.holder[held] = 1
        self.node = 0
        self.client = client


def _fetch_ahead(index, peers, pool, disk=None) -> FetchAhead:
    """A pass's fetching without a cache: misses held by a peer from it, the rest from storage (and
    ``disk``, a local-storage tier, where given)."""
    fetcher = Fetcher(index, None, drop_page_cache=False, disk=disk)
    return FetchAhead(
        fetcher,
        [],
        index.labels,
        pool,
        threads=2,
        depth=1,
        on_error="raise",
        stop=threading.Event(),
        peers=peers,
        peer_pool=pool,
    )


def _exact(index, batch, ids) -> bool:
    """The batch holds ``ids``' bytes, each once, in order."""
    return batch.ids.tolist() == ids.tolist() and [d.tobytes() for d in batch.data] == [
        Path(index.paths[i]).read_bytes() for i in ids
    ]


RETRY = 2.0  # Peers(retry_after) below: short, so that it passes within the test
EARLY = 0.5  # how long before the earliest possible end of the retry_after the test asks once more


def test_a_peer_left_alone_is_asked_again_once_peer_retry_after_has_passed(served, caplog):
    """docs/multinode.md, faults: a node whose request failed (here, a timeout) is left alone for
    ``Peers(retry_after)`` seconds: its samples come from storage meanwhile, without asking it (no
    new timeout per batch, one warning); once retry_after has passed it is asked again and serves.
    Checked through the fetcher's counters, with the holder map's own ``remote``."""
    index, server = served  # the cache node 1 serves once it is back: it holds the even samples
    timeout = 1.0
    listener = socket.create_server(("127.0.0.1", 0))  # node 1 at first: it accepts, and never answers
    addr = listener.getsockname()
    client = PeerClient({1: [addr]}, SECRET, index.fingerprint, index.sizes, timeout=timeout, retry_after=RETRY)
    held = np.arange(0, N, 2)
    batches = iter(np.arange(N, dtype=np.int64).reshape(-1, 12))  # 6 even samples in each
    back = None
    with cf.ThreadPoolExecutor(4) as pool, caplog.at_level(logging.WARNING, logger="coordl"):
        ahead = _fetch_ahead(index, _HolderMap(N, held, client), pool)
        c = ahead.fetcher.counters
        try:
            ids = next(batches)
            t0 = time.monotonic()
            batch = ahead.collect(ids)
            t1 = time.monotonic()
            assert _exact(index, batch, ids)
            assert timeout <= t1 - t0 < timeout + GUARD  # the request waited its timeout, then storage
            assert (c.peer_reads, c.storage_reads, client.failures) == (0, 12, 1)
            listener.close()
            asked = c.peer_ns  # time spent asking node 1: it grows only when node 1 is asked
            # It failed at least `timeout` after t0 and at the latest at t1: left alone until then + RETRY.
            earliest, latest = t0 + timeout + RETRY, t1 + RETRY
            back = PeerServer(server.cache, index.fingerprint, len(index), *addr)  # node 1 answers again
            back.set_secret(SECRET)

            def left_alone(reads: int) -> None:
                ids = next(batches)
                t = time.monotonic()
                batch = ahead.collect(ids)
                assert _exact(index, batch, ids)
                assert time.monotonic() - t < timeout  # no new timeout...
                assert c.peer_ns == asked and back.counters() == (0, 0)  # ...because node 1 was not even asked
                assert (c.peer_reads, c.storage_reads, client.failures) == (0, reads, 1)

            left_alone(24)  # at once
            time.sleep(max(0.0, earliest - EARLY - time.monotonic()))
            asked_at = time.monotonic()
            assert asked_at < earliest, f"the test slept past the window ({asked_at - earliest:.2f} s)"
            left_alone(36)  # shortly before the earliest end of the window
            time.sleep(max(0.0, latest - time.monotonic()) + 0.01)
            ids = next(batches)
            batch = ahead.collect(ids)  # retry_after has passed: node 1 is asked again, and serves
            assert _exact(index, batch, ids)
            assert back.counters()[0] == 6 and client.failures == 1
            assert (c.peer_reads, c.storage_reads) == (6, 42)  # its 6 from it, the other 6 from storage
        finally:
            listener.close()
            client.close()
            if back is not None:
                back.close()
    assert sum(LEFT_ALONE in r.getMessage() for r in caplog.records) == 1  # one warning, not one per batch


def _stalling_server(index, whole: int, trickle: bool):
    """A fake peer on 127.0.0.1 that holds every sample: it answers ``whole`` requests, sends
    half of the next answer, then nothing until the returned event is set; with ``trickle``, one
    byte every 20 ms first, for 5 s (so that no single read waits long, and the request does)."""
    listener = socket.create_server(("127.0.0.1", 0))
    release = threading.Event()

    def run():
        conn, _ = listener.accept()
        try:
            wire.server_handshake(conn, SECRET, index.fingerprint)
            for k in range(whole + 1):
                ids = wire.read_frame(conn, len(index), 5)
                lengths = np.array([index.sizes[i] for i in ids], dtype="<i8")
                body = b"".join(Path(index.paths[i]).read_bytes() for i in ids)
                answer = wire.HEAD.pack(wire.RESPONSE, len(ids)) + lengths.tobytes() + body
                conn.sendall(answer if k < whole else answer[: len(answer) // 2])
            rest = answer[len(answer) // 2 :]
            for b in range(250 if trickle else 0):
                if release.wait(0.02):
                    break
                conn.sendall(rest[b : b + 1])
            release.wait(WAIT)
        except OSError:  # the client closed the connection at its timeout
            pass
        finally:
            conn.close()
            listener.close()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return listener.getsockname(), release, thread


@pytest.mark.parametrize("trickle", [False, True], ids=["stalls", "trickles"])
def test_a_peer_that_answers_part_of_a_request_then_stalls_costs_one_timeout(tiny_dataset, monkeypatch, trickle):
    """docs/multinode.md, faults: a request may take ``Peers(timeout)`` seconds, whatever the peer
    sends meanwhile. The samples of the requests a peer answered are kept; those of the one it left
    half-sent (then sent nothing more, or a byte now and then) come from storage one ``timeout``
    later, each sample once and with its bytes; and the peer is left alone."""
    import coordl.fetch.peer_client as peer

    index = Index.scan(tiny_dataset)
    ids = np.arange(0, 40, dtype=np.int64)
    timeout = 0.5
    monkeypatch.setattr(peer, "MAX_REQUEST_BYTES", int(index.sizes[ids].sum()) // 3)
    addr, release, thread = _stalling_server(index, whole=1, trickle=trickle)
    client = PeerClient({1: [addr]}, SECRET, index.fingerprint, index.sizes, timeout=timeout, retry_after=30)
    first = next(client._requests(ids))
    try:
        with cf.ThreadPoolExecutor(2) as pool:
            ahead = _fetch_ahead(index, _HolderMap(len(index), np.arange(len(index)), client), pool)
            t0 = time.monotonic()
            batch = ahead.collect(ids)
            took = time.monotonic() - t0
    finally:
        release.set()
        thread.join(5)
        client.close()
    assert _exact(index, batch, ids)
    c = ahead.fetcher.counters
    assert (c.peer_reads, c.storage_reads) == (len(first), len(ids) - len(first))
    assert timeout <= took < timeout + GUARD, took
    assert not client.alive(1)


@pytest.mark.parametrize("peers_first", [False, True], ids=["tier-first", "peers-first"])
def test_a_peer_s_samples_are_written_to_the_local_tier_once(served, tmp_path, peers_first):
    """docs/disk-tier.md: what another node's memory sends is handed to the local tier's writer with
    what storage sends, so the tier holds every sample after one pass; the next pass reads them all
    from the tier, or (Disk(peers_first=True)) takes the peer's from the peer again and writes none of
    them twice. Node 1 is a real server holding the even samples."""
    from coordl.fetch.disk import DiskTier

    index, server = served
    client = _client(index, server)
    tier = DiskTier(str(tmp_path / "tier"), peers_first=peers_first)
    ids = np.arange(N, dtype=np.int64)
    passes = []
    try:
        for _ in range(2):
            with cf.ThreadPoolExecutor(2) as pool:
                ahead = _fetch_ahead(index, _HolderMap(N, np.arange(0, N, 2), client), pool, disk=tier)
                batch = ahead.collect(ids)
            assert _exact(index, batch, ids)
            assert tier.flush(WAIT)
            passes.append(ahead.fetcher.counters)
        entries = [p for p in (tmp_path / "tier").rglob("*") if p.is_file() and len(p.name) == 32]
    finally:
        client.close()
        tier.close()
    first, second = passes
    assert (first.peer_reads, first.storage_reads, first.disk_admitted) == (N // 2, N // 2, N)
    assert len(entries) == N and tier.written == N
    if peers_first:  # asked first again: what the peer sends is in the tier already, and not written again
        assert (second.peer_reads, second.disk_reads, second.disk_admitted) == (N // 2, N // 2, 0)
    else:
        assert (second.peer_reads, second.disk_reads, second.disk_admitted) == (0, N, 0)
    assert second.storage_reads == 0


# -- lingering -----------------------------------------------------------------------------------
def _linger(server, passes: int, bound: float):
    """Runs ``server.linger`` in a thread; the result: (ranks it stopped waiting for, seconds)."""
    out = {}

    def run():
        t0 = time.monotonic()
        out["waiting"] = server.linger(passes, bound)
        out["ended"] = time.monotonic()
        out["took"] = out["ended"] - t0

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def _until(condition, what: str) -> None:
    """Waits until ``condition()`` holds (the other side has reached a point), failing after a guard."""
    deadline = time.monotonic() + WAIT
    while not condition():
        assert time.monotonic() < deadline, f"not within {WAIT} s (a hang guard): {what}"
        time.sleep(0.005)


def _rank(server, index, rank: int) -> PeerClient:
    return PeerClient(
        {1: [server.address]}, SECRET, index.fingerprint, index.sizes, timeout=2, retry_after=30, rank=rank
    )


def test_a_closing_server_serves_until_every_rank_of_the_other_nodes_has_finished_the_pass(served):
    index, server = served
    server.expect([1, 2], 1)
    one, two = _rank(server, index, 1), _rank(server, index, 2)
    assert sorted(two.fetch(1, np.arange(6))) == [0, 2, 4]  # rank 2 keeps that connection
    thread, out = _linger(server, 1, 30)
    assert one.tell_done(1, time.monotonic() + 2) == []  # on a connection of its own, closed after
    _until(lambda: server.pending(1) == [2], "the server reads rank 1's word")  # rank 2 is still in its pass...
    assert sorted(two.fetch(1, np.arange(6, 12))) == [6, 8, 10]  # ...and served
    told = time.monotonic()
    assert two.tell_done(1, time.monotonic() + 2) == []
    thread.join(WAIT)
    assert not thread.is_alive(), f"still lingering after {WAIT} s"
    assert out["waiting"] == [] and told <= out["ended"] < told + GUARD  # it waited for rank 2's word, no longer
    assert len(two._idle[server.address]) == 1 and not one._idle[server.address]
    server.expect([1, 2], 2)  # the next pass: both are waited for again
    assert server.pending(2) == [1, 2]
    one.close()
    two.close()


def test_a_rank_whose_connections_close_in_its_pass_is_not_waited_for(served):
    """A rank killed in its pass: the kernel closes its connections, and the server stops waiting."""
    index, server = served
    server.expect([1], 1)
    client = _rank(server, index, 1)
    assert len(client.fetch(1, np.arange(4))) == 2
    assert server.pending(1) == [1]
    thread, out = _linger(server, 1, 30)
    closed = time.monotonic()
    client.close()  # as the kernel does for a killed process
    thread.join(WAIT)
    assert not thread.is_alive(), f"still lingering after {WAIT} s"
    assert out["waiting"] == [] and closed <= out["ended"] < closed + GUARD  # it waited for that, no longer


def test_a_silent_rank_costs_at_most_the_linger_counted_from_the_last_frame(served):
    """A rank that is stuck (connected, but never done) or that never connected is waited for
    ``bound`` seconds after the last frame the server received, then the server stops waiting."""
    index, server = served
    server.expect([1, 2], 1)  # rank 2 never connects
    client = _rank(server, index, 1)
    bound = 1.0
    thread, out = _linger(server, 1, bound)
    for _ in range(3):  # a rank still fetching keeps the server serving past the bound
        time.sleep(0.5)
        sent = time.monotonic()
        assert len(client.fetch(1, np.arange(2))) == 1
    last = time.monotonic()
    thread.join(WAIT)
    assert not thread.is_alive(), f"still lingering after {WAIT} s"
    assert out["waiting"] == [1, 2]
    assert sent + bound <= out["ended"] < last + bound + GUARD, (out, sent, last)  # counted from the last frame
    client.close()


def test_a_server_that_turns_connections_away_is_told_again(served, monkeypatch):
    """Every rank tells every server at the end of a pass: one with too many connections at that
    moment closes some at once, and those ranks tell it again; a server that is gone is not."""
    import coordl.fetch.peer_server as peer_server

    index, server = served
    server.expect([1], 1)
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    gone = s.getsockname()
    s.close()  # nothing listens there now
    monkeypatch.setattr(peer_server, "MAX_CONNECTIONS", 0)  # the server turns every connection away...
    connect, tries = socket.create_connection, Counter()

    def counting(address, *args, **kwargs):
        tries[tuple(address)] += 1
        if tuple(address) == server.address and tries[server.address] == 2:  # ...until the client tries again
            monkeypatch.setattr(peer_server, "MAX_CONNECTIONS", 256)
        return connect(address, *args, **kwargs)

    monkeypatch.setattr(socket, "create_connection", counting)
    client = PeerClient(
        {1: [server.address], 2: [gone]}, SECRET, index.fingerprint, index.sizes, timeout=2, retry_after=30, rank=1
    )
    assert client.tell_done(1, time.monotonic() + 3) == [gone]
    assert tries == {server.address: 2, gone: 1}  # turned away once, then told; the gone one not asked again
    thread, out = _linger(server, 1, 5)  # returns once the server has read it
    thread.join(WAIT)
    assert out["waiting"] == [] and out["took"] < GUARD
    client.close()


def test_the_linger_is_validated():
    assert coordl.Peers(timeout=4).linger is None and coordl.Peers(linger=0).linger == 0
    for bad in (-1, float("nan")):
        with pytest.raises(ValueError, match=r"Peers\(linger\) must be non-negative"):
            coordl.Peers(linger=bad)


def test_only_the_ranks_of_other_nodes_are_served(served):
    index, server = served
    server.expect([1], 1)
    stranger = _rank(server, index, 7)
    assert stranger.fetch(1, np.arange(4)) == {}
    assert server.rejected == 1 and server.counters() == (0, 0)
    stranger.close()


# -- addresses ---------------------------------------------------------------------------------
def test_the_advertised_address_follows_the_configuration(monkeypatch):
    for var in ("COORDL_PEER_ADDR", "COORDL_PEER_IFNAME", "GLOO_SOCKET_IFNAME", "MASTER_ADDR"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(CoordlError, match="COORDL_PEER_IFNAME"):
        advertised_address()
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")  # every node on this machine: loopback is right
    assert advertised_address() == "127.0.0.1"
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    assert advertised_address() == "127.0.0.1"
    assert advertised_address(interface="lo") == "127.0.0.1"
    with pytest.raises(CoordlError, match="no-such-if0"):
        advertised_address(interface="no-such-if0")
    monkeypatch.setenv("COORDL_PEER_ADDR", "127.0.0.9")
    assert advertised_address() == "127.0.0.9"


def test_peers_true_without_a_distributed_job_says_why(tiny_dataset):
    # Where the job runs is known when its first pass starts (a framework starts the process group
    # after the script made its loaders): that is when peers=True is refused, once.
    with CoordLoader(tiny_dataset, batch_size=8, device_id=None, peers=True, pipeline="imagenet-train") as loader:
        with pytest.raises(ValueError, match="peers=True, but the partitioned cache cannot run: .*init_process_group"):
            iter(loader)
    # What the loader is, when it is made.
    with pytest.raises(ValueError, match="peers=True, but .*: an hp_group shares prep within one node"):
        CoordLoader(tiny_dataset, device_id=None, peers=True, hp_group="g", pipeline="imagenet-train")
    with CoordLoader(
        tiny_dataset, batch_size=8, device_id=None, shuffle=True, pipeline="imagenet-train"
    ) as loader:  # "auto": off, quietly
        assert loader.resources.peers is None


# -- real multi-node jobs ----------------------------------------------------------------------
NS_REASON = "COORDL_TEST_NO_NETNS is set" if os.environ.get("COORDL_TEST_NO_NETNS") else netns.unavailable()
_port = [29600 + os.getpid() % 200]


def _run_nodes(
    data: Path,
    out: Path,
    nodes: int,
    args: list[str],
    per_node: int = 1,
    timeout: float = 240,
    until=None,
    leftovers: list | None = None,
    loopback: bool = False,
) -> list:
    """Runs multinode_train.py on ``nodes`` nodes; returns each torchrun's exit code (-9: killed
    at ``timeout``, or once ``until()`` is true). ``loopback`` runs the nodes on loopback addresses
    with a shm folder each. What the nodes leave in their /dev/shm (their shm folder) after the
    run goes into ``leftovers``."""
    _port[0] += 1
    out.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("COORDL_SHM")}
    env["PYTHONPATH"] = os.pathsep.join([str(HERE.parent / "src"), env.get("PYTHONPATH", "")])
    script = [str(HERE / "multinode_train.py"), str(data), str(out), *args]
    logs = []  # the nodes' stderr files, closed here once the nodes end

    def log(k: int):
        logs.append(open(out / f"node{k}.log", "w"))  # noqa: SIM115 - closed after the nodes end
        return logs[-1]

    def torchrun(k, master):
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            str(nodes),
            "--node_rank",
            str(k),
            "--nproc_per_node",
            str(per_node),
            "--master_addr",
            master,
            "--master_port",
            str(_port[0]),
            # each rank's stderr also into a file of its own (_rank_logs): the agent's log lines
            # are torchrun's, not the script's
            "--tee",
            "2",
            "--log-dir",
            str(out / f"ranks{k}"),
            *script,
        ]

    if NS_REASON is None and not loopback:

        def listing(k: int, argv: list[str]) -> list[str]:
            """``argv``, then what it left in the node's own /dev/shm, listed into a file."""
            if leftovers is None:
                return argv
            shm = out / f"node{k}.shm"
            return ["sh", "-c", f'"$@"; rc=$?; ls -A /dev/shm > {shm}; exit $rc', "sh", *argv]

        with netns.Cluster(nodes, shm_bytes=256 << 20) as c:  # 64 MiB of it stay free (headroom)
            env["GLOO_SOCKET_IFNAME"] = "eth0"
            procs = [
                c.popen(
                    k,
                    listing(k, torchrun(k, c.address(0))),
                    env=env,
                    stdout=subprocess.DEVNULL,
                    stderr=log(k),
                )
                for k in range(nodes)
            ]
            try:
                return _wait_all(procs, timeout, until)
            finally:
                for f in logs:
                    f.close()
                for k in range(nodes):
                    shm = out / f"node{k}.shm"
                    if leftovers is not None:
                        names = shm.read_text().split() if shm.exists() else ["(not listed: the node was killed)"]
                        leftovers += [f"node {k}: {name}" for name in names]
    procs = []
    for k in range(nodes):
        shm = Path(f"/dev/shm/coordl-test-node{os.getpid()}-{k}")
        shm.mkdir(exist_ok=True)
        node_env = dict(env, COORDL_SHM_DIR=str(shm), COORDL_PEER_ADDR=f"127.0.0.{k + 1}")
        procs.append(
            subprocess.Popen(
                torchrun(k, "127.0.0.1"),
                env=node_env,
                stdout=subprocess.DEVNULL,
                stderr=log(k),
                start_new_session=True,
            )
        )
    try:
        return _wait_all(procs, timeout, until)
    finally:
        for f in logs:
            f.close()
        for k in range(nodes):
            shm = f"/dev/shm/coordl-test-node{os.getpid()}-{k}"
            if leftovers is not None:
                leftovers += [f"node {k}: {name}" for name in os.listdir(shm)]
            subprocess.run(["rm", "-rf", shm])


def _wait_all(procs: list[subprocess.Popen], timeout: float, until) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        if until is not None and until():
            break
        time.sleep(0.2)
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, 9)
            p.wait()
    return [p.returncode for p in procs]


def _records(out: Path, world: int) -> list[dict]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def _logs(out: Path) -> str:
    """What the nodes wrote to stderr: their torchrun agents' lines and their ranks'."""
    return "\n".join(p.read_text()[-3000:] for p in sorted(out.glob("node*.log")))


def _rank_logs(out: Path, node: int | str = "*") -> str:
    """What the training scripts (the ranks) wrote to stderr, without their torchrun agents'
    lines: an agent may log a traceback of its own, as when the last agent to reach torchrun's
    exit barrier finds the store already closed by the agent that hosted it (torch's race, not
    the script's)."""
    return "\n".join(p.read_text() for p in sorted(out.glob(f"ranks{node}/**/stderr.log")))


def test_ranks_that_break_out_and_end_without_close_exit_cleanly_and_leave_nothing(tiny_dataset, tmp_path):
    """Two nodes with peers break out of their last epoch and end without close(): exit 0, no
    traceback or abort in their logs, and their shared memory released by the processes themselves."""
    out, left = tmp_path / "out", []
    codes = _run_nodes(
        tiny_dataset, out, 2, ["--epochs", "2", "--cache", "0.6", "--leave-at", "2"], leftovers=left, loopback=True
    )
    logs, ranks = _logs(out), _rank_logs(out)
    assert codes == [0, 0], logs
    for bad in ("Traceback", "terminate called", "Exception ignored", "AssertionError"):
        assert bad not in ranks, logs
    assert left == [], f"left in shared memory: {left}"
    recs = _records(out, 2)
    assert all(r["epochs"][1]["stats"]["peer_reads"] + r["epochs"][1]["stats"]["cache_hits"] > 0 for r in recs)


@pytest.mark.parametrize("locality", [0, 1], ids=["partitioned", "locality-aware"])
def test_two_nodes_read_storage_only_in_the_first_epoch_and_deliver_every_sample_once(tiny_dataset, tmp_path, locality):
    out = tmp_path / "out"
    codes = _run_nodes(tiny_dataset, out, 2, ["--epochs", "3", "--cache", "0.6", "--locality", str(locality)])
    assert codes == [0, 0], _logs(out)
    recs = _records(out, 2)
    total_received = total_served = 0
    for epoch in range(3):
        seen = Counter(i for r in recs for b in r["epochs"][epoch]["batches"] for i in b)
        assert sorted(seen) == list(range(N)) and set(seen.values()) == {1}, f"epoch {epoch} not exactly-once"
        stats = [r["epochs"][epoch]["stats"] for r in recs]
        if epoch == 0:
            assert sum(s["storage_reads"] for s in stats) == N and sum(s["peer_reads"] for s in stats) == 0
        else:
            assert [s["storage_reads"] for s in stats] == [0, 0], stats  # the two caches hold it all
            assert sum(s["cache_hits"] + s["peer_reads"] for s in stats) == N
        total_received += sum(s["peer_bytes"] for s in stats)
        total_served += sum(s["peer_served_bytes"] for s in stats)
        # The global batches are the plain sampler's; only who gets which sample may change.
        order = sampler.epoch_order(N, 5, epoch)
        for k in range(len(recs[0]["epochs"][epoch]["batches"])):
            plain = sorted(order[k * 16 : (k + 1) * 16].tolist())
            assert sorted(recs[0]["epochs"][epoch]["batches"][k] + recs[1]["epochs"][epoch]["batches"][k]) == plain
            assert len(recs[0]["epochs"][epoch]["batches"][k]) == len(recs[1]["epochs"][epoch]["batches"][k])
    # Served bytes count while the serving rank's own pass runs; a peer's last requests may come after.
    assert 0 < total_served <= total_received
    steady = sum(r["epochs"][e]["stats"]["peer_reads"] for r in recs for e in (1, 2))
    if not locality:
        assert steady > N // 2  # about half of every rank's samples are on the other node
    else:
        assert steady < N // 4  # each rank takes what its node holds


def test_four_ranks_on_two_nodes_share_each_nodes_cache(tiny_dataset, tmp_path):
    out = tmp_path / "out"
    codes = _run_nodes(tiny_dataset, out, 2, ["--epochs", "2", "--cache", "0.6", "-b", "6"], per_node=2)
    assert codes == [0, 0], _logs(out)
    recs = _records(out, 4)
    for epoch in range(2):
        seen = Counter(i for r in recs for b in r["epochs"][epoch]["batches"] for i in b)
        assert sorted(seen) == list(range(N)) and set(seen.values()) == {1}
    assert sum(r["epochs"][1]["stats"]["storage_reads"] for r in recs) == 0
    assert sum(r["epochs"][0]["stats"]["storage_reads"] for r in recs) == N


def test_a_killed_peer_costs_a_timeout_and_the_others_finish_the_epoch(tiny_dataset, tmp_path):
    out = tmp_path / "out"
    args = [
        "--epochs",
        "2",
        "--cache",
        "0.6",
        "--locality",
        "0",
        "--die-rank",
        "1",
        "--die-at",
        "1,0",
        "-b",
        "4",
        "--step-ms",
        "30",
        "--peer-timeout",
        "3",
    ]

    def survivor_done():
        try:
            return len(_records(out, 1)[0]["epochs"]) == 2
        except (OSError, ValueError):  # not written yet, or being written
            return False

    # torchrun's agent of the surviving node then waits for the dead node's agent at its exit
    # barrier, so the test stops watching once the survivor's training loop is done.
    t0 = time.monotonic()
    codes = _run_nodes(tiny_dataset, out, 2, args, timeout=90, until=survivor_done)
    assert survivor_done(), _logs(out)
    assert codes[1] != 0
    assert time.monotonic() - t0 < 60
    last = _records(out, 1)[0]["epochs"][1]
    ids = [i for b in last["batches"] for i in b]
    order = sampler.epoch_order(N, 5, 1)
    assert sorted(ids) == sorted(order[0::2].tolist())  # its whole shard, each sample once
    assert last["stats"]["storage_reads"] > 0  # what the dead node held came from storage
    assert "reading its samples from storage" in _logs(out)


def test_nodes_whose_last_epochs_end_out_of_step_keep_serving_each_other(tiny_dataset, tmp_path):
    """Rank 1 stalls in its last epoch, so node 0 ends its script and closes its loader first
    (no barrier before): node 0's server keeps serving until node 1 is done, so node 1 reads
    nothing from storage that node 0 holds and warns of no failed peer; both exit 0 and leave
    nothing in /dev/shm."""
    out, left = tmp_path / "out", []
    args = ["--epochs", "2", "--cache", "0.6", "--locality", "0", "--stall", "1,1,1,6"]
    codes = _run_nodes(tiny_dataset, out, 2, args, leftovers=left)
    logs, ranks = _logs(out), _rank_logs(out)
    assert codes == [0, 0], logs
    assert "coordl: peer node" not in ranks and "Traceback" not in ranks, logs  # no peer failed
    assert left == [], f"left in shared memory: {left}"
    recs = _records(out, 2)
    last = [r["epochs"][1]["stats"] for r in recs]
    assert [s["storage_reads"] for s in last] == [0, 0], last  # the two caches hold it all
    assert last[1]["peer_reads"] > 0  # node 1 still read from node 0 after node 0 had closed
    assert recs[0]["close_s"] > 3  # node 0 waited for node 1 (stalled for 6 s) to finish


def test_a_node_that_closes_first_waits_only_for_the_others_pass_not_their_script(tiny_dataset, tmp_path):
    """Rank 1 ends its last epoch, then spends 8 s before it closes its loader (an evaluation, a
    checkpoint): node 0, which closes at once, stops serving when rank 1's pass is done
    (``pass_done()`` at the end of every pass), not when its script is."""
    out = tmp_path / "out"
    args = ["--epochs", "2", "--cache", "0.6", "--locality", "0", "--sleep-before-close", "1,8"]
    codes = _run_nodes(tiny_dataset, out, 2, args)
    assert codes == [0, 0], _logs(out)
    recs = _records(out, 2)
    assert [r["epochs"][1]["stats"]["storage_reads"] for r in recs] == [0, 0]
    assert recs[0]["close_s"] < 4, recs[0]["close_s"]


@pytest.mark.parametrize(
    "fault", [["--die-rank", "1", "--die-at", "1,1"], ["--stall", "1,1,1,600"]], ids=["killed", "stuck"]
)
def test_a_node_waits_at_most_the_linger_for_a_peer_that_never_finishes(tiny_dataset, tmp_path, fault):
    """Rank 1 is killed, or stuck for good, in its last epoch. Node 0 ends its epoch and closes its
    loader: for a killed peer at once (its connections closed), for a stuck one after the linger
    (3 x Peers(timeout) = 6 s here) with nothing from it."""
    out = tmp_path / "out"
    args = ["--epochs", "2", "--cache", "0.6", "--locality", "0", "--peer-timeout", "2", *fault]

    def closed():
        try:
            return "close_s" in _records(out, 1)[0]
        except (OSError, ValueError):  # not written yet
            return False

    codes = _run_nodes(tiny_dataset, out, 2, args, timeout=90, until=closed)
    assert closed(), _logs(out)
    assert codes[1] != 0  # killed, or stopped by the test
    rec = _records(out, 1)[0]
    assert [e["epoch"] for e in rec["epochs"]] == [0, 1] and "Traceback" not in _rank_logs(out, 0), _logs(out)
    if fault[0] == "--die-rank":
        assert rec["close_s"] < 3, rec["close_s"]
    else:
        assert 5 < rec["close_s"] < 12, rec["close_s"]


def test_a_node_stopped_by_sigterm_does_not_wait_for_the_others(tiny_dataset, tmp_path):
    """Rank 1 is stuck in its last epoch (its server still up); rank 0 gets SIGTERM after its own
    (a preempted job): its loader closes without waiting the linger (30 s here) for rank 1, its
    server's connection threads joined within the SIGTERM deadline, and it ends by SIGTERM within 2 s."""
    out = tmp_path / "out"
    args = ["--epochs", "2", "--cache", "0.6", "--locality", "0", "--stall", "1,1,1,600", "--sigterm-at-end", "0"]

    gone_at = []  # when rank 0's process was first seen gone

    def ended():
        try:
            rec = _records(out, 1)[0]
        except (OSError, ValueError):  # not written yet
            return False
        if "pid" in rec and not os.path.exists(f"/proc/{rec['pid']}") and not gone_at:
            gone_at.append(time.time())
        # and its torchrun agent has reported how it ended (it may take a moment after)
        return bool(gone_at) and "(exitcode" in (out / "node0.log").read_text()

    codes = _run_nodes(tiny_dataset, out, 2, args, timeout=90, until=ended)
    assert gone_at, _logs(out)
    took = gone_at[0] - _records(out, 1)[0]["sigterm_at"]
    assert took < 2, (took, codes)  # seen gone within 2 s (it is looked for every 0.2 s)
    log = (out / "node0.log").read_text()
    assert "(exitcode: -15)" in log and "src/coordl" not in log, log  # ended by SIGTERM, no traceback of coordl's
    assert "peer connection failed" not in log, log  # nor an exception of its server's connection threads


def _delivered(recs: list[dict], epoch: int) -> Counter:
    """How many times each sample of ``epoch`` was delivered, over every rank."""
    return Counter(i for r in recs for e in r["epochs"] if e["epoch"] == epoch for b in e["batches"] for i in b)


@pytest.mark.parametrize("nodes, per_node", [(2, 1), (2, 2), (3, 1)], ids=["same", "2-ranks-a-node", "3-nodes"])
def test_a_state_from_rank_0_resumes_every_rank_of_a_multinode_job(tiny_dataset, tmp_path, nodes, per_node):
    """Two nodes of one rank stop after 3 batches of epoch 0, and the job restarts on ``nodes``
    nodes of ``per_node`` ranks from rank 0's ``state_dict()`` alone. The rest of epoch 0 is
    exactly the samples not delivered before (each once, beyond ``DistributedSampler``'s
    padding), in the global batches that order gives them; epoch 1 follows the new world."""
    common = ["--epochs", "2", "--cache", "0.6", "-b", "5"]
    out = tmp_path / "before"
    codes = _run_nodes(tiny_dataset, out, 2, [*common, "--stop-at", "0,3"])
    assert codes == [0, 0], _logs(out)
    recs = _records(out, 2)
    state = recs[0]["state"]
    assert all(r["state"] == state for r in recs) and "rank" not in state  # every rank's is rank 0's
    assert (state["epoch"], state["batches"], state["world_size"]) == (0, 3, 2)
    before = _delivered(recs, 0)
    assert len(before) == 2 * 3 * 5 and set(before.values()) == {1}
    saved = tmp_path / "state.json"
    saved.write_text(json.dumps(state))  # the checkpoint: rank 0's state only

    out = tmp_path / "after"
    world = nodes * per_node
    codes = _run_nodes(tiny_dataset, out, nodes, [*common, "--resume", str(saved)], per_node=per_node)
    assert codes == [0] * nodes, _logs(out)
    recs = _records(out, world)
    assert all(r["world_size"] == world and [e["epoch"] for e in r["epochs"]] == [0, 1] for r in recs)
    after = _delivered(recs, 0)
    left = N - len(before)
    padding = -left % world  # DistributedSampler pads every rank's shard to ceil(left / world)
    assert set(after) == set(range(N)) - set(before)
    assert sum(after.values()) == left + padding and sum(after.values()) - len(after) == padding
    # The global batches: the epoch's order from where the job stopped, padded with its head.
    rest = sampler.epoch_order(N, 5, 0)[len(before) :].tolist()
    rest += rest[:padding]
    resumed = [r["epochs"][0]["batches"] for r in recs]
    assert {len(b) for b in resumed} == {-(-len(rest) // (world * 5))}
    for k in range(len(resumed[0])):
        assert sorted(i for b in resumed for i in b[k]) == sorted(rest[k * world * 5 : (k + 1) * world * 5]), k
    assert _delivered(recs, 1) == Counter(range(N))
