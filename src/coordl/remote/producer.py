"""An HP group member's Ray actors making group batches: one remote stream feeds every trial.

:class:`RemoteProducer` claims the batches the group needs next from the staging area, as the
member's own producer does, and hands each to a ready actor of the member's
:class:`~coordl.remote.actors.RemotePrep` as a unit of work (the batch's order epoch, ids and
the loader's seed: the same images every member would make). Results are written into their
slots and published; the claims of an actor that died are given back to the group, which has
them made again by whoever claims next. Staged batches in uint8 come from the recipe's
uint8 variant (``Unit.pixels``), normalised by each consumer as the local ones are.
"""

from __future__ import annotations

import logging
import threading
import time

from coordl import lifecycle
from coordl.errors import SampleError
from coordl.remote.cluster import DEPTH, Dispatch
from coordl.remote.shipping import TrainerReads
from coordl.remote.worker import Unit
from coordl.staging.member import Producer

__all__ = ["RemoteProducer"]

log = logging.getLogger(__name__)


class RemoteProducer(Producer):
    """Makes group batches on this member's Ray actors until stopped (see the module's docstring)."""

    def __init__(self, member, stop: threading.Event, channel):
        super().__init__(member, stop, channel)
        self.remote = member.resources.remote
        self.pixels = member.normalize is not None  # staged as uint8 pixels, normalised by consumers
        self._remote_prep_s = 0.0

    @property
    def prep_s(self) -> float:
        """Seconds the actors spent on this producer's batches."""
        return self._remote_prep_s

    def _unit(self, c) -> Unit:
        return Unit(c.q, self.ids_of(c.q), self.area.order_key(c.q), pixels=self.pixels)

    def _run(self) -> None:
        lifecycle.quiet_thread()
        area, pool = self.area, self.remote.pool
        dispatch = Dispatch(pool)
        reads = TrainerReads(self.fetch, stop=self.stop, carry_skipped=True)

        def read_ahead() -> None:
            """Reads submitted for the batches the actors reading through the trainer take next."""
            want = DEPTH * sum(info["reads"] == "trainer" for info in pool.ready.values())
            while len(reads) < want:
                c = area.claim(block=False)
                if c is None:
                    return
                reads.submit(self._unit(c), c)

        def next_unit(info):
            if not reads and info["reads"] == "trainer":
                read_ahead()
            if reads:  # read already (an actor that reads for itself takes them too)
                got = reads.take()
                read_ahead()
                return got
            c = area.claim(block=False)
            return None if c is None else (self._unit(c), c)

        try:
            while not self.stop.is_set():
                dispatch.fill(next_unit)
                read_ahead()
                if reads and not pool.ready:  # read for actors that are gone: made by whoever claims next
                    self._unclaim(reads)
                if not dispatch:
                    time.sleep(0.01)
                    continue
                for actor, c, lost, done, died in dispatch.results(timeout=0.05):
                    self._collect(actor, c, lost, done, died)
        except BaseException as e:  # noqa: BLE001 - the consumer raises it
            if not self.stop.is_set():
                self.channel.fail(e)
        finally:
            for c in dispatch.keys():
                area.unclaim(c)  # made by another producer of the group
            dispatch.cancel()
            self._unclaim(reads)

    def _unclaim(self, reads: TrainerReads) -> None:
        for c in reads.keys():
            self.area.unclaim(c)
        reads.cancel()

    def _collect(self, actor, c, lost: float, done, died: bool) -> None:
        area = self.area
        if died:
            area.unclaim(c)  # the group's next claim makes it again
            self.remote.died(actor, done, lost)
            return
        if isinstance(done, SampleError):
            area.publish_error(c, str(done), done.path)
            return
        if isinstance(done, BaseException):
            raise done
        self._remote_prep_s += done.prep_s
        if done.images is None:  # every sample skipped
            area.publish(c, 0)
            return
        self.write(c, done.images, done.labels, done.ids)  # Ray's read-only views, copied once: into the slot
