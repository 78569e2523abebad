"""DS-Analyzer: the accounting, the model, and ``coordl analyze`` end to end.

Rates are checked against controlled inputs: a fake storage of known bandwidth (a token
bucket in front of the real reads), a prep step of known cost (a sleeping transform) and a
training step of known cost (a sleep).
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import coordl
from coordl.accounting import BusyClock, StepWaits, epoch_line
from coordl.analyze import report as rep
from coordl.analyze.model import DETACHED_WHEN_SLOWER, Model, Rates, bottleneck, describe_bottleneck, stall_split
from coordl.fetch import storage

# -- a storage of known bandwidth ------------------------------------------------------------
SLOW_STORAGE = """
import threading, time
from coordl.fetch import storage

def throttle(bytes_per_s):
    lock, state = threading.Lock(), {"next": 0.0}
    real = storage.read_many

    def read_many(paths, sizes, buffers, *, drop_page_cache):
        failed = {}
        for k in range(len(paths)):
            with lock:  # one queue for every thread: the device's bandwidth, shared
                start = max(time.perf_counter(), state["next"])
                state["next"] = done = start + sizes[k] / bytes_per_s
            failed.update({k: e for e in real(paths[k : k + 1], sizes[k : k + 1], buffers[k : k + 1],
                                                drop_page_cache=drop_page_cache).values()})
            time.sleep(max(0.0, done - time.perf_counter()))
        return failed

    storage.read_many = read_many
"""
_ns: dict = {}
exec(SLOW_STORAGE, _ns)  # noqa: S102 - the same code the analysed script runs
throttle = _ns["throttle"]


@pytest.fixture
def slow_storage():
    real = storage.read_many
    yield lambda bps: throttle(bps)
    storage.read_many = real


# -- accounting --------------------------------------------------------------------------------
def test_busy_clock_counts_the_interval_in_progress():
    c = BusyClock()
    assert c.total() == 0.0
    t0 = time.perf_counter()
    c.enter()
    t1 = time.perf_counter()
    time.sleep(0.05)
    t2 = time.perf_counter()
    mid = c.total()
    t3 = time.perf_counter()
    # The clock's own readings fall between the test's: the interval so far, however long the sleep took.
    assert max(0.05, t2 - t1) <= mid <= t3 - t0
    c.leave()
    done = c.total()
    assert done >= mid
    time.sleep(0.02)
    assert c.total() == done  # not running: no longer grows
    c.leave()  # a stray leave changes nothing
    assert c.total() == done


def test_step_waits_split_and_summary():
    w = StepWaits()
    w.record(1.0, fetch=0.25)
    w.record(0.5, fetch=2.0)  # clamped to the wait
    w.record(0.2)  # not attributed
    w.add_tail(0.3)
    s = w.summary(elapsed_s=10.0)
    assert s["stall_s"] == pytest.approx(2.0)
    assert s["stall_fetch_s"] == pytest.approx(0.75)
    assert s["stall_prep_s"] == pytest.approx(0.75)
    assert s["compute_s"] == pytest.approx(8.0)
    assert s["wait_max_s"] == pytest.approx(1.0)
    assert s["wait_p50_s"] == pytest.approx(0.5)


def test_waits_on_slow_storage_are_fetch_bound(tiny_dataset, slow_storage):
    sizes = sum(p.stat().st_size for p in tiny_dataset.rglob("*.jpg"))
    # The dataset takes 4 s to read: slow against the prep's second or so even on busy cores (at 2 s,
    # a busy machine's prep stalls made up to 40% of the stall).
    bps = sizes / 4.0
    slow_storage(bps)
    with coordl.CoordLoader(
        tiny_dataset,
        batch_size=10,
        device_id=None,
        pipeline=coordl.ImageNetVal(size=32, resize=36),
        cache=0,
        prep=1,
        shuffle=True,
    ) as loader:
        for _ in loader:
            pass
        s = loader.stats()
    assert s["stall_s"] > 2.0
    assert s["stall_fetch_s"] > 0.8 * s["stall_s"], s
    assert s["stall_fetch_s"] + s["stall_prep_s"] <= s["stall_s"] + 1e-9
    assert s["read_s"] >= 3.0  # every read waited its turn at the device
    assert s["storage_bytes"] == sizes
    assert s["compute_s"] == pytest.approx(s["elapsed_s"] - s["stall_s"])
    assert 0 < s["wait_p50_s"] <= s["wait_p95_s"] <= s["wait_max_s"]


class _Slow:
    """A transform of known cost."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    def __call__(self, img):
        time.sleep(self.seconds)
        return np.asarray(img.resize((8, 8)), dtype=np.float32)


def test_waits_on_slow_prep_are_prep_bound(tiny_dataset):
    from coordl.datasets import ImageFolder

    ds = ImageFolder(tiny_dataset, transform=_Slow(0.01))
    with coordl.CoordLoader(ds, batch_size=12, cache=0, shuffle=True) as loader:
        for _ in loader:
            pass
        s = loader.stats()
    assert s["prep_s"] >= 1.2  # 120 samples x 10 ms
    assert s["stall_prep_s"] >= 0.9 * 1.2, s
    assert s["stall_fetch_s"] < 0.1 * s["stall_s"], s


def test_cache_hit_bytes_and_the_epoch_line(tiny_dataset, capsys):
    with coordl.CoordLoader(
        tiny_dataset,
        batch_size=16,
        device_id=None,
        log_epochs=True,
        pipeline=coordl.ImageNetVal(size=32, resize=36),
        cache=1.0,
        shuffle=True,
    ) as loader:
        for _ in range(2):
            for _ in loader:
                pass
        s = loader.stats()
    assert s["cache_hits"] == 120 and s["cache_hit_bytes"] == loader.index.total_bytes
    err = capsys.readouterr().err.splitlines()
    lines = [x for x in err if x.startswith("coordl: epoch")]
    assert len(lines) == 2
    assert lines[1] == epoch_line(s, 0)
    assert "cache 120 hits" in lines[1] and "storage 0 reads" in lines[1]


def test_stats_keys_are_the_same_before_and_after_a_pass(tiny_dataset):
    with coordl.CoordLoader(
        tiny_dataset,
        batch_size=16,
        device_id=None,
        pipeline=coordl.ImageNetVal(size=32, resize=36),
        cache=0,
        shuffle=True,
    ) as loader:
        before = set(loader.stats())
        for _ in loader:
            pass
        assert set(loader.stats()) == before


# -- the model ---------------------------------------------------------------------------------
def rates(**kw) -> Rates:
    base = dict(
        G=400.0,
        P=300.0,
        R=200.0,
        S=10e6,
        C=1e10,
        F=90.0,
        sample_bytes=1e5,
        dataset_samples=10_000,
        dataset_bytes=10**9,
        prep_threads=2,
        cache_bytes=5 * 10**8,
    )
    base.update(kw)
    return Rates(**base)


def test_fetch_rate_is_the_papers_equation():
    m = Model(rates())
    assert m.fetch_rate(0.0) == pytest.approx(100.0)  # 10 MB/s of 100 kB samples
    x = 0.5
    assert m.fetch_rate(x) == pytest.approx(1 / (1e5 * x / 1e10 + 1e5 * (1 - x) / 10e6))
    assert m.fetch_rate(1.0) == pytest.approx(1e5)
    assert m.throughput(0.0) == pytest.approx(100.0)
    assert m.throughput(1.0) == pytest.approx(200.0)  # R
    assert m.paper_throughput(1.0) == pytest.approx(300.0)  # min(P, G)


def test_cache_that_removes_fetch_stalls():
    m = Model(rates())
    x = m.cache_to_remove_fetch_stalls()
    assert m.fetch_rate(x) == pytest.approx(m.R, rel=1e-9)
    assert 0.49 < x < 0.51  # 200 samples/s need half the bytes from the cache
    assert Model(rates(S=1e9)).cache_to_remove_fetch_stalls() == 0.0
    assert m.bound(0.2) == "fetch" and m.bound(0.9) != "fetch"


def test_a_local_storage_tier_serves_what_memory_does_not_hold_at_its_speed():
    m = Model(rates())  # half the dataset in memory, the store at 10 MB/s
    none = m.with_disk(0, 2e9)
    assert none["disk_fraction"] == 0.0 and none["fetch_samples_per_s"] == pytest.approx(m.fetch_rate(0.5))
    half = m.with_disk(0.5 * 10**9, 2e9)  # the tier holds what memory holds: nothing more
    assert half["disk_fraction"] == 0.0 and half["predicted_samples_per_s"] == pytest.approx(m.throughput(0.5))
    whole = m.with_disk(10**9, 2e9)
    assert whole["disk_fraction"] == pytest.approx(0.5)
    assert whole["fetch_samples_per_s"] == pytest.approx(1 / (1e5 * 0.5 / 1e10 + 1e5 * 0.5 / 2e9))
    assert whole["predicted_samples_per_s"] == pytest.approx(m.R)  # no fetch stall left
    slow = m.with_disk(10**9, 10e6)  # a tier as slow as the store buys nothing
    assert slow["fetch_samples_per_s"] == pytest.approx(m.fetch_rate(0.5))


def test_stall_split_is_differential():
    s = stall_split(25.0, G=100.0, R=50.0)  # a step of 40 ms: 10 compute, 10 prep, 20 fetch
    assert s == pytest.approx({"compute": 0.25, "prep": 0.25, "fetch": 0.5})
    assert bottleneck(s) == "fetch"
    assert describe_bottleneck(s) == "fetch-bound: 50% of the time is spent waiting for storage"
    s = stall_split(60.0, G=100.0, R=50.0)  # faster than with all data cached: noise, no fetch stall
    assert s["fetch"] == 0.0 and sum(s.values()) == pytest.approx(1.0)
    s = stall_split(98.0, G=100.0, R=98.0)
    assert bottleneck(s) == "compute" and describe_bottleneck(s).startswith("compute-bound")
    assert bottleneck(stall_split(50.0, G=100.0, R=50.0)) == "prep"


def test_sharing_is_the_model_that_explains_R():
    assert Model(rates(P=100.0, G=100.0, R=50.0)).sharing == "shared"  # 1/(1/P + 1/G)
    assert Model(rates(P=100.0, G=1000.0, R=99.0)).sharing == "overlapped"  # min(P, G)
    m = Model(rates(P=100.0, G=100.0, R=50.0))
    assert m.R_with_prep(100.0) == pytest.approx(50.0)  # calibrated to the measurement
    more = m.with_cores(2)
    assert more["P"] == pytest.approx(200.0) and more["R"] == pytest.approx(1 / (1 / 200 + 1 / 100))


def test_what_if_nodes_and_hp_jobs_are_ordered():
    m = Model(rates(S=5e6))
    for n in (2, 4):
        w = m.with_nodes(n, 1.25e8)
        assert w["no_peers"] <= w["partitioned"] <= w["locality_aware"]
        assert w["aggregate_cache_fraction"] == 1.0
    h = m.with_hp_jobs(4)
    assert h["coordinated_per_job"] >= h["independent_per_job"]
    assert h["independent_per_job"] <= m.throughput(m.cache_fraction()) / 4 + 1e-9


@pytest.mark.parametrize("R", [300.0, 1 / (1 / 300 + 1 / 400)])  # overlapped (a GPU per job), shared (CPU)
def test_what_if_a_slow_hp_job_follows_the_groups_rules(R):
    from coordl.staging.ring import SLOWER

    assert DETACHED_WHEN_SLOWER == SLOWER  # the model's rule is the group's
    m = Model(rates(P=300.0, G=400.0, R=R, S=1e9))
    near = m.with_hp_slow_job(3, 1.2)  # not slow enough to be detached: the group waits for it
    assert not near["detached"] and near["coordinated_fast_per_job"] == near["coordinated_slow"]
    slow = m.with_hp_slow_job(3, 3.0)
    assert slow["detached"]
    lockstep = m.with_hp_jobs(3)["coordinated_per_job"]
    # The fast jobs lose only the slow job's own prep, and beat jobs alone; the slow one is served as alone.
    assert slow["independent_fast_per_job"] < slow["coordinated_fast_per_job"] < lockstep
    assert slow["coordinated_slow"] >= slow["independent_slow"] - 1e-9
    assert slow["coordinated_slow"] < slow["coordinated_fast_per_job"]


def test_what_if_remote_cpus_is_local_prep_plus_remote_capped_by_the_network():
    # Prep and compute overlap (R = min(P, G), calibration 1) and storage is fast: training runs
    # at R(P + min(N * p, nodes * L / B)), p = P / prep CPUs = 300 / 2, B = 500 kB, L = 100 MB/s.
    r = rates(G=1000.0, P=300.0, R=300.0, S=1e9, prep_threads=2, output_sample_bytes=5e5)
    m = Model(r)
    assert m.sharing == "overlapped" and m.remote_cpu_rate() == 150.0
    exact = lambda v: pytest.approx(v, rel=1e-12)  # noqa: E731
    one = m.with_remote_cpus(1, 1e8)  # 150 samples/s from the CPU, the link carries 200
    assert one["remote_samples_per_s"] == exact(150.0) and one["network_samples_per_s"] == exact(200.0)
    assert not one["network_bound"] and one["P"] == exact(450.0)
    assert one["predicted_samples_per_s"] == exact(450.0) and one["bound"] == "prep"
    four = m.with_remote_cpus(4, 1e8)  # 600 from the CPUs, capped at 200 by the link
    assert four["network_bound"] and four["P"] == exact(500.0) and four["predicted_samples_per_s"] == exact(500.0)
    # the trainer ships the encoded bytes too: B = 500 kB + 100 kB, the link carries 1e8 / 6e5
    shipped = Model(rates(G=1000.0, P=300.0, R=300.0, S=1e9, output_sample_bytes=5e5, ships_encoded=True))
    assert shipped.with_remote_cpus(4, 1e8)["P"] == exact(300.0 + 1e8 / 6e5)
    # uint8 results (125 kB) on two nodes' links: 1600 samples/s; 16 CPUs give 2400; G caps training at 1000
    u8 = Model(rates(G=1000.0, P=300.0, R=300.0, S=1e9, output_sample_bytes=5e5, result_sample_bytes=1.25e5, nodes=2))
    w = u8.with_remote_cpus(16, 1e8)
    assert w["network_samples_per_s"] == exact(1600.0) and w["P"] == exact(1900.0)
    assert w["predicted_samples_per_s"] == exact(1000.0) and w["bound"] == "compute"
    # the rank had one CPU for its two threads: one remote CPU is worth phase P's whole rate
    assert Model(rates(P=300.0, prep_threads=2, prep_cpus=1.0)).remote_cpu_rate() == 300.0
    # fetch still bounds: storage at 100 samples/s and no cache
    slow = Model(rates(G=1000.0, P=300.0, R=300.0, S=1e7, cache_bytes=0, output_sample_bytes=5e5))
    assert slow.with_remote_cpus(4, 1e8)["predicted_samples_per_s"] == exact(100.0)
    # the output not measured: no network cap
    free = Model(rates(G=1000.0, P=300.0, R=300.0, S=1e9)).with_remote_cpus(4, 1e8)
    assert free["network_samples_per_s"] is None and free["P"] == exact(300.0 + 4 * 150.0)


def test_rates_from_takes_cpus_output_bytes_and_the_loaders_ray_prep():
    facts = dict(world_size=2, local_world_size=2, dataset_samples=10, dataset_bytes=1000, cache_budget=0)
    rank = dict(facts, prep_threads=4, samples_per_s=1.0, S_bytes_per_s=1.0)
    p = dict(rank, P_samples_per_s=100.0, R_samples_per_s=90.0, C_bytes_per_s=1.0)
    measured = dict(output_sample_bytes=400.0, output_uint8_sample_bytes=100.0)
    ray = dict(remote_output="uint8", remote_reads="trainer")
    phases = {k: [dict(rank, rank=0), dict(rank, rank=1)] for k in "GSF"}
    phases["P"] = [dict(p, rank=0, cpus=2, **measured, **ray), dict(p, rank=1, cpus=8)]
    r = rep.rates_from(phases)
    assert r.prep_cpus == 2 + 4  # each rank's threads, at most its CPUs
    assert r.output_sample_bytes == 400.0 and r.result_sample_bytes == 100.0 and r.ships_encoded
    assert Model(r).remote_sample_bytes() == 100.0 + 100.0  # uint8 pixels back, the encoded 100 B out
    phases["P"][0].update(remote_output="pipeline", remote_reads="auto")
    r = rep.rates_from(phases)
    assert r.result_sample_bytes == 400.0 and not r.ships_encoded


def test_batch_bytes_counts_every_tensor_and_floats_at_a_byte_for_uint8():
    import torch

    from coordl.analyze.probe import batch_bytes

    images, labels = torch.zeros(8, 3, 4, 4), torch.zeros(8, dtype=torch.int64)
    assert batch_bytes((images, labels)) == (8 * 48 * 4 + 64, 8 * 48 + 64)
    assert batch_bytes({"x": np.zeros((2, 5), np.float64), "y": [np.zeros(2, np.int32), "a path"]}) == (88, 18)


def test_report_shows_the_remote_cpus_rows():
    r = rep.build(rates(G=1000.0, P=300.0, R=300.0, S=1e9, output_sample_bytes=5e5), network_bytes_per_s=1e8)
    rows = json.loads(json.dumps(r))["what_if_remote_cpus"]
    assert [w["remote_cpus"] for w in rows] == [2, 4, 8]  # 1, 2 and 4 times the job's 2 prep CPUs
    assert [round(w["predicted_samples_per_s"]) for w in rows] == [500, 500, 500]
    assert r["remote_prep"]["per_cpu_samples_per_s"] == 150.0 and r["remote_prep"]["network_sample_bytes"] == 5e5
    text = rep.table(rep.build(rates(output_sample_bytes=5e5), network_bytes_per_s=1e8, remote_cpus=[1, 3]))
    assert "prep also on remote CPUs (RayPrep), each at the local rate per CPU, 150 samples/s" in text
    assert "500 kB a sample over 100.0 MB/s per node" in text
    assert "    1 remote CPU: 200 samples/s (fetch-bound)" in text


def test_report_json_table_and_plot(tmp_path):
    r = rep.build(rates(), command=["python", "train.py"])
    data = json.loads(json.dumps(r))  # JSON-able
    assert set(data["rates"]) >= {"G", "P", "F", "S", "C"}
    assert set(data["stall"]) == {"compute", "prep", "fetch"}
    assert data["bottleneck"] in ("fetch", "prep", "compute")
    assert len(data["what_if"]) == 21
    for w in data["what_if"]:
        assert {"cache_fraction", "predicted_samples_per_s"} <= set(w)
    text = rep.table(r)
    assert "Bottleneck: fetch-bound" in text and "removes fetch stalls" in text
    png = tmp_path / "r.png"
    rep.plot(r, str(png), measured=[(0.5, 150.0), (1.0, 190.0)])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# -- coordl analyze end to end --------------------------------------------------------------------
TRAIN = (
    SLOW_STORAGE
    + """
import sys
import coordl

throttle(float(sys.argv[2]))
STEP = float(sys.argv[3])
with coordl.CoordLoader(sys.argv[1], batch_size=8, device_id=None, pipeline=coordl.ImageNetVal(size=32, resize=36),
                        cache=0.5, prep=1, shuffle=True) as loader:
    for epoch in range(100):
        for images, labels in loader:
            assert images.shape == (len(labels), 3, 32, 32)
            time.sleep(STEP)  # the training step
print("the script finished")
"""
)


def test_analyze_end_to_end(tiny_dataset, tmp_path, isolated):
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    sizes = [p.stat().st_size for p in tiny_dataset.rglob("*.jpg")]
    b = sum(sizes) / len(sizes)
    bps = 60 * b  # storage delivers 60 samples/s; the step ingests 8 / 0.02 = 400
    out = tmp_path / "out"
    cmd = [
        sys.executable,
        "-m",
        "coordl.cli",
        "analyze",
        "--steps",
        "40",  # 0.8 s of 20 ms steps: long enough that a busy machine's hiccups move G and R by a few % only
        "--warmup",
        "2",
        "--out",
        str(out),
        "--storage-seconds",
        "3",
        "--",
        sys.executable,
        str(script),
        str(tiny_dataset),
        str(bps),
        "0.02",
    ]
    # The user's own sitecustomize (on PYTHONPATH) still runs: the probe's comes first and runs it.
    own = tmp_path / "own-site"
    own.mkdir()
    marker = tmp_path / "own-sitecustomize-ran"
    (own / "sitecustomize.py").write_text(f"open({str(marker)!r}, 'a').write('ran\\n')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(own), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    assert marker.read_text().count("ran") >= 4  # once in each phase's interpreter at least
    assert "Bottleneck: fetch-bound" in proc.stdout
    r = json.loads((out / "report.json").read_text())
    rt = r["rates"]
    assert rt["G"] == pytest.approx(400, rel=0.15)
    assert rt["S"] == pytest.approx(bps, rel=0.2)
    assert rt["R"] <= rt["G"] * 1.05 and rt["P"] > rt["R"] * 0.9
    assert rt["F"] == pytest.approx(60, rel=0.25)  # the cold run goes at storage speed
    assert r["bottleneck"] == "fetch" and r["stall"]["fetch"] > 0.6
    assert r["config"]["cache_fraction"] == pytest.approx(0.5, abs=0.01)
    assert r["model_check"]["cold_predicted_samples_per_s"] == pytest.approx(rt["F"], rel=0.25)
    assert r["stall_observed"]["fetch"] > 0.5  # the loader's own accounting agrees
    assert (out / "report.png").read_bytes()[:4] == b"\x89PNG"
    for phase in "GPSF":
        assert (out / f"phase-{phase}-rank0.json").exists()
        assert "the script finished" not in (out / f"phase-{phase}.log").read_text()
    p = r["phases"]["P"][0]  # ImageNetVal(size=32): 3 x 32 x 32 float32 pixels and a label
    assert 3 * 32 * 32 * 4 < p["output_sample_bytes"] <= 3 * 32 * 32 * 4 + 8
    assert r["remote_prep"]["per_cpu_samples_per_s"] == pytest.approx(rt["P"])  # prep=1: one thread
    assert [w["remote_cpus"] for w in r["what_if_remote_cpus"]] == [1, 2, 4]
    assert "remote CPUs: " in proc.stdout
    preds = {w["cache_fraction"]: w["predicted_samples_per_s"] for w in r["what_if"]}
    assert preds[0.0] < preds[0.5] < preds[1.0] <= rt["R"] + 1e-6
    assert not math.isinf(r["cache_to_remove_fetch_stalls"]["fraction"])


def test_analyze_explains_a_script_without_coordl(tmp_path):
    script = tmp_path / "plain.py"
    script.write_text("print('no loader here')\n")
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "coordl.cli", "analyze", "--out", str(out), "--", sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1
    assert "must iterate a coordl.CoordLoader" in proc.stderr
    assert "no loader here" in proc.stderr  # the end of its log


def test_analyze_reports_a_failing_script(tmp_path):
    script = tmp_path / "bad.py"
    script.write_text("raise SystemExit('boom: bad arguments')\n")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "coordl.cli",
            "analyze",
            "--out",
            str(tmp_path / "o"),
            "--",
            sys.executable,
            str(script),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1
    assert "failed with exit code 1" in proc.stderr and "boom: bad arguments" in proc.stderr


def test_analyze_needs_a_command(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "coordl.cli", "analyze", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1 and "give the training command after --" in proc.stderr


def test_a_phase_that_hangs_times_out(tmp_path):
    script = tmp_path / "hang.py"
    script.write_text("import time\ntime.sleep(600)\n")
    t0 = time.monotonic()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "coordl.cli",
            "analyze",
            "--timeout",
            "2",
            "--out",
            str(tmp_path / "o"),
            "--",
            sys.executable,
            str(script),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    took = time.monotonic() - t0
    assert proc.returncode == 1 and "did not finish within 2 s" in proc.stderr
    left = _running(str(script))  # the phase's script was stopped, and analyze waited for it
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"the timed-out phase's script is still running: {left}"
    # Not before its 2 s; and a guard (start-up is slow on busy cores): far from the script's own 600 s.
    assert 2.0 <= took < 60, took


def _running(argument: str) -> list[int]:
    """The processes whose command line has ``argument``."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue  # gone meanwhile
        if argument.encode() in cmdline:
            found.append(int(pid))
    return found


def test_the_probe_rejects_a_broken_spec(monkeypatch):
    from coordl.analyze import probe

    monkeypatch.setenv(probe.ENV, "{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        probe.spec()
    monkeypatch.setenv(probe.ENV, json.dumps({"phase": "G"}))
    with pytest.raises(ValueError, match="lacks 'steps'"):
        probe.spec()


TRAIN_TORCH = """
import sys, time
import numpy as np
import coordl
from coordl.datasets import ImageFolder

def small(img):
    return np.asarray(img.resize((16, 16)), dtype=np.float32)

ds = ImageFolder(sys.argv[1], transform=small)
with coordl.CoordLoader(ds, batch_size=8, num_workers=1, cache=0.5, shuffle=True) as loader:
    for epoch in range(100):
        for images, labels in loader:
            time.sleep(0.02)
print("the script finished")
"""


def test_analyze_a_torch_backend_script(tiny_dataset, tmp_path, isolated):
    script = tmp_path / "train_torch.py"
    script.write_text(TRAIN_TORCH)
    out = tmp_path / "out"
    cmd = [
        sys.executable,
        "-m",
        "coordl.cli",
        "analyze",
        "--steps",
        "40",  # as above: G within 15% on a busy machine needs more than 0.16 s of steps
        "--warmup",
        "1",
        "--out",
        str(out),
        "--storage-seconds",
        "2",
        "--",
        sys.executable,
        str(script),
        str(tiny_dataset),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    r = json.loads((out / "report.json").read_text())
    assert r["rates"]["G"] == pytest.approx(400, rel=0.15)
    assert r["phases"]["P"][0]["backend"] == "torch"
    assert r["phases"]["P"][0]["P_cache_hit_fraction"] == 1.0  # the workers read the private, filled cache
    assert r["phases"]["P"][0]["output_sample_bytes"] == 16 * 16 * 3 * 4 + 8  # float32 pixels, an int64 label
    for phase in "GPSF":
        assert "the script finished" not in (out / f"phase-{phase}.log").read_text()
