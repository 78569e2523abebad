"""Where delivery stands: the epoch, the batches the consumer has received, and what a resume asked for.

Pure and single-threaded: the loader calls it when a pass starts (:meth:`Position.begin`), when
the consumer receives a batch (:meth:`Position.delivered_to`) and when a pass ends
(:meth:`Position.end`). Batches are counted where the consumer received them, never where a
prefetcher got to, so a saved position resumes exactly, at the same or another world size.
``set_epoch`` during a pass applies to the next one, as with ``DistributedSampler``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["PassStart", "Position", "check_state"]


@dataclass(frozen=True)
class PassStart:
    """What a starting pass delivers: batches ``start..`` of the plan of ``epoch`` over the
    samples of ``order_epoch``'s order from position ``base`` on, at ``world_size`` ranks."""

    epoch: int
    start: int
    order_epoch: int
    base: int = 0
    world_size: int = 1


@dataclass
class Position:
    """The resume position of one loader, the same on every rank when every rank has received as
    many batches (as in DDP).

    An epoch's *plan* deals the samples of its order from position ``base`` on (``0``, unless
    the epoch was resumed at another world size) to ``world`` ranks, ``DistributedSampler``
    fashion. After ``delivered`` batches on every rank the job has received the first
    ``base + delivered * batch_size * world`` samples of the order (padding aside), so a state
    resumes at any world size: at the same one it continues the plan; at another it makes a new
    plan over the samples not yet received.

    Args:
        samples: samples in the dataset.
        batch_size: samples per batch and rank.

    Attributes:
        epoch: the epoch of the current pass, or of the next one between passes.
        delivered: batches of the plan each rank has received.
        order_epoch: the epoch whose order the plan follows (an HP group's pass may follow the
            group's order rather than its own epoch's).
        base: the plan's first position in the order.
        world: the plan's world size (None: no pass yet, the next pass's).
        pending: an epoch set by ``set_epoch`` during a pass, for the next pass.
        resume: the next pass continues the plan (set by :meth:`load_state_dict`).
        running: a pass has begun and has neither ended nor been stopped.
    """

    samples: int
    batch_size: int
    epoch: int = 0
    delivered: int = 0
    order_epoch: int = 0
    base: int = 0
    world: int | None = None
    pending: int | None = None
    resume: bool = False
    running: bool = False

    def set_epoch(self, epoch: int) -> None:
        """The next pass delivers ``epoch`` (from its start, unless a restored state is in it)."""
        if self.running:
            self.pending = epoch
        elif epoch != self.epoch:
            self.pending = None
            self._fresh(epoch)

    def _fresh(self, epoch: int) -> None:
        self.epoch, self.delivered, self.base, self.order_epoch, self.resume = epoch, 0, 0, epoch, False

    def received(self) -> int:
        """Samples of the order the job has received in the current plan's epoch, padding aside."""
        return min(self.samples, self.base + self.delivered * self.batch_size * (self.world or 1))

    def begin(self, world_size: int = 1) -> PassStart:
        """A pass starts at ``world_size`` ranks: the batches it delivers. A pass that was stopped
        early is restarted from its first batch, as ``DataLoader`` restarts an abandoned epoch."""
        if self.pending is not None:
            if self.pending != self.epoch:
                self._fresh(self.pending)
            self.pending = None
        if not self.resume:
            self._fresh(self.epoch)
        elif self.world is not None and self.world != world_size:
            # Another world size: a new plan over the samples the old ranks had not received.
            self.base, self.delivered = self.received(), 0
        self.resume, self.world, self.running = False, world_size, True
        return PassStart(
            epoch=self.epoch,
            start=self.delivered,
            order_epoch=self.order_epoch,
            base=self.base,
            world_size=world_size,
        )

    def follow_order(self, order_epoch: int) -> None:
        """The running pass follows ``order_epoch``'s order (an HP group decides it)."""
        self.order_epoch = order_epoch

    def delivered_to(self, batches: int) -> None:
        """The consumer has received the first ``batches`` batches of the running pass's plan."""
        self.delivered = batches

    def end(self) -> None:
        """The running pass delivered its last batch: the next pass is the next epoch."""
        self.running = False
        self._fresh(self.epoch + 1)

    def stop(self) -> None:
        """The running pass was abandoned; the position stays where the consumer got to."""
        self.running = False

    def state_dict(self) -> dict:
        """``epoch`` and ``batches``; ``world_size``, the plan's, once a pass has begun or a state
        was loaded; ``order_epoch`` when it is not ``epoch`` and ``base`` when not 0."""
        if self.pending is not None and self.pending != self.epoch:
            return {"epoch": self.pending, "batches": 0}
        state = {"epoch": self.epoch, "batches": self.delivered}
        if self.world is not None:
            state["world_size"] = self.world
        mid_epoch = self.delivered > 0 or self.base > 0
        if mid_epoch and self.order_epoch != self.epoch:
            state["order_epoch"] = self.order_epoch
        if self.base:
            state["base"] = self.base
        return state

    def load_state_dict(self, state: dict) -> None:
        """The next pass continues ``state``'s plan of ``state["epoch"]`` after its first
        ``state["batches"]`` batches, or, at another world size, deals the samples not yet received.

        A state saved after the last batch (before the loop saw ``StopIteration``) resumes as an
        empty pass of that epoch, so a script that calls ``set_epoch(epoch)`` again does not replay it.
        """
        epoch, batches = state["epoch"], state["batches"]
        base = state.get("base", 0)
        self.pending = None
        self.running = False
        self.epoch, self.delivered, self.base, self.world = epoch, batches, base, state.get("world_size")
        self.resume = batches > 0 or base > 0
        self.order_epoch = state.get("order_epoch", epoch) if self.resume else epoch


# Fields that must be equal for a state to resume a loader, in the order they are checked; the
# position is checked after them, and ``config`` (the rest of the identity: the pre-processing) last.
# The world size may differ: the state then resumes elastically.
MATCHING = ("seed", "batch_size", "drop_last", "shard_drop_last", "shuffle", "dataset")
VERSION = 3  # of the state's layout: 3 added "order" and "shard_drop_last"


def check_state(state, mine: dict, samples: int, batches_in: Callable[[int, int], int]) -> None:
    """Raises unless ``state`` (a loader's saved ``state_dict()``) can resume the loader whose
    state is ``mine``; the message names the field that differs.

    Args:
        samples: samples in the dataset.
        batches_in: batches per rank of a plan, from its world size and base.

    Raises:
        TypeError: ``state`` is not a dict.
        ValueError: a field differs, is missing, or the position does not fit the epoch.
    """
    if not isinstance(state, dict):
        raise TypeError(f"state must be a dict from state_dict(), got {type(state).__name__}")
    if state.get("version") in (1, 2):
        raise ValueError(
            f"cannot resume: state has version={state['version']}, saved by coordl 0.1, whose epoch order was "
            f"numpy's Generator.permutation; this coordl orders epochs with an algorithm of its own (order "
            f"version {mine['order']}), so the rest of that epoch would be other samples. Start its epoch "
            f"again with loader.set_epoch({state.get('epoch', 0)!r}) instead of load_state_dict"
        )
    missing = sorted(set(mine) - set(state) - {"order_epoch", "base"})
    if missing:
        raise ValueError(f"state is missing {', '.join(missing)}; was it made by CoordLoader.state_dict()?")
    if state["version"] != VERSION:
        raise ValueError(f"cannot resume: state has version={state['version']!r}; this coordl reads version {VERSION}")
    if state["order"] != mine["order"]:
        raise ValueError(
            f"cannot resume: state has order={state['order']!r}, the version of the epoch order it was saved "
            f"under, but this coordl orders epochs with version {mine['order']}, so the rest of its epoch would be "
            f"other samples. Start its epoch again with loader.set_epoch({state['epoch']!r}) instead"
        )
    for key in MATCHING:
        _same(key, state, mine)
    epoch, batches, world = state["epoch"], state["batches"], state["world_size"]
    order_epoch, base = state.get("order_epoch", epoch), state.get("base", 0)
    if not (_count(world) and world >= 1):
        raise ValueError(f"state has an invalid world_size: {world!r}")
    if not (_count(base) and base <= samples):
        raise ValueError(f"state has an invalid base: {base!r} (the dataset has {samples} samples)")
    most = batches_in(world, base)
    if not (_count(epoch) and _count(batches) and batches <= most):
        raise ValueError(f"state has an invalid position: epoch={epoch!r}, batches={batches!r} of {most}")
    if not _count(order_epoch):
        raise ValueError(f"state has an invalid order_epoch: {order_epoch!r}")
    _same("config", state, mine)


def _count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _same(key: str, state: dict, mine: dict) -> None:
    if state[key] != mine[key]:
        raise ValueError(f"cannot resume: state has {key}={state[key]!r} but this loader has {key}={mine[key]!r}")
