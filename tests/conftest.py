"""Fixtures: tiny real JPEG datasets, an isolated shm directory, a leak check, small cache layouts and
memory limits.

Every test runs with ``COORDL_SHM_DIR`` pointing at a fresh folder on /dev/shm (a
real tmpfs) and ``COORDL_INDEX_DIR`` at a temp folder, so tests never see each
other's segments. A test that leaves coordl segments, coordl threads or child
processes behind fails.
"""

from __future__ import annotations

import io
import multiprocessing
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from coordl.lifecycle import WATCH_THREAD  # resends a SIGTERM to the main thread: one for the process's life
from coordl.threads import LOOP_THREAD  # the process's event loop: one for its life, not a leak

ONE_PER_PROCESS = (LOOP_THREAD, WATCH_THREAD)  # coordl threads that live as long as the process

SHARED = Path(__file__).resolve().parents[2] / "shared"
pytest_plugins = ["coordl_testing.no_skips"]  # COORDL_NO_SKIPS=1 (.ci/run): a skip other than a GPU test's fails


def write_jpeg(path: Path, rng: np.random.Generator, size=(48, 40), quality=90) -> None:
    """A small smooth-ish JPEG (a colour gradient plus noise) that decodes quickly."""
    w, h = size
    yy, xx = np.mgrid[0:h, 0:w]
    base = rng.integers(0, 256, 3)
    img = base + 60 * np.sin(xx[..., None] / (3 + rng.random() * 5) + rng.random(3) * 6) + rng.normal(0, 12, (h, w, 3))
    buf = io.BytesIO()
    Image.fromarray(np.clip(img, 0, 255).astype(np.uint8)).save(buf, format="JPEG", quality=quality)
    path.write_bytes(buf.getvalue())


def make_tree(root: Path, classes: int, per_class: int, seed: int = 0, varied: bool = True) -> Path:
    """An ImageFolder tree ``root/class_k/img_i.jpg`` of real JPEGs with varied sizes."""
    rng = np.random.default_rng(seed)
    for c in range(classes):
        d = root / f"class_{c:02d}"
        d.mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            size = (int(rng.integers(32, 80)), int(rng.integers(32, 80))) if varied else (48, 40)
            write_jpeg(d / f"img_{i:04d}.jpg", rng, size=size)
    return root


def remove_cgroup(path: Path) -> None:
    """Removes a cgroup folder once its processes have left (their exit can lag their wait)."""
    deadline = time.monotonic() + 10
    while path.exists():
        try:
            path.rmdir()
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


@pytest.fixture
def procs():
    """Starts spawned processes (``procs(target, *args)``); every one is killed if still
    alive and joined at teardown."""
    started = []

    def start(target, *args):
        p = multiprocessing.get_context("spawn").Process(target=target, args=args, daemon=True)
        p.start()
        started.append(p)
        return p

    yield start
    for p in started:
        if p.is_alive():
            p.kill()
        p.join(10)


@pytest.fixture
def cache_layout(monkeypatch):
    """``cache_layout(chunk_bytes, slice_bytes=None)``: the caches this test creates from then on are cut
    into chunks (and reserved in slices) of these sizes, small so that a few items span chunks.

    The sizes are :mod:`coordl.fetch.cache`'s constants, recorded in a cache's header when it is
    created (a process that attaches follows the header); undone at teardown. A spawned child,
    which this does not reach, sets the constants itself before it creates a cache.
    """
    from coordl.fetch import cache

    def set_layout(chunk_bytes: int, slice_bytes: int | None = None) -> None:
        monkeypatch.setattr(cache, "DEFAULT_CHUNK_BYTES", chunk_bytes)
        if slice_bytes is not None:
            monkeypatch.setattr(cache, "DEFAULT_SLICE_BYTES", slice_bytes)

    return set_layout


@pytest.fixture
def memory_limit(monkeypatch):
    """``memory_limit(level)``: the tightest memory limit coordl reads (:func:`coordl.shm.limits.tightest`)
    is ``level`` from then on, a :class:`~coordl.shm.limits.Level`, None (no limit), or a callable
    that returns one each time it is asked (a limit that changes as the cache fills)."""
    from coordl.shm import limits

    def set_limit(level) -> None:
        monkeypatch.setattr(limits, "tightest", level if callable(level) else (lambda root="/": level))

    return set_limit


@pytest.fixture(scope="session")
def tiny_dataset(tmp_path_factory) -> Path:
    """120 JPEGs in 4 classes; read-only for tests (copy it to modify)."""
    return make_tree(tmp_path_factory.mktemp("tiny") / "train", classes=4, per_class=30)


@pytest.fixture
def dataset_copy(tiny_dataset, tmp_path) -> Path:
    """A private copy of the tiny dataset that a test may change."""
    dst = tmp_path / "train"
    shutil.copytree(tiny_dataset, dst)
    return dst


@pytest.fixture(autouse=True)
def isolated(monkeypatch, tmp_path):
    """A private shm folder and index folder per test; fails the test on leaks."""
    shm = Path(tempfile.mkdtemp(prefix="coordl-test-", dir="/dev/shm"))
    monkeypatch.setenv("COORDL_SHM_DIR", str(shm))
    monkeypatch.setenv("COORDL_INDEX_DIR", str(tmp_path / "index"))
    threads_before = {t.ident for t in threading.enumerate()}
    yield shm
    leaks = []
    deadline = time.monotonic() + 5
    while True:
        left = sorted(os.listdir(shm))
        threads = [
            t.name
            for t in threading.enumerate()
            if t.ident not in threads_before and t.name.startswith("coordl") and t.name not in ONE_PER_PROCESS
        ]
        children = multiprocessing.active_children()
        if not (left or threads or children) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    if left:
        leaks.append(f"shm segments left: {left}")
    if threads:
        leaks.append(f"threads left: {threads}")
    if children:
        leaks.append(f"child processes left: {children}")
        for p in children:
            p.kill()
    shutil.rmtree(shm, ignore_errors=True)
    if leaks:
        pytest.fail("; ".join(leaks))


@pytest.fixture(scope="session")
def s3_server():
    """The session's S3-compatible server on localhost, for every test that reads ``s3://`` in this
    process: coordl resolves the store's endpoint once per process (``coordl.s3.client.settings``),
    so a second server started by another module would never be asked. Each module makes a bucket
    of its own."""
    pytest.importorskip("moto")
    pytest.importorskip("obstore")
    pytest.importorskip("boto3")
    from coordl_testing.s3server import S3Server

    with S3Server() as s:
        yield s


_s3_prefixes = [0]


@pytest.fixture
def s3_tree(s3_server, monkeypatch):
    """``s3_tree(bucket, tree)``: a fresh prefix of ``bucket`` (made by the module) holding the files of
    ``tree``, as ``s3://<bucket>/p<k>/train``, with this process talking to the session's server and
    its request counts reset."""

    def upload(bucket: str, tree: Path) -> str:
        for k, v in s3_server.env().items():
            monkeypatch.setenv(k, v)
        _s3_prefixes[0] += 1
        prefix = f"p{_s3_prefixes[0]}/train"
        s3_server.upload_tree(tree, bucket, prefix)
        s3_server.reset()
        return f"s3://{bucket}/{prefix}"

    return upload


@pytest.fixture(scope="session")
def python_for_other_users():
    """Checks, once, that another local user can run this Python with coordl and numpy (tests that run a
    child as another uid need it), and fails with what to change otherwise: a virtual environment or a
    checkout in a folder only its owner may enter (``mktemp -d`` makes one, mode 0700)."""
    import subprocess
    import sys

    code = "import numpy, coordl"
    cmd = ["setpriv", "--reuid=23456", "--regid=23456", "--clear-groups", sys.executable, "-c", code]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    if p.returncode != 0:
        pytest.fail(
            f"another user cannot run {sys.executable} with coordl: these tests run children as another uid, so "
            f"the Python, its packages and the repository must be readable by others (mode 0755 on every folder "
            f"above them):\n{p.stderr[-2000:]}"
        )
