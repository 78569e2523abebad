"""The index of an ``s3://`` prefix by ImageFolder's rules over keys, and the sizes and ETags of a
list of URLs: what the store says, in a few requests per thousand samples.

ImageFolder over keys: the classes are the sorted first-level prefixes under the root (``root/<class>/``),
a class's samples every key below its prefix whose name has an accepted extension (``/``-terminated
folder markers skipped), ordered as ``sorted(os.walk(...))`` would order files: by their "folder"
(the key up to its last ``/``), then by name. Classes are listed concurrently.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from coordl.s3 import client, url
from coordl.threads import daemon_pool

__all__ = ["Listing", "class_names", "scan", "stat_known", "stat_many"]

log = logging.getLogger(__name__)

LIST_THREADS = 16  # class prefixes listed at once


class Listing:
    """The samples of a prefix: URLs, labels, sizes and ETags in ImageFolder order, and the classes."""

    def __init__(self, urls, labels, sizes, etags, classes, requests):
        self.urls, self.labels, self.sizes, self.etags, self.classes = urls, labels, sizes, etags, classes
        self.requests = requests  # LIST requests it took


def _pages(bucket: str, prefix: str, delimiter: str | None, root: str):
    """The pages of ``ListObjectsV2`` under ``prefix``."""
    kwargs = {"Bucket": bucket, "Prefix": prefix}
    if delimiter:
        kwargs["Delimiter"] = delimiter
    try:
        yield from client.boto3_client().get_paginator("list_objects_v2").paginate(**kwargs)
    except Exception as e:  # classified below
        raise _cannot_list(e, root) from e


def _cannot_list(e: BaseException, root: str) -> BaseException:
    found = client.classify(e, root)
    if isinstance(found, OSError):
        return type(found)(found.errno, f"cannot list {root}: {found.strerror} (the index needs s3:ListBucket there)")
    return found


def _prefix(root: str) -> tuple[str, str]:
    bucket, key = url.split(root)
    key = key.strip("/")
    return bucket, f"{key}/" if key else ""


def class_names(root: str) -> list[str]:
    """The sorted class names under ``root``: its first-level prefixes (one request per thousand)."""
    bucket, prefix = _prefix(root)
    names = []
    for page in _pages(bucket, prefix, "/", root):
        names += [p["Prefix"][len(prefix) : -1] for p in page.get("CommonPrefixes", [])]
    return sorted(n for n in names if n)


def _list_class(bucket: str, top: str, root: str, valid: Callable[[str], bool]) -> tuple[list, int]:
    found, requests = [], 0
    for page in _pages(bucket, top, None, root):
        requests += 1
        for obj in page.get("Contents", []):
            key = obj["Key"]
            if key.endswith("/"):
                continue  # a "folder" marker some tools write
            where = url.join(bucket, key)
            if valid(where):
                folder, _, name = key.rpartition("/")
                found.append((folder, name, where, int(obj["Size"]), obj["ETag"]))
    found.sort(key=lambda f: (f[0], f[1]))  # sorted(os.walk()): by folder, then by name
    return found, requests


def scan(
    root: str,
    extensions: Sequence[str],
    is_valid_file: Callable[[str], bool] | None = None,
    allow_empty: bool = False,
) -> Listing:
    """Lists ``root`` (``s3://bucket/prefix``) by ImageFolder's rules.

    Raises:
        FileNotFoundError: no class prefixes under ``root``, or a class without a valid key
            (unless ``allow_empty``); the message names them.
        StoreError: credentials refused, or no such bucket.
        PermissionError: listing is not allowed.
    """
    t0 = time.perf_counter()
    valid = is_valid_file or (lambda u: u.lower().endswith(tuple(extensions)))
    classes = class_names(root)
    if not classes:
        raise FileNotFoundError(
            f"no class folders found in {root}; expected one prefix per class ({root}/<class>/<file>)"
        )
    bucket, prefix = _prefix(root)
    with daemon_pool(min(LIST_THREADS, len(classes)), "coordl-list") as pool:
        listed = list(pool.map(lambda c: _list_class(bucket, f"{prefix}{c}/", root, valid), classes))
    urls, labels, sizes, etags, empty, requests = [], [], [], [], [], 1
    for label, (found, n) in enumerate(listed):
        requests += n
        if not found:
            empty.append(classes[label])
        for _, _, where, size, etag in found:
            urls.append(where)
            labels.append(label)
            sizes.append(size)
            etags.append(etag)
    if empty and not allow_empty:
        shown = ", ".join(empty[:10]) + (f" and {len(empty) - 10} more" if len(empty) > 10 else "")
        raise FileNotFoundError(
            f"found no valid file for the classes {shown} in {root}. Supported extensions are: {', '.join(extensions)}"
        )
    log.info(
        "coordl: listed %d objects in %d classes under %s (%d requests, %.1f s)",
        len(urls),
        len(classes),
        root,
        requests,
        time.perf_counter() - t0,
    )
    return Listing(urls=urls, labels=labels, sizes=sizes, etags=etags, classes=classes, requests=requests)


def tars(prefix: str) -> list[str]:
    """The URLs of the ``.tar`` objects directly under ``prefix`` (an ``s3://`` "folder"), sorted.

    Raises:
        StoreError: credentials refused, or no such bucket.
    """
    root = prefix.rstrip("/")
    bucket, key = url.split(root + "/")
    found = [
        url.join(bucket, obj["Key"])
        for page in _pages(bucket, key, "/", root)
        for obj in page.get("Contents", [])
        if obj["Key"].endswith(".tar")
    ]
    return sorted(found)


def stat_many(urls: Sequence[str]) -> tuple[list[int], list[str]]:
    """The sizes and ETags of ``urls`` (see :func:`stat_known`).

    Raises:
        FileNotFoundError: a URL names no object (the message names it).
        StoreError: credentials refused, or no such bucket.
    """
    known = stat_known(urls)
    sizes, etags = [], []
    for u in urls:
        if u not in known:
            raise FileNotFoundError(f"sample {u} does not exist")
        sizes.append(known[u][0])
        etags.append(known[u][1])
    return sizes, etags


def stat_known(urls: Sequence[str]) -> dict[str, tuple[int, str]]:
    """``url -> (size, ETag)`` of the ``urls`` that name an object: one listing per "folder" when
    the URLs share folders (a request per thousand keys), else one ``HeadObject`` per URL.

    Raises:
        StoreError: credentials refused, or no such bucket.
    """
    folders = sorted({u.rpartition("/")[0] for u in urls})
    known: dict[str, tuple[int, str]] = {}
    if len(folders) * 2 <= len(urls):
        for folder in folders:
            bucket, key = url.split(folder + "/")
            for page in _pages(bucket, key, "/", folder):
                for obj in page.get("Contents", []):
                    known[url.join(bucket, obj["Key"])] = (int(obj["Size"]), obj["ETag"])
    else:
        s3 = client.boto3_client()

        def head(u: str):
            bucket, key = url.split(u)
            try:
                answer = s3.head_object(Bucket=bucket, Key=key)
            except Exception as e:  # classified
                found = client.classify(e, u)
                if isinstance(found, FileNotFoundError):
                    return None
                raise found from e
            return int(answer["ContentLength"]), answer["ETag"]

        with daemon_pool(min(len(urls), client.settings().max_requests), "coordl-head") as pool:
            for u, got in zip(urls, pool.map(head, urls)):
                if got is not None:
                    known[u] = got
    return {u: known[u] for u in urls if u in known}
