"""The one naming function for coordl's shared resources, and the list of their kinds."""

from __future__ import annotations

import os
import re

__all__ = ["KINDS", "PREFIX", "parse_name", "segment_name", "shm_dir"]

PREFIX = "coordl"

#: Every kind of shared file coordl creates, with what it holds. The cleaner and
#: the tests walk this list.
KINDS = {
    "lock": "membership: every attached process holds a shared flock on it",
    "init": "serialises attach/detach decisions of a group (held for milliseconds)",
    "table": "the node's cache: header and one entry per sample (offset, length, state)",
    "chunk": "the node's cache: raw encoded sample bytes, reserved with posix_fallocate",
    "keep": "marker: keep this group after its last user leaves (coordl.Cache(keep=True))",
    "stage": "HP-group staging area: header, configuration, member and slot records",
    "batches": "HP-group staging area: the slots of ready batches, reserved with posix_fallocate",
    "mutex": "HP-group staging area: serialises changes of its records (held for microseconds)",
    "member": "HP-group staging area: member k holds an exclusive flock on member.k while alive",
}

_FINGERPRINT = re.compile(r"^[0-9a-f]{8,64}$")
_NAME = re.compile(r"^coordl\.(?P<fp>[0-9a-f]{8,64})\.(?P<kind>[a-z]+)(?:\.(?P<id>[0-9A-Za-z_-]+))?$")


def shm_dir() -> str:
    """The directory that holds shared segments: ``$COORDL_SHM_DIR`` or ``/dev/shm``."""
    return os.environ.get("COORDL_SHM_DIR", "/dev/shm")


def segment_name(fingerprint: str, kind: str, ident: int | str | None = None) -> str:
    """Returns the file name of a shared resource: ``coordl.<fingerprint>.<kind>[.<id>]``.

    Args:
        fingerprint: hex fingerprint of the dataset (or group) the resource belongs to.
        kind: one of :data:`KINDS`.
        ident: optional id within the kind (e.g. a chunk number).
    """
    if not _FINGERPRINT.match(fingerprint):
        raise ValueError(f"fingerprint must be 8-64 lowercase hex digits, got {fingerprint!r}")
    if kind not in KINDS:
        raise ValueError(f"unknown shared resource kind {kind!r}; expected one of {sorted(KINDS)}")
    name = f"{PREFIX}.{fingerprint}.{kind}"
    if ident is not None:
        name += f".{ident}"
    return name


def parse_name(name: str) -> tuple[str, str, str | None] | None:
    """Splits a name made by :func:`segment_name` into (fingerprint, kind, id); None if it is not one."""
    m = _NAME.match(name)
    if m is None or m.group("kind") not in KINDS:
        return None
    return m.group("fp"), m.group("kind"), m.group("id")
