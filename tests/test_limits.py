"""Memory limits read from the kernel: cgroup v1 and v2, their ancestors, and MemAvailable.

The parsing is tested against files laid out as the kernel lays them out, in fake trees
(``root/proc/self/cgroup``, ``root/proc/self/mountinfo``, ``root/proc/meminfo`` and the cgroup
folders under their mount points), and the reading against real cgroups where this machine
has them: a v1 memory cgroup made for the test (root only), and a cgroup2 mount.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from conftest import remove_cgroup
from coordl.shm import limits
from coordl.shm.limits import Level, Mount

MiB, GiB = 1 << 20, 1 << 30
V1_NO_LIMIT = "9223372036854771712"  # what v1 writes for "no limit" with 4 KiB pages

MEMINFO = """MemTotal:       16384000 kB
MemFree:         1000000 kB
MemAvailable:   12288000 kB
Buffers:          100000 kB
HugePages_Total:       0
Hugepagesize:       2048 kB
"""

V2_MOUNTINFO = """\
22 1 253:1 / / rw,relatime shared:1 - ext4 /dev/vda1 rw
26 22 0:24 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:4 - cgroup2 cgroup2 \
rw,nsdelegate,memory_recursiveprot
27 22 0:25 / /dev/shm rw,nosuid,nodev shared:5 - tmpfs tmpfs rw,size=8388608k
"""

V1_MOUNTINFO = """\
22 1 253:1 / / rw,relatime shared:1 - ext4 /dev/vda1 rw
31 22 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu,cpuacct rw,relatime - cgroup cgroup rw,cpu,cpuacct
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
"""


def v2_stat(inactive_file: int) -> str:
    return f"anon 1000\nfile 5000\nshmem 0\nactive_file 100\ninactive_file {inactive_file}\npgfault 7\n"


def v1_stat(inactive_file: int, total_inactive_file: int, hierarchical: int | str = V1_NO_LIMIT) -> str:
    return (
        f"cache 5000\nrss 1000\nshmem 0\ninactive_file {inactive_file}\nactive_file 100\n"
        f"hierarchical_memory_limit {hierarchical}\nhierarchical_memsw_limit {V1_NO_LIMIT}\n"
        f"total_cache 9000\ntotal_rss 2000\ntotal_inactive_file {total_inactive_file}\n"
    )


def tree(root: Path, files: dict[str, str]) -> Path:
    """Writes ``files`` (paths relative to ``root``) and returns ``root``."""
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return root


def v2_tree(root: Path, job_max="max", slice_max=str(2 * GiB)) -> Path:
    """A systemd-style v2 tree: the process in user.slice/job.scope, a limit on the slice."""
    cg = "sys/fs/cgroup"
    return tree(
        root,
        {
            "proc/self/cgroup": "0::/user.slice/job.scope\n",
            "proc/self/mountinfo": V2_MOUNTINFO,
            "proc/meminfo": MEMINFO,
            f"{cg}/cgroup.controllers": "cpuset cpu io memory pids\n",  # the root cgroup has no memory.max
            f"{cg}/memory.stat": v2_stat(0),
            f"{cg}/user.slice/memory.max": f"{slice_max}\n",
            f"{cg}/user.slice/memory.current": f"{1500 * MiB}\n",
            f"{cg}/user.slice/memory.stat": v2_stat(300 * MiB),
            f"{cg}/user.slice/job.scope/memory.max": f"{job_max}\n",
            f"{cg}/user.slice/job.scope/memory.current": f"{900 * MiB}\n",
            f"{cg}/user.slice/job.scope/memory.stat": v2_stat(100 * MiB),
        },
    )


def v1_tree(root: Path, step_limit=V1_NO_LIMIT, job_limit=str(4 * GiB), hierarchical=str(4 * GiB)) -> Path:
    """A Slurm-style v1 tree: the process in slurm/uid_0/job_42/step_0, the job's limit above it."""
    cg = "sys/fs/cgroup/memory"
    files = {
        "proc/self/cgroup": "12:pids:/slurm/uid_0/job_42/step_0\n4:memory:/slurm/uid_0/job_42/step_0\n"
        "3:cpu,cpuacct:/slurm/uid_0/job_42/step_0\n0::/\n",
        "proc/self/mountinfo": V1_MOUNTINFO,
        "proc/meminfo": MEMINFO,
    }
    for path, limit, usage, inactive in [
        ("", V1_NO_LIMIT, 10 * GiB, 2 * GiB),
        ("/slurm", V1_NO_LIMIT, 9 * GiB, 2 * GiB),
        ("/slurm/uid_0", V1_NO_LIMIT, 3 * GiB, 1 * GiB),
        ("/slurm/uid_0/job_42", job_limit, 3 * GiB, 1 * GiB),
        ("/slurm/uid_0/job_42/step_0", step_limit, 2 * GiB, 512 * MiB),
    ]:
        files[f"{cg}{path}/memory.limit_in_bytes"] = f"{limit}\n"
        files[f"{cg}{path}/memory.usage_in_bytes"] = f"{usage}\n"
        # v1's own inactive_file is local; total_inactive_file is hierarchical, as its usage is.
        files[f"{cg}{path}/memory.stat"] = v1_stat(7, inactive, hierarchical)
    return tree(root, files)


# -- parsing ------------------------------------------------------------------------------------
def test_parse_proc_cgroup_v1_v2_and_hybrid():
    v1 = "9:name=systemd:/\n4:memory:/process_api/ab12\n3:cpuset:/\n0::/\n"
    assert limits.parse_proc_cgroup(v1) == {1: "/process_api/ab12", 2: "/"}
    assert limits.parse_proc_cgroup("0::/user.slice/a b.scope\n") == {2: "/user.slice/a b.scope"}
    assert limits.parse_proc_cgroup("5:cpu,memory,blkio:/x\n") == {1: "/x"}  # co-mounted controllers
    assert limits.parse_proc_cgroup("3:cpu:/y\n") == {}  # no memory controller line
    assert limits.parse_proc_cgroup("") == {}


def test_parse_mountinfo_finds_cgroup2_and_v1_memory_only():
    assert limits.parse_mountinfo(V2_MOUNTINFO) == [Mount(2, "/sys/fs/cgroup", "/")]
    assert limits.parse_mountinfo(V1_MOUNTINFO) == [
        Mount(1, "/sys/fs/cgroup/memory", "/"),
        Mount(2, "/sys/fs/cgroup/unified", "/"),
    ]
    # A container's view: the root shown is its own cgroup; octal escapes in paths; optional fields.
    line = (
        "900 800 0:32 /docker/ab\\040c /sys/fs/cgroup/mem\\040ory ro,nosuid master:9 shared:3 - cgroup cgroup rw,memory"
    )
    assert limits.parse_mountinfo(line) == [Mount(1, "/sys/fs/cgroup/mem ory", "/docker/ab c")]
    assert limits.parse_mountinfo("garbage\n1 2 3\n") == []


def test_cgroup_dirs_walks_up_to_the_mount_root():
    m = Mount(2, "/sys/fs/cgroup", "/")
    assert limits.cgroup_dirs("/a/b", m) == [
        ("/a/b", "/sys/fs/cgroup/a/b"),
        ("/a", "/sys/fs/cgroup/a"),
        ("/", "/sys/fs/cgroup"),
    ]
    assert limits.cgroup_dirs("/", m) == [("/", "/sys/fs/cgroup")]
    # Docker without a cgroup namespace: the mount shows the container's cgroup at its root.
    c = Mount(1, "/sys/fs/cgroup/memory", "/docker/abc")
    assert limits.cgroup_dirs("/docker/abc", c) == [("/docker/abc", "/sys/fs/cgroup/memory")]
    assert limits.cgroup_dirs("/docker/abc/x", c)[0] == ("/docker/abc/x", "/sys/fs/cgroup/memory/x")
    assert limits.cgroup_dirs("/docker/abcd", c) == []  # not under the mount's root
    assert limits.cgroup_dirs("/other", c) == []
    assert limits.cgroup_dirs("/../../outside", m) == []  # another cgroup namespace's cgroup


@given(
    st.lists(st.text(alphabet="abcxyz._-", min_size=1, max_size=6).filter(lambda p: p not in (".", "..")), max_size=5)
)
def test_cgroup_dirs_property(parts):
    path = "/" + "/".join(parts)
    got = limits.cgroup_dirs(path, Mount(1, "/mnt/cg", "/"))
    assert len(got) == len(parts) + 1
    assert got[0] == (path, os.path.join("/mnt/cg", *parts))
    assert got[-1] == ("/", "/mnt/cg")
    for (child, child_dir), (parent, parent_dir) in itertools.pairwise(got):
        assert os.path.dirname(child) == parent and os.path.dirname(child_dir) == parent_dir


def test_parse_limit_max_and_v1_no_limit():
    assert limits.parse_limit("max\n") is None
    assert limits.parse_limit(V1_NO_LIMIT + "\n") is None
    assert limits.parse_limit("9223372036854710272") is None  # v1's no-limit with 64 KiB pages
    assert limits.parse_limit("1073741824\n") == GiB
    assert limits.parse_limit("0") == 0
    with pytest.raises(ValueError):
        limits.parse_limit("lots")


def test_parse_meminfo_and_stat():
    info = limits.parse_meminfo(MEMINFO)
    assert info["MemTotal"] == 16384000 * 1024 and info["MemAvailable"] == 12288000 * 1024
    assert info["HugePages_Total"] == 0  # counts have no unit
    stat = limits.parse_stat(v1_stat(7, 42))
    assert stat["inactive_file"] == 7 and stat["total_inactive_file"] == 42
    assert stat["hierarchical_memory_limit"] == int(V1_NO_LIMIT)


def test_working_set_leaves_out_inactive_page_cache():
    assert limits.working_set(1000, {"inactive_file": 300}, 2) == 700
    assert limits.working_set(1000, {"inactive_file": 7, "total_inactive_file": 300}, 1) == 700  # hierarchical
    assert limits.working_set(1000, {"inactive_file": 300}, 1) == 700  # a v1 without total_ lines
    assert limits.working_set(1000, {}, 2) == 1000
    assert limits.working_set(100, {"inactive_file": 300}, 2) == 0  # never negative


def test_margin_and_room():
    assert limits.margin(GiB) == 256 * MiB  # at least 256 MiB
    assert limits.margin(10 * GiB) == GiB  # 10% of larger limits
    level = Level("cgroup /x (v2)", 2 * GiB, 1 * GiB)
    assert level.free == GiB and level.margin == 256 * MiB and level.room == GiB - 256 * MiB
    assert Level("x", GiB, 900 * MiB).room == 0  # inside the margin: no room, never negative
    assert Level("x", GiB, 2 * GiB).free == 0


# -- reading fake trees -------------------------------------------------------------------------
def test_v2_ancestor_limit_applies_and_the_tightest_wins(tmp_path):
    root = v2_tree(tmp_path)
    found = limits.levels(str(root))
    # The scope has no limit ("max"), the slice has 2 GiB; then the machine.
    assert found == [
        Level("cgroup /user.slice (v2)", 2 * GiB, 1200 * MiB),
        Level("the machine", 16384000 * 1024, (16384000 - 12288000) * 1024),
    ]
    assert limits.tightest(str(root)) == found[0]


def test_v2_own_limit_smaller_than_the_ancestors(tmp_path):
    root = v2_tree(tmp_path, job_max=str(1 * GiB))
    found = limits.levels(str(root))
    assert found[0] == Level("cgroup /user.slice/job.scope (v2)", GiB, 800 * MiB)
    # The scope leaves 1 GiB - 800 MiB - 256 MiB < 0: no room; the slice leaves more.
    assert limits.tightest(str(root)).name == "cgroup /user.slice/job.scope (v2)"
    assert limits.tightest(str(root)).room == 0


def test_ancestor_with_less_room_wins_over_a_smaller_own_limit(tmp_path):
    # The scope may use 1.5 GiB but the slice, shared with others, has only 300 MiB left beyond its margin.
    root = v2_tree(tmp_path, job_max=str(1536 * MiB), slice_max=str(1200 * MiB + 556 * MiB))
    best = limits.tightest(str(root))
    assert best.name == "cgroup /user.slice (v2)" and best.room == 300 * MiB


def test_v1_slurm_job_limit_from_an_ancestor(tmp_path):
    root = v1_tree(tmp_path)
    found = limits.levels(str(root))
    assert found[0] == Level("cgroup /slurm/uid_0/job_42 (v1)", 4 * GiB, 2 * GiB)  # usage - total_inactive_file
    assert found[-1].name == "the machine"
    assert len(found) == 2  # no limit on the step, none above the job; hierarchical_memory_limit is the job's
    assert limits.tightest(str(root)) == found[0]


def test_v1_own_limit_and_hidden_ancestor(tmp_path):
    root = v1_tree(tmp_path, step_limit=str(3 * GiB), hierarchical=str(3 * GiB))
    assert limits.levels(str(root))[0] == Level("cgroup /slurm/uid_0/job_42/step_0 (v1)", 3 * GiB, 1536 * MiB)
    # A container that sees only its own cgroup (the mount's root is its cgroup): an ancestor's
    # smaller limit shows only as hierarchical_memory_limit, and is counted with the cgroup's own usage.
    cg = "sys/fs/cgroup/memory"
    hidden = tree(
        tmp_path / "container",
        {
            "proc/self/cgroup": "4:memory:/kubepods/pod1/ctr\n",
            "proc/self/mountinfo": "35 31 0:32 /kubepods/pod1/ctr /sys/fs/cgroup/memory ro - cgroup cgroup rw,memory\n",
            "proc/meminfo": MEMINFO,
            f"{cg}/memory.limit_in_bytes": f"{8 * GiB}\n",
            f"{cg}/memory.usage_in_bytes": f"{GiB}\n",
            f"{cg}/memory.stat": v1_stat(0, 0, hierarchical=str(2 * GiB)),
        },
    )
    found = limits.levels(str(hidden))
    assert found[:2] == [
        Level("cgroup /kubepods/pod1/ctr (v1)", 8 * GiB, GiB),
        Level("cgroup /kubepods/pod1/ctr (v1, an ancestor's limit)", 2 * GiB, GiB),
    ]
    assert limits.tightest(str(hidden)) == found[1]


def test_hybrid_v2_without_the_memory_controller_uses_v1(tmp_path):
    # /sys/fs/cgroup/unified (v2) exists but has no memory files: only the v1 limit counts.
    root = v1_tree(tmp_path)
    (root / "sys/fs/cgroup/unified").mkdir(parents=True)
    (root / "sys/fs/cgroup/unified/cgroup.procs").write_text("1\n")
    assert [lv.name for lv in limits.levels(str(root))] == ["cgroup /slurm/uid_0/job_42 (v1)", "the machine"]


def test_no_limits_only_the_machine_and_no_proc_at_all(tmp_path):
    root = v2_tree(tmp_path, slice_max="max")
    assert limits.levels(str(root)) == [Level("the machine", 16384000 * 1024, 4096000 * 1024)]
    assert limits.tightest(str(root)).room == 12288000 * 1024 - limits.margin(16384000 * 1024)
    assert limits.levels(str(tmp_path / "nothing")) == []  # not Linux: nothing known, nothing limited
    assert limits.tightest(str(tmp_path / "nothing")) is None


def test_a_cgroup_removed_while_reading_is_skipped(tmp_path):
    root = v2_tree(tmp_path, job_max=str(GiB))
    (root / "sys/fs/cgroup/user.slice/job.scope/memory.current").unlink()
    assert [lv.name for lv in limits.levels(str(root))] == ["cgroup /user.slice (v2)", "the machine"]


def test_the_machine_reads_this_machines_meminfo():
    machine = limits.levels()[-1]
    info = limits.parse_meminfo(Path("/proc/meminfo").read_text())
    assert machine.name == "the machine" and machine.limit == info["MemTotal"]
    assert abs(machine.free - info["MemAvailable"]) < 256 * MiB  # read moments apart


# -- real cgroups --------------------------------------------------------------------------------
def v1_memory_cgroup() -> tuple[str, Path]:
    """This process's v1 memory cgroup: its path and its folder. Skips the test where there is
    none, or where we are not root (making one needs root)."""
    if os.geteuid() != 0:
        pytest.skip("making a memory cgroup needs root")
    path = limits.parse_proc_cgroup(Path("/proc/self/cgroup").read_text()).get(1)
    mount = next((m for m in limits.parse_mountinfo(Path("/proc/self/mountinfo").read_text()) if m.version == 1), None)
    dirs = limits.cgroup_dirs(path, mount) if path is not None and mount is not None else []
    if not dirs or not Path(dirs[0][1], "memory.limit_in_bytes").exists():
        pytest.skip("no v1 memory cgroup on this machine (cgroup v2 only, or no memory controller)")
    return dirs[0][0], Path(dirs[0][1])


READ_IN_CGROUP = r"""
import json, os, sys
open(os.path.join(sys.argv[1], "cgroup.procs"), "w").write(str(os.getpid()))
from coordl.shm import limits
held = bytearray(64 << 20)  # 64 MiB of anonymous memory, touched
print(json.dumps([vars(level) for level in limits.levels()]))
"""


def test_real_v1_cgroup_and_its_parent(tmp_path):
    own_path, own = v1_memory_cgroup()
    name = f"coordl-test-limits-{os.getpid()}"
    parent = own / name
    parent.mkdir()
    try:
        child = parent / "inner"
        child.mkdir()
        try:
            (parent / "memory.limit_in_bytes").write_text(f"{768 * MiB}\n")  # the limit is on the parent
            cmd = [sys.executable, "-c", READ_IN_CGROUP, str(child)]
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)
            assert r.returncode == 0, r.stderr
            found = [Level(**level) for level in json.loads(r.stdout)]
            assert found[0].name == f"cgroup {own_path.rstrip('/')}/{name} (v1)" and found[0].limit == 768 * MiB
            assert 64 * MiB < found[0].used < 512 * MiB  # the child's interpreter and its 64 MiB
            assert found[-1].name == "the machine"
        finally:
            remove_cgroup(child)
    finally:
        remove_cgroup(parent)


def test_real_cgroup2_mount_resolves_the_process_cgroup(tmp_path):
    """Paths in a real cgroup2 hierarchy, as the kernel shows them, resolve to the process's folder
    (where the memory controller is bound to v1, as here, there is no memory.max to read)."""
    if os.geteuid() != 0:
        pytest.skip("mounting cgroup2 needs root")
    mnt = Path(tempfile.mkdtemp(prefix="coordl-cg2-"))
    r = subprocess.run(["mount", "-t", "cgroup2", "none", str(mnt)], capture_output=True, text=True, check=False)
    if r.returncode != 0:
        mnt.rmdir()
        pytest.skip(f"cannot mount cgroup2: {r.stderr.strip()}")
    cg = mnt / f"coordl-test-{os.getpid()}"
    try:
        cg.mkdir()
        code = (
            "import os,sys; open(sys.argv[1] + '/cgroup.procs', 'w').write(str(os.getpid()));"
            "from coordl.shm import limits;"
            "p = limits.parse_proc_cgroup(open('/proc/self/cgroup').read())[2];"
            "ms = [m for m in limits.parse_mountinfo(open('/proc/self/mountinfo').read()) if m.version == 2];"
            "print(p); print(' '.join(limits.cgroup_dirs(p, m)[0][1] for m in ms))"
        )
        r = subprocess.run(
            [sys.executable, "-c", code, str(cg)], capture_output=True, text=True, timeout=60, check=False
        )
        assert r.returncode == 0, r.stderr
        path, dirs = r.stdout.splitlines()
        assert path.endswith(f"/coordl-test-{os.getpid()}")
        assert str(cg) in dirs.split()
    finally:
        if cg.exists():
            remove_cgroup(cg)
        subprocess.run(["umount", str(mnt)], check=False)
        mnt.rmdir()
