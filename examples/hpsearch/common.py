"""What ``launch.py`` and ``halving.py`` share: the dataset (a folder, or ``--demo``) and the
options every trial gets."""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
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


class StartTogether:
    """Lets the first trials begin their first epoch together: each trial, once its loader and
    model are made, says it is ready and waits for the go. Trials start in seconds (imports) and
    an epoch of the demo takes a fraction of one, so without this the first trial could train its
    whole run before the others join the group."""

    def __init__(self):
        self.dir = Path(tempfile.mkdtemp(prefix="coordl-hpsearch-start-"))

    def args(self) -> list[str]:
        """The arguments that make a trial wait for the go."""
        return ["--start-together", str(self.dir)]

    def go(self, trials: list, timeout: float = 120.0) -> None:
        """Waits until every one of ``trials`` (processes) is ready, or has ended, then says go."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ready = len(list(self.dir.glob("ready.*")))
            if ready + sum(t.poll() is not None for t in trials) >= len(trials):
                break
            time.sleep(0.02)
        (self.dir / "go").touch()

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


def wait_for_go(folder: str | None, timeout: float = 120.0) -> None:
    """In a trial: says it is ready and waits for :meth:`StartTogether.go` (no folder: no wait)."""
    if not folder:
        return
    import os

    Path(folder, f"ready.{os.getpid()}").touch()
    deadline = time.monotonic() + timeout
    while not Path(folder, "go").exists() and time.monotonic() < deadline:
        time.sleep(0.01)
