"""Datasets in tar shards, WebDataset's format: which shards, and the index of their samples.

A shard is a POSIX tar file (ustar, GNU or pax). A sample is WebDataset's group of consecutive
members whose names share a key: the member's path up to the first dot of its file name, so
``a/000123.jpg`` and ``a/000123.cls`` are the sample ``a/000123`` (members with no dot in their
file name, and directories, are not samples' members). A sample's image is its member with the
first extension of :data:`IMAGE_EXTENSIONS` it has (the ones DALI decodes); its label is the
integer, as text, of its ``.cls`` member, or what a function of its other members returns.

Indexing reads the tar headers and nothing else, except the members a label is made of: one
positioned read of :data:`WINDOW` bytes per member that is larger than the window (the window
after a member holds the next headers and small members). The index holds, per sample, its
shard, where its image's bytes start in the shard and how many there are, so a sample is one
positioned read (:func:`coordl.fetch.storage.read_ranges`). Its path, in messages and in DALI's
``source_info``, is ``<shard>:<member>``.
"""

from __future__ import annotations

import glob
import logging
import os
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from coordl.errors import ShardError
from coordl.paths import PathTable
from coordl.s3 import url as s3url

__all__ = ["IMAGE_EXTENSIONS", "Shards", "expand", "is_tar_data", "scan_shard"]

log = logging.getLogger(__name__)

#: The extensions of a sample's image member, in the order one is chosen when a sample has several.
IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp", "bmp", "tif", "tiff", "ppm", "pgm", "pbm", "jp2")
WINDOW = 64 * 1024  # bytes read at once while indexing: the headers and small members after a member
BLOCK = 512
LABEL_MAX = 1 << 20  # the most bytes of one member a label is made of

_KEY = re.compile(r"^((?:.*/|)[^./]+)[.]([^/]*)$")  # webdataset's base_plus_ext
_BRACE = re.compile(r"\{([^{}]*)\}")
_REGULAR = (b"0", b"\0", b"7")


@dataclass(frozen=True, eq=False)
class Shards:
    """Where each sample of a tar dataset lies: an :class:`~coordl.index.Index`'s ``shards``.

    Attributes:
        files: the shards' paths (or ``s3://`` URLs), in the dataset's order.
        of: the shard of every sample (int64, a position in ``files``).
        offsets: where every sample's image starts in its shard (int64, bytes).
    """

    files: PathTable
    of: np.ndarray
    offsets: np.ndarray


# -- which shards -----------------------------------------------------------------------------
def expand(spec: str | os.PathLike) -> list[str]:
    """The shards ``spec`` names: a brace pattern (``train-{000000..000146}.tar``, ``{a,b}``; as
    WebDataset's ``braceexpand``, zero-padded ranges keep their width), a folder (its ``.tar`` files,
    sorted), or one tar file. Local paths are made absolute."""
    spec = os.fspath(spec)
    out = _braces(spec)
    if s3url.is_url(spec):
        return out
    if len(out) == 1 and os.path.isdir(out[0]):
        return sorted(os.path.abspath(p) for p in glob.glob(os.path.join(glob.escape(out[0]), "*.tar")))
    return [os.path.abspath(p) for p in out]


def _braces(spec: str) -> list[str]:
    m = _BRACE.search(spec)
    if m is None:
        return [spec]
    head, body, tail = spec[: m.start()], m.group(1), spec[m.end() :]
    r = re.fullmatch(r"(\d+)\.\.(\d+)", body)
    if r:
        a, b = r.group(1), r.group(2)
        width = len(a) if a.startswith("0") or len(a) == len(b) else 0
        step = 1 if int(b) >= int(a) else -1
        items = [str(k).zfill(width) for k in range(int(a), int(b) + step, step)]
    else:
        items = body.split(",")
    return [x for item in items for x in _braces(head + item + tail)]


def is_tar_data(data) -> bool:
    """Whether a loader's ``data`` names tar shards: a path or pattern ending in ``.tar``, a folder
    that holds ``.tar`` files and no sub-folder, or a list of such paths (not of pairs)."""
    if isinstance(data, (str, os.PathLike)):
        spec = os.fspath(data)
        if spec.endswith(".tar") or (_BRACE.search(spec) and spec.rstrip("/").endswith(".tar")):
            return True
        if s3url.is_url(spec) or not os.path.isdir(spec):
            return False
        entries = list(os.scandir(spec))
        return any(e.name.endswith(".tar") for e in entries) and not any(e.is_dir() for e in entries)
    if isinstance(data, Sequence) and data and all(isinstance(x, (str, os.PathLike)) for x in data):
        return all(os.fspath(x).endswith(".tar") for x in data)
    return False


def shard_list(data) -> list[str]:
    """The shards of ``data`` (see :func:`is_tar_data`), in order.

    Raises:
        FileNotFoundError: no shard found (the message names the pattern).
    """
    specs = [data] if isinstance(data, (str, os.PathLike)) else list(data)
    files = [f for spec in specs for f in expand(spec)]
    if not files:
        raise FileNotFoundError(f"no .tar shard found in {os.fspath(specs[0]) if len(specs) == 1 else specs}")
    return files


# -- one shard --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Member:
    name: str
    offset: int  # of its data in the shard
    size: int


class _Window:
    """Positioned reads of a shard through a window of :data:`WINDOW` bytes."""

    def __init__(self, read: Callable[[int, int], bytes], size: int):
        self.read, self.size = read, size
        self.at, self.buf = 0, b""
        self.reads = 0

    def get(self, pos: int, n: int) -> bytes:
        if not (self.at <= pos and pos + n <= self.at + len(self.buf)):
            self.buf, self.at = self.read(pos, max(n, WINDOW)), pos
            self.reads += 1
        return self.buf[pos - self.at : pos - self.at + n]


def members(path: str, w: _Window) -> list[Member]:
    """The regular members of the tar file ``path``, read through ``w``.

    Raises:
        ShardError: it is not a tar file, a header is damaged, or it ends inside a member.
    """
    size = w.size
    out: list[Member] = []
    pos, long_name, pax_name = 0, None, None
    while True:
        head = w.get(pos, BLOCK)
        if len(head) < BLOCK:
            if len(head) == 0 and pos > 0:
                break  # no end-of-archive blocks: tarfile accepts that too
            last = f" after member {out[-1].name}" if out else ""
            raise ShardError(f"{path} ends inside a tar header at byte {pos}{last}: the shard is truncated")
        if head == bytes(BLOCK):
            break
        if not _checksum_ok(head):
            if pos == 0:
                raise ShardError(f"{path} is not a tar file (its first block is not a tar header)")
            last = f" (after member {out[-1].name})" if out else ""
            raise ShardError(f"{path} has a damaged tar header at byte {pos}{last}")
        kind = head[156:157]
        n = _number(head[124:136], path, pos)
        data = pos + BLOCK
        name = long_name or pax_name or _name(head)
        if data + n > size:
            raise ShardError(
                f"{path} ends inside member {name} ({n} bytes from byte {data}, the file has {size}): "
                "the shard is truncated"
            )
        if kind == b"L":
            long_name = w.get(data, n).rstrip(b"\0").decode("utf-8", "surrogateescape")
        elif kind == b"x":
            pax_name = _pax_path(w.get(data, n)) or pax_name
        else:
            if kind in _REGULAR:
                out.append(Member(name, data, n))
            if kind not in (b"K", b"g"):
                long_name = pax_name = None
        pos = data + -(-n // BLOCK) * BLOCK
    return out


def _checksum_ok(head: bytes) -> bool:
    try:
        want = int(head[148:156].split(b"\0")[0].strip() or b"-1", 8)
    except ValueError:
        return False
    blank = head[:148] + b" " * 8 + head[156:]
    return want in (sum(blank), sum(np.frombuffer(blank, dtype=np.int8).tolist()))


def _number(field: bytes, path: str, pos: int) -> int:
    if field[0] & 0x80:  # GNU base-256
        return int.from_bytes(bytes([field[0] & 0x7F]) + field[1:], "big")
    try:
        return int(field.split(b"\0")[0].strip() or b"0", 8)
    except ValueError:
        raise ShardError(f"{path} has a damaged tar header at byte {pos} (size {field!r})") from None


def _name(head: bytes) -> str:
    name = head[:100].split(b"\0")[0]
    if head[257:262] == b"ustar":
        prefix = head[345:500].split(b"\0")[0]
        if prefix:
            name = prefix + b"/" + name
    return name.decode("utf-8", "surrogateescape")


def _pax_path(records: bytes) -> str | None:
    path, at = None, 0
    while at < len(records):
        sp = records.find(b" ", at)
        if sp < 0:
            break
        length = int(records[at:sp])
        key, _, value = records[sp + 1 : at + length - 1].partition(b"=")
        if key == b"path":
            path = value.decode("utf-8", "surrogateescape")
        at += length
    return path


@dataclass(frozen=True)
class Sample:
    key: str
    image: Member
    label: int


def samples_of(
    path: str,
    found: list[Member],
    read: Callable[[int, int], bytes],
    *,
    image: Sequence[str] = IMAGE_EXTENSIONS,
    label: Callable[[dict[str, bytes]], int] | None = None,
    skip: bool = False,
) -> list[Sample]:
    """The samples of one shard's members, in order (see the module docstring).

    Raises:
        ShardError: a key repeats, a sample has no image member, or its label is missing or not an
            integer (the message names the shard and the member); with ``skip``, such a sample is
            left out and logged instead, but a repeated key is always an error.
    """
    out: list[Sample] = []
    seen: set[str] = set()
    group: dict[str, Member] = {}
    key = None

    def close():
        if key is None:
            return
        try:
            out.append(_sample(path, key, group, read, image, label))
        except ShardError as e:
            if not skip:
                raise
            log.warning("coordl: skipping a sample: %s", e)

    for m in found:
        match = _KEY.match(m.name)
        if match is None:
            continue
        k, ext = match.group(1), match.group(2)
        if k != key:
            close()
            if k in seen:
                raise ShardError(f"{path}: key {k} repeats at member {m.name}, after other samples' members")
            seen.add(k)
            key, group = k, {}
        if ext in group:
            raise ShardError(f"{path}: sample {k} has two members {m.name}")
        group[ext] = m
    close()
    return out


def _sample(path, key, group, read, image, label) -> Sample:
    lowered = {ext.lower(): m for ext, m in group.items()}
    picked = next((lowered[e] for e in image if e in lowered), None)
    if picked is None:
        names = ", ".join(m.name for m in group.values())
        raise ShardError(f"{path}: sample {key} has no image member ({names}); image members end in {', '.join(image)}")
    if label is None:
        cls = lowered.get("cls")
        if cls is None:
            raise ShardError(
                f"{path}: sample {key} has no .cls member for its label; give a label function of its members"
            )
        text = _content(path, cls, read)
        try:
            value = int(text.decode().strip())
        except ValueError:
            raise ShardError(f"{path}: member {cls.name} is not an integer label ({text[:40]!r})") from None
    else:
        others = {ext: _content(path, m, read) for ext, m in group.items() if m is not picked}
        value = label(others)
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise ShardError(f"{path}: the label function returned {value!r} for sample {key}, not an int")
        value = int(value)
    if value < 0:
        raise ShardError(f"{path}: sample {key} has the label {value}; labels are non-negative")
    return Sample(key, picked, value)


def _content(path: str, m: Member, read) -> bytes:
    if m.size > LABEL_MAX:
        raise ShardError(f"{path}: member {m.name} is {m.size} bytes, more than a label is made of ({LABEL_MAX})")
    return read(m.offset, m.size)


def scan_shard(
    path: str, *, image=IMAGE_EXTENSIONS, label=None, skip: bool = False
) -> tuple[list[Sample], tuple[int, int]]:
    """The samples of the local tar file ``path``, and its ``(size, mtime_ns)``.

    Raises:
        ShardError: see :func:`members` and :func:`samples_of`.
        OSError: it cannot be opened or read.
    """
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)

        def read(offset: int, n: int) -> bytes:
            return os.pread(fd, n, offset)

        w = _Window(read, st.st_size)
        found = members(path, w)
        return samples_of(path, found, w.get, image=image, label=label, skip=skip), (st.st_size, st.st_mtime_ns)
    finally:
        os.close(fd)


# -- the whole dataset ----------------------------------------------------------------------------
PROGRESS_S = 5.0  # seconds between progress lines while indexing


def index(files: list[str], *, root, image=IMAGE_EXTENSIONS, label=None, skip: bool = False):
    """The :class:`~coordl.index.Index` of the samples of ``files``, in order, and each shard's
    ``[size, mtime_ns]`` (see :meth:`Index.from_tars <coordl.index.Index.from_tars>`).

    Raises:
        FileNotFoundError: a shard is missing, or the shards hold no sample.
        ShardError: see :func:`samples_of`.
    """
    from coordl.index import Index

    paths, labels, sizes, of, offsets, stamps = [], [], [], [], [], []
    t0 = last = time.monotonic()
    for k, f in enumerate(files):
        try:
            found, stamp = scan_shard(f, image=image, label=label, skip=skip)
        except FileNotFoundError:
            raise FileNotFoundError(f"shard {f} does not exist") from None
        stamps.append(list(stamp))
        for s in found:
            paths.append(f"{f}:{s.image.name}")
            labels.append(s.label)
            sizes.append(s.image.size)
            of.append(k)
            offsets.append(s.image.offset)
        now = time.monotonic()
        if now - last >= PROGRESS_S:
            log.info("coordl: indexed %d of %d shards (%d samples, %.0f s)", k + 1, len(files), len(paths), now - t0)
            last = now
    if not paths:
        raise FileNotFoundError(f"the {len(files)} shards ({files[0]}, ...) hold no sample")
    shards = Shards(PathTable.from_strings(files), np.array(of, dtype=np.int64), np.array(offsets, dtype=np.int64))
    log.info("coordl: indexed %d samples in %d shards in %.1f s", len(paths), len(files), time.monotonic() - t0)
    return Index.build(paths, labels, sizes, (), root, shards=shards), stamps


def fresh(files: list[str], stamps) -> bool:
    """Whether every shard of ``files`` still has the ``[size, mtime_ns]`` of ``stamps``."""
    if len(stamps) != len(files):
        return False
    for f, (size, mtime) in zip(files, stamps):
        try:
            st = os.stat(f)
        except OSError:
            return False
        if (st.st_size, st.st_mtime_ns) != (size, mtime):
            log.info("coordl: %s changed since the index was saved; indexing again", f)
            return False
    return True
