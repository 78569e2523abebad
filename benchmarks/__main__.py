"""``python -m benchmarks``: the scenarios, listed or run by name (:mod:`benchmarks.harness.cli`)."""

import sys

from benchmarks.harness.cli import main

sys.exit(main())
