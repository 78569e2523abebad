"""The benchmark harness: what every scenario shares, written once.

- :mod:`.dataset`: the options that name a dataset, and the dataset they make (generated once,
  found again by a later run with the same options);
- :mod:`.jobs`: child processes (a scenario's own jobs, started together or alone, or reporting
  to a parent that answers);
- :mod:`.limits`: the conditions set on the machine: v1 memory and blkio cgroups for one child,
  page-cache drops;
- :mod:`.measure`: CPU seconds of a process tree, the device's read counter, rates over steady
  epochs, medians, and the ABBA order in which configurations alternate;
- :mod:`.results`: the one JSON schema every result file has (scenario, command, date, commit,
  machine, options, dataset, results);
- :mod:`.report`: tables in Markdown, plots when matplotlib is there;
- :mod:`.cli`: ``python -m benchmarks`` lists the scenarios, ``python -m benchmarks NAME`` runs one.

A scenario is a module of ``benchmarks`` whose docstring's first line says what it compares, with
``options(parser)`` (its own options), ``run(args) -> dict | None`` (the figures, which the harness
writes, or None for a scenario's child job) and optionally ``table(results) -> str``.
"""
