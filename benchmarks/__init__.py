"""coordl's benchmarks, run as modules from the repository root: ``python -m benchmarks.run``.

Each script's docstring says what it measures and how to run it, and README.md lists them
with their results. The scripts import each other as ``from benchmarks import common``:

- ``common``: the dataset options every benchmark takes and the dataset they name, the block
  device's read counter, page-cache drops, the machine's description;
- ``limits``: a memory limit and a storage throttle for one child process (v1 cgroups);
- ``loaders``: the loaders ``run`` and ``torch_backend`` compare, and the child process that
  runs one of them;
- ``small_resnet``: the CPU training script ``analyze_accuracy`` analyses.

A benchmark that starts another in a child process runs it the same way
(``common.module_command``), so the child finds this package where its parent did.
"""
