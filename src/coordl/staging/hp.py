"""One pass of a CoordLoader in an HP group: a producer thread makes the group's batches, the
consumer takes every batch of its pass from the staging area.

The producer claims whichever batch the group needs next (a faster member claims
more), fetches its raw bytes through the node's cache, runs it through this member's
DALI pipeline and copies the result into the claimed slot. It never waits for a slot
while it has batches in flight in DALI: when no slot is free it lets DALI drain, then
waits, so a member's own unpublished batches can never hold up the group.
"""

from __future__ import annotations

import collections
import logging
import threading
import time

import numpy as np
import torch

from coordl import sampler
from coordl.accounting import StepWaits
from coordl.errors import CoordlError, SampleError
from coordl.fetch.ahead import FetchAhead
from coordl.staging.area import Claim, StagingArea

__all__ = ["GroupPass"]

log = logging.getLogger(__name__)

PROGRESS_EVERY_S = 30.0


class _Producer:
    """Makes group batches on this member's DALI pipeline until stopped."""

    def __init__(self, loader, area: StagingArea, prep, stop: threading.Event):
        self.loader = loader
        self.area = area
        self.prep = prep
        self.stop = stop
        self.failure: BaseException | None = None
        self._prep0 = prep.waiting.total()
        self._fetch = FetchAhead(loader._fetcher, [], loader.index.labels, loader._pool, depth=1,
                                 on_error=loader.on_error, stop=stop)  # fmt: skip
        self._inflight: collections.deque[tuple[Claim, np.ndarray]] = collections.deque()
        self._batches: dict[int, list[np.ndarray]] = {}
        self._dtype = getattr(torch, area.dtype)
        self._shape = area.sample_shape
        self._per_sample = int(np.prod(self._shape, dtype=np.int64))
        self._images_bytes = area._images_bytes()
        self.thread = threading.Thread(target=self._run, name="coordl-hp-producer", daemon=True)
        self.thread.start()

    @property
    def prep_s(self) -> float:
        """Seconds this producer has waited for its DALI pipeline."""
        return self.prep.waiting.total() - self._prep0

    def _run(self) -> None:
        try:
            while not self.stop.is_set():
                c = self.area.claim(block=True, stop=self.stop)
                if c is None:
                    return
                self._run_dali(c)
        except BaseException as e:  # noqa: BLE001 - the consumer raises it
            if not self.stop.is_set():
                self.failure = e
        finally:
            while self._inflight:
                self.area.unclaim(self._inflight.popleft()[0])

    def _ids(self, q: int) -> np.ndarray:
        key = self.area.order_key(q)
        if key not in self._batches:
            loader = self.loader
            order = sampler.epoch_order(len(loader.index), loader.seed, key, loader.shuffle)
            ids = sampler.shard(order, loader.world.rank, loader.world.world_size, loader.drop_last)
            self._batches = {key: sampler.batches(ids, loader.batch_size, loader.drop_last)}
        return self._batches[key][q % self.area.batches_per_pass]

    def _feed(self, c: Claim | None):
        while c is not None:
            ids = self._ids(c.q)
            try:
                raw = self._fetch.collect(ids)
            except SampleError as e:
                self.area.publish_error(c, str(e), e.path)
            else:
                self._inflight.append((c, raw.ids))
                yield raw
            if self.stop.is_set():
                return
            c = self.area.claim(block=False)  # never wait with batches in flight: let DALI drain

    def _run_dali(self, first: Claim) -> None:
        paths = self.loader.index.paths
        try:
            for images, labels, ids in self.prep.epoch(self._feed(first), paths.__getitem__):
                c = self._match(int(ids[0]))
                self._write(c, images, labels, ids)
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
            self._publish_empty(self._inflight.popleft()[0])

    def _match(self, first_id: int) -> Claim:
        while self._inflight:
            c, ids = self._inflight.popleft()
            if first_id in ids:
                return c
            self._publish_empty(c)
        raise CoordlError("coordl: internal error: DALI returned a batch nobody fed")

    def _publish_empty(self, c: Claim) -> None:
        self.area.publish(c, 0)

    def _write(self, c: Claim, images: torch.Tensor, labels: torch.Tensor, ids: torch.Tensor) -> None:
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
        bs = self.loader.batch_size
        np.frombuffer(view, np.int64, n, self._images_bytes)[:] = labels.cpu().numpy()
        np.frombuffer(view, np.int64, n, self._images_bytes + 8 * bs)[:] = ids.cpu().numpy()
        del dst, view
        self.area.publish(c, n)
        self.loader._produced_total += 1


class GroupPass:
    """One epoch of a member of an HP group, iterated like a DataLoader pass."""

    def __init__(self, loader, epoch: int):
        self.loader = loader
        self.epoch = epoch
        self.area: StagingArea = loader._group_area()
        self.active = True
        self._stop = threading.Event()
        self._batches = 0
        self._samples = 0
        self._waits = StepWaits()
        self._shared = 0
        self._elapsed = 0.0
        self._t0 = time.perf_counter()
        loader._fetcher.reset_counters()
        self._skipped: list[tuple[int, str]] = []
        # Batches this member made since the previous pass's statistics (a producer drains the
        # batches it has in flight after its pass ends; they count in the next pass).
        self._produced_from = loader._produced_mark
        self.start, continues = self.area.enroll(epoch, may_rebase=loader._group_in_step)
        self.order_epoch = self.area.order_key(self.start)
        loader._order_epoch = self.order_epoch
        loader._group_in_step &= self.order_epoch == epoch
        nb = self.area.batches_per_pass
        self.q, self.end = self.start, self.start + nb
        order = sampler.epoch_order(len(loader.index), loader.seed, self.order_epoch, loader.shuffle)
        ids = sampler.shard(order, loader.world.rank, loader.world.world_size, loader.drop_last)
        self._expected = sampler.batches(ids, loader.batch_size, loader.drop_last)
        released, _ = self.area.position()
        if not continues and released < self.start:
            log.info(
                "coordl: hp_group %r is in the middle of an epoch (batch %d of %d); this job starts sharing at "
                "its next epoch and helps make batches until then", loader.hp_group, released % nb, nb,
            )  # fmt: skip
        self.producer = _Producer(loader, self.area, loader._group_prep(), self._stop)

    def __iter__(self):
        return self

    def __len__(self) -> int:
        return self.end - self.q

    def __next__(self):
        if not self.active:
            raise StopIteration
        t0 = time.perf_counter()
        while True:
            if self.q == self.end:
                self._waits.add_tail(time.perf_counter() - t0)
                self._finish()
                raise StopIteration
            q = self.q
            self._wait(q)
            shared = not self.area.produced_by_me(q)
            taken = self.area.take(q)
            self.q += 1
            if taken.error is not None:
                self.close()
                raise SampleError(taken.error, path=taken.error_path, index=-1)
            labels, ids = self.area.labels_ids(taken)
            expected = self._expected[q - self.start]
            if len(ids) != len(expected):
                missing = np.setdiff1d(expected, ids)
                self._skipped += [(int(i), self.loader.index.paths[int(i)]) for i in missing]
            self.loader._on_batch(q - self.start + 1)
            if taken.n == 0:  # every sample of it was skipped
                self.area.release(taken)
                continue
            images = self._hand_off(taken)
            self.area.release_older(q - 1)  # the consumer may still hold the previous batch
            break
        self._waits.record(time.perf_counter() - t0)  # made by the group: not attributed
        self._batches += 1
        self._samples += len(ids)
        self._shared += shared
        labels_t, ids_t = torch.from_numpy(labels), torch.from_numpy(ids)
        if self.loader.return_index:
            return images, labels_t, ids_t
        return images, labels_t

    def _wait(self, q: int) -> None:
        if self.area.ready(q):
            return
        delay, last_health, t0 = 0.0002, time.monotonic(), time.monotonic()
        next_note = t0 + PROGRESS_EVERY_S
        while not self.area.ready(q):
            if self.producer.failure is not None:
                failure = self.producer.failure
                self.close()
                raise failure
            time.sleep(delay)
            delay = min(delay * 2, 0.005)
            now = time.monotonic()
            if now - last_health > 0.25:
                self.area.health()
                last_health = now
            if now > next_note:
                log.warning("coordl: hp_group %r: waited %.0f s for batch %d: %s",
                            self.loader.hp_group, now - t0, q % self.area.batches_per_pass,
                            self.area.waiting_on(q))  # fmt: skip
                next_note = now + PROGRESS_EVERY_S

    def _hand_off(self, taken) -> torch.Tensor:
        area, loader = self.area, self.loader
        dtype = getattr(torch, area.dtype)
        count = taken.n * int(np.prod(area.sample_shape, dtype=np.int64))
        shape = (taken.n, *area.sample_shape)
        normalize = loader._group_normalize()
        device = loader._output_device()
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
        self._elapsed = time.perf_counter() - self._t0
        self.active = False
        self._stop.set()
        self.area.finish_pass()
        self.loader._on_pass_end(self)
        self.loader._produced_mark = self.loader._produced_total

    @staticmethod
    def base_stats(loader, epoch: int) -> dict:
        from coordl.loader import _Pass

        s = _Pass.base_stats(loader, epoch)
        s.update(produced=0, consumed_shared=0, hp_members=0, staging_bound=0, staging_bytes=0, staging_peak_bytes=0)
        return s

    def stats(self, complete: bool) -> dict:
        from coordl.loader import pass_stats

        elapsed = self._elapsed if complete else time.perf_counter() - self._t0
        c = self.loader._fetcher.counters
        s = pass_stats(self.base_stats(self.loader, self.epoch), c, batches=self._batches, samples=self._samples,
                       waits=self._waits, fetch_wait_s=self.producer._fetch.wait_s, read_s=c.storage_ns / 1e9,
                       prep_s=self.producer.prep_s, elapsed_s=elapsed,
                       skipped_paths=[p for _, p in self._skipped])  # fmt: skip
        s.update(
            produced=self.loader._produced_total - self._produced_from,
            consumed_shared=self._shared,
            order_epoch=self.order_epoch,
        )
        if not self.loader._closed and self.area._h is not None:
            s.update(self.area.stats())
        return s

    def join_producer(self) -> None:
        self._stop.set()
        self.producer.thread.join()

    def close(self) -> None:
        """Leaves the pass unfinished: this member stops consuming; idempotent."""
        if self.active:
            self.active = False
            self._stop.set()
            self.area.abandon()
        self.join_producer()
