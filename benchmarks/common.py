"""The old name of the harness's shared parts, for the scenarios not yet written on it.

Import from :mod:`benchmarks.harness` instead; this module goes when the last one is ported.
"""

from __future__ import annotations

from benchmarks.harness.dataset import (  # noqa: F401
    ROOT,
    SHARED_PHOTOS,
    add_dataset_options,
    dataset_argv,
    dataset_from_args,
    describe,
    photos_of,
)
from benchmarks.harness.jobs import (  # noqa: F401
    drop_page_cache,
    evict,
    job_files,
    module_command,
    start_together,
    wait_for_go,
)
from benchmarks.harness.measure import device_of, sectors_read  # noqa: F401
from benchmarks.harness.report import mb  # noqa: F401


def machine() -> dict:
    """The machine, in the old results' keys (``cpus``, ``mem_gib``, ``git``) and the schema's."""
    from benchmarks.harness import results

    m = results.machine()
    return {**m, "cpus": m["cores"], "mem_gib": round(m["memory_bytes"] / 2**30, 1), "git": results.commit()[:7]}
