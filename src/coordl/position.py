"""Where delivery stands: the epoch, the batches the consumer has received, and what a resume asked for.

Pure and single-threaded: the loader calls it when a pass starts (:meth:`Position.begin`), when
the consumer receives a batch (:meth:`Position.delivered_to`) and when a pass ends
(:meth:`Position.end`). Batches are counted where the consumer received them, never where a
prefetcher got to, so a saved position resumes exactly. ``set_epoch`` during a pass applies to
the next one, as with ``DistributedSampler``.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PassStart", "Position", "check_state"]


@dataclass(frozen=True)
class PassStart:
    """What a starting pass delivers: batches ``start..`` of ``epoch``, in the order of ``order_epoch``."""

    epoch: int
    start: int
    order_epoch: int


@dataclass
class Position:
    """The resume position of one loader.

    Attributes:
        epoch: the epoch of the current pass, or of the next one between passes.
        delivered: batches of ``epoch`` the consumer has received.
        order_epoch: the epoch whose order the current pass follows (an HP group's pass may
            follow the group's order rather than its own epoch's).
        pending: an epoch set by ``set_epoch`` during a pass, for the next pass.
        resume_from: the batch the next pass starts at (set by :meth:`load_state_dict`).
        resume_order: the order epoch of the pass a restored state was in.
        running: a pass has begun and has neither ended nor been stopped.
    """

    epoch: int = 0
    delivered: int = 0
    order_epoch: int = 0
    pending: int | None = None
    resume_from: int = 0
    resume_order: int | None = None
    running: bool = False

    def set_epoch(self, epoch: int) -> None:
        """The next pass delivers ``epoch`` (from its start, unless a restored state is in it)."""
        if self.running:
            self.pending = epoch
        elif epoch != self.epoch:
            self.pending = None
            self.epoch, self.delivered, self.resume_from, self.resume_order = epoch, 0, 0, None

    def begin(self) -> PassStart:
        """A pass starts: the batches it delivers. A pass that was stopped early is restarted from
        its first batch, as ``DataLoader`` restarts an abandoned epoch."""
        if self.pending is not None:
            if self.pending != self.epoch:
                self.epoch, self.resume_from, self.resume_order = self.pending, 0, None
            self.pending = None
        start = self.resume_from
        self.order_epoch = self.resume_order if self.resume_order is not None else self.epoch
        self.resume_from, self.resume_order = 0, None
        self.delivered = start
        self.running = True
        return PassStart(self.epoch, start, self.order_epoch)

    def follow_order(self, order_epoch: int) -> None:
        """The running pass follows ``order_epoch``'s order (an HP group decides it)."""
        self.order_epoch = order_epoch

    def delivered_to(self, batches: int) -> None:
        """The consumer has received the first ``batches`` batches of the running pass's epoch."""
        self.delivered = batches

    def end(self) -> None:
        """The running pass delivered its last batch: the next pass is the next epoch."""
        self.running = False
        self.epoch += 1
        self.delivered = 0

    def stop(self) -> None:
        """The running pass was abandoned; the position stays where the consumer got to."""
        self.running = False

    def state_dict(self) -> dict:
        """``epoch``, ``batches`` and, when it differs from ``epoch``, ``order_epoch``."""
        epoch, batches = self.epoch, self.delivered
        order_epoch = self.order_epoch if batches else None
        if self.resume_order is not None:
            order_epoch = self.resume_order
        if self.pending is not None and self.pending != epoch:
            epoch, batches, order_epoch = self.pending, 0, None
        state = {"epoch": epoch, "batches": batches}
        if order_epoch is not None and order_epoch != epoch:
            state["order_epoch"] = order_epoch
        return state

    def load_state_dict(self, state: dict) -> None:
        """The next pass continues ``state["epoch"]`` after its first ``state["batches"]`` batches
        (in the order of ``state["order_epoch"]``, when given).

        A state saved after the last batch (before the loop saw ``StopIteration``) resumes as an
        empty pass of that epoch, so a script that calls ``set_epoch(epoch)`` again does not replay it.
        """
        epoch, batches, order_epoch = state["epoch"], state["batches"], state.get("order_epoch")
        self.pending = None
        self.running = False
        self.epoch, self.delivered, self.resume_from = epoch, batches, batches
        self.resume_order = (epoch if order_epoch is None else order_epoch) if batches else None


# Fields that must be equal for a state to resume a loader, in the order they are checked; the
# position is checked after them, and ``config`` (the rest of the identity: the pre-processing) last.
MATCHING = ("version", "seed", "rank", "world_size", "batch_size", "drop_last", "shuffle", "dataset")


def check_state(state, mine: dict, batches_per_epoch: int) -> None:
    """Raises unless ``state`` (a loader's saved ``state_dict()``) can resume the loader whose
    state is ``mine``; the message names the field that differs.

    Raises:
        TypeError: ``state`` is not a dict.
        ValueError: a field differs, is missing, or the position does not fit the epoch.
    """
    if not isinstance(state, dict):
        raise TypeError(f"state must be a dict from state_dict(), got {type(state).__name__}")
    missing = sorted(set(mine) - set(state) - {"order_epoch"})
    if missing:
        raise ValueError(f"state is missing {', '.join(missing)}; was it made by CoordLoader.state_dict()?")
    for key in MATCHING:
        _same(key, state, mine)
    epoch, batches = state["epoch"], state["batches"]
    order_epoch = state.get("order_epoch", epoch)
    if not (isinstance(epoch, int) and epoch >= 0 and isinstance(batches, int) and 0 <= batches <= batches_per_epoch):
        raise ValueError(f"state has an invalid position: epoch={epoch!r}, batches={batches!r} of {batches_per_epoch}")
    if not (isinstance(order_epoch, int) and order_epoch >= 0):
        raise ValueError(f"state has an invalid order_epoch: {order_epoch!r}")
    _same("config", state, mine)


def _same(key: str, state: dict, mine: dict) -> None:
    if state[key] != mine[key]:
        raise ValueError(f"cannot resume: state has {key}={state[key]!r} but this loader has {key}={mine[key]!r}")
