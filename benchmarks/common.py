"""Helpers shared by the benchmarks: the block device's read counter, dropping the page
cache, and a dataset made once and reused."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

SHARED_PHOTOS = Path(__file__).resolve().parents[2] / "shared" / "photos"


def device_of(path: str) -> tuple[int, int]:
    st = os.stat(path)
    return os.major(st.st_dev), os.minor(st.st_dev)


def sectors_read(dev: tuple[int, int]) -> int:
    """Bytes read from the block device so far (``/proc/diskstats`` column 6, 512-byte sectors)."""
    with open("/proc/diskstats") as f:
        for line in f:
            parts = line.split()
            if (int(parts[0]), int(parts[1])) == dev:
                return int(parts[5]) * 512
    raise RuntimeError(f"device {dev} is not in /proc/diskstats")


def drop_page_cache(level: int = 3) -> str | None:
    """Drops the OS caches (1: page cache, 3: also dentries and inodes); returns why it could not, or None."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write(f"{level}\n")
        return None
    except OSError as e:
        return f"cannot drop the page cache ({e}); run as root for cold-storage numbers"


def evict(root: str) -> None:
    """Drops the files under ``root`` from the page cache (``POSIX_FADV_DONTNEED``), and only them."""
    for folder, _, files in os.walk(root):
        for f in files:
            fd = os.open(os.path.join(folder, f), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def ensure_dataset(root: str, images: int | None, classes: int, photos: str | None, total_bytes: int | None = None) -> dict:
    """Generates (or finds, made before with the same arguments) a dataset of ``images`` files
    or of ``total_bytes``; returns its figures."""
    from coordl.datagen import make_dataset

    photos = photos or (str(SHARED_PHOTOS) if SHARED_PHOTOS.is_dir() else None)
    size = {"num_images": images} if total_bytes is None else {"total_bytes": total_bytes}
    s = make_dataset(root, num_classes=classes, photos_dir=photos, progress=sys.stderr.isatty(), **size)
    return {
        "root": s.root,
        "files": s.files,
        "classes": s.classes,
        "total_bytes": s.total_bytes,
        "mean_bytes": round(s.mean_bytes),
        "bytes_per_pixel": round(s.bytes_per_pixel, 3),
        "source": "photographs" if photos else "generated",
    }


def machine() -> dict:
    def run(cmd):
        try:
            return subprocess.run(cmd, capture_output=True, text=True, check=False).stdout.strip()
        except OSError:
            return ""

    mem = Path("/proc/meminfo").read_text().split("\n")[0].split()[1]
    return {
        "cpus": os.cpu_count(),
        "mem_gib": round(int(mem) / 2**20, 1),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "cpu_model": next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                           if ln.startswith("model name")), ""),  # fmt: skip
        "git": run(["git", "-C", str(Path(__file__).parent), "rev-parse", "--short", "HEAD"]),
    }
