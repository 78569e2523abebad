"""Every module a test, benchmark or example imports is installed by the README's test command, not by
hand: the next missing requirement is named here before it reaches a user on a fresh machine."""

from __future__ import annotations

import re
import textwrap

from coordl_testing import requirements

ROOT = requirements.ROOT


def test_every_imported_module_comes_from_the_declared_requirements():
    found = requirements.problems()
    assert not found, "\n".join(found)


def test_the_scan_finds_the_baselines_and_the_modules_children_run():
    found = requirements.imports()
    assert {"litdata", "streaming", "ray", "lightning", "obstore", "soundfile", "webdataset"} <= set(found)
    # a module run as a program: coordl_testing/s3server.py starts ["python", "-m", "moto.server", ...]
    assert any(u.file == "coordl_testing/s3server.py" for u in found["moto"]), found["moto"]
    # a child script held as a string: tests/test_lightning.py writes one that imports lightning
    assert any(u.file == "tests/test_lightning.py" for u in found["lightning"]), found["lightning"]
    assert not {"coordl", "coordl_testing", "benchmarks", "childproc", "os", "pip"} & set(found)
    # torchvision is imported by the examples for users who have it, and never required
    assert "torchvision" in found and "torchvision" in requirements.OPTIONAL


def test_a_requirement_removed_from_the_extras_is_named():
    pyproject = (ROOT / "pyproject.toml").read_text()
    baselines = (ROOT / "benchmarks" / "baselines.txt").read_text()
    without_litdata = re.sub(r"(?m)^litdata==.*$", "", baselines)
    found = requirements.problems(baselines=without_litdata)
    assert len(found) == 1 and found[0].startswith("'litdata' (imported at benchmarks/disk_tier_baselines.py:")
    assert "comes from litdata" in found[0], found

    without_ws = pyproject.replace('"webdataset>=0.2", ', "")
    assert without_ws != pyproject
    found = requirements.problems(pyproject=without_ws)
    assert [f.split(" ", 1)[0] for f in found] == ["'webdataset'"] and "comes from webdataset" in found[0], found


def test_imports_behind_import_error_are_optional_and_others_are_not(tmp_path):
    (tmp_path / "tests").mkdir()
    # written with IMPORT for import, so that this file's own scan does not read the fixture as a child script
    source = textwrap.dedent('''
        IMPORT os
        IMPORT numpy
        from helper IMPORT thing  # the folder's own module
        try:
            IMPORT not_installed_optional
        except ImportError:
            IMPORT not_installed_fallback
        SCRIPT = """
        IMPORT not_installed_in_a_child
        """
        CMD = ["python", "-m", "not_installed_server.main"]
        ''')
    (tmp_path / "tests" / "test_x.py").write_text(source.replace("IMPORT", "import"))
    (tmp_path / "tests" / "helper.py").write_text("thing = 1\n")
    found = requirements.imports(tmp_path, folders=("tests",))
    assert set(found) == {"numpy", "not_installed_in_a_child", "not_installed_server"}
    assert [str(u) for u in found["numpy"]] == ["tests/test_x.py:3"]
