"""What image ``i`` of a dataset is: its class, its path, its bytes, and how it is written.

A :class:`Job` holds every argument an image depends on besides its index, so it is all a
worker process needs. Each JPEG carries a comment naming the format version, the job's
:func:`fingerprint` and its index: :mod:`.scan` recognises a file this job would write by it,
without decoding. Files are written atomically, under a temporary name (:data:`TMP_NAME`) in
the same folder first.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
from dataclasses import dataclass

import numpy as np
from PIL import Image

from coordl.tools.datagen import images

__all__ = ["FORMAT_VERSION", "TMP_NAME", "Job", "class_name", "fingerprint", "write_atomic"]

# Bump when the generation algorithm changes, so that files written by an older
# version are not mistaken for what the current code would write.
FORMAT_VERSION = 1
# The comment's tag: the module's name when the format was made, kept so that datasets
# generated before the move to coordl.tools still match.
_TAG = "coordl.datagen"
TMP_NAME = re.compile(r"^(.+)\.\d+\.tmp$")  # the temporary files of write_atomic


def class_name(c: int) -> str:
    """The folder of class ``c``, named as ImageNet's are: ``n00000003``."""
    return f"n{c:08d}"


@dataclass(frozen=True)
class Job:
    """Everything needed to produce image ``i`` of a dataset (picklable)."""

    root: str
    ext: str
    num_classes: int
    seed: int
    size: tuple[int, int]
    quality: int
    sigma: float
    photos: tuple[str, ...]  # empty: synthetic images
    fingerprint: str

    def class_name(self, i: int) -> str:
        return class_name(i % self.num_classes)

    def file_name(self, i: int) -> str:
        return f"{self.class_name(i)}_{i:06d}{self.ext}"

    def path(self, i: int) -> str:
        return os.path.join(self.root, self.class_name(i), self.file_name(i))

    def comment(self, i: int) -> bytes:
        return f"{_TAG} v{FORMAT_VERSION} {self.fingerprint} {i}".encode("ascii")

    def encode(self, i: int) -> tuple[bytes, int]:
        """Return image ``i`` as JPEG bytes, and its pixel count."""
        rng = np.random.default_rng([self.seed, i])
        w, h = images.draw_size(rng, self.size)
        if self.photos:
            pixels = images.photo_crop(rng, self.photos, w, h)
        else:
            pixels = images.synthetic(rng, w, h)
        pixels = images.add_grain(rng, pixels, self.sigma)
        buf = io.BytesIO()
        Image.fromarray(pixels, "RGB").save(
            buf,
            "JPEG",
            quality=self.quality,
            subsampling="4:2:0",
            optimize=False,
            progressive=False,
            comment=self.comment(i),
        )
        return buf.getvalue(), w * h

    def write(self, i: int) -> tuple[int, int]:
        """Write image ``i`` atomically; return its size in bytes and pixel count."""
        data, pixels = self.encode(i)
        write_atomic(self.path(i), data)
        return len(data), pixels


def fingerprint(size: tuple[int, int], quality: int, sigma: float, seed: int, photos: tuple[str, ...]) -> str:
    """Hash of everything an image's content depends on, besides its index."""
    h = hashlib.sha256()
    h.update(repr((FORMAT_VERSION, size, quality, float(sigma).hex(), seed)).encode())
    for path in photos:  # photo contents, not paths: moving the folder is fine
        h.update(images.file_digest(path).encode())
    return h.hexdigest()[:16]


def write_atomic(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` via a temporary file in the same folder."""
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.remove(tmp)
        except OSError:
            pass
        raise
