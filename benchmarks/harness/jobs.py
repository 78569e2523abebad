"""Launching a scenario's jobs: child processes, jobs started together, v1 memory and blkio
cgroups for one child, and the page cache dropped.

A scenario's child runs the scenario again (``python -m benchmarks NAME --job ...``,
:func:`scenario_command`) and says what it measured as JSON: in a file, or as the last line of its
standard output (:func:`run_json`).

The memory cgroup caps everything the child charges: its anonymous memory, the page cache of the
files it reads and the shared memory (``/dev/shm``) it writes. That is what makes a comparison
fair: a page-cache loader and coordl's shared-memory cache get the same bytes. The blkio cgroup
throttles the child's reads from the dataset's block device. :func:`probe` says what this machine
allows; a scenario that cannot apply a limit records why and runs without it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

V1 = Path("/sys/fs/cgroup")


def scenario_command(name: str, *args: str) -> list[str]:
    """The command that runs scenario ``name`` in a child Python (``python -m benchmarks NAME``).

    The child finds the ``benchmarks`` package as its parent did: in the working directory it
    inherits (the repository root), or on the ``PYTHONPATH`` it inherits.
    """
    return [sys.executable, "-m", "benchmarks", name, *args]


def module_command(module: str, *args: str) -> list[str]:
    """The command that runs a helper module of ``benchmarks`` (not a scenario) in a child Python."""
    return [sys.executable, "-m", f"benchmarks.{module}", *args]


def run_json(command: list[str], *, timeout: float | None = None, **kwargs) -> dict:
    """Runs ``command`` to its end; returns the JSON of the last line of its output.

    A child that fails raises ``SystemExit`` with the end of its standard error.
    """
    p = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False, **kwargs)
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(command[:6])} ... failed ({p.returncode}):\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def say(**msg) -> None:
    """In a child: one JSON line for its parent."""
    print(json.dumps(msg), flush=True)


# -- jobs started together ------------------------------------------------------------------
def job_files(workdir: Path, k: int) -> tuple[Path, Path]:
    """Job ``k``'s output and ready files in ``workdir``, neither left from a run before."""
    out, ready = workdir / f"out{k}.json", workdir / f"ready{k}"
    out.unlink(missing_ok=True)
    ready.unlink(missing_ok=True)
    return out, ready


def start_together(commands: list[list[str]], readies: list[Path], go: Path, before_go=None, **popen) -> list:
    """Starts the jobs' ``commands``; once every one has touched its ready file (its loader is made),
    calls ``before_go`` and touches ``go``, which they all wait for (:func:`wait_for_go`)."""
    go.unlink(missing_ok=True)
    procs = [subprocess.Popen(c, **popen) for c in commands]
    while not all(r.exists() for r in readies):
        if any(p.poll() not in (None, 0) for p in procs):
            for p in procs:
                p.kill()
            raise SystemExit("a job failed before starting")
        time.sleep(0.05)
    if before_go is not None:
        before_go()
    go.touch()
    return procs


def start_jobs(commands: list[list[str]], workdir: Path, before_go=None, **popen) -> tuple[list, list[Path]]:
    """Starts ``commands`` (each given ``--out``, ``--ready`` and ``--go``) together, ``before_go``
    called once all are ready; returns the processes and their ``--out`` files."""
    go, outs, full = workdir / "go", [], []
    for k, c in enumerate(commands):
        out, ready = job_files(workdir, k)
        outs.append(out)
        full.append([*c, "--out", str(out), "--ready", str(ready), "--go", str(go)])
    readies = [workdir / f"ready{k}" for k in range(len(commands))]
    return start_together(full, readies, go, before_go, **popen), outs


def run_together(commands: list[list[str]], workdir: Path, before_go=None, **popen) -> list[dict]:
    """:func:`start_jobs`, then waits for them all; returns what each wrote to its ``--out``."""
    procs, outs = start_jobs(commands, workdir, before_go, **popen)
    if any(p.wait() for p in procs):
        raise SystemExit(f"a job failed: exit codes {[p.returncode for p in procs]}")
    return [json.loads(f.read_text()) for f in outs]


def wait_for_go(ready: str | None, go: str | None) -> None:
    """In a job: says it is ready, then waits for the go file of :func:`start_together`."""
    if not ready:
        return
    Path(ready).touch()
    while not os.path.exists(go):
        time.sleep(0.01)


# -- the page cache -------------------------------------------------------------------------
def drop_page_cache(level: int = 3) -> str | None:
    """Drops the OS caches (1: page cache, 3: also dentries and inodes); returns why it could not, or None."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write(f"{level}\n")
        return None
    except OSError as e:
        return f"cannot drop the page cache ({e}); run as root for cold-storage numbers"


def evict(root: str) -> None:
    """Drops the files under ``root`` from the page cache (``POSIX_FADV_DONTNEED``), and only them."""
    for folder, _, files in os.walk(root):
        for f in files:
            fd = os.open(os.path.join(folder, f), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def read_through(paths) -> int:
    """Reads every file of ``paths`` once (into the page cache); returns the bytes read."""
    n = 0
    for p in paths:
        with open(p, "rb") as f:
            while chunk := f.read(1 << 20):
                n += len(chunk)
    return n


# -- cgroups (v1) ----------------------------------------------------------------------------
def _own_path(controller: str) -> str | None:
    """This process's cgroup path in a v1 hierarchy (``/proc/self/cgroup``), or None."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if controller in controllers.split(","):
            return path
    return None


def probe() -> dict:
    """What can be applied here: ``{"memory": bool, "blkio": bool, "drop_caches": bool, "notes": [...]}``."""
    notes, ok, root = [], {}, os.geteuid() == 0
    if not root:
        notes.append(
            "not root: no memory cgroup, no blkio throttle, no page-cache drop; "
            "results are for an unlimited, unthrottled, possibly warm machine"
        )
    for controller, knob in (("memory", "memory.limit_in_bytes"), ("blkio", "blkio.throttle.read_bps_device")):
        path = _own_path(controller)
        base = V1 / controller / (path or "").lstrip("/")
        ok[controller] = bool(root and path is not None and (base / knob).exists())
        if root and not ok[controller]:
            if (V1 / "cgroup.controllers").exists():
                notes.append(f"cgroup v2 only: this runner applies v1 {controller} cgroups; running without")
            else:
                notes.append(f"no v1 {controller} cgroup at {base}; running without")
    return {"memory": ok["memory"], "blkio": ok["blkio"], "drop_caches": root, "notes": notes}


class Cgroup:
    """A fresh v1 cgroup below this process's own, in one controller; removed by ``remove()``."""

    def __init__(self, controller: str, name: str):
        self.path = V1 / controller / (_own_path(controller) or "/").lstrip("/") / name
        self.path.mkdir()

    def write(self, knob: str, value) -> None:
        (self.path / knob).write_text(f"{value}\n")

    def read(self, knob: str) -> str:
        return (self.path / knob).read_text()

    def add(self, pid: int) -> None:
        self.write("cgroup.procs", pid)

    def remove(self, timeout: float = 10.0) -> None:
        """Removes the cgroup once its processes are gone (their exit can lag their wait)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)


class Limits:
    """The memory and blkio cgroups of one child; either may be absent (``probe()`` said no)."""

    def __init__(self, name: str, memory: bool, blkio: bool):
        self.memory = Cgroup("memory", name) if memory else None
        try:
            self.blkio = Cgroup("blkio", name) if blkio else None
        except BaseException:
            if self.memory:
                self.memory.remove()
            raise

    def join(self) -> None:
        """Moves the calling process in (use as ``preexec_fn``, so the child starts inside)."""
        for cg in (self.memory, self.blkio):
            if cg:
                cg.add(os.getpid())

    @property
    def memory_path(self) -> str | None:
        return str(self.memory.path) if self.memory else None

    def usage(self) -> int | None:
        return int(self.memory.read("memory.usage_in_bytes")) if self.memory else None

    def stat(self, key: str) -> int | None:
        if not self.memory:
            return None
        for line in self.memory.read("memory.stat").splitlines():
            k, v = line.split()
            if k == key:
                return int(v)
        return None

    def limit_memory(self, nbytes: int) -> None:
        if self.memory:
            self.memory.write("memory.limit_in_bytes", int(nbytes))

    def throttle(self, device: tuple[int, int], bytes_per_s: int | None) -> None:
        if self.blkio and bytes_per_s:
            self.blkio.write("blkio.throttle.read_bps_device", f"{device[0]}:{device[1]} {int(bytes_per_s)}")

    def remove(self) -> None:
        for cg in (self.blkio, self.memory):
            if cg:
                cg.remove()


# -- a child that reports and waits ------------------------------------------------------------
class Parent:
    """A child's side of :func:`converse`: one JSON line out, then wait for the parent's go-ahead
    (it reads its counters and resets them in between)."""

    say = staticmethod(say)

    def wait(self) -> None:
        if sys.stdin.readline().strip() != "go":
            raise SystemExit("the parent went away")


def converse(command: list[str], on_message, **popen) -> tuple[int, str, dict]:
    """Runs a child speaking :class:`Parent`'s side: calls ``on_message(event, msg)`` for each JSON line
    it says (other lines are a library's chatter) until its ``done``, answering ``go`` after each.
    Returns its exit status, its standard error and its ``done`` message."""
    proc = subprocess.Popen(
        command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen
    )
    done = {}
    try:
        while line := proc.stdout.readline():
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            event = msg.pop("event")
            if event == "done":
                done = msg
                break
            on_message(event, msg)
            proc.stdin.write("go\n")
            proc.stdin.flush()
        proc.stdin.close()
        err = proc.stderr.read()
        proc.wait(120)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    return proc.returncode, err, done


def error_text(stderr: str) -> str:
    """The part of a child's stderr that says what failed (its last traceback, else its tail)."""
    at = stderr.rfind("Traceback (most recent call last)")
    return (stderr[at:] if at >= 0 else stderr).strip()[-3000:]
