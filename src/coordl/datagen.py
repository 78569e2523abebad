"""Generate deterministic ImageNet-like ImageFolder datasets of JPEG files.

The generated tree is ``root/<class>/<class>_<i:06d><ext>`` with ImageNet-style
class folder names (``n00000000``, ``n00000001``, ...), images spread
round-robin over the classes. Image sizes, resolutions and compressed bytes per
pixel resemble ImageNet's (about 400x350 pixels and 0.8 bytes/pixel at JPEG
quality 90), so the files are realistic inputs for data-loading benchmarks and
tests.

A dataset is sized either by its number of images (``num_images``) or by its
total size in bytes (``total_bytes``): then it holds images ``0..n-1`` for the
smallest ``n`` whose files add up to at least ``total_bytes``. ``n`` is found
in rounds (estimate the mean file size from the files known so far, generate
about as many images as are still missing, repeat), and any images generated
past ``n`` are deleted again, so the result is as deterministic as with
``num_images``.

Two sources of content:

* ``photos_dir`` given: random crops of natural photographs (random scale,
  aspect ratio and horizontal flip), resized to the target size, plus
  gaussian sensor grain.
* no ``photos_dir``: synthetic images made of smooth random colour fields,
  gradients, random shapes and multi-scale texture, plus grain.

Every image is a pure function of ``(seed, index)`` and the generation
arguments: each has its own random generator (``numpy.random.default_rng([seed,
index])``), so images can be produced in any order, in parallel, and still be
byte-identical from run to run. Files are written atomically (temporary name in
the same folder, then :func:`os.replace`), and each JPEG carries a comment that
identifies the arguments it was made with, so a second call with the same
arguments can recognise the existing files cheaply and return without
regenerating them.

Example:
    >>> from coordl.datagen import make_dataset
    >>> summary = make_dataset("/tmp/fake-imagenet", num_images=2000)  # doctest: +SKIP
    >>> print(summary)  # doctest: +SKIP
    2000 files in 10 classes, 221.4 MB, mean 110.7 KB, 0.79 bytes/pixel at /tmp/fake-imagenet
    >>> summary = make_dataset("/tmp/fake-imagenet-1g", total_bytes=10**9)  # doctest: +SKIP
    >>> summary.total_bytes >= 10**9  # doctest: +SKIP
    True
"""

from __future__ import annotations

import hashlib
import io
import math
import multiprocessing
import operator
import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw
from tqdm import tqdm

__all__ = ["DatasetSummary", "make_dataset"]

# Bump when the generation algorithm changes, so that files written by an older
# version are not mistaken for what the current code would write.
_FORMAT_VERSION = 1

# Default grain (gaussian noise std, in 8-bit levels per RGB channel) used when
# ``grain=None``, tuned so that datasets land near ImageNet's ~0.8 bytes/pixel
# at the default size (400x350) and quality 90. Measured with this code, 500
# images, seed 0:
#   photos (/work/shared/photos, 12 wallpapers): 0.81 bytes/pixel, mean 113.5 KB
#     (grain 0: 0.23 B/px, 32 KB; grain 20: 0.55 B/px, 77 KB);
#   synthetic (no photos_dir): 0.80 bytes/pixel, mean 112.7 KB
#     (grain 0: 0.16 B/px; grain 20: 0.53 B/px).
# Bytes grow only logarithmically with noise amplitude at quality 90, so
# matching ImageNet's size needs strong grain: the images look like very high
# ISO shots and the noise carries most of the bytes. Decoding them costs what
# ImageNet-sized JPEGs cost (Pillow, about 1.4 ms each, no slower per byte than
# clean ones), which is what loader benchmarks need. Pass e.g. ``grain=20`` for
# cleaner-looking images (~0.55 bytes/pixel).
_DEFAULT_GRAIN_PHOTOS = 60.0
_DEFAULT_GRAIN_SYNTHETIC = 60.0

_PHOTO_SUFFIXES = frozenset({".jpg", ".jpeg", ".png"})
_SIZE_JITTER = 0.15  # each side is size * U(1 - jitter, 1 + jitter)
_CROP_AREA = (0.15, 0.60)  # fraction of the photo's area covered by a crop
_CROP_ASPECT_JITTER = math.log(1.15)  # crop aspect = target aspect * exp(U(-j, j))
_PARALLEL_MIN_IMAGES = 200
_FIRST_ROUND = 64  # images generated to estimate the mean file size (total_bytes mode)
_ROUND_MARGIN = 0.01  # aim this fraction (plus one mean image) past the missing bytes
_CHUNK = 8  # images per pool task
_HEAD_BYTES = 512  # the comment sits right after the JFIF header
_TMP_NAME = re.compile(r"^(.+)\.\d+\.tmp$")  # see _write_atomic

# Discretised standard normal: the quantiles of N(0, 1) at (k + 0.5) / 65536.
# Indexing it with uniform random uint16 values draws gaussian grain several
# times faster than Generator.standard_normal (tails are cut at about 4.3 std,
# which does not matter for grain).
_NORMAL_TABLE: np.ndarray | None = None
_GRAIN_TABLES: dict[float, np.ndarray] = {}  # sigma -> rounded int16 table

# Decoded photographs, keyed by (absolute path, size, mtime_ns): each photo is
# decoded once per process. Worker processes forked after the parent filled it
# share it.
_PHOTO_CACHE: dict[tuple[str, int, int], Image.Image] = {}
_DIGEST_CACHE: dict[tuple[str, int, int], str] = {}

# The job a pool worker runs, set by the pool initializer.
_WORKER_JOB: _Job | None = None


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
            f"{files} in {classes}, {self.total_bytes / 1e6:.1f} MB, "
            f"mean {self.mean_bytes / 1e3:.1f} KB, "
            f"{self.bytes_per_pixel:.2f} bytes/pixel at {self.root}"
        )


@dataclass(frozen=True)
class _Job:
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
        return _class_name(i % self.num_classes)

    def file_name(self, i: int) -> str:
        return f"{self.class_name(i)}_{i:06d}{self.ext}"

    def path(self, i: int) -> str:
        return os.path.join(self.root, self.class_name(i), self.file_name(i))

    def comment(self, i: int) -> bytes:
        return f"coordl.datagen v{_FORMAT_VERSION} {self.fingerprint} {i}".encode("ascii")

    def encode(self, i: int) -> tuple[bytes, int]:
        """Return image ``i`` as JPEG bytes, and its pixel count."""
        rng = np.random.default_rng([self.seed, i])
        w, h = _draw_size(rng, self.size)
        if self.photos:
            pixels = _photo_crop(rng, self.photos, w, h)
        else:
            pixels = _synthetic(rng, w, h)
        pixels = _add_grain(rng, pixels, self.sigma)
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
        _write_atomic(self.path(i), data)
        return len(data), pixels


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
            dataset near ImageNet's ~0.8 bytes/pixel (see ``_DEFAULT_GRAIN_*``).
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
    if not isinstance(ext, str) or len(ext) < 2 or not ext.startswith(".") or any(
        sep in ext for sep in ("/", "\\", os.sep)
    ):
        raise ValueError(f"ext must be a file extension such as '.JPEG', got {ext!r}")

    photos: tuple[str, ...] = ()
    if photos_dir is not None:
        photos = _list_photos(photos_dir)
    if grain is None:
        sigma = _DEFAULT_GRAIN_PHOTOS if photos else _DEFAULT_GRAIN_SYNTHETIC
    else:
        sigma = float(grain)
        if not math.isfinite(sigma) or sigma < 0:
            raise ValueError(f"grain must be a finite number >= 0 or None, got {grain!r}")

    root_path = os.path.abspath(os.fspath(root))
    job = _Job(
        root=root_path,
        ext=ext,
        num_classes=num_classes,
        seed=seed,
        size=size,
        quality=quality,
        sigma=sigma,
        photos=photos,
        fingerprint=_fingerprint(size, quality, sigma, seed, photos),
    )

    existing, stale = _scan_root(job, num_images)
    for path in stale:
        _remove(path)
    created = [] if os.path.isdir(root_path) else [root_path]
    os.makedirs(root_path, exist_ok=True)
    for c in range(num_classes):
        folder = os.path.join(root_path, _class_name(c))
        if not os.path.isdir(folder):
            os.mkdir(folder)
            created.append(folder)

    if num_images is not None:
        known = dict(existing)
        todo = [i for i in range(num_images) if i not in known]
        if todo:
            with _progress_bar(len(todo), progress) as bar:
                known.update(_generate(job, todo, lambda nbytes: bar.update(1)))
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
    job: _Job, existing: dict[int, tuple[int, int]], target: int, progress: bool
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
                need = (target - prefix) * (1.0 + _ROUND_MARGIN) + mean
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
                todo = list(range(k, k + _FIRST_ROUND))
            if bar is None:
                bar = _progress_bar(target, progress, unit="B")
                bar.update(prefix)
            known.update(_generate(job, todo, partial(_advance_capped, bar)))
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


# --------------------------------------------------------------------------
# argument checks


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


def _list_photos(photos_dir: str | os.PathLike[str]) -> tuple[str, ...]:
    folder = Path(photos_dir).resolve()
    if not folder.exists():
        raise FileNotFoundError(f"photos_dir {folder} does not exist")
    if not folder.is_dir():
        raise ValueError(f"photos_dir {folder} is not a folder")
    photos = tuple(
        str(p)
        for p in sorted(folder.iterdir(), key=lambda p: p.name)
        if p.suffix.lower() in _PHOTO_SUFFIXES and p.is_file()
    )
    if not photos:
        raise ValueError(
            f"photos_dir {folder} holds no photographs "
            f"(expected files ending in {', '.join(sorted(_PHOTO_SUFFIXES))})"
        )
    return photos


def _fingerprint(
    size: tuple[int, int], quality: int, sigma: float, seed: int, photos: tuple[str, ...]
) -> str:
    """Hash of everything an image's content depends on, besides its index."""
    h = hashlib.sha256()
    h.update(repr((_FORMAT_VERSION, size, quality, float(sigma).hex(), seed)).encode())
    for path in photos:  # photo contents, not paths: moving the folder is fine
        h.update(_file_digest(path).encode())
    return h.hexdigest()[:16]


def _file_key(path: str) -> tuple[str, int, int]:
    st = os.stat(path)
    return (path, st.st_size, st.st_mtime_ns)


def _file_digest(path: str) -> str:
    key = _file_key(path)
    digest = _DIGEST_CACHE.get(key)
    if digest is None:
        with open(path, "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()
        _DIGEST_CACHE[key] = digest
    return digest


# --------------------------------------------------------------------------
# existing files


def _class_name(c: int) -> str:
    return f"n{c:08d}"


def _scan_root(
    job: _Job, num_images: int | None
) -> tuple[dict[int, tuple[int, int]], list[str]]:
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

    expected_dirs = {_class_name(c) for c in range(job.num_classes)}
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
            m = _TMP_NAME.match(file.name)
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


def _index_of(job: _Job, name: str, c: int, num_images: int | None) -> int | None:
    """Return the image index if ``name`` is an expected file name in class ``c``.

    Indices ``>= num_images`` are not expected, unless ``num_images`` is ``None``.
    """
    prefix = f"{_class_name(c)}_"
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


def _check_file(job: _Job, i: int, path: str) -> tuple[int, int] | None:
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
    if (w, h) != _draw_size(np.random.default_rng([job.seed, i]), job.size):
        return None
    return nbytes, w * h


# --------------------------------------------------------------------------
# generation


def _generate(
    job: _Job, todo: list[int], advance: Callable[[int], None]
) -> dict[int, tuple[int, int]]:
    """Write images ``todo``, calling ``advance(bytes)`` after each one.

    Returns:
        ``{index: (bytes, pixels)}`` of the written images.
    """
    done: dict[int, tuple[int, int]] = {}
    workers = _cpu_count()
    # (daemonic processes, e.g. pool workers, may not start a pool of their own)
    if workers > 1 and len(todo) >= _PARALLEL_MIN_IMAGES and not multiprocessing.current_process().daemon:
        for path in job.photos:  # decode before forking: workers share the pixels
            _load_photo(path)
        chunks = [todo[k : k + _CHUNK] for k in range(0, len(todo), _CHUNK)]
        with _mp_context().Pool(workers, initializer=_init_worker, initargs=(job,)) as pool:
            for results in pool.imap_unordered(_worker_write, chunks):
                for i, nbytes, pixels in results:
                    done[i] = (nbytes, pixels)
                    advance(nbytes)
    else:
        for i in todo:
            done[i] = job.write(i)
            advance(done[i][0])
    return done


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _mp_context() -> multiprocessing.context.BaseContext:
    # fork shares the decoded photos and needs no re-import of this module.
    if "fork" in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("fork")
    return multiprocessing.get_context()


def _init_worker(job: _Job) -> None:
    global _WORKER_JOB
    _WORKER_JOB = job


def _worker_write(indices: list[int]) -> list[tuple[int, int, int]]:
    job = _WORKER_JOB
    if job is None:  # pragma: no cover - the pool initializer always sets it
        raise RuntimeError("worker job not initialised")
    return [(i, *job.write(i)) for i in indices]


def _write_atomic(path: str, data: bytes) -> None:
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


def _draw_size(rng: np.random.Generator, size: tuple[int, int]) -> tuple[int, int]:
    """Draw an image's (width, height): each side within +-15% of ``size``.

    Must stay the first draws from an image's generator: existing files are
    checked against it.
    """
    jitter = rng.uniform(1.0 - _SIZE_JITTER, 1.0 + _SIZE_JITTER, size=2)
    return (max(1, round(size[0] * jitter[0])), max(1, round(size[1] * jitter[1])))


def _load_photo(path: str) -> Image.Image:
    key = _file_key(path)
    photo = _PHOTO_CACHE.get(key)
    if photo is None:
        with Image.open(path) as im:
            photo = im.convert("RGB")
        photo.load()
        _PHOTO_CACHE[key] = photo
    return photo


def _photo_crop(rng: np.random.Generator, photos: tuple[str, ...], w: int, h: int) -> np.ndarray:
    """Random crop of a random photo, resized to (w, h) and maybe flipped."""
    photo = _load_photo(photos[int(rng.integers(len(photos)))])
    pw, ph = photo.size
    area = rng.uniform(*_CROP_AREA) * pw * ph
    aspect = (w / h) * math.exp(rng.uniform(-_CROP_ASPECT_JITTER, _CROP_ASPECT_JITTER))
    cw = min(float(pw), math.sqrt(area * aspect))
    ch = min(float(ph), math.sqrt(area / aspect))
    x0 = rng.uniform(0.0, pw - cw)
    y0 = rng.uniform(0.0, ph - ch)
    flip = bool(rng.integers(2))
    # reducing_gap: box-reduce by an integer factor first, then bicubic; about
    # twice as fast as plain bicubic for these 3-6x downscales.
    img = photo.resize(
        (w, h), Image.Resampling.BICUBIC, box=(x0, y0, x0 + cw, y0 + ch), reducing_gap=1.5
    )
    pixels = np.asarray(img)
    return pixels[:, ::-1] if flip else pixels


def _synthetic(rng: np.random.Generator, w: int, h: int) -> np.ndarray:
    """A synthetic 'photo': colour fields, gradient, shapes and texture."""
    # Smooth low-frequency colour field: a tiny random image, upsampled.
    gw, gh = (int(v) for v in rng.integers(2, 6, size=2))
    field = rng.integers(0, 256, size=(gh, gw, 3), dtype=np.uint8)
    base = np.asarray(
        Image.fromarray(field, "RGB").resize((w, h), Image.Resampling.BICUBIC), dtype=np.float32
    )
    # A linear gradient (like lighting falloff).
    gx, gy = rng.uniform(-60.0, 60.0, size=2)
    ramp = (np.linspace(-0.5, 0.5, w, dtype=np.float32)[None, :] * gx) + (
        np.linspace(-0.5, 0.5, h, dtype=np.float32)[:, None] * gy
    )
    base += ramp[:, :, None]
    np.clip(base, 0, 255, out=base)
    img = Image.fromarray(base.astype(np.uint8), "RGB")

    # A few random shapes (objects with hard edges).
    draw = ImageDraw.Draw(img)
    for _ in range(int(rng.integers(3, 9))):
        kind = int(rng.integers(3))
        x = rng.uniform(-0.1, 1.1, size=2) * w
        y = rng.uniform(-0.1, 1.1, size=2) * h
        box = (min(x), min(y), max(x), max(y))
        fill = tuple(int(v) for v in rng.integers(0, 256, size=3))
        if kind == 0:
            draw.ellipse(box, fill=fill)
        elif kind == 1:
            draw.rectangle(box, fill=fill)
        else:
            n = int(rng.integers(3, 7))
            pts = rng.uniform(-0.1, 1.1, size=(n, 2)) * (w, h)
            draw.polygon([(float(px), float(py)) for px, py in pts], fill=fill)

    # Multi-scale luminance texture (roughly 1/f, like natural images).
    pixels = np.asarray(img, dtype=np.int16)
    texture = np.zeros((h, w), dtype=np.float32)
    for cell, amplitude in ((48, 14.0), (16, 9.0), (5, 6.0)):
        grid = rng.integers(0, 256, size=(h // cell + 2, w // cell + 2), dtype=np.uint8)
        up = Image.fromarray(grid, "L").resize(
            (w, h), Image.Resampling.BICUBIC, box=(0.5, 0.5, w / cell + 0.5, h / cell + 0.5)
        )
        texture += (np.asarray(up, dtype=np.float32) - 128.0) * (amplitude / 128.0)
    pixels += np.rint(texture).astype(np.int16)[:, :, None]
    np.clip(pixels, 0, 255, out=pixels)
    return pixels.astype(np.uint8)


def _normal_table() -> np.ndarray:
    global _NORMAL_TABLE
    if _NORMAL_TABLE is None:
        from statistics import NormalDist

        inv = NormalDist().inv_cdf
        _NORMAL_TABLE = np.array(
            [inv((k + 0.5) / 65536.0) for k in range(65536)], dtype=np.float32
        )
    return _NORMAL_TABLE


def _add_grain(rng: np.random.Generator, pixels: np.ndarray, sigma: float) -> np.ndarray:
    """Add iid gaussian noise of std ``sigma`` to every channel of every pixel."""
    if sigma <= 0:
        return np.ascontiguousarray(pixels)
    table = _GRAIN_TABLES.get(sigma)
    if table is None:
        scaled = np.clip(np.rint(_normal_table() * sigma), -255, 255)
        table = _GRAIN_TABLES[sigma] = scaled.astype(np.int16)
    idx = np.frombuffer(rng.bytes(2 * pixels.size), dtype="<u2")
    noisy = pixels.astype(np.int16)
    noisy += table.take(idx).reshape(pixels.shape)
    np.clip(noisy, 0, 255, out=noisy)
    return noisy.astype(np.uint8)
