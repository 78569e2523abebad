"""Child processes in tests: a function's result (or its traceback) from a spawned child, and
the processes a process group left."""

import os
import traceback
from pathlib import Path

WAIT = 30


def report(q, fn, *args) -> None:
    """Runs ``fn`` in a child and hands its result (or its traceback) to the parent."""
    try:
        q.put(("ok", fn(*args)))
    except BaseException:  # noqa: BLE001 - reported to the parent
        q.put(("error", traceback.format_exc()))


def result(q, timeout: float = WAIT):
    """The child's result; fails the test with the child's traceback if it raised."""
    status, value = q.get(timeout=timeout)
    assert status == "ok", f"child process failed:\n{value}"
    return value


def group_members(pgid: int) -> list[str]:
    """Live (not zombie) processes of the process group ``pgid``, as 'pid cmdline'."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[2]) == pgid and fields[0] != "Z":
            found.append(f"{entry} {cmd.strip()[:120]}")
    return found
