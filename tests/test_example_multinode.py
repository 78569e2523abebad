"""examples/multinode/simulate.py: two simulated nodes train with the partitioned cache, and leave nothing.

The simulation runs ``examples/imagenet/train.py`` under torchrun in two network namespaces
with a private /dev/shm each (root), or on two loopback addresses with an shm folder each
(``--no-netns``, any user), and the test reads rank 0's ``Epoch [e] summary:`` lines.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from coordl.tools.datagen import make_dataset
from coordl_testing import netns

ROOT = Path(__file__).resolve().parents[1]
SIMULATE = ROOT / "examples" / "multinode" / "simulate.py"

NS_REASON = "COORDL_TEST_NO_NETNS is set" if os.environ.get("COORDL_TEST_NO_NETNS") else netns.unavailable()
N = 128  # training images
SUMMARY = re.compile(
    r"^\[node 0\] Epoch \[(\d+)\] summary: .*; storage ([\d.]+) MB in (\d+) reads, "
    r"cache hits (\d+) \(([\d.]+) MB\), peers ([\d.]+) MB",
    re.MULTILINE,
)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """train/ (128 JPEGs of about 160x140, 4 classes) and val/ (32)."""
    root = tmp_path_factory.mktemp("multinode")
    make_dataset(root / "train", num_images=N, num_classes=4, size=(160, 140), seed=0, progress=False)
    make_dataset(root / "val", num_images=32, num_classes=4, size=(160, 140), seed=1, progress=False)
    return root


def _simulate(*args: str, timeout: float = 150) -> tuple[int, str]:
    """Runs simulate.py; its exit code and output. Past ``timeout`` it gets a SIGTERM, as from a
    user, so that it still cleans up, and the test fails."""
    p = subprocess.Popen(
        [sys.executable, str(SIMULATE), *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.send_signal(signal.SIGTERM)
        out, _ = p.communicate(timeout=60)
        pytest.fail(f"simulate.py ran for more than {timeout} s:\n{out}")
    assert not _namespaces_of(p.pid), out
    return p.returncode, out


def _left_behind(marker: str) -> list[str]:
    """Processes whose command line mentions ``marker``."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in cmdline and int(pid) != os.getpid():
            found.append(f"process {pid}: {cmdline[:200]}")
    return found


def _namespaces_of(pid: int) -> list[str]:
    """The bridge, namespaces and links that simulate.py's process ``pid`` made and still exist."""
    if NS_REASON is not None:
        return []
    out = subprocess.run(["ip", "-o", "link"], check=False, capture_output=True, text=True).stdout
    out += subprocess.run(["ip", "netns", "list"], check=False, capture_output=True, text=True).stdout
    tag = pid % 10000  # coordl_testing.netns names a cluster after its process id, then its count in it
    return sorted(set(re.findall(rf"\bcdl[bnv]{tag}\d(?:_\d+)?\b", out)))


MODES = [
    pytest.param([], id="netns", marks=pytest.mark.skipif(NS_REASON is not None, reason=f"{NS_REASON}")),
    pytest.param(["--no-netns"], id="loopback"),
]
MODE = [] if NS_REASON is None else ["--no-netns"]  # this machine's own, for the tests of failures


@pytest.mark.parametrize("mode", MODES)
def test_two_nodes_read_storage_only_in_the_first_epoch(data, tmp_path, mode):
    t0 = time.monotonic()
    code, out = _simulate(
        "--data",
        str(data),
        "--nodes",
        "2",
        "--cache",
        "0.6",
        *mode,
        "--",
        "-a",
        "resnet_tiny",
        "--image-size",
        "32",
        "--epochs",
        "2",
        "-b",
        "16",
        "-j",
        "1",
        "-p",
        "100",
        "--seed",
        "0",
        "--checkpoint-dir",
        str(tmp_path / "ckpt"),
    )
    assert code == 0, out
    assert "simulate: 2 node(s) x 1 rank(s) finished" in out and "(exit codes [0, 0])" in out, out
    assert "2 rank(s)" in out, out  # one job of two ranks, not two jobs of one
    epochs = {int(m[0]): m for m in SUMMARY.findall(out)}
    assert sorted(epochs) == [0, 1], out
    _, storage_mb, storage_reads, hits, _, peers_mb = epochs[0]
    assert int(storage_reads) == N and int(hits) == 0 and float(peers_mb) == 0, out  # epoch 0 fills the caches
    _, storage_mb, storage_reads, hits, _, peers_mb = epochs[1]
    # 0.6 of the dataset per node: the two caches hold it all, so nothing comes from storage,
    # and what a rank's own node does not hold comes from the other node.
    assert int(storage_reads) == 0 and float(storage_mb) == 0, out
    assert int(hits) < N and float(peers_mb) > 0, out
    assert (tmp_path / "ckpt" / "checkpoint.pth.tar").is_file()
    assert not _left_behind(str(data)), _left_behind(str(data))
    assert not [p for p in os.listdir("/dev/shm") if p.startswith("coordl-simulate-")]
    print(f"simulate ({mode or 'netns'}): {time.monotonic() - t0:.1f} s")


FAIL_ON_NODE_1 = """
import os, sys, time
print("node", os.environ["GROUP_RANK"], "of", os.environ["WORLD_SIZE"], "ranks:", sys.argv[1:], flush=True)
if os.environ["GROUP_RANK"] == "1":
    sys.exit(3)
time.sleep(float(os.environ.get("SLEEP", "0")))
"""


def test_a_failing_node_fails_the_simulation_and_nothing_is_left(tmp_path, mode=MODE):
    script = tmp_path / "fail_on_node_1.py"
    script.write_text(FAIL_ON_NODE_1)
    code, out = _simulate("--script", str(script), "--data", str(tmp_path), "--grace", "1", *mode, "--", "x")
    assert code == 1, out
    assert "[node 1] node 1 of 2 ranks:" in out and "'--cache', '0.6', 'x'" in out, out
    # torchrun's agent of node 0 waits for node 1's at its exit barrier, until simulate stops it.
    assert "FAILED on node(s) 1" in out, out
    assert not _left_behind(str(script)), _left_behind(str(script))


def test_sigterm_stops_every_node_and_removes_everything(tmp_path, mode=MODE):
    script = tmp_path / "sleeps.py"
    script.write_text(FAIL_ON_NODE_1.replace('"1"', '"no node"'))
    env = dict(os.environ, SLEEP="300")
    p = subprocess.Popen(
        [sys.executable, str(SIMULATE), "--script", str(script), "--data", str(tmp_path), *mode],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    try:
        lines = []
        for line in p.stdout:  # wait until both nodes' scripts run
            lines.append(line)
            if sum("of 2 ranks" in x for x in lines) == 2:
                break
        assert len(_left_behind(str(script))) >= 4, "".join(lines)  # two torchruns, two scripts
        if not mode:
            assert len(_namespaces_of(p.pid)) == 5  # a bridge, two namespaces and their links
        t0 = time.monotonic()
        p.send_signal(signal.SIGTERM)
        rest = p.stdout.read()
        assert p.wait(30) == 130, "".join(lines) + rest
        assert time.monotonic() - t0 < 20
        assert "interrupted" in rest
        assert not _left_behind(str(script)), _left_behind(str(script))
        assert not _namespaces_of(p.pid)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
