"""Coordinated prep: jobs that name one ``hp_group`` share every batch, made once.

Members are real spawned processes sharing a real staging area in the test's shm
folder; a killed member is killed with SIGKILL.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import threading
import time

import numpy as np
import pytest
import torch

import coordl
from childproc import WAIT, report, result
from coordl import CoordLoader, GroupConfigError, ImageNetTrain, ImageNetVal
from coordl.index import Index
from coordl.shm import names
from coordl.staging.area import StagingArea
from coordl.staging.layout import CLAIMED, slot_stride
from hptrials import GUARD_S, Opens, Records, Trials, exclusive_flocks, trial

CTX = multiprocessing.get_context("spawn")
RECIPE = ImageNetTrain(size=16)
N = 120  # samples in tiny_dataset


def _loader(root, **kw):
    kw.setdefault("batch_size", 8)
    kw.setdefault("pipeline", RECIPE)
    kw.setdefault("shuffle", True)
    return CoordLoader(root, return_index=True, **kw, prep=1, fetch=coordl.Fetch(threads=2))


def _member(root, group, epochs, kw, start, q, per_batch_s=0.0, progress=None, stop_after=None, enrolled=None):
    """Runs ``epochs`` epochs in the group, ``per_batch_s`` of training per batch; reports ids, image
    sums and stats per epoch. Sets ``progress`` after ``stop_after`` batches and waits there to be
    killed; sets ``enrolled`` once its first pass has joined the group's."""

    def body():
        out = {"ids": [], "sums": [], "stats": [], "max_gap": 0.0, "pid": os.getpid()}
        with _loader(root, hp_group=group, **kw) as loader:
            if start is not None:
                start.wait(WAIT)
            taken = 0
            for e in range(epochs):
                loader.set_epoch(e)
                ids, sums = [], []
                it = iter(loader)  # joins the group's pass
                if enrolled is not None:
                    enrolled.set()
                last = time.monotonic()
                for x, _, i in it:
                    out["max_gap"] = max(out["max_gap"], time.monotonic() - last)
                    ids.append(i.tolist())
                    sums.append(float(x.double().sum()))
                    x.mul_(0)  # a consumer's writes must not reach the other members
                    taken += 1
                    if progress is not None and taken == stop_after:
                        progress.set()
                        _wait_to_be_killed()
                    time.sleep(per_batch_s)  # the training step
                    last = time.monotonic()
                out["ids"].append(ids)
                out["sums"].append(sums)
                out["stats"].append(loader.stats())
        return out

    report(q, body)


def _wait_to_be_killed():
    while True:
        signal.pause()


def _flat(batches):
    return [i for b in batches for i in b]


def _check_epochs(out, n=N):
    for ids in out["ids"]:
        assert sorted(_flat(ids)) == list(range(n)), "an epoch missed or repeated a sample"


def two_members(procs, root, group: str, epochs: int, timeout: float = 120) -> list[dict]:
    """Two members of ``group`` over ``root`` started together (:func:`_member`, 0.01 s a batch):
    what each reported, once each epoch of each was exactly once and both got the same batches."""
    start, q = CTX.Barrier(2), CTX.Queue()
    for _ in range(2):
        procs(_member, root, group, epochs, {}, start, q, 0.01)
    outs = [result(q, timeout) for _ in range(2)]
    for out in outs:
        _check_epochs(out)
    assert outs[0]["ids"] == outs[1]["ids"]
    return outs


# -- a group of one ------------------------------------------------------------------------
def test_group_of_one_delivers_what_a_plain_loader_delivers(tiny_dataset, isolated):
    def epochs(**kw):
        got = []
        with _loader(str(tiny_dataset), **kw) as loader:
            for e in (0, 1, 2, 5):
                loader.set_epoch(e)
                got.append([i.tolist() for _, _, i in loader])
            stats = loader.stats()
        return got, stats

    plain, _ = epochs()
    grouped, stats = epochs(hp_group="alone")
    assert grouped == plain  # same order, same batches, set_epoch respected
    assert stats["hp_members"] == 1 and stats["consumed_shared"] == 0
    assert 0 < stats["staging_peak_bytes"] <= stats["staging_bound"]
    assert os.listdir(isolated) == []  # closing the last member removed the area


def test_a_producer_subclass_sets_its_fields_after_super_init(tiny_dataset, isolated, monkeypatch):
    """A producer is made complete, then started by whoever made it: a subclass (as the remote one)
    sets its own fields after ``super().__init__`` and its thread sees them. A constructor that
    started the thread let it run before they were set (an AttributeError in the loop)."""
    from coordl.staging import member

    class Late(member.Producer):
        def __init__(self, *args):
            super().__init__(*args)
            time.sleep(0.3)  # a thread started in the constructor runs before the field below
            self.label = "late"

        def _run(self):
            try:
                self.label  # noqa: B018 - unset if the thread runs before the constructor's end
            except AttributeError as e:
                self.channel.fail(e)  # the loop raises it
                return
            super()._run()

    monkeypatch.setattr(member, "Producer", Late)  # what a loader's group member makes
    with _loader(str(tiny_dataset), hp_group="late") as loader:
        ids = sorted(i for _, _, b in loader for i in b.tolist())
    assert ids == list(range(N))
    assert os.listdir(isolated) == []


def test_a_finished_pass_freed_after_the_next_began_leaves_the_next_ones_producers(tiny_dataset, isolated, procs):
    # A training loop that writes ``it = iter(loader)`` each epoch frees the previous pass only after
    # the next one began; closing that finished pass once stopped the new pass's producers, and a
    # group with nobody left producing waited forever.
    q = CTX.Queue()
    procs(_iter_each_epoch, str(tiny_dataset), q)
    epochs = result(q, GUARD_S)  # a guard: without producers the second epoch never ends
    assert [sorted(_flat(ids)) for ids in epochs] == [list(range(N))] * 2


def _iter_each_epoch(root, q):
    def body():
        stride = slot_stride(8, (3, 16, 16), "float32")
        group = coordl.HPGroup("iter", staging=4 * stride)  # 4 slots: the ring cannot hold a pass ahead
        got = []
        with _loader(root, hp_group=group) as loader:
            old = iter(loader)
            got.append([i.tolist() for _, _, i in old])
            loader.set_epoch(1)
            new = iter(loader)
            old.close()  # as its freeing does, after the next pass began
            got.append([i.tolist() for _, _, i in new])
        return got

    report(q, body)


# -- 2 to 4 members ------------------------------------------------------------------------
@pytest.mark.parametrize("members", [2, 4])
def test_members_see_every_sample_once_and_each_batch_is_made_once(tiny_dataset, isolated, procs, members):
    start, q = CTX.Barrier(members), CTX.Queue()
    for _ in range(members):
        procs(_member, str(tiny_dataset), "sweep", 3, {}, start, q, 0.01)
    outs = [result(q, 120) for _ in range(members)]
    nb = 15
    keys = set()
    for out in outs:
        _check_epochs(out)
        keys |= {s["order_epoch"] for s in out["stats"]}
        assert all(s["hp_members"] <= members for s in out["stats"])
    # Started together, they shared their passes: each batch was consumed by every member...
    assert keys == {0, 1, 2}
    assert sum(s["consumed_shared"] for o in outs for s in o["stats"]) >= (members - 1) * 3 * nb
    # ...and decoded once for the group, not once per member (work-ahead may add a pass).
    produced = sum(s["produced"] for o in outs for s in o["stats"])
    assert 3 * nb <= produced <= 4 * nb
    # Storage was read once for the group (the cache holds the dataset), not once per member.
    # The one exception: a sample whose first read is still in flight when a producer working
    # ahead on the next epoch needs it too is read twice (the cache never waits on a writer).
    total = Index.scan(tiny_dataset).total_bytes
    read = sum(s["storage_bytes"] for o in outs for s in o["stats"])
    assert total <= read < 1.25 * total
    # Members received identical batches, whatever the others did to theirs in place.
    for k in range(1, members):
        assert outs[k]["ids"] == outs[0]["ids"]
        np.testing.assert_allclose(outs[k]["sums"], outs[0]["sums"], rtol=1e-6)


# -- death ---------------------------------------------------------------------------------
def test_a_member_killed_mid_epoch_does_not_stop_the_others(tiny_dataset, isolated, procs):
    start, q, q_victim, progress = CTX.Barrier(3), CTX.Queue(), CTX.Queue(), CTX.Event()
    victim = procs(_member, str(tiny_dataset), "kill", 2, {}, start, q_victim, 0.0, progress, 5)
    for _ in range(2):
        procs(_member, str(tiny_dataset), "kill", 2, {}, start, q, 0.05)
    assert progress.wait(WAIT)
    os.kill(victim.pid, signal.SIGKILL)  # it holds batches the others need, maybe claims too
    victim.join(WAIT)
    outs = [result(q, 120) for _ in range(2)]
    for out in outs:
        _check_epochs(out)
        # A guard against a survivor stuck on the dead member's batches, not the bound (0.25 s to notice
        # the death): test_a_killed_trial_is_noticed_within_0_25_s_of_waiting_for_it checks that.
        assert out["max_gap"] < 5.0, f"a survivor waited {out['max_gap']:.1f} s for a batch"
    assert outs[0]["ids"] == outs[1]["ids"]


# -- leaving -------------------------------------------------------------------------------
def test_a_member_that_breaks_out_of_a_pass_leaves_it_and_the_others_go_on(tiny_dataset, isolated, procs):
    """docs/hp-search.md ("Leaving"): breaking out of an epoch leaves that pass. The breaker keeps
    its loader open without iterating; the others, in a staging area of a few slots, finish the
    epoch without waiting for it (its share of each staged batch is dropped at once, not after
    HPGroup(idle_timeout)), and its next epoch is a whole one."""
    group = coordl.HPGroup("leave", staging=4 * 8 * 3 * 16 * 16 * 4 + 4 * 4096, idle_timeout=60.0)  # 4-5 slots
    start, q, q_breaker, broke, go_on = CTX.Barrier(3), CTX.Queue(), CTX.Queue(), CTX.Event(), CTX.Event()
    procs(_member_breaking, str(tiny_dataset), group, start, q_breaker, broke, go_on)
    for _ in range(2):
        procs(_member, str(tiny_dataset), group, 1, {}, start, q, 0.02)
    assert broke.wait(WAIT)
    outs = [result(q, 120) for _ in range(2)]
    for out in outs:
        _check_epochs(out)
        assert out["stats"][0]["consumed_shared"] > 0  # they shared with each other
        # Held by the breaker, they would wait idle_timeout (60 s) once the 4-5 slots were full.
        assert out["max_gap"] < 5.0, f"a member waited {out['max_gap']:.1f} s for a batch"
    assert outs[0]["ids"] == outs[1]["ids"]
    go_on.set()
    b = result(q_breaker, 120)
    assert len(_flat(b["ids"][0])) == 3 * 8  # the pass it left
    _check_epochs({"ids": b["ids"][1:]})  # a whole epoch after it


def _member_breaking(root, group, start, q, broke, go_on):
    """Breaks out of its first epoch after 3 batches, keeps its loader open without iterating until
    ``go_on``, then runs a whole epoch."""

    def body():
        out = {"ids": []}
        with _loader(root, hp_group=group) as loader:
            start.wait(WAIT)
            for e in range(2):
                loader.set_epoch(e)
                ids = []
                for k, (_, _, i) in enumerate(loader):
                    ids.append(i.tolist())
                    if e == 0 and k == 2:
                        break
                out["ids"].append(ids)
                if e == 0:
                    broke.set()
                    assert go_on.wait(WAIT)
        return out

    report(q, body)


# The bound docs/guarantees.md ("A trial of an hp_group dies") and docs/hp-search.md ("Dying") state: the
# others notice a dead trial within 0.25 s of waiting for it.
NOTICE_S = 0.25
# How many times the others look at a stopped trial's lock (and find it alive) before it continues.
LOOKS = 8
EPOCHS = 2
NB = N // 8  # batches per pass at _loader's batch size


def _trials(procs, root, group, n, epochs=EPOCHS):
    """Starts ``n`` trials of ``group`` (:func:`hptrials.trial`); returns their pipes once each has had
    a batch (so each is a member of the group)."""
    start, trials, ps = CTX.Barrier(n), Trials(), []
    for _ in range(n):
        r, w = CTX.Pipe(duplex=False)
        ps.append(procs(trial, w, root, group, epochs, start, _loader))
        w.close()
        trials.add(ps[-1].pid, r)
    trials.until(lambda: all(trials.kinds(p.pid, "got") for p in ps), "every trial's first batch")
    return trials, ps


def _stop_while_making_a_batch(trials, rec, victim, last_q):
    """SIGSTOPs ``victim`` at a moment it is making a batch before ``last_q`` and holds no exclusive
    lock but its member file's (the group's mutex or the cache's would stop everyone, not just its
    batch). Tries again after each batch it gets; returns the first batch it is making and its claim token."""
    members = {os.stat(os.path.join(rec.directory, e)).st_ino for e in os.listdir(rec.directory) if ".member." in e}
    tries = len(trials.kinds(victim.pid, "got"))
    while True:
        assert tries < EPOCHS * NB, "guard: the victim never held a claim when stopped"
        os.kill(victim.pid, signal.SIGSTOP)
        _, status = os.waitpid(victim.pid, os.WUNTRACED)  # returns once all its threads stopped
        assert os.WIFSTOPPED(status), f"the victim ended: status {status}"
        if exclusive_flocks(victim.pid) <= members:
            with rec.locked():
                claims = rec.claims(rec.member(victim.pid))
            if claims and min(claims) < last_q:
                q = min(claims)
                return q, claims[q]
        os.kill(victim.pid, signal.SIGCONT)
        trials.until(lambda n=tries: len(trials.kinds(victim.pid, "got")) > n, "the victim's next batch")
        tries = len(trials.kinds(victim.pid, "got"))


def _waiting_for(trials, rec, others, q):
    """Whether each of ``others`` has had every batch it took (its ``consumed`` record counts them),
    asked for the next one (not for one past its epoch's end: that ask ends the epoch), and that is
    batch ``q``."""
    if not all(trials.last(p.pid) == "ask" and trials.events[p.pid][-1][2] < NB for p in others):
        return False
    with rec.locked():
        ms = [rec.m[rec.member(p.pid)] for p in others]
        return all(
            int(m["cursor"]) == q and int(m["consumed"]) == len(trials.kinds(p.pid, "got"))
            for m, p in zip(ms, others, strict=True)
        )


def _gaps(start: float, times: list[float]) -> list[float]:
    return [b - a for a, b in zip([start, *times], times, strict=False)]


def test_a_killed_trial_is_noticed_within_0_25_s_of_waiting_for_it(tiny_dataset, isolated, procs):
    trials, (victim, other) = _trials(procs, str(tiny_dataset), "noticed", 2)
    rec = Records(str(isolated), "noticed")
    looks = None
    try:
        # Stopped first, so that it dies for certain while making a batch the other waits for.
        q, token = _stop_while_making_a_batch(trials, rec, victim, EPOCHS * NB)
        looks = Opens(rec.member_file(rec.member(victim.pid)))
        trials.until(lambda: _waiting_for(trials, rec, [other], q), f"the other to wait for batch {q}")
        waiting = trials.kinds(other.pid, "ask")[-1]
        looks.wait_for(4, waiting, "the other to look at the stopped trial's lock")
        killed = time.monotonic()
        os.kill(victim.pid, signal.SIGKILL)
        trials.until(lambda: trials.kinds(victim.pid, "eof"), "the victim's end")
        dead = trials.kinds(victim.pid, "eof")[0]  # the kernel had dropped its locks by then
        trials.until(lambda: trials.kinds(other.pid, "gone"), "the other to notice the death")
        with rec.locked():
            assert all(int(rec.m[k]["pid"]) != victim.pid for k in range(len(rec.m)) if int(rec.m[k]["state"]))
            slot = rec.s[q % int(rec.h["slots"])]
            mine = int(slot["state"]) == CLAIMED and int(slot["q"]) == q and int(slot["token"]) == token
            assert not mine  # its claim was given back (and maybe made again by now)
        trials.until(lambda: other.pid in trials.results, "the other's result")
    finally:
        if looks is not None:
            looks.close()
        rec.close()
        trials.close()
    (noticed,) = trials.kinds(other.pid, "gone")  # found dead once
    remade = min(t for t in trials.kinds(other.pid, "got") if t > killed)
    gaps = _gaps(waiting, [t for t in looks.times if waiting < t < killed])
    timing = (
        f"while waiting, looked at its lock after {[round(g, 3) for g in gaps]} s; "
        f"killed -> ended by the kernel {dead - killed:.3f} s -> noticed {noticed - dead:+.3f} s "
        f"-> its batch remade and delivered {remade - noticed:+.3f} s"
    )
    print(timing)
    # While it waits, the other looks at least every 0.25 s: a trial dying at any moment is noticed
    # within 0.25 s. And the one that died was.
    assert max(gaps) <= NOTICE_S, timing
    assert noticed - dead <= NOTICE_S, timing
    _check_epochs(trials.results[other.pid])  # nothing lost, nothing twice


def test_a_trial_stopped_with_sigstop_is_alive_and_the_others_wait_for_it(tiny_dataset, isolated, procs):
    trials, ps = _trials(procs, str(tiny_dataset), "stopped", 3)
    victim, others = ps[0], ps[1:]
    rec = Records(str(isolated), "stopped")
    looks = None
    try:
        q, token = _stop_while_making_a_batch(trials, rec, victim, EPOCHS * NB)
        looks = Opens(rec.member_file(rec.member(victim.pid)))
        trials.until(lambda: _waiting_for(trials, rec, others, q), f"the others to wait for batch {q}")
        waiting = max(trials.kinds(p.pid, "ask")[-1] for p in others)
        looks.wait_for(LOOKS, waiting, "the others to look at the stopped trial's lock")
        came = [m for m in trials.drain() if m[0] != victim.pid]  # (it may have sent some before it stopped)
        assert came == [], f"while a trial was stopped the others went on or dropped it: {came}"
        with rec.locked():
            assert rec.claims(rec.member(victim.pid)).get(q) == token  # still a member, still making batch q
            assert all(int(rec.m[rec.member(p.pid)]["cursor"]) == q for p in others)
        os.kill(victim.pid, signal.SIGCONT)
        trials.until(lambda: len(trials.results) == len(ps), "every trial's results")
    finally:
        if looks is not None:
            looks.close()
        rec.close()
        trials.close()
    assert not any(trials.kinds(p.pid, "gone") for p in ps)
    outs = [trials.results[p.pid] for p in ps]
    for out in outs:
        _check_epochs(out)  # nothing lost, nothing twice, the stopped trial's included
    for out in outs[1:]:  # the stopped trial got exactly the others' batches
        assert out["ids"] == outs[0]["ids"]
        np.testing.assert_allclose(out["sums"], outs[0]["sums"], rtol=1e-6)
    assert {s["order_epoch"] for o in outs for s in o["stats"]} == set(range(EPOCHS))


def test_the_claim_of_a_dead_producer_is_made_by_another(isolated, procs):
    q, claimed = CTX.Queue(), CTX.Event()
    area = _area("dead-claim")
    try:
        area.enroll(0, may_rebase=False)
        p = procs(_claim_and_hang, str(isolated), claimed, q)
        assert claimed.wait(WAIT)
        assert area.claim(block=False).q == 1  # batch 0 is the child's
        os.kill(p.pid, signal.SIGKILL)
        p.join(WAIT)
        area.health()
        again = area.claim(block=False)
        assert again.q == 0  # given back when its producer died, and made first
    finally:
        area.close()


def _claim_and_hang(directory, claimed, q):
    os.environ["COORDL_SHM_DIR"] = directory
    area = _area("dead-claim")
    assert area.claim(block=False).q == 0
    claimed.set()
    _wait_to_be_killed()


def _area(name, **kw):
    kw.setdefault("batch_size", 2)
    return StagingArea(
        name,
        0,
        {"dataset": "x"},
        batches_per_pass=10,
        sample_shape=(3, 4, 4),
        dtype="uint8",
        epoch=0,
        bound=kw.pop("bound", 4 * 4096),
        **kw,
    )


def test_the_ring_never_holds_more_than_the_bound(isolated):
    area = _area("ring")
    try:
        assert area.slots == 4
        files = {e: os.path.getsize(os.path.join(isolated, e)) for e in os.listdir(isolated)}
        assert sum(v for k, v in files.items() if k.endswith(".batches")) <= 4 * 4096
        area.enroll(0, may_rebase=False)
        claims = [area.claim(block=False) for _ in range(4)]
        assert [c.q for c in claims] == [0, 1, 2, 3]
        assert area.claim(block=False) is None  # full until the member consumes batch 0
        for c in claims:
            area.publish(c, 2)
        t = area.take(0)
        assert area.claim(block=False) is None  # consumed but still held by its tensor
        area.release(t)
        assert area.claim(block=False).q == 4
        assert area.stats()["staging_peak_bytes"] <= area.stats()["staging_bound"] == 4 * 4096
    finally:
        area.close()


def test_a_member_idle_between_epochs_is_dropped_after_the_timeout(isolated):
    timeout = 1.0  # HPGroup(idle_timeout): the longest an idle member holds the others up
    busy, idle = _area("idle", idle_timeout=timeout), _area("idle", idle_timeout=timeout)
    try:
        busy.enroll(0, may_rebase=False)
        idle.enroll(0, may_rebase=False)
        before = time.monotonic()
        idle.finish_pass(0)  # enrolled for batch 0 on, but not iterating: idle from now
        after = time.monotonic()
        claims = [busy.claim(block=False) for _ in range(4)]
        for c in claims:
            busy.publish(c, 2)
        for q in range(4):
            busy.release(busy.take(q))
        c = busy.claim(block=False)
        if time.monotonic() < before + timeout:  # (a machine too busy to get here in time cannot tell)
            assert c is None  # its time is not up: the idle member still holds batch 0
        if c is None:
            time.sleep(max(0.0, after + timeout - time.monotonic()))  # until its time is up, at the latest
            c = busy.claim(block=False)
        assert c is not None and c.q == 4  # dropped: the ring moves on
        start, continues = idle.enroll(1, may_rebase=False)
        assert not continues and start == 10  # it rejoins at the next pass
    finally:
        idle.close()
        busy.close()


# -- joining -------------------------------------------------------------------------------
STEP_S = 0.03  # member A's training step in the joining test


def test_a_member_joining_mid_epoch_gets_whole_epochs_from_the_next_boundary(tiny_dataset, isolated, procs):
    q_a, q_b, progress, enrolled = CTX.Queue(), CTX.Queue(), CTX.Event(), CTX.Event()
    group = coordl.HPGroup("join", staging=4 * 4 * 3 * 16 * 16 * 4 + 4 * 4096)  # 4-5 slots, 30 batches a pass
    kw = {"batch_size": 4}
    procs(_member_signalling, str(tiny_dataset), group, 3, kw, q_a, progress, enrolled)
    assert progress.wait(WAIT)  # A is in the middle of its first epoch, and waits for B to join
    # B trains at A's pace: a B that trained faster would detach A as a laggard at the start of the
    # next pass (GroupPass), and then share only the few batches A's producer made before that.
    procs(_member, str(tiny_dataset), group, 2, kw, None, q_b, STEP_S, None, None, enrolled)
    a, b = result(q_a, 120), result(q_b, 120)
    _check_epochs(a)
    _check_epochs(b)
    first = b["stats"][0]["order_epoch"]
    assert first == 1  # not the epoch it arrived in the middle of: the next one
    assert [s["order_epoch"] for s in b["stats"]] == [first, first + 1]
    assert b["stats"][0]["consumed_shared"] > 0
    shared = [s["order_epoch"] for s in a["stats"]].index(first)
    assert a["ids"][shared] == b["ids"][0]


def _member_signalling(root, group, epochs, kw, q, progress, enrolled):
    """Member A: stops in the middle of its first epoch until B has joined the group's passes, and
    trains STEP_S a batch, as B does, so that B shares batches A's producer made."""

    def body():
        out = {"ids": [], "stats": []}
        with _loader(root, hp_group=group, **kw) as loader:
            for e in range(epochs):
                loader.set_epoch(e)
                ids = []
                for k, (_, _, i) in enumerate(loader):
                    ids.append(i.tolist())
                    if e == 0 and k == 10:
                        progress.set()
                        assert enrolled.wait(WAIT)  # B has joined, in the middle of A's epoch
                    time.sleep(STEP_S)  # the training step
                out["ids"].append(ids)
                out["stats"].append(loader.stats())
        return out

    report(q, body)


# -- configuration ------------------------------------------------------------------------
def test_a_member_with_another_configuration_is_refused(tiny_dataset, isolated):
    with _loader(str(tiny_dataset), hp_group="cfg") as first:
        next(iter(first))
        for kw, message in (
            ({"shuffle": False}, "shuffle: the group has True, this job has False"),
            ({"seed": 3}, "seed"),
        ):
            other = _loader(str(tiny_dataset), hp_group="cfg", **kw)
            try:
                with pytest.raises(GroupConfigError, match=message):
                    next(iter(other))
            finally:
                other.close()
        ok = _loader(str(tiny_dataset), hp_group="another-name", shuffle=False)
        try:
            next(iter(ok))  # a different name is a different group
        finally:
            ok.close()


def test_bad_arguments_are_refused(tiny_dataset):
    with pytest.raises(ValueError, match="hp_group"):
        CoordLoader(str(tiny_dataset), hp_group="", shuffle=True, pipeline="imagenet-train")
    with pytest.raises(ValueError, match=r"HPGroup\(staging=1000\) holds 0 batch"):
        loader = _loader(str(tiny_dataset), hp_group=coordl.HPGroup("small", staging=1000))
        try:
            next(iter(loader))
        finally:
            loader.close()


# -- cleanup ------------------------------------------------------------------------------
def test_members_that_all_die_leave_nothing_the_next_start_does_not_clean(tiny_dataset, isolated, procs):
    start, q, progress = CTX.Barrier(2), CTX.Queue(), CTX.Event()
    ps = [procs(_member, str(tiny_dataset), "dies", 1, {}, start, q, 0.0, progress, 3) for _ in range(2)]
    assert progress.wait(WAIT)
    for p in ps:
        os.kill(p.pid, signal.SIGKILL)
        p.join(WAIT)
    assert any(".stage" in e for e in os.listdir(isolated))  # left behind by the dead
    with _loader(str(tiny_dataset), hp_group="dies") as loader:  # the next start cleans up
        assert sorted(i for _, _, b in loader for i in b.tolist()) == list(range(N))
        kinds = {names.parse_name(e)[1] for e in os.listdir(isolated)}
        assert "stage" in kinds
    assert os.listdir(isolated) == []


# -- resume, formats ----------------------------------------------------------------------
def test_resuming_mid_epoch_finishes_that_epoch_then_joins_the_group(tiny_dataset, isolated):
    with _loader(str(tiny_dataset), hp_group="resume") as loader:
        it = iter(loader)
        first = [next(it)[2].tolist() for _ in range(5)]
        state = loader.state_dict()
    with _loader(str(tiny_dataset), hp_group="resume") as loader:
        loader.load_state_dict(state)
        rest = [i.tolist() for _, _, i in loader]
        assert sorted(_flat(first + rest)) == list(range(N))
        nxt = [i.tolist() for _, _, i in loader]  # the next epoch comes from the group
        assert sorted(_flat(nxt)) == list(range(N))
        assert loader.stats()["hp_members"] == 1


def test_uint8_staging_normalised_by_the_consumer_matches_the_pipeline(tiny_dataset, isolated, monkeypatch):
    val = ImageNetVal(size=16, resize=20)  # deterministic, so both ways must agree
    with _loader(str(tiny_dataset), pipeline=val, shuffle=False) as plain:
        want = [x for x, _, _ in plain]
    monkeypatch.setenv("COORDL_HP_STAGE_UINT8", "1")
    with _loader(str(tiny_dataset), pipeline=val, shuffle=False, hp_group="u8") as grouped:
        got = [x for x, _, _ in grouped]
        assert grouped.stats()["staging_bound"] <= 16 * 8 * 3 * 16 * 16 + 16 * 4096  # one byte per value
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == torch.float32 and g.shape == w.shape
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-5)


# -- the example ---------------------------------------------------------------------------
def test_the_hpsearch_example_runs_trials_that_share(tiny_dataset, isolated):
    import subprocess
    import sys
    from pathlib import Path

    launch = Path(__file__).resolve().parents[1] / "examples" / "hpsearch" / "launch.py"
    run = subprocess.run(
        [
            sys.executable,
            str(launch),
            str(tiny_dataset),
            "--lrs",
            "0.1,0.01",
            "--epochs",
            "1",
            "--group",
            "example-test",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    lines = [ln for ln in run.stdout.splitlines() if "epoch 0" in ln]
    assert len(lines) == 2 and all("batches made by other trials" in ln for ln in lines), run.stdout
    assert "2 trials sharing hp_group 'example-test'" in run.stdout


def _switching_in(path: str):
    """A trace function that hands the GIL to another thread before every bytecode of the code in
    ``path``: the interleavings a free-threaded build (or any preemption between bytecodes) allows,
    which CPython 3.11's GIL otherwise rarely shows within one line."""

    def local(frame, event, arg):
        if event == "opcode":
            time.sleep(0.0001)
        return local

    def tracer(frame, event, arg):
        if frame.f_code.co_filename != path:
            return None
        frame.f_trace_opcodes = True
        return local

    return tracer


def test_producers_writing_at_once_count_every_batch_they_made(tiny_dataset, isolated):
    """A member's producers (its own pipeline's and its Ray actors') publish from threads of their
    own: each batch written is counted once in ``member.produced`` (and the pass's ``produced``),
    whatever the threads' interleaving."""
    import coordl.staging.member as member_module

    with CoordLoader(
        str(tiny_dataset), batch_size=8, pipeline=RECIPE, device_id=None, hp_group="count", cache=1.0, prep=1
    ) as loader:
        for _ in loader:
            pass
        member = loader._member
        producer = member.producers[0]
        area = member.area
        claims = []
        while (c := area.claim(block=False)) is not None:
            claims.append(c)
        assert len(claims) >= 4, "the ring has room for several batches"
        n = area.unit
        images = torch.zeros((n, *area.sample_shape), dtype=getattr(torch, area.dtype))
        labels, ids = torch.zeros(n, dtype=torch.int64), torch.arange(n, dtype=torch.int64)
        before = member.produced
        go = threading.Barrier(len(claims))

        def write(c):
            sys.settrace(_switching_in(member_module.__file__))
            go.wait()
            producer.write(c, images, labels, ids)

        writers = [threading.Thread(target=write, args=(c,)) for c in claims]
        for t in writers:
            t.start()
        for t in writers:
            t.join(WAIT)
        assert member.produced - before == len(claims)  # none lost to another thread's update
