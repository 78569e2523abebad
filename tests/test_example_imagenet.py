"""examples/imagenet/train.py, run as users run it: one short CPU epoch per loader, resume
mid-epoch after SIGTERM and after ``kill -9``, evaluation, two ranks under torchrun, and one
checkpoint that resumes an interrupted epoch on 2, then 1, then 2 ranks."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from conftest import make_tree

TRAIN = Path(__file__).resolve().parents[1] / "examples" / "imagenet" / "train.py"
IMAGES = 48  # training images
BATCHES = 12  # at batch 4
FAST = ["-a", "resnet_tiny", "--image-size", "32", "-b", "4", "-j", "1", "--seed", "3"]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("imagenet")
    make_tree(root / "train", classes=4, per_class=12, seed=1)
    make_tree(root / "val", classes=4, per_class=5, seed=2)
    return root


def run(data: Path, ckpt: Path, *args: str, timeout: float = 120) -> str:
    p = subprocess.run(
        [sys.executable, str(TRAIN), str(data), *FAST, "--checkpoint-dir", str(ckpt), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    return p.stdout


def summaries(out: str) -> list[tuple[int, int, int]]:
    """(epoch, batches trained, first batch) of every epoch summary line."""
    return [
        (int(e), int(n), int(s))
        for e, n, s in re.findall(r"Epoch \[(\d+)\] summary: (\d+) batches from batch (\d+)", out)
    ]


def test_coordl_epoch_prints_stalls_and_accuracy_and_checkpoints_the_loader(data, tmp_path):
    out = run(data, tmp_path, "--epochs", "2", "--cache", "1.0")
    assert summaries(out) == [(0, BATCHES, 0), (1, BATCHES, 0)]
    lines = [line for line in out.splitlines() if "summary:" in line]
    # Epoch 0 reads every training byte from storage into the cache; epoch 1 reads none.
    assert re.search(r"storage [\d.]+ MB in 48 reads, cache hits 0 ", lines[0]), lines[0]
    assert re.search(r"storage 0\.0 MB in 0 reads, cache hits 48 ", lines[1]), lines[1]
    assert "waited for data" in lines[0] and "fetch" in lines[0] and "prep" in lines[0]
    assert len(re.findall(r"\* Acc@1 [\d.]+ Acc@5 [\d.]+ Loss [\d.]+ \(20 images\)", out)) == 2
    ckpt = torch.load(tmp_path / "checkpoint.pth.tar", weights_only=False)
    assert ckpt["epoch"] == 2 and not ckpt["mid_epoch"]
    assert ckpt["loader"]["epoch"] == 2 and ckpt["loader"]["batches"] == 0
    assert (tmp_path / "model_best.pth.tar").exists()


def test_torch_loader_runs_the_same_script(data, tmp_path):
    out = run(data, tmp_path, "--epochs", "1", "--loader", "torch")
    assert summaries(out) == [(0, BATCHES, 0)]
    assert "data: torch" in out and "(20 images)" in out
    assert torch.load(tmp_path / "checkpoint.pth.tar", weights_only=False)["loader"] is None


@pytest.mark.parametrize("flag", ["--save-every", "--log-samples"])
def test_save_every_and_log_samples_need_coordl(data, tmp_path, flag):
    p = subprocess.run(
        [sys.executable, str(TRAIN), str(data), "--loader", "torch", flag, "2"], capture_output=True, text=True
    )
    assert p.returncode == 2 and f"{flag} needs --loader coordl" in p.stderr


def test_missing_split_folder_is_explained(tmp_path):
    (tmp_path / "train").mkdir()
    p = subprocess.run([sys.executable, str(TRAIN), str(tmp_path)], capture_output=True, text=True)
    assert p.returncode != 0 and "must hold train/ and val/" in p.stderr


def _start(data: Path, ckpt: Path, *args: str, ranks: int = 1) -> subprocess.Popen:
    """The script with ``-p 1``, on ``ranks`` ranks (under torchrun when more than 1)."""
    launcher = [sys.executable]
    if ranks > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)]
    return subprocess.Popen(
        [*launcher, str(TRAIN), str(data), *FAST, "--checkpoint-dir", str(ckpt), "-p", "1", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )


def _rank0_worker(torchrun: int) -> int:
    """The pid of torchrun's worker of rank 0."""
    for task in Path(f"/proc/{torchrun}/task").iterdir():
        for pid in (task / "children").read_text().split():
            if b"RANK=0" in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                return int(pid)
    raise AssertionError(f"torchrun ({torchrun}) has no worker of rank 0")


def _interrupt(p: subprocess.Popen, after: str, ranks: int = 1) -> str:
    """Reads ``p``'s output until a line matches ``after``, then sends SIGTERM to rank 0 alone
    (the ranks agree to stop after the same batch); returns the output once ``p`` exited 0."""
    seen = []
    for line in p.stdout:
        seen.append(line)
        if re.match(after, line):
            os.kill(p.pid if ranks == 1 else _rank0_worker(p.pid), signal.SIGTERM)
            break
    seen += p.stdout.readlines()
    assert p.wait(60) == 0, "".join(seen)
    return "".join(seen)


def _trained(folder: Path, epoch: int) -> Counter:
    """How many times each sample was trained on in ``epoch``, over every --log-samples file."""
    seen = Counter()
    for path in folder.glob("rank*.jsonl"):
        for line in path.read_text().splitlines():
            batch = json.loads(line)
            if batch["epoch"] == epoch:
                seen.update(batch["ids"])
    return seen


def test_sigterm_saves_mid_epoch_and_resume_trains_exactly_the_rest(data, tmp_path):
    log = tmp_path / "samples"
    p = _start(data, tmp_path, "--epochs", "2", "--log-samples", str(log))
    seen = []
    for line in p.stdout:
        seen.append(line)
        if line.startswith("Epoch: [0][ 3/"):
            p.send_signal(signal.SIGTERM)
            break
    seen += p.stdout.readlines()
    assert p.wait(60) == 0, "".join(seen)
    first = "".join(seen)
    stopped = re.search(r"stopped by SIGTERM after batch (\d+) of epoch (\d+)", first)
    assert stopped, first
    k, epoch = int(stopped[1]), int(stopped[2])
    out = run(
        data, tmp_path, "--epochs", "2", "--log-samples", str(log), "--resume", str(tmp_path / "checkpoint.pth.tar")
    )
    done = summaries(first) + summaries(out)
    # Every epoch's batches are trained exactly once over the two runs.
    per_epoch = {e: 0 for e in range(2)}
    for e, n, _ in done:
        per_epoch[e] += n
    assert per_epoch == {0: BATCHES, 1: BATCHES}, done
    if 0 < k < BATCHES:
        assert f"resuming epoch {epoch} at batch {k} of {BATCHES}" in out
        assert (epoch, BATCHES - k, k) in summaries(out)
    # And every sample of each epoch exactly once.
    for e in range(2):
        assert _trained(log, e) == Counter(range(IMAGES)), e


def test_kill_9_resumes_from_the_last_save_every_checkpoint(data, tmp_path):
    p = _start(data, tmp_path, "--epochs", "1", "--save-every", "3")
    seen = []
    for line in p.stdout:
        seen.append(line)
        if re.search(r"saved .* \(epoch 0, batch 6\)", line):
            p.kill()  # kill -9 right after a mid-epoch checkpoint
            break
    p.wait(30)
    assert p.returncode == -signal.SIGKILL, "".join(seen)
    ckpt = torch.load(tmp_path / "checkpoint.pth.tar", weights_only=False)
    assert ckpt["mid_epoch"] and ckpt["epoch"] == 0
    saved = ckpt["loader"]["batches"]
    assert saved in (6, 9)  # the kill may land after the next save
    out = run(data, tmp_path, "--epochs", "1", "--resume", str(tmp_path / "checkpoint.pth.tar"))
    assert f"resuming epoch 0 at batch {saved} of {BATCHES}" in out
    assert summaries(out) == [(0, BATCHES - saved, saved)]


def test_evaluate_loads_the_checkpoint_and_only_validates(data, tmp_path):
    run(data, tmp_path, "--epochs", "1")
    out = run(data, tmp_path, "--evaluate", "--resume", str(tmp_path / "checkpoint.pth.tar"))
    assert "loaded checkpoint" in out and "(20 images)" in out and "summary" not in out


def test_two_ranks_under_torchrun_count_every_validation_image_once(data, tmp_path):
    # 20 validation images over 2 ranks at batch 4: the shards are padded to 12 each; the
    # accuracy must still be over exactly 20 images.
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            str(TRAIN),
            str(data),
            *FAST,
            "--epochs",
            "1",
            "--cache",
            "1.0",
            "--checkpoint-dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    assert "2 rank(s)" in p.stdout
    assert summaries(p.stdout) == [(0, BATCHES // 2, 0)]
    assert re.search(r"storage [\d.]+ MB in 48 reads", p.stdout), p.stdout  # the two shards add up to the dataset
    assert "(20 images)" in p.stdout
    ckpt = torch.load(tmp_path / "checkpoint.pth.tar", weights_only=False)
    assert isinstance(ckpt["loader"], dict) and "rank" not in ckpt["loader"]  # one state, for every rank
    assert ckpt["loader"]["world_size"] == 2 and (ckpt["loader"]["epoch"], ckpt["loader"]["batches"]) == (1, 0)


def _loader_state(folder: Path) -> dict:
    """The loader state of a mid-epoch checkpoint of epoch 0: one dict, rank 0's, with no rank."""
    ckpt = torch.load(folder / "checkpoint.pth.tar", weights_only=False)
    assert ckpt["mid_epoch"] and ckpt["epoch"] == 0
    state = ckpt["loader"]
    assert isinstance(state, dict) and "rank" not in state and state["epoch"] == 0, state
    return state


def test_one_checkpoint_resumes_an_epoch_on_the_same_or_another_number_of_ranks(data, tmp_path):
    """Epoch 0 runs on 2 ranks, is interrupted, resumes on 2 ranks, then on 1, then on 2 again,
    each time from rank 0's loader state alone. Every sample of the epoch is trained on exactly
    once (48 samples at batch 4 need no padding), and epoch 1 runs on 2 ranks."""
    log, ckpt = tmp_path / "samples", tmp_path / "ckpt"
    common = ["--epochs", "2", "--log-samples", str(log)]
    resume = ["--resume", str(ckpt / "checkpoint.pth.tar")]
    steps = [  # ranks, what the run says when it resumes, the checkpoint's world_size, batches, base
        (2, None, (2, 1, 0)),
        (2, "resuming epoch 0 at batch 1 of 6\n", (2, 2, 0)),  # 16 samples trained
        (1, "resuming epoch 0 at batch 0 of 8, which deal the 32 samples", (1, 1, 16)),
    ]
    trained = 0
    for ranks, resuming, position in steps:
        # SIGTERM before the first batch (at the model's line): the ranks stop after one batch.
        p = _start(data, ckpt, *common, *(resume if resuming else []), ranks=ranks)
        out = _interrupt(p, r"=> resnet_tiny", ranks)
        if resuming:
            assert resuming in out, out
        state = _loader_state(ckpt)
        assert (state["world_size"], state["batches"], state.get("base", 0)) == position, state
        trained += 4 * ranks
        assert len(_trained(log, 0)) == trained and set(_trained(log, 0).values()) == {1}
    assert "loaded checkpoint" in out and "(epoch 0, batch 2 on 2 rank(s))" in out, out  # the 1-rank run

    p = _start(data, ckpt, *common, *resume, ranks=2)  # the other 28 samples, 14 a rank
    out = p.communicate(timeout=120)[0]
    assert p.returncode == 0, out
    assert "resuming epoch 0 at batch 0 of 4, which deal the 28 samples" in out, out
    assert summaries(out) == [(0, 4, 0), (1, BATCHES // 2, 0)]
    for epoch in range(2):
        assert _trained(log, epoch) == Counter(range(IMAGES)), epoch
    assert sorted(path.name for path in log.iterdir()) == ["rank0.jsonl", "rank1.jsonl"]
