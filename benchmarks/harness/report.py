"""Tables in Markdown and plots (when matplotlib is installed) of a scenario's results."""

import sys

from coordl.units import format_bytes


def log(*a, end: str = "\n") -> None:
    """Progress, on standard error (standard output carries a child's JSON, or the tables)."""
    print(*a, file=sys.stderr, flush=True, end=end)


def table(headers: list[str] | str, rows: list[list]) -> str:
    """A Markdown table (``headers`` a list, or one string split at ``|``); ``None`` cells print as ``-``,
    floats with up to 3 significant decimals."""
    headers = headers.split("|") if isinstance(headers, str) else headers
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def cell(x, digits: int = 1) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{digits}f}" if abs(x) >= 10 else f"{x:.3g}"
    return str(x)


def mb(n: float | None, digits: int = 1) -> str:
    """A cell of a table column headed in MB; ``-`` for no value."""
    return "-" if n is None else format_bytes(n, "MB", digits=digits, with_unit=False)


def plot(path, draw) -> str | None:
    """Calls ``draw(plt)`` and saves the figure to ``path``; returns why not (no matplotlib) or None."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        why = "no plot: matplotlib is not installed (pip install -e '.[bench]')"
        print(why, file=sys.stderr)
        return why
    fig = draw(plt)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def spread(d: dict | None, fmt: str = "{:.0f}", rng: bool = False, scale: float = 1.0) -> str:
    """A cell of a :func:`benchmarks.harness.measure.spread`: its median (over ``scale``), and with ``rng``
    ``[min-max]`` when they differ; ``-`` for none."""
    if d is None:
        return "-"
    lo, med, hi = (fmt.format(d[k] / scale) for k in ("min", "median", "max"))
    return f"{med} [{lo}-{hi}]" if rng and lo != hi else med
