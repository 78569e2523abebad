"""This process's object-store clients, configured from the standard AWS configuration, and what
a store's refusal means.

Configuration is botocore's, so it is what the AWS CLI and boto3 would use: credentials from the
environment, ``AWS_PROFILE`` and the shared files, SSO, container and instance roles; the region
from the same chain (else the bucket's own, asked once); the endpoint from ``AWS_ENDPOINT_URL`` or
``AWS_ENDPOINT_URL_S3`` or the profile (MinIO, Ceph and other S3-compatible stores); retries from
``AWS_MAX_ATTEMPTS``. coordl's own settings: ``COORDL_S3_TIMEOUT`` (seconds per request) and
``COORDL_S3_REQUESTS`` (requests in flight per process).

Two clients, each made for its job: boto3 lists and asks for objects' sizes (the control plane,
a few requests per thousand samples), obstore (Rust) GETs the samples (the data plane: about a
quarter of boto3's CPU time per request). Clients are made per process: neither may be used
across ``fork``.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import threading
from dataclasses import dataclass

from coordl import env
from coordl.errors import CoordlError, DatasetChangedError, StoreError

__all__ = ["Settings", "boto3_client", "classify", "obstore_store", "settings"]

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 30.0
DEFAULT_REQUESTS = 64
DEFAULT_ATTEMPTS = 6  # one request and 5 retries, when AWS_MAX_ATTEMPTS is not set

# S3 error codes that refuse the job's identity rather than one object: no sample can be read.
CREDENTIAL_CODES = {
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "ExpiredToken",
    "InvalidToken",
    "TokenRefreshRequired",
    "AuthorizationHeaderMalformed",
    "InvalidSecurity",
    "AccountProblem",
}

_lock = threading.Lock()
_clients: dict = {}  # (pid, what, bucket) -> client; a forked child makes its own


def _after_fork_in_child() -> None:
    global _lock
    _lock = threading.Lock()  # another thread may have held it at the fork


os.register_at_fork(after_in_child=_after_fork_in_child)


@dataclass(frozen=True)
class Settings:
    """How this process talks to the store.

    Attributes:
        endpoint: the S3 endpoint URL, or None for AWS's own (from the region).
        region: the region requests are signed for (None: "us-east-1" at an endpoint of its own, else the bucket's).
        timeout_s: seconds one request may take, from connecting to its last byte.
        attempts: tries per request (``AWS_MAX_ATTEMPTS``), with exponential backoff and jitter.
        max_requests: requests in flight at once in this process.
        virtual_hosted: address buckets as ``bucket.host`` (the profile's ``addressing_style``).
        anonymous: no credentials were found: requests are not signed (public buckets).
    """

    endpoint: str | None
    region: str | None
    timeout_s: float
    attempts: int
    max_requests: int
    virtual_hosted: bool
    anonymous: bool


def _session():
    try:
        import botocore.session
    except ImportError:
        raise ImportError("s3:// datasets need boto3 and obstore: pip install 'coordl[s3]'") from None
    return botocore.session.get_session()


def settings() -> Settings:
    """This process's settings (resolved once per process)."""
    key = (os.getpid(), "settings", "")
    with _lock:
        if key in _clients:
            return _clients[key]
    session = _session()
    client = session.create_client("s3")
    endpoint = client.meta.endpoint_url
    if re.search(r"(^|\.)amazonaws\.com(\.cn)?(:\d+)?$", endpoint.split("://", 1)[-1].split("/", 1)[0]):
        endpoint = None  # AWS itself: obstore addresses the bucket from the region
    s3 = (session.get_scoped_config() or {}).get("s3") or {}
    attempts = session.get_config_variable("max_attempts")
    out = Settings(
        endpoint=endpoint,
        region=session.get_config_variable("region"),
        timeout_s=env.number("COORDL_S3_TIMEOUT", DEFAULT_TIMEOUT_S),
        attempts=int(attempts) if attempts else DEFAULT_ATTEMPTS,
        max_requests=env.integer("COORDL_S3_REQUESTS", DEFAULT_REQUESTS, minimum=1),
        virtual_hosted=isinstance(s3, dict) and s3.get("addressing_style") == "virtual",
        anonymous=session.get_credentials() is None,
    )
    with _lock:
        _clients[key] = out
        _clients[(os.getpid(), "session", "")] = session
    return out


def boto3_client():
    """This process's boto3 S3 client (listing, sizes; the fallback reader)."""
    key = (os.getpid(), "boto3", "")
    with _lock:
        if key in _clients:
            return _clients[key]
    s = settings()
    import boto3
    import botocore.config
    from botocore import UNSIGNED

    session = boto3.Session(botocore_session=_clients[(os.getpid(), "session", "")])
    config = botocore.config.Config(
        retries={"mode": "standard", "max_attempts": s.attempts},
        connect_timeout=s.timeout_s,
        read_timeout=s.timeout_s,
        max_pool_connections=s.max_requests,
        signature_version=UNSIGNED if s.anonymous else None,
        s3={"addressing_style": "virtual" if s.virtual_hosted else "auto"},
    )
    client = session.client("s3", config=config)
    with _lock:
        return _clients.setdefault(key, client)


def bucket_region(bucket: str) -> str:
    """The region to sign ``bucket``'s requests for: the configured one, else the bucket's own."""
    s = settings()
    if s.region:
        return s.region
    if s.endpoint:
        return "us-east-1"  # what MinIO and Ceph sign for unless they are told otherwise
    key = (os.getpid(), "region", bucket)
    with _lock:
        if key in _clients:
            return _clients[key]
    try:
        answer = boto3_client().head_bucket(Bucket=bucket)
        region = answer.get("BucketRegion") or answer["ResponseMetadata"]["HTTPHeaders"].get("x-amz-bucket-region")
    except Exception as e:  # classified: a refusal is the user's to see
        raise classify(e, f"s3://{bucket}") from e
    region = region or "us-east-1"
    with _lock:
        return _clients.setdefault(key, region)


def obstore_store(bucket: str):
    """This process's obstore store for ``bucket``."""
    key = (os.getpid(), "obstore", bucket)
    with _lock:
        if key in _clients:
            return _clients[key]
    s = settings()
    from datetime import timedelta

    from obstore.store import S3Store

    options = {
        "timeout": timedelta(seconds=s.timeout_s),
        "connect_timeout": timedelta(seconds=min(s.timeout_s, 10.0)),
        "pool_max_idle_per_host": str(s.max_requests),
    }
    config: dict = {"region": bucket_region(bucket), "virtual_hosted_style_request": s.virtual_hosted}
    if s.endpoint:
        scheme, _, host = s.endpoint.partition("://")
        # obstore's virtual-hosted requests go to the endpoint as given: it must name the bucket.
        config["endpoint"] = f"{scheme}://{bucket}.{host}" if s.virtual_hosted else s.endpoint
        options["allow_http"] = scheme == "http"
    retry = {
        "max_retries": max(0, s.attempts - 1),
        "backoff": {"init_backoff": timedelta(milliseconds=100), "max_backoff": timedelta(seconds=15), "base": 2},
        "retry_timeout": timedelta(seconds=max(180.0, s.timeout_s * s.attempts)),
    }
    provider = None
    if s.anonymous:
        config["skip_signature"] = True
    else:
        from obstore.auth.boto3 import Boto3CredentialProvider

        provider = Boto3CredentialProvider(_clients[(os.getpid(), "session", "")])
    store = S3Store(bucket, config=config, client_options=options, retry_config=retry, credential_provider=provider)
    with _lock:
        return _clients.setdefault(key, store)


# -- what a refusal means -----------------------------------------------------------------------------


def _code(text: str) -> str | None:
    m = re.search(r"<Code>([A-Za-z0-9.]+)</Code>", text)
    return m.group(1) if m else None


def _status(e: BaseException, text: str) -> int | None:
    response = getattr(e, "response", None)  # botocore's ClientError
    if isinstance(response, dict):
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if status:
            return int(status)
    m = re.search(r"status(?: code)?: (\d{3})", text)
    return int(m.group(1)) if m else None


def _retries(text: str) -> str:
    m = re.search(r"retries: (\d+)", text)
    return f" after {m.group(1)} retries" if m and m.group(1) != "0" else ""


def classify(e: BaseException, url: str) -> BaseException:
    """What a client's exception about ``url`` means, as the error coordl reports:

    - :class:`~coordl.errors.StoreError`: the store refused the job's credentials, or the bucket
      does not exist: no sample can be read (raised whatever ``on_error`` says);
    - :class:`~coordl.errors.DatasetChangedError`: the object is no longer the one indexed (412);
    - an ``OSError`` for this object alone (``FileNotFoundError``, ``PermissionError``,
      ``TimeoutError``, or ``OSError`` with ``EIO``): ``on_error`` decides.
    """
    if isinstance(e, CoordlError):
        return e
    text = str(e)
    error = getattr(e, "response", {}).get("Error", {}) if isinstance(getattr(e, "response", None), dict) else {}
    code = error.get("Code") or _code(text)
    status = _status(e, text)
    name = type(e).__name__
    if code in CREDENTIAL_CODES or name == "UnauthenticatedError" or status == 401:
        return StoreError(
            f"the object store refused coordl's credentials for {url} ({status or ''} {code or name}): check "
            "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, AWS_PROFILE and AWS_ENDPOINT_URL (or the instance's role)"
        )
    if code == "NoSuchBucket":
        return StoreError(f"the bucket of {url} does not exist at this endpoint (404 NoSuchBucket)")
    if code == "PreconditionFailed" or status == 412 or name == "PreconditionError":
        return DatasetChangedError(
            f"{url} changed after it was indexed (its ETag is not the index's): the dataset changed; "
            "restart so that it is indexed again"
        )
    if status == 404 or code in ("NoSuchKey", "NotFound") or isinstance(e, FileNotFoundError):
        return FileNotFoundError(errno.ENOENT, f"no such object (404 {code or 'Not Found'})")
    if status == 403 or isinstance(e, PermissionError) or name == "PermissionDeniedError":
        return PermissionError(errno.EACCES, f"access denied (403 {code or 'Forbidden'})")
    lowered = text.lower()
    if "timed out" in lowered or "timeout" in lowered:
        return TimeoutError(errno.ETIMEDOUT, f"no complete answer within {settings().timeout_s:g} s{_retries(text)}")
    if status is not None:
        return OSError(errno.EIO, f"the store answered {status} {code or ''}{_retries(text)}".rstrip())
    first = text.splitlines()[0] if text else name
    return OSError(errno.EIO, f"{first[:300]}{_retries(text)}")
