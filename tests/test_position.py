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
    fresh = Position()
    fresh.load_state_dict(state)
    return fresh


@settings(max_examples=300, deadline=None)
@given(epochs=st.integers(1, 4), cuts=st.lists(st.tuples(st.integers(0, N + 1), st.booleans()), max_size=12))
def test_interrupted_and_resumed_training_delivers_every_epoch_exactly_once(epochs, cuts):
    log: list = []
    pos = Position()
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
    pos, log = Position(), []
    b = pos.begin()
    for n in range(take):
        pos.delivered_to(n + 1)
    pos.set_epoch(new)
    assert pos.epoch == b.epoch and pos.delivered == take  # the running pass keeps its epoch
    assert pos.state_dict() == ({"epoch": new, "batches": 0} if new != 0 else {"epoch": 0, "batches": take})
    pos.stop()
    run_pass(pos, N, log)
    assert [n for _, n in log] == list(range(N)) and {ep for ep, _ in log} == {new}


@given(take=st.integers(0, N - 1))
def test_a_new_pass_after_a_break_restarts_the_epoch(take):
    pos, log = Position(), []
    run_pass(pos, take, log)  # break
    assert pos.state_dict() == {"epoch": 0, "batches": take}  # what a checkpoint saved now resumes from
    log.clear()
    run_pass(pos, N, log)  # a new iter(): the epoch from its start, as DataLoader does
    assert log == [(0, n) for n in range(N)] and pos.epoch == 1


@given(epoch=st.integers(0, 5), batches=st.integers(1, N), order=st.integers(0, 9))
def test_restore_keeps_the_order_epoch_and_set_epoch_of_the_same_epoch_keeps_the_position(epoch, batches, order):
    pos = Position()
    pos.load_state_dict({"epoch": epoch, "batches": batches, "order_epoch": order})
    assert pos.state_dict() == ({"epoch": epoch, "batches": batches} | ({"order_epoch": order} if order != epoch else {}))
    pos.set_epoch(epoch)  # a resumed script sets the epoch it is in: the position stays
    b = pos.begin()
    assert (b.epoch, b.start, b.order_epoch) == (epoch, batches, order)
    pos.set_epoch(epoch + 1)  # another epoch: from its start
    pos.stop()
    pos.set_epoch(epoch + 1)
    b = pos.begin()
    assert (b.epoch, b.start, b.order_epoch) == (epoch + 1, 0, epoch + 1)
