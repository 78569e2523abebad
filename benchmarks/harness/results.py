"""The one shape of every result file (``FIELDS``): what ran, where, from which commit, and what it measured.

``command`` is the line that reproduces it (``python -m benchmarks NAME ...``), ``machine`` the cores, memory,
kernel and library versions and the load (``MACHINE``), ``options`` every option's value, ``dataset`` the figures
of what was read (or None), ``results`` the scenario's own figures.
"""

import datetime
import json
import os
import platform
import subprocess
from importlib import metadata
from pathlib import Path

SCHEMA = 1
FIELDS = ("schema", "scenario", "command", "date", "commit", "machine", "options", "dataset", "results")
MACHINE = ("cores", "cpu_model", "memory_bytes", "kernel", "python", "versions", "load")


def machine() -> dict:
    """This machine: cores, CPU model, memory, kernel, Python, the libraries' versions, the load."""
    mem = int(Path("/proc/meminfo").read_text().split("\n")[0].split()[1]) * 1024
    model = (ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines() if "model name" in ln)
    versions = {}
    for dist in ("coordl", "numpy", "torch", "nvidia-dali-cuda120", "nvidia-dali-cuda110", "nvidia-dali-cuda130"):
        try:
            versions[dist.split("-cuda")[0]] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    values = (os.cpu_count(), next(model, ""), mem, platform.release(), platform.python_version(), versions)
    return dict(zip(MACHINE, (*values, os.getloadavg()), strict=True))  # in the order MACHINE declares


def commit() -> str:
    """The checkout's commit, ``+dirty`` when its tracked files differ from it; ``""`` outside git."""
    where = ["git", "-C", str(Path(__file__).parent)]
    try:
        head = subprocess.run([*where, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run([*where, "status", "--porcelain", "-uno"], capture_output=True, text=True).stdout
    except OSError:
        return ""
    return head + ("+dirty" if head and dirty.strip() else "")


def envelope(scenario: str, argv: list[str], options: dict, dataset: dict | None, results: dict) -> dict:
    """A result in the schema."""
    command = " ".join(["python -m benchmarks", scenario, *argv])
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    values = (SCHEMA, scenario, command, date, commit(), machine(), options, dataset, results)
    return dict(zip(FIELDS, values, strict=True))  # in the order FIELDS declares


def write(path: str | Path, result: dict) -> Path:
    """Writes a result (checked against the schema) as JSON."""
    check(result)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1, default=str) + "\n")
    return path


def check(result: dict) -> dict:
    """Raises ``ValueError`` naming what a result lacks of the schema; returns it."""
    got, schema = result.get("machine") or {}, result.get("schema")
    missing = [k for k in FIELDS if k not in result] + [f"machine.{k}" for k in MACHINE if k not in got]
    if missing or schema != SCHEMA:
        raise ValueError(f"not a result of schema {SCHEMA}: missing {missing or 'nothing'}, schema {schema}")
    return result


def load(path: str | Path) -> dict:
    """A result file, checked against the schema."""
    return check(json.loads(Path(path).read_text()))
