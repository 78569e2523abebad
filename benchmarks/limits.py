"""The old name of the harness's cgroups (:mod:`benchmarks.harness.jobs`), for the scenarios not yet ported."""

from benchmarks.harness.jobs import Cgroup, Limits, probe  # noqa: F401
