"""What ``pip install coordl`` installs: the package, and none of the repository's test support.

The wheel is built the way pip builds it for an install, offline (``--no-index``, with the
setuptools installed here: ``--no-build-isolation``), from a copy of the repository, since pip
leaves ``build/`` and an ``.egg-info`` in the tree it builds from.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "coordl"
# The repository's folders that are not the package: fixtures, tests, benchmarks, examples, docs.
OUTSIDE = ["coordl_testing", "tests", "benchmarks", "examples", "docs"]
FIXTURES = ["s3server.py", "netns.py"]
# What a copy of the repository leaves out: version control, caches and earlier build outputs.
NOT_COPIED = shutil.ignore_patterns(
    ".git", "build", "dist", "*.egg-info", "__pycache__", ".*cache", ".hypothesis", ".benchmarks", ".venv"
)


@pytest.fixture(scope="module")
def wheel_files(tmp_path_factory) -> list[str]:
    """The paths of the files in the wheel built from this repository."""
    pytest.importorskip("setuptools", minversion="77", reason="building the wheel offline needs setuptools>=77")
    tmp = tmp_path_factory.mktemp("wheel")
    repo, out = tmp / "repo", tmp / "out"
    shutil.copytree(ROOT, repo, ignore=NOT_COPIED)
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q"]
    done = subprocess.run([*cmd, "-w", str(out), str(repo)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"pip wheel failed:\n{done.stdout}\n{done.stderr}"
    (wheel,) = out.glob(f"{PACKAGE}-*.whl")
    with zipfile.ZipFile(wheel) as z:
        return z.namelist()


def test_the_wheel_holds_the_package_and_its_metadata_only(wheel_files):
    tops = {name.split("/")[0] for name in wheel_files}
    assert PACKAGE in tops, f"the wheel has no {PACKAGE}/: {sorted(tops)}"
    others = sorted(t for t in tops if t != PACKAGE and not (t.startswith(f"{PACKAGE}-") and t.endswith(".dist-info")))
    assert not others, f"the wheel installs more than the package: {others}"
    # The whole package, so that the checks below look at a real wheel.
    sources = sorted(p.relative_to(ROOT / "src").as_posix() for p in (ROOT / "src" / PACKAGE).rglob("*.py"))
    assert not set(sources) - set(wheel_files), sorted(set(sources) - set(wheel_files))


def test_the_wheel_holds_no_test_support(wheel_files):
    outside = [n for n in wheel_files if n.split("/")[0] in OUTSIDE or "coordl_testing" in n.split("/")]
    assert not outside, f"the wheel carries the repository's test support, tests or benchmarks: {outside}"
    fixtures = [n for n in wheel_files if n.rpartition("/")[2] in FIXTURES]
    assert not fixtures, f"the wheel carries test fixtures (they belong in coordl_testing/): {fixtures}"


def test_the_version_is_written_once_and_the_wheel_carries_it(wheel_files):
    import coordl

    assert coordl.__version__ == "0.2.0"
    assert f"{PACKAGE}-{coordl.__version__}.dist-info/METADATA" in wheel_files
    project = (ROOT / "pyproject.toml").read_text()
    assert 'dynamic = ["version"]' in project and coordl.__version__ not in project
