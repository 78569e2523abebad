"""Every feature on a GPU: decoding with nvJPEG and the tensors on the current device.

Each test here is marked ``gpu`` and skipped without CUDA ("needs an NVIDIA GPU"), so CI, which
has no GPU, pays nothing for them. The RayPrep trainer on a GPU is
``test_ray.py::test_a_gpu_trainer_gets_the_actors_batches_on_its_gpu``; the detection and audio
recipes have theirs in ``test_detection.py`` and ``test_audio.py``.

For developers: ``COORDL_GPU_TESTS_ON_CPU=1`` runs this file on a machine without a GPU, so that
its logic is checked where it is written. The device is then the CPU (``DEVICE`` is None, set in
this one place), the skip is lifted, and each CUDA-only assertion checks its CPU counterpart:
the batches on the CPU instead of ``cuda:0``, not pinned instead of pinned, the decoded tier used
instead of refused, the CPU decoder compared with itself (no difference) instead of with nvJPEG.
The spawned and launched scripts read the same variable. Run it as
``COORDL_GPU_TESTS_ON_CPU=1 python -m pytest tests/test_gpu.py``. It is not a user setting.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

import coordl
from childproc import report, result
from conftest import make_tree
from coordl import CoordLoader
from coordl.analyze.run import run_phase
from recording import take
from test_lifecycle import ends_as_without_coordl
from test_peers import _logs, _rank_logs, _records, _run_nodes

ON_CPU = os.environ.get("COORDL_GPU_TESTS_ON_CPU") == "1"
DEVICE = None if ON_CPU else 0  # the one place that says where these tests decode
ON_GPU = DEVICE is not None
WHERE = torch.device("cpu") if DEVICE is None else torch.device("cuda", DEVICE)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (ON_CPU or torch.cuda.is_available()), reason="needs an NVIDIA GPU"),
]

N = 120  # samples in tiny_dataset
BS = 8
SIZE = 32
RECIPE = coordl.ImageNetTrain(size=SIZE)
# nvJPEG (and the H100/H200's hardware decoder) against libjpeg-turbo, and DALI's GPU resize
# against its CPU resize: the same picture, not the same bits (IDCT rounding, chroma upsampling).
# Per image, the mean absolute difference of the normalised pixels (units of ImageNet's std,
# about 57 levels of 255) stays under 0.1, about 6 levels: test_detection.py's bound for the
# same two paths. A different crop window or flip of these images is several times further away.
PIXEL_TOL = 0.1
CTX = multiprocessing.get_context("spawn")


def _loader(data, **kw) -> CoordLoader:
    kw.setdefault("batch_size", BS)
    kw.setdefault("pipeline", RECIPE)
    kw.setdefault("device_id", DEVICE)
    kw.setdefault("prep", 2)
    kw.setdefault("shuffle", True)
    kw.setdefault("seed", 7)
    kw.setdefault("return_index", True)
    return CoordLoader(data, **kw)


def _distance(a: torch.Tensor, b: torch.Tensor) -> float:
    """Mean absolute difference of two images, on the CPU."""
    return float((a.detach().cpu().float() - b.detach().cpu().float()).abs().mean())


def _assert_same_pictures(got: dict, want: dict) -> None:
    """The same keys; on the CPU the same tensors bit for bit, on a GPU within PIXEL_TOL each (the
    GPU path promises its crop windows, not its bits, run after run: nvJPEG may give a batch's
    images to its hardware decoder or its CUDA one)."""
    assert got.keys() == want.keys()
    for key, image in got.items():
        if ON_GPU:
            assert _distance(image, want[key]) < PIXEL_TOL, f"{key}: the picture changed"
        else:
            assert torch.equal(image.cpu(), want[key].cpu()), f"{key} differs"


def _device_of(loader) -> torch.device:
    """Where ``loader``'s batches arrive."""
    return torch.device("cpu") if loader.device_id is None else torch.device("cuda", loader.device_id)


def _exactly_once(ids: list[int], n: int = N) -> None:
    counts = Counter(ids)
    assert sorted(counts) == list(range(n)) and set(counts.values()) == {1}, "not exactly once"


# -- decoding on the device, the cache's arithmetic -------------------------------------------------------
def test_every_epoch_is_exactly_once_on_the_device_and_later_epochs_read_only_the_uncached(tiny_dataset, isolated):
    """Three epochs on the device with half the dataset cached: every sample once an epoch, the
    batches float32 on the device (labels the index's), and the cache's arithmetic of the CPU path
    (test_cache.py): the first epoch reads everything, later ones exactly what the cache lacks."""
    index = coordl.Index.scan(tiny_dataset)
    total = index.total_bytes
    per_epoch = []
    with _loader(index, cache=0.5) as loader:
        assert loader.device_id == DEVICE
        for epoch in range(3):
            ids = []
            for images, labels, idx in loader:
                assert images.device == WHERE and images.dtype == torch.float32
                assert images.shape[1:] == (3, SIZE, SIZE)
                assert labels.tolist() == index.labels[idx.numpy()].tolist()
                ids += idx.tolist()
            _exactly_once(ids)
            s = loader.stats()
            assert s["epoch"] == epoch and s["samples"] == N
            assert s["cache_budget"] == int(0.5 * total) and 0 < s["cache_bytes"] <= s["cache_budget"]
            per_epoch.append(s)
    first = per_epoch[0]
    assert (first["storage_reads"], first["storage_bytes"], first["cache_hits"]) == (N, total, 0)
    assert first["admitted"] == first["cache_items"] > 0
    for s in per_epoch[1:]:
        assert s["cache_items"] == first["cache_items"] and s["cache_bytes"] == first["cache_bytes"]
        assert s["storage_reads"] == N - s["cache_items"] and s["storage_bytes"] == total - s["cache_bytes"]
        assert s["cache_hits"] == s["cache_items"] and s["admitted"] == 0


def test_device_id_auto_is_the_current_gpu_and_under_torchrun_the_local_rank_s(tiny_dataset, monkeypatch):
    """``device_id="auto"``: the current CUDA device; with ``LOCAL_RANK`` set, GPU
    ``LOCAL_RANK % GPUs``; without CUDA, the CPU. Its batches are those of the GPU named outright
    (the same samples in the same batches, on the same device)."""
    with _loader(tiny_dataset, cache=0) as given:
        want = [idx.tolist() for _, _, idx in given]
    expected = torch.cuda.current_device() if ON_GPU else None
    with _loader(tiny_dataset, cache=0, device_id="auto") as auto:
        assert auto.device_id == expected
        got = []
        for images, _, idx in auto:
            assert images.device == _device_of(auto)
            got.append(idx.tolist())
    assert got == want
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with _loader(tiny_dataset, cache=0, device_id="auto") as ranked:
        assert ranked.device_id == (1 % torch.cuda.device_count() if ON_GPU else None)
        images, _, _ = next(iter(ranked))
        assert images.is_cuda == ON_GPU


@pytest.mark.parametrize("device", ["given", "auto"])
def test_two_ranks_under_torchrun_on_one_gpu_deliver_every_sample_once(tiny_dataset, tmp_path, device):
    """torchrun with two ranks on one node (tests/multinode_train.py), both on GPU 0 (``device_id=0``)
    or on ``"auto"``'s choice (``LOCAL_RANK % GPUs``: GPU 0 for both on a one-GPU machine): every
    epoch exactly once across the ranks, each rank's batches on its device, the node's one cache
    shared (every item admitted once, by one rank), a clean exit and nothing left in shm."""
    arg = ("none" if DEVICE is None else str(DEVICE)) if device == "given" else "auto"
    out, left = tmp_path / "out", []
    codes = _run_nodes(
        tiny_dataset, out, 1, ["--epochs", "2", "--cache", "0.6", "--device", arg], per_node=2, leftovers=left,
        loopback=True,
    )  # fmt: skip
    assert codes == [0], _logs(out)
    assert "Traceback" not in _rank_logs(out), _rank_logs(out)
    assert left == [], f"left in shared memory: {left}"
    recs = _records(out, 2)
    for r in recs:
        if not ON_GPU:
            want = None
        elif device == "given":
            want = DEVICE
        else:
            want = r["rank"] % torch.cuda.device_count()  # one node: the local rank is the rank
        assert r["device_id"] == want, (r["rank"], r["device_id"])
        expected = ["cpu"] if want is None else [f"cuda:{want}"]
        assert all(e["devices"] == expected for e in r["epochs"]), [e["devices"] for e in r["epochs"]]
    for epoch in range(2):
        _exactly_once([i for r in recs for b in r["epochs"][epoch]["batches"] for i in b])
        stats = [r["epochs"][epoch]["stats"] for r in recs]
        # Every delivered sample came from storage or from the node's cache. (A rank that ends its
        # epoch first reads ahead into the next one, whose shard holds samples the other rank has
        # yet to take: those are hits even in epoch 0, so the split itself is a matter of timing.)
        assert sum(s["storage_reads"] + s["cache_hits"] for s in stats) == N, stats
    last = [r["epochs"][-1]["stats"] for r in recs]
    assert sum(s["cache_hits"] for s in last) > 0, last
    # The ranks share one cache: each item was admitted once, by one of them, within the budget.
    admitted = sum(e["stats"]["admitted"] for r in recs for e in r["epochs"])
    assert admitted == last[0]["cache_items"] == last[1]["cache_items"] > 0, (admitted, last)
    assert last[0]["cache_bytes"] <= last[0]["cache_budget"]


# -- the same crop windows as the CPU path ------------------------------------------------------------------
def _images(loader, epochs: int) -> dict:
    """Every delivered image by ``(epoch, sample)``, copied to the CPU."""
    out = {}
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        ids = []
        for images, _, idx in loader:
            assert images.device == _device_of(loader)
            for image, i in zip(images, idx.tolist(), strict=True):
                out[(epoch, i)] = image.cpu()
                ids.append(i)
        _exactly_once(ids)
    return out


def test_the_gpu_path_has_the_cpu_path_s_crop_windows_and_flips(tiny_dataset):
    """For the same ``(seed, epoch, sample)`` the GPU path (nvJPEG, DALI's GPU operators) crops and
    flips as the CPU path does. Tolerance: per image, the mean absolute difference of the
    normalised pixels is under PIXEL_TOL = 0.1 (about 6 levels of 255; another decoder and other
    resize kernels, the same picture), and the shapes are identical. That the bound tells windows
    apart is checked too: each GPU image is much closer to the CPU's image of its own epoch than
    to the CPU's image of the same sample in the other epoch (another window and flip), for at
    least 90% of the samples (two random windows of a small image can happen to be alike)."""
    with _loader(tiny_dataset, cache=0, device_id=None) as cpu_loader:
        cpu = _images(cpu_loader, 2)
    with _loader(tiny_dataset, cache=0) as gpu_loader:
        gpu = _images(gpu_loader, 2)
    assert gpu.keys() == cpu.keys() == {(e, i) for e in range(2) for i in range(N)}
    own, apart = [], []
    for (epoch, i), image in gpu.items():
        assert image.shape == cpu[(epoch, i)].shape == (3, SIZE, SIZE)
        own.append(_distance(image, cpu[(epoch, i)]))
        apart.append(_distance(image, cpu[(1 - epoch, i)]))
    worst = int(np.argmax(own))
    assert max(own) < PIXEL_TOL, f"{list(gpu)[worst]}: {own[worst]:.3f} from the CPU path's image"
    told_apart = sum(a > 3 * max(o, PIXEL_TOL / 3) for o, a in zip(own, apart, strict=True))
    assert told_apart >= 0.9 * len(own), f"only {told_apart} of {len(own)} images are far from another window"


def test_a_run_resumed_on_the_device_delivers_the_uninterrupted_runs_images(tiny_dataset):
    """A run stopped after 5 batches and resumed from its ``state_dict()`` on the device: the rest of
    the epoch and the next one, every sample once, the uninterrupted run's images."""
    whole = {}
    with _loader(tiny_dataset, cache=0) as loader:
        for epoch in range(2):
            loader.set_epoch(epoch)
            _exactly_once(take(loader, whole, epoch))
    out = {}
    with _loader(tiny_dataset, cache=0) as loader:
        first = take(loader, out, 0, limit=5)
        state = json.loads(json.dumps(loader.state_dict()))
    assert state["epoch"] == 0 and state["batches"] == 5
    with _loader(tiny_dataset, cache=0) as loader:
        loader.load_state_dict(state)
        rest = take(loader, out, 0)
        loader.set_epoch(1)
        after = take(loader, out, 1)
    _exactly_once(first + rest)
    _exactly_once(after)
    assert all(image.device == WHERE for image in out.values())
    _assert_same_pictures(out, whole)


# -- an hp_group: uint8 staging, normalised on the device ---------------------------------------------------
def _trial(root: str, start, q) -> None:
    def body():
        out, devices, dtypes = {}, set(), set()
        with _loader(root, hp_group="gpu-trials") as loader:
            start.wait(60)
            for epoch in range(2):
                loader.set_epoch(epoch)
                ids = []
                for images, _, idx in loader:
                    ids += idx.tolist()
                    devices.add(str(images.device))
                    dtypes.add(str(images.dtype))
                    for image, i in zip(images, idx.tolist(), strict=True):
                        out[(epoch, i)] = image.cpu().numpy()  # numpy: pickled by value to the test
                _exactly_once(ids)
            stats = loader.stats()
        return out, sorted(devices), sorted(dtypes), stats

    report(q, body)


def test_hp_group_trials_stage_uint8_and_get_the_loader_alone_s_batches_normalised_on_the_device(
    tiny_dataset, isolated, procs, monkeypatch
):
    """Two trials of an ``hp_group`` on the device: the group stages uint8 pixels (a quarter of
    float32's bytes; on a GPU always, on the CPU with ``COORDL_HP_STAGE_UINT8=1``) and each trial
    normalises them on its device, float32 there. Every trial gets every sample once an epoch, the
    trials share batches, and each image equals the loader alone's up to float rounding (torch's
    normalisation against DALI's: atol 1e-4, as test_hp_group.py's uint8 test)."""
    if ON_CPU:
        monkeypatch.setenv("COORDL_HP_STAGE_UINT8", "1")  # what a GPU does by itself
    root = str(tiny_dataset)
    start, q = CTX.Barrier(2), CTX.Queue()
    for _ in range(2):
        procs(_trial, root, start, q)
    trials = [result(q, 180) for _ in range(2)]
    with _loader(root, cache=0) as loader:
        alone = _images(loader, 2)
    uint8_slots = 16 * BS * 3 * SIZE * SIZE + 16 * 4096  # the default 16 slots, one byte a value
    for got, devices, dtypes, stats in trials:
        assert devices == [str(WHERE)] and dtypes == ["torch.float32"]
        assert 0 < stats["staging_bound"] <= uint8_slots, stats["staging_bound"]
        assert got.keys() == alone.keys()
        for key, image in got.items():
            note = lambda m, k=key: f"{k}: {m}"  # noqa: E731 - names the sample in the failure
            torch.testing.assert_close(torch.from_numpy(image), alone[key], atol=1e-4, rtol=1e-5, msg=note)
    assert sum(stats["consumed_shared"] for *_, stats in trials) > 0, "the trials did not share batches"


# -- the decoded tier on a GPU ----------------------------------------------------------------------------
def test_the_decoded_tier_is_refused_on_a_gpu_and_auto_means_none(tiny_dataset):
    """docs/decoded-tier.md, "On a GPU": an explicit share is refused with the reason (nvJPEG's
    images are not the CPU decoder's), ``"auto"`` means 0 (nothing measured) and the loader runs
    on the encoded cache, no sample served decoded. On the CPU (COORDL_GPU_TESTS_ON_CPU=1) the
    explicit share is used instead, and the second epoch is served from it."""
    explicit = coordl.Cache(size="100MB", decoded="25MB")
    if ON_GPU:
        with pytest.raises(ValueError, match=r"Cache\(decoded='25MB'\): .*nvJPEG.*pass Cache\(decoded=0\)"):
            _loader(tiny_dataset, cache=explicit)
    cache = coordl.Cache(size="100MB", decoded="auto") if ON_GPU else explicit
    with _loader(tiny_dataset, cache=cache) as loader:
        assert loader.tier_plan.decoded_budget == (0 if ON_GPU else 25_000_000)
        assert (loader.decoded_tier is None) == ON_GPU
        hits = []
        for epoch in range(2):
            loader.set_epoch(epoch)
            ids = []
            for images, _, idx in loader:
                assert images.device == WHERE
                ids += idx.tolist()
            _exactly_once(ids)
            hits.append(loader.stats()["decoded_hits"])
    assert hits == [0, 0] if ON_GPU else hits[1] == N, hits


# -- the torch backend with pin_memory ----------------------------------------------------------------------
def _small(img) -> torch.Tensor:
    """A picklable transform: PIL image -> uint8 tensor 3x16x16."""
    return torch.from_numpy(np.asarray(img.resize((16, 16))).copy()).permute(2, 0, 1)


def _torch_batches(root: str, pin: bool) -> dict:
    out = {}
    dataset = coordl.datasets.ImageFolder(root, transform=_small)
    with CoordLoader(
        dataset, batch_size=BS, num_workers=2, pin_memory=pin, shuffle=True, seed=7, return_index=True, cache=0.5
    ) as loader:
        for epoch in range(2):
            loader.set_epoch(epoch)
            ids = []
            for x, y, idx in loader:
                # pinned on a machine with CUDA; without it, torch's DataLoader pins nothing
                assert x.is_pinned() == (pin and ON_GPU) and y.is_pinned() == (pin and ON_GPU)
                moved = x.to(WHERE, non_blocking=True)  # from pinned memory: an asynchronous copy
                assert torch.equal(moved.cpu(), x)
                for image, i in zip(moved, idx.tolist(), strict=True):
                    out[(epoch, i)] = image.cpu()
                ids += idx.tolist()
            _exactly_once(ids)
    return out


def test_the_torch_backend_pins_its_batches_and_pinning_changes_nothing(tiny_dataset):
    """``pin_memory=True`` on the torch backend: the batches (and labels) in pinned host memory, as
    DataLoader pins them, copied to the device asynchronously intact; every sample once an epoch, and
    the same tensors as without pinning."""
    pinned = _torch_batches(str(tiny_dataset), pin=True)
    plain = _torch_batches(str(tiny_dataset), pin=False)
    assert pinned.keys() == plain.keys()
    assert all(torch.equal(pinned[k], plain[k]) for k in plain)


# -- peers -------------------------------------------------------------------------------------------------
def test_two_nodes_with_peers_on_the_gpu_read_storage_once_and_deliver_every_sample_once(tiny_dataset, tmp_path):
    """Two nodes (loopback addresses, a shm folder each) with one rank each, both on the device:
    the partitioned cache as on the CPU path (test_peers.py): storage read once in the first epoch,
    later epochs from the two caches and the other node's, every sample once an epoch, the
    batches on the device, clean exits and nothing left in shm."""
    out, left = tmp_path / "out", []
    device = "none" if DEVICE is None else str(DEVICE)
    codes = _run_nodes(
        tiny_dataset, out, 2, ["--epochs", "3", "--cache", "0.6", "--device", device], leftovers=left, loopback=True
    )
    assert codes == [0, 0], _logs(out)
    assert "Traceback" not in _rank_logs(out), _rank_logs(out)
    assert left == [], f"left in shared memory: {left}"
    recs = _records(out, 2)
    peer_reads = 0
    for epoch in range(3):
        _exactly_once([i for r in recs for b in r["epochs"][epoch]["batches"] for i in b])
        assert all(r["epochs"][epoch]["devices"] == [str(WHERE)] for r in recs)
        stats = [r["epochs"][epoch]["stats"] for r in recs]
        if epoch == 0:
            assert sum(s["storage_reads"] for s in stats) == N and sum(s["peer_reads"] for s in stats) == 0
        else:
            assert [s["storage_reads"] for s in stats] == [0, 0], stats
            assert sum(s["cache_hits"] + s["peer_reads"] for s in stats) == N
            peer_reads += sum(s["peer_reads"] for s in stats)
    assert peer_reads > 0, "no node read from the other"


# -- a script's end with a CUDA context alive ----------------------------------------------------------------
def _lifecycle_backend(hp_group: str | None) -> str:
    """test_lifecycle.py's DALI backend on the device, in a script that holds a CUDA context (a
    tensor on the device) for its whole life, as a training script does."""
    group = f"\n    kw.setdefault('hp_group', {hp_group!r})" if hp_group else ""
    return f"""
import torch

import coordl

DEVICE = None if os.environ.get("COORDL_GPU_TESTS_ON_CPU") == "1" else 0
CONTEXT = torch.zeros(1, device="cpu" if DEVICE is None else f"cuda:{{DEVICE}}")  # alive until the end


def make(**kw):
    kw.setdefault("batch_size", 8)
    kw.setdefault("pipeline", coordl.ImageNetTrain(size=32))
    kw.setdefault("cache", "4MB")
    kw.setdefault("shuffle", True)
    kw.setdefault("device_id", DEVICE){group}
    return coordl.CoordLoader(ROOT, **kw)


make_val = make
"""


# Every way a script leaves its loop or ends: a break, an exception, Ctrl-C, SIGTERM (the
# default handler and a framework's that chains to it), a pass left open and no close().
IDIOMS = ["full_epoch", "partial_pass", "break", "del_and_gc", "value_error", "keyboard_interrupt", "sigterm",
          "sigterm_handled_by_the_script"]  # fmt: skip
HP_IDIOMS = ["partial_pass", "break", "value_error", "sigterm"]
CASES = [("dali", name) for name in IDIOMS] + [("hp", name) for name in HP_IDIOMS]


@pytest.fixture(scope="module")
def lifecycle_data(tmp_path_factory) -> Path:
    """test_lifecycle.py's dataset: 200 small JPEGs in 4 classes (25 batches of 8)."""
    return make_tree(tmp_path_factory.mktemp("gpu-lifecycle") / "train", classes=4, per_class=50, varied=False)


@pytest.mark.parametrize("backend,name", CASES, ids=[f"{b}-{n}" for b, n in CASES])
def test_a_script_with_a_cuda_context_ends_as_it_would_without_coordl(
    backend, name, lifecycle_data, isolated, tmp_path
):
    """test_lifecycle.py's check on the device with a CUDA context alive: the exit status of the
    same script with a plain list, no traceback, abort or line of coordl's or DALI's on stderr but
    the script's own exception, nothing left in its COORDL_SHM_DIR, no process outliving it."""
    source = _lifecycle_backend("gpu-lc" if backend == "hp" else None)
    ends_as_without_coordl(source, name, lifecycle_data, isolated, tmp_path, label=f"gpu-{backend}")


# -- the analyzer's G on a real model step --------------------------------------------------------------------
G_SCRIPT = """
import atexit, json, os, statistics, sys, time

import torch

import coordl

DEVICE = None if os.environ.get("COORDL_GPU_TESTS_ON_CPU") == "1" else 0
dev = torch.device("cpu" if DEVICE is None else f"cuda:{DEVICE}")
torch.manual_seed(0)
model = torch.nn.Sequential(
    torch.nn.Flatten(), torch.nn.Linear(3 * 32 * 32, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 4)
).to(dev)
opt = torch.optim.SGD(model.parameters(), lr=0.01)


def step(images, labels, reps):
    labels = labels.to(dev)
    for _ in range(reps):
        loss = torch.nn.functional.cross_entropy(model(images), labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return loss.item()  # waits for the device: the step's time is the device's work


x, y = torch.randn(8, 3, 32, 32, device=dev), torch.zeros(8, dtype=torch.long, device=dev)
reps = 1
while True:  # a step of at least 20 ms, so that a batch's hand-over is a small part of it
    step(x, y, reps)
    t0 = time.perf_counter()
    step(x, y, reps)
    if time.perf_counter() - t0 >= 0.02:
        break
    reps *= 2
times = []
for _ in range(15):
    t0 = time.perf_counter()
    step(x, y, reps)
    times.append(time.perf_counter() - t0)
record = {"step_s": statistics.median(times), "reps": reps, "loop": []}  # "loop": when each step ended


def save():  # at exit: the probe ends the script with SystemExit once it has measured
    with open(sys.argv[2], "w") as f:
        json.dump(record, f)


atexit.register(save)
with coordl.CoordLoader(sys.argv[1], batch_size=8, device_id=DEVICE, pipeline=coordl.ImageNetTrain(size=32), cache=0,
                        prep=1, shuffle=True) as loader:
    for epoch in range(100):
        for images, labels in loader:
            assert images.device == dev
            step(images, labels, reps)
            record["loop"].append(time.perf_counter())
print("the script finished")
"""


def test_the_analyzer_s_g_is_the_rate_of_the_script_s_model_step_on_the_device(tiny_dataset, tmp_path):
    """Phase G of ``coordl analyze`` (its probe in the script's interpreter, as the command runs it)
    on a script whose step is a real model's forward, backward and SGD update on the device, ended
    by ``loss.item()``: G is measured on the device, positive, the rate of the script's own steps
    in its loop (within 10%: the same steps, timed by the script after each one), and on a GPU
    within 25% of the batch size over the step's time alone, measured by the script beforehand
    (the same step with no loader). On the CPU (COORDL_GPU_TESTS_ON_CPU=1) that last comparison is
    left out: the step then competes for the cores with DALI's threads and whatever else runs
    (docs/analyze.md, "Threads on CPU training"), and measured 0.5x to 2x its time alone here."""
    script, timed, out = tmp_path / "train.py", tmp_path / "step.json", tmp_path / "out"
    script.write_text(G_SCRIPT)
    out.mkdir()
    command = [sys.executable, str(script), str(tiny_dataset), str(timed)]
    (g,) = run_phase(command, "G", out=str(out), steps=30, warmup=3, run_id="gpu-test", timeout=300)
    log = (out / "phase-G.log").read_text()
    assert "the script finished" not in log, log
    timing = json.loads(timed.read_text())
    assert g["device"] == str(WHERE) and g["batch_size"] == BS
    assert g["samples_per_s"] > 0 and g["step_s"] == pytest.approx(BS / g["samples_per_s"])
    loop = timing["loop"]  # the ends of the steps the probe timed, from its first batch on
    assert len(loop) >= 30, loop
    in_loop = BS * (len(loop) - 4) / (loop[-1] - loop[3])  # past the warm-up
    assert g["samples_per_s"] == pytest.approx(in_loop, rel=0.1), (g, in_loop)
    if ON_GPU:  # the device does the step's work, whatever the CPUs do meanwhile
        alone = BS / timing["step_s"]
        assert g["samples_per_s"] == pytest.approx(alone, rel=0.25), (g, alone)
