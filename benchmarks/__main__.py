"""``python -m benchmarks``: the scenarios, listed or run by name (:mod:`benchmarks.harness.cli`)."""

from benchmarks.harness.cli import main

raise SystemExit(main())
