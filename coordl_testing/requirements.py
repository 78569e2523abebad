"""Every module the tests, benchmarks and examples import is provided by what the README's test command
installs: the ``test`` extra (with the core requirements and the extras it names) and
``benchmarks/baselines.txt``.

A package installed by hand on a developer's machine or in CI's environment would otherwise stand in for
a missing requirement: the suite passes there and fails for the next user on a fresh machine
(``No module named 'litdata'``). :func:`problems` reads the imports of every ``.py`` file under the
scanned folders (and of the child scripts the tests hold as strings, and ``python -m X`` commands), maps
each module to the distributions that provide it (``importlib.metadata.packages_distributions``), and
names every module that no declared requirement provides, directly or as a requirement of one.

Not required: the standard library, the repository's own modules, imports inside a ``try`` whose
``except`` catches ``ImportError`` (optional by construction), and :data:`OPTIONAL`.
"""

from __future__ import annotations

import ast
import importlib.metadata as md
import re
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

from packaging.markers import Marker
from packaging.requirements import Requirement

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the test extra installs tomli there
    import tomli as tomllib

__all__ = ["OPTIONAL", "SCANNED", "Use", "declared", "imports", "problems", "provided"]

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("tests", "benchmarks", "coordl_testing", "examples")

#: Modules a script may use when the user has them, never installed for the tests, with why.
OPTIONAL = {
    "torchvision": "the user's own: PyPI's build requires a newer torch and fails against the CPU build; "
    "examples and benchmarks check for it and say so",
}

#: Modules that are not third-party packages: with every virtual environment, or made by a test.
NOT_PACKAGES = {
    "pip": "in every virtual environment (ensurepip)",
    "pkg": "a package tests/test_architecture.py writes into a temporary folder",
}

_IMPORT_ERRORS = {"ImportError", "ModuleNotFoundError"}


@dataclass(frozen=True)
class Use:
    """Where a module is imported: a file (relative to the root) and a line."""

    module: str
    file: str
    line: int

    def __str__(self) -> str:
        return f"{self.file}:{self.line}"


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


# -- imports: the source in, top-level module names out ---------------------------------------------
def _optional_lines(tree: ast.AST) -> set[int]:
    """Lines inside a ``try`` whose handlers catch ``ImportError`` (or all exceptions), and inside those
    handlers (a fallback, such as ``tomli`` where ``tomllib`` is missing)."""
    lines: set[int] = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Try):
            continue
        caught = set()
        for h in node.handlers:
            if h.type is None:
                caught.add("ImportError")
            for t in h.type.elts if isinstance(h.type, ast.Tuple) else [h.type] if h.type is not None else []:
                if isinstance(t, ast.Name):
                    caught.add(t.id)
                elif isinstance(t, ast.Attribute):
                    caught.add(t.attr)
        if caught & (_IMPORT_ERRORS | {"Exception", "BaseException"}):
            for stmt in [*node.body, *(s for h in node.handlers for s in h.body)]:
                lines.update(range(stmt.lineno, (stmt.end_lineno or stmt.lineno) + 1))
    return lines


def _modules(tree: ast.AST) -> list[tuple[str, int]]:
    """``(top-level module, line)`` of every required import in ``tree``, embedded scripts included."""
    optional = _optional_lines(tree)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import) and node.lineno not in optional:
            out += [(a.name.split(".")[0], node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and node.lineno not in optional:
            out.append((node.module.split(".")[0], node.lineno))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and "import " in node.value:
            # a child script held as a string (tests run them with python -c or write them to a file)
            try:
                inner = ast.parse(textwrap.dedent(node.value))
            except (SyntaxError, ValueError):
                continue
            out += [(m, node.lineno) for m, _ in _modules(inner)]
        elif isinstance(node, ast.List | ast.Tuple):
            # ["python", "-m", "moto.server", ...]: a module run as a program
            for a, b in zip(node.elts, node.elts[1:]):
                if isinstance(a, ast.Constant) and a.value == "-m" and isinstance(b, ast.Constant):
                    if isinstance(b.value, str) and re.fullmatch(r"[A-Za-z_][\w.]*", b.value):
                        out.append((b.value.split(".")[0], node.lineno))
    return out


def _local_modules(root: Path, folders) -> set[str]:
    """Names the repository's own files and packages are importable as (a script's folder is on its path)."""
    names = {p.name for p in root.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    names |= {p.name for p in (root / "src").iterdir() if p.is_dir()} if (root / "src").is_dir() else set()
    for folder in folders:
        for p in (root / folder).rglob("*.py"):
            names.add(p.stem)
            names.update(d.name for d in p.relative_to(root).parents if d.name)
    return names


def imports(root: Path = ROOT, folders=SCANNED) -> dict[str, list[Use]]:
    """Every third-party module imported under ``folders`` of ``root``, with where."""
    std = set(sys.stdlib_module_names) | {"__future__"} | set(NOT_PACKAGES)
    local = _local_modules(root, folders)
    found: dict[str, list[Use]] = {}
    for folder in folders:
        for path in sorted((root / folder).rglob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            for module, line in _modules(tree):
                if module in std or module in local:
                    continue
                found.setdefault(module, []).append(Use(module, str(path.relative_to(root)), line))
    return found


# -- what the README's test command installs --------------------------------------------------------
def declared(pyproject: str, baselines: str, extra: str = "test") -> list[Requirement]:
    """The requirements ``pip install -e ".[extra]"`` and ``pip install -r baselines`` ask for: the
    project's dependencies, the extra, and every ``coordl[...]`` extra it names, recursively."""
    project = tomllib.loads(pyproject)["project"]
    name = _normalise(project["name"])
    extras = project.get("optional-dependencies", {})
    out = [Requirement(r) for r in project.get("dependencies", [])]
    todo, seen = [extra], set()
    while todo:
        e = todo.pop()
        if e in seen:
            continue
        seen.add(e)
        if e not in extras:
            raise ValueError(f"pyproject.toml has no extra {e!r}")
        for text in extras[e]:
            r = Requirement(text)
            if _normalise(r.name) == name:
                todo += sorted(r.extras)
            else:
                out.append(r)
    for line in baselines.splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            out.append(Requirement(line))
    return out


def provided(requirements: list[Requirement]) -> set[str]:
    """The (normalised) names of the distributions these requirements install: each, and what its
    installed metadata requires in turn (markers evaluated here, with the extras asked for)."""
    out: set[str] = set()
    todo = [(r, frozenset(r.extras)) for r in requirements]
    while todo:
        r, extras = todo.pop()
        if r.marker is not None and not any(r.marker.evaluate({"extra": e}) for e in (extras or {""})):
            continue
        key = (_normalise(r.name), extras)
        if key in out:
            continue
        out.add(key)
        try:
            requires = md.requires(r.name) or []
        except md.PackageNotFoundError:
            continue
        for text in requires:
            sub = Requirement(text)
            marker: Marker | None = sub.marker
            if marker is not None and not any(marker.evaluate({"extra": e}) for e in (extras or {""})):
                continue
            sub.marker = None  # evaluated with the parent's extras; the child's own extras come next
            todo.append((sub, frozenset(sub.extras)))
    return {name for name, _ in out}


def problems(root: Path = ROOT, pyproject: str | None = None, baselines: str | None = None) -> list[str]:
    """One line per module imported under the scanned folders that the declared requirements do not
    provide: the module, where it is imported, and the distribution that would (when installed here)."""
    pyproject = pyproject if pyproject is not None else (root / "pyproject.toml").read_text()
    baselines = baselines if baselines is not None else (root / "benchmarks" / "baselines.txt").read_text()
    have = provided(declared(pyproject, baselines))
    owners = md.packages_distributions()
    out = []
    for module, uses in sorted(imports(root).items()):
        if module in OPTIONAL:
            continue
        where = ", ".join(map(str, uses[:3])) + (f" and {len(uses) - 3} more" if len(uses) > 3 else "")
        dists = sorted({_normalise(d) for d in owners.get(module, [])})
        if not dists:
            out.append(
                f"{module!r} (imported at {where}) is not installed, and no requirement of the test extra or "
                "benchmarks/baselines.txt provides it: add the distribution that provides it"
            )
        elif not set(dists) & have:
            out.append(
                f"{module!r} (imported at {where}) comes from {', '.join(dists)}, which neither the test extra "
                "(pyproject.toml) nor benchmarks/baselines.txt installs: it is here only because it was installed "
                "by hand; add it to an extra the test extra includes"
            )
    return out
