"""The CPUs this process may use: its CPU affinity and its cgroups' CPU quotas, read from the kernel.

``os.cpu_count()`` counts the machine's CPUs. A job often may use fewer, and threads beyond
them only wait for each other:

- its CPU affinity (``taskset``, Slurm's and Kubernetes' cpusets): ``os.sched_getaffinity``;
- a CFS quota (Kubernetes CPU limits, Slurm, ``docker --cpus``) on its cgroup or on any
  ancestor visible: cgroup v2's ``cpu.max`` (``"150000 100000"``: 150 ms of CPU time every
  100 ms, 1.5 CPUs; ``"max 100000"``: none), cgroup v1's ``cpu.cfs_quota_us`` over
  ``cpu.cfs_period_us`` (a quota of -1: none) in the hierarchy that holds the ``cpu`` controller.

A quota of a fraction of a CPU counts as the whole CPU it reaches into (1.5 -> 2), and never
less than 1. :func:`available` is the least of them all. Nothing is cached: affinity may change
while the process runs. The ``parse_*`` functions are pure (the files' text in, CPUs out);
:func:`cgroup_quota` reads the files, in the cgroups that :mod:`coordl.cgroups` finds.
"""

from __future__ import annotations

import os

from coordl import cgroups

__all__ = ["available", "cgroup_quota", "parse_cfs_quota", "parse_cpu_max"]


def _cpus(quota: int, period: int) -> int:
    # CPU time ``quota`` every ``period``: the CPUs it keeps busy, a fraction rounded up, at least 1.
    if period <= 0:
        raise ValueError(f"a CFS period of {period} microseconds: expected a positive number")
    return max(1, -(-quota // period))


def parse_cpu_max(text: str) -> int | None:
    """CPUs of a cgroup v2 ``cpu.max`` (``"$MAX $PERIOD"``), rounded up; None for no quota (``max``)."""
    fields = text.split()
    if not fields or fields[0] == "max":
        return None
    return _cpus(int(fields[0]), int(fields[1]) if len(fields) > 1 else 100_000)


def parse_cfs_quota(quota: str, period: str) -> int | None:
    """CPUs of cgroup v1's ``cpu.cfs_quota_us`` and ``cpu.cfs_period_us``, rounded up; None for no
    quota (``-1``)."""
    value = int(quota)
    return None if value < 0 else _cpus(value, int(period))


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _quota(version: int, directory: str) -> int | None:
    if version == 2:
        return parse_cpu_max(_read(os.path.join(directory, "cpu.max")))
    return parse_cfs_quota(
        _read(os.path.join(directory, "cpu.cfs_quota_us")), _read(os.path.join(directory, "cpu.cfs_period_us"))
    )


def cgroup_quota(root: str = "/") -> int | None:
    """The CPUs that the tightest CFS quota of this process's cgroups leaves, or None where none has one.

    Args:
        root: where ``/proc`` and the cgroup mounts are (a fake tree in tests).
    """
    found = []
    for version, pairs in cgroups.hierarchies("cpu", root):
        for _, directory in pairs:
            try:
                quota = _quota(version, directory)
            except (OSError, ValueError):  # no cpu controller here (the root, v2 beside v1), or removed
                continue
            if quota is not None:
                found.append(quota)
    return min(found, default=None)


def available(root: str = "/") -> int:
    """The CPUs this process may use: the least of its CPU affinity and its cgroups' CPU quotas.

    Args:
        root: where ``/proc`` and the cgroup mounts are (a fake tree in tests); the affinity is
            always this process's.
    """
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # no affinity on this platform (macOS)
        cpus = os.cpu_count() or 1
    quota = cgroup_quota(root)
    return max(1, min(cpus, quota) if quota is not None else cpus)
