"""Test support that pip does not install: fixtures shared by tests/, benchmarks/ and the examples.

- :mod:`coordl_testing.s3server` runs moto's S3 server behind a proxy on 127.0.0.1 that counts
  every request and injects latency, errors and hangs (``tests/test_s3.py``, the S3 benchmarks).
- :mod:`coordl_testing.netns` runs several "nodes" on one machine, each in a network namespace
  with a private ``/dev/shm`` (``examples/multinode/simulate.py``, the multi-node tests and
  benchmark).
- :mod:`coordl_testing.raycluster` runs a real Ray cluster of several nodes on loopback, in a
  network namespace of its own, and drivers in it (``tests/test_ray.py``); and Ray nodes on
  separate "machines", each a namespace with its own /dev/shm and host name, started with
  ``ray start`` (``tests/test_ray_nodes.py``).
- :mod:`coordl_testing.traffic` counts the entries a split of a global batch moves between nodes,
  the measure ``tests/test_placement.py`` and ``benchmarks/multinode.py`` hold plans to.

It lives at the repository root, beside ``src/``, so that the wheel (``src/coordl`` only) never
carries it. Import it from the root: pytest puts the root on ``sys.path`` (``pythonpath`` in
pyproject.toml), ``python -m benchmarks.X`` runs from it, and ``examples/multinode/simulate.py``
adds it itself. It imports nothing from coordl; coordl never imports it.
"""
