"""The benchmarks: the runner's arithmetic (``benchmarks.run``), the Pillow loaders' shared
augmentation, the harness's list of scenarios and its result schema, and small end-to-end runs of
the scenarios, each run as ``python -m benchmarks NAME`` from the repository root; every result
they write is read back through the schema (``_result``)."""

from __future__ import annotations

import json
import os
import pickle
import random
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from benchmarks import loaders, run
from benchmarks.harness import cli, results

ROOT = Path(__file__).resolve().parents[1]


def _result(path, scenario: str) -> dict:
    """A result file read back through the schema: every field there (``results.load`` raises
    otherwise), the scenario's name, the command that makes it again, the machine and the commit."""
    r = results.load(path)
    assert r["scenario"] == scenario and r["command"].startswith(f"python -m benchmarks {scenario}")
    assert r["machine"]["cores"] > 0 and r["machine"]["memory_bytes"] > 0 and r["machine"]["python"]
    assert len(r["commit"]) >= 40 and r["date"][:2] == "20"
    return r


def _figures(path, scenario: str) -> dict:
    """A scenario's figures (``_result``'s ``results``) with the dataset, command and machine beside them."""
    r = _result(path, scenario)
    return {**r["results"], "dataset": r["dataset"], "command": r["command"], "machine": r["machine"]}


def test_scenarios_listed():
    """``python -m benchmarks`` lists every scenario module (one with ``options`` and ``run``) with its
    one-line description, and nothing else; ``NAME --help`` shows a scenario's options."""
    modules = {p.stem for p in (ROOT / "benchmarks").glob("*.py") if "\ndef run(" in p.read_text()}
    helpers = {"loaders", "small_resnet", "__init__", "__main__"}
    helpers |= {p.stem for p in (ROOT / "benchmarks").glob("*_baselines.py")}
    assert modules and not modules & helpers
    p = subprocess.run([sys.executable, "-m", "benchmarks"], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert p.returncode == 0, p.stderr
    listed = {}
    for line in p.stdout.split("scenarios:\n", 1)[1].splitlines():
        name, what = line.split(None, 1)
        listed[name] = what
    assert set(listed) == set(cli.scenarios()) == modules
    assert all(what.endswith(".") and len(what) > 20 for what in listed.values()), listed
    h = subprocess.run(
        [sys.executable, "-m", "benchmarks", "miss_path", "--help"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert h.returncode == 0 and "python -m benchmarks miss_path" in h.stdout and "--reps" in h.stdout
    bad = subprocess.run([sys.executable, "-m", "benchmarks", "no_such"], capture_output=True, text=True, cwd=ROOT)
    assert bad.returncode == 2 and "no scenario 'no_such'" in bad.stderr


def test_result_schema(tmp_path):
    """A result written by the harness carries every field of the schema; one without them is refused."""
    import argparse

    args = argparse.Namespace(out=str(tmp_path / "r.json"), reps=2, _scenario="miss_path", _argv=["--reps", "2"])
    cli.save(args, {"dataset": {"files": 3}, "median": {"warm": 1.0}})
    r = _result(tmp_path / "r.json", "miss_path")
    assert r["command"] == "python -m benchmarks miss_path --reps 2" and r["options"] == {"out": args.out, "reps": 2}
    assert r["dataset"] == {"files": 3} and r["results"] == {"median": {"warm": 1.0}}
    assert set(r) == set(results.FIELDS) and set(results.MACHINE) <= set(r["machine"])
    (tmp_path / "old.json").write_text(json.dumps({"machine": {}, "median": {}}))
    with pytest.raises(ValueError, match="missing"):
        results.load(tmp_path / "old.json")


def test_an_earlier_result_keeps_what_a_run_does_not_measure_with_its_origin(tmp_path):
    """``hp_group.kept``: a run that measures some of a result file's figures keeps the others, each named
    with the command, commit and date it came from (its own, or the one it already had); nothing from a
    file of another dataset, of an old shape, or no file."""
    import argparse

    path = tmp_path / "r.json"
    args = argparse.Namespace(out=str(path), _scenario="hp_group", _argv=["--scenarios", "a,b"])
    origin_c = {"command": "python -m benchmarks hp_group --scenarios c", "commit": "x" * 40, "date": "2026-01-01"}
    cli.save(args, {"dataset": {"total_bytes": 10}, "a": 1, "b": 2, "c": 3, "earlier": {"c": origin_c}})
    first = results.load(path)
    origin = {k: first[k] for k in ("command", "commit", "date")}
    from benchmarks.hp_group import kept

    assert kept(path, ["a"], {"total_bytes": 10}) == {"b": 2, "c": 3, "earlier": {"b": origin, "c": origin_c}}
    assert kept(path, ["a", "b", "c"], {"total_bytes": 10}) == {}
    assert kept(path, ["a"], {"total_bytes": 11}) == {}
    (tmp_path / "old.json").write_text(json.dumps({"machine": {}, "a": 1}))
    assert kept(tmp_path / "old.json", []) == kept(tmp_path / "none.json", []) == {}


def test_bandwidth_specs():
    assert run.parse_bandwidth("0.25P") == (0.25, "P")
    assert run.parse_bandwidth("2p") == (2.0, "P")
    assert run.parse_bandwidth("20MB") == (20e6, "B/s")
    assert run.parse_bandwidth("none") is None
    cell = {"name": "x", "bandwidth": (0.5, "P")}
    assert run.resolve_bandwidth(cell, prep_bps=80e6) == 40_000_000
    with pytest.raises(SystemExit, match="prep rate"):
        run.resolve_bandwidth(cell, prep_bps=None)


def _run(scenario, loader, seconds, device_bytes, samples_per_s=100.0, storage=None):
    r = {
        "scenario": scenario,
        "loader": loader,
        "bandwidth_bps": None,
        "epochs": [{"seconds": 1.0}],
        "steady": {
            "seconds": seconds,
            "device_bytes": device_bytes,
            "samples_per_s": samples_per_s,
            "wait_s": 0.0,
            "peak_memory_bytes": 1,
        },
    }
    if storage is not None:
        r["steady"]["coordl_storage_bytes"] = storage
    return r


def test_summary_ratios_and_bound():
    result = {
        "dataset": {"total_bytes": 1000, "files": 100, "mean_bytes": 10},
        "prep_rate_samples_per_s": 50.0,  # 100 files: 2 s at the prep rate
        "scenarios": [
            {"name": "fits", "cache": 1.0, "bandwidth_bps": None},
            {"name": "io", "cache": 0.5, "bandwidth_bps": 100},
        ],
        "runs": [
            _run("fits", "dali-seq", 2.0, 0, samples_per_s=50.0),
            _run("fits", "coordl", 2.1, 0, samples_per_s=47.0),
            _run("io", "torch", 9.0, 800),
            _run("io", "dali-shuffle", 6.0, 600),
            _run("io", "coordl", 5.5, 510, storage=500),
            _run("io", "coordl-torch", 4.5, 505, storage=500),  # not a baseline: compared with torch
        ],
    }
    rows = {r["scenario"]: r for r in run.summarise(result)}
    assert run.prep_rate(result["runs"]) == 50.0
    assert rows["fits"]["best_baseline"] == "dali-seq"
    assert rows["fits"]["speedup_vs_best"] == pytest.approx(2.0 / 2.1)
    assert rows["fits"]["bound_s"] == pytest.approx(2.0)
    io = rows["io"]
    assert io["minimum_bytes"] == 500
    assert io["best_baseline"] == "dali-shuffle"
    assert io["speedup_vs_best"] == pytest.approx(6.0 / 5.5)
    assert io["coordl_device_over_min"] == pytest.approx(510 / 500)
    assert io["bound_s"] == pytest.approx(max(500 / 100, 2.0))  # fetch-bound: 5 s
    assert io["coordl_over_bound"] == pytest.approx(5.5 / 5.0)
    assert io["coordl_torch_speedup_vs_torch"] == pytest.approx(9.0 / 4.5)
    assert io["coordl_torch_device_over_min"] == pytest.approx(505 / 500)


def test_prep_rate_of_pillow_pipelines_without_dali():
    runs = [_run("fits", "torch", 2.0, 0, samples_per_s=40.0), _run("fits", "coordl-torch", 2.1, 0, samples_per_s=38.0)]
    assert run.prep_rate(runs) == 40.0
    assert run.prep_rate(runs + [_run("fits", "dali-seq", 1.0, 0, samples_per_s=80.0)]) == 80.0  # DALI's first


def _bench_cgroups() -> set[str]:
    found = set()
    for controller in ("memory", "blkio"):
        base = Path("/sys/fs/cgroup") / controller
        if base.is_dir():
            found |= {str(p) for p in base.rglob("coordl-bench-*") if p.is_dir()}
    return found


@pytest.mark.slow
def test_runner_end_to_end(tmp_path):
    """Two loaders, the 'fits' scenario and one limited scenario, two epochs each: results
    for every run, the report files, and no cgroup left behind."""
    before = _bench_cgroups()
    out = tmp_path / "out"
    cmd = [
        sys.executable,
        "-m",
        "benchmarks",
        "run",
        "--data",
        str(tmp_path / "ds"),
        "--images",
        "48",
        "--classes",
        "3",
        "--loaders",
        "dali-seq,coordl",
        "--cache",
        "0.5",
        "--bandwidth",
        "0.5P",
        "--epochs",
        "2",
        "--fit-epochs",
        "2",
        "--batch-size",
        "8",
        "--workers",
        "1",
        "--warmup-batches",
        "1",
        "--baseline-slack",
        "64MB",
        "--out",
        str(out),
    ]
    # 48 tiny images are far fewer bytes than DALI's own memory swings between runs; without
    # headroom the baseline was, now and then, OOM-killed under its measured working set.
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=os.environ, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    result = _figures(out / "results.json", "run")
    assert [(r["scenario"], r["loader"]) for r in result["runs"]] == [
        ("fits", "dali-seq"),
        ("fits", "coordl"),
        ("0.5P@0.5", "coordl"),
        ("0.5P@0.5", "dali-seq"),
    ]
    for r in result["runs"]:
        assert "error" not in r, r["error"]
        assert [e["samples"] for e in r["epochs"][1:]] == [48]  # every steady epoch is whole
    coordl = [r for r in result["runs"] if r["loader"] == "coordl"]
    assert coordl[0]["epochs"][1]["counters"]["storage_bytes"] == 0  # everything cached
    half = coordl[1]["epochs"][1]["counters"]
    assert half["storage_bytes"] == result["dataset"]["total_bytes"] - half["cache_bytes"]
    assert result["prep_rate_samples_per_s"] > 0
    assert {row["scenario"] for row in result["summary"]} == {"fits", "0.5P@0.5"}
    assert "| 0.5P@0.5 |" in (out / "results.md").read_text()
    if result["limits"]["memory"]:
        assert coordl[1]["memory_limit_bytes"] > coordl[1]["cache_bytes"]
        seq = [r for r in result["runs"] if r["loader"] == "dali-seq"][1]
        assert seq["memory_limit_bytes"] >= 64 << 20
    else:
        assert result["limits"]["notes"], "running without limits must say why"
    try:
        import matplotlib  # noqa: F401

        assert (out / "results.png").stat().st_size > 0
    except ImportError:
        assert "matplotlib" in p.stderr
    assert _bench_cgroups() == before


def test_pillow_loaders_do_the_same_work(tiny_dataset):
    """``torch`` (files opened by path) and ``coordl-torch`` (coordl's ImageFolder) give the same
    tensor for the same sample and random state: the same decode and the same picklable augmentation."""
    import torch

    from coordl.datasets import ImageFolder

    augment = pickle.loads(pickle.dumps(loaders.TrainAugment()))
    by_path = loaders.PillowImageFolder(str(tiny_dataset), augment)
    by_coordl = ImageFolder(str(tiny_dataset), transform=augment)
    assert len(by_path) == len(by_coordl)
    for i in (0, 7, len(by_path) - 1):
        random.seed(i)
        a, label_a = by_path[i]
        random.seed(i)
        b, label_b = by_coordl[i]
        assert a.shape == (3, loaders.SIZE, loaders.SIZE) and a.dtype == torch.float32
        assert torch.equal(a, b) and label_a == label_b


@pytest.mark.slow
def test_torch_backend_quick(tmp_path):
    """``run --warm`` (was torch_backend) on a tiny dataset, one rep, then ``run``'s limited scenario for torch
    and coordl-torch (the commands docs/torch-backend.md gives, warm and with short memory and slow storage): the
    JSON's fields, coordl's counters exact (every warm epoch from its cache; a steady limited epoch reads exactly the
    dataset less its cache), the tables printed, and no cgroup left behind. (The fixture fails the
    test on shared memory left behind.)"""
    before = _bench_cgroups()
    out, data = tmp_path / "tb", ["--data", str(tmp_path / "ds"), "--images", "48", "--classes", "3"]
    cmd = [sys.executable, "-m", "benchmarks", "run", "--warm", "--loaders", "coordl-torch,coordl,torch", "--reps", "1"]
    cmd += [*data, "--batch-size", "8", "--workers", "2", "--out", str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=os.environ, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    result = _figures(out / "torch_backend.json", "run")
    total = result["dataset"]["total_bytes"]
    assert result["dataset"]["files"] == 48

    warm = result["warm"]
    assert [(e["rep"], e["loader"]) for e in warm["epochs"]] == [(0, "coordl-torch"), (0, "coordl"), (0, "torch")]
    assert all(e["samples"] == 48 and e["samples_per_s"] > 0 for e in warm["epochs"])
    assert set(warm["median_samples_per_s"]) == {"torch", "coordl-torch", "coordl"}
    assert warm["ratio_coordl_torch_over_torch"] > 0 and warm["target_ratio"] == 0.95
    coordl_epoch = warm["epochs"][0]["counters"]
    assert coordl_epoch["cache_hits"] == 48 and coordl_epoch["storage_reads"] == 0
    assert "coordl-torch / torch" in p.stdout

    # short memory (none here: a tiny dataset is smaller than a loader's memory swings), slow storage
    run_out = tmp_path / "run"
    cmd = [sys.executable, "-m", "benchmarks", "run", *data, "--loaders", "torch,coordl-torch", "--cache", "0.5"]
    cmd += ["--bandwidth", "0.5P", "--epochs", "2", "--fit-epochs", "2", "--warmup-batches", "1", "--workers", "2"]
    cmd += ["--batch-size", "8", "--no-memory-limit", "--out", str(run_out)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=os.environ, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    limited = _figures(run_out / "results.json", "run")
    runs = {r["loader"]: r for r in limited["runs"] if r["scenario"] == "0.5P@0.5"}
    assert set(runs) == {"torch", "coordl-torch"} and limited["dataset"]["total_bytes"] == total
    for name, r in runs.items():
        assert "error" not in r, r["error"]
        assert [e["epoch"] for e in r["epochs"]] == [0, 1] and r["bandwidth_bps"] > 0 and r["cache_fraction"] == 0.5
        assert r["epochs"][1]["device_bytes"] >= 0 and r["epochs"][1]["samples"] == 48
        assert ("counters" in r["epochs"][1]) == (name == "coordl-torch")
    steady = runs["coordl-torch"]["epochs"][1]["counters"]
    assert 0 < steady["storage_bytes"] == total - steady["cache_bytes"] < total
    (summary,) = [s for s in limited["summary"] if s["scenario"] == "0.5P@0.5"]
    assert summary["minimum_bytes"] > 0 and summary["coordl_torch_device_over_min"] > 0
    assert summary["coordl_torch_speedup_vs_torch"] > 0
    assert "coordl-torch vs torch" in (run_out / "results.md").read_text()
    assert _bench_cgroups() == before


@pytest.mark.slow
def test_ray_prep_quick(tmp_path):
    """ray_prep --quick: every configuration of both backends runs on a one-core Ray node in a private
    network namespace, the steady epoch's units go where the configuration says, the actor's batches weigh what a
    batch weighs, and no process of the node is left."""
    pytest.importorskip("ray")
    from benchmarks import ray_prep

    why = ray_prep.cannot_run()
    if why:
        pytest.skip(why)
    out = tmp_path / "ray_prep.json"
    command = [sys.executable, "-m", "benchmarks", "ray_prep", "--quick", "--data", str(tmp_path / "data")]
    proc = subprocess.run(command + ["--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = _figures(out, "ray_prep")
    assert result["ray_processes_left"] == []
    assert result["object_store"]["cumulative spill requests"] == 0  # 4 batches of 19 MB in flight at most
    assert {(r["backend"], r["config"]) for r in result["runs"]} == {
        (b, c) for b in ("dali", "torch") for c in ("local", "remote", "both")
    }
    for r in result["runs"]:
        assert [e["samples"] for e in r["epochs"]] == [64, 64] and r["steady_samples_per_s"] > 0
        (steady,) = r["epochs"][1:]
        split = (steady["stats"].get("remote_units", 0), steady["stats"].get("local_units", 0))
        assert sum(split) == (0 if r["config"] == "local" else 2)
        if r["config"] == "remote":
            assert split == (2, 0) and r["actor_s_per_unit"] > 0 and r["actor_pids"]
            assert r["steady_cpu_s_per_sample"]["actor"] > 0
        if r["config"] != "local" and r["backend"] == "dali" and split[0]:
            assert r["remote_result_bytes_per_sample"] == r["image_bytes"] == 3 * 224 * 224 * 4
    assert set(result["summary"]) == {"dali", "torch"}
    assert all(s["ratio"]["both"] > 0 and s["ratio"]["remote"] > 0 for s in result["summary"].values())
    assert "| dali | both |" in proc.stdout and "remote/local" in proc.stdout


def test_multinode_quick(tmp_path):
    """multinode --quick: 2 namespaced nodes, modes a/b/c, storage at the minimum."""
    from coordl_testing import netns

    why = netns.unavailable() or (
        None if Path("/sys/fs/cgroup/blkio/blkio.throttle.read_bps_device").exists() else "no v1 blkio cgroup"
    )
    if why:
        pytest.skip(why)
    out = tmp_path / "multinode.json"
    data = tmp_path / "data"
    env = {k: v for k, v in os.environ.items() if not k.startswith("COORDL_SHM")}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks",
            "multinode",
            "--quick",
            "--data",
            str(data),
            "--out",
            str(out),
            "--aggregate",
            "1.0",
        ],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = _figures(out, "multinode")
    (check,) = result["checks"]
    assert check["b_storage_at_minimum"] and check["c_storage_at_minimum"] and check["b_storage_bytes"] == 0
    assert check["c_peer_bytes"] < check["b_peer_bytes"]
    assert out.with_suffix(".md").exists()


def test_train_example_quick(tmp_path):
    """train_example --quick: the ImageNet example with both loaders, in cgroups."""
    data = tmp_path / "data"
    checkpoints = set(Path(tempfile.gettempdir()).glob("coordl-train-example-*"))
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "train_example", "--quick", "--data", str(data), "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = _figures(tmp_path / "train_example_quick.json", "train_example")
    assert [r["loader"] for r in result["runs"]] == ["coordl", "torch"]
    for one in result["runs"]:
        assert one["returncode"] == 0 and [e["epoch"] for e in one["epochs"]] == [0, 1]
    # Epoch 0 reads the 128 training images from storage; with --cache 0.5, epoch 1 reads only
    # what the cache does not hold.
    first, second = (
        re.search(r"storage [\d.]+ MB in (\d+) reads, cache hits (\d+) ", e["line"]).groups()
        for e in result["runs"][0]["epochs"]
    )
    assert first == ("128", "0")
    assert int(second[0]) + int(second[1]) == 128 and 0 < int(second[1]) < 128
    assert (tmp_path / "train_example_quick.md").exists()
    assert set(Path(tempfile.gettempdir()).glob("coordl-train-example-*")) == checkpoints  # removed


def test_index_scale_small(tmp_path):
    """index --what scale on a 3 x 20 tree: every figure measured, the tree removed after."""
    data, out = tmp_path / "data", tmp_path / "index_scale.json"
    command = [sys.executable, "-m", "benchmarks", "index", "--what", "scale", "--data", str(data), "--out", str(out)]
    small = ["--classes", "3", "--per-class", "20", "--reps", "1"]
    proc = subprocess.run(command + small, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    after = _figures(out, "index")
    assert after["samples"] == 60 and after["load_s"] > 0 and after["file_bytes"] > 0
    assert after["worker_after_walk"]["dirty"] < 5e6 and "heap_bytes" in after
    assert not data.exists()
    (data / "train").mkdir(parents=True)  # a tree it did not make is never replaced
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "not made by this benchmark" in proc.stderr and (data / "train").is_dir()


def test_index_currency_small(tmp_path):
    """index --what currency on a 3 x 20 tree and 2 s3:// classes of 30 keys: every check measured, the
    rewritten files and the replaced object found, one listing per check, the tree removed after."""
    data, out = tmp_path / "data", tmp_path / "index_currency.json"
    command = [sys.executable, "-m", "benchmarks", "index", "--what", "currency", "--data", str(data)]
    command += ["--out", str(out)]
    small = ["--classes", "3", "--per-class", "20", "--reps", "1", "--threads", "1", "4", "--changed", "5"]
    small += ["--no-cold", "--s3-classes", "2", "--s3-per-class", "30", "--latency-ms", "2"]
    proc = subprocess.run(command + small, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = _figures(out, "index")
    files, s3 = result["files"], result["s3"]
    assert (
        files["scan"]["samples"] == 60 and files["changed"]["changed"] == 5 and files["after_changed"]["changed"] == 0
    )
    assert [r["threads"] for r in files["check_warm_by_threads"]] == [1, 4] and files["check_cold_by_threads"] == []
    assert s3["objects"] == 60 and s3["changed"]["changed"] == 1
    assert all(r["list_requests"] == 3 and r["object_requests"] == 0 for r in s3["check"])  # classes, then each
    assert s3["extrapolated"]["pages"] == 2001 and not data.exists()


def test_tars_index_small(tmp_path):
    """index --what tars on 4 sparse shards of 10 samples: both ways of indexing measured, every sample found."""
    data, out = tmp_path / "data", tmp_path / "tars_index.json"
    command = [sys.executable, "-m", "benchmarks", "index", "--what", "tars", "--data", str(data), "--out", str(out)]
    small = ["--shards", "4", "--per-shard", "10", "--reps", "1", "--keep"]
    proc = subprocess.run(command + small, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = _figures(out, "index")["rows"]
    assert {r["processes"].split()[-1] for r in rows} == {"one", "workers"}
    assert all(
        r["samples"] == 40 and r["index_s"] > 0 and r["load_saved_s"] > 0 and r["warm_index_s"] > 0 for r in rows
    )
    (alone,) = [r for r in rows if "reads" in r]
    assert alone["reads"] == 4 * (10 + 1)  # a shard's start, then after each image: where the window moves
    assert os.path.getsize(data / "tars" / "shard-000000.tar") > 10 * 60_000  # the images' bytes are holes, not missing


def test_tars_s3_index_small(tmp_path):
    """index --what tars-s3 on 2 shards of 60 samples, small and large members: every way
    measured, every sample found; left to choose, the small members' shards are streamed (few GETs)
    and the large members' read by range GETs (few bytes)."""
    out = tmp_path / "s3_index.json"
    command = [sys.executable, "-m", "benchmarks", "index", "--what", "tars-s3", "--members", "1KB-2KB,60KB-80KB"]
    command += ["--shards", "2", "--per-shard", "60", "--latency-ms", "2", "--reps", "1", "--out", str(out)]
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {(r["members"], r["how"].split()[0]): r for r in _figures(out, "index")["rows"]}
    assert len(rows) == 6 and all(r["samples"] == 120 for r in rows.values())
    small, large = ("1KB-2KB", "60KB-80KB")
    assert rows[small, "one"]["gets"] == 2 and rows[large, "one"]["gets"] == 2  # one GET a shard
    assert rows[large, "range"]["gets"] == 2 * 61  # a shard's start, then after each image
    assert rows[small, "left"]["gets"] < rows[small, "range"]["gets"] / 2
    assert rows[large, "left"]["gets"] == rows[large, "range"]["gets"]
    assert rows[large, "left"]["bytes"] < rows[large, "one"]["bytes"] / 10


@pytest.mark.parametrize("store", ["local", "s3"])
def test_tars_epochs_small(tmp_path, store):
    """tars_epochs on 48 photos in 4 shards: every loader runs every epoch whole, coordl's
    later epochs read exactly the uncached samples' bytes (its count; on s3 the store's too)."""
    if store == "local" and os.geteuid() != 0:
        pytest.skip("the shards' own file system (a loop device) needs root")
    out = tmp_path / "epochs.json"
    command = [sys.executable, "-m", "benchmarks", "tars_epochs", "--data", str(tmp_path / "photos")]
    command += ["--images", "48", "--classes", "4", "--width", "160", "--height", "120", "--per-shard", "12"]
    command += ["--shards-dir", str(tmp_path / "shards"), "--epochs", "2", "--batch-size", "16", "--workers", "1"]
    command += ["--cache", "0,1", "--store", store, "--latency", "0.005", "--out", str(out)]
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = _figures(out, "tars_epochs")
    rows = {r["loader"]: r for r in result["rows"]}
    assert set(rows) == {"coordl cache 0", "coordl cache 1", "webdataset", "dali"}
    assert all(e["samples"] == 48 for r in rows.values() for e in r["epochs"]), rows
    total = result["dataset"]["total_bytes"]
    assert rows["coordl cache 0"]["least_bytes"] == total and rows["coordl cache 1"]["least_bytes"] == 0
    for r in (rows["coordl cache 0"], rows["coordl cache 1"]):
        assert [e["stats"]["storage_bytes"] for e in r["epochs"]] == [total, r["least_bytes"]]
    if store == "s3":
        assert rows["coordl cache 1"]["epochs"][1]["gets"] == 0
        assert all(e["gets"] == 4 and e["get_bytes"] > total for e in rows["webdataset"]["epochs"])  # whole shards
        assert rows["coordl cache 0"]["epochs"][1]["get_bytes"] >= total  # merged reads carry the headers too
    else:
        assert result["device"].startswith("/dev/loop")
        assert not Path(result["device"]).exists() or result["device"] not in Path("/proc/mounts").read_text()
    assert not list(tmp_path.glob("*.img"))  # the file system's image is removed


def test_miss_path_small(tmp_path):
    """miss_path on 600 tiny JPEGs: every mode runs, reads what it should, and is compared."""
    data, out = tmp_path / "tiny", tmp_path / "miss_path.json"
    command = [
        sys.executable,
        "-m",
        "benchmarks",
        "miss_path",
        "--data",
        str(data),
        "--images",
        "600",
        "--classes",
        "4",
    ]
    command += ["--synthetic", "--batch-size", "64", "--reps", "1", "--out", str(out)]
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = _figures(out, "miss_path")
    assert set(result["median"]) == {"dali-reader", "no-cache", "filling", "warm"}
    assert all(v > 0 for v in result["median"].values())
    assert set(result["ratio_to_dali_reader"]) == {"no-cache", "filling", "warm"}
    (nocache,), (filling,), (warm,) = (result["stats"][m] for m in ("no-cache", "filling", "warm"))
    assert nocache["storage_reads"] == 600 and nocache["cache_items"] == 0
    assert filling["storage_reads"] == 600 and 0 < filling["cache_items"] < 600
    assert warm["storage_reads"] == 0 and warm["cache_hits"] == 600


def test_decoded_tier_small(tmp_path):
    """decoded_tier on 96 photo-like JPEGs: every configuration runs, a prediction stands
    beside each, the tier serves every sample where it holds the dataset, and the plot is drawn.
    (640x480, so that even the capped tier is above the smallest tier "auto" keeps, 16 MiB.)"""
    data, out = tmp_path / "data", tmp_path / "out"
    command = [sys.executable, "-m", "benchmarks", "decoded_tier", "--data", str(data), "--images", "96"]
    command += ["--classes", "4", "--width", "640", "--height", "480", "--epochs", "2", "--repeat", "1"]
    command += ["--fractions", "0", "1", "--max-short-side", "256", "--jobs", "2", "--job-epochs", "1"]
    command += ["--batch", "16", "--out", str(out)]
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = _figures(out / "decoded_tier.json", "decoded_tier")
    runs = {str(r["fraction"]): r for r in result["split"]["runs"]}
    assert set(runs) == {"auto", "auto-half", "0.0", "1.0", "capped-auto-256", "capped-0-256"}
    assert all(r["predicted_samples_per_s"] > 0 and r["steady_samples_per_s"] > 0 for r in runs.values())
    for name in ("1.0", "auto", "capped-auto-256"):
        assert runs[name]["repeats"][0]["epochs"][1]["decoded_hits"] == 96
    assert runs["0.0"]["repeats"][0]["epochs"][1]["decoded_hits"] == 0
    assert {(j["jobs"], j["config"]) for j in result["jobs"]} == {
        (2, "decoded_cache=0"),
        (2, "decoded tier"),
        (2, "hp_group"),
    }
    assert (out / "decoded_tier.png").stat().st_size > 0


def test_prep_ops_small(tmp_path):
    """prep_ops times every pipeline it lists."""
    data, out = tmp_path / "data", tmp_path / "out"
    command = [sys.executable, "-m", "benchmarks", "prep_ops", "--data", str(data), "--images", "64", "--classes", "2"]
    command += ["--width", "160", "--height", "120", "--samples", "64", "--batch", "16", "--seconds", "0.2"]
    command += ["--max-short-side", "64", "--out", str(out / "prep_ops.json")]
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = _figures(out / "prep_ops.json", "prep_ops")["lines"]
    assert len(lines) == 8 and all(line["samples_per_s"] > 0 for line in lines)


def test_s3_small(tmp_path):
    """s3 on 96 photo-like JPEGs: every configuration in the JSON, the proxy's object GETs equal to
    coordl's storage_reads in every epoch (a full cache reads nothing the second time), DALI's s3:// reader
    either measured or its failure recorded, and no moto server left running."""
    data, out = tmp_path / "data", tmp_path / "s3.json"
    command = [sys.executable, "-m", "benchmarks", "s3", "--data", str(data), "--images", "96", "--classes", "4"]
    command += ["--width", "200", "--height", "160", "--repeat", "1", "--out", str(out)]
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = _figures(out, "s3")
    names = {"coordl-0", "coordl-0.5", "coordl-1", "dali-s3", "dali-local", "capacity-0", "capacity-0.02"}
    assert set(result["runs"]) == names and set(result["summary"]) == names
    assert result["objects"] == 96 and result["machine"]["cores"] == os.cpu_count()
    for name in ("coordl-0", "coordl-0.5", "coordl-1", "dali-local", "capacity-0", "capacity-0.02"):
        (run,) = result["runs"][name]
        assert "error" not in run, run["error"]
    for name, cached in (("coordl-0", {0}), ("coordl-0.5", set(range(1, 96))), ("coordl-1", {96})):
        (run,) = result["runs"][name]
        assert run["create_requests"]["listing_requests"] > 0 and run["create_requests"]["gets"] == 0
        assert [e["samples"] for e in run["epochs"]] == [96, 96]
        for e in run["epochs"]:
            assert e["gets"] == e["stats"]["storage_reads"] and e["get_bytes"] == e["stats"]["storage_bytes"]
        hits = run["epochs"][1]["stats"]["cache_hits"]
        assert run["epochs"][0]["gets"] == 96 and hits in cached and run["epochs"][1]["gets"] == 96 - hits
        assert result["summary"][name]["epochs"][1]["samples_per_s"]["median"] > 0
    dali = result["runs"]["dali-s3"][0]
    if "error" in dali:
        assert result["dali_s3"] == {"works": False, "error": dali["error"]} and dali["error"]
    else:
        assert result["dali_s3"]["works"] and all(e["samples"] == 96 and e["gets"] >= 96 for e in dali["epochs"])
    assert all(e["gets"] == 0 for e in result["runs"]["dali-local"][0]["epochs"])
    for name in ("capacity-0", "capacity-0.02"):
        (e,) = result["runs"][name][0]["epochs"]
        assert e["gets"] == 96 and e["samples_per_s"] > 0
    assert "| coordl-0.5 | 1 |" in proc.stdout and "server capacity" in proc.stdout
    cmdline = Path(f"/proc/{result['moto_pid']}/cmdline")  # the benchmark's moto server is gone
    assert not cmdline.exists() or b"moto.server" not in cmdline.read_bytes()


def test_s3_clients_small(tmp_path):
    """s3 --clients on 24 small JPEGs: both clients GET every object and report their CPU per GET."""
    data, out = tmp_path / "data", tmp_path / "s3_clients.json"
    command = [sys.executable, "-m", "benchmarks", "s3", "--clients", "--data", str(data), "--images", "24"]
    command += ["--classes", "2", "--width", "120", "--height", "100", "--objects", "24", "--repeat", "1"]
    command += ["--out", str(out)]
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = _figures(out, "s3")
    assert result["command"].startswith("python -m benchmarks s3 --clients")
    assert set(result["runs"]) == set(result["summary"]) == {"client-boto3", "client-obstore"}
    for name, (one,) in result["runs"].items():
        assert "error" not in one and [e["samples"] for e in one["epochs"]] == [24], one
        assert all(result["summary"][name][k]["median"] > 0 for k in ("cpu_ms_per_get", "gets_per_s"))


def test_hp_mix_small(tmp_path):
    """hp_group's scenarios same, mix, handoff and slow (once hp_mix) on 128 small photos: every
    scenario runs and compares what it should, every epoch of every job of every run is exactly once,
    and the jobs leave nothing in shared memory nor in the temporary folder (its work folder was left in
    /tmp by every run before)."""
    out, shm = tmp_path / "hp_mix.json", tempfile.mkdtemp(prefix="coordl-test-", dir="/dev/shm")
    command = [sys.executable, "-m", "benchmarks", "hp_group", "--data", str(tmp_path / "photos"), "--images", "128"]
    command += ["--classes", "4", "--width", "160", "--height", "120", "--epochs", "2", "--reps", "1"]
    command += ["--scenarios", "same,mix,handoff,slow", "--out", str(out)]
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    try:
        env = dict(os.environ, COORDL_SHM_DIR=shm, TMPDIR=str(tmp))
        proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900, env=env)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        r = _figures(out, "hp_group")
        assert [row["jobs"] for row in r["same"]] == [2, 4]
        runs = [run for row in r["same"] for m in ("alone", "group") for run in row[m]]
        runs += [run for m in ("alone", "group") for run in r["mix"][m]]
        runs += [run for m in ("pair", "trio", "beside") for run in r["slow_sleep_0"][m]]
        assert runs and all(run["exactly_once"] for run in runs)
        assert [len(run["per_job_samples_per_s"]) for run in r["slow_sleep_0"]["trio"]] == [3]
        assert [(h["batch"], h["staged"]) for h in r["handoff"]] == [(64, 64), (16, 64), (64, 16)]
        assert "earlier" not in r
        # A second run into the same file keeps the scenarios it does not measure, each naming the
        # command it came from: the file's envelope is the second run's.
        first = results.load(out)["command"]
        again = [*command[: command.index("--scenarios")], "--scenarios", "handoff", "--out", str(out)]
        proc = subprocess.run(again, cwd=ROOT, capture_output=True, text=True, timeout=900, env=env)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        r2 = _figures(out, "hp_group")
        assert sorted(r2["earlier"]) == ["mix", "same", "slow_sleep_0"]
        assert {e["command"] for e in r2["earlier"].values()} == {first} != {results.load(out)["command"]}
        assert r2["same"] == r["same"] and [(h["batch"], h["staged"]) for h in r2["handoff"]] == [
            (64, 64),
            (16, 64),
            (64, 16),
        ]
        assert os.listdir(shm) == [] and os.listdir(tmp) == []
    finally:
        shutil.rmtree(shm, ignore_errors=True)


def test_hp_sweep_small(tmp_path):
    """hp_group's scenario sweep (once hp_sweep) on 1,024 small photos: in either start order, the
    shorthand stages 128 samples as stage_batch=128 does, every batch of every trial is a view, every
    epoch exactly once, and the trials leave nothing in shared memory."""
    out, shm = tmp_path / "hp_sweep.json", tempfile.mkdtemp(prefix="coordl-test-", dir="/dev/shm")
    command = [sys.executable, "-m", "benchmarks", "hp_group", "--data", str(tmp_path / "photos"), "--images", "1024"]
    command += ["--classes", "4", "--width", "160", "--height", "120", "--epochs", "2", "--reps", "1"]
    command += ["--scenarios", "sweep", "--modes", "shorthand,stage128", "--out", str(out)]
    try:
        env = dict(os.environ, COORDL_SHM_DIR=shm)
        proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900, env=env)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        r = _figures(out, "hp_group")["sweep"]
        runs = [
            run for m in ("shorthand", "stage128") for order in ("16-first", "128-first") for run in r["runs"][m][order]
        ]
        assert len(runs) == 4 and all(run["exactly_once"] for run in runs)
        assert all(run["stage_batch"] == [128] and set(run["views"].values()) == {1.0} for run in runs)
        assert set(r["shorthand_over_stage128"]) == {"16-first", "128-first"}
        assert os.listdir(shm) == []
    finally:
        shutil.rmtree(shm, ignore_errors=True)


def test_detection_smoke(tmp_path):
    """detection --smoke on 40 small photo JPEGs: every loader of the prep scenario and both
    modes of the HP group run every epoch whole, the JSON holds the figures the docs quote, and the
    jobs leave nothing in shared memory."""
    out, shm = tmp_path / "detection.json", tempfile.mkdtemp(prefix="coordl-test-", dir="/dev/shm")
    command = [sys.executable, "-m", "benchmarks", "detection", "--smoke", "--data", str(tmp_path / "coco")]
    command += ["--out", str(out)]
    try:
        env = dict(os.environ, COORDL_SHM_DIR=shm)
        proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        r = _figures(out, "detection")
        assert r["dataset"]["files"] == 40 and r["dataset"]["total_bytes"] > 0 and r["dataset"]["boxes"] > 0
        assert r["command"].startswith("python -m benchmarks detection --smoke") and r["machine"]["cores"] > 0
        assert r["python_per_batch"]["plan_ms"] > 0 and r["python_per_batch"]["targets_ms"] > 0
        prep = r["prep"]
        assert set(prep["runs"]) == set(prep["median"]) == {"coordl", "dali", "torch"}
        assert set(prep["ratios"]) == {"coordl/dali", "coordl/torch"}
        for runs in prep["runs"].values():
            (run,) = runs
            assert [(e["warmup"], e["samples"]) for e in run["epochs"]] == [(True, 40), (False, 40)]
            assert run["samples_per_s"] > 0 and run["cpu_s_per_sample"] > 0
        (coordl_run,) = prep["runs"]["coordl"]
        assert coordl_run["epochs"][1]["stats"]["storage_reads"] == 0  # the measured epoch from the cache
        hp = r["hp"]
        assert len(hp["speedups"]) == 1 and hp["speedups"][0] > 0
        for mode in ("separate", "group"):
            (run,) = hp[mode]
            assert len(run["per_trial_samples_per_s"]) == 2
            assert all(e["samples"] == 40 for j in run["jobs"] for e in j["epochs"])
        assert all(e["stats"]["produced"] is not None for j in hp["group"][0]["jobs"] for e in j["epochs"])
        assert "coordl/dali" in proc.stdout and "hp per-trial speedup" in proc.stdout
        assert os.listdir(shm) == []
    finally:
        shutil.rmtree(shm, ignore_errors=True)


def test_coco_index_small(tmp_path):
    """index --what coco on 300 images: cold and saved-index times measured, every box indexed, the
    files removed after."""
    data, out = tmp_path / "data", tmp_path / "coco_index.json"
    command = [sys.executable, "-m", "benchmarks", "index", "--what", "coco", "--images", "300", "--reps", "2"]
    command += ["--data", str(data), "--out", str(out)]
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = _figures(out, "index")
    assert r["images"] == 300 and r["boxes"] > 1000 and r["annotations_bytes"] > 0
    assert r["cold_s"] > 0 and len(r["loads_s"]) == 2 and r["load_s"] > 0
    assert r["box_bytes"] > 24 * r["boxes"] and r["index_file_bytes"] > r["box_bytes"]
    assert not data.exists()


def test_disk_tier_smoke(tmp_path):
    """disk_tier --smoke on 48 small photos: every configuration runs both epochs whole, the proxy's
    GETs equal coordl's storage reads, the tier's steady epoch GETs nothing and reads the tier (with and without
    O_DIRECT), LitData's cache reads nothing the second time, and the JSON holds the ratios and conversion times."""
    data, out = tmp_path / "data", tmp_path / "disk_tier.json"
    command = [sys.executable, "-m", "benchmarks", "disk_tier", "--smoke", "--no-drop", "--data", str(data)]
    command += ["--tier-root", str(tmp_path), "--out", str(out)]
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = _figures(out, "disk_tier")
    names = {"no-tier", "tier", "tier-direct", "local", "litdata"}
    assert (
        r["smoke"] and r["command"].startswith("python -m benchmarks disk_tier --smoke") and r["machine"]["cores"] > 0
    )
    assert r["dataset"]["files"] == 48 and r["dataset"]["total_bytes"] > 0 and r["dataset"]["mean_bytes"] > 0
    assert set(r["runs"]) == set(r["summary"]) == names and r["config"]["memory_bytes"] > 0
    conv = r["conversions"]["litdata"]
    assert conv["seconds"] > 0 and conv["chunks"] >= 1 and conv["bytes"] > r["dataset"]["total_bytes"]
    for name, runs in r["runs"].items():
        (run,) = runs
        assert "error" not in run, run["error"]
        assert [e["samples"] for e in run["epochs"]] == [48, 48]
        assert r["summary"][name]["steady_samples_per_s"]["median"] > 0
        for e in run["epochs"]:
            assert e["seconds"] > 0 and e["meminfo"]["page_cache"] > 0 and e["device_read"] >= 0
            if "stats" in e and name != "local":  # local: its storage reads are the folder's files
                assert e["gets"] == e["stats"]["storage_reads"] and e["get_bytes"] == e["stats"]["storage_bytes"]
    first, steady = r["runs"]["no-tier"][0]["epochs"]
    assert first["gets"] == 48 and steady["gets"] == 48 - steady["stats"]["cache_hits"] > 0
    for name in ("tier", "tier-direct"):
        first, steady = r["runs"][name][0]["epochs"]
        assert first["gets"] == 48 and first["stats"]["disk_admitted"] == 48 and first["resident_bytes"] is not None
        assert steady["gets"] == 0 and steady["stats"]["disk_reads"] == 48 - steady["stats"]["cache_hits"] > 0
        reads = r["runs"][name][0]["tier_read"]  # read back from 1 and 8 threads: every entry, whole
        assert [x["threads"] for x in reads] == [1, 8] and all(x["files"] == 48 for x in reads)
        assert all(x["bytes"] > r["dataset"]["total_bytes"] and x["bytes_per_s"] > 0 for x in reads)
    assert all(e["gets"] == 0 for e in r["runs"]["local"][0]["epochs"])
    first, steady = r["runs"]["litdata"][0]["epochs"]
    assert first["gets"] >= conv["chunks"] and first["get_bytes"] > r["dataset"]["total_bytes"] and steady["gets"] == 0
    assert first["page_cache_delta"] > r["dataset"]["total_bytes"] / 2  # its chunks, downloaded to its cache folder
    for tier in ("tier", "tier-direct"):
        assert {f"{tier}/{b}" for b in ("local", "no-tier", "litdata")} <= set(r["ratios"])
    assert all(x["of_medians"] > 0 for x in r["ratios"].values())
    assert (
        "| tier | 1 |" in proc.stdout
        and "entries read back" in proc.stdout
        and "tier/local" in proc.stdout
        and "litdata conversion" in proc.stdout
    )
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("coordl-disk-tier")]  # run folders removed
    cmdline = Path(f"/proc/{r['moto_pid']}/cmdline")  # the benchmark's moto server is gone
    assert not cmdline.exists() or b"moto.server" not in cmdline.read_bytes()


def test_audio_smoke(tmp_path):
    """audio --smoke on 40 short tones: every loader of the prep scenario and both modes of
    both HP scenarios (M5 steps, no model) run every epoch whole in windows of 32000 samples, the JSON
    holds the figures the docs quote, and the jobs leave nothing in shared memory."""
    out, shm = tmp_path / "audio.json", tempfile.mkdtemp(prefix="coordl-test-", dir="/dev/shm")
    command = [sys.executable, "-m", "benchmarks", "audio", "--smoke", "--data", str(tmp_path / "tones")]
    command += ["--out", str(out)]
    try:
        env = dict(os.environ, COORDL_SHM_DIR=shm)
        proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        r = _figures(out, "audio")
        assert r["dataset"]["files"] == 40 and r["dataset"]["total_bytes"] > 0 and r["dataset"]["mean_seconds"] > 0
        assert r["command"].startswith("python -m benchmarks audio --smoke") and r["machine"]["cores"] > 0
        prep = r["prep"]
        assert set(prep["runs"]) == set(prep["median"]) == {"coordl", "dali", "torch"}
        assert set(prep["ratios"]) == {"coordl/dali", "coordl/torch"}
        for runs in prep["runs"].values():
            (run,) = runs
            assert [(e["warmup"], e["samples"]) for e in run["epochs"]] == [(True, 40), (False, 40)]
            assert all(e["shape"][1:] == [1, 32000] for e in run["epochs"])
            assert run["samples_per_s"] > 0 and run["cpu_s_per_sample"] > 0
        (coordl_run,) = prep["runs"]["coordl"]
        assert coordl_run["epochs"][1]["stats"]["storage_reads"] == 0  # the measured epoch from the cache
        for name, step in (("hp", "m5"), ("hp-prep", "touch")):
            hp = r[name]
            assert hp["step"] == step and len(hp["speedups"]) == 1 and hp["speedups"][0] > 0
            for mode in ("separate", "group"):
                (run,) = hp[mode]
                assert len(run["per_trial_samples_per_s"]) == 2
                assert all(e["samples"] == 40 for j in run["jobs"] for e in j["epochs"])
            assert all(e["stats"]["produced"] is not None for j in hp["group"][0]["jobs"] for e in j["epochs"])
        assert "coordl/dali" in proc.stdout and "hp per-trial speedup" in proc.stdout
        assert os.listdir(shm) == []
    finally:
        shutil.rmtree(shm, ignore_errors=True)


def test_gpu_smoke(tmp_path):
    """gpu --cpu-smoke on 64 generated JPEGs: every loader (coordl, DALI's own pipeline, coordl on
    the CPU, DataLoader) in its CPU form, in both modes (a resnet_tiny training step, prep alone), delivers
    every sample of every epoch; the JSON holds positive rates, stall fractions in [0, 1] and CPU per sample,
    and the runs leave nothing in shared memory."""
    out, shm = tmp_path / "gpu.json", tempfile.mkdtemp(prefix="coordl-test-", dir="/dev/shm")
    command = [sys.executable, "-m", "benchmarks", "gpu", "--cpu-smoke", "--data", str(tmp_path / "data")]
    command += ["--out", str(out)]
    try:
        env = dict(os.environ, COORDL_SHM_DIR=shm)
        proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        r = _figures(out, "gpu")
        assert r["cpu_smoke"] and r["command"].startswith("python -m benchmarks gpu --cpu-smoke")
        assert r["machine"]["cores"] > 0 and r["config"]["device"] == "cpu" and r["config"]["arch"] == "resnet_tiny"
        data = r["dataset"]
        assert data["files"] == 64 and data["total_bytes"] > 0 and data["page_cache_read_bytes"] == data["total_bytes"]
        assert set(r["runs"]) == set(r["median"]) == {"coordl", "dali", "coordl-cpu", "torch"}
        for name, runs in r["runs"].items():
            (run,) = runs
            assert "error" not in run and "skipped" not in run, run
            assert run["device_id"] is None and run["model_from"] and run["params"] > 0
            assert [(e["mode"], e["warmup"], e["samples"]) for e in run["epochs"]] == [
                ("train", True, 64),
                ("train", False, 64),
                ("prep", False, 64),
            ]
            assert all(e["device"] == "cpu" and e["shape"][1:] == [3, 224, 224] for e in run["epochs"])
            for mode in ("train", "prep"):
                s = run["summary"][mode]
                assert s["samples_per_s"] > 0 and s["cpu_s_per_sample"] > 0 and 0 <= s["stall_fraction"] <= 1
                assert r["median"][name][mode]["samples_per_s"] > 0
                if name.startswith("coordl"):
                    assert 0 <= s["stats_stall_fraction"] <= 1
        assert {f"coordl/{o} {m}" for o in ("dali", "coordl-cpu", "torch") for m in ("train", "prep")} == set(
            r["ratios"]
        )
        assert "| coordl | train |" in proc.stdout and "| torch | prep |" in proc.stdout
        assert os.listdir(shm) == []
    finally:
        shutil.rmtree(shm, ignore_errors=True)


def test_a_child_that_writes_much_to_stderr_does_not_block_its_conversation(tmp_path):
    """``jobs.converse`` keeps a child's stderr in a file, not a pipe: a child that logs more than a
    pipe holds (64 KiB) before its next message still reaches it (with a pipe read only at the end,
    each side waited for the other)."""
    child = tmp_path / "child.py"
    child.write_text(
        "import json, sys\n"
        "sys.stderr.write('x' * 200_000 + '\\n')\n"
        "print(json.dumps({'event': 'epoch', 'n': 1}), flush=True)\n"
        "sys.stdin.readline()\n"
        "print(json.dumps({'event': 'done', 'ok': True}), flush=True)\n"
    )
    parent = (
        "import json, sys\n"
        "from benchmarks.harness import jobs\n"
        "heard = []\n"
        f"code, err, done = jobs.converse([sys.executable, {str(child)!r}], lambda e, m: heard.append([e, m]))\n"
        "print(json.dumps([code, len(err), done, heard]))\n"
    )
    # In a child of its own, so that a hang fails the test (killed: its child's stderr pipe breaks too).
    p = subprocess.run([sys.executable, "-c", parent], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout) == [0, 200_001, {"ok": True}, [["epoch", {"n": 1}]]]
