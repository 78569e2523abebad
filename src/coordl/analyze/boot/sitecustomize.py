"""Run by Python when an interpreter of a command that ``coordl analyze`` runs starts (this folder
is first on the command's ``PYTHONPATH``): installs DS-Analyzer's probe
(:func:`coordl.analyze.probe.install`), then runs the ``sitecustomize`` this one shadows, if any."""

import importlib.util
import os
import sys


def _run_shadowed() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    for entry in sys.path:
        folder = os.path.abspath(entry or os.curdir)
        path = os.path.join(folder, "sitecustomize.py")
        if folder != here and os.path.isfile(path):
            spec = importlib.util.spec_from_file_location("_coordl_shadowed_sitecustomize", path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return


if os.environ.get("COORDL_ANALYZE"):
    from coordl.analyze import probe

    probe.install()
_run_shadowed()
