"""The DALI pass: a driver thread runs fetch-ahead + the DALI pipeline, the consumer takes ready batches.

The driver thread holds the pipeline, the look-ahead and the channel, never the pass or the
loader, so a pass the consumer drops is collected and closed (``break``, ``islice``, ``del``).
"""

from __future__ import annotations

import threading
import time

import numpy as np

from coordl import lifecycle
from coordl.config import LoaderConfig
from coordl.fetch.ahead import FetchAhead, Stopped
from coordl.fetch.fetcher import FetchCounters
from coordl.passes import END, Channel, Pass, Step
from coordl.resources import Resources

__all__ = ["DaliPass"]


class DaliPass(Pass):
    """One pass of the DALI backend over ``batches`` (this rank's, from batch ``start`` of the epoch).

    Args:
        resources: the loader's collaborators; ``resources.prep`` is the pipeline runner.
        config: the loader's settings.
        batches: sample ids of each batch, in delivery order.
        order_epoch: the epoch whose order ``batches`` follow, which keys the random draws of
            their augmentation (default: ``epoch``).
        **hooks: ``epoch``, ``start``, ``owner``, ``on_batch``, ``on_end``, ``on_stop`` (see :class:`Pass`).
    """

    def __init__(
        self,
        resources: Resources,
        config: LoaderConfig,
        batches: list[np.ndarray],
        *,
        order_epoch: int | None = None,
        **hooks,
    ):
        super().__init__(length=len(batches), cache=resources.cache, decoded=resources.decoded, **hooks)
        order_epoch = self.epoch if order_epoch is None else order_epoch
        self._res = resources
        self._order_epoch = order_epoch
        prep = resources.prep
        self._prep0 = prep.waiting.total()
        self._skipped0 = len(prep.skipped)
        resources.fetcher.reset_counters()
        self._ahead = resources.fetch_ahead(batches, config, self.stop_event)
        peers = resources.peers
        self._served0 = peers.served() if peers is not None else (0, 0)
        keep = resources.fetcher if resources.decoded is not None else None
        all_decoded = keep is not None and bool(batches) and keep.all_decoded(np.concatenate(batches))
        self._channel = Channel(2, self.stop_event)
        self._thread = threading.Thread(
            target=_drive,
            args=(
                prep,
                self._ahead,
                resources.index.paths,
                order_epoch,
                self._channel,
                self.stop_event,
                keep,
                all_decoded,
            ),
            name="coordl-prep",
            daemon=True,
        )  # started by the first batch asked for: a pass made only to test iterability costs nothing

    def _step(self) -> Step | None:
        if self._thread.ident is None:
            self._thread.start()
        fetching = self._ahead.waiting
        f0 = fetching.total()
        item = self._channel.get(self._thread)
        if item is END:
            self._thread.join()
            return None
        images, labels, ids, number = item
        out = self._res.delivery(images, labels, ids, self._order_epoch)
        # Batches before it that were skipped whole count as received too.
        return Step(out, len(labels), self.start + number + 1, fetch=fetching.total() - f0)

    def _counters(self) -> FetchCounters:
        return self._res.fetcher.counters

    def _figures(self) -> dict:
        prep, peers = self._res.prep, self._res.peers
        skipped = self._ahead.skipped + (prep.skipped[self._skipped0 :] if prep is not None else [])
        served = (0, 0)
        if peers is not None:
            reads, nbytes = peers.served()
            served = (reads - self._served0[0], nbytes - self._served0[1])
        prep_s = prep.waiting.total() - self._prep0 if prep is not None else 0.0
        return {
            "fetch_wait_s": self._ahead.wait_s,
            "prep_s": prep_s,
            "skipped_paths": [p for _, p, _ in skipped],
            "served": served,
        }

    def _shutdown(self) -> None:
        self.stop_event.set()
        if self._res.peers is not None:  # after the requests in flight, the other nodes hear it is done
            self._res.peers.pass_done()
        if threading.current_thread() is self._thread:  # collected in its own thread: it is ending
            return
        deadline = time.monotonic() + lifecycle.SIGTERM_DEADLINE_S
        while self._thread.is_alive() and not (lifecycle.terminating() and time.monotonic() > deadline):
            self._channel.drain()
            self._thread.join(timeout=0.1)


def _drive(
    prep, ahead: FetchAhead, paths, order_epoch: int, channel: Channel, stop: threading.Event, keep, all_decoded
) -> None:
    """The driver thread: raw batches through the pipeline into the channel, then END or the failure."""
    lifecycle.quiet_thread()  # and so DALI's threads, which the pipeline starts from this one
    try:
        for tensors in prep.epoch(iter(ahead), paths.__getitem__, order_epoch, keep, all_decoded=all_decoded):
            if not channel.put(tensors):
                return
        channel.put(END)
    except Stopped:
        return
    except BaseException as e:  # noqa: BLE001 - handed to the consumer with its traceback
        if not stop.is_set():
            channel.fail(e)
