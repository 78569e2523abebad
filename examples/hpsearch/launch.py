"""Launches N trials of a learning-rate sweep as separate processes sharing one ``hp_group``.

Each trial is an ordinary training script (``train.py``) started by its own command, as an
HP-search tool would start it; naming the same group is all they share. With
``--alone`` the same trials run without the group, for comparison.

    python examples/hpsearch/launch.py /path/to/train --lrs 0.4,0.1,0.02,0.005
    python examples/hpsearch/launch.py --demo            # on a generated dataset
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

import common  # noqa: E402 - this folder's module (the script's folder is on sys.path)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_data_args(p, group="lr-sweep")
    p.add_argument("--lrs", default="0.4,0.1,0.02", help="one trial per learning rate")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--alone", action="store_true", help="run the trials without sharing, for comparison")
    args = p.parse_args()
    common.resolve_data(p, args)
    trials = []
    t0 = time.perf_counter()
    together = common.StartTogether()
    try:
        for lr in args.lrs.split(","):
            cmd = [
                sys.executable,
                str(HERE / "train.py"),
                args.data,
                "--lr",
                lr,
                "--epochs",
                str(args.epochs),
                "--batch-size",
                str(args.batch_size),
                "--size",
                str(args.size),
                *together.args(),
            ]
            if not args.alone:
                cmd += ["--hp-group", args.group]
            trials.append(subprocess.Popen(cmd))  # independent processes, as an HP tool starts them
        together.go(trials)
        codes = [t.wait() for t in trials]
    except Exception:
        for t in trials:
            t.send_signal(signal.SIGINT)  # as Ctrl-C does: each trial leaves the group and exits
        raise
    finally:
        together.close()
        # Ctrl-C reaches the trials too (one process group). None outlives this script.
        for t in trials:
            try:
                t.wait(timeout=10)
            except subprocess.TimeoutExpired:
                t.kill()
                t.wait()
    print(
        f"{len(trials)} trials {'alone' if args.alone else f'sharing hp_group {args.group!r}'}: "
        f"{time.perf_counter() - t0:.1f} s, exit codes {codes}"
    )
    return 0 if not any(codes) else 1


if __name__ == "__main__":
    sys.exit(main())
