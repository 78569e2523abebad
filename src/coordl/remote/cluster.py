"""The Ray side: connecting to the cluster, and the pool of actors that run a loader's units.

Ray is imported here only, and only when a loader is made with :class:`~coordl.RayPrep`. The
actors are the driver's (not detached): Ray ends them when the script ends however it ends, and
:meth:`WorkerPool.close` ends them at once.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time

from coordl import lifecycle
from coordl.errors import CoordlError, warn
from coordl.options import refuse_ray_client
from coordl.remote.address import join as address_join
from coordl.remote.address import split as address_split
from coordl.threads import OwnedLock

__all__ = [
    "DEPTH",
    "Dispatch",
    "WorkerPool",
    "actor_options",
    "cause",
    "check_nodes",
    "connect",
    "free_cpus",
    "ray_module",
    "trainer_only",
]

log = logging.getLogger(__name__)

CLOSE_TIMEOUT_S = 2.0  # for actors to leave their nodes' caches when the loader closes
EXIT_TIMEOUT_S = 10.0  # for the actors that did not leave in time to be gone, once killed
# After SIGTERM, within the process's SIGTERM_DEADLINE_S (1.5 s), beside the loader's other closing:
TERM_LEAVE_S = 0.5  # for actors to leave their nodes' caches
TERM_EXIT_S = 0.5  # then for the killed ones that had not left to be gone
KILLED_EXIT_S = 2.0  # for the processes of actors killed while starting to leave their cache
DEPTH = 2  # units each actor holds: one running, one waiting, so it is never idle between units


def ray_module():
    """Ray, or a clear error when it is not installed."""
    try:
        import ray
    except ImportError:
        raise ImportError(
            "prep=coordl.RayPrep(...) needs Ray: pip install 'coordl[ray]' (on every machine of the cluster)"
        ) from None
    return ray


def connect(address: str) -> None:
    """Connects this process to the Ray cluster at ``address`` (once; a script's own
    ``ray.init`` is used as it is).

    Raises:
        CoordlError: no Ray cluster answers at ``address``.
    """
    ray = ray_module()
    if ray.is_initialized():
        return
    target = address  # "auto": Ray reads RAY_ADDRESS, else finds the cluster this machine runs
    if target == "auto":
        env = os.environ.get("RAY_ADDRESS", "")
        refuse_ray_client(env, f"RAY_ADDRESS={env!r}", CoordlError)
    hint = (
        "start one with `ray start --head --num-cpus=0` on this machine (0: it lends no CPUs to actors) and "
        "`ray start --address=<head>:6379` on the others, or pass RayPrep(address='<head>:6379'); see "
        "docs/remote-prep.md"
    )
    if target not in ("auto", "local"):
        host, port = address_split(target)  # RayPrep checked it; an IPv6 host comes without brackets
        target = address_join(host, port)  # Ray's form: "[::1]:6379"
        try:
            socket.create_connection((host, port), timeout=5).close()
        except OSError as e:
            raise CoordlError(
                f"coordl: no Ray cluster at RayPrep(address={address!r}) ({target}: {e}); {hint}"
            ) from None
    main = threading.current_thread() is threading.main_thread()
    sigterm = signal.getsignal(signal.SIGTERM) if main else None
    try:
        ray.init(address=target, logging_level=logging.WARNING, log_to_driver=True, configure_logging=False)
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise CoordlError(
            f"coordl: cannot join the Ray cluster at RayPrep(address={address!r}): {type(e).__name__}: {e} (if a "
            "cluster runs there: its token, RAY_AUTH_TOKEN / ~/.ray/auth_token, or its Ray version differs from "
            f"this machine's); {hint}"
        ) from None
    finally:
        # ray.init replaces the script's SIGTERM handling with sys.exit(15), under a C handler of
        # Ray's that aborts the process (-6) when it has not exited 3 s later: the script's own
        # handling is put back (the default action: coordl's, which closes the loaders first).
        if sigterm is not None and signal.getsignal(signal.SIGTERM) is not sigterm:
            signal.signal(signal.SIGTERM, sigterm)


def actor_env() -> dict:
    """The trainer's settings that an actor's coordl reads (``COORDL_*``, and ``AWS_*`` for
    ``s3://``), for the actor's process."""
    return {k: v for k, v in os.environ.items() if k.startswith(("COORDL_", "AWS_"))}


NODE_ID = "ray.io/node-id"  # the label Ray gives every node (Ray 2.49 and later)


def actor_options(on_trainer_node: bool) -> dict:
    """Ray's options for a new actor: the trainer's settings (:func:`actor_env`) in its
    environment, and, unless ``on_trainer_node`` (``RayPrep(on_trainer_node)``), a node other than
    the trainer's: the trainer's CPUs run its training loop and its own pipeline, whatever its
    node lends to Ray."""
    env = actor_env()
    options = {"runtime_env": {"env_vars": env}} if env else {}
    if not on_trainer_node:
        options["label_selector"] = {NODE_ID: "!" + trainer_node()}
    return options


def trainer_node() -> str:
    """The Ray node id of this process's node."""
    return ray_module().get_runtime_context().get_node_id()


def trainer_only() -> bool:
    """Whether the cluster has no live node but this process's."""
    me = trainer_node()
    return not any(n.get("Alive") and n.get("NodeID") != me for n in ray_module().nodes())


def check_nodes(options) -> None:
    """Says at once when the cluster has no node ``RayPrep`` (``options``) lets its actors run on:
    none but the trainer's, which ``on_trainer_node=False`` keeps them off. Ray would never place
    them. With ``local=False`` nobody would prepare a batch: an error; with ``local=True`` a warning
    that no actor will start (the local pipeline prepares every batch).

    Raises:
        CoordlError: no such node, and ``RayPrep(local=False)``.
    """
    if options.on_trainer_node or options.workers == 0 or not trainer_only():
        return
    if not options.local:
        raise CoordlError(
            f"coordl: the Ray cluster of RayPrep(address={options.address!r}) has no node but this trainer's, and "
            "RayPrep(on_trainer_node=False) keeps the actors off it: no actor can start, and RayPrep(local=False) "
            "leaves nobody to prepare batches; pass RayPrep(on_trainer_node=True) to run them on this machine (they "
            "then share its CPUs with the training loop), or start Ray on another machine "
            "(`ray start --address=<head>:6379`); see docs/remote-prep.md"
        )
    warn(
        f"coordl: the Ray cluster of RayPrep(address={options.address!r}) has no node but this trainer's, and "
        "RayPrep(on_trainer_node=False) keeps the actors off it: no actor will start, and this machine's pipeline "
        "prepares every batch (RayPrep(local=True)); pass RayPrep(on_trainer_node=True) to run them on this "
        "machine too, or start Ray on another machine (`ray start --address=<head>:6379`)"
    )


def free_cpus(on_trainer_node: bool) -> float:
    """Ray's free CPUs where an actor may be placed: every node's, less the trainer's unless
    ``on_trainer_node``. 0.0 once this process is no longer connected to the cluster (the loader is
    closing); any other failure is raised."""
    ray = ray_module()
    from ray._private.state import available_resources_per_node  # Ray's DeveloperAPI: no public one per node

    try:
        nodes = available_resources_per_node()
        trainer = None if on_trainer_node else trainer_node()
    except (ray.exceptions.RaySystemError, ray.exceptions.RpcError, ConnectionError):
        if ray.is_initialized():
            raise
        return 0.0  # ray.shutdown() ran: the script is ending
    return float(sum(free.get("CPU", 0.0) for node, free in nodes.items() if node != trainer))


class WorkerPool:
    """The actors preparing one loader's units.

    Its state (the actors, those starting, ready, retiring and leaving, the counts) is read and
    changed under one lock, by the pass's and the HP group's threads, ``stats()`` and ``close()``;
    Ray's waits run outside it. The lock is an :class:`~coordl.threads.OwnedLock`: the closing on
    SIGTERM does not wait for it when the parked main thread holds it.

    Args:
        job: what they prepare (:class:`~coordl.remote.worker.Job`).
        workers: actors to start now.
        cpus: Ray CPUs per actor.
        on_trainer_node: actors may run on the trainer's node (``RayPrep(on_trainer_node)``).
    """

    def __init__(self, job, workers: int, cpus: int, on_trainer_node: bool = False):
        ray = ray_module()
        from coordl.remote.worker import PrepWorker

        self._ray = ray
        self._cpus = cpus
        self.on_trainer_node = on_trainer_node
        self._options = actor_options(on_trainer_node)
        self._job_ref = ray.put(job)
        self._cls = ray.remote(num_cpus=cpus, max_restarts=0, max_concurrency=1)(PrepWorker)
        self._lock = OwnedLock()
        self._ready: dict[object, dict] = {}  # actor -> what it said when ready
        self._starting: dict[object, object] = {}  # ready() ref -> actor
        self._actors: list = []
        self._retiring: set = set()  # ready actors that take no new units, ended once idle
        self._leaving: dict = {}  # close() ref -> a retired actor leaving its node's cache
        self._where: dict = {}  # actor -> what it said when ready (kept after it retires)
        self.started = 0
        self.died = 0
        self.closed = False
        self.killed_starting = False  # close() killed actors still starting (their pids unknown)
        for _ in range(workers):
            self.add()

    @property
    def ready(self) -> dict:
        """The ready actors (a copy): actor -> what it said when ready."""
        with self._lock:
            return dict(self._ready)

    @property
    def retiring(self) -> set:
        """The retiring actors (a copy)."""
        with self._lock:
            return set(self._retiring)

    @property
    def starting(self) -> int:
        """Actors started and not yet ready."""
        with self._lock:
            return len(self._starting)

    def add(self) -> None:
        """Starts one more actor; it takes units once it is ready. Nothing once closed (a pass's
        thread may replace a dead actor while the loader closes)."""
        with self._lock:
            if self.closed:
                return
            actor = self._cls.options(**self._options).remote(self._job_ref, self.started)
            self._actors.append(actor)
            self._starting[actor.ready.remote()] = actor
            self.started += 1

    def remove(self, actor) -> None:
        """Ends ``actor`` now (its units in flight fail and are run again)."""
        with self._lock:
            self._forget(actor)
        self._kill(actor)

    def _forget(self, actor) -> bool:
        """``actor`` out of every state (under the lock); whether it was started and not ended."""
        known = actor in self._actors
        if known:
            self._actors.remove(actor)
        self._ready.pop(actor, None)
        self._retiring.discard(actor)
        for ref in [ref for ref, a in self._starting.items() if a is actor]:
            del self._starting[ref]
        return known

    def _kill(self, actor) -> None:
        try:
            self._ray.kill(actor, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass

    def retire(self, actor) -> None:
        """``actor`` takes no new units; :meth:`reap` ends it once it holds none."""
        with self._lock:
            if self._ready.pop(actor, None) is not None:
                self._retiring.add(actor)

    def reap(self, holding) -> None:
        """Ends the retiring actors that hold no unit (``holding(actor)``: units it holds), once
        each has left its node's cache."""
        with self._lock:
            if self.closed:
                return
            for actor in [a for a in self._retiring if not holding(a)]:
                self._retiring.discard(actor)
                self._leaving[actor.close.remote()] = actor
            leaving = list(self._leaving)
        if leaving:
            done, _ = self._ray.wait(leaving, num_returns=len(leaving), timeout=0)
            for ref in done:
                with self._lock:
                    actor = self._leaving.pop(ref, None)
                if actor is not None:
                    self.remove(actor)

    def died_now(self, actor) -> bool:
        """``actor`` died: forgotten. True for the first report of the death of an actor that was
        ready or retiring (one decision, under the lock, when two threads report it)."""
        with self._lock:
            first = actor in self._ready or actor in self._retiring
            if self._forget(actor):
                self.died += 1
        self._kill(actor)
        return first

    def poll(self, timeout: float = 0.0) -> None:
        """Moves actors that finished starting to :attr:`ready`; an actor that failed to start is
        dropped, and its error raised when no actor is left at all."""
        with self._lock:
            refs = list(self._starting)
        if not refs:
            return
        done, _ = self._ray.wait(refs, num_returns=len(refs), timeout=timeout)
        for ref in done:
            try:
                info, error = self._ray.get(ref), None
            except Exception as e:  # noqa: BLE001 - the actor could not start
                info, error = None, e
            with self._lock:
                actor = self._starting.pop(ref, None)
                if actor is not None and error is None:
                    self._ready[actor] = self._where[actor] = info
            if actor is None or error is None:  # removed meanwhile (closed), or ready
                continue
            self.died_now(actor)
            if not self.size:
                raise CoordlError(f"coordl: RayPrep's actors cannot start: {cause(error)}") from None
            log.warning("coordl: a RayPrep actor could not start: %s", cause(error))

    def wait_ready(self, timeout: float) -> None:
        """Waits until at least one actor is ready (or none is starting), at most ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while self.starting and not self.ready and time.monotonic() < deadline:
            self.poll(min(0.5, max(0.0, deadline - time.monotonic())))

    @property
    def size(self) -> int:
        """Actors started and not ended (ready or starting)."""
        with self._lock:
            return len(self._actors)

    def free_cpus(self) -> float:
        """Ray's free CPUs where this pool may place an actor (:func:`free_cpus`)."""
        return free_cpus(self.on_trainer_node)

    @property
    def cpus(self) -> int:
        return self._cpus

    def close(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
        """Ends every actor: each first leaves its node's cache (at most ``timeout`` seconds for
        all), then is killed. An actor that had not left by then (on busy cores it may still be
        running its units, or starting) leaves its node's cache behind it: once such actors are
        gone (at most :data:`EXIT_TIMEOUT_S`), the caches in this node's shm folder that no live
        process uses are removed, as the next loader would. After SIGTERM the whole of it fits in
        the time the process has left (:data:`~coordl.lifecycle.SIGTERM_DEADLINE_S`). Idempotent."""
        t0 = time.monotonic()
        exit_timeout = EXIT_TIMEOUT_S
        if lifecycle.terminating():  # a share of the deadline each: leaving, then the killed ones' exit
            timeout, exit_timeout = min(timeout, TERM_LEAVE_S), TERM_EXIT_S
        with self._lock:
            if self.closed:
                return
            self.closed = True
            asked = dict(self._leaving)  # close() ref -> actor
            leave = [*self._ready, *self._retiring]
            starting = list(self._starting)
            actors = list(self._actors)
            for actor in actors:
                self._forget(actor)
        try:
            for actor in leave:
                asked[actor.close.remote()] = actor
            done, _ = self._ray.wait(list(asked), num_returns=len(asked), timeout=timeout) if asked else ([], [])
        except Exception:  # noqa: BLE001 - the cluster is going away: they end anyway
            done = list(asked)
        late = [asked[ref] for ref in asked if ref not in done]
        self.killed_starting = bool(starting)
        for actor in actors:
            self._kill(actor)
        if late or starting:
            self._reap_after(late, starting, t0 + timeout + exit_timeout)

    def _reap_after(self, late, starting, deadline: float) -> None:
        """Once the killed actors ``late`` (ready, on this machine) and ``starting`` (their ready()
        refs) are gone, at most until ``deadline`` (monotonic), removes the caches in this machine's
        shm folder that no live process uses (an actor on another machine leaves its cache to the
        next loader there)."""
        here = socket.gethostname()
        pids = [
            int(w.rsplit(":", 1)[1])
            for a in late
            for w in [self._where.get(a, {}).get("worker", "")]
            if w.startswith(here + ":")
        ]
        try:
            if starting:  # they fail once Ray has seen the actor die
                left = max(0.0, deadline - time.monotonic())
                self._ray.wait(starting, num_returns=len(starting), timeout=left)
        except Exception:  # noqa: BLE001 - the cluster is going away
            pass
        while pids and time.monotonic() < deadline:  # Ray reports a killed actor dead before its process is gone
            pids = [pid for pid in pids if _may_hold_files(pid)]
            time.sleep(0.02)
        from coordl.shm import reaper

        for g in reaper.reap():
            log.info("coordl: removed the cache %s that a RayPrep actor ended before leaving it", g.fingerprint)

    def remove_left_cache(self, fingerprint: str, directory: str) -> None:
        """Called once the loader has left its node's cache (``fingerprint`` in ``directory``): removes it when the
        only users left were actors that close() killed while they were starting. Those had
        attached it, and Ray reports them dead before their processes are gone, whose pids it never
        told; so the loader was not the cache's last user, and nobody would be. At most
        :data:`KILLED_EXIT_S`; nothing after SIGTERM (the next loader reaps it)."""
        if not self.killed_starting or lifecycle.terminating():
            return
        from coordl.shm import reaper

        deadline = time.monotonic() + KILLED_EXIT_S
        while time.monotonic() < deadline:
            group = next((g for g in reaper.list_groups(directory) if g.fingerprint == fingerprint), None)
            if group is None:
                return
            if not group.in_use:
                reaper.reap(directory)
                return
            time.sleep(0.05)


def _may_hold_files(pid: int) -> bool:
    """Whether process ``pid`` may still hold files: it runs, or it is a zombie whose other threads
    are still exiting (the first thread of a killed process turns zombie before the others are
    gone, and the files they share are closed, and their locks released, by the last)."""
    try:
        if len(os.listdir(f"/proc/{pid}/task")) > 1:
            return True
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class Dispatch:
    """Units in flight on a pool's ready actors: up to :data:`DEPTH` each, and their results as
    they come (the pass's remote thread and an HP group member's remote producer use one each).

    Args:
        pool: the actors.
    """

    def __init__(self, pool: WorkerPool):
        self.pool = pool
        self._ray = ray_module()
        self._held: dict = {}  # ref -> (actor, the caller's key, when handed out)
        self._holding: dict = {}  # actor -> units it holds

    def fill(self, next_unit) -> None:
        """Starts actors that finished starting, ends idle retired ones, and gives each ready actor
        units until it holds :data:`DEPTH`: ``next_unit(info)`` returns ``(unit, key)`` for an actor
        that reads as ``info`` says, or None when there is none now."""
        pool = self.pool
        pool.poll()
        pool.reap(lambda a: self._holding.get(a, 0))
        for actor, info in list(pool.ready.items()):
            while self._holding.get(actor, 0) < DEPTH:
                got = next_unit(info)
                if got is None:
                    return
                unit, key = got
                self._held[actor.run.remote(unit)] = (actor, key, time.perf_counter())
                self._holding[actor] = self._holding.get(actor, 0) + 1

    def __bool__(self) -> bool:
        return bool(self._held)

    def keys(self) -> list:
        """The keys of the units in flight."""
        return [key for _, key, _ in self._held.values()]

    def results(self, timeout: float):
        """Yields ``(actor, key, seconds since handed out, outcome, died)`` for units that finished
        within ``timeout``: ``outcome`` is the actor's :class:`~coordl.remote.worker.Done`, or the
        exception it raised (out of Ray's wrapper), or (``died``) the error of its death."""
        ray = self._ray
        ready, _ = ray.wait(list(self._held), num_returns=1, timeout=timeout)
        for ref in ready:
            actor, key, t0 = self._held.pop(ref)
            self._holding[actor] -= 1
            try:
                outcome, died = ray.get(ref), False
            except died_errors(ray) as e:
                outcome, died = e, True
            except ray.exceptions.RayTaskError as e:
                outcome, died = cause(e), False
            yield actor, key, time.perf_counter() - t0, outcome, died

    def cancel(self) -> None:
        """Gives up the units in flight (an actor finishes the one it runs; its result is dropped)."""
        for ref in list(self._held):
            try:
                self._ray.cancel(ref)
            except Exception:  # noqa: BLE001 - the actor is gone
                pass
        self._held.clear()


def died_errors(ray) -> tuple:
    """Ray's errors for a unit whose actor, worker or result is gone: the unit runs again."""
    e = ray.exceptions
    return (e.RayActorError, e.ObjectLostError, e.WorkerCrashedError)


def cause(error: BaseException) -> BaseException:
    """The exception an actor raised, out of Ray's wrapper when Ray could carry it."""
    cause = getattr(error, "cause", None)
    return cause if isinstance(cause, BaseException) else error
