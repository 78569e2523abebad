"""What an ``s3://`` URL names: pure string functions."""

from __future__ import annotations

import os

__all__ = ["SCHEME", "is_url", "join", "normalize", "split"]

SCHEME = "s3://"


def is_url(x) -> bool:
    """Whether ``x`` is a string that names an object store location (``s3://...``)."""
    return isinstance(x, str) and x.startswith(SCHEME)


def split(url: str) -> tuple[str, str]:
    """``(bucket, key)`` of ``s3://bucket/key`` (the key may be ``""``).

    Raises:
        ValueError: ``url`` is not an ``s3://`` URL with a bucket.
    """
    if not is_url(url):
        raise ValueError(f"expected an s3://bucket/key URL, got {url!r}")
    bucket, _, key = url[len(SCHEME) :].partition("/")
    if not bucket:
        raise ValueError(f"{url!r} names no bucket; expected s3://bucket/prefix")
    return bucket, key


def join(bucket: str, key: str) -> str:
    """The URL of ``key`` in ``bucket``."""
    return f"{SCHEME}{bucket}/{key}"


def normalize(url: str | os.PathLike) -> str:
    """A prefix URL without trailing slashes (``s3://b/train/`` and ``s3://b/train`` are one root)."""
    url = os.fspath(url)
    bucket, key = split(url)
    return join(bucket, key.rstrip("/")).rstrip("/") if key.rstrip("/") else f"{SCHEME}{bucket}"
