"""RayPrep against a real Ray cluster on loopback, no mocks: a head lending no CPUs (the trainer's
node, as docs/remote-prep.md says to start it) and a node of two CPUs, where the actors run.

One cluster serves the module (:class:`coordl_testing.raycluster.RayCluster`, in a network
namespace of its own). Each test runs a user's script, ``tests/ray_driver.py``, as a Ray driver
in that namespace, and checks its exit status, its stderr, what it wrote as JSON (Ray redirects a
driver's stdout), the actor processes it leaves, and its shm folder (the ``isolated`` fixture's
``COORDL_SHM_DIR``, which the actors get too). A script checks several things, because every
driver pays seconds to connect and to start its actors. Comparisons are bit for bit against the
same loader with local prep, made in the same script.
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import coordl
from conftest import make_tree
from coordl.remote import cluster as cluster_mod
from coordl.shm import reaper
from coordl_testing import raycluster

N = 120  # samples in tiny_dataset
BS = 8  # samples a batch (ray_driver.BS)
BATCHES = N // BS
DRIVER = Path(__file__).with_name("ray_driver.py")
CLOSED_S = 5.0  # a closed or collected loader's actors are gone within this (guarantees.md: "under 5 s")
GRACE_S = 30.0  # Slurm's KillWait and Kubernetes' grace period: a SIGTERMed script is gone well before
START_S = 3.0  # coordl.remote.raypass.START_TIMEOUT_S in the start_timeout script (120 s in coordl)
LATE_S = 2.0  # a guard: the pass fails this soon after START_S (its thread looks every 0.05 s)
REASON = "COORDL_TEST_NO_NETNS is set" if os.environ.get("COORDL_TEST_NO_NETNS") else raycluster.unavailable()
CODE = str(
    Path(coordl.__file__).resolve().parents[1]
)  # the coordl under test: the cluster's workers and drivers import it


def needs_cluster(test):
    """A test on the module's cluster: slow (seconds per script), and skipped where no cluster can start."""
    return pytest.mark.slow(pytest.mark.skipif(REASON is not None, reason=f"a Ray cluster on loopback {REASON}")(test))


@pytest.fixture(scope="module")
def cluster():
    """The module's Ray cluster; its workers import the coordl under test."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("COORDL_")}
    env["PYTHONPATH"] = _path(CODE, str(raycluster.ROOT))
    c = raycluster.RayCluster(nodes=2, cpus=(0, 2), env=env)
    yield c
    killed = c.close()
    if killed:
        pytest.fail(f"processes of the Ray cluster outlived its shutdown and were killed: {killed}")


def _path(*first: str) -> str:
    return os.pathsep.join(p for p in (*first, os.environ.get("PYTHONPATH", "")) if p)


@dataclass
class Run:
    rc: int
    stderr: str
    result: dict | None
    seconds: float
    ended_at: float  # time.time() once the driver had exited


def drive(cluster, tmp_path, scenario: str, root, *args: str, timeout: float = 240) -> Run:
    """Runs ``ray_driver.py scenario root out *args`` in the cluster, with the test's environment
    (its ``COORDL_SHM_DIR``, which the actors get too)."""
    out = tmp_path / f"{scenario}-{'-'.join(args)}.json"
    env = cluster.env(PYTHONPATH=_path(CODE))
    argv = [sys.executable, str(DRIVER), scenario, str(root), str(out), *args]
    t0 = time.monotonic()
    p = cluster.popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        _, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        _, err = p.communicate()
        err += f"\n[killed by the test after {timeout:.0f} s]"
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        cluster.watch()
    result = json.loads(out.read_text()) if out.exists() else None
    return Run(p.returncode, err, result, time.monotonic() - t0, time.time())


def ok(run: Run) -> dict:
    """The script's result, once it exited 0 without a traceback."""
    assert run.rc == 0 and "Traceback" not in run.stderr, f"exit status {run.rc}:\n{run.stderr[-4000:]}"
    assert run.result is not None, "the script wrote no result"
    return run.result


def gone(procs, timeout: float = 15.0) -> list[int]:
    """The pids of ``procs`` (``[pid, start time]`` pairs, as the driver saw them) still alive after
    ``timeout`` seconds: a pid whose process started at another time is another process's (the
    machine starts tens of processes a second, and pids wrap at 32768)."""
    deadline = time.monotonic() + timeout
    while True:
        alive = [pid for pid, start in procs if start is not None and _started(pid) == start]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.05)


def _started(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks after boot); None: no such process, or a zombie."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] == "Z" else int(fields[19])


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:200]
    except OSError:
        return f"{pid}: gone"


def segments(shm: Path, timeout: float = 10.0) -> list[str]:
    """The coordl segments left in ``shm`` after ``timeout`` seconds (killed actors leave late)."""
    deadline = time.monotonic() + timeout
    while True:
        left = sorted(os.listdir(shm))
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


def exactly_once(ids) -> None:
    counts = Counter(ids)
    assert set(counts) == set(range(N)), f"samples never delivered: {sorted(set(range(N)) - set(counts))}"
    assert max(counts.values()) == 1, f"samples delivered twice: {sorted(i for i, c in counts.items() if c > 1)}"


def same_as_reference(run: dict, reference: list[dict], labels=None) -> None:
    """Every epoch of ``run`` delivered the reference's samples in its order, with its labels and
    (``bad``) bit-equal images."""
    for epoch, (got, want) in enumerate(zip(run["epochs"], reference, strict=True)):
        exactly_once(got["ids"])
        assert got["ids"] == want["ids"], f"epoch {epoch}: another order than local prep's"
        assert got["labels"] == want["labels"], f"epoch {epoch}: other labels than local prep's"
        if labels is not None:
            assert got["labels"] == [labels[i] for i in got["ids"]], f"epoch {epoch}: labels not the index's"
    assert run["compared"] == N * len(reference)
    assert run["bad_count"] == 0, (
        f"{run['bad_count']} images differ from local prep's, e.g. (epoch:sample) {run['bad']}"
    )


# -- the tests -------------------------------------------------------------------------------------
def test_sample_error_pickles():
    """An actor's SampleError reaches the trainer pickled (through Ray's RayTaskError)."""
    e = pickle.loads(pickle.dumps(coordl.SampleError("cannot decode sample 3 (a.jpg)", path="a.jpg", index=3)))
    assert (type(e), str(e), e.path, e.index) == (coordl.SampleError, "cannot decode sample 3 (a.jpg)", "a.jpg", 3)


def test_no_cluster_at_the_address_is_an_error_at_construction(tiny_dataset, tmp_path):
    """In a script of its own: without the check before ray.init, Ray retries for minutes."""
    pytest.importorskip("ray")
    out = tmp_path / "no_cluster.json"
    argv = [sys.executable, str(DRIVER), "no_cluster", str(tiny_dataset), str(out), "127.0.0.1:1"]
    env = {**os.environ, "PYTHONPATH": _path(CODE)}
    env.pop("RAY_ADDRESS", None)
    p = subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=60)
    assert p.returncode == 0, p.stderr[-4000:]
    r = json.loads(out.read_text())
    assert r["raised"] == "CoordlError" and r["coordl"], r
    assert "no Ray cluster at RayPrep(address='127.0.0.1:1')" in r["message"]
    assert r["seconds"] < 10


@needs_cluster
def test_dali_remote_and_both_give_local_prep_s_tensors(cluster, tiny_dataset, isolated, tmp_path):
    r = ok(drive(cluster, tmp_path, "equal_dali", tiny_dataset))
    reference, labels = r["reference"], r["labels"]
    for epoch in reference:
        exactly_once(epoch["ids"])
    for name in ("remote", "both", "trainer"):
        same_as_reference(r[name], reference, labels)
    remote, both, trainer = r["remote"]["stats"], r["both"]["stats"], r["trainer"]["stats"]
    assert remote["remote_units"] == BATCHES and remote["local_units"] == 0
    assert both["remote_units"] > 0 and both["local_units"] > 0, (
        "RayPrep(local=True): actors and the trainer take units"
    )
    assert both["remote_units"] + both["local_units"] == BATCHES
    assert r["remote"]["reads"] == ["node"] and remote["remote_shipped_bytes"] == 0
    # The actors read through the node's cache (the reference run filled it): every sample a hit,
    # counted from their reads, none from storage.
    assert (remote["cache_hits"], remote["storage_reads"]) == (N, 0), remote
    assert r["trainer"]["reads"] == ["trainer"] and trainer["remote_shipped_bytes"] > 0
    # output="uint8": normalised on the trainer, by other float operations than DALI's (measured: 2.4e-7)
    uint8 = r["uint8"]
    for got, want in zip(uint8["epochs"], reference, strict=True):
        assert (got["ids"], got["labels"]) == (want["ids"], want["labels"])
    assert uint8["compared"] == 2 * N and uint8["max_diff"] <= 1e-5, f"max difference {uint8['max_diff']}"
    assert uint8["stats"]["remote_result_bytes"] * 4 == remote["remote_result_bytes"]
    assert segments(isolated) == []


@needs_cluster
def test_a_detection_dataset_s_actors_deliver_local_prep_s_pixels_and_boxes(cluster, isolated, tmp_path):
    """SSDTrain on a COCO set prepared by actors only: the same pixels (bit for bit; as uint8,
    normalised on the trainer, within float rounding) and the same boxes, computed by the trainer
    from the sample ids."""
    from coordl.tools.datagen.coco import make_coco

    coco = make_coco(tmp_path / "coco", 40, seed=2, width=(64, 96), height=(48, 80))
    r = ok(drive(cluster, tmp_path, "detection", coco.images))
    everything = sorted(f"{e}:{i}" for e in range(2) for i in range(40))
    assert r["reference"]["samples"] == everything
    for name, bound in (("remote", 0.0), ("uint8", 1e-5)):
        assert r[name]["samples"] == everything and r[name]["boxes_differ"] == 0, r[name]
        assert r[name]["max_diff"] <= bound and r[name]["remote_units"] == 5, r[name]  # the last epoch's units
    assert segments(isolated) == []


@needs_cluster
def test_audio_clips_prepared_by_actors_are_local_prep_s_windows(cluster, isolated, tmp_path):
    """AudioTrain (decode, resample, window, gain) by actors only: bit for bit local prep's windows."""
    from coordl.tools.datagen.tones import make_tones

    tones = make_tones(tmp_path / "tones", classes=2, per_class=8, seconds=(0.3, 1.2), seed=4)
    r = ok(drive(cluster, tmp_path, "audio", tones.root))
    everything = sorted(f"{e}:{i}" for e in range(2) for i in range(16))
    assert r["reference"]["samples"] == r["remote"]["samples"] == everything
    assert r["remote"]["differ"] == 0 and r["remote"]["remote_units"] == 2, r["remote"]
    assert segments(isolated) == []


@needs_cluster
def test_torch_backend_remote_gives_local_tensors(cluster, tiny_dataset, isolated, tmp_path):
    """ImageFolder with a random crop and flip drawn from Python's and torch's global generators."""
    r = ok(drive(cluster, tmp_path, "equal_torch", tiny_dataset))
    for name in ("remote", "both"):
        same_as_reference(r[name], r["reference"])
    assert r["remote"]["stats"]["remote_units"] == BATCHES
    both = r["both"]["stats"]
    assert both["remote_units"] > 0 and both["local_units"] > 0
    assert segments(isolated) == []


@needs_cluster
def test_a_custom_recipe_drawing_from_ctx_random_gives_local_prep_s_tensors(cluster, tiny_dataset, isolated, tmp_path):
    """A callable recipe whose crop window, brightness and flip come from ctx.random, prepared by
    actors only: bit for bit the tensors of local prep, two epochs."""
    r = ok(drive(cluster, tmp_path, "custom", tiny_dataset))
    for epoch in r["reference"]:
        exactly_once(epoch["ids"])
    # The draws decide the tensors: a sample's differ from one epoch to the next (all but chance ones).
    assert r["fresh"] >= N - 5, f"only {r['fresh']} of {N} samples changed between epochs"
    same_as_reference(r["remote"], r["reference"])
    stats = r["remote"]["stats"]
    assert stats["remote_units"] == BATCHES and stats["local_units"] == 0
    assert segments(isolated) == []


@needs_cluster
@pytest.mark.parametrize("backend", ["dali", "torch"])
def test_a_state_resumes_at_another_world_size_with_ray_prep(cluster, tiny_dataset, isolated, tmp_path, backend):
    """tests/test_resume.py's resumed run, 2 ranks -> 3, every loader with RayPrep: the interrupted
    epoch is delivered exactly once in all, with the uninterrupted run's tensors."""
    r = ok(drive(cluster, tmp_path, "resume", tiny_dataset, "3", backend))
    assert r["states_equal"], "ranks that received as many batches have one state"
    assert (r["state"]["world_size"], r["state"]["epoch"], r["state"]["batches"]) == (2, 0, 3)
    assert len(r["before"]) == 2 * 3 * 8
    exactly_once(r["before"] + r["after"]["0"])
    exactly_once(r["after"]["1"])  # the next epoch, at the new world size, is whole
    assert r["compared"] == 2 * N and r["bad_count"] == 0, f"images differ from the reference: {r['bad']}"
    assert segments(isolated) == []


@needs_cluster
def test_a_state_saved_with_ray_prep_resumes_without_it(cluster, tiny_dataset, isolated, tmp_path):
    """A state saved during a pass whose batches came from actors (RayPrep(local=False)), loaded by
    the same loader without RayPrep: it delivers exactly the rest of the epoch, in the
    uninterrupted run's order and with its tensors, then the next epoch whole."""
    cut = 4
    r = ok(drive(cluster, tmp_path, "resume_plain", tiny_dataset, str(cut)))
    reference = r["reference"]
    assert r["remote_units"] >= cut, "the actors made the batches before the state"
    assert (r["state"]["epoch"], r["state"]["batches"]) == (0, cut)
    assert r["before"] == reference[0]["ids"][: cut * BS]
    assert r["after"][0]["ids"] == reference[0]["ids"][cut * BS :], "not the rest of the epoch, in its order"
    assert r["after"][1]["ids"] == reference[1]["ids"]
    exactly_once(r["before"] + r["after"][0]["ids"])
    assert r["compared"] == 2 * N and r["bad_count"] == 0, f"images differ from the reference: {r['bad']}"
    assert segments(isolated) == []


@needs_cluster
def test_a_killed_actor_s_units_run_again(cluster, tiny_dataset, isolated, tmp_path):
    run = drive(cluster, tmp_path, "kill", tiny_dataset, timeout=90)  # a lost unit would hang the epoch
    r = ok(run)
    exactly_once(r["ids"])
    exactly_once(r["second"])  # the pool goes on with the actor left, and its replacement
    stats = r["stats"]
    assert stats["remote_retried"] >= 1 and stats["remote_lost_s"] > 0
    assert "coordl: a RayPrep actor died" in run.stderr
    assert gone([r["killed"]]) == []
    assert segments(isolated) == []


@pytest.fixture(scope="module")
def plain_interrupt_status(cluster, tiny_dataset, tmp_path_factory):
    """The exit status of a script that calls ray.init and gets SIGINT, without coordl."""
    run = drive(cluster, tmp_path_factory.mktemp("plain"), "life", tiny_dataset, "plain")
    assert run.stderr.rstrip().endswith("KeyboardInterrupt"), run.stderr[-2000:]
    return run.rc


#: What a clean stderr never holds: a traceback, an ignored exception, an abort (Ray's C++ handler
#: prints "*** SIGTERM received" and aborts a driver that has not exited 3 s after a SIGTERM).
NOISE = ("Traceback", "Exception ignored", "terminate called", "*** SIG", "Aborted", "Fatal Python error")


@needs_cluster
@pytest.mark.parametrize(
    "mode,status",
    [
        ("break", 0),
        ("raise", 3),
        ("interrupt", None),
        ("term", -signal.SIGTERM),
        ("kill", -9),
        ("noclose", 0),
        ("collect", 0),
    ],
)
def test_a_script_s_end_ends_its_actors_and_leaves_no_segment(
    cluster, tiny_dataset, isolated, tmp_path, mode, status, request
):
    """A script that breaks out of its loop and closes, raises SystemExit(3), gets SIGINT, gets
    SIGTERM, is SIGKILLed, never calls close(), or drops its loader and pass mid-epoch and collects
    them: it exits with its own status (SIGTERM: death by it, as without Ray), its actors end, and
    its shm folder is empty (after a SIGKILL: left to the reaper, which finds nobody attached)."""
    if mode == "interrupt":  # Ray's driver exits 1 on an uncaught KeyboardInterrupt (Python alone: -2)
        status = request.getfixturevalue("plain_interrupt_status")
    run = drive(cluster, tmp_path, "life", tiny_dataset, mode)
    assert run.rc == status, f"exit status {run.rc}, not {status}:\n{run.stderr[-4000:]}"
    if mode == "interrupt":
        assert run.stderr.rstrip().endswith("KeyboardInterrupt"), run.stderr[-4000:]
    else:
        noise = [line for line in run.stderr.splitlines() if any(word in line for word in NOISE)]
        assert noise == [], run.stderr[-4000:]
    assert run.result is not None and len(run.result["procs"]) == 2
    assert all(start is not None for _, start in run.result["procs"]), run.result["procs"]
    left = gone(run.result["procs"])
    assert left == [], f"actors outlived their script: {[_cmdline(pid) for pid in left]}"
    if mode in ("break", "collect"):  # while the script goes on
        assert run.result["end"] == mode and run.result["ended_s"] < CLOSED_S, "closing ends the actors at once"
    if mode == "collect":
        assert run.result["collected"], "the dropped loader was not collected"
    if mode == "term":  # coordl closed the loader, then SIGTERM ended the process: well within a grace period
        assert run.ended_at - run.result["signalled_at"] < GRACE_S
    if mode == "kill":
        left = segments(isolated, timeout=1.0)
        assert all(not g.in_use for g in reaper.list_groups(str(isolated))), "a dead script's cache is in use"
        reaper.reap(str(isolated))
        assert segments(isolated, timeout=0) == [], left
    assert segments(isolated) == []


@needs_cluster
def test_sigterm_at_a_random_moment_ends_a_ray_prep_trainer_within_2_s_with_its_actors(
    cluster, tiny_dataset, isolated, tmp_path
):
    """tests/test_sigterm.py's check, for a RayPrep trainer (an actor, and the trainer's own DALI
    thread): 16 times in a row, SIGTERM at a random moment of its training loop ends it by SIGTERM
    within 2 s (closing the pool fits the 1.5 s the handler gives the loaders; it could wait 2 s for
    the actors to leave their caches, then 10 s for them to be gone), with no traceback, its actor
    gone and nothing left in its shm folder."""
    import random

    rng = random.Random(47)
    env = cluster.env(PYTHONPATH=_path(CODE))
    for k in range(16):
        out, err = tmp_path / f"term{k}.json", tmp_path / f"term{k}.err"
        argv = [sys.executable, str(DRIVER), "term", str(tiny_dataset), str(out)]
        with open(err, "w") as stderr:
            p = cluster.popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=stderr, text=True)
        try:
            deadline = time.monotonic() + 120
            while not out.exists() and p.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            assert out.exists(), f"round {k}: the trainer never had its actor ready:\n{err.read_text()[-4000:]}"
            time.sleep(rng.uniform(0.0, 1.5))  # anywhere in its loop: in coordl, in Ray, or in the step
            t0 = time.monotonic()
            p.send_signal(signal.SIGTERM)
            p.wait(timeout=30)
            took = time.monotonic() - t0
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
            cluster.watch()
        stderr = err.read_text()
        assert p.returncode == -signal.SIGTERM, f"round {k}: exit status {p.returncode}\n{stderr[-4000:]}"
        assert took < 2.0, f"round {k}: ended {took:.2f} s after SIGTERM"
        noise = [line for line in stderr.splitlines() if any(word in line for word in NOISE)]
        assert noise == [], f"round {k}:\n{stderr[-4000:]}"
        procs = json.loads(out.read_text())["procs"]
        assert len(procs) == 1 and gone(procs) == [], f"round {k}: its actor outlived it"
        assert segments(isolated) == [], f"round {k}: left in shared memory"


@needs_cluster
def test_threads_polling_the_pool_at_once_make_each_actor_ready_once(cluster, tiny_dataset, isolated, tmp_path):
    """The pool's state is changed under one lock: four threads polling it while its two actors
    start each see the actor that became ready, and only one of them moves it to the ready ones (each
    popped it from the starting ones: a KeyError in the others); then an epoch, exactly once."""
    r = ok(drive(cluster, tmp_path, "pool_race", tiny_dataset))
    assert r["errors"] == [], r["errors"]
    assert (r["ready"], r["size"], r["started"], r["died"]) == (2, 2, 2, 0), r
    exactly_once(r["ids"])
    assert r["stats"]["remote_units"] == N // 4
    assert segments(isolated) == []


def test_the_start_timeout_is_coordl_s_documented_120_s():
    """guarantees.md: a pass of RayPrep(local=False) whose actors cannot start fails after 120 s."""
    from coordl.remote import actors, raypass

    assert actors.START_TIMEOUT_S == raypass.START_TIMEOUT_S == 120.0


@needs_cluster
def test_actors_that_cannot_start_fail_the_pass_after_the_start_timeout(cluster, tiny_dataset, isolated, tmp_path):
    """RayPrep(local=False, cpus_per_worker=4) on nodes of one CPU: Ray never places the actor, and
    the first batch raises CoordlError once no actor has been ready for START_TIMEOUT_S (START_S
    here), not before and not much later; close() ends the actor Ray never placed."""
    r = ok(drive(cluster, tmp_path, "start_timeout", tiny_dataset, str(START_S), timeout=60))  # 60: a guard
    assert r["cluster_cpus"] == 2.0
    assert (r["raised"], r["coordl"]) == ("CoordlError", True), r
    assert r["message"] == (
        f"coordl: no RayPrep actor has been ready for {START_S:.0f} s and RayPrep(local=False): "
        "the cluster has no free CPUs for them (see `ray status`)"
    )
    assert START_S <= r["seconds"] < START_S + LATE_S, f"failed after {r['seconds']:.2f} s"
    assert list(r["before"].values()) == ["PENDING_CREATION"], r["before"]
    assert list(r["after"].values()) == ["DEAD"], r["after"]
    assert segments(isolated) == []


@needs_cluster
def test_a_cluster_with_no_node_but_the_trainer_s_is_named_at_once(tiny_dataset, isolated, tmp_path):
    """A cluster of one node, the trainer's (2 CPUs): Ray would never place an actor that
    RayPrep(on_trainer_node=False) keeps off it. RayPrep(local=False) fails when the loader is
    made, within 5 s, naming on_trainer_node=True (it used to wait 120 s at the first batch and then
    blame the CPUs); RayPrep(local=True) warns once that no actor will start and prepares every
    batch itself (it used to start actors that waited for ever, silently); on_trainer_node=True
    runs the actor there."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("COORDL_")}
    env["PYTHONPATH"] = _path(CODE, str(raycluster.ROOT))
    with raycluster.RayCluster(nodes=1, cpus=2, env=env) as one:
        r = ok(drive(one, tmp_path, "one_node", tiny_dataset))
        killed = one.close()
    assert killed == [], f"processes of the Ray cluster outlived its shutdown and were killed: {killed}"
    assert r["raised"] == "CoordlError" and r.get("coordl"), r
    assert r["message"] == (
        "coordl: the Ray cluster of RayPrep(address='auto') has no node but this trainer's, and "
        "RayPrep(on_trainer_node=False) keeps the actors off it: no actor can start, and RayPrep(local=False) "
        "leaves nobody to prepare batches; pass RayPrep(on_trainer_node=True) to run them on this machine (they "
        "then share its CPUs with the training loop), or start Ray on another machine "
        "(`ray start --address=<head>:6379`); see docs/remote-prep.md"
    )
    assert r["seconds"] < 5.0, f"failed after {r['seconds']:.2f} s (connected in {r['connect_s']:.2f} s before)"
    assert r["warnings"] == [
        "RuntimeWarning: coordl: the Ray cluster of RayPrep(address='auto') has no node but this trainer's, and "
        "RayPrep(on_trainer_node=False) keeps the actors off it: no actor will start, and this machine's pipeline "
        "prepares every batch (RayPrep(local=True)); pass RayPrep(on_trainer_node=True) to run them on this "
        "machine too, or start Ray on another machine (`ray start --address=<head>:6379`)"
    ], r["warnings"]
    assert (r["started"], r["remote_units"]) == (0, 0), r
    for epoch in r["epochs"]:
        exactly_once(epoch["ids"])
    exactly_once(r["here"]["ids"])
    assert r["here"]["remote_units"] == BATCHES, r["here"]
    assert segments(isolated) == []


@needs_cluster
def test_a_loader_closed_while_its_actors_are_busy_leaves_no_cache_behind(cluster, tiny_dataset, isolated, tmp_path):
    """Actors in the middle of units longer than the 2 s they have to leave their node's cache are
    killed with it open: the loader removes the cache once they are gone, as the next loader would."""
    r = ok(drive(cluster, tmp_path, "slow_close", tiny_dataset))
    assert all(c > 0 for c in r["caches"]), f"the actors read through no cache: {r['caches']}"
    assert r["closed_s"] < cluster_mod.CLOSE_TIMEOUT_S + cluster_mod.EXIT_TIMEOUT_S, r
    assert gone(r["procs"]) == [], "the actors outlived their loader"
    assert segments(isolated, timeout=0) == []


@needs_cluster
def test_workers_auto_grows_the_pool_within_the_cluster(cluster, tiny_dataset, isolated, tmp_path):
    """A prep-bound loader (actors only; or actors and one local DALI thread) with workers="auto":
    a second actor once the loop waits, none beyond the cluster's 2 CPUs."""
    r = ok(drive(cluster, tmp_path, "auto", tiny_dataset, timeout=600))  # a guard: each case waits at most 120 s
    for name in ("remote", "both"):
        samples = r[name]["samples"]  # (seconds, actors ready, actors started) after each batch
        assert max(ready for _, ready, _ in samples) == 2, f"{name}: the pool never grew: {samples[-5:]}"
        assert max(size for _, _, size in samples) <= 2, f"{name}: more actors than the cluster's CPUs"
    assert segments(isolated) == []


@needs_cluster
def test_in_flight_bounds_the_units_ahead_of_a_slow_loop(cluster, tiny_dataset, isolated, tmp_path):
    """RayPrep(in_flight=3), a loop sleeping 0.1 s a batch: units claimed by actors and not taken
    stay within 3, and with local=True all units within 3 plus the local pipeline's depth (its
    results wait in memory); Ray's object store spills nothing."""
    run = drive(cluster, tmp_path, "in_flight", tiny_dataset)
    r = ok(run)
    for name in ("remote", "both"):
        exactly_once(r[name]["ids"])
    sampled = {name: {k: sorted(int(n) for n in r[name][k]) for k in ("in_flight", "remote_in_flight")} for name in r}
    assert max(sampled["remote"]["in_flight"]) == 3, f"actors only: {sampled['remote']}"
    assert max(sampled["both"]["remote_in_flight"]) <= 3, f"local=True: {sampled['both']}"
    # the local pipeline's own bound: its queue (Fetch(batches_ahead) + 1 + DALI's 2), and the results
    # it holds while the loop waits for an actor's unit (2 + 2): a few units, not the epoch's 30
    depth = r["both"]["local_depth"]
    assert depth is not None and depth <= 2 + 1 + 2 + 4, f"the local pipeline may hold {depth} units"
    assert max(sampled["both"]["in_flight"]) <= 3 + depth, f"local=True: {sampled['both']}"
    logs = Path(cluster.session_dir, "logs")
    spilled = [line for f in logs.glob("raylet*.out") for line in f.read_text().splitlines() if "Spilled" in line]
    assert spilled == [] and "Spilled" not in run.stderr, spilled
    assert segments(isolated) == []


@needs_cluster
def test_a_corrupt_jpeg_raises_sample_error_or_is_skipped(cluster, dataset_copy, isolated, tmp_path):
    """Actors preparing a corrupt JPEG: on_error="raise" raises SampleError naming it (DALI and torch
    backends); on_error="skip" skips it and counts it."""
    bad = sorted(dataset_copy.rglob("*.jpg"))[35]
    bad.write_bytes(b"\xff\xd8" + b"x" * (bad.stat().st_size - 2))  # the index's size: read, then not decoded
    r = ok(drive(cluster, tmp_path, "errors", dataset_copy))
    for backend in ("dali", "torch"):
        raised = r[f"{backend}_raise"]
        assert raised["raised"] == "SampleError", f"{backend}: {raised}"
        assert raised["path"] == str(bad) and str(bad) in raised["message"]
        skipped = r[f"{backend}_skip"]
        assert sorted(skipped["ids"]) == [i for i in range(N) if i != 35]
        assert skipped["stats"]["skipped"] == 1 and skipped["stats"]["skipped_paths"] == [str(bad)]
    assert segments(isolated) == []


@needs_cluster
def test_an_hp_group_s_batches_come_from_its_members_actors(cluster, tiny_dataset, isolated, tmp_path):
    """Two trials of one HP group, each with RayPrep(local=False): the group's batches are made once,
    by the members' actors, and each trial gets every sample once an epoch, with the tensors of a
    loader alone."""
    r = ok(drive(cluster, tmp_path, "hp", tiny_dataset))
    assert r["rcs"] == [0, 0]
    produced = shared = 0
    for member in r["members"]:
        for got in member["epochs"]:
            exactly_once(got["ids"])
            assert sorted(got["ids"]) == list(range(N))
            produced += got["produced"]
            shared += got["shared"]
        assert member["compared"] == 2 * N and member["bad_count"] == 0, member["bad"]
    # Every batch of the group's two epochs was made by the trials' actors (their only producers);
    # a batch made ahead of a pass counts in the pass before it, so the sum is over every pass.
    assert produced >= 2 * BATCHES
    assert shared > 0, "a trial took batches the other's actors made"
    assert segments(isolated) == []


@needs_cluster
def test_a_trial_with_ray_prep_that_starts_an_hp_group_stages_its_own_batch_size(cluster, isolated, tmp_path):
    """The default staged batch doubles the first trial's batch size (issue 47), but a trial's Ray
    actors make batches of its batch_size: a group it starts stages that, or it would refuse itself."""
    root = make_tree(tmp_path / "train", classes=4, per_class=64)  # 256 samples: room to double 8 twice
    r = ok(drive(cluster, tmp_path, "hp_stage", root))
    assert r["stage_batch"] == 8
    assert sorted(r["ids"]) == list(range(256))
    assert segments(isolated) == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@needs_cluster
def test_a_gpu_trainer_gets_the_actors_batches_on_its_gpu(cluster, tiny_dataset, isolated, tmp_path):
    """The GPU path: CPU actors' batches moved to the trainer's GPU (bit-equal to CPU prep), uint8
    ones normalised there, and the trainer's own share decoded on the GPU beside them."""
    r = ok(drive(cluster, tmp_path, "gpu", tiny_dataset))
    reference = r["reference"][0]["ids"]
    for name in ("remote", "uint8", "both"):
        assert r[name]["devices"] == ["cuda:0"], (name, r[name]["devices"])
        exactly_once(r[name]["ids"])
        assert r[name]["ids"] == reference
    assert r["remote"]["bad_count"] == 0, r["remote"]["bad"]
    assert r["uint8"]["max_diff"] <= 1e-5
    both = r["both"]["stats"]
    assert both["remote_units"] + both["local_units"] == BATCHES
    assert r["both"]["max_diff"] < 0.5  # the GPU decoder's pixels differ from the CPU's by a few levels
    assert segments(isolated) == []
