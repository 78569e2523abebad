"""The peer protocol of the partitioned cache: an authenticated handshake, then batched requests.

All integers are little-endian. A connection goes:

1. server -> client ``HELLO``: ``b"CDLH"``, version (u16), a 16-byte random nonce.
2. client -> server: ``HMAC-SHA256(secret, "coordl-peer-client" | dataset | server nonce |
   client nonce | rank)`` (32 bytes), its own 16-byte nonce, then its rank (u32). The server
   checks the MAC in constant time; a wrong one, or none within :data:`HANDSHAKE_TIMEOUT`,
   closes the connection before anything else is sent. The connection then speaks for that
   rank: while it is open, the rank is alive (the kernel closes it when the process dies).
3. server -> client: ``HMAC-SHA256(secret, "coordl-peer-server" | dataset | client nonce |
   server nonce)``, so the client knows it talks to a member of its own job and dataset.
4. Any number of frames from the client, each a header ``magic`` (4 bytes), ``n`` (u32):

   - request ``b"CDLQ"``, ``n`` = count (1..:data:`MAX_IDS`), then count sample ids (u64 each),
     answered before the next frame is read: ``b"CDLR"``, count (u32, the request's), count
     lengths (i64 each, -1 when the server does not hold that sample), then the held samples'
     bytes back to back;
   - done ``b"CDLD"``, ``n`` = a pass number: the rank has finished that pass of the loader
     and asks nothing more in it. Not answered.

The secret is made per job by rank 0 and handed out through the job's own process group.
Every length is checked against the dataset's index on both sides, so a frame can never
make either side allocate more than the samples it asked for.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import struct
import time
from typing import NamedTuple

import numpy as np

__all__ = [
    "MAX_IDS",
    "Done",
    "WireError",
    "client_handshake",
    "client_proof",
    "pack_done",
    "pack_request",
    "read_frame",
    "recv_exact",
    "server_handshake",
]

VERSION = 2
HELLO = struct.Struct("<4sH16s")
HEAD = struct.Struct("<4sI")
RANK = struct.Struct("<I")
REQUEST, RESPONSE, DONE = b"CDLQ", b"CDLR", b"CDLD"
MAX_IDS = 4096
NONCE = 16
MAC = 32
HANDSHAKE_TIMEOUT = 5.0


class WireError(Exception):
    """A peer broke the protocol (bad MAC, bad frame, closed early)."""


class Done(NamedTuple):
    """A done frame: the connection's rank has finished pass ``passes`` and asks nothing more in it."""

    passes: int


def _mac(secret: bytes, role: bytes, dataset: str, *fields: bytes) -> bytes:
    return hmac.new(secret, b"|".join([role, dataset.encode(), *fields]), hashlib.sha256).digest()


def client_proof(secret: bytes, dataset: str, server_nonce: bytes, rank: int) -> bytes:
    """The client's part of the handshake (step 2) for a server's nonce."""
    mine, who = os.urandom(NONCE), RANK.pack(rank)
    return _mac(secret, b"coordl-peer-client", dataset, server_nonce, mine, who) + mine + who


def recv_exact(sock: socket.socket, n: int, deadline: float | None = None) -> bytearray:
    """Reads exactly ``n`` bytes (before ``deadline``, a ``time.monotonic()`` value, if given)."""
    buf = bytearray(n)
    recv_into_exact(sock, memoryview(buf), deadline)
    return buf


def recv_into_exact(sock: socket.socket, view: memoryview, deadline: float | None = None) -> None:
    """Fills ``view`` from ``sock``.

    Raises:
        WireError: the peer closed the connection first.
        TimeoutError: ``deadline`` passed.
    """
    done = 0
    while done < len(view):
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("peer too slow")
            sock.settimeout(left)
        n = sock.recv_into(view[done:])
        if n == 0:
            raise WireError("connection closed by the peer")
        done += n


def server_handshake(sock: socket.socket, secret: bytes, dataset: str) -> int:
    """Authenticates the client on a fresh connection: its rank, or :class:`WireError` if it cannot."""
    nonce = os.urandom(NONCE)
    sock.sendall(HELLO.pack(b"CDLH", VERSION, nonce))
    reply = bytes(recv_exact(sock, MAC + NONCE + RANK.size, time.monotonic() + HANDSHAKE_TIMEOUT))
    mac, client_nonce, who = reply[:MAC], reply[MAC : MAC + NONCE], reply[MAC + NONCE :]
    if not hmac.compare_digest(mac, _mac(secret, b"coordl-peer-client", dataset, nonce, client_nonce, who)):
        raise WireError("client failed authentication")
    sock.sendall(_mac(secret, b"coordl-peer-server", dataset, client_nonce, nonce))
    return RANK.unpack(who)[0]


def client_handshake(sock: socket.socket, secret: bytes, dataset: str, deadline: float, rank: int) -> None:
    """Proves the job's secret (and says which rank speaks) to the server, and checks the server's proof."""
    magic, version, nonce = HELLO.unpack(recv_exact(sock, HELLO.size, deadline))
    if magic != b"CDLH" or version != VERSION:
        raise WireError(f"not a coordl peer (version {version})")
    proof = client_proof(secret, dataset, nonce, rank)
    sock.sendall(proof)
    mine = proof[MAC : MAC + NONCE]
    answer = bytes(recv_exact(sock, MAC, deadline))
    if not hmac.compare_digest(answer, _mac(secret, b"coordl-peer-server", dataset, mine, nonce)):
        raise WireError("server failed authentication")


def pack_request(ids: np.ndarray) -> bytes:
    ids = np.ascontiguousarray(ids, dtype="<u8")
    return HEAD.pack(REQUEST, len(ids)) + ids.tobytes()


def pack_done(passes: int) -> bytes:
    return HEAD.pack(DONE, passes)


def read_frame(sock: socket.socket, num_items: int, body_timeout: float) -> np.ndarray | Done | None:
    """The next frame from the client: a request's ids, a :class:`Done`, or None when the client
    closed the connection cleanly.

    Raises:
        WireError: the frame is malformed (bad magic, count, or an id outside the dataset).
    """
    sock.settimeout(None)  # an authenticated client may idle between epochs
    first = sock.recv(HEAD.size)
    if not first:
        return None
    head = bytes(first) + bytes(recv_exact(sock, HEAD.size - len(first), time.monotonic() + body_timeout))
    magic, count = HEAD.unpack(head)
    if magic == DONE:
        return Done(count)
    if magic != REQUEST or not 0 < count <= MAX_IDS:
        raise WireError(f"malformed request (magic {magic!r}, count {count})")
    ids = np.frombuffer(recv_exact(sock, 8 * count, time.monotonic() + body_timeout), dtype="<u8")
    if int(ids.max()) >= num_items:
        raise WireError(f"request for sample {int(ids.max())} of a dataset of {num_items}")
    return ids.astype(np.int64)
