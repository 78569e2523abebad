"""The environment variables coordl reads, parsed one way: an empty value is an unset one, and a
value that does not parse is a ``ValueError`` naming the variable.

Every variable is listed in ``docs/configuration.md``; this module is the only reader of
``os.environ`` outside ``shm/`` (which imports nothing from coordl) and the launchers of
``coordl analyze``.
"""

from __future__ import annotations

import os

__all__ = ["flag", "integer", "number", "text"]


def text(name: str, default: str | None = None) -> str | None:
    """The variable's value, or ``default`` when it is unset or empty."""
    value = os.environ.get(name, "")
    return value if value != "" else default


def flag(name: str) -> bool:
    """Whether the variable is on: set to anything but empty or ``0``."""
    return text(name, "0") != "0"


def integer(name: str, default: int, *, minimum: int | None = None) -> int:
    """The variable as an int (``default`` when unset), at least ``minimum`` when given.

    Raises:
        ValueError: it is not an integer, or it is below ``minimum``.
    """
    raw = text(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer") from None
    if minimum is not None and value < minimum:
        raise ValueError(f"environment variable {name}={raw!r} must be at least {minimum}")
    return value


def number(name: str, default: float) -> float:
    """The variable as a positive float (``default`` when unset).

    Raises:
        ValueError: it is not a positive number.
    """
    raw = text(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = None
    if value is None or not value > 0 or value == float("inf"):
        raise ValueError(f"environment variable {name}={raw!r} must be a positive number")
    return value
