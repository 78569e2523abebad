"""Scanning an existing dataset folder, so that a run resumes or returns at once.

:func:`scan_root` accepts a folder only if it holds nothing but files this job would write
(and temporary files an interrupted run left, which it returns for deletion). It recognises
each image cheaply, by the comment in its JPEG header, its end marker and its dimensions,
without decoding it.
"""

from __future__ import annotations

import os

import numpy as np
from PIL import Image

from coordl.tools.datagen import images
from coordl.tools.datagen.job import TMP_NAME, Job, class_name

__all__ = ["scan_root"]

_HEAD_BYTES = 512  # the comment sits right after the JFIF header


def scan_root(job: Job, num_images: int | None) -> tuple[dict[int, tuple[int, int]], list[str]]:
    """Check that ``job.root`` holds only files this job writes.

    Args:
        job: The dataset's generation arguments.
        num_images: Images of index ``>= num_images`` are refused; ``None``
            accepts any index.

    Returns:
        ``{index: (bytes, pixels)}`` for the complete files already there, and
        the paths of leftover temporary files to delete.

    Raises:
        ValueError: If the root is not a folder or holds anything else.
    """
    root = job.root
    if not os.path.exists(root):
        return {}, []
    if not os.path.isdir(root):
        raise ValueError(f"root {root} exists and is not a folder")

    expected_dirs = {class_name(c) for c in range(job.num_classes)}
    existing: dict[int, tuple[int, int]] = {}
    stale: list[str] = []

    def refuse(what: str) -> ValueError:
        return ValueError(
            f"root {root} is not empty and {what}; make_dataset only reuses a folder "
            f"that holds nothing but its own output for the same arguments and seed: "
            f"pass an empty or new folder"
        )

    for entry in sorted(os.scandir(root), key=lambda e: e.name):
        if entry.name not in expected_dirs or not entry.is_dir(follow_symlinks=False):
            raise refuse(f"{entry.path} is not one of the {job.num_classes} class folders")
        c = int(entry.name[1:])
        for file in sorted(os.scandir(entry.path), key=lambda e: e.name):
            m = TMP_NAME.match(file.name)
            if m is not None and _index_of(job, m.group(1), c, num_images) is not None:
                stale.append(file.path)
                continue
            i = _index_of(job, file.name, c, num_images)
            if i is None or not file.is_file(follow_symlinks=False):
                raise refuse(f"{file.path} is not a file of this dataset")
            found = _check_file(job, i, file.path)
            if found is None:
                raise refuse(
                    f"{file.path} was not written by make_dataset with these arguments "
                    f"(different seed, size, quality, grain or photos?)"
                )
            existing[i] = found
    return existing, stale


def _index_of(job: Job, name: str, c: int, num_images: int | None) -> int | None:
    """Return the image index if ``name`` is an expected file name in class ``c``.

    Indices ``>= num_images`` are not expected, unless ``num_images`` is ``None``.
    """
    prefix = f"{class_name(c)}_"
    if not (name.startswith(prefix) and name.endswith(job.ext)):
        return None
    digits = name[len(prefix) : len(name) - len(job.ext)]
    if not digits.isdigit():
        return None
    i = int(digits)
    if num_images is not None and i >= num_images:
        return None
    if i % job.num_classes != c or job.file_name(i) != name:
        return None
    return i


def _check_file(job: Job, i: int, path: str) -> tuple[int, int] | None:
    """Return (bytes, pixels) if ``path`` is image ``i`` of ``job``, else None.

    Cheap: reads the JPEG header (comment and dimensions) and the last two
    bytes, without decoding.
    """
    try:
        with open(path, "rb") as f:
            head = f.read(_HEAD_BYTES)
            if not head.startswith(b"\xff\xd8") or job.comment(i) not in head:
                return None
            nbytes = os.fstat(f.fileno()).st_size
            f.seek(-2, os.SEEK_END)
            if f.read(2) != b"\xff\xd9":
                return None
            f.seek(0)
            with Image.open(f) as im:
                if im.format != "JPEG":
                    return None
                w, h = im.size
    except (OSError, ValueError):
        return None
    if (w, h) != images.draw_size(np.random.default_rng([job.seed, i]), job.size):
        return None
    return nbytes, w * h
