"""A user's script reading ``s3://`` under ``python -X dev``, and how it ends: its exit status,
its stderr (warnings, ResourceWarnings, "Task was destroyed", tracebacks), the threads still
running when the interpreter starts to finalize, and what it leaves in ``/dev/shm``.

``tests/test_s3.py`` runs it twice; run it many times in a row, as issue 47 asks (20), with::

    python tests/s3_exits.py --runs 20

which starts its own S3 server (``coordl_testing.s3server``) and dataset, alternates the endings
(``close()`` then ``sys.exit(0)``; ``break`` with GETs hung at the store, then ``sys.exit(3)``
without ``close()``) and prints one line a run, then how many were clean.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

EXIT_SCRIPT = """
import atexit, sys, threading
# Registered first, so it runs last: what still runs when the interpreter starts to finalize.
atexit.register(lambda: print("threads at the end:", [t.name for t in threading.enumerate()][1:], flush=True))
import coordl
loader = coordl.CoordLoader(sys.argv[1], batch_size=8, shuffle=False, device_id=None,
                            pipeline=coordl.ImageNetTrain(size=16), cache=0.5, prep=1)
for k, _ in enumerate(loader):
    if sys.argv[2] == "leave":
        break  # with the GETs of later batches in flight (hung), and without close()
if sys.argv[2] == "close":
    loader.close()
sys.exit(int(sys.argv[3]))
"""

HUNG = range(24, 48)  # batches 3-5 (of 8 samples, in order): in flight when "leave" leaves after batch 0


def run_exit_script(root: str, how: str, status: int, env: dict | None = None) -> subprocess.CompletedProcess:
    """Runs :data:`EXIT_SCRIPT` over ``root`` under ``python -X dev`` (warnings shown, asyncio's
    debug mode), as a user would; ``how`` is ``"close"`` or ``"leave"``."""
    full = dict(os.environ, **(env or {}))
    full["PYTHONPATH"] = os.pathsep.join([str(HERE.parent / "src"), full.get("PYTHONPATH", "")])
    args = [sys.executable, "-X", "dev", "-c", EXIT_SCRIPT, root, how, str(status)]
    return subprocess.run(args, env=full, capture_output=True, text=True, timeout=120, check=False)


def clean(proc: subprocess.CompletedProcess, status: int, shm: str) -> list[str]:
    """What was wrong with a run's ending (empty: it ended cleanly)."""
    wrong = []
    if proc.returncode != status:
        wrong.append(f"exit status {proc.returncode}, not {status}")
    if proc.stderr:
        wrong.append(f"stderr: {proc.stderr[-2000:]!r}")
    if not proc.stdout.endswith("threads at the end: []\n"):
        wrong.append(f"stdout ends: {proc.stdout[-300:]!r}")
    if os.listdir(shm):
        wrong.append(f"left in {shm}: {sorted(os.listdir(shm))}")
    return wrong


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=20)
    runs = parser.parse_args().runs
    sys.path.insert(0, str(HERE))
    sys.path.insert(0, str(HERE.parent))
    from conftest import make_tree
    from coordl_testing.s3server import S3Server

    tmp = Path(tempfile.mkdtemp(prefix="coordl-s3-exits-"))
    shm = tempfile.mkdtemp(prefix="coordl-s3-exits-", dir="/dev/shm")
    try:
        tree = make_tree(tmp / "train", classes=4, per_class=30)
        with S3Server() as server:
            server.create_bucket("coordl-exits")
            server.upload_tree(tree, "coordl-exits", "close/train")
            keys = server.upload_tree(tree, "coordl-exits", "leave/train")
            for i in HUNG:  # every run that leaves (the rules stay)
                server.hang(keys[i], 60.0, times=1000)
            env = dict(server.env(), COORDL_SHM_DIR=shm, COORDL_INDEX_DIR=str(tmp / "index"))
            bad = 0
            for k in range(runs):
                how, status = [("close", 0), ("leave", 3)][k % 2]
                t0 = time.monotonic()
                proc = run_exit_script(f"s3://coordl-exits/{how}/train", how, status, env)
                wrong = clean(proc, status, shm)
                bad += bool(wrong)
                print(
                    f"run {k + 1:2d} {how:5s} status {proc.returncode} {time.monotonic() - t0:5.1f} s",
                    *wrong or ["clean"],
                )
                shutil.rmtree(shm, ignore_errors=True)
                os.makedirs(shm, mode=0o700, exist_ok=True)
            print(f"{runs - bad} of {runs} runs ended cleanly")
            return 1 if bad else 0
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
