"""What the index scenarios share: the files they make once, and an index made or loaded (or a function run) in a
fresh Python (:func:`fresh` runs :func:`child`: ``python -m benchmarks.indexing SPEC``)."""

import contextlib
import importlib
import json
import os
import shutil
import sys
import time
from pathlib import Path

from benchmarks.harness import dataset, jobs

MARK = ".made-by-benchmarks"  # in a folder a scenario made (and may delete): what it holds, once complete


def made(root: Path, key: str, write) -> float:
    """``write(root)``'s seconds, unless a complete ``root`` made with ``key`` is there; never replaces another's."""
    mark = root / MARK
    if mark.exists() and mark.read_text() == key:
        return 0.0
    if root.exists() and not mark.exists():
        raise SystemExit(f"{root} exists and was not made by this benchmark; give another --data, or delete it")
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    mark.write_text("incomplete")
    t0 = time.perf_counter()
    write(root)
    mark.write_text(key)
    return time.perf_counter() - t0


def remove(root: Path) -> None:
    """Deletes ``root`` if a scenario made it, then its parent if that leaves it empty."""
    if (root / MARK).exists():
        shutil.rmtree(root)
    with contextlib.suppress(OSError):
        root.parent.rmdir()


def fresh(spec: dict, env: dict | None = None) -> dict:
    """:func:`child` of ``spec`` in a fresh Python, which imports coordl as this one does (its ``PYTHONPATH``)."""
    command = jobs.module_command("indexing", json.dumps(spec))
    return jobs.run_json(command, env={**os.environ, **(env or {})}, cwd=dataset.ROOT)


def memory() -> dict:
    """This process's memory in bytes: RSS, PSS, USS, private dirty pages (its heap, a fork's copies), anonymous."""
    lines = Path("/proc/self/smaps_rollup").read_text().splitlines()[1:]
    f = {ln.split(":")[0]: int(ln.split()[1]) * 1024 for ln in lines}
    out = {"rss": f["Rss"], "pss": f["Pss"], "uss": f["Private_Clean"] + f["Private_Dirty"]}
    return out | {"dirty": f["Private_Dirty"], "anon": f["Anonymous"]}


def function(name: str):
    module, attr = name.split(":")
    return getattr(importlib.import_module(module), attr)


def child(spec: dict) -> dict:
    """``Index.<how>(*args, **kwargs)`` timed (wall, CPU), the memory it took. First: the attributes in ``set``,
    the functions in ``before`` (``"module:function"``: a run's fixed cost), tracemalloc with ``heap``; after:
    ``then`` (``["module:function", *args]``) adds its figures of the index. A ``how`` "module:function": its own."""
    import gc
    import tracemalloc

    import numpy as np  # noqa: F401 - imported before the baseline, as a training script has

    from coordl import Index

    if ":" in spec["how"]:
        return function(spec["how"])(*spec["args"])
    for name, value in spec.get("set", {}).items():
        module, attr = name.rsplit(".", 1)
        setattr(importlib.import_module(module), attr, value)
    for name in spec.get("before", []):
        function(name)()
    gc.collect()
    if spec.get("heap"):
        tracemalloc.start()
    m0, c0, t0 = memory(), time.process_time(), time.perf_counter()
    index = getattr(Index, spec["how"])(*spec["args"], **spec.get("kwargs", {}))
    out = {"seconds": time.perf_counter() - t0, "cpu_s": time.process_time() - c0, "samples": len(index)}
    gc.collect()
    out |= {"fingerprint": index.fingerprint, "after_load": {k: v - m0[k] for k, v in memory().items()}}
    if spec.get("heap"):
        out["heap_bytes"] = tracemalloc.get_traced_memory()[0]
    out["changed"] = getattr(index, "changed", None)  # the check's finding (None: an index before the check)
    if then := spec.get("then"):
        out |= function(then[0])(index, *then[1:])
    return out


if __name__ == "__main__":
    jobs.say(**child(json.loads(sys.argv[1])))
