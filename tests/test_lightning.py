"""PyTorch Lightning's DDP, on CPU, with CoordLoaders made at the top of the script.

Lightning's ``ddp`` strategy re-runs the script for every other rank (with ``LOCAL_RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT`` in the environment) and starts the process
group only inside ``Trainer.fit``. A loader made before that must still shard by the rank
the job ends up with, as a ``DataLoader`` does once Lightning gives it a
``DistributedSampler``.

What Lightning does with an iterable that is not a ``torch.utils.data.DataLoader``
(lightning 2.6, ``trainer/connectors/data_connector.py`` and ``loops/``): it uses it as it
is: no sampler is replaced (``use_distributed_sampler`` applies to DataLoaders only), so the
loader must shard itself. It calls ``iter(loader)`` once just to check that it is iterable
(and drops that iterator), ``len(loader)`` on every rank (summed with a collective), and
stops an epoch after ``len(loader)`` batches without asking for one more, so the loader's
iterator never raises ``StopIteration`` under Lightning. Through ``hasattr``/``getattr`` it
reads ``loader.dataset`` (an ``IterableDataset``?), ``loader.sampler`` and then
``loader.batch_sampler`` (and ``batch_sampler.sampler``) to tell whether a validation loader
shuffles, calls ``loader.sampler.set_epoch(epoch)`` (and ``batch_sampler.sampler.set_epoch``)
before every training and validation epoch, and with ``seed_everything(workers=True)``
sets ``loader.worker_init_fn`` when that attribute exists and is None.
"""

from __future__ import annotations

import collections
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from childproc import group_members
from conftest import make_tree

pytest.importorskip("lightning")

CLASSES, PER_CLASS = 3, 17
N = CLASSES * PER_CLASS  # 51: odd, so DistributedSampler-style padding adds one sample per epoch
WORLD = 2
EPOCHS = 2
TIMEOUT = 240  # a DDP job whose ranks disagree on the number of steps may hang in a collective

SCRIPT = """
import json, os, sys

import torch
import lightning as L

import coordl

ROOT, OUT = sys.argv[1], sys.argv[2]

# Made at the top, before the Trainer: Lightning starts the process group inside fit().
train_loader = coordl.CoordLoader(ROOT, batch_size=8, pipeline=coordl.ImageNetTrain(size=16),
                                  return_index=True, cache="4MB", shuffle=True)
val_loader = coordl.CoordLoader(ROOT, batch_size=8, pipeline=coordl.ImageNetVal(size=16, resize=18),
                                shuffle=False, return_index=True, cache="4MB")


class Tiny(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(3 * 16 * 16, 3)
        self.seen = {"train": {}, "val": {}}

    def record(self, stage, ids):
        self.seen[stage].setdefault(str(self.current_epoch), []).extend(int(i) for i in ids)

    def training_step(self, batch, batch_idx):
        x, y, ids = batch
        self.record("train", ids)
        return torch.nn.functional.cross_entropy(self.fc(x.flatten(1).float()), y.long())

    def validation_step(self, batch, batch_idx):
        x, y, ids = batch
        if not self.trainer.sanity_checking:  # the sanity check peeks at 2 batches, then breaks
            self.record("val", ids)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        return train_loader

    def val_dataloader(self):
        return val_loader


model = Tiny()
trainer = L.Trainer(accelerator="cpu", strategy="ddp", devices=2, max_epochs=2, logger=False,
                    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
trainer.fit(model)
with open(os.path.join(OUT, f"rank{trainer.global_rank}.json"), "w") as f:
    json.dump({"rank": trainer.global_rank, "world_size": trainer.world_size,
               "len_train": len(train_loader), "len_val": len(val_loader), **model.seen}, f)
# Rank 0 started the other rank (Lightning keeps its Popen in a private attribute: when that
# changes, the test goes by rank 1's stderr and its "done" line alone).
procs = getattr(getattr(trainer.strategy, "_launcher", None), "procs", None)
if trainer.global_rank == 0:
    for p in procs or []:
        print("other-rank-exit", p.wait(timeout=120), flush=True)
    if not procs:
        print("other-rank-exit unknown", flush=True)
print(f"rank{trainer.global_rank}-done", flush=True)
"""

FORBIDDEN = [
    "Traceback",
    "terminate called",
    "Exception ignored",
    "AssertionError",
    "nvidia/dali",
    "leaked",
    "core dumped",
    "Segmentation fault",
]


@dataclass
class Job:
    rc: int
    out: str
    err: str
    ranks: dict[int, dict]
    shm_left: list[str]
    procs_left: list[str]
    hung: bool


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> Job:
    """Runs the DDP job once for the module's tests (in its own shm folder and session)."""
    base = tmp_path_factory.mktemp("lightning")
    root = make_tree(base / "train", classes=CLASSES, per_class=PER_CLASS, varied=False)
    out = base / "out"
    out.mkdir()
    script = base / "train_lightning.py"
    script.write_text(textwrap.dedent(SCRIPT))
    shm = Path(tempfile.mkdtemp(prefix="coordl-test-", dir="/dev/shm"))
    env = {
        k: v
        for k, v in os.environ.items()
        if k
        not in (
            "RANK",
            "WORLD_SIZE",
            "LOCAL_RANK",
            "LOCAL_WORLD_SIZE",
            "MASTER_ADDR",
            "MASTER_PORT",
            "NODE_RANK",
            "GROUP_RANK",
            "COORDL_LOG_EPOCHS",
        )
    }
    env.update(COORDL_SHM_DIR=str(shm), COORDL_INDEX_DIR=str(base / "index"), PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [sys.executable, str(script), str(root), str(out)],
        cwd=base,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    hung = False
    try:
        stdout, stderr = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        hung = True
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
    deadline = time.monotonic() + 10
    while (procs := group_members(proc.pid)) and time.monotonic() < deadline:
        time.sleep(0.1)
    if procs:
        os.killpg(proc.pid, signal.SIGKILL)
    deadline = time.monotonic() + 2
    while (left := sorted(os.listdir(shm))) and time.monotonic() < deadline:
        time.sleep(0.05)
    shutil.rmtree(shm, ignore_errors=True)
    ranks = {}
    for f in out.glob("rank*.json"):
        data = json.loads(f.read_text())
        ranks[data["rank"]] = data
    return Job(proc.returncode, stdout, stderr.replace(str(base), "<tmp>"), ranks, left, procs, hung)


def _context(job: Job) -> str:
    err = job.err if len(job.err) < 8000 else job.err[:3000] + "\n[...]\n" + job.err[-5000:]
    return f"\n--- stdout:\n{job.out[-3000:]}\n--- stderr:\n{err}"


def _summary(ranks: dict[int, dict]) -> str:
    """What each rank that finished reports: its world, its loaders' lengths, what it saw."""
    lines = []
    for r, d in sorted(ranks.items()):
        seen = {stage: {e: len(ids) for e, ids in d[stage].items()} for stage in ("train", "val")}
        lines.append(
            f"rank {r}: trainer world_size {d['world_size']}, len(train_loader) {d['len_train']}, "
            f"len(val_loader) {d['len_val']}, samples per epoch {seen}, "
            f"val ids of epoch 0: {d['val'].get('0', [])[:10]}..."
        )
    return "\n  ".join(lines)


def _ranks(job: Job) -> dict[int, dict]:
    if sorted(job.ranks) != list(range(WORLD)):
        pytest.fail(
            f"the job wrote results for ranks {sorted(job.ranks)}, not 0..{WORLD - 1} (hung: {job.hung}, "
            f"exit status {job.rc})\n  {_summary(job.ranks)}{_context(job)}",
            pytrace=False,
        )
    return job.ranks


def _shard_problems(job: Job, stage: str) -> list[str]:
    """Each rank's ids of each epoch are a DistributedSampler shard of the whole dataset."""
    ranks = _ranks(job)
    per_rank = math.ceil(N / WORLD)
    problems = []
    for epoch in map(str, range(EPOCHS)):
        ids = {r: ranks[r][stage].get(epoch, []) for r in range(WORLD)}
        for r, got in ids.items():
            if len(got) != per_rank:
                problems.append(f"epoch {epoch}: rank {r} saw {len(got)} samples, not ceil({N}/{WORLD}) = {per_rank}")
        counts = collections.Counter(i for got in ids.values() for i in got)
        missing = sorted(set(range(N)) - set(counts))
        extra = sum(counts.values()) - len(counts)
        if missing:
            problems.append(f"epoch {epoch}: {len(missing)} samples seen by no rank, e.g. {missing[:8]}")
        if extra != per_rank * WORLD - N:
            overlap = sorted(set(ids[0]) & set(ids[1]))
            problems.append(
                f"epoch {epoch}: {extra} repeated samples across ranks (padding allows "
                f"{per_rank * WORLD - N}); ranks 0 and 1 share {len(overlap)}, e.g. {overlap[:8]}"
            )
    return problems


def test_the_ddp_job_ends_cleanly(job):
    problems = []
    if job.hung:
        problems.append(f"the job hung (over {TIMEOUT} s) and was killed")
    elif job.rc != 0:
        problems.append(f"exit status {job.rc}")
    others = [line.split()[1] for line in job.out.splitlines() if line.startswith("other-rank-exit")]
    if others != ["0"] * (WORLD - 1) and others != ["unknown"]:
        problems.append(f"the other rank's exit status: {others or 'not reported'}")
    for r in range(WORLD):
        if f"rank{r}-done" not in job.out:
            problems.append(f"rank {r} did not reach the end of the script")
    problems += [f"stderr has {needle!r}" for needle in FORBIDDEN if needle in job.err]
    if job.shm_left:
        problems.append(f"shm segments left: {job.shm_left}")
    if job.procs_left:
        problems.append(f"processes outlived the job: {job.procs_left}")
    if problems:
        pytest.fail("\n  - ".join(["Lightning DDP job:", *problems]) + _context(job), pytrace=False)


def test_each_rank_trains_on_its_own_shard_every_epoch(job):
    problems = _shard_problems(job, "train")
    if problems:
        pytest.fail(
            "training under Lightning DDP:\n  - " + "\n  - ".join(problems) + "\n  " + _summary(job.ranks),
            pytrace=False,
        )


def test_each_rank_validates_its_own_shard_every_epoch(job):
    problems = _shard_problems(job, "val")
    if problems:
        pytest.fail(
            "validation under Lightning DDP:\n  - " + "\n  - ".join(problems) + "\n  " + _summary(job.ranks),
            pytrace=False,
        )


def test_training_is_reshuffled_every_epoch(job):
    """Lightning never exhausts a sized loader's iterator (it stops after ``len(loader)``
    batches) and calls ``sampler.set_epoch``: every rank's second epoch must still come in the
    second epoch's order, as with a DistributedSampler. Checked on every rank that finished."""
    if not job.ranks:
        pytest.fail(f"no rank finished the job{_context(job)}", pytrace=False)
    same = [r for r, d in sorted(job.ranks.items()) if d["train"].get("0") == d["train"].get("1")]
    if same:
        pytest.fail(
            f"rank(s) {same} trained on epoch 0's order again in epoch 1: "
            f"{[job.ranks[r]['train'].get('1', [])[:10] for r in same]}...",
            pytrace=False,
        )
