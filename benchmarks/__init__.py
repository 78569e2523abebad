"""coordl's benchmarks: scenarios of one harness, run from the repository root.

``python -m benchmarks`` lists the scenarios; ``python -m benchmarks NAME [options]`` runs one
(``NAME --help``: its options). :mod:`benchmarks.harness` holds what they share; each scenario is a
module of this package with ``options(parser)`` and ``run(args)``, its docstring saying what it
compares. The other modules are the loaders the scenarios compare (``loaders``,
``*_baselines``), the training script ``analyze_accuracy``
analyses (``small_resnet``) and the parts of ``index`` (``indexing``, ``index_tars``). README.md lists the
scenarios with their results.
"""
