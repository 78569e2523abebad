"""A loader's remote prep: its pool of actors, how many units they may hold, and how the pool
follows the measured stalls (``RayPrep(workers="auto")``).

Made once per loader when its first pass starts (:class:`~coordl.resources.Resources`) and
closed with it; passes share it, as they share the local pipeline.
"""

from __future__ import annotations

import logging
import math
import time

from coordl.options import RayPrep
from coordl.remote.cluster import DEPTH, WorkerPool, trainer_only
from coordl.remote.worker import Job
from coordl.staging.pixels import Normaliser

__all__ = ["DEPTH", "RemotePrep", "scale_step"]

log = logging.getLogger(__name__)

SCALE_EVERY_S = 1.0  # how often workers="auto" looks at the stalls
GROW_ABOVE = 0.05  # the loop waited more than this share of the time: one more actor
SHRINK_BELOW = 0.01  # less than this share, with prepared batches waiting: one fewer
START_TIMEOUT_S = 120.0  # a pass with no local prep waits this long for a first actor
MAX_RATIO = 16.0  # the actors' rate over the local pipeline's that the default bound follows, at most


def scale_step(
    *,
    waited: float,
    elapsed: float,
    ready: int,
    actors: int,
    starting: int,
    free_cpus: float,
    cpus: int,
    most: int,
    least: int,
) -> int:
    """``workers="auto"``: +1, -1 or 0 actors, from the last interval's figures.

    The training loop waited for batches more than :data:`GROW_ABOVE` of the time, no actor is
    still starting (the one added last must first show what it changes: an actor takes seconds to
    start, and until it is ready the loop waits as before), and the cluster has the CPUs for
    another actor (and the pool is under ``most``): one more. It waited less
    than :data:`SHRINK_BELOW`, and prepared batches are waiting for it (more than there are
    actors, so the actors are ahead, not merely in step): one fewer, down to ``least``.
    """
    if elapsed <= 0:
        return 0
    share = waited / elapsed
    if share > GROW_ABOVE and not starting and actors < most and free_cpus >= cpus:
        return 1
    if share < SHRINK_BELOW and ready > actors and actors > least:
        return -1
    return 0


class RemotePrep:
    """The actors of one loader (see the module's docstring).

    Args:
        options: the loader's :class:`~coordl.RayPrep`.
        job: what the actors prepare.
        device_id: the trainer's GPU (None: the CPU): batches from actors are moved there.
        normalize: the recipe's :class:`~coordl.staging.pixels.Normaliser`, when actors send uint8 pixels
            (``RayPrep(output="uint8")``: units ask for the recipe's pixels).
    """

    def __init__(self, options: RayPrep, job: Job, device_id, normalize=None):
        self.options = options
        self.job = job
        self.device_id = device_id
        self.normalize = normalize
        workers = 1 if options.workers == "auto" else options.workers
        if not options.on_trainer_node and trainer_only():  # Ray would never place them (check_nodes warned)
            workers = 0
        self.pool = WorkerPool(job, workers, options.cpus_per_worker, options.on_trainer_node)
        self._last_scale = time.monotonic()
        self.least = 0 if options.local else 1
        self.waited_total = 0.0

    @classmethod
    def for_loader(
        cls, options: RayPrep, *, backend: str, index, config, cache, recipe, items, torch_options, device_id
    ):
        """The remote prep of a loader's settings (its actors start now)."""
        normalize = Normaliser.of(recipe) if backend == "dali" and options.output == "uint8" else None
        from coordl.remote import versions
        from coordl.remote.cluster import actor_env

        job = Job(
            backend=backend,
            index=index,
            seed=config.seed,
            batch_size=config.batch_size,
            on_error=config.on_error,
            cache=cache,
            reads=options.reads,
            threads=options.cpus_per_worker,
            recipe=recipe if backend == "dali" else None,
            items=items,
            collate_fn=torch_options.collate_fn,
            worker_init_fn=torch_options.worker_init_fn,
            first_worker_id=torch_options.num_workers if options.local else 0,
            env=actor_env(),
            versions=versions.versions(backend),
        )
        return cls(options, job, device_id, normalize)

    def bound(self, local_depth: int = 0, ratio: float = 1.0) -> int:
        """Units the actors may hold that the training loop has not taken (``RayPrep(in_flight)``).

        By default: two per ready actor (one running, one waiting), two more, and what the actors
        make while the loop waits for a unit of the local pipeline, which holds ``local_depth``
        units (its queue): ``local_depth`` times ``ratio``, the actors' rate over the local one.
        Batches are delivered in order, so with less the actors would wait for the local queue.
        """
        if self.options.in_flight is not None:
            return self.options.in_flight
        local = math.ceil(local_depth * min(max(ratio, 1.0), MAX_RATIO)) if local_depth else 0
        return DEPTH * max(1, len(self.pool.ready)) + 2 + local

    def most(self) -> int:
        o = self.options
        return o.max_workers if o.max_workers is not None else 1 << 20

    def scale(self, rate, ready: int) -> None:
        """Grows or shrinks the pool (``workers="auto"``), at most once per :data:`SCALE_EVERY_S`."""
        if self.options.workers != "auto" or time.monotonic() - self._last_scale < SCALE_EVERY_S:
            return
        self._last_scale = time.monotonic()
        waited, elapsed = rate.take()
        pool = self.pool
        starting = pool.starting
        step = scale_step(
            waited=waited,
            elapsed=elapsed,
            ready=ready,
            actors=pool.size,
            starting=starting,
            free_cpus=pool.free_cpus() if waited > GROW_ABOVE * elapsed and not starting else 0.0,
            cpus=pool.cpus,
            most=self.most(),
            least=self.least,
        )
        if step > 0:
            log.info(
                "coordl: RayPrep: the loop waited %.0f%% of the time: starting actor %d",
                100 * waited / elapsed,
                pool.size + 1,
            )
            pool.add()
        elif step < 0 and (ready_actors := list(pool.ready)):
            log.info("coordl: RayPrep: prepared batches are waiting: ending one of %d actors", pool.size)
            pool.retire(ready_actors[-1])

    def died(self, actor, error: BaseException, lost: float) -> bool:
        """``actor``'s unit failed because it died (``lost``: seconds since the unit was handed
        to it): the first report of its death logs it, ends it and starts its replacement. True
        for that first report."""
        if not self.pool.died_now(actor):
            return False
        log.warning(
            "coordl: a RayPrep actor died (%s); its units run again elsewhere (%.2f s of its work lost)",
            type(error).__name__,
            lost,
        )
        self.replace()
        return True

    def replace(self) -> None:
        """After an actor died: a new one in its place (a fixed number of workers), on whichever
        machine has the CPUs."""
        if self.options.workers != "auto" and self.pool.size < self.options.workers and not self.pool.closed:
            self.pool.add()

    def close(self) -> None:
        self.pool.close()

    def remove_left_cache(self, cache) -> None:
        """After the loader left its node's cache (a NodeCache, or None): see
        :meth:`WorkerPool.remove_left_cache <coordl.remote.cluster.WorkerPool.remove_left_cache>`."""
        if cache is not None:
            self.pool.remove_left_cache(cache.fingerprint, cache.directory)
