"""Tools around the loader, not imported by it: what demos, tests, benchmarks and examples need.

- :mod:`coordl.tools.datagen` generates ImageNet-like JPEG datasets (``coordl demo``,
  ``coordl make-dataset``, the tests' fixtures, the benchmarks).
- :mod:`coordl.tools.netns` runs several "nodes" on one machine, each in a network namespace
  with a private ``/dev/shm`` (``examples/multinode/simulate.py``, the multi-node tests and
  benchmark).

Nothing under ``coordl.tools`` is imported by the loader or its packages; a tool imports the
loader's modules, never the other way round.
"""
