"""A real S3-compatible server on localhost for tests and benchmarks, with request counts, latency and faults.

:class:`S3Server` starts moto's S3 server (``python -m moto.server``, a subprocess) and, in front of it, a small
HTTP/1.1 proxy (threads inside the calling process) on 127.0.0.1. Clients talk to :attr:`S3Server.endpoint`, the
proxy, which records every request (method, path, status, response body bytes), can add latency before forwarding
each request, can send response bodies no faster than a bandwidth (:attr:`S3Server.bandwidth_bps`, off by default),
and can answer chosen keys with an error (:meth:`S3Server.fail`) or stall them (:meth:`S3Server.hang`). Setup
(buckets, uploads) goes to :attr:`S3Server.direct`, moto itself, so it is not counted.

With ``auth=True`` moto checks SigV4 signatures and IAM permissions: the server creates an IAM user with an access
key allowed ``s3:*``, and only that key (:attr:`S3Server.access_key`, :attr:`S3Server.secret_key`) is accepted.

Needs ``moto[server]`` and ``boto3`` (imported lazily, so importing this module costs nothing). Used by the S3 tests
and benchmarks; it is test support, outside the installed package, and imports nothing from coordl.
"""

from __future__ import annotations

import fnmatch
import http.client
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

__all__ = ["S3Server", "free_port"]

# Headers that describe one hop, not the message: never relayed. Expect is answered by the proxy itself (and is not
# covered by SigV4 signatures, nor is Transfer-Encoding, so dropping them keeps signatures valid).
_HOP = frozenset(
    {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer", "upgrade", "expect"}
)

# Query parameters that still address one object (GET /b/k?versionId=..., boto3's ?x-id=GetObject, multipart
# parts); anything else (list-type, tagging, acl, uploads...) is not an object request for :meth:`S3Server.count`.
_OBJECT_PARAMS = frozenset(
    {"x-id", "versionid", "partnumber", "uploadid", "awsaccesskeyid", "signature", "expires"}  # and x-amz-*: presigned
)

_ERRORS = {
    400: ("BadRequest", "Bad Request"),
    403: ("AccessDenied", "Access Denied"),
    404: ("NoSuchKey", "The specified key does not exist."),
    500: ("InternalError", "We encountered an internal error. Please try again."),
    503: ("SlowDown", "Please reduce your request rate."),
}

_PACE = 64 * 1024  # bytes of a response body sent per slot of the bandwidth limit

_POLICY = '{"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}'


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _split(path: str) -> tuple[str, str, str]:
    """``(bucket, key, query)`` of a path-style request path; the key is URL-decoded, "" when there is none."""
    raw, _, query = path.partition("?")
    bucket, _, key = raw.lstrip("/").partition("/")
    return bucket, urllib.parse.unquote(key), query


def _is_object(path: str) -> bool:
    """Whether a request path names one object (a key after the bucket, no listing or sub-resource query)."""
    _, key, query = _split(path)
    if not key:
        return False
    names = {p.partition("=")[0].lower() for p in query.split("&") if p}
    return all(n in _OBJECT_PARAMS or n.startswith(("response-", "x-amz-")) for n in names)


def _error_body(status: int, key: str) -> bytes:
    code, message = _ERRORS.get(status, ("InternalError", http.client.responses.get(status, "Error")))
    rid = os.urandom(8).hex().upper()
    key = key.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    return (
        f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>{message}</Message>'
        f"<Key>{key}</Key><RequestId>{rid}</RequestId></Error>"
    ).encode()


@dataclass
class _Rule:
    """A fault for the next ``times`` requests of ``method`` whose key matches ``pattern``."""

    pattern: str
    method: str
    times: int
    status: int = 0  # fail: the status to answer with
    seconds: float = 0.0  # hang: how long to stall before forwarding

    def matches(self, method: str, key: str) -> bool:
        return self.times > 0 and self.method in (method, "*") and fnmatch.fnmatchcase(key, self.pattern)


class _Handler(BaseHTTPRequestHandler):
    """One client connection: forwards its requests to moto over one upstream connection of its own."""

    protocol_version = "HTTP/1.1"  # keep-alive, as the clients' connection pools expect
    disable_nagle_algorithm = True  # headers and body are separate writes: Nagle would stall each response ~40 ms
    server: _ProxyServer

    def log_message(self, format, *args) -> None:
        pass  # hundreds of requests per second in benchmarks: no per-request logging

    def setup(self) -> None:
        super().setup()
        self._up: http.client.HTTPConnection | None = None
        self.server.track(self.connection, True)

    def finish(self) -> None:
        try:
            super().finish()
        except OSError:
            pass  # the client went away mid-response
        if self._up is not None:
            self._up.close()
        self.server.track(self.connection, False)

    def do_GET(self) -> None:
        self._proxy()

    do_HEAD = do_PUT = do_POST = do_DELETE = do_GET

    def _body(self) -> bytes:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            parts = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass  # trailers: nothing here needs them
                    return b"".join(parts)
                parts.append(self.rfile.read(size))
                self.rfile.readline()
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n) if n else b""

    def _proxy(self) -> None:
        owner = self.server.owner
        method, path = self.command, self.path
        # The body is read first in every case, so that an answered-early request leaves the connection usable.
        body = self._body()
        _, key, _ = _split(path)
        # Faults are for object requests; a listing (no key) never matches, not even "*".
        hang, fail = owner._take_rules(method, key) if key else (None, None)
        delay = owner.latency_s + (hang.seconds if hang else 0.0)
        if hang is not None:
            # Recorded as it arrives, with status 0: the client usually gives up before the stall ends.
            owner._record(method, path, 0, 0)
        if delay > 0 and owner._stop.wait(delay):
            self.close_connection = True
            return
        if fail is not None:
            self._answer_error(fail.status, key)
            return
        try:
            status, reason, headers, data = self._forward(method, path, body)
        except (OSError, http.client.HTTPException):
            self._answer_error(502, key)
            return
        sent = 0 if method == "HEAD" else len(data)
        if hang is None:
            owner._record(method, path, status, sent)
        try:
            self.send_response_only(status, reason)
            bodiless = method == "HEAD" or status in (204, 304) or status < 200
            for name, value in headers:
                low = name.lower()
                if low in _HOP or (low == "content-length" and not bodiless):
                    continue
                self.send_header(name, value)
            if not bodiless:
                self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if not bodiless and data:
                self._send_body(data)
        except OSError:
            self.close_connection = True  # the client gave up (a timeout after hang()): nothing left to tell it

    def _send_body(self, data: bytes) -> None:
        """Writes a response body, paced by the server's bandwidth limit when it has one."""
        owner = self.server.owner
        bandwidth = owner.bandwidth_bps
        if not bandwidth:
            self.wfile.write(data)
            return
        view = memoryview(data)
        for at in range(0, len(view), _PACE):
            piece = view[at : at + _PACE]
            if owner._stop.wait(owner._pace(len(piece), bandwidth)):
                raise OSError("the server is closing")
            self.wfile.write(piece)

    def _forward(self, method: str, path: str, body: bytes) -> tuple[int, str, list[tuple[str, str]], bytes]:
        """Sends the request to moto unchanged (Host included: SigV4 signs it) and reads the whole response."""
        for attempt in range(2):
            if self._up is None:
                self._up = http.client.HTTPConnection("127.0.0.1", self.server.upstream_port, timeout=60)
            try:
                self._up.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
                chunked = "chunked" in self.headers.get("Transfer-Encoding", "").lower()
                for name, value in self.headers.items():
                    if name.lower() not in _HOP and not (chunked and name.lower() == "content-length"):
                        self._up.putheader(name, value)
                if chunked:  # sent on de-chunked, so it needs a length
                    self._up.putheader("Content-Length", str(len(body)))
                self._up.endheaders(body or None)
                resp = self._up.getresponse()
                data = resp.read()
                if resp.will_close:
                    self._up.close()
                    self._up = None
                return resp.status, resp.reason, resp.getheaders(), data
            except (OSError, http.client.HTTPException):
                # moto may have closed an idle keep-alive connection: one retry on a fresh one.
                self._up.close()
                self._up = None
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def _answer_error(self, status: int, key: str) -> None:
        data = b"" if self.command == "HEAD" else _error_body(status, key)
        self.server.owner._record(self.command, self.path, status, len(data))
        try:
            self.send_response_only(status)
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(data)))
            self.send_header("x-amz-request-id", "S3SERVERFAULT")
            self.end_headers()
            if data:
                self.wfile.write(data)
        except OSError:
            self.close_connection = True


class _ProxyServer(ThreadingHTTPServer):
    """A threading HTTP server whose connection threads are named ``s3proxy-*`` and can all be stopped."""

    daemon_threads = True
    block_on_close = False  # close() joins the threads itself, with a timeout

    def __init__(self, owner: S3Server, upstream_port: int):
        self.owner = owner
        self.upstream_port = upstream_port
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._conn_threads: set[threading.Thread] = set()
        self._n = 0
        super().__init__(("127.0.0.1", 0), _Handler)

    def track(self, conn: socket.socket, alive: bool) -> None:
        with self._lock:
            (self._conns.add if alive else self._conns.discard)(conn)

    def handle_error(self, request, client_address) -> None:
        if not isinstance(sys.exc_info()[1], OSError):
            super().handle_error(request, client_address)
        # else: a client reset its connection (a timeout, close() shutting sockets down): normal here, not news

    def process_request(self, request, client_address) -> None:
        with self._lock:
            self._n += 1
            t = threading.Thread(
                target=self._serve_one, args=(request, client_address), name=f"s3proxy-conn-{self._n}", daemon=True
            )
            self._conn_threads.add(t)
        t.start()

    def _serve_one(self, request, client_address) -> None:
        try:
            self.process_request_thread(request, client_address)
        finally:
            with self._lock:
                self._conn_threads.discard(threading.current_thread())

    def stop(self, timeout: float = 5.0) -> None:
        """Stops accepting, ends every open connection (kept-alive ones would block forever) and joins."""
        self.shutdown()
        self.server_close()
        with self._lock:
            conns, threads = list(self._conns), list(self._conn_threads)
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        deadline = time.monotonic() + timeout
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))


class S3Server:
    """moto's S3 server behind a counting, fault-injecting proxy on 127.0.0.1.

    Attributes:
        endpoint: ``http://127.0.0.1:<proxy port>``, what clients use (``AWS_ENDPOINT_URL``).
        direct: moto's own endpoint, bypassing the proxy (setup, uploads): not counted, no faults.
        access_key: The access key id the server accepts.
        secret_key: Its secret.
        region: The region clients should sign for.
        latency_s: Seconds added before forwarding each request through the proxy; may be changed at any time.
        bandwidth_bps: Bytes per second at which the proxy sends response bodies, all connections together (a link
            of that speed: bodies are sent in 64 KiB pieces, each when the link is free); None or 0: unlimited (the
            default). May be changed at any time.

    Args:
        latency_s: The initial :attr:`latency_s`.
        bandwidth_bps: The initial :attr:`bandwidth_bps`.
        auth: Whether moto checks signatures and IAM permissions (then only :attr:`access_key` works); without it
            moto accepts any credentials and ``testing``/``testing`` is used.

    Raises:
        RuntimeError: moto did not answer within 30 s (the message carries the tail of its output).
    """

    region: str = "us-east-1"

    def __init__(self, *, latency_s: float = 0.0, auth: bool = False, bandwidth_bps: float | None = None):
        self.latency_s = latency_s
        self.bandwidth_bps = bandwidth_bps
        self._link_free = 0.0  # time.monotonic() at which the limited link has sent everything given to it
        self.access_key = "testing"
        self.secret_key = "testing"
        self._lock = threading.Lock()
        self._log: list[tuple[str, str, int, int]] = []
        self._rules: list[_Rule] = []
        self._stop = threading.Event()
        self._client = None
        self._closed = False
        self._proc: subprocess.Popen | None = None
        self._proxy: _ProxyServer | None = None
        self._out = ""  # moto's output file, made by _start_moto
        try:
            self._start_moto()
            proxy = _ProxyServer(self, self._port)
            # 0.05 s polls: close() waits one poll for the accept loop to notice
            threading.Thread(target=proxy.serve_forever, args=(0.05,), name="s3proxy-accept", daemon=True).start()
            self._proxy = proxy  # only once serving: shutdown() on a server that never served would wait forever
            self.endpoint = f"http://127.0.0.1:{proxy.server_address[1]}"
            if auth:
                self._enable_auth()
        except BaseException:
            self.close()
            raise

    # -- lifecycle --

    def _start_moto(self, timeout: float = 30.0) -> None:
        self._port = free_port()
        self.direct = f"http://127.0.0.1:{self._port}"
        env = dict(os.environ)
        # Without the variable moto never checks credentials; auth=True turns the check on later (_enable_auth).
        env.pop("INITIAL_NO_AUTH_ACTION_COUNT", None)
        # A file, not a pipe: nobody reads moto's output (it logs every request) unless it fails to start.
        fd, self._out = tempfile.mkstemp(prefix="s3server-moto-", suffix=".log")
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self._port)],
                stdin=subprocess.DEVNULL,
                stdout=fd,
                stderr=subprocess.STDOUT,
                env=env,
            )
        finally:
            os.close(fd)  # moto has its own copy
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                break
            try:
                socket.create_connection(("127.0.0.1", self._port), timeout=0.5).close()
                return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"moto server on port {self._port} did not start; its output ends:\n{self._tail()}")

    def _tail(self, n: int = 2000) -> str:
        try:
            return Path(self._out).read_bytes()[-n:].decode(errors="replace")
        except OSError:
            return "(no output)"

    def _enable_auth(self) -> None:
        """Makes an IAM user allowed ``s3:*`` with an access key, then makes moto require valid credentials.

        moto checks credentials once it has served ``INITIAL_NO_AUTH_ACTION_COUNT`` actions; rather than count
        the setup's requests, the server is started without a limit and ``/moto-api/reset-auth`` sets it to 0 once
        the key exists (which also resets moto's counter).
        """
        import boto3

        iam = boto3.client(
            "iam",
            endpoint_url=self.direct,
            region_name=self.region,
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
        )
        iam.create_user(UserName="s3server")
        iam.put_user_policy(UserName="s3server", PolicyName="s3-all", PolicyDocument=_POLICY)
        key = iam.create_access_key(UserName="s3server")["AccessKey"]
        # text/plain: with urllib's default (a form) Flask consumes the body as form data and moto reads "".
        req = urllib.request.Request(
            f"{self.direct}/moto-api/reset-auth", data=b"0", method="POST", headers={"Content-Type": "text/plain"}
        )
        with urllib.request.urlopen(req, timeout=10) as r:
            r.read()
        self.access_key, self.secret_key = key["AccessKeyId"], key["SecretAccessKey"]

    def close(self) -> None:
        """Stops the proxy (its threads and open connections) and moto (SIGTERM, SIGKILL after 5 s); idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()  # wakes handlers sleeping in latency or hang()
        try:
            if self._proxy is not None:
                self._proxy.stop()
            if self._client is not None:
                self._client.close()
        finally:
            self._stop_moto()

    def _stop_moto(self) -> None:
        """Terminates moto (killed if it takes over 5 s) and removes its output file."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        if self._out:
            try:
                os.unlink(self._out)
            except OSError:
                pass

    def __enter__(self) -> S3Server:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- clients and setup (direct to moto: not counted) --

    def env(self) -> dict[str, str]:
        """The environment variables that point AWS SDKs (boto3, obstore) at the proxy with the good credentials."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_DEFAULT_REGION": self.region,
            "AWS_EC2_METADATA_DISABLED": "true",
        }

    def client(self):
        """A boto3 S3 client for :attr:`direct` with the good credentials (one per server, shared: thread-safe)."""
        if self._client is None:
            with self._lock:
                if self._client is None:
                    self._client = self._make_client(self.direct)
        return self._client

    def _make_client(self, endpoint: str):
        import boto3
        from botocore.config import Config

        return boto3.session.Session().client(
            "s3",
            endpoint_url=endpoint,
            region_name=self.region,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            config=Config(max_pool_connections=32, s3={"addressing_style": "path"}),
        )

    def create_bucket(self, name: str) -> None:
        """Creates bucket ``name`` (a valid S3 name: 3-63 characters)."""
        self.client().create_bucket(Bucket=name)

    def upload_tree(self, local_root, bucket: str, prefix: str) -> list[str]:
        """Uploads every file under ``local_root`` to ``s3://bucket/prefix/<relative path>`` in parallel.

        Args:
            local_root: The folder to upload.
            bucket: An existing bucket.
            prefix: The key prefix, "" for none; slashes around it are ignored.

        Returns:
            The keys written, sorted.
        """
        root = Path(local_root)
        prefix = prefix.strip("/")
        files = sorted(p for p in root.rglob("*") if p.is_file())
        keys = [(f"{prefix}/" if prefix else "") + p.relative_to(root).as_posix() for p in files]
        s3 = self.client()
        with ThreadPoolExecutor(16, thread_name_prefix="s3server-upload") as pool:
            list(
                pool.map(lambda pk: s3.put_object(Bucket=bucket, Key=pk[1], Body=pk[0].read_bytes()), zip(files, keys))
            )
        return sorted(keys)

    def put(self, bucket: str, key: str, data: bytes) -> None:
        """Writes one object directly (not counted)."""
        self.client().put_object(Bucket=bucket, Key=key, Body=data)

    def delete(self, bucket: str, key: str) -> None:
        """Deletes one object directly (not counted)."""
        self.client().delete_object(Bucket=bucket, Key=key)

    # -- what the proxy saw --

    def _record(self, method: str, path: str, status: int, nbytes: int) -> None:
        with self._lock:
            self._log.append((method, path, status, nbytes))

    def requests(self, method: str | None = None) -> list[tuple[str, str, int, int]]:
        """``(method, path as sent, status, response body bytes)`` of the proxied requests, in arrival order.

        Args:
            method: Only requests of this method; all when None.
        """
        with self._lock:
            return [r for r in self._log if method is None or r[0] == method]

    def count(self, method: str = "GET", *, objects_only: bool = True) -> int:
        """How many requests of ``method`` went through the proxy (answered by a fault too).

        Args:
            method: The HTTP method.
            objects_only: Count only requests for one object (a key after the bucket; no listing or sub-resource
                query such as ``?list-type=2``, though ``versionId``/``partNumber``/``x-id`` are allowed).
        """
        return sum(1 for r in self.requests(method) if not objects_only or _is_object(r[1]))

    def bytes_sent(self, method: str = "GET", *, objects_only: bool = True) -> int:
        """Response body bytes of the requests :meth:`count` counts (HEAD responses have none)."""
        return sum(r[3] for r in self.requests(method) if not objects_only or _is_object(r[1]))

    def reset(self) -> None:
        """Forgets what the proxy saw (the fault rules stay)."""
        with self._lock:
            self._log.clear()

    # -- faults --

    def fail(self, key: str, status: int = 503, times: int = 1, *, method: str = "GET") -> None:
        """Answers the next ``times`` requests for keys matching ``key`` with ``status``, without asking moto.

        The body is an S3 XML error: ``SlowDown`` for 503, ``InternalError`` for 500, ``AccessDenied`` for 403,
        ``NoSuchKey`` for 404.

        Args:
            key: An fnmatch pattern for the object key (the URL-decoded part after ``/<bucket>/``).
            status: The HTTP status to answer with.
            times: How many matching requests fail before the rule expires.
            method: The HTTP method the rule applies to, ``"*"`` for any.
        """
        with self._lock:
            self._rules.append(_Rule(key, method.upper(), times, status=status))

    def hang(self, key: str, seconds: float, times: int = 1, *, method: str = "GET") -> None:
        """Stalls the next ``times`` requests for keys matching ``key`` by ``seconds`` before forwarding them.

        A client with a shorter timeout gives up; one with a longer timeout gets the object late.
        A stalled request is recorded as it arrives, with status 0 (:meth:`requests`, :meth:`count`).

        Args:
            key: An fnmatch pattern for the object key, as in :meth:`fail`.
            seconds: How long to stall.
            times: How many matching requests stall before the rule expires.
            method: The HTTP method the rule applies to, ``"*"`` for any.
        """
        with self._lock:
            self._rules.append(_Rule(key, method.upper(), times, seconds=seconds))

    def _pace(self, nbytes: int, bandwidth: float) -> float:
        """Books ``nbytes`` on the limited link; the seconds until they have gone out at ``bandwidth`` bytes/s."""
        with self._lock:
            now = time.monotonic()
            self._link_free = max(now, self._link_free) + nbytes / bandwidth
            return self._link_free - now

    def _take_rules(self, method: str, key: str) -> tuple[_Rule | None, _Rule | None]:
        """The first live hang rule and the first live fail rule matching a request, each used up once."""
        hang = fail = None
        with self._lock:
            for rule in self._rules:
                if rule.status == 0 and hang is None and rule.matches(method, key):
                    hang = rule
                elif rule.status and fail is None and rule.matches(method, key):
                    fail = rule
            for rule in (hang, fail):
                if rule is not None:
                    rule.times -= 1
            self._rules = [r for r in self._rules if r.times > 0]
        return hang, fail
