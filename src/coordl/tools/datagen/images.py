"""Image synthesis: what image ``i`` looks like, from photographs or from noise.

Every function here draws from the random generator it is given, in a fixed order, so an
image is a pure function of that generator's seed and the arguments. :func:`draw_size` must
stay the first draw: :mod:`.scan` recognises existing files by the size it draws. Decoded
photographs and their digests are cached per process; worker processes forked after the
parent filled the cache share it.
"""

from __future__ import annotations

import hashlib
import math
import os
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

__all__ = [
    "DEFAULT_GRAIN_PHOTOS",
    "DEFAULT_GRAIN_SYNTHETIC",
    "add_grain",
    "draw_size",
    "file_digest",
    "list_photos",
    "load_photo",
    "photo_crop",
    "synthetic",
]

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
DEFAULT_GRAIN_PHOTOS = 60.0
DEFAULT_GRAIN_SYNTHETIC = 60.0

_PHOTO_SUFFIXES = frozenset({".jpg", ".jpeg", ".png"})
_SIZE_JITTER = 0.15  # each side is size * U(1 - jitter, 1 + jitter)
_CROP_AREA = (0.15, 0.60)  # fraction of the photo's area covered by a crop
_CROP_ASPECT_JITTER = math.log(1.15)  # crop aspect = target aspect * exp(U(-j, j))

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


def list_photos(photos_dir: str | os.PathLike[str]) -> tuple[str, ...]:
    """The photographs in ``photos_dir`` (absolute paths, sorted by name).

    Raises:
        FileNotFoundError: If ``photos_dir`` does not exist.
        ValueError: If it is not a folder or holds no ``.jpg``, ``.jpeg`` or ``.png`` file.
    """
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
            f"photos_dir {folder} holds no photographs (expected files ending in {', '.join(sorted(_PHOTO_SUFFIXES))})"
        )
    return photos


def _file_key(path: str) -> tuple[str, int, int]:
    st = os.stat(path)
    return (path, st.st_size, st.st_mtime_ns)


def file_digest(path: str) -> str:
    """SHA-256 of the file's bytes, computed once per process per (path, size, mtime)."""
    key = _file_key(path)
    digest = _DIGEST_CACHE.get(key)
    if digest is None:
        with open(path, "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()
        _DIGEST_CACHE[key] = digest
    return digest


def draw_size(rng: np.random.Generator, size: tuple[int, int]) -> tuple[int, int]:
    """Draw an image's (width, height): each side within +-15% of ``size``.

    Must stay the first draws from an image's generator: existing files are
    checked against it.
    """
    jitter = rng.uniform(1.0 - _SIZE_JITTER, 1.0 + _SIZE_JITTER, size=2)
    return (max(1, round(size[0] * jitter[0])), max(1, round(size[1] * jitter[1])))


def load_photo(path: str) -> Image.Image:
    """The photograph at ``path`` decoded to RGB, once per process (see the module's docstring)."""
    key = _file_key(path)
    photo = _PHOTO_CACHE.get(key)
    if photo is None:
        with Image.open(path) as im:
            photo = im.convert("RGB")
        photo.load()
        _PHOTO_CACHE[key] = photo
    return photo


def photo_crop(rng: np.random.Generator, photos: tuple[str, ...], w: int, h: int) -> np.ndarray:
    """Random crop of a random photo, resized to (w, h) and maybe flipped."""
    photo = load_photo(photos[int(rng.integers(len(photos)))])
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
    img = photo.resize((w, h), Image.Resampling.BICUBIC, box=(x0, y0, x0 + cw, y0 + ch), reducing_gap=1.5)
    pixels = np.asarray(img)
    return pixels[:, ::-1] if flip else pixels


def synthetic(rng: np.random.Generator, w: int, h: int) -> np.ndarray:
    """A synthetic 'photo': colour fields, gradient, shapes and texture."""
    # Smooth low-frequency colour field: a tiny random image, upsampled.
    gw, gh = (int(v) for v in rng.integers(2, 6, size=2))
    field = rng.integers(0, 256, size=(gh, gw, 3), dtype=np.uint8)
    base = np.asarray(Image.fromarray(field, "RGB").resize((w, h), Image.Resampling.BICUBIC), dtype=np.float32)
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
        _NORMAL_TABLE = np.array([inv((k + 0.5) / 65536.0) for k in range(65536)], dtype=np.float32)
    return _NORMAL_TABLE


def add_grain(rng: np.random.Generator, pixels: np.ndarray, sigma: float) -> np.ndarray:
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
