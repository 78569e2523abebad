"""A member's pass over an HP group's epoch: its batches cut from the group's staged ones, or made alone.

:class:`GroupPass` takes every staged batch of its pass from the staging area, in order, and cuts
batches of the member's own size from them: a view of a private (copy-on-write) mapping of the
slot where a batch lies inside one staged batch, else a copy. It publishes the member's training
pace (seconds per sample, the median of its recent batches). A consumer that waits for a staged
batch nobody can claim, because the ring is full, detaches the members a whole ring behind it
that train slower (:meth:`~coordl.staging.area.StagingArea.detach_laggards`); a detached member
finishes its pass on a plain pass of its loader (the same order, the same images) and rejoins
the group at a pass it can join from its start.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import numpy as np
import torch

from coordl import sampler
from coordl.errors import SampleError
from coordl.fetch.fetcher import FetchCounters
from coordl.passes import Channel, Pass, Step
from coordl.staging.area import HEALTH_EVERY_S

__all__ = ["DETACH_LOOK_S", "PACE_AFTER", "PROGRESS_EVERY_S", "GroupPass"]

log = logging.getLogger(__name__)

PROGRESS_EVERY_S = 30.0
# A consumer waiting for a staged batch nobody can claim (the ring is full) looks for members a
# whole ring behind it that train slower, as it starts to wait and then at this interval.
DETACH_LOOK_S = 0.05
# A member's pace (the median over its recent batches, GroupMember.paces) is published once it has this many.
PACE_AFTER = 4


@dataclasses.dataclass
class _Staged:
    """A staged batch this member took and still needs: its labels and ids (copies), the position in
    the staged batch of each sample it has (fewer than the unit's where samples were skipped), and
    the private mapping its views share, once one was made (kept while a later batch of this member
    needs it; then only the consumer's tensors keep it)."""

    taken: object
    labels: np.ndarray
    ids: np.ndarray
    pos: np.ndarray
    complete: bool
    mm: object = None


def _positions(expected: np.ndarray, got: np.ndarray) -> np.ndarray:
    """Where each of ``got`` (``expected`` less some samples, in its order) sits in ``expected``."""
    pos, k = np.empty(len(got), np.int64), 0
    for r, i in enumerate(got.tolist()):
        while expected[k] != i:
            k += 1
        pos[r], k = k, k + 1
    return pos


class GroupPass(Pass):
    """One epoch of a member of an HP group, iterated like a DataLoader pass: batches of the member's
    own size cut from the group's staged batches; once detached, the rest made alone."""

    def __init__(self, member, epoch: int, alone, **hooks):
        area = member.area
        start, continues = area.enroll(epoch, may_rebase=member.in_step, after=member.last_order)
        w, c = member.world, member.config
        order_epoch = area.order_key(start)
        self._order = member.schedule.shard(order_epoch, w.rank, w.world_size)  # the samples of the pass
        self.b = c.batch_size
        nb = sampler.num_batches(len(self._order), self.b, c.drop_last)
        super().__init__(
            epoch=epoch, start=0, length=nb, cache=member.resources.cache, decoded=member.resources.decoded, **hooks
        )
        self.member = member
        self.area = area
        self.first = start
        self.order_epoch = order_epoch
        member.in_step &= self.order_epoch == epoch
        self.q, self.end = start, start + area.batches_per_pass  # the next staged batch to take; the pass's end
        self.i = 0  # this member's next batch
        self._staged: dict[int, _Staged] = {}  # taken and still held, by staged batch
        self._prev_first = start  # the first staged batch of the batch handed over before
        self._alone = alone
        self._alone_pass: Pass | None = None
        self._alone_position = 0
        self._before_alone: FetchCounters | None = None
        self._shared = 0
        self._skipped: list[tuple[int, str]] = []
        self._handed: tuple[float, int] | None = None  # when the last batch was handed over, its samples
        member.resources.fetcher.reset_counters()
        # Batches this member made since the previous pass's statistics (a producer drains the
        # batches it has in flight after its pass ends; they count in the next pass).
        self._produced_from = member.produced_mark
        self._produced_to: int | None = None  # the count when the pass ended
        released, _ = area.position()
        self._channel = Channel(1, self.stop_event)
        member.join_producer()  # the previous pass's producers may still drain their batches
        if not continues and released < start and member.went_alone:
            # Detached in its last pass, so slower than the group: waiting for the group's next pass
            # would make it slower than alone. It makes this epoch itself (the order of that pass).
            area.abandon()
            self.producers = member.producers = []
            self._go_alone("it was detached in its last epoch and the group is in the middle of one")
            return
        if not continues and released < start:
            nu = area.batches_per_pass
            log.info(
                "coordl: hp_group %r is in the middle of an epoch (batch %d of %d); this job starts sharing at "
                "its next epoch and helps make batches until then",
                member.options.name,
                released % nu,
                nu,
            )
        self.producers = member.producers = [p(member, self.stop_event, self._channel) for p in member.make]
        for p in self.producers:
            p.start()

    # -- batches ----------------------------------------------------------------------------
    def _step(self) -> Step | None:
        now = time.perf_counter()
        if self._handed is not None:  # the consumer's training since the last batch, per sample
            paces = self.member.paces
            paces.append((now - self._handed[0]) / self._handed[1])
            if len(paces) >= PACE_AFTER:
                self.area.set_pace(float(np.median(paces)))
        step = self._next_step()
        self._handed = (time.perf_counter(), step.samples) if step is not None and step.samples else None
        return step

    def _next_step(self) -> Step | None:
        G = self.area.unit
        while True:
            if self._alone_pass is not None:
                return self._alone_step()
            if self.i == self.length:
                return None
            lo, hi = self.i * self.b, min((self.i + 1) * self.b, len(self._order))
            j0, j1 = self.first + lo // G, self.first + (hi - 1) // G
            while self.q <= j1:
                if not self._take_next():
                    self._go_alone(f"it fell {self.area.slots} staged batches behind the group")
                    break
            if self._alone_pass is not None:
                continue
            step = self._cut(lo, hi, j0, j1)
            self.i += 1
            if step is not None:
                return step
            if self._on_batch is not None:  # every sample of it was skipped
                self._on_batch(self.i)

    def _take_next(self) -> bool:
        """Takes the next staged batch of the pass; False: this member was detached."""
        area, q, G = self.area, self.q, self.area.unit
        if not self._wait(q):
            return False
        shared = not area.produced_by_me(q)
        taken = area.take(q)
        if taken is None:
            return False
        self.q += 1
        if taken.error is not None:
            raise SampleError(taken.error, path=taken.error_path, index=-1)
        labels, ids = area.labels_ids(taken)
        base = (q - self.first) * G
        expected = self._order[base : base + G]
        complete = len(ids) == len(expected)
        pos = np.arange(len(ids), dtype=np.int64) if complete else _positions(expected, ids)
        if not complete:
            got = np.zeros(len(expected), bool)
            got[pos] = True
            limit = self.length * self.b - base  # samples past this member's last batch (drop_last) are not its
            paths = self.member.resources.index.paths
            self._skipped += [(int(i), paths[int(i)]) for k, i in enumerate(expected) if not got[k] and k < limit]
        self._staged[q] = _Staged(taken, labels, ids, pos, complete)
        self._shared += shared
        return True

    def _cut(self, lo: int, hi: int, j0: int, j1: int) -> Step | None:
        """This member's batch of the pass's samples ``[lo, hi)``, from staged batches ``j0..j1``."""
        G = self.area.unit
        parts = []
        for j in range(j0, j1 + 1):
            st = self._staged[j]
            base = (j - self.first) * G
            parts.append((st, (st.pos >= lo - base) & (st.pos < hi - base)))
        labels = np.concatenate([st.labels[sel] for st, sel in parts])
        ids = np.concatenate([st.ids[sel] for st, sel in parts])
        images = self._images(parts, lo, hi, j0) if len(ids) else None
        # Staged batches no later batch of this member needs are let go: one copied out is released;
        # one a view maps stays held while the consumer's tensors map it, and once this member asks
        # for the batch after next it is unshared (its pages copied into the mapping) and released.
        done = j1 if hi == min((j1 - self.first + 1) * G, len(self._order)) else j1 - 1
        for j in [j for j in self._staged if j <= done]:
            st = self._staged.pop(j)
            if st.mm is None:
                self.area.release(st.taken)
        self.area.release_older(self._prev_first)
        self._prev_first = j0
        if images is None:
            return None
        labels_t, ids_t = torch.from_numpy(labels), torch.from_numpy(ids)
        out = self.member.resources.delivery(images, labels_t, ids_t, self.order_epoch)
        return Step(out, len(ids), self.i + 1, fetch=None)  # made by the group: the wait is not split

    def _images(self, parts, lo: int, hi: int, j0: int) -> torch.Tensor:
        """The images of a batch: a view of a private mapping of its staged batch where it lies whole
        in one (no copy; writes stay in this process), else copied out of the shared slots."""
        area, member = self.area, self.member
        dtype = getattr(torch, area.dtype)
        shape = area.sample_shape
        per = int(np.prod(shape, dtype=np.int64))
        n = hi - lo
        normalize = member.normalize
        device = torch.device("cpu") if member.device_id is None else torch.device("cuda", member.device_id)
        st, sel = parts[0]
        whole = len(parts) == 1 and st.complete
        offset = lo - (j0 - self.first) * area.unit
        if whole and device.type == "cpu" and normalize is None and area.cow:
            if st.mm is None:
                st.mm = area.private_images(st.taken)
            at = offset * per * dtype.itemsize
            return torch.frombuffer(st.mm, dtype=dtype, count=n * per, offset=at).view(n, *shape)
        if whole:
            src = self._shared_rows(st)[offset : offset + n]
        else:  # one copy of the rows of each staged batch into the batch's own tensor
            src = torch.empty((sum(int(np.count_nonzero(sel)) for _, sel in parts), *shape), dtype=dtype)
            r = 0
            for st, sel in parts:
                idx = np.flatnonzero(sel)
                if not len(idx):
                    continue
                rows = self._shared_rows(st)
                if idx[-1] - idx[0] + 1 == len(idx):  # a run of rows: a slice, not a gather
                    src[r : r + len(idx)].copy_(rows[int(idx[0]) : int(idx[-1]) + 1])
                else:
                    torch.index_select(rows, 0, torch.from_numpy(idx), out=src[r : r + len(idx)])
                r += len(idx)
        if normalize is not None:
            return normalize(src.to(device))
        return src.to(device, copy=True) if whole else src.to(device)

    def _shared_rows(self, st: _Staged) -> torch.Tensor:
        """The images of a held staged batch, in the shared mapping (read, never written)."""
        area = self.area
        n = st.taken.n
        count = n * int(np.prod(area.sample_shape, dtype=np.int64))
        view = torch.frombuffer(area.shared_images(st.taken), dtype=getattr(torch, area.dtype), count=count)
        return view.view(n, *area.sample_shape)

    def _wait(self, q: int) -> bool:
        """Waits until staged batch ``q`` is ready; False: this member was detached."""
        area = self.area
        if area.ready(q):
            return True
        delay, last_health, t0 = 0.0002, time.monotonic(), time.monotonic()
        next_note, next_look = t0 + PROGRESS_EVERY_S, t0
        while not area.ready(q):
            if area.detached:
                return False
            self._channel.check()
            time.sleep(delay)
            delay = min(delay * 2, 0.005)
            now = time.monotonic()
            if now >= next_look:  # the ring is full and nobody can make q: who is a whole ring behind?
                area.detach_laggards(q)
                next_look = now + DETACH_LOOK_S
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
        return True

    # -- alone ------------------------------------------------------------------------------
    def _go_alone(self, why: str) -> None:
        """The rest of this pass comes from the member's own pipeline, in the same order and with the
        same images: the group detached it, or it was detached in its last pass and the group is in
        the middle of one. Its producers stop (the pipeline is the alone pass's now)."""
        self.area.release_all()  # the slots it held go back to the group
        self._staged.clear()
        self.member.join_producer(self.producers)
        log.info(
            "coordl: hp_group %r: %s; this job makes its batches %d-%d of this epoch itself and rejoins the "
            "group at an epoch that starts when the group's does",
            self.member.options.name,
            why,
            self.i,
            self.length - 1,
        )
        c = self.member.config
        batches = sampler.batches(self._order, self.b, c.drop_last, start=self.i)
        self._before_alone = dataclasses.replace(self.member.resources.fetcher.counters)
        self._alone_position = self.i
        self._alone_pass = self._alone(
            batches, order_epoch=self.order_epoch, start=self.i, on_batch=self._alone_delivered
        )

    def _alone_delivered(self, position: int) -> None:
        self._alone_position = position

    def _alone_step(self) -> Step | None:
        try:
            out = next(self._alone_pass)
        except StopIteration:
            return None
        return Step(out, len(out[1]), self._alone_position, fetch=None)

    # -- end, statistics ------------------------------------------------------------------------
    def _finish(self) -> None:
        self.member.went_alone = self._alone_pass is not None
        self.member.last_order = self.order_epoch  # a pass left unfinished may be joined again, as a plain loader would
        self.area.finish_pass(self.end)
        # One reading of the producers' count ends this pass's share and starts the next's: a
        # batch made while the statistics are taken counts in one of them, not in neither.
        self._produced_to = self.member.produced_mark = self.member.produced
        super()._finish()

    def _counters(self) -> FetchCounters:
        now = self.member.resources.fetcher.counters
        if self._before_alone is None:
            return now
        return self._before_alone + now  # the alone pass reset the counters when it began

    def _figures(self) -> dict:
        alone = self._alone_pass._figures() if self._alone_pass is not None else {}
        extra = {
            "produced": (self.member.produced if self._produced_to is None else self._produced_to)
            - self._produced_from,
            "consumed_shared": self._shared,
            "order_epoch": self.order_epoch,
            "detached": self._alone_pass is not None,
            "alone_batches": self._alone_pass.batches if self._alone_pass is not None else 0,
        }
        if self.area.attached:
            extra.update(self.area.stats())
        return {
            "fetch_wait_s": sum(p.fetch.wait_s for p in self.producers) + alone.get("fetch_wait_s", 0.0),
            "prep_s": sum(p.prep_s for p in self.producers) + alone.get("prep_s", 0.0),
            "skipped_paths": [p for _, p in self._skipped] + alone.get("skipped_paths", []),
            "extra": extra,
        }

    def _shutdown(self) -> None:
        """Stops the producer; it drains the batches it has in flight in the background (they count
        in the next pass, which waits for it)."""
        self.stop_event.set()
        if self._alone_pass is not None:
            self._alone_pass.close()

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
