"""The layering of src/coordl stays true: read from the source with ``ast``, nothing imported.

Imports point one way, from the loader down to ``shm/``; a pure module never imports a
stateful one; modules do not reach into each other's private names; files stay small
enough to hold one idea; ``coordl/__init__.py`` is the public API, with a sorted
``__all__``. Each rule lists every offender with its file and line.

What counts as an import: every ``import``/``from ... import`` anywhere in a file (deferred
imports inside functions included), except those under ``if TYPE_CHECKING:``, which never
run. ``from coordl.pkg import name`` is an edge to the module ``coordl.pkg.name`` when there
is one, else to ``coordl.pkg`` (its ``__init__``); the packages that Python imports on the
way (``coordl``, ``coordl.pkg``) are not counted as edges.
"""

from __future__ import annotations

import ast
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "coordl"

# -- the rules' lists -------------------------------------------------------------------------

MAX_LINES = 600

# Pure modules: plain values in, plain values out (orders, shards, placements, frames, the
# what-if model). They may import each other, coordl.errors, the standard library and numpy.
PURE = [
    "coordl.sampler",
    "coordl.placement",  # STYLE.md puts it at coordl.fetch.placement: either place is fine
    "coordl.fetch.wire",
    "coordl.analyze.model",
    "coordl.tiers.model",
    "coordl.detection.boxes",
    "coordl.detection.crops",
]
PURE_IF_PRESENT = [
    "coordl.draws",
    "coordl.fetch.placement",
    "coordl.position",
    "coordl.schedule",
]
# A listed pure module may have moved to this other name (then the other name must exist).
PURE_MOVED = {"coordl.placement": "coordl.fetch.placement", "coordl.fetch.placement": "coordl.placement"}
PURE_MAY_IMPORT = ["coordl.errors"]
THIRD_PARTY_PURE_MAY_IMPORT = ["numpy"]

# shm/ holds primitives only: it imports nothing else from coordl but cgroups, a leaf that imports
# nothing of coordl (where the process's cgroups are: shm/limits reads memory's, cpus.py the CPU quota).
SHM = "coordl.shm"
SHM_MAY_IMPORT = ["coordl.cgroups"]


# Test support lives outside the package, at the repository root (coordl_testing/, tests/,
# benchmarks/), which pip does not install: no module of the package is one of the fixtures, and
# none imports the test support or what only the fixtures need (moto).
FIXTURES = ["s3server", "netns", "raycluster"]
TEST_SUPPORT = ["coordl_testing", "tests", "benchmarks", "moto"]


# -- reading the source -----------------------------------------------------------------------


@dataclass
class Import:
    """One import statement's target, resolved to a module of the package when it is one."""

    target: str  # a dotted module name (a package module, or an outside one such as "numpy")
    line: int
    names: list[str] = field(default_factory=list)  # names taken with ``from target import ...``
    internal: bool = False


@dataclass
class Module:
    name: str
    path: Path
    is_package: bool
    tree: ast.Module
    lines: int
    where: str  # the path shown in messages, e.g. coordl/loader.py
    imports: list[Import] = field(default_factory=list)
    private_uses: list[tuple[int, str]] = field(default_factory=list)  # (line, what)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _statements(tree: ast.AST):
    """Every node of ``tree`` except what lies under ``if TYPE_CHECKING:`` (its ``else`` runs)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


def load_modules(src: Path = SRC, package: str = PACKAGE) -> dict[str, Module]:
    """Every module of ``package`` under ``src``, with its resolved imports and private uses."""
    root = src / package
    modules: dict[str, Module] = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(src).with_suffix("")
        parts = list(rel.parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts = parts[:-1]
        text = path.read_text(encoding="utf-8")
        name = ".".join(parts)
        tree = ast.parse(text, str(path))
        modules[name] = Module(name, path, is_package, tree, len(text.splitlines()), str(path.relative_to(src)))
    for m in modules.values():
        _resolve(m, modules, package)
    return modules


def _resolve(m: Module, modules: dict[str, Module], package: str) -> None:
    def inside(name: str) -> bool:
        return name == package or name.startswith(package + ".")

    def existing(name: str) -> str:
        """The longest prefix of ``name`` that is a module of the package."""
        parts = name.split(".")
        while parts and ".".join(parts) not in modules:
            parts.pop()
        return ".".join(parts) if parts else name

    bound: dict[str, str] = {}  # a local name -> the package module it is bound to
    for node in _statements(m.tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if inside(alias.name):
                    target = existing(alias.name)
                    m.imports.append(Import(target, node.lineno, internal=True))
                    if alias.asname:
                        bound[alias.asname] = target
                    else:  # ``import coordl.x.y`` binds ``coordl``; attribute chains are resolved below
                        bound[alias.name.split(".")[0]] = alias.name.split(".")[0]
                    for part in alias.name.split(".")[1:]:
                        if _private(part) and not _same_package(m, alias.name):
                            m.private_uses.append((node.lineno, f"import {alias.name}"))
                else:
                    m.imports.append(Import(alias.name, node.lineno))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = m.name if m.is_package else m.name.rpartition(".")[0]
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                source = f"{base}.{node.module}" if node.module else base
            else:
                source = node.module or ""
            if not inside(source):
                m.imports.append(Import(source, node.lineno, [a.name for a in node.names]))
                continue
            plain: list[str] = []
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                if sub in modules:  # a submodule: the edge goes to it, not to the package
                    m.imports.append(Import(sub, node.lineno, internal=True))
                    bound[alias.asname or alias.name] = sub
                    if _private(alias.name) and not _same_package(m, sub):
                        m.private_uses.append((node.lineno, f"from {source} import {alias.name}"))
                else:
                    plain.append(alias.name)
                    if _private(alias.name):
                        m.private_uses.append((node.lineno, f"from {source} import {alias.name}"))
            if plain:
                m.imports.append(Import(existing(source), node.lineno, plain, internal=True))
    # ``module._name`` where ``module`` is bound to a package module by an import of this file
    for node in _statements(m.tree):
        if not isinstance(node, ast.Attribute):
            continue
        chain = []
        cur: ast.expr = node
        while isinstance(cur, ast.Attribute):
            chain.append(cur.attr)
            cur = cur.value
        if not isinstance(cur, ast.Name) or cur.id not in bound:
            continue
        chain.reverse()
        owner = bound[cur.id]
        for attr in chain:  # walk down submodules: coordl.fetch.cache._x
            if f"{owner}.{attr}" in modules and not _private(attr):
                owner = f"{owner}.{attr}"
                continue
            if _private(attr) and owner != m.name:
                m.private_uses.append((node.lineno, f"{cur.id}.{'.'.join(chain[: chain.index(attr) + 1])}"))
            break


def _same_package(m: Module, target: str) -> bool:
    """A private submodule may be imported by the modules of its own package."""
    pkg = target.rpartition(".")[0]
    mine = m.name if m.is_package else m.name.rpartition(".")[0]
    return mine == pkg or mine.startswith(pkg + ".")


def edges(modules: dict[str, Module]) -> dict[str, dict[str, int]]:
    """module -> {imported package module: first line}, self-imports left out."""
    out: dict[str, dict[str, int]] = {name: {} for name in modules}
    for m in modules.values():
        for imp in m.imports:
            if imp.internal and imp.target != m.name and imp.target in modules:
                out[m.name].setdefault(imp.target, imp.line)
    return out


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = [0]
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def shortest_cycle(graph: dict[str, dict[str, int]], members: list[str]) -> list[str]:
    """One shortest cycle through the first member of a component, as a list of modules."""
    start = members[0]
    inside = set(members)
    prev: dict[str, str] = {}
    frontier = [start]
    seen = {start}
    while frontier:
        nxt = []
        for v in frontier:
            for w in graph[v]:
                if w not in inside:
                    continue
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(prev[path[-1]])
                    return [start, *reversed(path[:-1]), start] if len(path) > 1 else [start, v, start]
                if w not in seen:
                    seen.add(w)
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    return members


def describe_cycle(graph, modules, comp) -> str:
    """A component's members, one shortest cycle through it, and every import inside it."""
    path = shortest_cycle(graph, comp)
    inner = [f"{a} -> {b} ({modules[a].where}:{graph[a][b]})" for a in comp for b in graph[a] if b in comp]
    return (
        f"{{{', '.join(comp)}}}\n    shortest cycle: {' -> '.join(path)}\n    imports inside it:\n      "
        + "\n      ".join(inner)
    )


def _fail_if(offenders: list[str], header: str) -> None:
    """Fails with one line per offender (no repr of the module table)."""
    if offenders:
        pytest.fail(f"{header}\n  " + "\n  ".join(offenders), pytrace=False)


@pytest.fixture(scope="module")
def modules() -> dict[str, Module]:
    found = load_modules()
    assert PACKAGE in found and len(found) >= 10, f"found too few modules under {SRC / PACKAGE}: {sorted(found)}"
    return found


# -- the rules --------------------------------------------------------------------------------


def test_no_import_cycles(modules):
    graph = edges(modules)
    comps = cycles(graph)
    _fail_if(
        [describe_cycle(graph, modules, c) for c in comps],
        f"{len(comps)} import cycle(s) between coordl modules (imports point one way, from the loader down to "
        "shm/; pass what a lower module needs as a value, or import a type only under TYPE_CHECKING):",
    )


def test_no_module_uses_another_modules_private_names(modules):
    offenders = [f"{m.where}:{line}: {what}" for m in modules.values() for line, what in m.private_uses]
    _fail_if(
        sorted(offenders),
        f"{len(offenders)} use(s) of another coordl module's private names (make the name "
        "public, with a docstring, or move the code that needs it):",
    )


def test_modules_are_at_most_600_lines(modules):
    big = sorted((m.lines, m.where) for m in modules.values() if m.lines > MAX_LINES)
    _fail_if(
        [f"{where}: {n} lines" for n, where in reversed(big)],
        f"{len(big)} module(s) over {MAX_LINES} lines (a module that long usually holds two ideas; split it):",
    )


def test_shm_imports_nothing_else_from_coordl(modules):
    offenders = [
        f"{m.where}:{imp.line}: imports {imp.target}"
        for m in modules.values()
        if m.name == SHM or m.name.startswith(SHM + ".")
        for imp in m.imports
        if imp.internal and not (imp.target == SHM or imp.target.startswith(SHM + ".") or imp.target in SHM_MAY_IMPORT)
    ]
    leaves = [
        f"{modules[name].where}:{imp.line}: imports {imp.target}"
        for name in SHM_MAY_IMPORT
        for imp in modules[name].imports
        if imp.internal
    ]
    _fail_if(offenders + leaves, "coordl.shm holds primitives and imports nothing else from coordl but its leaves:")


def test_the_package_holds_no_test_fixture_and_imports_no_test_support(modules):
    fixtures = [
        f"{m.where}: a test fixture in the package; it belongs in coordl_testing/"
        for m in modules.values()
        if m.name.rpartition(".")[2] in FIXTURES
    ]
    imports = [
        f"{m.where}:{imp.line}: imports {imp.target}"
        for m in modules.values()
        for imp in m.imports
        if not imp.internal and imp.target.split(".")[0] in TEST_SUPPORT
    ]
    _fail_if(
        fixtures + imports,
        "the installed package holds test support or needs it (fixtures live in coordl_testing/ at the "
        "repository root, which pip does not install, and coordl never imports them):",
    )
    assert "coordl.tools" in modules  # where the fixtures were: the check above reads it
    assert not [f"coordl.tools.{f}" for f in FIXTURES if f"coordl.tools.{f}" in modules]


# Names the typing module gained after Python 3.10, the oldest Python pyproject.toml admits.
TYPING_AFTER_310 = {
    "Self",
    "LiteralString",
    "Never",
    "TypeVarTuple",
    "Unpack",
    "Required",
    "NotRequired",
    "assert_never",
    "assert_type",
    "reveal_type",
    "dataclass_transform",
    "get_overloads",
    "clear_overloads",
    "override",
    "TypeAliasType",
    "get_protocol_members",
    "is_protocol",
    "ReadOnly",
    "TypeIs",
    "NoDefault",
}


def test_the_code_runs_on_the_oldest_python_it_declares(modules):
    """Every module of the package and of coordl_testing parses as Python 3.10 and imports no typing name
    3.10 lacks (ruff's target-version checks the rest of the syntax it rewrites)."""
    offenders = []
    paths = [m.path for m in modules.values()] + sorted((SRC.parent / "coordl_testing").glob("*.py"))
    for path in paths:
        text = path.read_text(encoding="utf-8")
        try:
            tree = ast.parse(text, str(path), feature_version=(3, 10))
        except SyntaxError as e:
            offenders.append(f"{path.name}:{e.lineno}: not Python 3.10 syntax: {e.msg}")
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "typing":
                late = sorted({a.name for a in node.names} & TYPING_AFTER_310)
                offenders += [f"{path.name}:{node.lineno}: typing.{n} is not in Python 3.10" for n in late]
            if (
                isinstance(node, ast.Attribute)
                and ast.unparse(node.value) == "typing"
                and node.attr in TYPING_AFTER_310
            ):
                offenders.append(f"{path.name}:{node.lineno}: typing.{node.attr} is not in Python 3.10")
    _fail_if(offenders, "code that Python 3.10 cannot run, which pyproject.toml's requires-python admits:")


def _pure_modules(modules) -> list[str]:
    return [name for name in PURE + PURE_IF_PRESENT if name in modules]


ANALYZER = "coordl.analyze"
MAY_IMPORT_ANALYZER = ["coordl.cli"]  # the `coordl analyze` command runs it


def test_the_core_never_imports_the_analyzer(modules):
    """DS-Analyzer is a tool that uses the loader (through its public entries), never the reverse:
    no module outside coordl.analyze imports it, deferred imports included."""
    offenders = [
        f"{m.where}:{imp.line}: imports {imp.target}"
        for m in modules.values()
        if not _within(m.name, ANALYZER) and m.name not in MAY_IMPORT_ANALYZER
        for imp in m.imports
        if imp.internal and _within(imp.target, ANALYZER)
    ]
    _fail_if(sorted(offenders), "the core imports the analyzer (make what it needs a module of the core):")


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def test_the_listed_pure_modules_exist(modules):
    missing = [n for n in PURE if n not in modules and PURE_MOVED.get(n) not in modules]
    _fail_if(
        missing,
        "pure module(s) listed in tests/test_architecture.py (PURE) are not in src/coordl; if one "
        "moved or was renamed, update the list:",
    )


def test_pure_modules_import_only_pure_modules(modules):
    pure = set(_pure_modules(modules))
    allowed_internal = pure | set(PURE_MAY_IMPORT)
    stdlib = set(sys.stdlib_module_names) | {"__future__"}
    offenders = []
    for name in sorted(pure):
        m = modules[name]
        for imp in m.imports:
            if imp.internal:
                if imp.target not in allowed_internal:
                    offenders.append(f"{m.where}:{imp.line}: imports {imp.target} (stateful)")
            else:
                top = imp.target.split(".")[0]
                if top not in stdlib and top not in THIRD_PARTY_PURE_MAY_IMPORT:
                    offenders.append(f"{m.where}:{imp.line}: imports {imp.target}")
    _fail_if(
        offenders,
        f"pure modules ({', '.join(sorted(pure))}) may import only each other, "
        f"{', '.join(PURE_MAY_IMPORT)}, the standard library and numpy:",
    )


def _defined_names(tree: ast.Module) -> set[str]:
    """Names bound at the top level of a module, plus those its ``__getattr__`` serves by name."""
    names: set[str] = set()
    for node in _statements(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == "__getattr__":
            for sub in ast.walk(node):
                if isinstance(sub, ast.Compare):
                    for c in [sub.left, *sub.comparators]:
                        elts = c.elts if isinstance(c, (ast.Tuple, ast.List, ast.Set)) else [c]
                        names |= {e.value for e in elts if isinstance(e, ast.Constant) and isinstance(e.value, str)}
    for node in tree.body:
        nodes = [node]
        if isinstance(node, (ast.If, ast.Try)):
            nodes = list(_statements(node))
        for n in nodes:
            if isinstance(n, (ast.Import, ast.ImportFrom)):
                for a in n.names:
                    names.add(a.asname or a.name.split(".")[0])
            elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(n.name)
            elif isinstance(n, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                targets = n.targets if isinstance(n, ast.Assign) else [n.target]
                for t in targets:
                    for e in ast.walk(t):
                        if isinstance(e, ast.Name):
                            names.add(e.id)
    return names


def _all_of(tree: ast.Module) -> tuple[list[str] | None, int]:
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
                return list(ast.literal_eval(node.value)), node.lineno
    return None, 0


def test_public_all_is_sorted_and_names_what_init_defines(modules):
    init = modules[PACKAGE]
    names, line = _all_of(init.tree)
    assert names is not None, f"{init.where} has no literal __all__"
    problems = []
    if names != sorted(names):
        problems.append(f"__all__ is not sorted; sorted it reads {sorted(names)}")
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        problems.append(f"__all__ lists {dupes} more than once")
    undefined = [n for n in names if n not in _defined_names(init.tree)]
    if undefined:
        problems.append(f"__all__ names {undefined}, which {init.where} neither defines nor imports")
    _fail_if(problems, f"{init.where}:{line}: the public API's __all__:")


# -- the checker itself finds what it should --------------------------------------------------


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(textwrap.dedent(text))


def test_the_checker_resolves_imports_cycles_and_private_uses(tmp_path):
    _write(
        tmp_path,
        {
            "pkg/__init__.py": "from pkg.a import A\n__all__ = ['A', 'later', 'B']\ndef __getattr__(name):\n"
            "    if name == 'later':\n        return 1\n",
            "pkg/a.py": """
            from typing import TYPE_CHECKING
            from pkg.sub import b            # the sibling module, not pkg.sub's __init__
            if TYPE_CHECKING:
                from pkg import c            # never runs: no edge
            class A: ...
            """,
            "pkg/sub/__init__.py": "from . import b\n",
            "pkg/sub/b.py": """
            import numpy as np
            def later():
                from .. import c             # deferred: an edge to pkg.c
                return c._hidden             # a private name of another module
            """,
            "pkg/c.py": "from pkg.a import A, _x\nimport pkg.sub.b as bee\nbee._y\n",
            "pkg/sub/_priv.py": "",
            "pkg/sub/d.py": "from pkg.sub import _priv\n",  # package-private: allowed
            "pkg/e.py": "from pkg.sub import _priv\n",  # from outside its package: not allowed
        },
    )
    mods = load_modules(tmp_path, "pkg")
    graph = edges(mods)
    assert graph["pkg.a"] == {"pkg.sub.b": 3}
    assert graph["pkg.sub"] == {"pkg.sub.b": 1}
    assert graph["pkg.sub.b"] == {"pkg.c": 4}
    assert graph["pkg.c"] == {"pkg.a": 1, "pkg.sub.b": 2}
    assert graph["pkg"] == {"pkg.a": 1}
    assert cycles(graph) == [["pkg.a", "pkg.c", "pkg.sub.b"]]
    assert "pkg.a -> pkg.sub.b (pkg/a.py:3)" in describe_cycle(graph, mods, cycles(graph)[0])
    assert shortest_cycle(graph, ["pkg.a", "pkg.c", "pkg.sub.b"]) == ["pkg.a", "pkg.sub.b", "pkg.c", "pkg.a"]
    assert [w for _, w in mods["pkg.sub.b"].private_uses] == ["c._hidden"]
    assert sorted(w for _, w in mods["pkg.c"].private_uses) == ["bee._y", "from pkg.a import _x"]
    assert mods["pkg.sub.d"].private_uses == []
    assert [w for _, w in mods["pkg.e"].private_uses] == ["from pkg.sub import _priv"]
    assert [i.target for i in mods["pkg.sub.b"].imports if not i.internal] == ["numpy"]
    names, _ = _all_of(mods["pkg"].tree)
    assert [n for n in names if n not in _defined_names(mods["pkg"].tree)] == ["B"]


def test_only_the_cluster_module_imports_ray(modules):
    """Ray is an extra (``coordl[ray]``), imported when a loader is made with ``RayPrep`` only:
    by coordl.remote.cluster, and by nothing else, deferred imports included."""
    offenders = [
        f"{m.where}:{imp.line}: imports {imp.target}"
        for m in modules.values()
        if m.name != "coordl.remote.cluster"
        for imp in m.imports
        if not imp.internal and imp.target.split(".")[0] == "ray"
    ]
    _fail_if(sorted(offenders), "Ray is imported outside coordl.remote.cluster (ask it for Ray: ray_module()):")
    cluster = modules["coordl.remote.cluster"]
    assert any(imp.target == "ray" for imp in cluster.imports)  # the check sees its import


def _thread_starts(tree: ast.AST):
    """``(line, what)`` of every call in ``tree`` that makes a thread or a pool of threads."""
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
        if name in ("ThreadPoolExecutor", "Thread", "DaemonPool"):
            yield node, name


def test_every_thread_coordl_starts_is_a_daemon(modules):
    """The interpreter's exit waits for no thread of coordl's (a user's Ctrl-C or SIGTERM during a
    listing, a calibration or an index must not hang in a join at exit): no ThreadPoolExecutor
    (whose threads Python joins at exit), every ``threading.Thread(..., daemon=True)``, and pools
    made by coordl.threads (daemon threads that never take the process's signals)."""
    offenders = []
    for m in modules.values():
        for node, name in _thread_starts(m.tree):
            where = f"{m.where}:{node.lineno}"
            if name == "ThreadPoolExecutor":
                offenders.append(f"{where}: a ThreadPoolExecutor (use coordl.threads.daemon_pool)")
            elif name == "DaemonPool" and m.name != "coordl.threads":
                offenders.append(f"{where}: a DaemonPool made here (use coordl.threads.daemon_pool)")
            elif name == "Thread" and not any(
                k.arg == "daemon" and isinstance(k.value, ast.Constant) and k.value.value is True for k in node.keywords
            ):
                offenders.append(f"{where}: a thread without daemon=True")
    _fail_if(sorted(offenders), "threads the interpreter's exit would wait for:")


# Where prep runs is asked in one place: coordl.prep.site (and Prep.of, which takes a RayPrep as it is).
PREP_SITE_MAY_ASK = {"coordl.prep.site", "coordl.options"}


def test_prep_and_rayprep_are_told_apart_in_one_place(modules):
    """``prep=`` holds a Prep or a RayPrep: only :mod:`coordl.prep.site` asks which (its Local and
    Remote answer the loader's questions alike), no ``isinstance`` anywhere else."""
    offenders = []
    for m in modules.values():
        if m.name in PREP_SITE_MAY_ASK:
            continue
        for node in ast.walk(m.tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "isinstance":
                names = {n.id if isinstance(n, ast.Name) else getattr(n, "attr", "") for n in ast.walk(node.args[1])}
                if names & {"Prep", "RayPrep"}:
                    offenders.append(f"{m.where}:{node.lineno}: isinstance(..., {' | '.join(sorted(names))})")
    _fail_if(offenders, "a type switch on prep= outside coordl.prep.site:")


# What a recipe is, is asked in one place: the module that defines the recipe protocol.
RECIPE_PROTOCOL = "coordl.prep.protocol"
RECIPE_BASE = "Recipe"
# The type switches the protocol replaced: functions that asked a recipe's kind.
BUILT_IN_RECIPES = {"ImageNetTrain", "ImageNetVal", "SSDTrain", "SSDVal", "AudioTrain", "AudioVal", "DecodedRecipe"}
RECIPE_KIND_QUESTIONS = {"is_audio", "is_detection", "is_image", "takes_decoded", "normalised", "output_shape"}


def recipe_classes(modules: dict[str, Module]) -> set[str]:
    """The names of :data:`RECIPE_BASE` and of every class of the package that derives from it
    (through any chain of bases), read from the source."""
    bases: dict[str, set[str]] = {}
    for m in modules.values():
        for node in ast.walk(m.tree):
            if isinstance(node, ast.ClassDef):
                names = {b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases}
                bases.setdefault(node.name, set()).update(names)
    found = {RECIPE_BASE}
    grew = True
    while grew:
        grew = False
        for name, of in bases.items():
            if name not in found and of & found:
                found.add(name)
                grew = True
    return found


def recipe_type_checks(m: Module, recipes: set[str]) -> list[str]:
    """Where ``m`` asks which kind of recipe it holds: ``isinstance``/``issubclass`` against a recipe
    class, ``type(x) is`` one, or a call of one of :data:`RECIPE_KIND_QUESTIONS`."""
    found = []
    for node in ast.walk(m.tree):
        if isinstance(node, ast.Call):
            func = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", "")
            if func in ("isinstance", "issubclass") and len(node.args) == 2:
                names = {n.id if isinstance(n, ast.Name) else getattr(n, "attr", "") for n in ast.walk(node.args[1])}
                if names & recipes:
                    found.append(f"{m.where}:{node.lineno}: {func}(..., {' | '.join(sorted(names & recipes))})")
            elif func in RECIPE_KIND_QUESTIONS:
                found.append(f"{m.where}:{node.lineno}: {func}(...)")
        elif isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            typed = any(isinstance(x, ast.Call) and getattr(x.func, "id", "") == "type" for x in sides)
            named = {x.id if isinstance(x, ast.Name) else getattr(x, "attr", "") for x in sides}
            if typed and named & recipes:
                found.append(f"{m.where}:{node.lineno}: type(...) is {' | '.join(sorted(named & recipes))}")
    return found


def test_recipes_are_told_apart_in_one_place(modules):
    """Each kind of recipe answers the pipeline graph, the checks, staging and delivery itself
    (:mod:`coordl.prep.protocol`): only the module that defines the protocol asks which kind it
    holds, no ``isinstance``, ``type(...) is`` or ``is_audio()``-like switch anywhere else."""
    recipes = recipe_classes(modules) | BUILT_IN_RECIPES
    offenders = [
        where for m in modules.values() if m.name != RECIPE_PROTOCOL for where in recipe_type_checks(m, recipes)
    ]
    _fail_if(offenders, f"{len(offenders)} type switch(es) on a recipe outside {RECIPE_PROTOCOL} (ask the recipe):")
    assert RECIPE_PROTOCOL in modules, f"the recipe protocol's module {RECIPE_PROTOCOL} is gone"
    assert BUILT_IN_RECIPES <= recipe_classes(modules), "a built-in recipe does not derive from the protocol's Recipe"


def test_the_recipe_check_finds_switches(tmp_path):
    """The recipe rule on a package of its own: the switches it must find, and what it must pass."""
    pkg = tmp_path / "pkg"
    (pkg / "prep").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "prep" / "__init__.py").write_text("")
    (pkg / "prep" / "protocol.py").write_text(
        "class Recipe:\n    pass\n\n\ndef as_recipe(x):\n    return x if isinstance(x, Recipe) else None\n"
    )
    (pkg / "prep" / "kinds.py").write_text(
        textwrap.dedent(
            """
            from pkg.prep.protocol import Recipe

            class Mixin:
                pass

            class Base(Mixin, Recipe):
                pass

            class Audio(Base):
                pass
            """
        )
    )
    (pkg / "user.py").write_text(
        textwrap.dedent(
            """
            from pkg.prep import kinds

            def f(recipe, x):
                a = isinstance(recipe, kinds.Audio)
                b = type(recipe) is kinds.Base
                c = is_audio(recipe)
                d = isinstance(x, (int, str))
                e = recipe.target == "boxes"
                return a, b, c, d, e
            """
        )
    )
    found = load_modules(tmp_path, "pkg")
    recipes = recipe_classes(found)
    assert recipes == {"Recipe", "Base", "Audio"}
    assert recipe_type_checks(found["pkg.prep.protocol"], recipes)  # it is allowed there, not blind there
    assert [w.split(": ", 1)[1] for w in recipe_type_checks(found["pkg.user"], recipes)] == [
        "isinstance(..., Audio)",
        "type(...) is Base",
        "is_audio(...)",
    ]


def package_edges(modules: dict[str, Module]) -> dict[str, dict[str, str]]:
    """Top-level package (or module) of coordl -> {another it imports when it is imported: where},
    counting the imports that run at import time (module level, not inside a function)."""

    def unit(name: str) -> str:
        return ".".join(name.split(".")[:2])

    out: dict[str, dict[str, str]] = {}
    for m in modules.values():
        at_import: set[int] = set()
        body = list(m.tree.body)
        while body:
            node = body.pop()
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                at_import.add(node.lineno)
            elif isinstance(node, ast.If) and not _is_type_checking(node.test):
                body.extend(node.body + node.orelse)
            elif isinstance(node, ast.Try):
                body.extend(node.body + node.orelse + node.finalbody + [s for h in node.handlers for s in h.body])
        src = unit(m.name)
        out.setdefault(src, {})
        for imp in m.imports:
            dst = unit(imp.target)
            if imp.internal and imp.line in at_import and imp.target in modules and dst not in (src, PACKAGE):
                out[src].setdefault(dst, f"{m.where}:{imp.line} imports {imp.target}")
    for targets in list(out.values()):
        for t in targets:
            out.setdefault(t, {})
    return out


def test_no_import_cycles_between_packages(modules):
    """Sub-packages import each other one way when they are imported (``detection`` imported
    ``prep.recipes`` for an ``isinstance`` while ``prep`` imports ``detection.crops``: a cycle of
    packages that no module-level check saw)."""
    graph = package_edges(modules)
    comps = cycles({k: dict.fromkeys(v, 0) for k, v in graph.items()})
    _fail_if(
        [f"{{{', '.join(c)}}}: " + "; ".join(graph[a][b] for a in c for b in graph[a] if b in c) for c in comps],
        f"{len(comps)} import cycle(s) between coordl's packages at import time:",
    )


def test_module_names_are_unique_in_meaning():
    """No module of a sub-package takes the name of one of coordl's own top-level modules or
    packages (``remote/units.py`` beside ``units.py``, ``remote/staging.py`` beside ``staging/``:
    one name, two meanings)."""
    root = SRC / PACKAGE
    top = {p.stem for p in root.glob("*.py")} | {p.name for p in root.iterdir() if (p / "__init__.py").exists()}
    top.discard("__init__")
    offenders = [
        f"{p.relative_to(root.parent)} is named as coordl.{p.stem}"
        for p in sorted(root.glob("*/**/*.py"))
        if p.stem in top
    ]
    _fail_if(offenders, "modules named as a top-level module or package of coordl:")


# The layers, from the top down (docs/architecture.md draws them). A module belongs to the layer of
# the longest prefix listed; an import to a higher layer must be deferred into the function that
# needs it, with a comment starting "lazy:" on its line or the lines just above that says why.
LAYERS = [
    ("commands", ["coordl.cli", "coordl.tools", "coordl.analyze"]),
    ("api", ["coordl", "coordl.loader"]),
    ("passes", ["coordl.backends", "coordl.staging", "coordl.remote", "coordl.passes"]),
    ("assembly", ["coordl.resources", "coordl.sources", "coordl.tiers", "coordl.delivery", "coordl.views"]),
    ("prep", ["coordl.prep", "coordl.datasets", "coordl.audio"]),
    (
        "data",
        [
            "coordl.fetch",
            "coordl.index",
            "coordl.indexfile",
            "coordl.saved",
            "coordl.currency",
            "coordl.tars",
            "coordl.detection",
            "coordl.s3",
            "coordl.paths",
        ],
    ),
    (
        "settings",
        [
            "coordl.options",
            "coordl.config",
            "coordl.world",
            "coordl.cpus",
            "coordl.lifecycle",
            "coordl.threads",
            "coordl.accounting",
            "coordl.compat",
            "coordl.position",
            "coordl.schedule",
        ],
    ),
    ("pure", ["coordl.sampler", "coordl.placement", "coordl.draws", "coordl.remote.address"]),
    ("base", ["coordl.shm", "coordl.cgroups", "coordl.errors", "coordl.env", "coordl.units", "coordl.renamed"]),
]


def _layer(name: str) -> int | None:
    """The index in LAYERS (0 the top) of the longest listed prefix of ``name``."""
    best: tuple[int, int] | None = None
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if _within(name, p) and (best is None or len(p) > best[1]):
                best = (i, len(p))
    return best[0] if best else None


def _says_why_lazy(m: Module, line: int) -> bool:
    """A ``# lazy: ...`` comment on ``line`` or on the comment (and import) lines just above it."""
    lines = m.path.read_text(encoding="utf-8").splitlines()
    if "# lazy:" in lines[line - 1]:
        return True
    i = line - 2
    while i >= 0 and lines[i].strip().startswith(("#", "from ", "import ")):
        if lines[i].strip().startswith("# lazy:"):
            return True
        i -= 1
    return False


def test_every_module_has_a_layer(modules):
    _fail_if(
        sorted(m.where for m in modules.values() if _layer(m.name) is None),
        "module(s) in no layer of tests/test_architecture.py's LAYERS (add the module or its package):",
    )


def test_an_import_up_the_layers_is_deferred_and_says_why(modules):
    """Imports point down the layers; the few that must go up (a heavy or optional dependency
    loaded only by the path that needs it) are deferred into a function and say why."""
    offenders = []
    for m in modules.values():
        here = _layer(m.name)
        top_level = {id(n) for n in m.tree.body}
        for node in _statements(m.tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for imp in m.imports:
                if imp.line != node.lineno or not imp.internal or imp.target == m.name or imp.target not in modules:
                    continue
                there = _layer(imp.target)
                if here is None or there is None or there >= here:
                    continue
                what = f"{m.where}:{imp.line}: {LAYERS[here][0]} -> {LAYERS[there][0]} ({imp.target})"
                if id(node) in top_level:
                    offenders.append(f"{what}: at the top level")
                elif not _says_why_lazy(m, imp.line):
                    offenders.append(f"{what}: no '# lazy: <why>' comment")
    _fail_if(sorted(set(offenders)), "imports up the layers (pass a value down instead, or defer and say why):")
