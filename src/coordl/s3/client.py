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
across ``fork``. At exit, once the loaders are closed and the event loop has ended (nothing is in
flight), :func:`close` drops them: boto3's connection pools close, and obstore's stores with their
connections, while the interpreter is whole.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import threading
from dataclasses import dataclass

from coordl import env, lifecycle
from coordl.errors import CoordlError, DatasetChangedError, StoreError
from coordl.s3 import url as s3url

__all__ = ["Settings", "boto3_client", "classify", "close", "explain", "obstore_store", "settings"]

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
_close_registered = False  # close() is an exit hook (a forked child inherits it)


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
    global _close_registered
    with _lock:
        _clients[key] = out
        _clients[(os.getpid(), "session", "")] = session
        if not _close_registered:
            _close_registered = True
            lifecycle.at_exit(close)  # registered before the event loop's hook: runs after it
    return out


def close() -> None:
    """Drops this process's clients (boto3's connection pools are closed; obstore's stores go with
    their connections); the next request makes new ones. An exit hook: by then the loaders are
    closed and the event loop has ended, so no request is in flight."""
    pid = os.getpid()
    with _lock:
        dropped = {k: _clients.pop(k) for k in [k for k in _clients if k[0] == pid]}
    for (_, what, _), c in dropped.items():
        if what == "boto3":
            c.close()


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

    # coordl cuts each try at timeout_s itself (a typed TimeoutError) and retries (coordl.s3.reads):
    # obstore's own limits only back that up, and a connection that cannot be made in 10 s is given
    # up (a GenericError, tried again) even when timeout_s is longer.
    options = {
        "timeout": timedelta(seconds=2 * s.timeout_s),
        "connect_timeout": timedelta(seconds=min(2 * s.timeout_s, 10.0)),
        "pool_max_idle_per_host": str(s.max_requests),
    }
    config: dict = {"region": bucket_region(bucket), "virtual_hosted_style_request": s.virtual_hosted}
    if s.endpoint:
        scheme, _, host = s.endpoint.partition("://")
        # obstore's virtual-hosted requests go to the endpoint as given: it must name the bucket.
        config["endpoint"] = f"{scheme}://{bucket}.{host}" if s.virtual_hosted else s.endpoint
        options["allow_http"] = scheme == "http"
    retry = {"max_retries": 0}  # one try a call: coordl retries (see above)
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
#
# By the clients' exception types, never their messages. What each carries:
# - botocore's ClientError: the parsed answer, ``response["Error"]["Code"]`` (the S3 error code) and
#   ``response["ResponseMetadata"]`` (``HTTPStatusCode``, ``RetryAttempts``); a subclass per code
#   (``NoSuchKey``...) is made at run time, so the dict is what to read. ReadTimeoutError and
#   ConnectTimeoutError: a try took too long; EndpointConnectionError and other HTTPClientErrors: no
#   answer; NoCredentialsError, CredentialRetrievalError, TokenRetrievalError, SSOError...: no usable
#   credentials were found.
# - obstore (object_store's errors, by variant): PreconditionError (412), UnauthenticatedError (401),
#   PermissionDeniedError (403), the builtin FileNotFoundError (404); their message is all they carry:
#   no status, no S3 error code. So a 403 alone does not say whether the store refused the
#   credentials (SignatureDoesNotMatch) or this one object (AccessDenied), nor a 404 whether the key
#   or the bucket is gone: :func:`explain` asks boto3, whose ClientError carries the code.
#   GenericError is everything else, with nothing typed to tell it apart: 5xx and throttling
#   answers, refused or dropped connections, object_store's own timeouts. coordl makes obstore try
#   once (no retries of its own), cuts each try at COORDL_S3_TIMEOUT itself (then the failure is
#   the builtin TimeoutError) and retries GenericErrors and its timeouts (coordl.s3.reads): what a
#   GenericError means to coordl is "this try failed and may succeed if tried again".


def classify(e: BaseException, url: str, *, retries: int = 0) -> BaseException:
    """What a client's exception about ``url`` means, as the error coordl reports:

    - :class:`~coordl.errors.StoreError`: the store refused the job's credentials (or none were
      found), or the bucket does not exist: no sample can be read (raised whatever ``on_error`` says);
    - :class:`~coordl.errors.DatasetChangedError`: the object is no longer the one indexed (412);
    - an ``OSError`` for this object alone (``FileNotFoundError``, ``PermissionError``,
      ``TimeoutError``, or ``OSError`` with ``EIO``): ``on_error`` decides.

    Args:
        e: what botocore or obstore raised, or the builtin ``TimeoutError`` of a try that coordl
            cut at ``COORDL_S3_TIMEOUT``.
        url: the object (or prefix) asked for.
        retries: how many times coordl tried again before ``e`` (botocore counts its own).
    """
    if isinstance(e, CoordlError):
        return e
    from botocore import exceptions as bx

    after = f" after {retries} retries" if retries else ""
    if isinstance(e, bx.ClientError):
        meta = e.response.get("ResponseMetadata", {})
        status = meta.get("HTTPStatusCode")
        code = e.response.get("Error", {}).get("Code")
        if code == str(status):
            code = None  # an answer without a body (HEAD): botocore puts the status there
        retried = int(meta.get("RetryAttempts") or 0)
        return _answer(url, int(status) if status else None, code, f" after {retried} retries" if retried else "")
    from obstore import exceptions as ox

    if isinstance(e, ox.PreconditionError):
        return _answer(url, 412, None, after)
    if isinstance(e, ox.UnauthenticatedError):
        return _answer(url, 401, None, after)
    if isinstance(e, ox.PermissionDeniedError):
        return _answer(url, 403, None, after)
    if isinstance(e, FileNotFoundError):  # obstore's 404 (its NotFoundError is not raised any more)
        return _answer(url, 404, None, after)
    if isinstance(e, (TimeoutError, bx.ReadTimeoutError, bx.ConnectTimeoutError)):
        return TimeoutError(errno.ETIMEDOUT, f"no complete answer within {settings().timeout_s:g} s{after}")
    if isinstance(e, _credential_errors(bx)):
        return StoreError(
            f"coordl found no usable credentials for {url} ({type(e).__name__}: {e}): check AWS_ACCESS_KEY_ID / "
            "AWS_SECRET_ACCESS_KEY, AWS_PROFILE and AWS_ENDPOINT_URL (or the instance's role)"
        )
    text = str(e)
    first = text.splitlines()[0][:300] if text else type(e).__name__
    return OSError(errno.EIO, f"the request failed{after}: {first}")


def _credential_errors(bx) -> tuple[type, ...]:
    """botocore's exceptions for credentials that could not be had (not refused by the store)."""
    return (
        bx.NoCredentialsError,
        bx.PartialCredentialsError,
        bx.CredentialRetrievalError,
        bx.TokenRetrievalError,
        bx.SSOError,
    )


def _answer(url: str, status: int | None, code: str | None, after: str) -> BaseException:
    """The error for the store's answer ``status`` with S3 error ``code`` (either may be unknown)."""
    if code in CREDENTIAL_CODES or status == 401:
        return StoreError(
            f"the object store refused coordl's credentials for {url} ({status or ''} {code or 'Unauthorized'}): "
            "check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, AWS_PROFILE and AWS_ENDPOINT_URL (or the instance's role)"
        )
    if code == "NoSuchBucket":
        return StoreError(f"the bucket of {url} does not exist at this endpoint (404 NoSuchBucket)")
    if code == "PreconditionFailed" or status == 412:
        return DatasetChangedError(
            f"{url} changed after it was indexed (its ETag is not the index's): the dataset changed; "
            "restart so that it is indexed again"
        )
    if status == 404 or code in ("NoSuchKey", "NotFound"):
        return FileNotFoundError(errno.ENOENT, f"no such object (404 {code or 'Not Found'})")
    if status == 403:
        return PermissionError(errno.EACCES, f"access denied (403 {code or 'Forbidden'})")
    return OSError(errno.EIO, f"the store answered {status or ''} {code or ''}".rstrip() + after)


def explain(e: BaseException, url: str, retries: int = 0) -> BaseException:
    """:func:`classify` of what obstore raised about ``url``, with the S3 error code where obstore
    has none to give: after a 403 or a 404, the object is asked for again (its first byte) with
    boto3, whose answer carries the code: refused credentials and a missing bucket are told from a
    forbidden or missing object. One request, made only for an object obstore was refused."""
    from botocore import exceptions as bx
    from obstore import exceptions as ox

    found = classify(e, url, retries=retries)
    if not isinstance(e, (ox.PermissionDeniedError, FileNotFoundError)):
        return found
    bucket, key = s3url.split(url)
    try:
        answer = boto3_client().get_object(Bucket=bucket, Key=key, Range="bytes=0-0")
        answer["Body"].close()
    except bx.ClientError as again:
        told = classify(again, url)
        # The same refusal, now with its code (or the job's credentials, or the bucket, refused).
        if isinstance(told, StoreError) or type(told) is type(found):
            return told
    except Exception:  # noqa: BLE001 - no better answer than obstore's: it stands
        pass
    return found
