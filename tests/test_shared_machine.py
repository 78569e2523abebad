"""Two local users on one machine: what another user makes at coordl's names in the shm folder
is never read, written, followed or removed, and training goes on without it.

The other user is a bare uid (:data:`OTHER`, no passwd entry) run with ``setpriv``; the trainer is
another (:data:`TRAINER`) running a user's script (``shared_machine_train.py``) as a subprocess,
or this test process (root) where it says so. Their shm folder is a sticky folder open to all
(mode 1777, as ``/dev/shm``) on the real tmpfs. A planted file's times are checked too: its atime
is set before the run to before its mtime, so that any read or mapping of it would move it
(``relatime``), and its mtime and ctime move with any write, truncation or chmod.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

import coordl
from coordl.fetch.cache import NodeCache
from coordl.shm import group, names, own, reaper

pytestmark = pytest.mark.usefixtures("python_for_other_users")

OTHER = 23456  # the other local user
TRAINER = 23457  # the user whose script trains
SRC = Path(coordl.__file__).resolve().parents[1]  # this checkout's coordl, for the users' processes
SCRIPT = Path(__file__).with_name("shared_machine_train.py")
PAYLOAD = b"planted by another user " * 200
SECRET = b"the trainer's own file, which no link may make coordl write\n" * 50
FP = "5eed5eed5eed5eed"
FP_OTHER = "0de50de50de50de5"
CACHE_KINDS = ["table", "chunk.0", "lock", "init", "keep"]
STAGING_KINDS = ["stage", "batches", "mutex", "member.0"]


def as_user(uid: int, cmd: list[str], **kw) -> subprocess.CompletedProcess:
    """Runs ``cmd`` as ``uid`` (its own group, no other groups)."""
    return subprocess.run(["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", *cmd], **kw)


def python_as(uid: int, code: str, *args: str, env: dict | None = None) -> None:
    as_user(uid, [sys.executable, "-c", code, *args], check=True, timeout=120, env=env)


def plant_file(path: Path, mode: int = 0o666) -> None:
    """The other user makes a file at ``path`` first (by default open to all: the old code would
    have used it as its own)."""
    code = (
        "import os, sys; os.umask(0);"
        "fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_EXCL, int(sys.argv[2]));"
        "os.write(fd, bytes.fromhex(sys.argv[3])); os.close(fd)"
    )
    python_as(OTHER, code, str(path), str(mode), PAYLOAD.hex())


def plant_link(path: Path, target: Path) -> None:
    python_as(OTHER, "import os, sys; os.symlink(sys.argv[1], sys.argv[2])", str(target), str(path))


def times_armed(path: Path) -> None:
    """Sets ``path``'s atime before its mtime (not following a link): a read would move it."""
    st = os.lstat(path)
    os.utime(path, ns=(10**9, st.st_mtime_ns), follow_symlinks=False)


def snapshot(path: Path) -> tuple:
    st = os.lstat(path)
    return (st.st_ino, st.st_mode, st.st_uid, st.st_nlink, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_atime_ns)


@dataclass
class Planted:
    """A file or link another user made, and the trainer's file a link points at, as they were."""

    path: Path
    before: tuple
    target: Path | None = None
    target_before: tuple | None = None

    @classmethod
    def take(cls, path: Path, target: Path | None = None) -> Planted:
        times_armed(path)
        if target is not None:
            times_armed(target)
        return cls(path, snapshot(path), target, snapshot(target) if target is not None else None)

    def assert_untouched(self) -> None:
        # Stat first: reading the bytes here moves the atime.
        assert snapshot(self.path) == self.before, f"{self.path} was read, written or replaced"
        if self.target is None:
            assert self.path.read_bytes() == PAYLOAD
        else:
            assert snapshot(self.target) == self.target_before, f"{self.target} was read or written through a link"
            assert os.readlink(self.path) == str(self.target)
            assert self.target.read_bytes() == SECRET


@dataclass
class Machine:
    """A shm folder both users can reach (1777), the trainer's home (its index, its own file) and
    the dataset (readable by both)."""

    data: Path
    shm: Path
    home: Path

    @property
    def trainers_file(self) -> Path:
        return self.home / "weights.pt"

    def env(self) -> dict:
        env = {k: v for k, v in os.environ.items() if not k.startswith("COORDL_")}
        env.update(
            PYTHONPATH=str(SRC),
            HOME=str(self.home),
            COORDL_SHM_DIR=str(self.shm),
            COORDL_INDEX_DIR=str(self.home / "index"),
            OMP_NUM_THREADS="1",
        )
        return env

    def train(self, *args: str, uid: int = TRAINER) -> dict:
        """Runs the user's script as ``uid`` (0: root, this process's user); it must exit 0 with
        nothing of coordl's (a traceback, a logged warning) on stderr. Returns its JSON."""
        cmd = [sys.executable, str(SCRIPT), str(self.data), *args]
        if uid:
            p = as_user(uid, cmd, env=self.env(), capture_output=True, text=True, timeout=600, cwd=self.home)
        else:
            p = subprocess.run(cmd, env=self.env(), capture_output=True, text=True, timeout=600, cwd=self.home)
        assert p.returncode == 0, f"the script failed ({p.returncode}):\n{p.stderr}"
        assert "Traceback" not in p.stderr and "coordl" not in p.stderr, p.stderr
        return json.loads(p.stdout.strip().splitlines()[-1])

    def plant(self, path: Path, form: str) -> Planted:
        """The other user makes ``path`` first: a file open to all, or a link to the trainer's file."""
        if form == "file":
            plant_file(path)
            return Planted.take(path)
        plant_link(path, self.trainers_file)
        return Planted.take(path, self.trainers_file)


def _folder(parent: Path, name: str, mode: int, uid: int = 0) -> Path:
    d = parent / name
    d.mkdir()
    os.chown(d, uid, uid)
    d.chmod(mode)
    return d


@pytest.fixture(scope="module")
def readable_data(tiny_dataset):
    """The tiny dataset where both users can read it (the test's tmp folders are root's alone)."""
    base = Path(tempfile.mkdtemp(prefix="coordl-two-users-", dir="/dev/shm"))
    base.chmod(0o755)
    shutil.copytree(tiny_dataset, base / "data")
    for d, _, files in os.walk(base / "data"):
        os.chmod(d, 0o755)
        for f in files:
            os.chmod(os.path.join(d, f), 0o644)
    yield base / "data"
    shutil.rmtree(base)


def _machine(data: Path) -> tuple[Machine, Path]:
    base = Path(tempfile.mkdtemp(prefix="coordl-machine-", dir="/dev/shm"))
    base.chmod(0o755)
    m = Machine(data, _folder(base, "shm", 0o1777), _folder(base, "home", 0o700, TRAINER))
    m.trainers_file.write_bytes(SECRET)
    os.chown(m.trainers_file, TRAINER, TRAINER)
    m.trainers_file.chmod(0o600)
    return m, base


@pytest.fixture
def machine(readable_data):
    m, base = _machine(readable_data)
    yield m
    shutil.rmtree(base)


@pytest.fixture(scope="module")
def reference(readable_data) -> dict:
    """The trainer's script without a cache or a group, and the trainer's names."""
    m, base = _machine(readable_data)
    try:
        out = m.train()
        assert os.listdir(m.shm) == []
    finally:
        shutil.rmtree(base)
    assert len(out["batches"]) == 2 * 15 and out["warnings"] == []
    return out


# -- the one check, on every kind of object --------------------------------------------------------
FORMS = [
    "another user's file",
    "another user's file open to all",
    "a link to this user's file",
    "this user's file open to others",
    "a second link to this user's file",
    "a FIFO",
    "a folder",
]


@pytest.fixture
def shared_shm(isolated):
    """The test's shm folder, open to the other user as /dev/shm is."""
    isolated.chmod(0o1777)
    return isolated


def _make(form: str, path: Path, mine: Path) -> str:
    """Makes the object ``form`` at ``path`` (``mine``: a file of this process's user beside it);
    returns what the check must say about it."""
    if form == "another user's file":
        plant_file(path, 0o600)
        return "owned by another user"
    if form == "another user's file open to all":
        plant_file(path)
        return "owned by another user"
    if form == "a link to this user's file":
        plant_link(path, mine)
        return "a symbolic link"
    if form == "this user's file open to others":
        path.write_bytes(PAYLOAD)
        path.chmod(0o644)
        return "mode 0644, open to other users"
    if form == "a second link to this user's file":
        os.link(mine, path)
        return "2 hard links"
    if form == "a FIFO":
        python_as(OTHER, "import os, sys; os.mkfifo(sys.argv[1], 0o666)", str(path))
        return "not a regular file"
    python_as(OTHER, "import os, sys; os.mkdir(sys.argv[1], 0o777)", str(path))
    return "not a regular file"


@pytest.mark.parametrize("form", FORMS)
def test_only_this_users_own_private_file_is_opened_or_created(shared_shm, form):
    mine = shared_shm / "mine"
    mine.write_bytes(SECRET)
    mine.chmod(0o600)
    path = shared_shm / names.segment_name(FP, "table")
    why = _make(form, path, mine)
    times_armed(path)
    times_armed(mine)
    before, mine_before = snapshot(path), snapshot(mine)
    try:
        for attempt in (own.open_own, lambda p: own.open_own(p, write=False), own.create_exclusive, own.open_or_create):
            with pytest.raises(own.ForeignFileError) as e:
                attempt(str(path))
            assert e.value.found == (own.Foreign(str(path), os.lstat(path).st_uid, why),)
            assert isinstance(e.value, PermissionError) and str(path) in str(e.value) and "`rm`" in str(e.value)
        with pytest.raises(own.ForeignFileError, match=why):
            NodeCache(FP, np.full(10, 100), 1000, directory=str(shared_shm))  # not joined: nothing made
        assert sorted(os.listdir(shared_shm)) == sorted(["mine", path.name])
        assert reaper.list_groups(str(shared_shm)) == [] and reaper.reap(str(shared_shm), include_kept=True) == []
        group.remove_group(FP, str(shared_shm))
        assert snapshot(path) == before and snapshot(mine) == mine_before
    finally:
        if stat.S_ISDIR(os.lstat(path).st_mode):
            path.rmdir()
        else:
            path.unlink()
        mine.unlink()


def test_this_users_own_private_file_passes_the_check(shared_shm):
    path = str(shared_shm / names.segment_name(FP, "table"))
    fd, created = own.open_or_create(path)
    os.close(fd)
    assert created and stat.S_IMODE(os.stat(path).st_mode) == 0o600
    fd, created = own.open_or_create(path)
    os.close(fd)
    assert not created and own.foreign(path) is None
    with pytest.raises(FileExistsError):
        own.create_exclusive(path)
    os.unlink(path)


# -- the node cache ----------------------------------------------------------------------------
@pytest.mark.parametrize("form", ["file", "symlink"])
@pytest.mark.parametrize("kind", CACHE_KINDS)
def test_a_name_of_the_node_cache_taken_by_another_user_leaves_the_run_uncached_and_the_file_alone(
    machine, reference, kind, form
):
    path = machine.shm / f"{names.PREFIX}.{reference['names']['cache']}.{kind}"
    planted = machine.plant(path, form)
    run = machine.train("--cache", "1.0", "--keep")
    assert run["batches"] == reference["batches"]  # the same tensors as without a cache
    assert [s["cache_hits"] for s in run["stats"]] == [0, 0]
    (warning,) = run["warnings"]
    assert warning.startswith("RuntimeWarning: coordl: the node cache is off for this run: "), warning
    assert f"{path} (" in warning and f"owner uid {OTHER})" in warning and "`rm` as their owner or root" in warning
    planted.assert_untouched()
    assert os.listdir(machine.shm) == [path.name]  # nothing of the trainer's was made there


@pytest.mark.parametrize("trainer", [TRAINER, 0], ids=["user", "root"])
def test_a_kept_cache_another_user_then_owns_gives_no_hits_and_is_left_alone(machine, reference, trainer):
    first = machine.train("--cache", "1.0", "--keep", uid=trainer)
    assert first["batches"] == reference["batches"] and first["stats"][1]["cache_hits"] == 120  # kept warm
    kept = sorted(machine.shm.iterdir())
    assert {names.parse_name(p.name)[1] for p in kept} >= {"table", "chunk", "lock", "init", "keep"}
    for p in kept:
        os.chown(p, OTHER, OTHER)  # root hands the cache to another user
        times_armed(p)
    before = {p: snapshot(p) for p in kept}
    run = machine.train("--cache", "1.0", "--keep", uid=trainer)
    assert run["batches"] == reference["batches"]
    assert [s["cache_hits"] for s in run["stats"]] == [0, 0]  # none of its bytes served
    (warning,) = run["warnings"]
    assert "the node cache is off for this run" in warning
    assert all(f"{p} (owned by another user" in warning for p in kept)
    assert {p: snapshot(p) for p in kept} == before  # not read, written, locked or removed (close() included)
    assert sorted(machine.shm.iterdir()) == kept


def test_a_chunk_planted_while_the_cache_grows_stops_it_and_is_left_alone(shared_shm, cache_layout, recwarn):
    cache_layout(4096, 4096)
    sizes = np.full(40, 700)
    cache = NodeCache(FP, sizes, 20_000, directory=str(shared_shm))
    path = shared_shm / names.segment_name(FP, "chunk", 2)
    plant_file(path)
    planted = Planted.take(path)
    try:
        got = []
        for i in range(40):
            views = cache.reserve_many(np.array([i]))[0]
            if views is None:
                break
            for v in views:
                v[:] = i % 251
            cache.publish_many(np.array([i]))
            got.append(i)
        assert got == list(range(8192 // 700))  # every item that fits before chunk 2
        assert cache.reserve_many(np.array([39]))[0] is None  # full: no later item either
        for i in got:
            assert (cache.get(i) == i % 251).all()
        (w,) = [str(w.message) for w in recwarn.list]
        assert "the cache stopped growing" in w and f"{path} (owned by another user" in w and "`rm`" in w
    finally:
        cache.close()
    planted.assert_untouched()
    assert os.listdir(shared_shm) == [path.name]  # the last user removed its own files, not that one
    path.unlink()


def test_both_tiers_taken_turn_both_off_with_one_warning_and_no_worker_attaches(shared_shm, recwarn):
    from coordl.fetch.spec import CacheSpec
    from coordl.tiers.plan import TierPlan

    encoded = CacheSpec(FP, 10_000, False, str(shared_shm), FP)
    decoded = CacheSpec(FP_OTHER, 10_000, False, str(shared_shm), FP, tier="decoded")
    paths = [shared_shm / names.segment_name(FP, "lock"), shared_shm / names.segment_name(FP_OTHER, "table")]
    planted = []
    for p in paths:
        plant_file(p)
        planted.append(Planted.take(p))
    plan = TierPlan(encoded=encoded, encoded_budget=10_000, decoded=decoded, decoded_budget=10_000)
    assert plan.open(np.full(10, 100)) == (None, None)
    assert (plan.encoded, plan.encoded_budget, plan.decoded, plan.decoded_budget) == (None, 0, None, 0)
    (w,) = [str(w.message) for w in recwarn.list]
    assert w.startswith("coordl: the node cache and its decoded tier are off for this run: ")
    assert all(f"{p} (owned by another user; owner uid {OTHER})" in w for p in paths)
    for p in planted:
        p.assert_untouched()
    assert sorted(os.listdir(shared_shm)) == sorted(p.name for p in paths)
    for p in paths:
        p.unlink()


def test_cache_ls_and_clean_leave_other_users_files_alone(shared_shm):
    # The other user's own cache, made by coordl as that user: theirs to list and remove.
    env = {**os.environ, "PYTHONPATH": str(SRC), "COORDL_SHM_DIR": str(shared_shm)}
    code = (
        "import sys, numpy as np; from coordl.fetch.cache import NodeCache;"
        "c = NodeCache(sys.argv[1], np.full(10, 100), 1000, keep=True, directory=sys.argv[2]);"
        "v = c.reserve_many(np.array([0]))[0]; v[0][:] = 7; c.publish_many(np.array([0])); c.close()"
    )
    python_as(OTHER, code, FP_OTHER, str(shared_shm), env=env)
    theirs = sorted(p for p in shared_shm.iterdir())
    # This user's kept cache, then another user's file and link at two of its names.
    mine = NodeCache(FP, np.full(10, 100), 1000, keep=True, directory=str(shared_shm))
    mine.close()
    secret = shared_shm / "weights.pt"
    secret.write_bytes(SECRET)
    secret.chmod(0o600)
    plant_file(shared_shm / names.segment_name(FP, "chunk", 9))
    plant_link(shared_shm / names.segment_name(FP, "stage"), secret)
    planted = [
        Planted.take(shared_shm / names.segment_name(FP, "chunk", 9)),
        Planted.take(shared_shm / names.segment_name(FP, "stage"), secret),
    ]
    for p in theirs:
        times_armed(p)
    before = {p: snapshot(p) for p in theirs}
    try:
        cli = [sys.executable, "-m", "coordl.cli", "cache"]
        ls = subprocess.run([*cli, "ls"], env=env, capture_output=True, text=True, timeout=120)
        assert ls.returncode == 0, ls.stderr
        assert FP in ls.stdout and FP_OTHER not in ls.stdout and "kept warm" in ls.stdout
        clean = subprocess.run([*cli, "clean"], env=env, capture_output=True, text=True, timeout=120)
        assert clean.returncode == 0, clean.stderr
        assert f"removed {FP}" in clean.stdout and FP_OTHER not in clean.stdout
        left = sorted(shared_shm.iterdir())
        assert left == sorted([*theirs, secret, *(p.path for p in planted)])  # only this user's files went
        assert {p: snapshot(p) for p in theirs} == before
        for p in planted:
            p.assert_untouched()
    finally:
        for p in shared_shm.iterdir():
            p.unlink()


# -- the HP group's staging area ---------------------------------------------------------------
@pytest.mark.parametrize("form", ["file", "symlink"])
@pytest.mark.parametrize("kind", STAGING_KINDS)
def test_a_name_of_an_hp_groups_staging_taken_by_another_user_leaves_the_trial_alone_and_the_file_alone(
    machine, reference, kind, form
):
    path = machine.shm / f"{names.PREFIX}.{reference['names']['hp_group']}.{kind}"
    planted = machine.plant(path, form)
    run = machine.train("--hp-group", "sweep")
    assert run["batches"] == reference["batches"]  # the loader alone's batches
    (warning,) = run["warnings"]
    assert warning.startswith("RuntimeWarning: coordl: hp_group 'sweep' is not shared by this job, which runs alone: ")
    assert f"{path} (" in warning and f"owner uid {OTHER})" in warning and "`rm` as their owner or root" in warning
    planted.assert_untouched()
    assert os.listdir(machine.shm) == [path.name]


def test_the_kinds_planted_here_are_every_kind_of_shared_file():
    assert {k.split(".")[0] for k in CACHE_KINDS + STAGING_KINDS} == set(names.KINDS)
