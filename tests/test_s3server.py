"""coordl_testing.s3server: moto behind the counting, fault-injecting proxy, used by boto3 and obstore."""

from __future__ import annotations

import http.client
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("moto")
boto3 = pytest.importorskip("boto3")

from botocore.config import Config  # noqa: E402 - after the importorskip above
from botocore.exceptions import ClientError, ReadTimeoutError  # noqa: E402

from coordl_testing.s3server import S3Server  # noqa: E402

BUCKET = "test-bucket"
FILES = {"a.bin": b"a" * 1000, "sub/b.bin": b"b" * 2000, "sub/deep/c b.bin": b"c" * 3000}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("tree")
    for rel, data in FILES.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    with S3Server() as s:
        s.create_bucket(BUCKET)
        keys = s.upload_tree(root, BUCKET, "/data/")
        assert keys == sorted(f"data/{k}" for k in FILES)
        yield s


@pytest.fixture
def srv(server):
    """The module's server with clean counts, no latency and no rules left over."""
    server.reset()
    server.latency_s = 0.0
    yield server
    server.latency_s = 0.0
    server.bandwidth_bps = None
    server._rules.clear()


def proxied(s: S3Server, **config):
    return boto3.session.Session().client(
        "s3",
        endpoint_url=s.endpoint,
        region_name=s.region,
        aws_access_key_id=s.access_key,
        aws_secret_access_key=s.secret_key,
        config=Config(retries={"total_max_attempts": 1, "mode": "standard"}, **config),
    )


def test_env_and_uploads_not_counted(srv):
    env = srv.env()
    assert env == {
        "AWS_ENDPOINT_URL": srv.endpoint,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",
    }
    assert srv.endpoint != srv.direct
    assert srv.requests() == []  # the fixture's uploads went direct


def test_boto3_gets_counted(srv):
    s3 = proxied(srv)
    for rel, data in FILES.items():
        assert s3.get_object(Bucket=BUCKET, Key=f"data/{rel}")["Body"].read() == data
    head = s3.head_object(Bucket=BUCKET, Key="data/a.bin")
    assert head["ContentLength"] == 1000
    listed = s3.list_objects_v2(Bucket=BUCKET, Prefix="data/")
    assert sorted(o["Key"] for o in listed["Contents"]) == sorted(f"data/{k}" for k in FILES)
    assert srv.count("GET") == 3
    assert srv.bytes_sent("GET") == 6000
    assert srv.count("GET", objects_only=False) == 4  # the listing too
    assert srv.count("HEAD") == 1 and srv.bytes_sent("HEAD") == 0
    gets = srv.requests("GET")
    assert [r[2] for r in gets] == [200] * 4
    assert gets[2][1].startswith("/test-bucket/data/sub/deep/c%20b.bin")
    assert "list-type=2" in gets[3][1]
    srv.reset()
    assert srv.count("GET") == 0 and srv.requests() == []


def test_obstore_gets_counted(srv):
    obstore = pytest.importorskip("obstore")
    from obstore.store import S3Store

    store = S3Store(
        BUCKET,
        endpoint=srv.endpoint,
        region=srv.region,
        access_key_id=srv.access_key,
        secret_access_key=srv.secret_key,
        client_options={"allow_http": True},
        retry_config={"max_retries": 0},
    )
    for rel, data in FILES.items():
        assert bytes(obstore.get(store, f"data/{rel}").bytes()) == data
    assert bytes(obstore.get_range(store, "data/sub/b.bin", start=10, end=20)) == b"b" * 10
    assert sorted(m["path"] for batch in obstore.list(store, prefix="data") for m in batch) == sorted(
        f"data/{k}" for k in FILES
    )
    assert srv.count("GET") == 4
    assert srv.bytes_sent("GET") == 6010
    assert srv.count("GET", objects_only=False) == 5
    assert [r[2] for r in srv.requests("GET")] == [200, 200, 200, 206, 200]


def test_fail_once_then_succeed(srv):
    s3 = proxied(srv)
    srv.fail("data/sub/*", 503)
    with pytest.raises(ClientError) as e:
        s3.get_object(Bucket=BUCKET, Key="data/sub/b.bin")
    assert e.value.response["ResponseMetadata"]["HTTPStatusCode"] == 503
    assert e.value.response["Error"]["Code"] == "SlowDown"
    assert s3.get_object(Bucket=BUCKET, Key="data/sub/b.bin")["Body"].read() == FILES["sub/b.bin"]
    assert [r[2] for r in srv.requests("GET")] == [503, 200]
    assert srv.count("GET") == 2

    srv.fail("data/a.bin", 404, times=2)
    srv.fail("*", 500, method="HEAD")
    for _ in range(2):
        with pytest.raises(ClientError) as e:
            s3.get_object(Bucket=BUCKET, Key="data/a.bin")
        assert e.value.response["Error"]["Code"] == "NoSuchKey"
    with pytest.raises(ClientError) as e:
        s3.head_object(Bucket=BUCKET, Key="data/a.bin")
    assert e.value.response["ResponseMetadata"]["HTTPStatusCode"] == 500
    assert s3.head_object(Bucket=BUCKET, Key="data/a.bin")["ContentLength"] == 1000
    assert s3.get_object(Bucket=BUCKET, Key="data/a.bin")["Body"].read() == FILES["a.bin"]
    assert srv._rules == []


def test_hang_times_out_a_short_timeout(srv):
    s3 = proxied(srv, read_timeout=0.5, connect_timeout=1)
    srv.hang("data/a.bin", 300.0)  # far longer than the client waits: only its timeout ends the request
    t = time.monotonic()
    with pytest.raises(ReadTimeoutError):
        s3.get_object(Bucket=BUCKET, Key="data/a.bin")
    took = time.monotonic() - t
    assert 0.5 <= took < 300.0, took  # at the client's read timeout, before the stall ended
    ((method, path, status, _),) = srv.requests()  # recorded as it arrived, stalled
    assert (method, status) == ("GET", 0) and path.startswith("/test-bucket/data/a.bin"), srv.requests()
    # the rule is used up: the next request goes straight through
    assert s3.get_object(Bucket=BUCKET, Key="data/a.bin")["Body"].read() == FILES["a.bin"]


def _seconds_per_get(s3, n: int) -> list[float]:
    took = []
    for _ in range(n):
        t = time.monotonic()
        s3.get_object(Bucket=BUCKET, Key="data/a.bin")["Body"].read()
        took.append(time.monotonic() - t)
    return took


def test_latency(srv):
    s3 = proxied(srv)
    s3.head_object(Bucket=BUCKET, Key="data/a.bin")  # connect first
    latency = 1.0  # long beside a request without it, even on busy cores (a few ms; 0.1 s at worst seen)
    srv.latency_s = latency
    took = _seconds_per_get(s3, 2)
    assert all(t >= latency for t in took), took  # each request waits it
    srv.latency_s = 0.0
    took = _seconds_per_get(s3, 2)
    assert all(t < latency for t in took), took  # changed at once: none waits it any more


def test_bandwidth(srv):
    """A body is sent no faster than bandwidth_bps, all connections together; None sends at once again."""
    s3 = proxied(srv)
    s3.head_object(Bucket=BUCKET, Key="data/sub/deep/c b.bin")  # connect first
    srv.bandwidth_bps = 3000.0  # c b.bin is 3,000 bytes: one second of the link
    try:
        t = time.monotonic()
        assert s3.get_object(Bucket=BUCKET, Key="data/sub/deep/c b.bin")["Body"].read() == FILES["sub/deep/c b.bin"]
        assert time.monotonic() - t >= 0.95  # the pacer books the bytes before sending: ~1 s, never less
        t = time.monotonic()  # two clients at once share the link: 6,000 bytes take two seconds
        other = proxied(srv)
        other.head_object(Bucket=BUCKET, Key="data/a.bin")
        with ThreadPoolExecutor(2) as pool:
            got = list(
                pool.map(lambda c: c.get_object(Bucket=BUCKET, Key="data/sub/deep/c b.bin")["Body"].read(), (s3, other))
            )
        assert got == [FILES["sub/deep/c b.bin"]] * 2 and time.monotonic() - t >= 1.9
    finally:
        srv.bandwidth_bps = None
    t = time.monotonic()
    s3.get_object(Bucket=BUCKET, Key="data/sub/deep/c b.bin")["Body"].read()
    assert time.monotonic() - t < 0.9  # changed at once: unlimited again


def test_chunked_put_and_keepalive(srv):
    """A raw chunked upload through the proxy arrives whole, and one connection serves several requests."""
    host, port = srv.endpoint.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=5)
    try:
        conn.request("PUT", f"/{BUCKET}/raw/chunked", body=iter([b"x" * 100, b"y" * 50]), encode_chunked=True)
        resp = conn.getresponse()
        resp.read()
        assert resp.status == 200
        # moto refuses anonymous reads of a private object (403), but the connection stays usable after it
        conn.request("GET", f"/{BUCKET}/raw/chunked")
        resp = conn.getresponse()
        resp.read()
        assert resp.status == 403
        conn.request("HEAD", f"/{BUCKET}/raw/chunked")
        resp = conn.getresponse()
        assert resp.status == 403 and resp.read() == b""
    finally:
        conn.close()
    assert srv.client().get_object(Bucket=BUCKET, Key="raw/chunked")["Body"].read() == b"x" * 100 + b"y" * 50
    assert proxied(srv).head_object(Bucket=BUCKET, Key="raw/chunked")["ContentLength"] == 150
    srv.delete(BUCKET, "raw/chunked")
    assert [(r[0], r[2]) for r in srv.requests()] == [("PUT", 200), ("GET", 403), ("HEAD", 403), ("HEAD", 200)]


def test_auth_refuses_bad_keys():
    with S3Server(auth=True) as s:
        assert s.access_key != "testing"
        s.create_bucket("auth-bucket")
        s.put("auth-bucket", "k", b"secret")
        assert proxied(s).get_object(Bucket="auth-bucket", Key="k")["Body"].read() == b"secret"
        proxied(s).put_object(Bucket="auth-bucket", Key="p", Body=b"signed put")  # signed PUT through the proxy
        assert s.client().get_object(Bucket="auth-bucket", Key="p")["Body"].read() == b"signed put"
        good, bad = s.access_key, s.secret_key
        for key, secret, code in [
            (good, "wrong" + bad, "SignatureDoesNotMatch"),
            ("AKIAUNKNOWNKEY000000", bad, "InvalidAccessKeyId"),
            ("testing", "testing", "InvalidAccessKeyId"),
        ]:
            s.access_key, s.secret_key = key, secret
            with pytest.raises(ClientError) as e:
                proxied(s).get_object(Bucket="auth-bucket", Key="k")
            assert e.value.response["ResponseMetadata"]["HTTPStatusCode"] == 403
            assert e.value.response["Error"]["Code"] == code
        s.access_key, s.secret_key = good, bad
        assert [r[2] for r in s.requests("GET")] == [200, 403, 403, 403]


def test_close_is_idempotent_and_frees_ports():
    s = S3Server()
    endpoint, direct = s.endpoint, s.direct
    s3 = proxied(s)
    s.create_bucket("close-bucket")
    s3.list_objects_v2(Bucket="close-bucket")  # leaves a kept-alive connection open in the pool
    s.close()
    s.close()
    for url in (endpoint, direct):
        host, port = url.removeprefix("http://").split(":")
        with pytest.raises(OSError):
            http.client.HTTPConnection(host, int(port), timeout=1).connect()
    assert s._proc.returncode is not None
