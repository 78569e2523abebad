"""Byte sizes: parsing what users write and formatting what coordl prints.

Users write sizes as ``"40GB"`` (decimal: 10**9), ``"512MiB"`` (binary: 2**20; ``"512M"``
means the same), plain bytes (``1_000_000``) or, where a dataset gives the whole, a fraction
of it (``0.5``). coordl prints them in decimal units, ``"12.3 MB"``, unless a table's header
already names the unit. Pure: no state, no imports from the rest of coordl.
"""

from __future__ import annotations

import math

__all__ = ["format_bytes", "parse_bytes"]

_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "k": 2**10,
    "m": 2**20,
    "g": 2**30,
    "t": 2**40,
}
_DECIMAL = ("B", "KB", "MB", "GB", "TB")  # what format_bytes picks from without a unit


def parse_bytes(value, dataset_bytes: int | None = None) -> int:
    """Parses ``"40GB"``, ``"512MiB"``, ``1_000_000`` or a fraction like ``0.5`` into bytes.

    Args:
        value: an ``int`` of bytes; a string of a number and a unit (``B``, ``KB``, ``MB``,
            ``GB``, ``TB`` decimal; ``KiB`` ... ``TiB`` or ``K`` ... ``T`` binary; any case,
            spaces and ``_`` ignored; no unit: bytes); or a ``float`` in [0, 1], a fraction of
            ``dataset_bytes``.
        dataset_bytes: the whole a float fraction is taken of; without it a float is refused.

    Returns:
        The size in bytes, rounded down.

    Raises:
        TypeError: for a bool or a type that is none of the above.
        ValueError: for a negative size, a fraction outside [0, 1] or without ``dataset_bytes``,
            a percentage, or a string that is not a number and a known unit.
    """
    if isinstance(value, bool):
        raise TypeError("a byte size must be an int, a float fraction or a string, not a bool")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"a byte size cannot be negative, got {value}")
        return value
    if isinstance(value, float):
        if dataset_bytes is None or not 0.0 <= value <= 1.0:
            raise ValueError(f"a float byte size is a fraction of the dataset in [0, 1], got {value}")
        return int(value * dataset_bytes)
    if isinstance(value, str):
        text = value.strip().lower().replace("_", "").replace(" ", "")
        num = text.rstrip("abcdefghijklmnopqrstuvwxyz")
        unit = text[len(num) :] or "b"
        if unit.endswith("%") or num.endswith("%"):
            raise ValueError(f"write a fraction as a float (0.5), not {value!r}")
        expected = f"cannot parse byte size {value!r}; expected e.g. '40GB', '512MiB' or 1000000"
        if unit not in _UNITS or not num:
            raise ValueError(expected)
        if not text[len(num) :] and "." in num:
            raise ValueError(
                f"{value!r} has no unit; write a fraction of the dataset as a float (0.5), "
                "or bytes with a unit ('0.5GB')"
            )
        try:
            number = float(num)
        except ValueError:
            raise ValueError(expected) from None
        if number < 0 or math.isnan(number):
            raise ValueError(f"a byte size cannot be negative, got {value!r}")
        return int(number * _UNITS[unit])
    raise TypeError(f"a byte size must be an int, a float fraction or a string, got {type(value).__name__}")


def format_bytes(n: float, unit: str | None = None, *, digits: int = 1, with_unit: bool = True) -> str:
    """``n`` bytes for people: ``"12.3 MB"``.

    Args:
        n: bytes.
        unit: the unit to write ``n`` in (any unit :func:`parse_bytes` reads, written as given:
            ``"MB"``, ``"KB"``, ``"MiB"``...); by default the largest decimal unit ``n`` reaches,
            from ``B`` (whole bytes) to ``TB``.
        digits: decimals after the point (a default unit of ``B`` has none).
        with_unit: ``False`` leaves the unit out (``"12.3"``), for a table whose header names it.
    """
    if unit is None:
        unit = next((u for u in _DECIMAL if abs(n) < 1000 * _UNITS[u.lower()]), _DECIMAL[-1])
        digits = 0 if unit == "B" else digits
    scale = _UNITS[unit.lower()]  # KeyError: not a unit (a mistake in coordl's own call)
    text = f"{n / scale:.{digits}f}"
    return f"{text} {unit}" if with_unit else text
