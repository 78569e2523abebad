"""The options that name a benchmark's image folder, and the folder they make once (``coordl.tools.datagen``, as
``coordl make-dataset`` does) and find again on the next run."""

import argparse
import sys
from pathlib import Path

from coordl.units import format_bytes, parse_bytes

ROOT = Path(__file__).resolve().parents[2]  # the repository: run the benchmarks from here
SHARED_PHOTOS = ROOT.parent / "shared" / "photos"


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
) -> argparse._ArgumentGroup:
    """Adds ``--data``, ``--images`` or ``--size`` (the one given replaces the other's default), ``--classes``,
    ``--photos`` or ``--synthetic``, ``--width``, ``--height`` and ``--dataset-seed``, their defaults the keyword
    arguments (``None``: the scenario picks one after parsing); returns the group, for the scenario's own options."""
    g = parser.add_argument_group("dataset", "generated there if missing, found again by a later run")

    def default(text, value):
        return f"{text} (default: {value})" if value else text

    g.add_argument("--data", default=data, help=default(data_help, data))
    howmany = g.add_mutually_exclusive_group()
    howmany.add_argument("--images", type=int, default=images, action=_HowMany, help=default("JPEGs", images))
    howmany.add_argument("--size", type=_byte_size, default=size, action=_HowMany, help=default("or bytes", size))
    g.add_argument("--classes", type=int, default=classes, help=default("class folders", classes))
    add_source_options(g)
    g.add_argument("--width", type=int, default=width, help=f"mean image width (default: {width})")
    g.add_argument("--height", type=int, default=height, help=f"mean image height (default: {height})")
    g.add_argument("--dataset-seed", type=int, default=0, help="the generator's seed (default: 0)")
    return g


def add_source_options(group) -> None:
    """``--photos DIR`` or ``--synthetic``: what the images are cropped from."""
    source = group.add_mutually_exclusive_group()
    source.add_argument("--photos", help=f"photographs to crop from (default: {SHARED_PHOTOS} if present)")
    source.add_argument("--synthetic", action="store_true", help="generated images, even where photographs are")


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
    return None if args.synthetic else args.photos or (str(SHARED_PHOTOS) if SHARED_PHOTOS.is_dir() else None)


def dataset_from_args(
    args: argparse.Namespace, *, root: str | None = None, images: int | None = None, seed: int | None = None
) -> dict:
    """Generates (or finds) the dataset the options name; returns its figures. ``root``, ``images`` and ``seed``
    replace ``--data``, ``--images`` (or ``--size``) and ``--dataset-seed``: for a second split of the same kind."""
    from coordl.tools.datagen import make_dataset

    photos = photos_of(args)
    if images is not None or args.size is None:
        howmany = {"num_images": args.images if images is None else images}
    else:
        howmany = {"total_bytes": args.size}
    kw = {"num_classes": args.classes, "photos_dir": photos, "size": (args.width, args.height), **howmany}
    s = make_dataset(
        root or args.data, seed=args.dataset_seed if seed is None else seed, progress=sys.stderr.isatty(), **kw
    )
    out = {"root": s.root, "files": s.files, "classes": s.classes, "total_bytes": s.total_bytes}
    out |= {"mean_bytes": round(s.mean_bytes), "bytes_per_pixel": round(s.bytes_per_pixel, 3)}
    return out | {"source": "photographs" if photos else "generated"}


def describe(dataset: dict) -> str:
    """A dataset's figures in a line: ``2000 files, 226.2 MB, mean 113.1 KB (photographs)``."""
    mb, kb = format_bytes(dataset["total_bytes"], "MB"), format_bytes(dataset["mean_bytes"], "KB")
    return f"{dataset['files']} files, {mb}, mean {kb} ({dataset['source']})"
