"""The only code that reads objects from the store: many GETs in flight, each checked against the
index's size and ETag, into the caller's buffers.

One call reads a list of objects concurrently (obstore's async GETs on an event loop of the
calling thread), at most ``COORDL_S3_REQUESTS`` in flight in the whole process: calls share
that many tokens. Each GET carries ``If-Match: <the index's ETag>``, so an object replaced since
it was indexed is refused by the store itself (412), and its size is checked before its body is
read; then its bytes are copied from the client's receive buffer into the caller's buffers (a
cache slot): no other copy. Throttling (503 SlowDown), 5xx answers, dropped connections and
timeouts are retried by the client with exponential backoff and jitter (``AWS_MAX_ATTEMPTS``).

A call's requests still waiting when its ``stop`` event is set (the loader closes) or the
interpreter exits (a script that ends without ``close()``) are abandoned, so that neither waits
out the timeout and its retries.

obstore's runtime does not survive ``fork``: a process forked from one that used it (a
``DataLoader`` worker whose parent read samples itself) reads with boto3 instead, on threads,
and says so once.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import errno
import logging
import os
import threading
from collections.abc import Sequence

from coordl.errors import DatasetChangedError, StoreError
from coordl.s3 import client, url

__all__ = ["read_many"]

log = logging.getLogger(__name__)

STOP_POLL_S = 0.05  # how often a call's requests look at its stop event
_obstore_pid: int | None = None  # the process whose obstore runtime this is (None: not started)
_warned_fork = False


class _Tokens:
    """Requests in flight in this process: at most ``limit``, shared by concurrent calls."""

    def __init__(self, limit: int):
        self.free = limit
        self.cond = threading.Condition()

    def take(self, want: int) -> int:
        """Blocks until at least one token is free; takes up to ``want``."""
        with self.cond:
            while self.free == 0:
                self.cond.wait()
            n = min(want, self.free)
            self.free -= n
            return n

    def give(self, n: int) -> None:
        with self.cond:
            self.free += n
            self.cond.notify_all()


_tokens: _Tokens | None = None
_tokens_lock = threading.Lock()


def _after_fork_in_child() -> None:
    global _tokens, _tokens_lock
    _tokens, _tokens_lock = None, threading.Lock()  # another thread may have held them at the fork


os.register_at_fork(after_in_child=_after_fork_in_child)

# The interpreter is exiting: requests still waiting are abandoned. Python joins the I/O pools'
# threads (concurrent.futures' exit hook) before atexit closes the loaders a script left open, so
# a hook of the same kind, registered later and so run earlier, must release them first.
_exiting = threading.Event()
threading._register_atexit(_exiting.set)  # private, but the hook concurrent.futures itself uses


def _process_tokens() -> _Tokens:
    global _tokens
    with _tokens_lock:
        if _tokens is None:
            _tokens = _Tokens(client.settings().max_requests)
        return _tokens


def read_many(
    urls: Sequence[str],
    sizes: Sequence[int],
    etags: Sequence[str | None],
    buffers: Sequence[list],
    *,
    stop: threading.Event | None = None,
) -> dict[int, Exception]:
    """Reads object ``k`` of ``urls`` (``sizes[k]`` bytes, ETag ``etags[k]``) into ``buffers[k]``,
    a list of buffers that hold ``sizes[k]`` bytes in all, for every ``k``. Once ``stop`` is set
    (the loader closes), the requests still in flight are abandoned (failures, ``ECANCELED``).

    Returns:
        the objects that could not be read, by position: an ``OSError`` (missing, forbidden,
        timed out or failing after the retries) or a :class:`~coordl.errors.DatasetChangedError`
        (not the size or ETag the index has). The other objects are read whatever happens to these.

    Raises:
        StoreError: the store refused the job's credentials, or the bucket is gone.
    """
    if not len(urls):
        return {}
    tokens = _process_tokens()
    n = tokens.take(len(urls))
    try:
        if _obstore_usable():
            failed = _run(_read_async(urls, sizes, etags, buffers, n, stop))
        else:
            failed = _read_threads(urls, sizes, etags, buffers, n)
    finally:
        tokens.give(n)
    for e in failed.values():
        if isinstance(e, StoreError):
            raise e
    return failed


def _obstore_usable() -> bool:
    global _obstore_pid, _warned_fork
    pid = os.getpid()
    if _obstore_pid is None:
        _obstore_pid = pid
    if _obstore_pid == pid:
        return True
    if not _warned_fork:
        _warned_fork = True
        log.warning(
            "coordl: this process was forked from one that had read s3:// objects with obstore, whose runtime does "
            "not survive fork; it reads with boto3 instead, at about 3x the CPU time per request. Start the workers "
            "with multiprocessing_context='forkserver' (or 'spawn') to keep obstore"
        )
    return False


def _run(coro):
    """Runs ``coro`` on an event loop of its own: here, or on a helper thread when this thread
    already runs one (a caller inside async code)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with cf.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


def _scatter(data, views: list, size: int, where: str) -> None:
    """Copies the object's bytes into the caller's buffers."""
    src = memoryview(data).cast("B")
    if len(src) != size:
        raise DatasetChangedError(f"{where} answered {len(src)} bytes but the index says {size}: the dataset changed")
    at = 0
    for v in views:
        dst = memoryview(v).cast("B")
        dst[:] = src[at : at + len(dst)]
        at += len(dst)


def _changed_size(where: str, actual: int, size: int) -> DatasetChangedError:
    return DatasetChangedError(
        f"{where} is {actual} bytes but the index says {size}: the dataset changed after it was indexed; "
        "restart so that it is indexed again"
    )


async def _read_async(urls, sizes, etags, buffers, limit: int, stop: threading.Event | None) -> dict[int, Exception]:
    import obstore

    gate = asyncio.Semaphore(limit)
    where = [url.split(u) for u in urls]
    stores = {bucket: client.obstore_store(bucket) for bucket in {b for b, _ in where}}  # once per call, not object

    async def one(k: int) -> None:
        bucket, key = where[k]
        store = stores[bucket]
        options = {"if_match": etags[k]} if etags[k] else None
        async with gate:
            answer = await obstore.get_async(store, key, options=options)
            actual = int(answer.meta["size"])
            if actual != sizes[k]:
                raise _changed_size(urls[k], actual, sizes[k])
            data = await answer.bytes_async()
        _scatter(data, buffers[k], sizes[k], urls[k])

    tasks = [asyncio.ensure_future(one(k)) for k in range(len(urls))]
    watch = asyncio.ensure_future(_cancel_on(stop, tasks))
    results = await asyncio.gather(*tasks, return_exceptions=True)
    watch.cancel()
    return {k: _failure(r, urls[k]) for k, r in enumerate(results) if isinstance(r, BaseException)}


async def _cancel_on(stop: threading.Event | None, tasks: list) -> None:
    """Cancels ``tasks`` once ``stop`` is set or the interpreter exits (checked every 50 ms)."""
    while not (_exiting.is_set() or (stop is not None and stop.is_set())):
        await asyncio.sleep(STOP_POLL_S)
    for t in tasks:
        t.cancel()


def _failure(e: BaseException, where: str) -> Exception:
    if isinstance(e, asyncio.CancelledError):
        return OSError(errno.ECANCELED, "the loader closed before the object arrived")
    return client.classify(e, where)


def _read_threads(urls, sizes, etags, buffers, limit: int) -> dict[int, Exception]:
    """The same reads with boto3 on ``limit`` threads (a process forked after obstore started)."""
    s3 = client.boto3_client()

    def one(k: int) -> None:
        bucket, key = url.split(urls[k])
        extra = {"IfMatch": etags[k]} if etags[k] else {}
        answer = s3.get_object(Bucket=bucket, Key=key, **extra)
        if int(answer["ContentLength"]) != sizes[k]:
            answer["Body"].close()
            raise _changed_size(urls[k], int(answer["ContentLength"]), sizes[k])
        _scatter(answer["Body"].read(), buffers[k], sizes[k], urls[k])

    failed: dict[int, Exception] = {}
    with cf.ThreadPoolExecutor(min(limit, len(urls))) as pool:
        futures = {pool.submit(one, k): k for k in range(len(urls))}
        for future, k in futures.items():
            e = future.exception()
            if e is not None:
                failed[k] = client.classify(e, urls[k])
    return failed
