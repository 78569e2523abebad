"""Running a function in a spawned child and getting its result, or its traceback, back."""

import traceback

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
