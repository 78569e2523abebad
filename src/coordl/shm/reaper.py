"""Finds this user's coordl groups in the shm directory and removes the ones no live process uses.

Only this user's own private files count (:mod:`.own`): another user's files at coordl's names,
links and files open to others are neither listed, opened, locked nor removed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from coordl.shm import group, names, own

__all__ = ["GroupInfo", "list_groups", "reap"]


@dataclass(frozen=True)
class GroupInfo:
    """What ``coordl cache ls`` shows about one group of segments."""

    fingerprint: str
    files: int
    bytes: int
    kinds: tuple[str, ...]
    in_use: bool
    keep: bool


def _fingerprints(directory: str) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    try:
        entries = os.listdir(directory)
    except FileNotFoundError:
        return found
    for entry in entries:
        parsed = names.parse_name(entry)
        if parsed is not None and own.foreign(os.path.join(directory, entry)) is None:
            found.setdefault(parsed[0], []).append(entry)
    return found


def list_groups(directory: str | None = None) -> list[GroupInfo]:
    """Every group in the shm directory, with its size and whether a live process uses it."""
    directory = directory or names.shm_dir()
    out = []
    for fp, entries in sorted(_fingerprints(directory).items()):
        size = 0
        for entry in entries:
            try:
                size += os.lstat(os.path.join(directory, entry)).st_blocks * 512
            except FileNotFoundError:
                pass
        try:
            with group.try_lock_unused(fp, directory) as unused:
                if unused is None:
                    continue  # removed by its last user meanwhile
                in_use = not unused
        except PermissionError:
            continue  # its init or lock file is another user's (a ForeignFileError): not ours to lock
        kinds = tuple(sorted({names.parse_name(e)[1] for e in entries}))
        info = GroupInfo(
            fingerprint=fp, files=len(entries), bytes=size, kinds=kinds, in_use=in_use, keep="keep" in kinds
        )
        out.append(info)
    return out


def reap(directory: str | None = None, *, include_kept: bool = False, exclude: str | None = None) -> list[GroupInfo]:
    """Removes every group that no live process is attached to.

    Args:
        directory: the shm directory (default :func:`names.shm_dir`).
        include_kept: also remove groups marked ``keep`` (kept warm for a next run).
        exclude: a fingerprint to leave alone (the caller's own group).

    Returns:
        The groups removed.
    """
    directory = directory or names.shm_dir()
    removed = []
    for fp, entries in sorted(_fingerprints(directory).items()):
        if fp == exclude:
            continue
        try:
            with group.try_lock_unused(fp, directory) as unused:
                if not unused:
                    continue
                marker = os.path.join(directory, names.segment_name(fp, "keep"))
                keep = os.path.lexists(marker) and own.foreign(marker) is None  # another user's marker keeps nothing
                if keep and not include_kept:
                    continue
                freed = group.remove_group(fp, directory)
        except PermissionError:
            continue  # its init or lock file is another user's (a ForeignFileError): not ours to remove
        kinds = tuple(sorted({names.parse_name(e)[1] for e in entries}))
        removed.append(GroupInfo(fingerprint=fp, files=len(entries), bytes=freed, kinds=kinds, in_use=False, keep=keep))
    return removed
