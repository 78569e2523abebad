"""A loader's part in an HP group: its staging area, a producer thread, and one pass per epoch.

The producer claims whichever batch the group needs next (a faster member claims more),
fetches its raw bytes through the node's cache, runs it through this member's DALI pipeline
and copies the result into the claimed slot. It never waits for a slot while it has batches in
flight in DALI: when no slot is free it lets DALI drain, then waits, so a member's own
unpublished batches can never hold up the group. The consumer (:class:`GroupPass`) takes every
batch of its pass from the staging area.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time

import numpy as np
import torch

from coordl import env, lifecycle
from coordl.errors import CoordlError, SampleError
from coordl.fetch.ahead import FetchAhead, RawBatch
from coordl.fetch.fetcher import FetchCounters
from coordl.passes import Channel, Pass, Step
from coordl.prep.recipes import ImageNetTrain, ImageNetVal
from coordl.schedule import Schedule
from coordl.shm import names
from coordl.staging.area import HEALTH_EVERY_S, Claim, StagingArea

__all__ = ["EMPTY_GROUP_STATS", "GroupMember", "GroupPass", "Producer"]

log = logging.getLogger(__name__)

PROGRESS_EVERY_S = 30.0
EMPTY_GROUP_STATS = {
    "produced": 0,
    "consumed_shared": 0,
    "hp_members": 0,
    "staging_bound": 0,
    "staging_bytes": 0,
    "staging_peak_bytes": 0,
}


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
            with remote prep, also or only a :class:`~coordl.remote.staging.RemoteProducer`).
    """

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
        self.options = options
        self.resources = resources
        self.config = config
        self.recipe = recipe
        self.world = world
        self.device_id = device_id
        self.schedule = schedule
        self.in_step = True  # every group pass so far had the order of this loader's epoch
        self.produced = 0  # group batches this member's producers made
        self.produced_mark = 0  # ... when the last pass's statistics were taken
        self._staging_prep = None
        self.make = producers or (Producer,)
        self.producers: list[Producer] = []  # the last pass's
        shape, dtype = self._staged_format(num_threads)
        from coordl.fetch.spec import reap_once

        reap_once(names.shm_dir())
        config_of_group = dict(identity, world_size=world.world_size, on_error=config.on_error)
        self.area = StagingArea(
            options.name,
            world.rank,
            config_of_group,
            batch_size=config.batch_size,
            batches_per_pass=schedule.num_batches(world.world_size),
            sample_shape=shape,
            dtype=dtype,
            epoch=epoch,
            bound=options.staging,
            idle_timeout=options.idle_timeout,
        )
        self.normalize = self._normalizer()

    def _uint8_staging(self) -> bool:
        r = self.recipe
        return (
            isinstance(r, (ImageNetTrain, ImageNetVal))
            and r.dtype == "float32"
            and (self.device_id is not None or env.flag("COORDL_HP_STAGE_UINT8"))
        )

    def _staged_format(self, num_threads: int) -> tuple[tuple[int, ...], str]:
        """Shape and dtype of one staged image: the recipe's output, or uint8 pixels that the
        consumer normalises (on a GPU, or when ``COORDL_HP_STAGE_UINT8=1``)."""
        r = self.recipe
        if isinstance(r, (ImageNetTrain, ImageNetVal)):
            if self._uint8_staging():
                from coordl.prep.dali import DaliPrep

                c = self.config
                self._staging_prep = DaliPrep(
                    dataclasses.replace(r, dtype="uint8"),
                    batch_size=c.batch_size,
                    num_threads=num_threads,
                    device_id=self.device_id,
                    seed=c.seed,
                    rank=self.world.rank,
                    role="staging",
                    on_error=c.on_error,
                    tiered=self.resources.decoded is not None,
                )
                return (3, r.size, r.size), "uint8"
            return (3, r.size, r.size), r.dtype
        # A custom recipe: run it on one sample to learn its output.
        res = self.resources
        data = res.fetcher.fetch(0)
        raw = RawBatch(np.array([0], np.int64), [data], res.index.labels[[0]])
        images = next(iter(res.prep.epoch(iter([raw]), res.index.paths.__getitem__, 0)))[0]
        return tuple(images.shape[1:]), str(images.dtype).removeprefix("torch.")

    def _normalizer(self):
        """``(mean, std)`` (x255, shaped for NCHW) when staged pixels still need normalising."""
        r = self.recipe
        if self.area.dtype == "uint8" and isinstance(r, (ImageNetTrain, ImageNetVal)) and r.dtype == "float32":
            mean = torch.tensor([m * 255 for m in r.mean]).view(1, 3, 1, 1)
            std = torch.tensor([s * 255 for s in r.std]).view(1, 3, 1, 1)
            return mean, std
        return None

    @property
    def prep(self):
        """The pipeline that makes this member's share of the group's batches."""
        return self._staging_prep if self._staging_prep is not None else self.resources.prep

    def open_pass(self, epoch: int, hooks: dict) -> GroupPass:
        """This member's pass over ``epoch`` (or over the group's pass it joins)."""
        return GroupPass(self, epoch, **hooks)

    def join_producer(self, producers=None) -> None:
        """Waits for ``producers`` (default: the last pass's) to stop (they drain what they have in
        flight first)."""
        for p in self.producers if producers is None else producers:
            if threading.current_thread() is not p.thread:
                p.stop.set()
                p.thread.join()

    def close(self) -> None:
        self.join_producer()
        self.area.close()
        if self._staging_prep is not None:
            self._staging_prep.close()


class Producer:
    """Makes group batches on this member's DALI pipeline until stopped.

    Its thread holds the member's collaborators, never the pass or the loader.
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
        self._batches: dict[int, list[np.ndarray]] = {}
        self._dtype = getattr(torch, self.area.dtype)
        self._shape = self.area.sample_shape
        self._per_sample = int(np.prod(self._shape, dtype=np.int64))
        self._images_bytes = self.area.images_bytes
        self.thread = threading.Thread(target=self._run, name="coordl-hp-producer", daemon=True)
        self.thread.start()

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
        key = self.area.order_key(q)
        if key not in self._batches:
            w = self.member.world
            self._batches = {key: self.member.schedule.batches(key, w.rank, w.world_size)}
        return self._batches[key][q % self.area.batches_per_pass]

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

    def write(self, c: Claim, images: torch.Tensor, labels: torch.Tensor, ids: torch.Tensor) -> None:
        n = len(labels)
        if tuple(images.shape[1:]) != self._shape or images.dtype != self._dtype:
            self.area.publish_error(
                c,
                f"the pipeline's output changed from {self.area.dtype}{list(self._shape)} to "
                f"{str(images.dtype).removeprefix('torch.')}{list(images.shape[1:])}; an hp_group stages batches of "
                "a fixed shape, so end the recipe with a crop or resize to a fixed size",
            )
            return
        view = self.area.slot_view(c)
        dst = torch.frombuffer(view, dtype=self._dtype, count=n * self._per_sample).view(n, *self._shape)
        dst.copy_(images)
        bs = self.member.config.batch_size
        np.frombuffer(view, np.int64, n, self._images_bytes)[:] = labels.cpu().numpy()
        np.frombuffer(view, np.int64, n, self._images_bytes + 8 * bs)[:] = ids.cpu().numpy()
        del dst, view
        self.area.publish(c, n)
        self.member.produced += 1


class GroupPass(Pass):
    """One epoch of a member of an HP group, iterated like a DataLoader pass."""

    def __init__(self, member: GroupMember, epoch: int, **hooks):
        area = member.area
        start, continues = area.enroll(epoch, may_rebase=member.in_step)
        nb = area.batches_per_pass
        super().__init__(
            epoch=epoch, start=0, length=nb, cache=member.resources.cache, decoded=member.resources.decoded, **hooks
        )
        self.member = member
        self.area = area
        self.first = start
        self.order_epoch = area.order_key(start)
        member.in_step &= self.order_epoch == epoch
        self.q, self.end = start, start + nb
        w = member.world
        self._expected = member.schedule.batches(self.order_epoch, w.rank, w.world_size)
        self._shared = 0
        self._skipped: list[tuple[int, str]] = []
        member.resources.fetcher.reset_counters()
        # Batches this member made since the previous pass's statistics (a producer drains the
        # batches it has in flight after its pass ends; they count in the next pass).
        self._produced_from = member.produced_mark
        self._produced_to: int | None = None  # the count when the pass ended
        released, _ = area.position()
        if not continues and released < start:
            log.info(
                "coordl: hp_group %r is in the middle of an epoch (batch %d of %d); this job starts sharing at "
                "its next epoch and helps make batches until then",
                member.options.name,
                released % nb,
                nb,
            )
        self._channel = Channel(1, self.stop_event)
        member.join_producer()  # the previous pass's producers may still drain their batches
        self.producers = member.producers = [p(member, self.stop_event, self._channel) for p in member.make]

    def _step(self) -> Step | None:
        area = self.area
        while True:
            if self.q == self.end:
                return None
            q = self.q
            self._wait(q)
            shared = not area.produced_by_me(q)
            taken = area.take(q)
            self.q += 1
            if taken.error is not None:
                raise SampleError(taken.error, path=taken.error_path, index=-1)
            labels, ids = area.labels_ids(taken)
            expected = self._expected[q - self.first]
            if len(ids) != len(expected):
                missing = np.setdiff1d(expected, ids)
                self._skipped += [(int(i), self.member.resources.index.paths[int(i)]) for i in missing]
            position = q - self.first + 1
            if taken.n == 0:  # every sample of it was skipped
                area.release(taken)
                if self._on_batch is not None:
                    self._on_batch(position)
                continue
            images = self._hand_off(taken)
            area.release_older(q - 1)  # the consumer may still hold the previous batch
            break
        self._shared += shared
        labels_t, ids_t = torch.from_numpy(labels), torch.from_numpy(ids)
        out = (images, labels_t, ids_t) if self.member.config.return_index else (images, labels_t)
        return Step(out, len(ids), position, fetch=None)  # made by the group: the wait is not split

    def _wait(self, q: int) -> None:
        area = self.area
        if area.ready(q):
            return
        delay, last_health, t0 = 0.0002, time.monotonic(), time.monotonic()
        next_note = t0 + PROGRESS_EVERY_S
        while not area.ready(q):
            self._channel.check()
            time.sleep(delay)
            delay = min(delay * 2, 0.005)
            now = time.monotonic()
            if now - last_health >= HEALTH_EVERY_S:  # a member that died is noticed within 0.25 s
                area.health()
                last_health = now
            if now > next_note:
                log.warning(
                    "coordl: hp_group %r: waited %.0f s for batch %d: %s",
                    self.member.options.name,
                    now - t0,
                    q % area.batches_per_pass,
                    area.waiting_on(q),
                )
                next_note = now + PROGRESS_EVERY_S

    def _hand_off(self, taken) -> torch.Tensor:
        area, member = self.area, self.member
        dtype = getattr(torch, area.dtype)
        count = taken.n * int(np.prod(area.sample_shape, dtype=np.int64))
        shape = (taken.n, *area.sample_shape)
        normalize = member.normalize
        device = torch.device("cpu") if member.device_id is None else torch.device("cuda", member.device_id)
        if device.type == "cpu" and normalize is None and area.cow:
            # Zero copy: a private copy-on-write mapping of the slot; the slot stays held
            # until the tensor is freed, and writes to the tensor stay in this process.
            mm = area.private_images(taken)
            return torch.frombuffer(mm, dtype=dtype, count=count).view(shape)
        view = torch.frombuffer(area.shared_images(taken), dtype=dtype, count=count).view(shape)
        try:
            if normalize is not None:
                mean, std = normalize
                out = view.to(device).to(torch.float32)
                return out.sub_(mean.to(device)).div_(std.to(device))
            return view.to(device, copy=True)
        finally:
            del view
            area.release(taken)

    def _finish(self) -> None:
        self.area.finish_pass()
        # One reading of the producers' count ends this pass's share and starts the next's: a
        # batch made while the statistics are taken counts in one of them, not in neither.
        self._produced_to = self.member.produced_mark = self.member.produced
        super()._finish()

    def _counters(self) -> FetchCounters:
        return self.member.resources.fetcher.counters

    def _figures(self) -> dict:
        extra = {
            "produced": (self.member.produced if self._produced_to is None else self._produced_to)
            - self._produced_from,
            "consumed_shared": self._shared,
            "order_epoch": self.order_epoch,
        }
        if self.area.attached:
            extra.update(self.area.stats())
        return {
            "fetch_wait_s": sum(p.fetch.wait_s for p in self.producers),
            "prep_s": sum(p.prep_s for p in self.producers),
            "skipped_paths": [p for _, p in self._skipped],
            "extra": extra,
        }

    def _shutdown(self) -> None:
        """Stops the producer; it drains the batches it has in flight in the background (they count
        in the next pass, which waits for it)."""
        self.stop_event.set()

    def close(self) -> None:
        """Leaves the pass unfinished: this member stops consuming (the group goes on); idempotent.

        Stops this pass's producers only: a pass closed, or freed, after the next one started (a
        training loop's ``it = iter(loader)`` frees the previous pass after the next one began)
        must not stop the next one's, or the group loses this member's production. Nothing in a
        forked child, whose copy is the parent's: it must not leave in the parent's name."""
        if self.forked:
            self._closed = True
            return
        if not self._closed and self.active:
            self.area.abandon()
        super().close()
        self.member.join_producer(getattr(self, "producers", ()))
