"""Launching a scenario's jobs: child processes, jobs started together, a child that reports and waits.

A scenario's child runs the scenario again (``python -m benchmarks NAME --job ...``,
:func:`scenario_command`) and says what it measured as JSON: in a file, or as the last line of its
standard output (:func:`outcome`), or line by line to a parent that answers (:func:`converse`).
"""

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def scenario_command(name: str, *args: str) -> list[str]:
    """The command that runs scenario ``name`` in a child Python (``python -m benchmarks NAME``), which finds the
    ``benchmarks`` package as its parent did: in the working directory (the repository root) or ``PYTHONPATH``."""
    return [sys.executable, "-m", "benchmarks", name, *args]


def flags(**options) -> list[str]:
    """``--name value`` for each option (``batch_size`` as ``--batch-size``): None left out, True a bare flag."""
    out = []
    for name, value in options.items():
        if value is not None and value is not False:
            out += [f"--{name.replace('_', '-')}"] + ([] if value is True else [str(value)])
    return out


def module_command(module: str, *args: str) -> list[str]:
    """The command that runs a helper module of ``benchmarks`` (not a scenario) in a child Python."""
    return [sys.executable, "-m", f"benchmarks.{module}", *args]


def run_json(command: list[str], *, timeout: float | None = None, **kwargs) -> dict:
    """Runs ``command`` to its end; returns the JSON of the last line of its output (:func:`outcome`), or
    raises ``SystemExit`` with the end of its standard error if it failed."""
    if "error" in (said := outcome(command, timeout=timeout, **kwargs)):
        raise SystemExit(f"{' '.join(command[:6])} ... failed: {said['error']}")
    return said


def outcome(command: list[str], *, timeout: float | None = None, out: Path | None = None, **kwargs) -> dict:
    """Runs ``command`` to its end: the JSON it said (the last line of its output, or the file ``out``), or
    when it failed ``{"error", "returncode"}``: its exit status and its last traceback, or that ``timeout`` ran out."""
    try:
        p = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False, **kwargs)
    except subprocess.TimeoutExpired as e:
        said = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else e.stdout or ""
        return {"error": f"still running after {e.timeout:.0f} s; its output ended: {said[-1500:]}", "returncode": None}
    if p.returncode != 0:
        return {"error": f"exit status {p.returncode}: {error_text(p.stderr)}", "returncode": p.returncode}
    return json.loads(Path(out).read_text() if out else p.stdout.strip().splitlines()[-1])


def say(**msg) -> None:
    """In a child: one JSON line for its parent."""
    print(json.dumps(msg), flush=True)


# -- jobs started together ------------------------------------------------------------------
def start_together(commands: list[list[str]], readies: list[Path], go: Path, before_go=None, **popen) -> list:
    """Starts the jobs' ``commands``; once every one has touched its ready file (its loader is made),
    calls ``before_go`` and touches ``go``, which they all wait for (:func:`wait_for_go`)."""
    go.unlink(missing_ok=True)
    procs = [subprocess.Popen(c, **popen) for c in commands]
    while not all(r.exists() for r in readies):
        if any(p.poll() not in (None, 0) for p in procs):
            for p in procs:
                p.kill()
            raise SystemExit("a job failed before starting")
        time.sleep(0.05)
    if before_go is not None:
        before_go()
    go.touch()
    return procs


def start_jobs(commands: list[list[str]], workdir: Path, before_go=None, **popen) -> tuple[list, list[Path]]:
    """Starts ``commands`` (each given ``--out``, ``--ready`` and ``--go``) together, ``before_go``
    called once all are ready; returns the processes and their ``--out`` files."""
    go, n = workdir / "go", len(commands)
    outs, readies = [workdir / f"out{k}.json" for k in range(n)], [workdir / f"ready{k}" for k in range(n)]
    for f in (*outs, *readies):  # none left from a run before
        f.unlink(missing_ok=True)
    full = [[*c, "--out", str(o), "--ready", str(r), "--go", str(go)] for c, o, r in zip(commands, outs, readies)]
    return start_together(full, readies, go, before_go, **popen), outs


def run_together(commands: list[list[str]], workdir: Path, before_go=None, **popen) -> list[dict]:
    """:func:`start_jobs`, then waits for them all; returns what each wrote to its ``--out``."""
    procs, outs = start_jobs(commands, workdir, before_go, **popen)
    if any(p.wait() for p in procs):
        raise SystemExit(f"a job failed: exit codes {[p.returncode for p in procs]}")
    return [json.loads(f.read_text()) for f in outs]


def wait_for_go(ready: str | None, go: str | None) -> None:
    """In a job: says it is ready, then waits for the go file of :func:`start_together`."""
    if not ready:
        return
    Path(ready).touch()
    while not os.path.exists(go):
        time.sleep(0.01)


# -- a child that reports and waits ------------------------------------------------------------
class Parent:
    """A child's side of :func:`converse`: one JSON line out, then wait for the parent's go-ahead
    (it reads its counters and resets them in between)."""

    say = staticmethod(say)

    def wait(self) -> None:
        if sys.stdin.readline().strip() != "go":
            raise SystemExit("the parent went away")


def converse(command: list[str], on_message, **popen) -> tuple[int, str, dict]:
    """Runs a child speaking :class:`Parent`'s side: calls ``on_message(event, msg)`` for each JSON line
    it says (other lines are a library's chatter) until its ``done``, answering ``go`` after each.
    Returns its exit status, its standard error and its ``done`` message."""
    errors = tempfile.TemporaryFile("w+")  # a file, not a pipe: a child's long stderr never blocks it
    proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=errors, text=True, **popen)
    done = {}
    try:
        while line := proc.stdout.readline():
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            event = msg.pop("event")
            if event == "done":
                done = msg
                break
            on_message(event, msg)
            proc.stdin.write("go\n")
            proc.stdin.flush()
        proc.stdin.close()
        proc.wait(120)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    finally:
        errors.seek(0)
        err = errors.read()
        errors.close()
    return proc.returncode, err, done


def error_text(stderr: str) -> str:
    """The part of a child's stderr that says what failed (its last traceback, else its tail)."""
    at = stderr.rfind("Traceback (most recent call last)")
    return (stderr[at:] if at >= 0 else stderr).strip()[-3000:]
