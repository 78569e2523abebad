"""Scripts that tests/test_ray_nodes.py runs as Ray drivers on node 0 of a cluster of separate
"machines" (:class:`coordl_testing.raycluster.RayNodes`).

``python tests/ray_nodes_driver.py SCENARIO ROOT OUT [ARG...]``: connects to the cluster at
``RAY_ADDRESS``, runs one scenario over the dataset at ROOT and writes what it saw to OUT as JSON;
the helpers are tests/ray_driver.py's. The reference of every comparison is the same loader with
local prep, made in the same script.
"""

from __future__ import annotations

import logging
import socket
import sys
import time

import coordl
from coordl.remote import cluster
from ray_driver import compare, dali, epochs, wait_actors, write


def actors(loader) -> list[dict]:
    """What each ready actor said: where it runs (``host:pid``), how it reads."""
    return list(loader.resources.remote.pool.ready.values())


def two_nodes(root: str, out: str) -> None:
    """Actors on node 1 against local prep on node 0: one epoch, and where the actors ran."""
    ref_images: dict = {}
    with dali(root, 1) as loader:
        result = {"reference": epochs(loader, 1, ref_images), "trainer": socket.gethostname()}
    images: dict = {}
    with dali(root, coordl.RayPrep(workers=2, local=False)) as loader:
        wait_actors(loader, 2, timeout=120)
        result["actors"] = actors(loader)
        result["free_cpus"] = loader.resources.remote.pool.free_cpus()  # node 1's two CPUs are the actors'
        result["remote"] = {"epochs": epochs(loader, 1, images), "stats": loader.stats()}
    result["remote"].update(compare(images, ref_images))
    write(out, result)


def placement(root: str, out: str) -> None:
    """The trainer's node lends a CPU to Ray: two actors by default (one fits on node 1), then
    with ``on_trainer_node=True``; where they ran, and the free CPUs each pool counts."""
    result = {"trainer": socket.gethostname()}
    for name, extra in (("default", {}), ("on_trainer_node", {"on_trainer_node": True})):
        with dali(root, coordl.RayPrep(workers=2, local=False, **extra)) as loader:
            wait_actors(loader, 1 if name == "default" else 2, timeout=120)
            wait_actors(loader, 2, timeout=5)  # by default the second has no CPU it may take
            pool = loader.resources.remote.pool
            run = {"actors": actors(loader), "size": pool.size, "free_cpus": pool.free_cpus()}
            run["cluster_free_cpus"] = cluster.ray_module().available_resources().get("CPU", 0.0)
            run["ids"] = epochs(loader, 1)[0]["ids"]
        result[name] = run
        write(out, result)  # each run's as soon as it is known
    cluster.ray_module().shutdown()
    result["free_cpus_after_shutdown"] = cluster.free_cpus(False)  # the one failure that means 0
    write(out, result)


def versions(root: str, out: str, other: str) -> None:
    """Actors whose coordl is another version (``other``: a folder holding it, put first on their
    ``PYTHONPATH`` by the job's runtime environment, as another machine's install would be): the
    error the training loop gets, and how long it took."""
    import ray

    ray.init(runtime_env={"env_vars": {"PYTHONPATH": other}}, logging_level=logging.WARNING)
    t0 = time.monotonic()
    try:
        with dali(root, coordl.RayPrep(workers=1, local=False)) as loader:
            epochs(loader, 1)
        result = {"raised": None}
    except Exception as e:  # noqa: BLE001 - recorded for the test
        result = {"raised": type(e).__name__, "coordl": isinstance(e, coordl.CoordlError), "message": str(e)}
    write(out, {**result, "seconds": time.monotonic() - t0, "mine": coordl.__version__})


def address(root: str, out: str, given: str) -> None:
    """``RayPrep(address=given)``: whether the loader connects, and one epoch with an actor."""
    try:
        with dali(root, coordl.RayPrep(address=given, workers=1, local=False)) as loader:
            ids = epochs(loader, 1)[0]["ids"]
        result = {"raised": None, "ids": ids, "gcs": cluster.ray_module().get_runtime_context().gcs_address}
    except Exception as e:  # noqa: BLE001 - recorded for the test
        result = {"raised": type(e).__name__, "message": str(e)}
    write(out, result)


SCENARIOS = {f.__name__: f for f in (two_nodes, placement, versions, address)}

if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    SCENARIOS[sys.argv[1]](*sys.argv[2:])
