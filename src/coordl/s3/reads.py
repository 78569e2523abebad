"""The only code that reads objects from the store: many GETs in flight, each checked against the
index's size and ETag, into the caller's buffers.

Every call's GETs run on this process's event loop (:func:`coordl.threads.event_loop`: one daemon
thread, ended at exit after the loaders) with obstore's async client, while the calling thread waits.
At most ``COORDL_S3_REQUESTS`` GETs are in flight in the whole process: calls share one semaphore
on the loop. Each GET carries ``If-Match: <the index's ETag>``, so an object replaced since it was
indexed is refused by the store itself (412), and its size is checked before its body is read;
then its bytes are copied from the client's receive buffer into the caller's buffers (a cache
slot): no other copy, made on the loop's thread while the call waits, so nothing writes the
buffers once the call has returned. Each try is cut at ``COORDL_S3_TIMEOUT``; throttling (503
SlowDown), 5xx answers, dropped connections and timeouts are tried again, ``AWS_MAX_ATTEMPTS``
tries in all, with exponential backoff and full jitter.

A call's requests still waiting when its ``stop`` signal is set (the loader closes; a script that
ends without ``close()`` closes it at exit, :func:`coordl.lifecycle.close_all`) are abandoned at
once: the signal's callback cancels them on the loop. Nothing polls.

obstore's runtime does not survive ``fork``: a process forked from one that used it (a
``DataLoader`` worker whose parent read samples itself) reads with boto3 instead, on daemon
threads, under the same loop and bound, and says so once.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import errno
import logging
import os
import random
from collections.abc import Sequence

from coordl import threads
from coordl.errors import DatasetChangedError, StoreError
from coordl.s3 import client, url

__all__ = ["read_many"]

log = logging.getLogger(__name__)

INIT_BACKOFF_S = 0.1  # the first retry waits up to this long; each next one up to twice as long
MAX_BACKOFF_S = 15.0
_obstore_pid: int | None = None  # the process whose obstore runtime this is (None: not started)
_warned_fork = False
_gate: asyncio.Semaphore | None = None  # GETs in flight in this process; made on the loop
_boto3_pool: threads.DaemonPool | None = None  # the boto3 reader's threads (a forked process)


def _after_fork_in_child() -> None:
    global _gate, _boto3_pool
    _gate, _boto3_pool = None, None  # the parent's loop and threads: the child starts its own


os.register_at_fork(after_in_child=_after_fork_in_child)


def read_many(
    urls: Sequence[str],
    sizes: Sequence[int],
    etags: Sequence[str | None],
    buffers: Sequence[list],
    *,
    stop: threads.Signal | None = None,
    offsets: Sequence[int] | None = None,
) -> dict[int, Exception]:
    """Reads object ``k`` of ``urls`` (``sizes[k]`` bytes, ETag ``etags[k]``) into ``buffers[k]``,
    a list of buffers that hold ``sizes[k]`` bytes in all, for every ``k``; with ``offsets``, the
    ``sizes[k]`` bytes from ``offsets[k]`` of it (a range GET, still ``If-Match`` its ETag: a tar
    shard's members). Once ``stop`` is set (the loader closes), the requests still in flight are
    abandoned (failures, ``ECANCELED``).

    Returns:
        the objects that could not be read, by position: an ``OSError`` (missing, forbidden,
        timed out or failing after the retries) or a :class:`~coordl.errors.DatasetChangedError`
        (not the size or ETag the index has). The other objects are read whatever happens to these.

    Raises:
        StoreError: the store refused the job's credentials, or the bucket is gone.
    """
    if not len(urls):
        return {}
    s = client.settings()
    where = [url.split(u) for u in urls]
    if _obstore_usable():
        # Here, not on the loop: making a store may ask for the bucket's region (a blocking request).
        reader = _Obstore({bucket: client.obstore_store(bucket) for bucket in {b for b, _ in where}}, s)
    else:
        reader = _Boto3(client.boto3_client(), s)
    call = _Call(threads.event_loop())
    reads = [
        _read_one(
            reader, *where[k], etags[k], sizes[k], buffers[k], urls[k], s, None if offsets is None else offsets[k]
        )
        for k in range(len(urls))
    ]
    handle = stop.add(call.cancel) if stop is not None else None
    try:
        future = asyncio.run_coroutine_threadsafe(call.run(reads, s), call.loop)
        try:
            results = future.result()
        except BaseException:  # interrupted while waiting (KeyboardInterrupt in the main thread)
            call.cancel()
            cf.wait([future])  # the buffers may be released once this call returns: nothing may write them after
            raise
    finally:
        if stop is not None:
            stop.remove(handle)
    failed: dict[int, Exception] = {}
    for k, r in enumerate(results):
        if r is None:
            continue
        if isinstance(r, asyncio.CancelledError):
            failed[k] = OSError(errno.ECANCELED, "the loader closed before the object arrived")
            continue
        e, retries = r if isinstance(r, tuple) else (r, 0)
        if stop is not None and stop.is_set():
            failed[k] = client.classify(e, urls[k], retries=retries)
        else:
            failed[k] = client.explain(e, urls[k], retries)  # in this thread: it may ask the store again
        if isinstance(failed[k], StoreError):
            raise failed[k]  # no sample can be read: the objects left need no explaining
    return failed


class _Call:
    """One call's requests on the loop; :meth:`cancel` abandons those still waiting, from any thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.tasks: list[asyncio.Future] = []
        self.cancelled = False

    def cancel(self) -> None:
        self.loop.call_soon_threadsafe(self._cancel)

    def _cancel(self) -> None:
        self.cancelled = True  # before run() started: it cancels its tasks as it makes them
        for task in self.tasks:
            task.cancel()

    async def run(self, reads: list, s: client.Settings) -> list:
        global _gate
        if _gate is None:
            _gate = asyncio.Semaphore(s.max_requests)
        self.tasks = [asyncio.ensure_future(r) for r in reads]
        if self.cancelled:
            self._cancel()
        return await asyncio.gather(*self.tasks, return_exceptions=True)


async def _read_one(
    reader, bucket: str, key: str, etag, size: int, views: list, where: str, s: client.Settings, offset: int | None
):
    """Reads one object into ``views``, trying again what may succeed if tried again.

    Returns:
        None, or ``(what the client raised, how many times it was tried again)``.
    """
    failure: BaseException | None = None
    async with _gate:
        for n in range(reader.tries):
            if n:
                await asyncio.sleep(random.uniform(0.0, min(MAX_BACKOFF_S, INIT_BACKOFF_S * 2 ** (n - 1))))
            try:
                data = await reader.get(bucket, key, etag, size, where, offset)
                _scatter(data, views, size, where)
                return None
            except reader.retried as e:
                failure = e
            except Exception as e:  # noqa: BLE001 - classified by the caller, with the store's answer
                return e, n
    return failure, reader.tries - 1


class _Obstore:
    """GETs with obstore's async client, one try each (coordl retries), cut at ``timeout_s``."""

    def __init__(self, stores: dict, s: client.Settings):
        from obstore.exceptions import GenericError

        self.stores = stores
        self.timeout_s = s.timeout_s
        self.tries = s.attempts
        # What may succeed if tried again: a try cut at the timeout, and obstore's GenericError,
        # which carries every failure without a variant of its own (see coordl.s3.client).
        self.retried = (TimeoutError, GenericError)

    async def get(self, bucket: str, key: str, etag: str | None, size: int, where: str, offset: int | None):
        try:
            return await asyncio.wait_for(self._get(bucket, key, etag, size, where, offset), self.timeout_s)
        except asyncio.TimeoutError:  # not the builtin TimeoutError before Python 3.11
            raise TimeoutError from None  # classify() says it, with the tries

    async def _get(self, bucket: str, key: str, etag: str | None, size: int, where: str, offset: int | None):
        import obstore

        options = {"if_match": etag} if etag else {}
        if offset is not None:
            options["range"] = (offset, offset + size)  # the end is exclusive
        answer = await obstore.get_async(self.stores[bucket], key, options=options or None)
        if offset is None and int(answer.meta["size"]) != size:
            raise _changed_size(where, int(answer.meta["size"]), size)
        if offset is not None and tuple(answer.range) != (offset, offset + size):
            raise _short_range(where, offset, size, int(answer.meta["size"]))
        return await answer.bytes_async()


class _Boto3:
    """GETs with boto3 on daemon threads (a process forked after obstore started); botocore retries."""

    tries = 1
    retried = ()

    def __init__(self, s3, s: client.Settings):
        global _boto3_pool
        self.s3 = s3
        if _boto3_pool is None:
            _boto3_pool = threads.daemon_pool(s.max_requests, "coordl-s3-boto3")
        self.pool = _boto3_pool

    async def get(self, bucket: str, key: str, etag: str | None, size: int, where: str, offset: int | None):
        # The bytes come back to the loop, which copies them: a request abandoned on its thread writes nothing.
        return await asyncio.wrap_future(self.pool.submit(self._get, bucket, key, etag, size, where, offset))

    def _get(self, bucket: str, key: str, etag: str | None, size: int, where: str, offset: int | None) -> bytes:
        kw = {"IfMatch": etag} if etag else {}
        if offset is not None:
            kw["Range"] = f"bytes={offset}-{offset + size - 1}"
        answer = self.s3.get_object(Bucket=bucket, Key=key, **kw)
        try:
            if int(answer["ContentLength"]) != size:
                if offset is not None:
                    raise _short_range(where, offset, size, int(answer["ContentLength"]) + offset)
                raise _changed_size(where, int(answer["ContentLength"]), size)
            return answer["Body"].read()
        finally:
            answer["Body"].close()


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


def _short_range(where: str, offset: int, size: int, actual: int) -> DatasetChangedError:
    return DatasetChangedError(
        f"{where} ends at byte {actual}, inside the {size} bytes from byte {offset} the index says are there: the "
        "dataset changed after it was indexed; restart so that it is indexed again"
    )


def _changed_size(where: str, actual: int, size: int) -> DatasetChangedError:
    return DatasetChangedError(
        f"{where} is {actual} bytes but the index says {size}: the dataset changed after it was indexed; "
        "restart so that it is indexed again"
    )
