"""The saved index's file, declared once: write it atomically, map it read-only, check it.

One file per scanned tree, ``index-<key>.idx`` in the index directory: a :data:`HEADER`
(a numpy structured dtype with a magic, a version and the sizes), then its sections, each
starting at a multiple of :data:`ALIGN` bytes: ``offsets`` (int64, count + 1),
``labels`` (int64, count), ``sizes`` (int64, count), ``mtimes`` (int64, count: the modification
time in ns of the file each sample lies in, its own or its tar shard; empty for ``s3://``, whose
ETags play that part), ``blob`` (uint8, the paths' bytes, see :mod:`coordl.paths`), ``meta``
(UTF-8 JSON), and the objects' ETags of an ``s3://``
index as a second table of strings, ``etag_offsets`` (int64, count + 1) and ``etag_blob``
(both empty for local files), and for a dataset of tar shards (:mod:`coordl.tars`) each sample's
shard, ``shard_of`` (int64, count), where its bytes start in it, ``data_offsets`` (int64, count), and
the shards' paths as a third table, ``shard_offsets`` (int64, shards + 1) and ``shard_blob`` (all
four empty for files and objects), and for a detection dataset (:mod:`coordl.detection`) its boxes:
``box_offsets`` (int64, count + 1), ``box_xyxy`` (float32, boxes x 4), ``box_labels`` (int64, boxes),
``image_sizes`` (int64, count x 2) and ``image_ids`` (int64, count) (all five empty for a dataset of
classes). The arrays are stored as they are in
memory, so reading the file is mapping it: no sample is read at load, and the processes
of a machine share one copy of its pages in the page cache.

Invariant: a published file is complete and never changes. It is written under a
temporary name, fsynced and renamed over the old one; a process that mapped the old one
keeps it (a local filesystem keeps a replaced file's pages while they are mapped). On a
network filesystem, where a replacement by another machine can pull the pages from under
a mapping (SIGBUS), the file is read into memory instead (:func:`is_local`). Version 1
was an ``.npz`` of another name, which is not read; versions 2 (without ETags), 3 (without
shards), 4 (without boxes) and 5 (without modification times) are rescanned.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import re
import socket
from dataclasses import dataclass

import numpy as np

from coordl.paths import PathTable

__all__ = ["BOX_SECTIONS", "FORMAT_VERSION", "HEADER", "SUFFIX", "Saved", "is_local", "read", "write"]

MAGIC = b"coordlix"
FORMAT_VERSION = 6
ALIGN = 64
HEADER = np.dtype(
    [
        ("magic", "S8"),
        ("version", "<u4"),
        ("header_bytes", "<u4"),  # HEADER.itemsize
        ("count", "<u8"),  # samples
        ("blob_bytes", "<u8"),
        ("meta_bytes", "<u8"),
        ("fingerprint", "S16"),  # Index.fingerprint, as computed when the index was built
        ("etag_bytes", "<u8"),  # the ETags' blob and one (0: no ETags, local files)
        ("shard_count", "<u8"),  # tar shards (0: samples are files or objects)
        ("shard_bytes", "<u8"),  # the shards' paths' blob and one (0: no shards)
        ("box_count", "<u8"),  # boxes and one (0: no boxes, a dataset of classes)
        ("mtime_count", "<u8"),  # samples with a modification time: count (0: none, s3://)
    ]
)
SUFFIX = ".idx"
# Where a saved index is mapped rather than read (see is_local).
LOCAL_FILESYSTEMS = {"ext2", "ext3", "ext4", "xfs", "btrfs", "zfs", "f2fs", "bcachefs", "tmpfs", "ramfs", "overlay"}


@dataclass(frozen=True)
class Saved:
    """The contents of a saved index: arrays in the file's pages (mapped) or in memory."""

    paths: PathTable
    labels: np.ndarray
    sizes: np.ndarray
    fingerprint: str
    meta: dict
    etags: PathTable | None = None
    shards: tuple[PathTable, np.ndarray, np.ndarray] | None = None  # files, of, offsets (coordl.tars.Shards)
    boxes: tuple[np.ndarray, ...] | None = None  # offsets, xyxy, labels, image_sizes, image_ids (Boxes)
    mtimes: np.ndarray | None = None  # int64 ns, per sample (Index.mtimes)


def write(
    path: str,
    paths: PathTable,
    labels: np.ndarray,
    sizes: np.ndarray,
    fingerprint: str,
    meta: dict,
    etags: PathTable | None = None,
    shards: tuple[PathTable, np.ndarray, np.ndarray] | None = None,
    boxes: tuple[np.ndarray, ...] | None = None,
    mtimes: np.ndarray | None = None,
) -> None:
    """Publishes a saved index at ``path``: complete, or not at all.

    Raises:
        OSError: the file cannot be written (the temporary file is removed).
    """
    os.makedirs(os.path.dirname(path), exist_ok=True)
    meta_bytes = json.dumps(meta).encode()
    arrays = {
        "offsets": paths.offsets,
        "labels": labels,
        "sizes": sizes,
        "blob": paths.blob,
        "meta": np.frombuffer(meta_bytes, dtype=np.uint8),
        "etag_offsets": etags.offsets if etags is not None else np.zeros(0, np.int64),
        "etag_blob": etags.blob if etags is not None else np.zeros(0, np.uint8),
        "shard_of": shards[1] if shards is not None else np.zeros(0, np.int64),
        "data_offsets": shards[2] if shards is not None else np.zeros(0, np.int64),
        "shard_offsets": shards[0].offsets if shards is not None else np.zeros(0, np.int64),
        "shard_blob": shards[0].blob if shards is not None else np.zeros(0, np.uint8),
    }
    for name, a in zip(BOX_SECTIONS, boxes if boxes is not None else [np.zeros(0)] * len(BOX_SECTIONS)):
        arrays[name] = a
    arrays["mtimes"] = mtimes if mtimes is not None else np.zeros(0, np.int64)
    head = np.zeros((), HEADER)
    head["magic"], head["version"], head["header_bytes"] = MAGIC, FORMAT_VERSION, HEADER.itemsize
    head["count"], head["blob_bytes"], head["meta_bytes"] = len(paths), len(paths.blob), len(meta_bytes)
    head["fingerprint"] = fingerprint.encode()
    head["etag_bytes"] = len(etags.blob) + 1 if etags is not None else 0
    if shards is not None:
        head["shard_count"], head["shard_bytes"] = len(shards[0]), len(shards[0].blob) + 1
    if boxes is not None:
        head["box_count"] = len(boxes[2]) + 1
    if mtimes is not None:
        head["mtime_count"] = len(paths)
    sections, total = _sections(
        len(paths), len(paths.blob), len(meta_bytes), int(head["etag_bytes"]), *_tail_sizes(head)
    )
    tmp = f"{path}.{socket.gethostname()}.{os.getpid()}.tmp"  # unique also in an index folder shared by nodes
    try:
        with open(tmp, "wb") as f:
            f.write(head.tobytes())
            for name, dtype, _, offset in sections:
                f.write(b"\0" * (offset - f.tell()))
                f.write(memoryview(np.ascontiguousarray(arrays[name], dtype=dtype)).cast("B"))
            f.truncate(total)  # a no-op unless the last section is empty
            f.flush()
            os.fsync(f.fileno())  # on disk before it is published: never an empty file after a crash
        os.replace(tmp, path)  # readers see the old index or the new one, never half of one
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def read(path: str) -> Saved | str | None:
    """The saved index at ``path``, mapped read-only on a local filesystem and read into
    memory on any other; None if there is no file, or why it is not a complete saved
    index of this version (a sentence)."""
    try:
        with open(path, "rb") as f:
            buf = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) if is_local(path) else f.read()
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:  # ValueError: an empty file cannot be mapped
        return str(e)
    why = _unusable(buf)
    if why is not None:
        return why
    head = np.frombuffer(buf, HEADER, count=1)[0]
    sections, _ = _sections(
        int(head["count"]),
        int(head["blob_bytes"]),
        int(head["meta_bytes"]),
        int(head["etag_bytes"]),
        *_tail_sizes(head),
    )
    a = {name: np.frombuffer(buf, dtype, items, offset) for name, dtype, items, offset in sections}
    try:
        meta = json.loads(a["meta"].tobytes())
    except ValueError as e:
        return f"metadata: {e}"
    if not isinstance(meta, dict):
        return "metadata: not an object"
    paths = PathTable(a["blob"], a["offsets"])
    etags = PathTable(a["etag_blob"], a["etag_offsets"]) if head["etag_bytes"] else None
    shards = None
    if head["shard_bytes"]:
        shards = (PathTable(a["shard_blob"], a["shard_offsets"]), a["shard_of"], a["data_offsets"])
    boxes = None
    if head["box_count"]:
        boxes = tuple(a[name] for name in BOX_SECTIONS)
        boxes = (boxes[0], boxes[1].reshape(-1, 4), boxes[2], boxes[3].reshape(-1, 2), boxes[4])
    mtimes = a["mtimes"] if head["mtime_count"] else None
    return Saved(
        paths=paths,
        labels=a["labels"],
        sizes=a["sizes"],
        fingerprint=head["fingerprint"].decode(),
        meta=meta,
        etags=etags,
        shards=shards,
        boxes=boxes,
        mtimes=mtimes,
    )


#: The sections of a detection dataset's boxes, in the order of :attr:`Saved.boxes`.
BOX_SECTIONS = ("box_offsets", "box_xyxy", "box_labels", "image_sizes", "image_ids")


def _tail_sizes(head) -> tuple[int, int, int, int]:
    """The header's sizes of the sections after the ETags: shards, boxes and modification times."""
    return int(head["shard_count"]), int(head["shard_bytes"]), int(head["box_count"]), int(head["mtime_count"])


def is_local(path: str, mountinfo: str = "/proc/self/mountinfo") -> bool:
    """Whether ``path`` is on a filesystem of this machine, where a mapping of it is safe.

    A mapped file that another machine replaces on a network filesystem (a rescan on
    another node renames a new index over it) can vanish from under the mapping: the next
    page fault is a SIGBUS. A local filesystem keeps a replaced file's pages while they are
    mapped. Unknown filesystems count as network ones.
    """
    try:
        with open(mountinfo) as f:
            mounts = f.read().splitlines()
        real = os.path.realpath(path)
    except OSError:
        return False
    best, fstype = "", None
    for line in mounts:  # "36 35 98:0 / /mnt rw,noatime master:1 - ext4 /dev/root rw"
        fields = line.split()
        if "-" not in fields:
            continue
        mount = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4])  # "\040" is a space
        inside = real == mount or real.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) >= len(best):  # the last of the longest: what is mounted on top
            best, fstype = mount, fields[fields.index("-") + 1]
    return fstype in LOCAL_FILESYSTEMS


def _sections(
    count: int,
    blob_bytes: int,
    meta_bytes: int,
    etag_bytes: int = 0,
    shard_count: int = 0,
    shard_bytes: int = 0,
    box_count: int = 0,
    mtime_count: int = 0,
) -> tuple[list[tuple[str, np.dtype, int, int]], int]:
    """``(name, dtype, items, offset)`` of each section of a saved index, and the file's size
    (``etag_bytes``, ``shard_bytes``, ``box_count``, ``mtime_count``: the header's, 0 for no ETags,
    shards, boxes or modification times)."""
    boxes = max(box_count - 1, 0)
    out, at = [], HEADER.itemsize
    for name, dtype, items in (
        ("offsets", np.dtype("<i8"), count + 1),
        ("labels", np.dtype("<i8"), count),
        ("sizes", np.dtype("<i8"), count),
        ("mtimes", np.dtype("<i8"), mtime_count),
        ("blob", np.dtype(np.uint8), blob_bytes),
        ("meta", np.dtype(np.uint8), meta_bytes),
        ("etag_offsets", np.dtype("<i8"), count + 1 if etag_bytes else 0),
        ("etag_blob", np.dtype(np.uint8), max(etag_bytes - 1, 0)),
        ("shard_of", np.dtype("<i8"), count if shard_bytes else 0),
        ("data_offsets", np.dtype("<i8"), count if shard_bytes else 0),
        ("shard_offsets", np.dtype("<i8"), shard_count + 1 if shard_bytes else 0),
        ("shard_blob", np.dtype(np.uint8), max(shard_bytes - 1, 0)),
        ("box_offsets", np.dtype("<i8"), count + 1 if box_count else 0),
        ("box_xyxy", np.dtype("<f4"), 4 * boxes),
        ("box_labels", np.dtype("<i8"), boxes),
        ("image_sizes", np.dtype("<i8"), 2 * count if box_count else 0),
        ("image_ids", np.dtype("<i8"), count if box_count else 0),
    ):
        if items:  # an empty section takes no room: a file without ETags ends with its metadata
            at = -(-at // ALIGN) * ALIGN
        out.append((name, dtype, items, at))
        at += dtype.itemsize * items
    return out, at


def _unusable(buf) -> str | None:
    """Why the file's bytes are not a complete saved index of this version, or None. Checks
    the header and the file's size, not the samples: the file was published whole by a rename."""
    if len(buf) < HEADER.itemsize:
        return f"{len(buf)} bytes, shorter than the header"
    head = np.frombuffer(buf, HEADER, count=1)[0]
    if head["magic"] != MAGIC or head["header_bytes"] != HEADER.itemsize:
        return "not a coordl index file"
    if head["version"] != FORMAT_VERSION:
        return f"format version {head['version']}, this coordl reads {FORMAT_VERSION}"
    count, blob_bytes, etag_bytes = int(head["count"]), int(head["blob_bytes"]), int(head["etag_bytes"])
    sections, total = _sections(count, blob_bytes, int(head["meta_bytes"]), etag_bytes, *_tail_sizes(head))
    if len(buf) != total:
        return f"{len(buf)} bytes, the header says {total}"
    if int(head["mtime_count"]) not in (0, count):
        return f"{int(head['mtime_count'])} modification times for {count} samples"
    offsets_at = _sections(count, blob_bytes, 0)[0][0][3]
    first, last = np.frombuffer(buf, "<i8", 1, offsets_at), np.frombuffer(buf, "<i8", 1, offsets_at + 8 * count)
    if first[0] != 0 or last[0] != (blob_bytes + 1 if count else 0):
        return "its path offsets do not match its paths"
    if etag_bytes:
        at = next(offset for name, _, _, offset in sections if name == "etag_offsets")
        first, last = np.frombuffer(buf, "<i8", 1, at), np.frombuffer(buf, "<i8", 1, at + 8 * count)
        if first[0] != 0 or last[0] != (etag_bytes if count else 0):
            return "its ETag offsets do not match its ETags"
    if head["shard_bytes"]:
        at = next(offset for name, _, _, offset in sections if name == "shard_offsets")
        n = int(head["shard_count"])
        first, last = np.frombuffer(buf, "<i8", 1, at), np.frombuffer(buf, "<i8", 1, at + 8 * n)
        if first[0] != 0 or last[0] != (int(head["shard_bytes"]) if n else 0):
            return "its shard offsets do not match its shards"
    if head["box_count"]:
        at = next(offset for name, _, _, offset in sections if name == "box_offsets")
        first, last = np.frombuffer(buf, "<i8", 1, at), np.frombuffer(buf, "<i8", 1, at + 8 * count)
        if first[0] != 0 or last[0] != int(head["box_count"]) - 1:
            return "its box offsets do not match its boxes"
    return None
