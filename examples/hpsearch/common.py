"""What ``launch.py`` and ``halving.py`` share: the dataset (a folder, or ``--demo``) and the
options every trial gets."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_data_args(p: argparse.ArgumentParser, group: str) -> None:
    p.add_argument("data", nargs="?", help="ImageFolder-style folder")
    p.add_argument("--demo", action="store_true", help="generate a dataset in --demo-dir and use it")
    p.add_argument("--demo-dir", default="/tmp/coordl-hpsearch-demo", help="where --demo puts its dataset")
    p.add_argument("--demo-images", type=int, default=600, help="JPEGs --demo generates")
    p.add_argument("-b", "--batch-size", type=int, default=64)
    p.add_argument("--size", type=int, default=64, help="training crop size")
    p.add_argument("--group", default=group, help="the hp_group the trials share")


def resolve_data(p: argparse.ArgumentParser, args) -> None:
    """Sets ``args.data``, generating the demo dataset first with ``--demo``."""
    if args.demo:
        from coordl.tools.datagen import make_dataset

        args.data = str(Path(args.demo_dir) / "train")
        make_dataset(args.data, num_images=args.demo_images, num_classes=10, progress=False)
    if not args.data or not Path(args.data).is_dir():
        p.error("give a dataset folder or --demo")
