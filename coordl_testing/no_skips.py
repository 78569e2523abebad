"""A pytest plugin: with ``COORDL_NO_SKIPS=1`` (as ``.ci/run`` sets it), a skipped test fails unless it
is marked ``gpu``.

CI's machine can run every test but the GPU's (it is root, with cgroups, tmpfs mounts, network
namespaces and every test dependency); a test that skips there hides the guarantee it checks.
The failure keeps the skip's reason.
"""

from __future__ import annotations

import os

import pytest


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if os.environ.get("COORDL_NO_SKIPS") != "1" or not report.skipped or hasattr(report, "wasxfail"):
        return
    if item.get_closest_marker("gpu") is not None:
        return
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    report.outcome = "failed"
    report.longrepr = f"skipped, and COORDL_NO_SKIPS=1 lets only tests marked gpu skip: {reason}"
