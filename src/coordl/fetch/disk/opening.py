"""How a loader finds its local-storage tier (:func:`spec_for`) and how each of its processes opens
it (:class:`DiskSpec`): the folder checked once, in the loader's constructor, on the trainer and on
each Ray actor's node."""

from __future__ import annotations

import os
from dataclasses import dataclass

from coordl import errors
from coordl.fetch.disk.folder import ForeignFolderError, open_folder, tier_folder
from coordl.fetch.disk.tier import DiskTier

__all__ = ["DiskSpec", "spec_for"]


def spec_for(disk, index) -> DiskSpec | None:
    """The tier a loader with ``Cache(disk=disk)`` (a :class:`~coordl.options.Disk`, or None) uses
    for ``index``: None without one, when the tier's folder is not this user's private folder (with
    a warning: :class:`~coordl.fetch.disk.folder.ForeignFolderError`), or (with a warning) when the
    dataset's files lie on the tier's own file system, where a copy would cost the disk and save
    nothing.

    Raises:
        ValueError: ``Disk(path)`` does not exist here or is not a folder.
    """
    if disk is None:
        return None
    folder = tier_folder(disk.path)
    try:
        opened = open_folder(folder, create=True)
    except ForeignFolderError as e:
        errors.warn(f"coordl: {e}")
        return None
    try:
        dev = os.fstat(opened.fd).st_dev
    finally:
        opened.close()
    if not index.in_store and len(index):
        first = index.location(0)[0]
        try:
            same = os.stat(first).st_dev == dev
        except OSError:
            same = False
        if same:
            errors.warn(
                f"coordl: Cache(disk={disk.path!r}) is on the file system of the dataset's files ({first}): the "
                "local tier would copy them next to themselves, so it is not used. It serves datasets that lie "
                "elsewhere: s3://, a network file system, another device"
            )
            return None
    return DiskSpec(folder, disk.size, disk.direct, disk.peers_first, disk.keep_free)


@dataclass(frozen=True)
class DiskSpec:
    """How a process opens the node's local-storage tier (picklable: worker processes open it too).

    Attributes:
        folder: the tier's folder (:func:`~coordl.fetch.disk.folder.tier_folder`).
        size: its budget in bytes, or ``"auto"`` (see :meth:`~coordl.fetch.disk.ledger.Ledger.open`).
        direct: read with ``O_DIRECT`` instead of dropping the pages behind each read.
        peers_first: ask the other nodes' memory caches before this tier.
        keep_free: what the tier leaves free on its file system (:func:`~coordl.fetch.disk.ledger.floor`).
    """

    folder: str
    size: int | str = "auto"
    direct: bool = False
    peers_first: bool = False
    keep_free: int | float | str = "auto"

    def open(self) -> DiskTier | None:
        """This process's attachment, or None (with a warning) when the folder became foreign."""
        try:
            return DiskTier(
                self.folder, self.size, direct=self.direct, peers_first=self.peers_first, keep_free=self.keep_free
            )
        except ForeignFolderError as e:
            errors.warn(f"coordl: {e}")
            return None
