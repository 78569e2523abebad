"""examples/hpsearch/: launch.py's trials share one hp_group, and halving.py's group survives a
trial killed with SIGKILL and takes in the trial started in its place.

Real processes on a tiny generated dataset; the trials inherit the test's private shm folder
(``COORDL_SHM_DIR``), which must be empty when the scripts have exited.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from coordl.tools.datagen import make_dataset

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "hpsearch"
EPOCHS = 8  # of each halving trial
FAST = ["--size", "32", "--batch-size", "16"]  # small crops and batches: seconds per trial
# halving.py's summary row: "  12.0s t2      0.01  finished            3/3    1.456   26%  20/24 7/24 0/24"
SUMMARY_ROW = r"^ *[\d.]+s (t\d+) +\S+  (finished|killed in round \d+|failed \(exit -?\d+\)) +(\d+)/\d+ "


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """384 small JPEGs in 4 classes: 24 batches of 16 per epoch."""
    root = tmp_path_factory.mktemp("hpsearch") / "train"
    make_dataset(root, num_images=384, num_classes=4, size=(64, 56), progress=False)
    return root


def _run(script: str, *args: str, timeout: float) -> subprocess.CompletedProcess:
    """Runs an example in a process group of its own, killed with everything it started on a timeout."""
    cmd = [sys.executable, str(EXAMPLE / script), *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{script} did not finish in {timeout} s:\n{out}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, "")


def _reports(out: str) -> list[dict]:
    return [json.loads(line) for line in out.splitlines() if line.startswith('{"event": "epoch"')]


def test_launch_trials_share_one_group(data, isolated):
    p = _run("launch.py", str(data), "--lrs", "0.1,0.02", "--epochs", "2", *FAST, timeout=120)
    assert p.returncode == 0, p.stdout
    reports = _reports(p.stdout)
    for lr in (0.1, 0.02):
        epochs = sorted(r["epoch"] for r in reports if r["lr"] == lr)
        assert epochs == [0, 1], f"lr {lr} reported epochs {epochs}:\n{p.stdout}"
        assert sum(f"lr={lr:g} epoch" in line for line in p.stdout.splitlines()) == 2  # the lines for people
    assert all(r["batches"] == 24 for r in reports)
    # Trials that start together share batches: one made some of the other's.
    assert sum(r["consumed_shared"] for r in reports) > 0, p.stdout
    assert "sharing hp_group 'lr-sweep'" in p.stdout
    assert os.listdir(isolated) == []


def test_halving_kills_the_worst_trial_and_the_group_goes_on(data, isolated):
    # Enough epochs that a round ends while every trial still trains, however far apart the trials
    # started (each imports torch and DALI on 2 shared cores; an epoch here takes 0.3 s).
    p = _run(
        "halving.py",
        str(data),
        "--trials",
        "3",
        "--rounds",
        "1",
        "--epochs",
        str(EPOCHS),
        "--lrs",
        "0.3,0.05,0.01",
        *FAST,
        "--timeout",
        "150",
        timeout=180,
    )
    out = p.stdout
    assert p.returncode == 0, out
    killed = re.search(r"round 1: killed (t\d) \(lr [\d.e-]+, pid \d+\) with SIGKILL after (\d) epoch", out)
    assert killed, out
    assert "round 1: started t3: lr " in out, out
    assert "no more rounds" not in out  # one round was asked for, and held
    # The summary: one row per trial, its fate and the epochs it completed.
    rows = {m[1]: (m[2], m[3]) for m in re.finditer(SUMMARY_ROW, out, re.M)}
    fate, epochs = rows.pop(killed[1])
    assert fate == "killed in round 1" and int(epochs) >= int(killed[2]), out  # a last report may follow the kill
    # Every other trial trained all its epochs: the survivors and the newcomer.
    assert rows == {t: ("finished", str(EPOCHS)) for t in ("t0", "t1", "t2", "t3") if t != killed[1]}, out
    # The killed trial's part of the group was reclaimed: nothing is left in the shm folder.
    assert os.listdir(isolated) == []
