"""The position object alone: no threads, no DALI. Hypothesis drives sequences of ``set_epoch``,
passes (whole, broken off, abandoned for a new ``iter``), ``state_dict`` and a restart that loads it,
and checks that every epoch is delivered exactly once and in order, and that a resume continues
exactly where the consumer was."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from coordl.position import Position

N = 7  # batches per epoch


def run_pass(pos: Position, take: int, log: list, exhaust: bool = True) -> None:
    """A pass as the loader runs one: the consumer takes up to ``take`` batches; asking for one
    more after the last ends the pass (``exhaust``), else it is abandoned (``break``)."""
    b = pos.begin()
    n = b.start
    while n < N and n - b.start < take:
        n += 1
        pos.delivered_to(n)
        log.append((b.epoch, n - 1))
    if n == N and exhaust:
        pos.end()
    else:
        pos.stop()


def restart(pos: Position) -> Position:
    """A new process loads the saved state (through JSON, as a checkpoint does)."""
    state = json.loads(json.dumps(pos.state_dict()))
    fresh = Position(N, 1)
    fresh.load_state_dict(state)
    return fresh


@settings(max_examples=300, deadline=None)
@given(epochs=st.integers(1, 4), cuts=st.lists(st.tuples(st.integers(0, N + 1), st.booleans()), max_size=12))
def test_interrupted_and_resumed_training_delivers_every_epoch_exactly_once(epochs, cuts):
    log: list = []
    pos = Position(N, 1)
    cuts = list(cuts)
    e = 0
    while e < epochs:
        pos.set_epoch(e)  # the script's loop, before and after every restart
        while True:
            if cuts:
                take, exhaust = cuts.pop(0)
                run_pass(pos, take, log, exhaust)
                pos = restart(pos)  # the job is killed and restarted from its last checkpoint
                if pos.epoch != e:
                    break
                if pos.delivered == N:  # saved after the last batch, before StopIteration
                    run_pass(pos, N, log)  # an empty pass of the epoch ends it
                    break
                continue
            run_pass(pos, N, log)
            break
        e += 1
    for epoch in range(epochs):
        got = [n for ep, n in log if ep == epoch]
        assert got == list(range(N)), f"epoch {epoch}: {got}"


@settings(max_examples=200, deadline=None)
@given(take=st.integers(0, N - 1), new=st.integers(0, 9))
def test_set_epoch_during_a_pass_is_for_the_next_pass(take, new):
    pos, log = Position(N, 1), []
    b = pos.begin()
    for n in range(take):
        pos.delivered_to(n + 1)
    pos.set_epoch(new)
    assert pos.epoch == b.epoch and pos.delivered == take  # the running pass keeps its epoch
    assert pos.state_dict() == (
        {"epoch": new, "batches": 0} if new != 0 else {"epoch": 0, "batches": take, "world_size": 1}
    )
    pos.stop()
    run_pass(pos, N, log)
    assert [n for _, n in log] == list(range(N)) and {ep for ep, _ in log} == {new}


@given(take=st.integers(0, N - 1))
def test_a_new_pass_after_a_break_restarts_the_epoch(take):
    pos, log = Position(N, 1), []
    run_pass(pos, take, log)  # break
    assert pos.state_dict() == {"epoch": 0, "batches": take, "world_size": 1}  # what a checkpoint resumes from
    log.clear()
    run_pass(pos, N, log)  # a new iter(): the epoch from its start, as DataLoader does
    assert log == [(0, n) for n in range(N)] and pos.epoch == 1


@given(epoch=st.integers(0, 5), batches=st.integers(1, N), order=st.integers(0, 9))
def test_restore_keeps_the_order_epoch_and_set_epoch_of_the_same_epoch_keeps_the_position(epoch, batches, order):
    pos = Position(N, 1)
    pos.load_state_dict({"epoch": epoch, "batches": batches, "order_epoch": order})
    assert pos.state_dict() == (
        {"epoch": epoch, "batches": batches} | ({"order_epoch": order} if order != epoch else {})
    )
    pos.set_epoch(epoch)  # a resumed script sets the epoch it is in: the position stays
    b = pos.begin()
    assert (b.epoch, b.start, b.order_epoch) == (epoch, batches, order)
    pos.set_epoch(epoch + 1)  # another epoch: from its start
    pos.stop()
    pos.set_epoch(epoch + 1)
    b = pos.begin()
    assert (b.epoch, b.start, b.order_epoch) == (epoch + 1, 0, epoch + 1)


# -- elastic resume: the position with the schedule, across world sizes ---------------------------------------------

from collections import Counter  # noqa: E402

from coordl.position import check_state  # noqa: E402
from coordl.schedule import Schedule  # noqa: E402


def _epoch_on(schedule: Schedule, pos: Position, world: int, take: int | None) -> tuple[list[int], bool]:
    """One pass on every rank of a ``world``-rank job, in step as under DDP: each rank receives its
    batches one by one; the job stops after ``take`` batches (None: the whole pass). Returns the
    samples received, rank by rank and batch by batch, and whether the pass ended."""
    b = pos.begin(world)
    plans = [schedule.batches(b.order_epoch, r, world, b.start, base=b.base) for r in range(world)]
    assert len({len(p) for p in plans}) == 1, "ranks of one job must have as many batches"
    n = len(plans[0]) if take is None else min(take, len(plans[0]))
    got = [int(i) for k in range(n) for r in range(world) for i in plans[r][k]]
    pos.delivered_to(b.start + n)
    if n == len(plans[0]):
        pos.end()
        return got, True
    pos.stop()
    return got, False


@settings(max_examples=300, deadline=None)
@given(
    samples=st.integers(1, 60),
    batch_size=st.integers(1, 5),
    drop_last=st.booleans(),
    worlds=st.lists(st.integers(1, 5), min_size=1, max_size=4),
    takes=st.lists(st.integers(0, 6), min_size=3, max_size=3),
)
def test_an_epoch_resumed_at_other_world_sizes_delivers_every_sample_once_beyond_padding(
    samples, batch_size, drop_last, worlds, takes
):
    schedule = Schedule(samples, batch_size, shuffle=True, drop_last=drop_last, seed=5, shard_drop_last=drop_last)
    pos = Position(samples, batch_size)
    got, slack = [], 0
    for k, world in enumerate(worlds):
        last = k == len(worlds) - 1
        part, ended = _epoch_on(schedule, pos, world, None if last else takes[k % 3])
        got += part
        slack += world * batch_size  # a plan pads fewer than `world` samples, or cuts fewer than this
        if ended:
            break
        fields = {"version": 3, "order": 1, "seed": 5, "batch_size": batch_size, "drop_last": drop_last}
        fields |= {"shard_drop_last": drop_last, "shuffle": True}
        state = json.loads(json.dumps({**fields, **pos.state_dict(), "dataset": "d", "config": "c"}))
        check_state(state, state, samples, schedule.num_batches)  # what rank 0 saved is well formed
        pos = Position(samples, batch_size)  # the job restarts at the next world size
        pos.load_state_dict(state)
    assert ended and pos.epoch == 1
    counts = Counter(got)
    assert set(counts) <= set(range(samples))
    if drop_last:
        assert max(counts.values(), default=1) == 1, "drop_last: no sample twice"
        assert samples - len(counts) < slack
    else:
        assert len(counts) == samples, "every sample of the epoch delivered"
        assert sum(counts.values()) - samples < slack


@settings(max_examples=200, deadline=None)
@given(
    samples=st.integers(1, 50),
    batch_size=st.integers(1, 4),
    world=st.integers(1, 4),
    take=st.integers(0, 8),
    drop_last=st.booleans(),
)
def test_a_resume_at_the_same_world_size_continues_the_uninterrupted_batches(
    samples, batch_size, world, take, drop_last
):
    schedule = Schedule(samples, batch_size, shuffle=True, drop_last=drop_last, seed=1, shard_drop_last=drop_last)
    whole, _ = _epoch_on(schedule, Position(samples, batch_size), world, None)
    pos = Position(samples, batch_size)
    first, ended = _epoch_on(schedule, pos, world, take)
    if not ended:
        resumed = Position(samples, batch_size)
        resumed.load_state_dict(json.loads(json.dumps(pos.state_dict())))
        rest, ended = _epoch_on(schedule, resumed, world, None)
        first += rest
    assert ended and first == whole


def test_the_epochs_after_an_elastic_resume_follow_the_new_world_size():
    schedule = Schedule(20, 2, shuffle=True, drop_last=False, seed=0)
    pos = Position(20, 2)
    _epoch_on(schedule, pos, 2, 3)  # 12 samples of epoch 0 at 2 ranks
    resumed = Position(20, 2)
    resumed.load_state_dict(pos.state_dict())
    rest, ended = _epoch_on(schedule, resumed, 3, None)
    assert ended and sorted(rest) == sorted(schedule.order(0)[12:].tolist() + schedule.order(0)[12:13].tolist())
    b = resumed.begin(3)
    assert (b.epoch, b.start, b.base) == (1, 0, 0)
    assert resumed.state_dict() == {"epoch": 1, "batches": 0, "world_size": 3}


@settings(max_examples=100, deadline=None)
@given(
    samples=st.integers(1, 60),
    batch_size=st.integers(1, 4),
    before=st.integers(1, 4),
    after=st.integers(1, 4),
    take=st.integers(0, 5),
    seed=st.integers(0, 99),
)
def test_locality_aware_resume_keeps_the_global_batches_of_the_plain_one(
    samples, batch_size, before, after, take, seed
):
    import numpy as np

    from coordl.schedule import Locality

    rng = np.random.default_rng(seed)
    schedule = Schedule(samples, batch_size, shuffle=True, drop_last=False, seed=seed)
    pos = Position(samples, batch_size)
    _epoch_on(schedule, pos, before, take)
    resumed = Position(samples, batch_size)
    resumed.load_state_dict(pos.state_dict())
    b = resumed.begin(after)
    nodes = rng.integers(1, after + 1)
    locality = Locality(rng.integers(-1, nodes, samples), np.sort(rng.integers(0, nodes, after)))
    plain = [schedule.batches(b.order_epoch, r, after, b.start, base=b.base) for r in range(after)]
    aware = [schedule.batches(b.order_epoch, r, after, b.start, locality, b.base) for r in range(after)]
    assert [len(p) for p in aware] == [len(p) for p in plain]
    for k in range(len(plain[0])):
        assert sorted(np.concatenate([p[k] for p in aware])) == sorted(np.concatenate([p[k] for p in plain]))
        assert [len(p[k]) for p in aware] == [len(p[k]) for p in plain]
