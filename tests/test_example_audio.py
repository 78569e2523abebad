"""examples/audio/: train.py generates two sets of tones, trains M5 on them with coordl's audio
recipes, prints one line per epoch; its loss falls and it tells the tones apart well above
chance. M5's shapes and its shortest input are checked on random waveforms.

The script runs as users run it, in a process of its own, which inherits the test's private shm
folder (``COORDL_SHM_DIR``): it must leave nothing there.
"""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "audio"
EPOCH = re.compile(
    r"^epoch (\d+)/(\d+): train loss ([\d.]+), (\d+) batches, .*\| val loss [\d.]+, accuracy ([\d.]+)% "
    r"\((\d+)/(\d+) clips\)$",
    re.M,
)
STALLS = re.compile(r"waited for data [\d.]+ s \(\d+%\): fetch [\d.]+ s, prep [\d.]+ s; storage [\d.]+ MB in \d+ reads")


def test_train_generates_tones_prints_every_epoch_and_learns_them(tmp_path):
    data = tmp_path / "tones"
    args = ["--data", str(data), "--per-class", "8", "--val-per-class", "6", "--epochs", "4", "-b", "8"]
    p = subprocess.run(
        [sys.executable, str(EXAMPLE / "train.py"), *args, "--threads", "2", "--seed", "1"],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    out = p.stdout
    for split, n in (("train", 8), ("val", 6)):
        folders = sorted(f for f in (data / split).iterdir() if f.is_dir())
        assert len(folders) == 4, folders
        assert all(len([c for c in f.iterdir() if c.is_file()]) == n for f in folders), folders
    assert "=> M5 (n_channel 32)" in out and "32 training clips, 24 validation clips" in out, out
    assert "windows of 16000 samples at 8000 Hz (2 s)" in out, out
    epochs = EPOCH.findall(out)
    assert [(int(e[0]), int(e[1]), int(e[3])) for e in epochs] == [(e, 4, 4) for e in range(1, 5)], out
    assert all(int(e[6]) == 24 for e in epochs), out  # every validation clip, every epoch
    for line in EPOCH.finditer(out):
        assert STALLS.search(line.group(0)), line.group(0)
    losses = [float(e[2]) for e in epochs]
    assert losses[-1] < losses[0], out
    # Four classes: chance is 25%. The run is deterministic (seeded model, order and windows), and
    # seeds 1 to 5 all end at 100% here; 75% leaves room for another DALI resampler or torch.
    assert float(epochs[-1][4]) >= 75.0, out


def test_a_generated_set_is_used_again_and_a_foreign_one_left_as_it_is(tmp_path):
    """make_tones' training set (same arguments) is found, not made again; a validation set that
    make_tones did not make (no manifest, as clips of one's own) is used as it is, although
    ``--val-per-class`` asks for another size. The same run, one trial of an ``hp_group`` with no
    cache, gives the same windows and so the same loss as a run alone."""
    from coordl.tools.datagen.audioset import MANIFEST
    from coordl.tools.datagen.tones import make_tones

    data = tmp_path / "tones"
    make_tones(data / "train", classes=4, per_class=4, seed=0)
    make_tones(data / "val", classes=4, per_class=2, seed=1)
    (data / "val" / MANIFEST).unlink()
    files = {p: p.stat().st_mtime_ns for p in data.rglob("*") if p.is_file()}
    cmd = [sys.executable, str(EXAMPLE / "train.py"), "--data", str(data), "--per-class", "4", "--val-per-class", "3"]
    runs = []
    for extra in ([], ["--hp-group", "audio-example", "--cache", "0"]):
        p = subprocess.run([*cmd, "--epochs", "1", "-b", "8", *extra], capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, p.stdout + p.stderr
        assert "=> made" not in p.stdout and "16 training clips, 8 validation clips" in p.stdout, p.stdout
        runs.append(EPOCH.findall(p.stdout))
        assert len(runs[-1]) == 1 and runs[-1][0][6] == "8", p.stdout
    assert runs[0][0][2] == runs[1][0][2]  # the training loss, to the last digit
    assert {p: p.stat().st_mtime_ns for p in data.rglob("*") if p.is_file()} == files


def test_a_window_too_short_for_m5_is_refused_before_anything_is_made(tmp_path):
    data = tmp_path / "tones"
    p = subprocess.run(
        [sys.executable, str(EXAMPLE / "train.py"), "--data", str(data), "--samples", "1000"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 2, p.stdout + p.stderr
    assert "--samples 1000 is too short for M5's four pools: it needs at least 1772" in p.stderr, p.stderr
    assert not data.exists()


@pytest.fixture(scope="module")
def model():
    """The example's model module, imported from its folder as train.py does."""
    saved = sys.modules.pop("model", None)
    sys.path.insert(0, str(EXAMPLE))
    try:
        yield importlib.import_module("model")
    finally:
        sys.path.remove(str(EXAMPLE))
        sys.modules.pop("model", None)
        if saved is not None:
            sys.modules["model"] = saved


def test_m5_gives_logits_per_clip_from_its_shortest_input_on(model):
    torch.manual_seed(0)
    net = model.M5(num_classes=5)
    assert net.min_samples == 1772
    assert sum(p.numel() for p in net.parameters()) < 30_000  # n_channel 32: small enough for a CPU
    assert net(torch.randn(3, 1, 16000)).shape == (3, 5)
    assert net(torch.randn(2, 1, net.min_samples)).shape == (2, 5)
    with pytest.raises(RuntimeError):
        net(torch.randn(2, 1, net.min_samples - 1))
    wide = model.M5(num_classes=5, n_channel=128, stride=16)
    assert wide.fc.in_features == 256 and wide(torch.randn(2, 1, wide.min_samples)).shape == (2, 5)
