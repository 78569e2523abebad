"""Memory limits: how much memory this process's cgroups and the machine leave, read from the kernel.

Shared memory is memory. A page of a tmpfs (``/dev/shm``) is charged to the memory cgroup of
the process that allocates it (``posix_fallocate`` included), stays charged while the file
exists, and cannot be reclaimed without swap; a group over its limit gets a process killed.
So a cache may only take what the limits leave. Those that apply to a process:

- cgroup v2: ``memory.max`` of its cgroup and of every ancestor visible under the cgroup2
  mount, each with its ``memory.current``;
- cgroup v1: ``memory.limit_in_bytes`` of the same in the hierarchy that holds the ``memory``
  controller, each with its ``memory.usage_in_bytes``, and the ``hierarchical_memory_limit``
  of ``memory.stat`` (which counts ancestors a container cannot see);
- the machine: ``MemTotal``, with ``MemTotal - MemAvailable`` in use (``/proc/meminfo``).

What counts as used leaves out the inactive page cache (``inactive_file``; v1's hierarchical
``total_inactive_file``), which the kernel reclaims before it kills anything: the working set,
as the kernel's own estimate and kubelet's count it. A cache's pages are ``shmem``, never on the
file lists, so they always count.

Every limit keeps a :func:`margin` free for the processes' own growth and the other processes
of the group; :attr:`Level.room` is what is left for a cache beyond it, and :func:`tightest`
the limit that leaves the least. The ``parse_*`` functions and :func:`cgroup_dirs` are pure (the
files' text in, values out); :func:`levels` reads the files, in the cgroups that
:mod:`coordl.cgroups` finds.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from coordl import cgroups
from coordl.cgroups import Mount, cgroup_dirs

__all__ = [
    "Level",
    "Mount",
    "cgroup_dirs",
    "levels",
    "margin",
    "parse_limit",
    "parse_meminfo",
    "parse_mountinfo",
    "parse_proc_cgroup",
    "parse_stat",
    "tightest",
    "working_set",
]

UNLIMITED = 1 << 62  # v1 writes "no limit" as its largest page count: 9223372036854771712 with 4 KiB pages
MIN_MARGIN = 256 << 20


def margin(limit: int) -> int:
    """Bytes under a memory limit that a cache never takes: 10% of the limit, at least 256 MiB.

    They are for what grows after the cache has taken its memory, which it never gives back:
    the processes' own memory (a loader's pipeline and batches swing by 100 MiB or more; a
    training step's tensors) and the group's other processes.
    """
    return max(MIN_MARGIN, limit // 10)


@dataclass(frozen=True)
class Level:
    """One memory limit that applies to this process.

    Attributes:
        name: where it comes from, for messages: ``cgroup /a/b (v1)``, ``the machine``.
        limit: bytes.
        used: bytes counted against it now, the reclaimable inactive page cache left out.
    """

    name: str
    limit: int
    used: int

    @property
    def free(self) -> int:
        return max(0, self.limit - self.used)

    @property
    def margin(self) -> int:
        return margin(self.limit)

    @property
    def room(self) -> int:
        """Bytes a cache may still take: what is free beyond the margin."""
        return max(0, self.limit - self.used - self.margin)


# -- parsing: the files' text in, values out ------------------------------------------------------
# (where the cgroups are is found by coordl.cgroups, for any controller; these read memory's)
def parse_proc_cgroup(text: str) -> dict[int, str]:
    """The process's cgroup paths from ``/proc/<pid>/cgroup``: ``{1: v1 memory path, 2: v2 path}``."""
    return cgroups.parse_proc_cgroup(text, "memory")


def parse_mountinfo(text: str) -> list[Mount]:
    """The cgroup mounts in ``/proc/<pid>/mountinfo``: cgroup2, and v1 hierarchies with ``memory``."""
    return cgroups.parse_mountinfo(text, "memory")


def parse_limit(text: str) -> int | None:
    """A limit file's bytes (``memory.max``, ``memory.limit_in_bytes``); None for no limit
    (``max``, or v1's largest value)."""
    text = text.strip()
    if text == "max":
        return None
    value = int(text)
    return None if value >= UNLIMITED else value


def parse_stat(text: str) -> dict[str, int]:
    """``memory.stat``'s ``key value`` lines."""
    out = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].lstrip("-").isdigit():
            out[parts[0]] = int(parts[1])
    return out


def parse_meminfo(text: str) -> dict[str, int]:
    """``/proc/meminfo`` in bytes: ``{"MemTotal": ..., "MemAvailable": ...}``."""
    out = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        parts = value.split()
        if parts and parts[0].isdigit():
            out[key.strip()] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    return out


def working_set(usage: int, stat: dict[str, int], version: int) -> int:
    """A cgroup's usage less its inactive page cache, which the kernel reclaims before killing:
    v1's hierarchical ``total_inactive_file`` (its usage is hierarchical too), v2's ``inactive_file``."""
    keys = ("total_inactive_file", "inactive_file") if version == 1 else ("inactive_file",)
    inactive = next((stat[k] for k in keys if k in stat), 0)
    return max(0, usage - inactive)


# -- reading the kernel's files --------------------------------------------------------------------
def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


_FILES = {1: ("memory.limit_in_bytes", "memory.usage_in_bytes"), 2: ("memory.max", "memory.current")}


def _cgroup_levels(version: int, pairs: list[tuple[str, str]]) -> list[Level]:
    out = []
    limit_file, usage_file = _FILES[version]
    hidden = None
    for k, (path, directory) in enumerate(pairs):
        own_v1 = k == 0 and version == 1  # its memory.stat also holds the least limit of all its ancestors
        try:
            limit = parse_limit(_read(os.path.join(directory, limit_file)))
            if limit is None and not own_v1:
                continue
            stat = parse_stat(_read(os.path.join(directory, "memory.stat")))
            used = working_set(int(_read(os.path.join(directory, usage_file))), stat, version)
        except (OSError, ValueError):  # no memory controller here (v2 beside v1), or a cgroup just removed
            continue
        if limit is not None:
            out.append(Level(f"cgroup {path} (v{version})", limit, used))
        if own_v1 and (top := parse_limit(str(stat.get("hierarchical_memory_limit", "max")))) is not None:
            hidden = Level(f"cgroup {path} (v1, an ancestor's limit)", top, used)
    if hidden is not None and all(hidden.limit < level.limit for level in out):
        # An ancestor's limit that the mount does not show (a container's view of its cgroups):
        # that ancestor's usage is unknown, and this cgroup's is the least of it.
        out.append(hidden)
    return out


def levels(root: str = "/") -> list[Level]:
    """Every memory limit that applies to this process, its cgroups' first, the machine last.

    Args:
        root: where ``/proc`` and the cgroup mounts are (a fake tree in tests).
    """
    out = []
    for version, pairs in cgroups.hierarchies("memory", root):
        out += _cgroup_levels(version, pairs)
    try:
        info = parse_meminfo(_read(os.path.join(root, "proc/meminfo")))
    except OSError:
        info = {}
    if "MemTotal" in info and "MemAvailable" in info:
        out.append(Level("the machine", info["MemTotal"], info["MemTotal"] - info["MemAvailable"]))
    return out


def tightest(root: str = "/") -> Level | None:
    """The memory limit that leaves the least :attr:`~Level.room`, or None where none can be read."""
    found = levels(root)
    return min(found, key=lambda level: level.room) if found else None
