"""The benchmark harness: what every scenario shares, written once, a module per part (each says what it holds).

:mod:`.dataset` names and makes a dataset; :mod:`.jobs` launches a scenario's child processes; :mod:`.limits` sets
the machine's conditions (cgroups, the page cache); :mod:`.measure` measures and alternates runs ABBA;
:mod:`.compare` runs loaders alone or as HP trials, in children; :mod:`.results` writes the one schema;
:mod:`.report` prints tables and plots; :mod:`.cli` is ``python -m benchmarks [NAME]``.

A scenario is a module of ``benchmarks`` whose docstring's first line says what it compares, with
``options(parser)`` (its own options), ``run(args) -> dict | None`` (the figures, which the harness
writes, or None for a scenario's child job) and optionally ``table(results) -> str``.
"""
