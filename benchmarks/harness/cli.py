"""``python -m benchmarks``: lists the scenarios; ``python -m benchmarks NAME [options]`` runs one (see the
package's docstring): parses its options (with ``--out``, its result file), runs it, writes what it returns in
the schema of :mod:`.results` and prints its ``table``.
"""

import argparse
import ast
import importlib
import sys
from pathlib import Path

from . import results as schema

HERE = Path(__file__).resolve().parents[1]  # the benchmarks package
RESULTS = HERE / "results"


def scenarios() -> dict[str, str]:
    """Every scenario's name and description, from the modules' source (nothing imported)."""
    found = {}
    for path in sorted(HERE.glob("*.py")):
        tree = ast.parse(path.read_text())
        names = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
        if {"options", "run"} <= names:
            found[path.stem] = (ast.get_docstring(tree) or "").split("\n")[0]
    return found


def save(args: argparse.Namespace, results: dict, path: str | Path | None = None, dataset: dict | None = None) -> Path:
    """Writes ``results`` in the schema to ``path`` (default ``args.out``), with the scenario's
    command line and options: a scenario that writes as it goes (after every run) calls this.
    A ``"dataset"`` in ``results`` goes to the schema's own field."""
    options = {k: v for k, v in vars(args).items() if not k.startswith("_")}
    dataset = dataset or results.get("dataset")
    results = {k: v for k, v in results.items() if k != "dataset"}
    result = schema.envelope(args._scenario, args._argv, options, dataset, results)
    return schema.write(path or args.out, result)


def defaults(args: argparse.Namespace, quick: bool, **values: tuple) -> None:
    """Sets each option left None to its ``(default, with --quick)`` value in ``values``."""
    for key, (normal, small) in values.items():
        if getattr(args, key) is None:
            setattr(args, key, small if quick else normal)


def parser(name: str, module) -> argparse.ArgumentParser:
    raw = argparse.RawDescriptionHelpFormatter
    p = argparse.ArgumentParser(prog=f"python -m benchmarks {name}", description=module.__doc__, formatter_class=raw)
    default = getattr(module, "OUT", str(RESULTS / f"{name}.json"))
    p.add_argument("--out", default=default, help="the result file (default: %(default)s)")
    module.options(p)
    return p


def run(name: str, argv: list[str]) -> int:
    module = importlib.import_module(f"benchmarks.{name}")
    args = parser(name, module).parse_args(argv)
    args._scenario, args._argv = name, argv
    results = module.run(args)
    if results is None:  # a child job, or a scenario that wrote its results itself
        return 0
    path = save(args, results, getattr(module, "out_path", lambda a: a.out)(args))
    if hasattr(module, "table"):
        print(module.table(results))
    print(f"wrote {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    found = scenarios()
    if not argv or argv[0] in ("-h", "--help", "list"):
        width = max(map(len, found))
        print("usage: python -m benchmarks NAME [options]   (NAME --help: its options)\n\nscenarios:")
        for name, what in found.items():
            print(f"  {name:<{width}}  {what}")
        return 0
    if argv[0] not in found:
        print(f"python -m benchmarks: no scenario {argv[0]!r}; one of: {', '.join(found)}", file=sys.stderr)
        return 2
    return run(argv[0], argv[1:])
