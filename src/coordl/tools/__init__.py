"""Tools around the loader, not imported by it: what the ``coordl`` command's demos need.

- :mod:`coordl.tools.datagen` generates ImageNet-like JPEG datasets (``coordl demo``,
  ``coordl make-dataset``, the tests' fixtures, the benchmarks).

Nothing under ``coordl.tools`` is imported by the loader or its packages; a tool imports the
loader's modules, never the other way round. Fixtures only the tests, benchmarks and examples
use (a fault-injecting S3 server, network namespaces) are in ``coordl_testing/`` at the
repository root, which pip does not install.
"""
