"""Cgroups: the folders of this process's cgroup and its ancestors that hold a controller's files.

A process has a cgroup in each hierarchy: in cgroup v1, one per mounted controller (``memory``,
``cpu``, ...), named on its ``/proc/self/cgroup`` line (``4:memory:/slurm/job_42``); in cgroup v2,
one for all controllers (``0::/user.slice/job.scope``). A hierarchy's folders are under its mount
(``/proc/self/mountinfo``), whose root is the cgroup the mount shows: ``/`` on a host, the
container's own cgroup in a container without a cgroup namespace. Ancestors above the mount's
root are not visible; a cgroup outside it (another namespace's, ``/../..``) has no folder here.
A machine may have both (the hybrid layout): the controller is bound to one of them, and the
other has none of its files, which the callers read as no limit.

The ``parse_*`` functions and :func:`cgroup_dirs` are pure (the files' text in, values out);
:func:`hierarchies` reads the files.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

__all__ = ["Mount", "cgroup_dirs", "hierarchies", "parse_mountinfo", "parse_proc_cgroup"]


@dataclass(frozen=True)
class Mount:
    """A cgroup hierarchy's mount: where it is, and which cgroup its root shows."""

    version: int  # 1: a v1 hierarchy with the controller asked for; 2: the unified hierarchy
    point: str
    root: str


def parse_proc_cgroup(text: str, controller: str) -> dict[int, str]:
    """The process's cgroup paths from ``/proc/<pid>/cgroup``: ``{1: v1 path, 2: v2 path}``.

    Lines are ``id:controllers:path``; the v1 hierarchy of ``controller`` lists it among its
    controllers, v2's line is ``0::path``. A key is missing when there is no such line.
    """
    out: dict[int, str] = {}
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hid, controllers, path = parts
        if hid == "0" and controllers == "":
            out[2] = path
        elif controller in controllers.split(","):
            out[1] = path
    return out


def _unescape(field: str) -> str:
    # mountinfo writes space, tab, newline and backslash in paths as octal escapes (\040).
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def parse_mountinfo(text: str, controller: str) -> list[Mount]:
    """The cgroup mounts in ``/proc/<pid>/mountinfo``: cgroup2, and v1 hierarchies with ``controller``.

    A line is ``id parent major:minor root mount-point options [optional...] - fstype source
    super-options``; v1's controllers are among the super-options.
    """
    out = []
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if not sep or len(fields) < 5 or not tail:
            continue
        if tail[0] == "cgroup2":
            version = 2
        elif tail[0] == "cgroup" and len(tail) > 2 and controller in tail[2].split(","):
            version = 1
        else:
            continue
        out.append(Mount(version, _unescape(fields[4]), _unescape(fields[3])))
    return out


def cgroup_dirs(path: str, mount: Mount) -> list[tuple[str, str]]:
    """``(cgroup path, directory)`` of the cgroup at ``path`` and of its ancestors visible under
    ``mount``, the cgroup itself first; empty when the cgroup is not under the mount's root."""
    root = mount.root.rstrip("/")
    if path != mount.root and not path.startswith(root + "/"):
        return []
    parts = [p for p in path[len(root) :].split("/") if p]
    if ".." in parts:  # outside this cgroup namespace
        return []
    return [
        ("/".join([root, *parts[:k]]) or "/", os.path.join(mount.point, *parts[:k])) for k in range(len(parts), -1, -1)
    ]


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def hierarchies(controller: str, root: str = "/") -> list[tuple[int, list[tuple[str, str]]]]:
    """This process's cgroup and its visible ancestors (:func:`cgroup_dirs`, the cgroup first) in
    the v1 hierarchy of ``controller`` and in v2, as ``(version, pairs)``; v1 first, either
    missing where the machine has no such hierarchy or the cgroup has no folder.

    Args:
        controller: the v1 controller whose hierarchy to look in (``memory``, ``cpu``).
        root: where ``/proc`` and the cgroup mounts are (a fake tree in tests).
    """
    try:
        paths = parse_proc_cgroup(_read(os.path.join(root, "proc/self/cgroup")), controller)
        mounts = parse_mountinfo(_read(os.path.join(root, "proc/self/mountinfo")), controller)
    except OSError:  # not Linux, or no /proc
        return []
    out = []
    for version in (1, 2):
        if version not in paths:
            continue
        for mount in mounts:
            if mount.version != version:
                continue
            pairs = [(p, os.path.join(root, d.lstrip("/"))) for p, d in cgroup_dirs(paths[version], mount)]
            if pairs and os.path.isdir(pairs[0][1]):
                out.append((version, pairs))
                break
    return out
