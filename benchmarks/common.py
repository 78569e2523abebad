"""Helpers shared by the benchmarks: the options that name a dataset and the dataset they
make, the block device's read counter, dropping the page cache, and the machine's description.

Every benchmark that makes or reads a dataset takes the same options for it
(:func:`add_dataset_options`) and gets it from :func:`dataset_from_args`, which generates it
once and finds it again on the next run with the same options.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

from coordl.units import format_bytes, parse_bytes

ROOT = Path(__file__).resolve().parents[1]  # the repository: run the benchmarks from here
SHARED_PHOTOS = ROOT.parent / "shared" / "photos"


# -- the dataset -----------------------------------------------------------------------------
def add_dataset_options(
    parser: argparse.ArgumentParser,
    *,
    data: str | None,
    images: int | None = 2000,
    size: str | None = None,
    classes: int | None = 20,
    width: int = 400,
    height: int = 350,
    data_help: str = "dataset root",
) -> None:
    """Adds the options that say where a benchmark's dataset is and what to generate there.

    ``--data``, ``--images`` or ``--size`` (the one given replaces the other's default),
    ``--classes``, ``--photos`` or ``--synthetic``, ``--width``, ``--height`` and
    ``--dataset-seed``; the keyword arguments are this benchmark's defaults (``None``: the
    benchmark picks one after parsing; ``data_help`` says what ``--data`` holds). ``--size`` is
    parsed into bytes.
    """
    g = parser.add_argument_group(
        "dataset", "where the dataset is; generated there if missing, found again by a later run with the same options"
    )
    g.add_argument("--data", default=data, help=f"{data_help} (default: {data})" if data else data_help)
    howmany = g.add_mutually_exclusive_group()
    howmany.add_argument(
        "--images",
        type=int,
        default=images,
        action=_HowMany,
        help=f"JPEGs to generate (default: {images})" if images else "JPEGs to generate",
    )
    howmany.add_argument(
        "--size",
        type=_byte_size,
        default=size,
        action=_HowMany,
        help="total size to generate instead, e.g. 500MB" + (f" (default: {size})" if size else ""),
    )
    g.add_argument(
        "--classes",
        type=int,
        default=classes,
        help=f"class folders (default: {classes})" if classes else "class folders",
    )
    source = g.add_mutually_exclusive_group()
    source.add_argument("--photos", help=f"photographs to crop from (default: {SHARED_PHOTOS} if present)")
    source.add_argument("--synthetic", action="store_true", help="generated images, even where photographs are")
    g.add_argument("--width", type=int, default=width, help=f"mean image width in pixels (default: {width})")
    g.add_argument("--height", type=int, default=height, help=f"mean image height in pixels (default: {height})")
    g.add_argument("--dataset-seed", type=int, default=0, help="the generator's seed (default: 0)")


class _HowMany(argparse.Action):
    """``--images`` or ``--size``: the one given replaces the default of the other."""

    def __call__(self, parser, namespace, values, option_string=None):
        namespace.images = namespace.size = None
        setattr(namespace, self.dest, values)


def _byte_size(text: str) -> int:
    try:
        return parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def photos_of(args: argparse.Namespace) -> str | None:
    """The photographs the dataset is cropped from, or None for generated images."""
    if args.synthetic:
        return None
    return args.photos or (str(SHARED_PHOTOS) if SHARED_PHOTOS.is_dir() else None)


def dataset_from_args(
    args: argparse.Namespace, *, root: str | None = None, images: int | None = None, seed: int | None = None
) -> dict:
    """Generates (or finds, made before with the same options) the dataset the options name.

    ``root``, ``images`` and ``seed`` replace ``--data``, ``--images`` (or ``--size``) and
    ``--dataset-seed``: for a second split of the same kind. Returns its figures.
    """
    from coordl.tools.datagen import make_dataset

    photos = photos_of(args)
    if images is not None or args.size is None:
        howmany = {"num_images": args.images if images is None else images}
    else:
        howmany = {"total_bytes": args.size}
    s = make_dataset(
        root or args.data,
        num_classes=args.classes,
        photos_dir=photos,
        size=(args.width, args.height),
        seed=args.dataset_seed if seed is None else seed,
        progress=sys.stderr.isatty(),
        **howmany,
    )
    return {
        "root": s.root,
        "files": s.files,
        "classes": s.classes,
        "total_bytes": s.total_bytes,
        "mean_bytes": round(s.mean_bytes),
        "bytes_per_pixel": round(s.bytes_per_pixel, 3),
        "source": "photographs" if photos else "generated",
    }


def dataset_argv(args: argparse.Namespace) -> list[str]:
    """The dataset options of ``args`` as a command line, for a child benchmark to find the same dataset."""
    argv = ["--data", args.data, "--classes", str(args.classes), "--dataset-seed", str(args.dataset_seed)]
    argv += ["--width", str(args.width), "--height", str(args.height)]
    argv += ["--size", str(args.size)] if args.size is not None else ["--images", str(args.images)]
    photos = photos_of(args)
    return argv + (["--photos", photos] if photos else ["--synthetic"])


def describe(dataset: dict) -> str:
    """A dataset's figures in a line: ``2000 files, 226.2 MB, mean 113.1 KB (photographs)``."""
    return (
        f"{dataset['files']} files, {format_bytes(dataset['total_bytes'], 'MB')}, "
        f"mean {format_bytes(dataset['mean_bytes'], 'KB')} ({dataset['source']})"
    )


def mb(n: float | None, digits: int = 1) -> str:
    """A cell of a table column headed in MB; ``-`` for no value."""
    return "-" if n is None else format_bytes(n, "MB", digits=digits, with_unit=False)


def module_command(name: str, *args: str) -> list[str]:
    """The command that runs the benchmark module ``name`` in a child Python.

    The child finds the ``benchmarks`` package as its parent did: in the working directory it
    inherits (the repository root), or on the ``PYTHONPATH`` it inherits.
    """
    return [sys.executable, "-m", f"benchmarks.{name}", *args]


# -- jobs started together ------------------------------------------------------------------
def job_files(workdir: Path, k: int) -> tuple[Path, Path]:
    """Job ``k``'s output and ready files in ``workdir``, neither left from a run before."""
    out, ready = workdir / f"out{k}.json", workdir / f"ready{k}"
    out.unlink(missing_ok=True)
    ready.unlink(missing_ok=True)
    return out, ready


def start_together(commands: list[list[str]], readies: list[Path], go: Path, before_go=None) -> list:
    """Starts the jobs' ``commands``; once every one has touched its ready file (its loader is made),
    calls ``before_go`` and touches ``go``, which they all wait for (:func:`wait_for_go`)."""
    procs = [subprocess.Popen(c) for c in commands]
    while not all(r.exists() for r in readies):
        if any(p.poll() not in (None, 0) for p in procs):
            raise SystemExit("a job failed before starting")
        time.sleep(0.05)
    if before_go is not None:
        before_go()
    go.touch()
    return procs


def wait_for_go(ready: str, go: str) -> None:
    """In a job: says it is ready, then waits for the go file of :func:`start_together`."""
    Path(ready).touch()
    while not os.path.exists(go):
        time.sleep(0.01)


# -- the machine -----------------------------------------------------------------------------
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
        "cpu_model": next(
            (
                ln.split(":", 1)[1].strip()
                for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")
            ),
            "",
        ),
        "git": run(["git", "-C", str(Path(__file__).parent), "rev-parse", "--short", "HEAD"]),
    }
