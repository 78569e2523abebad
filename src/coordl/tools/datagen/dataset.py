"""The public API, :func:`make_dataset` and :class:`DatasetSummary`, and the job's bookkeeping.

:func:`make_dataset` checks its arguments, describes the dataset as a :class:`~.job.Job`,
keeps what :func:`~.scan.scan_root` finds already on disk and has :func:`~.workers.generate`
write the rest: the images asked for, or, for a total size, rounds of images until the first
``n`` add up to it (:data:`FIRST_ROUND` images to estimate the mean size first, then about as
many as are still missing, aiming :data:`ROUND_MARGIN` past the target).
"""

from __future__ import annotations

import math
import operator
import os
import sys
from dataclasses import dataclass
from functools import partial

from tqdm import tqdm

from coordl.tools.datagen import images, workers
from coordl.tools.datagen.job import Job, class_name, fingerprint
from coordl.tools.datagen.scan import scan_root
from coordl.units import format_bytes

__all__ = ["FIRST_ROUND", "ROUND_MARGIN", "DatasetSummary", "make_dataset"]

FIRST_ROUND = 64  # images generated to estimate the mean file size (total_bytes mode)
ROUND_MARGIN = 0.01  # aim this fraction (plus one mean image) past the missing bytes


@dataclass(frozen=True)
class DatasetSummary:
    """Size statistics of a generated dataset.

    Attributes:
        root: Absolute path of the dataset's root folder.
        files: Number of image files.
        classes: Number of class folders.
        total_bytes: Sum of the files' sizes in bytes.
        mean_bytes: ``total_bytes / files``.
        bytes_per_pixel: ``total_bytes`` divided by the summed pixel counts
            (width * height) of all images.
    """

    root: str
    files: int
    classes: int
    total_bytes: int
    mean_bytes: float
    bytes_per_pixel: float

    def __str__(self) -> str:
        """Return a one-line human description of the dataset."""
        files = f"{self.files} file{'' if self.files == 1 else 's'}"
        classes = f"{self.classes} class{'' if self.classes == 1 else 'es'}"
        return (
            f"{files} in {classes}, {format_bytes(self.total_bytes, 'MB')}, "
            f"mean {format_bytes(self.mean_bytes, 'KB')}, "
            f"{self.bytes_per_pixel:.2f} bytes/pixel at {self.root}"
        )


def make_dataset(
    root: str | os.PathLike[str],
    *,
    num_images: int | None = None,
    total_bytes: int | None = None,
    num_classes: int = 10,
    photos_dir: str | os.PathLike[str] | None = None,
    size: tuple[int, int] = (400, 350),
    quality: int = 90,
    grain: float | None = None,
    seed: int = 0,
    ext: str = ".JPEG",
    progress: bool = True,
) -> DatasetSummary:
    """Generate a deterministic ImageNet-like ImageFolder dataset of JPEGs.

    Writes ``root/<class>/<class>_<i:06d><ext>`` for ``i`` in ``range(n)``,
    image ``i`` going to class ``i % num_classes``; class folders are named
    ``n{index:08d}``. Each image's width and height are drawn independently
    within +-15% of ``size``. The same arguments give byte-identical files,
    whatever the number of worker processes.

    Give exactly one of ``num_images`` and ``total_bytes``. With
    ``num_images``, ``n = num_images``. With ``total_bytes``, ``n`` is the
    smallest count of images whose file sizes add up to at least
    ``total_bytes`` (so images ``0..n-2`` add up to less). Since every image
    is a pure function of the seed, its index and the arguments, ``n`` and
    the files are deterministic too. They are generated in rounds: the mean
    file size is estimated from the files known so far (a first round of 64
    images when there are none), about as many images as are still missing
    are generated, and so on until the sum reaches ``total_bytes``; images
    generated past ``n`` are then deleted.

    If ``root`` already holds files, they must all be files this call would
    write (same arguments and seed, recognised by the comment embedded in each
    JPEG); then only the missing ones are generated (none after a complete
    run, making a second call a cheap no-op) and the summary is recounted from
    the files on disk. Leftover temporary files of an interrupted run are
    removed. With ``num_images``, files of images ``>= num_images`` are
    refused; with ``total_bytes``, existing images past ``n`` are deleted.

    Args:
        root: Folder to create the dataset in; created if missing, must be
            empty or hold only this call's files.
        num_images: Number of images, at least 1.
        total_bytes: Minimum total size of the dataset's files in bytes, at
            least 1.
        num_classes: Number of class folders, between 1 and the number of
            images ``n``.
        photos_dir: Folder of large natural photographs (``.jpg``, ``.jpeg``,
            ``.png``) to crop images from; ``None`` for synthetic images.
        size: Mean ``(width, height)`` of the images in pixels.
        quality: JPEG quality, 1 to 100.
        grain: Standard deviation of the gaussian noise added to each RGB
            channel, in 8-bit levels; ``None`` picks a default that brings the
            dataset near ImageNet's ~0.8 bytes/pixel (see ``images.DEFAULT_GRAIN_*``).
        seed: Non-negative random seed.
        ext: File name extension, starting with a dot.
        progress: Show a tqdm progress bar on stderr while generating (in
            images with ``num_images``, in bytes with ``total_bytes``).

    Returns:
        The dataset's summary.

    Raises:
        ValueError: If neither or both of ``num_images`` and ``total_bytes``
            are given, if an argument is out of range, if ``total_bytes`` is
            reached with fewer than ``num_classes`` images (then the files this
            call wrote are deleted again), if ``photos_dir`` holds no
            photographs, or if ``root`` exists and is not a folder or holds
            anything this call would not write.
        TypeError: If a count, byte size, image size, quality or seed is not
            an integer.
        FileNotFoundError: If ``photos_dir`` does not exist.
    """
    if (num_images is None) == (total_bytes is None):
        raise ValueError(
            "give exactly one of num_images and total_bytes, "
            f"got num_images={num_images!r}, total_bytes={total_bytes!r}"
        )
    num_classes = _as_int("num_classes", num_classes)
    if num_images is not None:
        num_images = _as_int("num_images", num_images)
        if num_images < 1:
            raise ValueError(f"num_images must be >= 1, got {num_images}")
    else:
        total_bytes = _as_int("total_bytes", total_bytes)
        if total_bytes < 1:
            raise ValueError(f"total_bytes must be >= 1, got {total_bytes}")
    if num_classes < 1:
        raise ValueError(f"num_classes must be >= 1, got {num_classes}")
    if num_images is not None and num_classes > num_images:
        raise ValueError(
            f"num_classes must be <= num_images (every class needs an image), "
            f"got num_classes={num_classes} > num_images={num_images}"
        )
    size = _check_size(size)
    quality = _as_int("quality", quality)
    if not 1 <= quality <= 100:
        raise ValueError(f"quality must be between 1 and 100, got {quality}")
    seed = _as_int("seed", seed)
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    if (
        not isinstance(ext, str)
        or len(ext) < 2
        or not ext.startswith(".")
        or any(sep in ext for sep in ("/", "\\", os.sep))
    ):
        raise ValueError(f"ext must be a file extension such as '.JPEG', got {ext!r}")

    photos: tuple[str, ...] = ()
    if photos_dir is not None:
        photos = images.list_photos(photos_dir)
    if grain is None:
        sigma = images.DEFAULT_GRAIN_PHOTOS if photos else images.DEFAULT_GRAIN_SYNTHETIC
    else:
        sigma = float(grain)
        if not math.isfinite(sigma) or sigma < 0:
            raise ValueError(f"grain must be a finite number >= 0 or None, got {grain!r}")

    root_path = os.path.abspath(os.fspath(root))
    job = Job(
        root=root_path,
        ext=ext,
        num_classes=num_classes,
        seed=seed,
        size=size,
        quality=quality,
        sigma=sigma,
        photos=photos,
        fingerprint=fingerprint(size, quality, sigma, seed, photos),
    )

    existing, stale = scan_root(job, num_images)
    for path in stale:
        _remove(path)
    created = [] if os.path.isdir(root_path) else [root_path]
    os.makedirs(root_path, exist_ok=True)
    for c in range(num_classes):
        folder = os.path.join(root_path, class_name(c))
        if not os.path.isdir(folder):
            os.mkdir(folder)
            created.append(folder)

    if num_images is not None:
        known = dict(existing)
        todo = [i for i in range(num_images) if i not in known]
        if todo:
            with _progress_bar(len(todo), progress) as bar:
                known.update(workers.generate(job, todo, lambda nbytes: bar.update(1)))
        n = num_images
    else:
        known, n = _fill_to_bytes(job, existing, total_bytes, progress)
        if n < num_classes:
            for i in known:  # undo this call: delete what it wrote, keep what was there
                if i not in existing:
                    _remove(job.path(i))
            for folder in reversed(created):
                try:
                    os.rmdir(folder)
                except OSError:
                    pass
            raise ValueError(
                f"total_bytes={total_bytes} is reached with {n} image{'' if n == 1 else 's'}, "
                f"fewer than num_classes={num_classes} (every class needs an image): "
                f"ask for more bytes or fewer classes"
            )
        for i in known:  # images generated (or found) past n
            if i >= n:
                _remove(job.path(i))

    nbytes = sum(known[i][0] for i in range(n))
    pixels = sum(known[i][1] for i in range(n))
    return DatasetSummary(
        root=root_path,
        files=n,
        classes=num_classes,
        total_bytes=nbytes,
        mean_bytes=nbytes / n,
        bytes_per_pixel=nbytes / pixels,
    )


def _fill_to_bytes(
    job: Job, existing: dict[int, tuple[int, int]], target: int, progress: bool
) -> tuple[dict[int, tuple[int, int]], int]:
    """Generate images in rounds until images ``0..n-1`` reach ``target`` bytes.

    Returns:
        ``{index: (bytes, pixels)}`` of every image of the dataset on disk
        (``existing`` plus the generated ones, possibly past ``n``), and ``n``:
        the smallest count of images whose sizes add up to ``target`` or more.
    """
    known = dict(existing)
    bar = None
    k = 0  # images 0..k-1 are known and add up to `prefix` bytes
    prefix = 0
    try:
        while True:
            while prefix < target and k in known:
                prefix += known[k][0]
                k += 1
            if prefix >= target:
                if bar is not None:
                    bar.update(bar.total - bar.n)
                return known, k
            if known:
                mean = sum(b for b, _ in known.values()) / len(known)
                # Aim a little past the target (a margin plus one mean-sized
                # image), so that a round rarely falls short and needs another.
                need = (target - prefix) * (1.0 + ROUND_MARGIN) + mean
                todo = []
                i = k
                while need > 0:
                    if i in known:
                        need -= known[i][0]
                    else:
                        todo.append(i)
                        need -= mean
                    i += 1
            else:
                todo = list(range(k, k + FIRST_ROUND))
            if bar is None:
                bar = _progress_bar(target, progress, unit="B")
                bar.update(prefix)
            known.update(workers.generate(job, todo, partial(_advance_capped, bar)))
    finally:
        if bar is not None:
            bar.close()


def _advance_capped(bar: tqdm, nbytes: int) -> None:
    """Advance a bytes bar, not past its total (the last round overshoots)."""
    bar.update(min(nbytes, bar.total - bar.n))


def _progress_bar(total: int, progress: bool, unit: str = "img") -> tqdm:
    return tqdm(
        total=total,
        desc="make_dataset",
        unit=unit,
        unit_scale=unit == "B",
        disable=not progress,
        file=sys.stderr,
    )


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def _as_int(name: str, value: object) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"{name} must be an integer, got {value!r}") from None


def _check_size(size: object) -> tuple[int, int]:
    try:
        w, h = size  # type: ignore[misc]
    except (TypeError, ValueError):
        raise ValueError(f"size must be a (width, height) pair, got {size!r}") from None
    w = _as_int("size[0] (width)", w)
    h = _as_int("size[1] (height)", h)
    if w < 8 or h < 8:
        raise ValueError(f"size must be at least (8, 8) pixels, got {(w, h)}")
    return (w, h)
