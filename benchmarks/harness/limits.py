"""The conditions a scenario sets on the machine: v1 memory and blkio cgroups for one child, and the page cache dropped
or filled.

The memory cgroup caps everything the child charges: its anonymous memory, the page cache of the files it reads and
the shared memory (``/dev/shm``) it writes. That is what makes a comparison fair: a page-cache loader and coordl's
shared-memory cache get the same bytes. The blkio cgroup throttles the child's reads from the dataset's block
device. :func:`probe` says what this machine allows; a scenario that cannot apply a limit records why and runs
without it.
"""

import os
import time
from pathlib import Path

V1 = Path("/sys/fs/cgroup")


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
    """Drops the files under ``root`` from the page cache (``POSIX_FADV_DONTNEED``), and only them.
    Each is written back first: the advice leaves dirty pages (a dataset just made) in the cache."""
    for folder, _, files in os.walk(root):
        for f in files:
            fd = os.open(os.path.join(folder, f), os.O_RDONLY)
            try:
                os.fdatasync(fd)
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


def blkio_read(path: str | Path | None, device: str) -> int | None:
    """Bytes a v1 blkio cgroup read from ``device`` (``MAJ:MIN``) so far, from its
    ``blkio.throttle.io_service_bytes`` file at ``path`` (a cgroup folder or the file); None without one."""
    if not path:
        return None
    path = Path(path)
    path = path / "blkio.throttle.io_service_bytes" if path.is_dir() else path
    for parts in (line.split() for line in path.read_text().splitlines()):
        if len(parts) == 3 and parts[0] == device and parts[1] == "Read":
            return int(parts[2])
    return 0  # nothing read from that device yet


def memory_stat(path: str | Path) -> dict[str, int]:
    """A v1 memory cgroup's ``memory.stat`` (the cgroup's folder ``path``): every counter by name."""
    return {k: int(v) for k, v in (line.split() for line in Path(path, "memory.stat").read_text().splitlines())}


class Cgroup:
    """A fresh v1 cgroup below this process's own, in one controller; removed by ``remove()``."""

    def __init__(self, controller: str, name: str):
        self.path = V1 / controller / (_own_path(controller) or "/").lstrip("/") / name
        self.path.mkdir()

    def write(self, knob: str, value) -> None:
        (self.path / knob).write_text(f"{value}\n")

    def read(self, knob: str) -> str:
        return (self.path / knob).read_text()

    def remove(self, timeout: float = 10.0) -> None:
        """Removes the cgroup once its processes are gone (their exit can lag their wait)."""
        deadline = time.monotonic() + timeout
        while self.path.exists():
            try:
                self.path.rmdir()
            except OSError:
                if time.monotonic() > deadline and self.path.exists():
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
        for cg in filter(None, (self.memory, self.blkio)):
            cg.write("cgroup.procs", os.getpid())

    @property
    def memory_path(self) -> str | None:
        return str(self.memory.path) if self.memory else None

    def usage(self) -> int | None:
        return int(self.memory.read("memory.usage_in_bytes")) if self.memory else None

    def stat(self, key: str) -> int | None:
        return memory_stat(self.memory.path).get(key) if self.memory else None

    def limit_memory(self, nbytes: int) -> None:
        if self.memory:
            self.memory.write("memory.limit_in_bytes", int(nbytes))

    def throttle(self, device: tuple[int, int], bytes_per_s: int | None) -> None:
        if self.blkio and bytes_per_s:
            self.blkio.write("blkio.throttle.read_bps_device", f"{device[0]}:{device[1]} {int(bytes_per_s)}")

    def remove(self) -> None:
        for cg in filter(None, (self.blkio, self.memory)):
            cg.remove()
