"""What .ci/run relies on: the README's test command, and COORDL_NO_SKIPS=1 failing every skip but a GPU test's."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SKIPPING = """
import pytest

def test_runs():
    pass

def test_skips_inside():
    pytest.skip("no tmpfs here")

@pytest.mark.skipif(True, reason="no cgroup here")
def test_skips_by_mark():
    pass

@pytest.mark.gpu
@pytest.mark.skipif(True, reason="needs an NVIDIA GPU")
def test_needs_a_gpu():
    pass
"""


def run_pytest(tmp_path, no_skips: bool) -> subprocess.CompletedProcess:
    (tmp_path / "test_skipping.py").write_text(SKIPPING)
    env = {k: v for k, v in os.environ.items() if k != "COORDL_NO_SKIPS"}
    if no_skips:
        env["COORDL_NO_SKIPS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "pytest", "-q", "-ra", "-p", "no:cacheprovider", "-p", "coordl_testing.no_skips"]
    cmd += ["-o", "markers=gpu", "test_skipping.py"]
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


def test_without_the_variable_skips_are_skips(tmp_path):
    done = run_pytest(tmp_path, no_skips=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert re.search(r"1 passed, 3 skipped", done.stdout), done.stdout


def test_no_skips_fails_every_skip_but_a_gpu_tests_and_keeps_the_reason(tmp_path):
    done = run_pytest(tmp_path, no_skips=True)
    assert done.returncode == 1, done.stdout + done.stderr
    out = done.stdout
    assert "FAILED test_skipping.py::test_skips_inside" in out
    assert "ERROR test_skipping.py::test_skips_by_mark" in out  # a skipif mark skips in setup
    assert "no tmpfs here" in out and "no cgroup here" in out
    assert re.search(r"SKIPPED \[1\] test_skipping.py:\d+: needs an NVIDIA GPU", out)  # the one skip left
    assert re.search(r"1 failed, 1 passed, 1 skipped, 1 error", out), out


def _readme_commands() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"## Quick start.*?```bash\n(.*?)```", readme, re.S).group(1)
    return [line for line in block.splitlines() if line and not line.startswith("#")]


def test_ci_runs_the_readmes_commands_in_a_fresh_environment_with_no_skips():
    demo, tests = _readme_commands()
    ci = (ROOT / ".ci" / "run").read_text()
    lines = [line for line in ci.splitlines() if line and not line.lstrip().startswith("#")]
    # a virtual environment of its own, outside the repository, removed at the end, before any install
    venv = next(k for k, line in enumerate(lines) if re.match(r'python3? -m venv "\$VENV"$', line))
    assert any(re.match(r'VENV=\$\(mktemp -d "\$\{TMPDIR:-/tmp\}/', line) for line in lines[:venv]), ci
    assert any(line.startswith("trap 'rm -rf \"$VENV\"' EXIT") for line in lines[:venv]), ci
    assert lines[venv + 1] == 'source "$VENV/bin/activate"', ci
    assert not any("pip install" in line for line in lines[:venv]), "CI installs into the machine's own Python"

    # the README's commands, word for word but for pip's --quiet and the demo's smaller set
    def quiet(command: str) -> str:
        return command.replace("pip install ", "pip install --quiet ")

    assert quiet(demo) + " --images 200 --quiet" in lines, (demo, ci)
    installs, _, pytest_command = tests.rpartition(" && ")
    assert pytest_command == "python -m pytest -q"
    assert quiet(installs) in lines, (installs, ci)
    assert lines[-1] == f"COORDL_NO_SKIPS=1 {pytest_command}", "CI must run the README's tests last, no skips"
