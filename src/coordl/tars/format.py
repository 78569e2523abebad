"""The tar format, read by its headers: a shard's members, and WebDataset's samples of them."""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np

from coordl.errors import ShardError

__all__ = ["IMAGE_EXTENSIONS", "Member", "Sample", "members", "samples_of", "scan_shard"]

log = logging.getLogger(__name__)

#: The extensions of a sample's image member, in the order one is chosen when a sample has several.
IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp", "bmp", "tif", "tiff", "ppm", "pgm", "pbm", "jp2")
WINDOW = 4096  # bytes read at once while indexing: the headers and small members after a member
# (a 64 KB window cost 1.5x the CPU time on shards of 60-160 KB images: each read copies it)
BLOCK = 512
LABEL_MAX = 1 << 20  # the most bytes of one member a label is made of

_KEY = re.compile(r"^((?:.*/|)[^./]+)[.]([^/]*)$")  # webdataset's base_plus_ext
_REGULAR = (48, 0, 55)  # 0, NUL, 7: a regular file
_ZERO = bytes(BLOCK)


class Member(NamedTuple):  # made once per member of a dataset: a tuple is cheaper to make than a frozen dataclass
    name: str
    offset: int  # of its data in the shard
    size: int
    data: bytes | None = None  # its bytes, when kept while reading the headers (a label's member)


class _Window:
    """Positioned reads of a shard through a window of :data:`WINDOW` bytes."""

    def __init__(self, read: Callable[[int, int], bytes], size: int, window: int = WINDOW):
        self.read, self.size, self.window = read, size, window
        self.at, self.buf = 0, b""

    def get(self, pos: int, n: int) -> bytes:
        if not (self.at <= pos and pos + n <= self.at + len(self.buf)):
            self.buf, self.at = self.read(pos, max(n, self.window)), pos
        return self.buf[pos - self.at : pos - self.at + n]


def members(path: str, w: _Window, keep: Callable[[str, int], bool] | None = None) -> list[Member]:
    """The regular members of the tar file ``path``, read through ``w`` in one pass forward; the
    bytes of those ``keep(name, size)`` is true of are read too (:attr:`Member.data`).

    Raises:
        ShardError: it is not a tar file, a header is damaged, or it ends inside a member.
    """
    size, read, window = w.size, w.read, w.window
    out: list[Member] = []
    # every header and where it is: their checksums are checked at once, at the end or at the first
    # sign of trouble (one at a time in Python, each summing 512 bytes, they were the parse's largest
    # cost under the profiler)
    heads: list[bytes] = []
    heads_at: list[int] = []
    pos, long_name, pax_name = 0, None, None
    buf, at = b"", 0  # the window, inline: this loop runs once per member of the dataset

    def damaged() -> ShardError | None:
        """The error of the first header read that fails its checksum; None if none does."""
        bad = _first_damaged(heads)
        if bad is None:
            return None
        if heads_at[bad] == 0:
            return ShardError(f"{path} is not a tar file (its first block is not a tar header)")
        before = [m.name for m in out if m.offset < heads_at[bad]]
        last = f" (after member {before[-1]})" if before else ""
        return ShardError(f"{path} has a damaged tar header at byte {heads_at[bad]}{last}")

    while True:
        if not (at <= pos and pos + BLOCK <= at + len(buf)):
            buf, at = read(pos, window), pos
        head = buf[pos - at : pos - at + BLOCK]
        if len(head) < BLOCK:
            if len(head) == 0 and pos > 0:
                break  # no end-of-archive blocks: tarfile accepts that too
            last = f" after member {out[-1].name}" if out else ""
            raise damaged() or ShardError(
                f"{path} ends inside a tar header at byte {pos}{last}: the shard is truncated"
            )
        if head == _ZERO:
            break
        heads.append(head)
        heads_at.append(pos)
        if pos == 0 and (error := damaged()):
            raise error
        kind = head[156]
        field = head[124:136]
        if field[0] & 0x80:  # GNU base-256
            n = int.from_bytes(bytes([field[0] & 0x7F]) + field[1:], "big")
        else:
            try:
                n = int(field.split(b"\0", 1)[0].strip() or b"0", 8)
            except ValueError:
                raise damaged() or ShardError(
                    f"{path} has a damaged tar header at byte {pos} (size {field!r})"
                ) from None
        data = pos + BLOCK
        if long_name or pax_name:
            name = long_name or pax_name
        else:
            name = head[:100].split(b"\0", 1)[0]
            if head[345] and head[257:262] == b"ustar":
                name = head[345:500].split(b"\0", 1)[0] + b"/" + name
            name = name.decode("utf-8", "surrogateescape")
        if data + n > size:
            raise damaged() or ShardError(
                f"{path} ends inside member {name} ({n} bytes from byte {data}, the file has {size}): "
                "the shard is truncated"
            )
        if kind in _REGULAR:
            kept = _piece(buf, at, w, data, n) if keep is not None and keep(name, n) else None
            out.append(Member(name, data, n, kept))
            long_name = pax_name = None
        elif kind == 76:  # L: the next member's long name
            long_name = _piece(buf, at, w, data, n).rstrip(b"\0").decode("utf-8", "surrogateescape")
        elif kind == 120:  # x: the next member's pax header
            pax_name = _pax_path(_piece(buf, at, w, data, n)) or pax_name
        elif kind not in (75, 103):  # K (a long link name), g (global pax) leave the names
            long_name = pax_name = None
        pos = data + -(-n // BLOCK) * BLOCK
    error = damaged()
    if error is not None:
        raise error
    return out


def _piece(buf: bytes, at: int, w: _Window, data: int, n: int) -> bytes:
    """The shard's bytes ``[data, data + n)``: from the window ``buf`` (the bytes from ``at``) where
    they lie in it, as a small member after its header does, else read through ``w``."""
    return buf[data - at : data - at + n] if data + n <= at + len(buf) else w.get(data, n)


def _first_damaged(heads: list[bytes]) -> int | None:
    """Where in ``heads`` the first header with a wrong checksum is, or None. All are checked at
    once against ``"%06o\\0 "`` of their unsigned sums (what tarfile, GNU tar and bsdtar write);
    those whose field is written otherwise are checked one by one (:func:`_checksum_ok`)."""
    if not heads:
        return None
    blocks = np.frombuffer(b"".join(heads), dtype=np.uint8).reshape(len(heads), BLOCK)
    field = blocks[:, 148:156]
    sums = blocks.sum(axis=1, dtype=np.int64) - field.sum(axis=1, dtype=np.int64) + 8 * 32
    digits = field[:, :6].astype(np.int64) - 48
    written = (digits * (8 ** np.arange(5, -1, -1, dtype=np.int64))).sum(axis=1)
    plain = (digits >= 0).all(axis=1) & (digits <= 7).all(axis=1) & (field[:, 6] == 0) & (field[:, 7] == 32)
    for k in np.flatnonzero(~(plain & (written == sums))).tolist():
        if not _checksum_ok(heads[k]):
            return k
    return None


def _checksum_ok(head: bytes) -> bool:
    field = head[148:156]
    try:
        want = int(field.split(b"\0", 1)[0].strip() or b"-1", 8)
    except ValueError:
        return False
    unsigned = sum(head) - sum(field) + 8 * 32  # the field counts as 8 spaces
    if want == unsigned:
        return True
    blank = head[:148] + b" " * 8 + head[156:]  # some old tars sum signed bytes
    return want == int(np.frombuffer(blank, dtype=np.int8).sum(dtype=np.int64))


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


class Sample(NamedTuple):
    key: str
    image: Member
    label: int | bytes  # bytes: the raw .json member of a detection sample (label=JSON)


#: ``label=JSON``: a sample's target is its ``.json`` member (COCO's fields for one image: its size
#: and boxes), kept as bytes for :mod:`coordl.detection.coco`, instead of a class.
JSON = "json"


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
    if label == JSON:  # a detection sample's boxes: the member's bytes, parsed by the index
        member = lowered.get("json")
        if member is None:
            raise ShardError(f"{path}: sample {key} has no .json member with its image's size and boxes")
        return Sample(key, picked, _content(path, member, read))
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
    return m.data if m.data is not None else read(m.offset, m.size)


def _keeper(image, label) -> Callable[[str, int], bool]:
    """Which members' bytes a label is made of: ``.cls`` ones, or (a label function) every member
    that is not an image, up to :data:`LABEL_MAX` bytes."""
    images = set(image)

    def keep(name: str, size: int) -> bool:
        ext = name.rpartition("/")[2].partition(".")[2].lower()
        if label is None or label == JSON:
            return ext == ("cls" if label is None else "json")
        return ext not in images and size <= LABEL_MAX

    return keep


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
        found = members(path, w, _keeper(image, label))
        return samples_of(path, found, w.get, image=image, label=label, skip=skip), (st.st_size, st.st_mtime_ns)
    finally:
        os.close(fd)


S3_WINDOW = 4096  # bytes per range GET while indexing s3:// shards: a .cls member and the next header
# Left to choose (stream=None), a shard's headers are read by range GETs until, after STREAM_AFTER of
# them, they have moved STREAM_AT or more of the bytes they went past (members of a few KB: a stream
# would move at most 1/STREAM_AT times their bytes, in one request where they make one per sample);
# then the rest of the shard is read by one streaming GET.
STREAM_AFTER = 8
STREAM_AT = 0.5


def scan_object(
    url: str,
    size: int,
    etag: str,
    *,
    stream: bool | None = None,
    image=IMAGE_EXTENSIONS,
    label=None,
    skip: bool = False,
) -> tuple[list[Sample], int]:
    """The samples of the ``s3://`` tar object ``url`` (``size`` bytes, ETag ``etag``), and how many
    bytes reading it moved. ``stream``: False reads its headers by range GETs (:data:`S3_WINDOW`
    bytes each, one after each member larger than that); True reads it whole by one GET; None
    (the default) makes range GETs while they move fewer than :data:`STREAM_AT` of the bytes they
    go past, and reads the rest of the object by one GET once they do not (small members). Each
    GET carries ``If-Match: etag``.

    Raises:
        ShardError: see :func:`members` and :func:`samples_of`.
        DatasetChangedError: the object was replaced while it was read.
        OSError, StoreError: as reading a sample (:mod:`coordl.s3.client`).
    """
    from coordl.s3 import client
    from coordl.s3 import url as s3url

    s3 = client.boto3_client()
    bucket, key = s3url.split(url)
    moved = [0]

    def get(**kw):
        try:
            answer = s3.get_object(Bucket=bucket, Key=key, IfMatch=etag, **kw)
        except Exception as e:  # noqa: BLE001 - explained with the store's answer
            raise client.explain(e, url) from e
        return answer["Body"]

    forward = [_Forward(get(), moved) if stream else None]  # the streaming GET, once there is one
    gets = [0]

    def read(offset: int, n: int) -> bytes:
        end = min(offset + n, size)
        if forward[0] is None:
            if end <= offset:
                return b""
            if stream is None and gets[0] >= STREAM_AFTER and moved[0] >= STREAM_AT * offset:
                forward[0] = _Forward(get(Range=f"bytes={offset}-"), moved, offset)
        if forward[0] is not None:
            return forward[0].read(offset, n)
        data = get(Range=f"bytes={offset}-{end - 1}").read()
        moved[0] += len(data)
        gets[0] += 1
        return data

    try:
        w = _Window(read, size, S3_WINDOW)
        found = members(url, w, _keeper(image, label))
        return samples_of(url, found, w.get, image=image, label=label, skip=skip), moved[0]
    finally:
        if forward[0] is not None:
            forward[0].body.close()


class _Forward:
    """``read(offset, n)`` of one streaming GET of the object from byte ``start`` on: offsets only
    move forward (the bytes before one are dropped), except back into the last bytes read."""

    def __init__(self, body, moved: list, start: int = 0):
        self.body, self.moved = body, moved
        self.start, self.buf = start, b""

    def read(self, offset: int, n: int) -> bytes:
        if offset < self.start:
            raise ValueError(f"a streaming read went back from byte {self.start} to {offset}")
        drop = min(offset - self.start, len(self.buf))
        self.buf, self.start = self.buf[drop:], self.start + drop
        while self.start < offset:  # beyond what was read: skip the stream forward
            chunk = self.body.read(min(offset - self.start, 1 << 20))
            if not chunk:
                return b""
            self.moved[0] += len(chunk)
            self.start += len(chunk)
        while len(self.buf) < n:
            chunk = self.body.read(max(n - len(self.buf), 1 << 16))
            if not chunk:
                break
            self.moved[0] += len(chunk)
            self.buf += chunk
        return self.buf[:n]
