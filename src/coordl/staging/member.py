"""A loader's part in an HP group: its staging area, a producer thread, and one pass per epoch.

The producer claims whichever staged batch the group needs next (a faster member claims more),
fetches its raw bytes through the node's cache, runs it through a DALI pipeline that takes the
group's staged batch and copies the result into the claimed slot. It never waits for a slot while
it has batches in flight in DALI: when no slot is free it lets DALI drain, then waits, so a
member's own unpublished batches can never hold up the group. The consumer is the member's pass
(:class:`~coordl.staging.grouppass.GroupPass`).
"""

from __future__ import annotations

import collections
import logging
import threading

import numpy as np
import torch

from coordl import env, lifecycle, sampler
from coordl.errors import CoordlError, GroupConfigError, SampleError, warn
from coordl.fetch.ahead import FetchAhead, RawBatch
from coordl.passes import Channel
from coordl.schedule import Schedule
from coordl.shm import names, own, segment
from coordl.staging.area import Claim, StagingArea
from coordl.staging.layout import default_unit
from coordl.staging.pixels import Normaliser

__all__ = ["EMPTY_GROUP_STATS", "GroupMember", "Producer", "warn_alone"]

log = logging.getLogger(__name__)

EMPTY_GROUP_STATS = {
    "produced": 0,
    "consumed_shared": 0,
    "detached": False,
    "alone_batches": 0,
    "hp_members": 0,
    "stage_batch": 0,
    "staging_bound": 0,
    "staging_bytes": 0,
    "staging_peak_bytes": 0,
}


def warn_alone(name: str, found: tuple[own.Foreign, ...]) -> None:
    """Warns that this job runs without its HP group ``name`` because of the files ``found``."""
    listing = "; ".join(map(str, found))
    warn(
        f"coordl: hp_group {name!r} is not shared by this job, which runs alone: {listing}. These files are at "
        "the group's names in the shm directory but are not this user's own private files, and coordl never "
        "reads, writes or follows them. Remove them (`rm` as their owner or root) and the next run shares again"
    )


class GroupMember:
    """One loader's membership of its HP group, from its first pass to ``close()``.

    Args:
        options: the group's name, staging bound and idle timeout (:class:`~coordl.HPGroup`).
        resources: the loader's collaborators (cache, fetcher, pool, the DALI pipeline).
        config: the loader's settings.
        schedule: the loader's order settings.
        recipe: the DALI recipe.
        world: this process's place in the job (the group is per rank).
        device_id: the GPU of the outputs, or None.
        num_threads: DALI threads of a pipeline made for staging.
        identity: the loader's :func:`~coordl.config.identity`, which every member must share.
        epoch: the loader's epoch when it joins.
        producers: what makes this member's share of the group's batches, each a class taking
            ``(member, stop, channel)`` (default: a :class:`Producer` on the member's pipeline;
            with remote prep, also or only a :class:`~coordl.remote.producer.RemoteProducer`).

    Raises:
        ForeignFileError: a file at one of the group's names is not this user's own private file
            (:meth:`attach` then warns and gives None: the loader runs alone).
    """

    @classmethod
    def attach(cls, **kwargs) -> GroupMember | None:
        """A member of its group, made with ``kwargs``; None, with :func:`warn_alone`, where a file
        at one of the group's names is not this user's own (nothing of the group was read)."""
        try:
            return cls(**kwargs)
        except own.ForeignFileError as e:
            warn_alone(kwargs["options"].name, e.found)
            return None

    def __init__(
        self,
        *,
        options,
        resources,
        config,
        schedule: Schedule,
        recipe,
        world,
        device_id,
        num_threads: int,
        identity: dict,
        epoch: int,
        producers: tuple = (),
    ):
        self.area: StagingArea | None = None  # none yet, for close() on SIGTERM while it is made
        self._staging_prep = None
        self.producers: list[Producer] = []  # the last pass's
        with lifecycle.making(self):  # SIGTERM in here: close() undoes what is made
            self.options = options
            self.resources = resources
            self.config = config
            self.recipe = recipe
            self.world = world
            self.device_id = device_id
            self.schedule = schedule
            self.in_step = True  # every group pass so far had the order of this loader's epoch
            self.produced = 0  # group batches this member's producers made (count_produced)
            self._produced_lock = threading.Lock()  # its producers' threads count at once
            self.produced_mark = 0  # ... when the last pass's statistics were taken
            self.make = producers or (Producer,)
            shape, dtype = self._staged_format()
            from coordl.fetch.spec import reap_once

            reap_once(names.shm_dir())
            # Members agree on what they load, not on how they batch it: each cuts its own batches.
            config_of_group = {k: v for k, v in identity.items() if k not in ("batch_size", "drop_last")}
            config_of_group.update(world_size=world.world_size, on_error=config.on_error)
            pass_samples = schedule.shard_size(world.world_size)
            unit = options.stage_batch or self._default_unit(pass_samples, shape, dtype)
            self.area = StagingArea(
                options.name,
                world.rank,
                config_of_group,
                batch_size=unit,
                batches_per_pass=sampler.num_batches(pass_samples, unit, False),
                sample_shape=shape,
                dtype=dtype,
                epoch=epoch,
                bound=options.staging,
                idle_timeout=options.idle_timeout,
            )
            try:
                self.unit = self.area.unit  # the group's, which its first member decided
                self._check_room()
                self._staging_prep = self._make_staging_prep(num_threads)
            except BaseException:
                self.area.close()
                raise
            self.normalize = self._normalizer()
            self._units: dict[int, list[np.ndarray]] = {}
            self.paces: collections.deque[float] = collections.deque(maxlen=8)  # s/sample of its recent batches
            self.went_alone = False  # its last pass was finished alone (it was detached)
            self.last_order: int | None = None  # the order (sampler epoch) of its last finished pass

    def _uint8_staging(self) -> bool:
        uint8_here = self.device_id is not None or env.flag("COORDL_HP_STAGE_UINT8")
        return self.recipe.normalisation() is not None and uint8_here

    def _staged_format(self) -> tuple[tuple[int, ...], str]:
        """Shape and dtype of one staged image: the recipe's output, or uint8 pixels that the
        consumer normalises (on a GPU, or when ``COORDL_HP_STAGE_UINT8=1``)."""
        known = self.recipe.output()
        if known is not None:
            shape, dtype = known
            return shape, "uint8" if self._uint8_staging() else dtype
        # A custom recipe: run it on one sample to learn its output.
        res = self.resources
        data = res.fetcher.fetch(0)
        raw = RawBatch(np.array([0], np.int64), [data], res.index.labels[[0]])
        images = next(iter(res.prep.epoch(iter([raw]), res.index.paths.__getitem__, 0)))[0]
        return tuple(images.shape[1:]), str(images.dtype).removeprefix("torch.")

    def _default_unit(self, pass_samples: int, shape: tuple[int, ...], dtype: str) -> int:
        """The staged batch this member gives a group it starts without ``HPGroup(stage_batch)``:
        its batch size, doubled within the limits of :func:`~coordl.staging.layout.default_unit`, so
        that the sweep's larger batch sizes get views. With remote prep, its batch size: its Ray
        actors are built for it and make no larger staged batch."""
        b = self.config.batch_size
        if self.resources.remote is not None:
            return b
        free = segment.space(names.shm_dir()).free
        return default_unit(b, pass_samples, shape, dtype, self.options.staging, free)

    def _check_room(self) -> None:
        """Refuses a member whose batches could never be cut from the group's ring, or whose Ray
        actors could not make the group's staged batches."""
        b, unit, slots = self.config.batch_size, self.unit, self.area.slots
        spans = -(-b // unit) + 1  # staged batches one of this member's batches may span
        if spans + 2 > slots:
            raise GroupConfigError(
                f"hp_group {self.options.name!r} stages batches of {unit} samples in {slots} slots; a batch of {b} "
                f"spans up to {spans} of them and needs {spans + 2} slots. Give the group a larger "
                "HPGroup(staging=...) or HPGroup(stage_batch=...), or use another hp_group name"
            )
        remote = self.resources.remote
        if remote is not None and unit > b:
            raise GroupConfigError(
                f"hp_group {self.options.name!r} stages batches of {unit} samples, more than this job's batch_size "
                f"{b}, which its Ray actors are built for; with remote prep a member's batch_size must be at least "
                "the group's HPGroup(stage_batch)"
            )

    def _make_staging_prep(self, num_threads: int):
        """A DALI pipeline for the group's staged batches, where the loader's own cannot make them:
        uint8 pixels, or a staged batch larger than the loader's. None: the loader's pipeline."""
        r, c = self.recipe, self.config
        uint8 = self.area.dtype == "uint8" and r.normalisation() is not None
        if not uint8 and self.unit <= c.batch_size:
            return None
        from coordl.prep.dali import DaliPrep

        return DaliPrep(
            r.pixels() if uint8 else r,
            batch_size=max(self.unit, c.batch_size),
            num_threads=num_threads,
            device_id=self.device_id,
            seed=c.seed,
            rank=self.world.rank,
            role="staging",
            on_error=c.on_error,
            tiered=self.resources.decoded is not None,
            boxes=self.resources.index.boxes,
        )

    def units(self, key: int) -> list[np.ndarray]:
        """The sample ids of every staged batch of the group's pass whose order is epoch ``key``."""
        known = self._units  # producers' threads ask too: this reading is theirs
        if key not in known:
            w = self.world
            shard = self.schedule.shard(key, w.rank, w.world_size)
            known = {k: v for k, v in known.items() if k == key - 1}  # the pass before it, still draining
            known[key] = sampler.batches(shard, self.unit, False)
            self._units = known
        return known[key]

    def _normalizer(self):
        """The recipe's :class:`Normaliser` when staged pixels still need normalising."""
        uint8 = self.area.dtype == "uint8" and self.recipe.normalisation() is not None
        return Normaliser.of(self.recipe) if uint8 else None

    @property
    def prep(self):
        """The pipeline that makes this member's share of the group's batches."""
        return self._staging_prep if self._staging_prep is not None else self.resources.prep

    def open_pass(self, epoch: int, hooks: dict, alone):
        """This member's pass over ``epoch`` (or over the group's pass it joins); ``alone(batches,
        order_epoch=, start=, on_batch=)`` opens the loader's plain pass that finishes it if the
        group detaches this member."""
        from coordl.staging.grouppass import GroupPass

        return GroupPass(self, epoch, alone, **hooks)

    def join_producer(self, producers=None) -> None:
        """Waits for ``producers`` (default: the last pass's) to stop (they drain what they have in
        flight first); only tells them to, while SIGTERM parks the main thread inside the group's
        mutex (:attr:`StagingArea.parked_inside <coordl.staging.area.StagingArea.parked_inside>`)."""
        # SIGTERM parked the main thread inside the group's mutex: a producer that waits for it
        # waits until the process ends, and close() gives the member up without it.
        wait = self.area is None or not self.area.parked_inside
        for p in self.producers if producers is None else producers:
            if threading.current_thread() is not p.thread:
                p.stop.set()
                if p.thread.ident is not None and wait:  # made and not started (SIGTERM in between): nothing runs
                    lifecycle.join(p.thread)  # at most the SIGTERM deadline while the process is ending

    def count_produced(self) -> None:
        """Counts one more group batch made by this member, from any of its producers' threads
        (its pipeline's and its Ray actors' publish at once: ``+=`` alone could lose one)."""
        with self._produced_lock:
            self.produced += 1

    def close(self) -> None:
        self.join_producer()
        if self.area is not None:
            self.area.close()
        if self._staging_prep is not None:
            self._staging_prep.close()


class Producer:
    """Makes group batches on this member's DALI pipeline until stopped.

    Made complete first, then started: whoever makes one calls :meth:`start` (so that a subclass
    sets its own fields after ``super().__init__``, before its thread runs). Its thread holds the
    member's collaborators, never the pass or the loader.
    """

    def __init__(self, member: GroupMember, stop: threading.Event, channel: Channel):
        self.member = member
        self.area = member.area
        self.prep = member.prep
        self.stop = stop
        self.channel = channel
        res = member.resources
        self._paths = res.index.paths
        self._prep0 = self.prep.waiting.total()
        self.fetch = FetchAhead(
            res.fetcher,
            [],
            res.index.labels,
            res.pool,
            threads=res.io_threads,
            depth=1,
            on_error=member.config.on_error,
            stop=stop,
        )
        self._inflight: collections.deque[tuple[Claim, np.ndarray]] = collections.deque()
        self._dtype = getattr(torch, self.area.dtype)
        self._shape = self.area.sample_shape
        self._per_sample = int(np.prod(self._shape, dtype=np.int64))
        self._images_bytes = self.area.images_bytes
        self.thread = threading.Thread(target=self._run, name="coordl-hp-producer", daemon=True)

    def start(self) -> Producer:
        """Starts the thread; returns the producer."""
        self.thread.start()
        return self

    @property
    def prep_s(self) -> float:
        """Seconds this producer has waited for its DALI pipeline."""
        return self.prep.waiting.total() - self._prep0

    def _run(self) -> None:
        lifecycle.quiet_thread()
        try:
            while not self.stop.is_set():
                c = self.area.claim(block=True, stop=self.stop)
                if c is None:
                    return
                self._run_dali(c)
        except BaseException as e:  # noqa: BLE001 - the consumer raises it
            if not self.stop.is_set():
                self.channel.fail(e)
        finally:
            while self._inflight:
                self.area.unclaim(self._inflight.popleft()[0])

    def ids_of(self, q: int) -> np.ndarray:
        return self.member.units(self.area.order_key(q))[q % self.area.batches_per_pass]

    def _feed(self, c: Claim | None):
        while c is not None:
            ids = self.ids_of(c.q)
            try:
                raw = self.fetch.collect(ids, number=c.q)  # the claim's number travels with the batch
            except SampleError as e:
                self.area.publish_error(c, str(e), e.path)
            else:
                raw.epoch = self.area.order_key(c.q)  # augmented as the same loader alone augments it
                self._inflight.append((c, raw.ids))
                yield raw
            if self.stop.is_set():
                return
            c = self.area.claim(block=False)  # never wait with batches in flight: let DALI drain

    def _run_dali(self, first: Claim) -> None:
        try:
            keep = self.member.resources.fetcher if self.member.resources.decoded is not None else None
            # Claims run on across epochs: without the decoder only once the tier holds the dataset.
            whole = keep is not None and keep.all_decoded()
            for images, labels, ids, q in self.prep.epoch(
                self._feed(first), self._paths.__getitem__, 0, keep, all_decoded=whole
            ):
                self.write(self._claim_of(q), images, labels, ids)
        except SampleError as e:
            bad = next((c for c, ids in self._inflight if e.index in ids), None)
            if bad is None:
                raise
            self.area.publish_error(bad, str(e), e.path)
            while self._inflight:
                c = self._inflight.popleft()[0]
                if c is not bad:
                    self.area.unclaim(c)
            return
        while self._inflight:  # every sample of these was skipped (on_error="skip")
            self.area.publish(self._inflight.popleft()[0], 0)

    def _claim_of(self, q: int) -> Claim:
        """The claim of batch ``q``, which DALI just returned; those fed before it that it did not
        return had every sample skipped (``on_error="skip"``): published empty."""
        while self._inflight:
            c, _ = self._inflight.popleft()
            if c.q == q:
                return c
            self.area.publish(c, 0)
        raise CoordlError(f"coordl: internal error: DALI returned batch {q}, which nobody fed")

    def write(self, c: Claim, images, labels, ids) -> None:
        """Writes a made batch into its claimed slot and publishes it. ``images``, ``labels`` and
        ``ids``: tensors (the pipeline's) or numpy arrays (a Ray actor's, read-only views of Ray's
        object store): either way copied once, into the slot."""
        n = len(labels)
        dtype = str(images.dtype).removeprefix("torch.")
        if tuple(images.shape[1:]) != self._shape or dtype != self.area.dtype:
            self.area.publish_error(
                c,
                f"the pipeline's output changed from {self.area.dtype}{list(self._shape)} to "
                f"{dtype}{list(images.shape[1:])}; an hp_group stages batches of "
                "a fixed shape, so end the recipe with a crop or resize to a fixed size",
            )
            return
        view = self.area.slot_view(c)
        dst = torch.frombuffer(view, dtype=self._dtype, count=n * self._per_sample).view(n, *self._shape)
        if isinstance(images, np.ndarray):
            dst.numpy()[...] = images
        else:
            dst.copy_(images)
        bs = self.area.unit
        np.frombuffer(view, np.int64, n, self._images_bytes)[:] = _numpy(labels)
        np.frombuffer(view, np.int64, n, self._images_bytes + 8 * bs)[:] = _numpy(ids)
        del dst, view
        self.area.publish(c, n)
        self.member.count_produced()


def _numpy(values) -> np.ndarray:
    """A tensor's values as numpy (on the CPU), or a numpy array as it is."""
    return values if isinstance(values, np.ndarray) else values.cpu().numpy()
