"""RayPrep across machines: Ray nodes on separate "machines" of this host, no mocks.

Each machine is a network namespace with its own tmpfs at /dev/shm, host name and address
(:class:`coordl_testing.raycluster.RayNodes`); node 0 runs Ray's head and the trainer, node 1 a
Ray node for the actors, started with ``ray start`` as docs/remote-prep.md says. Each test runs a
user's script, ``tests/ray_nodes_driver.py``, on node 0 with the default shm folder (each
machine's own /dev/shm), and checks its exit status, stderr, the JSON it wrote, and what each
machine's /dev/shm holds afterwards.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

import coordl
from coordl.remote import address
from coordl_testing import netns, raycluster

N = 120  # samples in tiny_dataset
DRIVER = Path(__file__).with_name("ray_nodes_driver.py")
CODE = str(Path(coordl.__file__).resolve().parents[1])  # the coordl under test
REASON = "COORDL_TEST_NO_NETNS is set" if os.environ.get("COORDL_TEST_NO_NETNS") else raycluster.unavailable()
REASON = REASON or netns.unavailable()


def needs_nodes(test):
    return pytest.mark.slow(pytest.mark.skipif(REASON is not None, reason=f"Ray nodes in namespaces: {REASON}")(test))


def _env() -> dict:
    """The nodes' environment: the coordl under test, and none of the test's COORDL_* (its shm folder
    is this machine's, not the nodes')."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("COORDL_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (CODE, str(raycluster.ROOT), os.environ.get("PYTHONPATH")) if p)
    return env


def _nodes(cpus, **kw):
    nodes = raycluster.RayNodes(cpus=cpus, env=_env(), **kw)
    yield nodes
    killed = nodes.close()
    if killed:
        pytest.fail(f"processes of the Ray nodes outlived `ray start`'s shutdown and were killed: {killed}")


@pytest.fixture(scope="module")
def nodes():
    """The trainer's machine lending no CPUs (``ray start --head --num-cpus=0``), a machine of two."""
    yield from _nodes((0, 2))


@pytest.fixture(scope="module")
def lending():
    """The trainer's machine lending one CPU to Ray, a machine of one."""
    yield from _nodes((1, 1))


@pytest.fixture(scope="module")
def ipv6_nodes():
    """The two machines of :func:`nodes`, talking over IPv6 (``fd00:<net>::1`` and ``::2``)."""
    yield from _nodes((0, 1), ipv6=True)


def drive(nodes, tmp_path, scenario: str, root, *args: str, env=None, timeout: float = 300) -> dict:
    """Runs ``ray_nodes_driver.py scenario root out *args`` on node 0; its result, once it exited 0
    without a traceback."""
    out = tmp_path / f"{scenario}.json"
    env = nodes.driver_env(COORDL_INDEX_DIR=tmp_path / "index", **(env or {}))
    argv = [sys.executable, str(DRIVER), scenario, str(root), str(out), *args]
    p = nodes.popen(0, argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        _, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        _, err = p.communicate()
        err += f"\n[killed by the test after {timeout:.0f} s]"
    assert p.returncode == 0 and "Traceback" not in err, f"exit status {p.returncode}:\n{err[-4000:]}"
    assert out.exists(), f"the script wrote no result:\n{err[-4000:]}"
    return json.loads(out.read_text())


def coordl_files(nodes, k: int) -> list[str]:
    return [name for name in nodes.shm(k) if name.startswith("coordl")]


def host(actor: dict) -> str:
    return actor["worker"].rsplit(":", 1)[0]


# -- the tests -------------------------------------------------------------------------------------
@needs_nodes
def test_actors_on_another_machine_deliver_local_prep_s_epoch(nodes, tiny_dataset, tmp_path):
    """The trainer on node 0 (lending no CPUs), actors on node 1: the epoch exactly once, in local
    prep's order, bit for bit; node 1 read every sample from storage into its own cache (node 0's
    cache, which local prep filled, is another machine's); both machines' /dev/shm empty after."""
    r = drive(nodes, tmp_path, "two_nodes", tiny_dataset)
    assert r["trainer"] == nodes.hostnames[0]
    assert [host(a) for a in r["actors"]] == [nodes.hostnames[1]] * 2, r["actors"]
    assert {a["reads"] for a in r["actors"]} == {"node"}
    got, want = r["remote"]["epochs"][0], r["reference"][0]
    counts = Counter(got["ids"])
    assert set(counts) == set(range(N)) and max(counts.values()) == 1, "not every sample exactly once"
    assert (got["ids"], got["labels"]) == (want["ids"], want["labels"]), "another order than local prep's"
    assert r["remote"]["compared"] == N and r["remote"]["bad_count"] == 0, r["remote"]["bad"]
    stats = r["remote"]["stats"]
    assert stats["remote_units"] == N // 8 and stats["local_units"] == 0
    assert (stats["storage_reads"], stats["cache_hits"]) == (N, 0), stats
    assert r["free_cpus"] == 0.0, "node 1's CPUs are its actors'; node 0 lends none"
    assert coordl_files(nodes, 0) == [] and coordl_files(nodes, 1) == [], (nodes.shm(0), nodes.shm(1))


@needs_nodes
def test_actors_stay_off_the_trainer_s_node_unless_it_is_offered(lending, tiny_dataset, tmp_path):
    """The trainer's node lends a CPU to Ray: by default no actor takes it (the second of two waits
    for a CPU elsewhere) and the pool does not count it free; with ``on_trainer_node=True`` the
    second actor runs there. Once the script has left the cluster, no CPU is free to it."""
    r = drive(lending, tmp_path, "placement", tiny_dataset)
    default, offered = r["default"], r["on_trainer_node"]
    assert [host(a) for a in default["actors"]] == [lending.hostnames[1]], default
    assert default["size"] == 2 and default["cluster_free_cpus"] == 1.0, default  # the trainer's CPU, idle
    assert default["free_cpus"] == 0.0, "the pool counted the trainer's CPU as free for its actors"
    assert sorted(default["ids"]) == list(range(N))
    assert sorted(host(a) for a in offered["actors"]) == sorted(lending.hostnames), offered
    assert offered["free_cpus"] == 0.0
    assert r["free_cpus_after_shutdown"] == 0.0
    assert sorted(offered["ids"]) == list(range(N))
    assert coordl_files(lending, 0) == [] and coordl_files(lending, 1) == []


@needs_nodes
def test_an_actor_running_another_coordl_version_is_refused_naming_both(nodes, tiny_dataset, tmp_path):
    """The actors' machine imports another coordl (its version says so): the loop gets an error
    naming both versions, and nothing is prepared."""
    other = tmp_path / "other"
    shutil.copytree(Path(coordl.__file__).parent, other / "coordl")
    init = other / "coordl" / "__init__.py"
    mine = coordl.__version__
    text = init.read_text()
    assert f'__version__ = "{mine}"' in text
    init.write_text(text.replace(f'__version__ = "{mine}"', f'__version__ = "{mine}.dev7"'))
    r = drive(nodes, tmp_path, "versions", tiny_dataset, str(other))
    assert r["raised"] is not None and r["coordl"], r
    assert f"coordl {mine} on the trainer, {mine}.dev7 on {nodes.hostnames[1]}" in r["message"], r["message"]
    assert r["seconds"] < 60
    assert coordl_files(nodes, 0) == [] and coordl_files(nodes, 1) == []


# -- addresses -------------------------------------------------------------------------------------
@needs_nodes
def test_a_head_s_ipv6_address_in_brackets_connects_and_its_actors_deliver(ipv6_nodes, tiny_dataset, tmp_path):
    """``RayPrep(address="[fd00:<net>::1]:6379")``, Ray's own form of an IPv6 address: the loader
    connects (the check before ray.init took "[fd00..." for a host name) and an actor on node 1
    prepares the epoch."""
    given = ipv6_nodes.address
    assert given.startswith("[fd00:") and given.endswith("]:6379")
    r = drive(ipv6_nodes, tmp_path, "address", tiny_dataset, given, env={"RAY_ADDRESS": ""})
    assert r["raised"] is None, r
    assert sorted(r["ids"]) == list(range(N))
    assert r["gcs"] == given


@pytest.mark.parametrize(
    "given, want",
    [
        ("10.0.0.5:6379", ("10.0.0.5", 6379)),
        ("head.example:7000", ("head.example", 7000)),
        ("head", ("head", 6379)),
        ("[::1]:6379", ("::1", 6379)),
        ("[::1]", ("::1", 6379)),
        ("::1", ("::1", 6379)),
        ("fe80::1%eth0", ("fe80::1%eth0", 6379)),
        ("[2001:db8::7]:6380", ("2001:db8::7", 6380)),
        (" 10.0.0.5:6379 ", ("10.0.0.5", 6379)),
    ],
)
def test_addresses_split_into_host_and_port_and_join_back(given, want):
    assert address.split(given) == want
    host, port = want
    joined = address.join(host, port)
    assert address.split(joined) == want
    assert joined == (f"[{host}]:{port}" if ":" in host else f"{host}:{port}")


@pytest.mark.parametrize("given", ["[::1", "[head]:6379", "[::1]6379", "::g", ":6379", "head:0", "head:x", "h:65536"])
def test_a_malformed_address_is_refused_when_ray_prep_is_made(given):
    with pytest.raises(ValueError, match=r"RayPrep\(address\)"):
        coordl.RayPrep(address=given)
