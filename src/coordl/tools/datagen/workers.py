"""Writing images, in a pool of worker processes when there are many.

:func:`generate` writes the images it is given, in this process or, for
:data:`PARALLEL_MIN_IMAGES` or more on several cores, in a ``fork`` pool that shares the
photographs the parent decoded. Every image is a pure function of the job and its index, so
the files are the same whichever process writes them, in whatever order.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable

from coordl import cpus
from coordl.tools.datagen import images
from coordl.tools.datagen.job import Job

__all__ = ["PARALLEL_MIN_IMAGES", "cpu_count", "generate"]

PARALLEL_MIN_IMAGES = 200  # fewer are written in this process: a pool costs more than it saves
_CHUNK = 8  # images per pool task

# The job a pool worker runs, set by the pool initializer.
_WORKER_JOB: Job | None = None


def generate(job: Job, todo: list[int], advance: Callable[[int], None]) -> dict[int, tuple[int, int]]:
    """Write images ``todo``, calling ``advance(bytes)`` after each one.

    Returns:
        ``{index: (bytes, pixels)}`` of the written images.
    """
    done: dict[int, tuple[int, int]] = {}
    workers = cpu_count()
    # (daemonic processes, e.g. pool workers, may not start a pool of their own)
    if workers > 1 and len(todo) >= PARALLEL_MIN_IMAGES and not multiprocessing.current_process().daemon:
        for path in job.photos:  # decode before forking: workers share the pixels
            images.load_photo(path)
        chunks = [todo[k : k + _CHUNK] for k in range(0, len(todo), _CHUNK)]
        with _mp_context().Pool(workers, initializer=_init_worker, initargs=(job,)) as pool:
            for results in pool.imap_unordered(_worker_write, chunks):
                for i, nbytes, pixels in results:
                    done[i] = (nbytes, pixels)
                    advance(nbytes)
    else:
        for i in todo:
            done[i] = job.write(i)
            advance(done[i][0])
    return done


def cpu_count() -> int:
    """The CPUs this process may use (its affinity and its cgroups' CPU quota): the pool's size."""
    return cpus.available()


def _mp_context() -> multiprocessing.context.BaseContext:
    # fork shares the decoded photos and needs no re-import of this module.
    if "fork" in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("fork")
    return multiprocessing.get_context()


def _init_worker(job: Job) -> None:
    global _WORKER_JOB
    _WORKER_JOB = job


def _worker_write(indices: list[int]) -> list[tuple[int, int, int]]:
    job = _WORKER_JOB
    if job is None:  # pragma: no cover - the pool initializer always sets it
        raise RuntimeError("worker job not initialised")
    return [(i, *job.write(i)) for i in indices]
