"""The CPUs a process may use: its affinity and its cgroups' CPU quotas (cgroup v1 and v2).

The parsing is tested against files laid out as the kernel lays them out, in fake trees
(``root/proc/self/cgroup``, ``root/proc/self/mountinfo`` and the cgroup folders under their
mount points); the reading against a real ``taskset`` and a real cgroup with a CPU quota made for
the test (root only), in subprocesses that report what they see.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from conftest import remove_cgroup
from coordl import cgroups, cpus

V2_MOUNTINFO = """\
22 1 253:1 / / rw,relatime shared:1 - ext4 /dev/vda1 rw
26 22 0:24 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:4 - cgroup2 cgroup2 rw,nsdelegate
"""

V1_MOUNTINFO = """\
22 1 253:1 / / rw,relatime shared:1 - ext4 /dev/vda1 rw
31 22 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu,cpuacct rw,relatime - cgroup cgroup rw,cpu,cpuacct
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
"""


def tree(root: Path, files: dict[str, str]) -> Path:
    """Writes ``files`` (paths relative to ``root``) and returns ``root``."""
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return root


def v2_tree(root: Path, scope="max 100000", slice_="max 100000") -> Path:
    """A systemd-style v2 tree: the process in kubepods.slice/pod.scope; the root has no cpu.max."""
    cg = "sys/fs/cgroup"
    return tree(
        root,
        {
            "proc/self/cgroup": "0::/kubepods.slice/pod.scope\n",
            "proc/self/mountinfo": V2_MOUNTINFO,
            f"{cg}/cgroup.controllers": "cpuset cpu io memory pids\n",
            f"{cg}/kubepods.slice/cpu.max": f"{slice_}\n",
            f"{cg}/kubepods.slice/pod.scope/cpu.max": f"{scope}\n",
        },
    )


def v1_tree(root: Path, step="-1", job="-1", period="100000") -> Path:
    """A Slurm-style v1 tree: the process in slurm/uid_0/job_42/step_0, cpu co-mounted with cpuacct."""
    cg = "sys/fs/cgroup/cpu,cpuacct"
    files = {
        "proc/self/cgroup": "12:pids:/slurm/uid_0/job_42/step_0\n4:memory:/slurm/uid_0/job_42/step_0\n"
        "3:cpu,cpuacct:/slurm/uid_0/job_42/step_0\n0::/\n",
        "proc/self/mountinfo": V1_MOUNTINFO,
    }
    for path, quota in [
        ("", "-1"),
        ("/slurm", "-1"),
        ("/slurm/uid_0/job_42", job),
        ("/slurm/uid_0/job_42/step_0", step),
    ]:
        files[f"{cg}{path}/cpu.cfs_quota_us"] = f"{quota}\n"
        files[f"{cg}{path}/cpu.cfs_period_us"] = f"{period}\n"
    files["sys/fs/cgroup/unified/cgroup.procs"] = "1\n"  # the hybrid layout's v2, without the cpu controller
    return tree(root, files)


def affinity() -> int:
    return len(os.sched_getaffinity(0))


# -- parsing ------------------------------------------------------------------------------------
def test_parse_cpu_max_v2_forms():
    assert cpus.parse_cpu_max("max 100000\n") is None
    assert cpus.parse_cpu_max("max\n") is None
    assert cpus.parse_cpu_max("100000 100000\n") == 1
    assert cpus.parse_cpu_max("800000 100000\n") == 8
    assert cpus.parse_cpu_max("150000 100000\n") == 2  # 1.5 CPUs: rounded up
    assert cpus.parse_cpu_max("100001 100000\n") == 2
    assert cpus.parse_cpu_max("50000 100000\n") == 1  # half a CPU: never below 1
    assert cpus.parse_cpu_max("1000 1000000\n") == 1
    assert cpus.parse_cpu_max("400000\n") == 4  # the period left out: the kernel's 100 ms
    with pytest.raises(ValueError):
        cpus.parse_cpu_max("lots 100000")
    with pytest.raises(ValueError):
        cpus.parse_cpu_max("100000 0")


def test_parse_cfs_quota_v1_forms():
    assert cpus.parse_cfs_quota("-1\n", "100000\n") is None
    assert cpus.parse_cfs_quota("200000\n", "100000\n") == 2
    assert cpus.parse_cfs_quota("250000\n", "100000\n") == 3  # 2.5 CPUs: rounded up
    assert cpus.parse_cfs_quota("1000\n", "100000\n") == 1  # never below 1
    assert cpus.parse_cfs_quota("50000\n", "10000\n") == 5  # another period
    with pytest.raises(ValueError):
        cpus.parse_cfs_quota("", "100000")


@given(st.integers(1000, 10**9), st.integers(1000, 10**6))
def test_a_quota_rounds_up_to_whole_cpus(quota, period):
    n = cpus.parse_cpu_max(f"{quota} {period}")
    assert n == cpus.parse_cfs_quota(str(quota), str(period))
    assert (n - 1) * period < quota <= n * period  # the fewest whole CPUs that hold the quota


def test_cgroups_finds_the_cpu_hierarchy_not_memorys():
    text = "4:memory:/a\n3:cpu,cpuacct:/b\n0::/c\n"
    assert cgroups.parse_proc_cgroup(text, "cpu") == {1: "/b", 2: "/c"}
    assert cgroups.parse_proc_cgroup(text, "memory") == {1: "/a", 2: "/c"}
    assert cgroups.parse_proc_cgroup("3:cpuacct:/b\n", "cpu") == {}  # cpuacct is not cpu
    assert [m.point for m in cgroups.parse_mountinfo(V1_MOUNTINFO, "cpu")] == [
        "/sys/fs/cgroup/cpu,cpuacct",
        "/sys/fs/cgroup/unified",
    ]


# -- reading fake trees -------------------------------------------------------------------------
def test_v2_the_tightest_ancestor_wins(tmp_path):
    assert cpus.cgroup_quota(str(v2_tree(tmp_path / "a", slice_="400000 100000"))) == 4  # the slice's
    assert cpus.cgroup_quota(str(v2_tree(tmp_path / "b", scope="200000 100000", slice_="400000 100000"))) == 2
    assert cpus.cgroup_quota(str(v2_tree(tmp_path / "c", scope="800000 100000", slice_="300000 100000"))) == 3
    assert cpus.cgroup_quota(str(v2_tree(tmp_path / "d", scope="150000 100000"))) == 2  # 1.5 CPUs


def test_v2_unlimited(tmp_path):
    assert cpus.cgroup_quota(str(v2_tree(tmp_path))) is None
    assert cpus.available(str(v2_tree(tmp_path))) == affinity()


def test_v1_slurm_job_quota_from_an_ancestor(tmp_path):
    assert cpus.cgroup_quota(str(v1_tree(tmp_path / "a", job="800000"))) == 8
    assert cpus.cgroup_quota(str(v1_tree(tmp_path / "b", job="800000", step="200000"))) == 2
    assert cpus.cgroup_quota(str(v1_tree(tmp_path / "c", job="250000", step="800000"))) == 3
    assert cpus.cgroup_quota(str(v1_tree(tmp_path / "d"))) is None
    assert cpus.cgroup_quota(str(v1_tree(tmp_path / "e", job="50000", period="10000"))) == 5


def test_a_container_sees_only_its_own_cgroup(tmp_path):
    # Without a cgroup namespace the mount's root is the container's cgroup: its quota counts.
    root = tree(
        tmp_path,
        {
            "proc/self/cgroup": "5:cpu,cpuacct:/kubepods/pod1/ctr\n",
            "proc/self/mountinfo": "32 31 0:29 /kubepods/pod1/ctr /sys/fs/cgroup/cpu,cpuacct ro "
            "- cgroup cgroup rw,cpu,cpuacct\n",
            "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us": "300000\n",
            "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us": "100000\n",
        },
    )
    assert cpus.cgroup_quota(str(root)) == 3


def test_v1_and_v2_both_hold_quotas_the_least_wins(tmp_path):
    root = v1_tree(tmp_path, job="800000")
    (root / "sys/fs/cgroup/unified/cpu.max").write_text("300000 100000\n")  # the process is in v2's root
    assert cpus.cgroup_quota(str(root)) == 3


def test_missing_files_are_no_quota(tmp_path):
    root = v2_tree(tmp_path, scope="200000 100000")
    (root / "sys/fs/cgroup/kubepods.slice/pod.scope/cpu.max").unlink()  # no cpu controller there
    assert cpus.cgroup_quota(str(root)) is None
    (root / "sys/fs/cgroup/kubepods.slice/cpu.max").write_text("garbage\n")  # unreadable: no quota
    assert cpus.cgroup_quota(str(root)) is None
    v1 = v1_tree(tmp_path / "v1", job="200000")
    (v1 / "sys/fs/cgroup/cpu,cpuacct/slurm/uid_0/job_42/cpu.cfs_period_us").unlink()
    assert cpus.cgroup_quota(str(v1)) is None
    assert cpus.cgroup_quota(str(tmp_path / "nothing")) is None  # not Linux: no /proc, nothing limited
    assert cpus.available(str(tmp_path / "nothing")) == affinity()
    # The process's cgroup not under the mount (another cgroup namespace's): no folder, no quota.
    outside = v2_tree(tmp_path / "ns", scope="100000 100000")
    (outside / "proc/self/cgroup").write_text("0::/../../kubepods.slice/pod.scope\n")
    assert cpus.cgroup_quota(str(outside)) is None


def test_available_is_the_least_of_affinity_and_quota(tmp_path):
    assert cpus.available(str(v2_tree(tmp_path / "a", scope="100000 100000"))) == 1
    assert cpus.available(str(v2_tree(tmp_path / "b", scope="50000 100000"))) == 1  # never below 1
    assert cpus.available(str(v2_tree(tmp_path / "c", scope=f"{100000 * (affinity() + 4)} 100000"))) == affinity()


def test_available_is_not_cached(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2})
    assert cpus.available("/nonexistent") == 3
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {5})
    assert cpus.available("/nonexistent") == 1


# -- real processes ------------------------------------------------------------------------------
REPORT = r"""
import json, os, sys
if len(sys.argv) > 1:  # move into the cgroup before anything counts its CPUs
    with open(os.path.join(sys.argv[1], "cgroup.procs"), "w") as f:
        f.write(str(os.getpid()))
import io, logging, re, tarfile, tempfile
from coordl import Index, cpus
from coordl.tools.datagen import workers
logs = io.StringIO()
logging.basicConfig(stream=logs, level=logging.INFO, format="%(message)s")
with tempfile.TemporaryDirectory() as d:  # enough shards for two indexing processes
    for k in range(32):
        with tarfile.open(f"{d}/s-{k:02d}.tar", "w") as tar:
            for member, data in ((f"{k}.jpg", b"x" * 10), (f"{k}.cls", b"1")):
                info = tarfile.TarInfo(member)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    Index.from_tars(d, index_dir=d)
processes = re.search(r"indexed 32 samples in 32 shards in [0-9.]+ s(?: \((\d+) processes\))?", logs.getvalue())
print(json.dumps({"available": cpus.available(), "workers": workers.cpu_count(), "cpu_count": os.cpu_count(),
                  "index_processes": int(processes.group(1) or 1)}))
"""


def report(*cmd: str) -> dict:
    r = subprocess.run([*cmd], capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_real_taskset_one_cpu():
    if shutil.which("taskset") is None:
        pytest.skip("no taskset on this machine (util-linux)")
    if affinity() < 2:
        pytest.skip("this process may use one CPU only: taskset -c could not tell fewer")
    got = report("taskset", "-c", str(min(os.sched_getaffinity(0))), sys.executable, "-c", REPORT)
    assert got["available"] == 1 and got["workers"] == 1 and got["index_processes"] == 1
    assert got["cpu_count"] >= 2  # what a loader counted before: the machine's CPUs


def cpu_cgroup_parent() -> tuple[int, Path]:
    """The root folder of the hierarchy holding the cpu controller, and its version. Skips the
    test where we are not root or the machine has no cpu controller to give a child cgroup."""
    if os.geteuid() != 0:
        pytest.skip("making a cgroup needs root")
    for mount in cgroups.parse_mountinfo(Path("/proc/self/mountinfo").read_text(), "cpu"):
        point = Path(mount.point)
        if mount.version == 1 and (point / "cpu.cfs_quota_us").exists():
            return 1, point
        control = point / "cgroup.subtree_control"
        if mount.version == 2 and control.exists() and "cpu" in control.read_text().split():
            return 2, point
    pytest.skip("no cpu controller for a child cgroup: no v1 cpu hierarchy, and v2's root does not enable cpu")


def test_real_cgroup_with_a_one_cpu_quota():
    version, parent = cpu_cgroup_parent()
    cg = parent / f"coordl-test-cpus-{os.getpid()}"
    cg.mkdir()
    try:
        if version == 2:
            (cg / "cpu.max").write_text("100000 100000\n")
        else:
            (cg / "cpu.cfs_period_us").write_text("100000\n")
            (cg / "cpu.cfs_quota_us").write_text("100000\n")
        got = report(sys.executable, "-c", REPORT, str(cg))
        assert got["available"] == 1 and got["workers"] == 1, f"in {cg} (cgroup v{version}): {got}"
        assert got["index_processes"] == 1, f"tar shards indexed by more processes than the quota's CPUs: {got}"
        if affinity() >= 2:
            assert got["cpu_count"] >= 2  # what a loader counted before
    finally:
        remove_cgroup(cg)
