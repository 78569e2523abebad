"""SIGTERM at any moment (what Kubernetes, Slurm and torchrun send first) ends a script by SIGTERM
within 2 s, with no traceback, and never hangs: coordl's handler parks the main thread, wherever it
was (inside one of coordl's locks included), and closes the loaders on a thread of its own, with a
deadline. Scripts run as users run them, in subprocesses; their exit status, stderr and what they
leave in shared memory are checked."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
N = 120  # samples in tiny_dataset
BOUND_S = 2.0  # the bound: from SIGTERM to the process's end
ROUNDS = 16

TRIAL = """
import json, sys, time
import coordl
root, group, epochs, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
record = []
with coordl.CoordLoader(root, batch_size=8, pipeline=coordl.ImageNetTrain(size=16), device_id=None, shuffle=True,
                        hp_group=group, prep=1, return_index=True, seed=4) as loader:
    print("ready", flush=True)
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        ids = []
        for x, _, i in loader:
            ids += i.tolist()
            time.sleep(0.01)  # the training step
        record.append(ids)
with open(out, "w") as f:
    json.dump(record, f)
"""

# SIGTERM while the main thread is inside the staging area's lock, every time: the script sends it
# to itself from inside the lock (the handler runs at the next bytecode, the lock still held), at
# the AFTER-th time the main thread enters it. The handler used to close the loaders there and
# wait for that lock forever.
IN_THE_LOCK = """
import os, signal, sys, threading
import coordl
from coordl.staging import ring
root, group, after = sys.argv[1], sys.argv[2], int(sys.argv[3])
enter, entered = ring.Mutex.__enter__, [0]
def inside(self):
    held = enter(self)
    if threading.current_thread() is threading.main_thread():
        entered[0] += 1
        if entered[0] == after:
            os.kill(os.getpid(), signal.SIGTERM)
            sum(range(1000))  # the handler runs in here, the lock held
    return held
ring.Mutex.__enter__ = inside
with coordl.CoordLoader(root, batch_size=8, pipeline=coordl.ImageNetTrain(size=16), device_id=None,
                        hp_group=group, prep=1, seed=4) as loader:
    for epoch in range(1000):
        for x, _ in loader:
            pass
"""

# A trial stopped by SIGTERM in the middle of an edit of the group's shared records, inside the
# group's mutex: a trace function of the main thread's sends the signal at the AFTER-th time the
# main thread is about to run LINE of FUNC (in the module whose file ends with FILE); the handler
# runs at once, in there, so the edit is left half done. Then it waits, ready, for the go on stdin.
MID_EDIT = """
import linecache, os, signal, sys, time
import coordl
root, group, file, func, line, after = sys.argv[1:6] + [int(sys.argv[6])]
hits = [0]
def local(frame, event, arg):
    if event == "line" and linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip() == line:
        hits[0] += 1
        if hits[0] == after:
            print("signalled", flush=True)
            os.kill(os.getpid(), signal.SIGTERM)
            sum(range(1000))  # the handler runs in here: the main thread stops before LINE
    return local
def calls(frame, event, arg):
    code = frame.f_code
    return local if code.co_name == func and code.co_filename.endswith(file) else None
with coordl.CoordLoader(root, batch_size=8, pipeline=coordl.ImageNetTrain(size=16), device_id=None, shuffle=True,
                        hp_group=group, prep=1, return_index=True, seed=4) as loader:
    print("ready", flush=True)
    sys.stdin.readline()
    sys.settrace(calls)
    for epoch in range(1000):
        loader.set_epoch(epoch)
        for x, _, i in loader:
            time.sleep(0.01)
"""

# Its trial partner: EPOCHS epochs from the go on stdin, each sample's id as delivered.
PARTNER = """
import json, sys, time
import coordl
root, group, epochs, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
record = []
with coordl.CoordLoader(root, batch_size=8, pipeline=coordl.ImageNetTrain(size=16), device_id=None, shuffle=True,
                        hp_group=group, prep=1, return_index=True, seed=4) as loader:
    print("ready", flush=True)
    sys.stdin.readline()
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        ids = []
        for x, _, i in loader:
            ids += i.tolist()
            time.sleep(0.02)  # the training step
        record.append(ids)
with open(out, "w") as f:
    json.dump(record, f)
"""

BAD = ("Traceback", "terminate called", "Exception ignored", "Fatal Python error")


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE.parent / "src"), os.environ.get("PYTHONPATH", "")]))


def _start(root, group: str, epochs: int, out: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", TRIAL, str(root), group, str(epochs), str(out)],
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_sigterm_at_a_random_moment_ends_one_trial_of_a_group_within_2_s_and_the_other_goes_on(
    tiny_dataset, tmp_path, isolated
):
    rng = random.Random(7)
    for k in range(ROUNDS):
        # The victim has more epochs than it can finish before the signal, however fast the machine.
        victim = _start(tiny_dataset, f"sig{k}", 1000, tmp_path / f"victim{k}.json")
        survivor = _start(tiny_dataset, f"sig{k}", 2, tmp_path / f"survivor{k}.json")
        try:
            for p in (victim, survivor):
                assert p.stdout.readline().strip() == "ready", p.stderr.read()
            time.sleep(rng.uniform(0.0, 1.5))  # anywhere in the first epochs: inside coordl or the step
            t0 = time.monotonic()
            victim.send_signal(signal.SIGTERM)
            victim.wait(timeout=30)
            took = time.monotonic() - t0
            err = victim.stderr.read()
            assert victim.returncode == -signal.SIGTERM, f"round {k}: exit status {victim.returncode}\n{err}"
            assert took < BOUND_S, f"round {k}: ended {took:.2f} s after SIGTERM"
            assert not any(b in err for b in BAD), f"round {k}:\n{err}"
            survivor.wait(timeout=120)
            err = survivor.stderr.read()
            assert survivor.returncode == 0 and not any(b in err for b in BAD), f"round {k}:\n{err}"
        finally:
            for p in (victim, survivor):
                if p.poll() is None:
                    p.kill()
                    p.wait()
        epochs = json.loads((tmp_path / f"survivor{k}.json").read_text())
        for ids in epochs:
            counts = Counter(ids)
            assert sorted(counts) == list(range(N)) and set(counts.values()) == {1}, f"round {k}: not exactly once"
        assert os.listdir(isolated) == [], f"round {k}: left in shared memory: {os.listdir(isolated)}"


def test_sigterm_inside_the_staging_areas_lock_ends_the_process(tiny_dataset, isolated):
    for after in (1, 2, 3, 20):  # 1: while the trial joins the group, in its first pass
        t0 = time.monotonic()
        p = subprocess.run(
            [sys.executable, "-c", IN_THE_LOCK, str(tiny_dataset), f"held{after}", str(after)],
            env=_env(),
            capture_output=True,
            text=True,
            timeout=60,
        )
        took = time.monotonic() - t0
        assert p.returncode == -signal.SIGTERM, f"entry {after}: exit status {p.returncode}\n{p.stderr}"
        assert not any(b in p.stderr for b in BAD), f"entry {after}:\n{p.stderr}"
        assert os.listdir(isolated) == [], f"entry {after}: left in shared memory: {os.listdir(isolated)}"
    assert took < 30  # the whole script, start included


# Where the main thread stops, each inside the group's mutex with a shared record half changed:
# its member record's cursor moved on and its count not (taking a batch); a slot emptied and the
# ring's released counter not moved (releasing); a slot's hold dropped from the process's table
# and its bit still set in the member record (releasing the slots of the batch before).
HALF_EDITS = {
    "take": ("staging/area.py", "take", 'me["consumed"] += 1', 5),
    "try_release": ("staging/ring.py", "try_release", 'h["released"] = q + 1', 3),
    "drop_hold": ("staging/holds.py", "_drop", 'me["held"] = int(me["held"]) & ~(1 << slot)', 4),
}


@pytest.mark.parametrize("where", HALF_EDITS)
def test_sigterm_inside_the_staging_lock_in_the_middle_of_an_edit_leaves_it_to_the_partner(
    tiny_dataset, tmp_path, isolated, where
):
    """The closing on SIGTERM edits none of the records the stopped main thread was changing: it
    gives the member up (its member lock), and the partner takes it back as it takes back a killed
    member (it logs that the member is gone, which it never does of a member that left), finishes
    every epoch with every sample once, and leaves nothing in shared memory."""
    file, func, line, after = HALF_EDITS[where]
    group = f"mid-{where}"
    victim = subprocess.Popen(
        [sys.executable, "-c", MID_EDIT, str(tiny_dataset), group, file, func, line, str(after)],
        env=_env(),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    out = tmp_path / "partner.json"
    partner = subprocess.Popen(
        [sys.executable, "-c", PARTNER, str(tiny_dataset), group, "4", str(out)],
        env=_env(),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        for p in (victim, partner):
            assert p.stdout.readline().strip() == "ready", p.stderr.read()
        for p in (victim, partner):
            p.stdin.write("go\n")
            p.stdin.flush()
        assert victim.stdout.readline().strip() == "signalled", victim.stderr.read()
        t0 = time.monotonic()
        victim.wait(timeout=30)
        took = time.monotonic() - t0
        err = victim.stderr.read()
        assert victim.returncode == -signal.SIGTERM, f"exit status {victim.returncode}\n{err}"
        assert took < BOUND_S, f"ended {took:.2f} s after SIGTERM"
        assert not any(b in err for b in BAD), err
        partner.wait(timeout=120)
        err = partner.stderr.read()
        assert partner.returncode == 0 and not any(b in err for b in BAD), err
    finally:
        for p in (victim, partner):
            if p.poll() is None:
                p.kill()
                p.wait()
            for f in (p.stdin, p.stdout, p.stderr):
                f.close()
    assert f"(pid {victim.pid}) is gone" in err, f"the partner did not take the member back as a dead one:\n{err}"
    epochs = json.loads(out.read_text())
    assert len(epochs) == 4
    for ids in epochs:
        counts = Counter(ids)
        assert sorted(counts) == list(range(N)) and set(counts.values()) == {1}, "not exactly once"
    assert os.listdir(isolated) == [], f"left in shared memory: {os.listdir(isolated)}"
