"""coordl's benchmarks: scenarios of one harness (:mod:`benchmarks.harness`, whose docstring says what a scenario
is), run from the repository root: ``python -m benchmarks`` lists them, ``python -m benchmarks NAME`` runs one.

The other modules are the loaders the scenarios compare (``loaders``, ``*_baselines``), the training script
``analyze_accuracy`` analyses (``small_resnet``) and the parts of ``index`` (``indexing``, ``index_tars``).
README.md lists the scenarios with their results.
"""
