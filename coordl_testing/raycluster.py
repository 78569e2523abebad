"""Real Ray clusters for the tests of RayPrep: on loopback in a namespace of its own
(:class:`RayCluster`), or a node per "machine" (:class:`RayNodes`, at the end).

Ray replaces 127.0.0.1 with the machine's interface address, so the cluster and every driver run
in a private network namespace with only loopback up: nothing outside it can join, and it sees
no other cluster on the machine. :class:`RayCluster` starts ``python -m coordl_testing.raycluster``
under ``unshare -n``; that process starts ``ray.cluster_utils.Cluster`` (a head and more nodes, each
with its own raylet and object store), prints one JSON line (address, session folder, the pids of
the processes Ray started), and shuts the cluster down when its stdin closes. Drivers join the
namespace with ``nsenter -t <pid> -n`` (:meth:`RayCluster.popen`).

:meth:`RayCluster.close` closes that stdin, waits, then SIGKILLs what survived: the processes
started under the cluster's process (seen before it exits), every process still in its network
namespace (drivers included), and every process whose command line names the cluster's own
temporary folder (Ray's session folder is in it: raylets, the GCS), each checked by its start
time, so that a recycled pid is left alone. Nothing else on the machine is touched: other
sessions may run Ray too (never ``ray stop``).

Needs root, ``unshare``, ``nsenter`` and ``ip``, and Ray; :func:`unavailable` says why not.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

__all__ = ["RayCluster", "RayNodes", "unavailable"]

ROOT = Path(__file__).resolve().parents[1]  # the repository root: coordl_testing imports from it
QUIET = {  # Ray's settings for a cluster of 1-CPU nodes on a shared machine
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_enable_worker_prestart": "0",  # no idle workers: actors of coordl get workers of their own
    "RAY_prestart_worker_first_driver": "0",
    # Ray starts its workers at nice 15: against a busy loop at nice 0 on the same core (the suite runs
    # with one per core, as a training node's cores are busy), an actor gets about 3% of a core and
    # takes minutes to start. The cluster here shares the test's cores; docs/remote-prep.md says the same.
    "RAY_worker_niceness": "0",
}


def unavailable() -> str | None:
    """Why a cluster cannot start here (None: it can)."""
    if os.geteuid() != 0:
        return "needs root (a network namespace per cluster: unshare -n)"
    missing = [tool for tool in ("unshare", "nsenter", "ip") if shutil.which(tool) is None]
    if missing:
        return f"needs {', '.join(missing)} (util-linux, iproute2)"
    try:
        import ray  # noqa: F401
    except ImportError:
        return "needs Ray: pip install 'coordl[ray]'"
    probe = subprocess.run(["unshare", "-n", "ip", "link", "set", "lo", "up"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"unshare -n is refused here: {probe.stderr.strip()}"
    return None


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time in ticks) of a live process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return int(fields[1]), int(fields[19])


def _netns(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/net")
    except OSError:
        return None


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def _pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def descendants(root: int) -> dict[int, int]:
    """The live descendants of ``root``: pid -> start time."""
    parent, start = {}, {}
    for pid in _pids():
        s = _stat(pid)
        if s is not None:
            parent[pid], start[pid] = s
    out, frontier = {}, {root}
    while frontier:
        frontier = {pid for pid, ppid in parent.items() if ppid in frontier and pid not in out}
        out.update({pid: start[pid] for pid in frontier})
    return out


class RayCluster:
    """A Ray cluster on loopback in a network namespace of its own (see the module's docstring).

    Args:
        nodes: Ray nodes (the head and ``nodes - 1`` more).
        cpus: Ray CPUs per node, or of each node (the head's first; 0 lends none, as the docs say of
            the trainer's node, whose driver Ray attaches to the head).
        object_store_mb: each node's object store.
        env: the cluster's environment (Ray's workers inherit it: put the coordl under test on
            its ``PYTHONPATH``).
        timeout: seconds to wait for the cluster to start.
    """

    def __init__(self, nodes: int = 2, cpus=1, object_store_mb: int = 128, env=None, timeout: float = 60.0):
        self._stderr = open(os.devnull, "w")  # noqa: SIM115 - closed in close()
        log = os.environ.get("COORDL_RAY_CLUSTER_LOG")  # where Ray's own complaints go, to debug a start
        if log:
            self._stderr = open(log, "a")  # noqa: SIM115
        script = 'ip link set lo up && exec "$0" -m coordl_testing.raycluster "$@"'
        self.temp_dir = tempfile.mkdtemp(prefix="coordl-ray-")  # Ray's sessions: not in /tmp/ray, which others use
        per_node = [cpus] * nodes if isinstance(cpus, int) else list(cpus)
        if len(per_node) != nodes:
            raise ValueError(f"cpus: {len(per_node)} values for {nodes} nodes")
        args = [str(nodes), ",".join(map(str, per_node)), str(object_store_mb), self.temp_dir]
        self.process = subprocess.Popen(
            ["unshare", "-n", "sh", "-c", script, sys.executable, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            env={**(env if env is not None else os.environ), **QUIET},
            cwd=ROOT,
        )
        self.pid = self.process.pid
        self._seen: dict[int, int] = {}  # pid -> start time: every process seen under the cluster's
        self.info: dict = {}
        self.netns = None
        try:
            self.info = self._read_info(timeout)
        except BaseException:
            self.close()
            raise
        self.netns = _netns(self.pid)
        self.address: str = self.info["address"]
        self.session_dir: str = self.info["session_dir"]
        self.watch()

    def _read_info(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        line = b""
        while not line.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0 or self.process.poll() is not None:
                how = f"exited with status {self.process.returncode}" if left > 0 else f"timed out ({timeout:.0f} s)"
                raise RuntimeError(
                    f"the Ray cluster's process {how} before it printed its address; "
                    "set COORDL_RAY_CLUSTER_LOG=<file> to keep its stderr"
                )
            ready, _, _ = select.select([self.process.stdout], [], [], min(left, 0.5))
            if ready:
                chunk = os.read(self.process.stdout.fileno(), 4096)
                if not chunk:
                    continue
                line += chunk
        return json.loads(line)

    def watch(self) -> None:
        """Records the processes now under the cluster's process (call it while drivers run: a
        worker whose raylet is gone would no longer be found under it)."""
        for pid in self.info.get("pids", []):
            s = _stat(pid)
            if s is not None:
                self._seen.setdefault(pid, s[1])
        self._seen.update(descendants(self.pid))

    def env(self, **extra) -> dict:
        """A driver's environment: this cluster's address in ``RAY_ADDRESS``, and ``extra``."""
        return {**os.environ, "RAY_ADDRESS": self.address, **{k: str(v) for k, v in extra.items()}}

    def popen(self, argv: list[str], **kwargs) -> subprocess.Popen:
        """Runs ``argv`` in the cluster's network namespace (``nsenter -n``, which execs it: the
        process's pid is the command's)."""
        return subprocess.Popen(["nsenter", "-t", str(self.pid), "-n", *argv], **kwargs)

    def members(self) -> dict[int, int]:
        """The live processes of this cluster: seen under its process, in its network namespace, or
        naming its temporary folder (Ray's session folder is in it) on their command line (pid ->
        start time); never this process or its parents."""
        mine = {os.getpid(), os.getppid(), 1}
        out = {}
        for pid, start in self._seen.items():
            s = _stat(pid)
            if s is not None and s[1] == start:
                out[pid] = start
        ours = self.netns is not None and self.netns != _netns(os.getpid())
        for pid in _pids():
            if (ours and _netns(pid) == self.netns) or self.temp_dir.encode() in _cmdline(pid):
                s = _stat(pid)
                if s is not None:
                    out[pid] = s[1]
        return {pid: start for pid, start in out.items() if pid not in mine}

    def close(self, timeout: float = 30.0) -> list[int]:
        """Shuts the cluster down, then SIGKILLs every process of it that survived. Returns the
        pids that had to be killed. Idempotent."""
        if self.process.returncode is None:
            self.watch()
        if self.process.stdin is not None and not self.process.stdin.closed:
            self.process.stdin.close()
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        killed = []
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            left = self.members()
            if not left:
                break
            for pid, start in left.items():
                s = _stat(pid)
                if s is not None and s[1] == start:
                    try:
                        os.kill(pid, signal.SIGKILL)
                        killed.append(pid)
                    except ProcessLookupError:
                        pass
            time.sleep(0.1)
        if self.process.stdout is not None:
            self.process.stdout.close()
        self._stderr.close()
        shutil.rmtree(self.temp_dir, ignore_errors=True)
        return sorted(set(killed))

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class RayNodes:
    """Ray on separate "machines" of this host: each node a network namespace of its own on a
    bridge (:class:`coordl_testing.netns.Cluster`, node k at ``10.<net>.0.<k+1>``), with its own
    tmpfs at /dev/shm, host name and /etc/hosts (which names every node, as a cluster's DNS
    would: Ray finds a driver's node address from its host name). Node 0 runs the head
    (``ray start --head --block``), the others ``ray start --address=<node 0>:6379 --block``, each
    with its own temporary folder. Commands run in a node with :meth:`popen`
    (``nsenter`` into the node's namespaces, held by a process that sleeps there).

    :meth:`close` SIGTERMs the ``ray start`` processes it started (Ray ends the processes each
    started), then SIGKILLs whatever is left in the nodes' network namespaces (drivers and
    actors included), and removes the namespaces, the bridge and the temporary folders; it
    returns the pids it had to kill. Never ``ray stop``: other sessions may run Ray.

    Args:
        cpus: Ray CPUs of each node (``cpus[0]``: the head's; 0 lends none, as on a trainer's machine).
        object_store_mb: each node's object store.
        env: the nodes' environment (Ray's workers inherit it: put the coordl under test on its
            ``PYTHONPATH``).
        timeout: seconds to wait for every node to join.
        ipv6: the nodes talk over IPv6 (``fd00:<net>::<k+1>``): Ray's nodes, and its head's address
            (``[fd00:<net>::1]:6379``).
    """

    PORT = 6379

    def __init__(self, cpus=(0, 1), object_store_mb: int = 128, env=None, timeout: float = 90.0, ipv6: bool = False):
        from coordl_testing import netns

        self.net = netns.Cluster(len(cpus), shm_bytes=(object_store_mb + 256) << 20)
        self.temp_dir = tempfile.mkdtemp(prefix="coordl-raynodes-")
        self.hostnames = [f"{self.net.bridge}-node{k}" for k in range(len(cpus))]
        self.ipv6 = ipv6
        self.address = f"[{self.ip(0)}]:{self.PORT}" if ipv6 else f"{self.ip(0)}:{self.PORT}"
        self.holders: list[subprocess.Popen] = []
        self.ray: list[subprocess.Popen] = []  # the `ray start --block` of each node
        self._log = open(os.environ.get("COORDL_RAY_CLUSTER_LOG") or os.devnull, "a")  # noqa: SIM115
        # A token of this cluster's own (Ray's head enables token authentication), in the environment:
        # never ~/.ray/auth_token, which other clusters on this machine would read.
        token = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
        self.env = {**(env if env is not None else os.environ), **QUIET, **token}
        self.nodes: list[dict] = []  # Ray's view of each node, in node order (node id, address, host name)
        try:
            self.net.__enter__()
            for k, ns in enumerate(self.net.ns if ipv6 else ()):  # beside the IPv4 one; nodad: usable at once
                cmd = ["ip", "-n", ns, "addr", "add", f"{self.ip(k)}/64", "dev", "eth0", "nodad"]
                subprocess.run(cmd, check=True, capture_output=True)
            hosts = os.path.join(self.temp_dir, "hosts")
            with open(hosts, "w") as f:
                f.write("127.0.0.1 localhost\n::1 localhost\n")
                f.writelines(f"{self.ip(k)} {name}\n" for k, name in enumerate(self.hostnames))
            hold = 'mount --bind "$0" /etc/hosts && echo ready && exec sleep infinity'
            for k, name in enumerate(self.hostnames):
                holder = self.net.popen(k, ["sh", "-c", hold, hosts], hostname=name, stdout=subprocess.PIPE)
                self.holders.append(holder)
                # Its namespaces are the node's once it has made them: nsenter before then would
                # enter this machine's mounts and host name.
                if holder.stdout.readline() != b"ready\n":
                    raise RuntimeError(f"node {k}'s namespaces could not be made (exit status {holder.wait()})")
            for k, n in enumerate(cpus):
                self.ray.append(self._start(k, n, object_store_mb))
            self.nodes = self._wait(len(cpus), timeout)
        except BaseException:
            self.close()
            raise

    def _start(self, k: int, cpus: int, object_store_mb: int) -> subprocess.Popen:
        temp = os.path.join(self.temp_dir, f"node{k}")
        os.makedirs(temp)
        where = (
            ["--head", f"--port={self.PORT}", "--include-dashboard=false"] if k == 0 else [f"--address={self.address}"]
        )
        argv = [
            shutil.which("ray", path=os.path.dirname(sys.executable)) or "ray",  # this Python's Ray
            "start",
            *where,
            f"--node-ip-address={self.ip(k)}",
            f"--num-cpus={cpus}",
            f"--object-store-memory={object_store_mb << 20}",
            f"--temp-dir={temp}",
            "--disable-usage-stats",
            "--block",
        ]
        env = {**self.env, "RAY_TMPDIR": temp}  # Ray's address file, not /tmp/ray's, which others use
        return self.popen(k, argv, env=env, stdout=self._log, stderr=self._log)

    def _wait(self, n: int, timeout: float) -> list[dict]:
        """Waits until ``n`` nodes are alive, from a driver on node 0; Ray's view of each."""
        probe = (
            "import json, sys, time, ray\n"
            "ray.init(address=sys.argv[1], logging_level='ERROR')\n"
            "deadline = time.monotonic() + float(sys.argv[3])\n"
            "while True:\n"
            "    nodes = [n for n in ray.nodes() if n['Alive']]\n"
            "    if len(nodes) >= int(sys.argv[2]) or time.monotonic() > deadline: break\n"
            "    time.sleep(0.2)\n"
            "keys = ('NodeID', 'NodeManagerAddress', 'NodeManagerHostname', 'Resources')\n"
            "sys.stderr.write('NODES ' + json.dumps([{k: n[k] for k in keys} for n in nodes]) + '\\n')\n"
        )
        p = self.popen(
            0,
            [sys.executable, "-c", probe, self.address, str(n), str(timeout)],
            env=self.env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            _, err = p.communicate(timeout=timeout + 30)
        except subprocess.TimeoutExpired:
            p.kill()
            _, err = p.communicate()
        found = [line[6:] for line in err.splitlines() if line.startswith("NODES ")]
        nodes = json.loads(found[-1]) if found else []
        if len(nodes) < n:
            raise RuntimeError(
                f"{len(nodes)} of {n} Ray nodes joined within {timeout:.0f} s (set COORDL_RAY_CLUSTER_LOG=<file> to "
                f"keep Ray's output):\n{err[-2000:]}"
            )
        by_address = {node["NodeManagerAddress"]: node for node in nodes}
        return [by_address[self.ip(k)] for k in range(n)]

    def ip(self, k: int) -> str:
        """Node ``k``'s address: ``10.<net>.0.<k+1>``, or with ``ipv6`` ``fd00:<net>::<k+1>``."""
        return f"fd00:{self.net.net}::{k + 1}" if self.ipv6 else self.net.address(k)

    def driver_env(self, **extra) -> dict:
        """A driver's environment: the nodes' (their token), this cluster's address in ``RAY_ADDRESS``,
        and ``extra``."""
        return {**self.env, "RAY_ADDRESS": self.address, **{k: str(v) for k, v in extra.items()}}

    def popen(self, k: int, argv: list[str], **kwargs) -> subprocess.Popen:
        """Runs ``argv`` on node ``k``: its network, mounts (/dev/shm) and host name."""
        ns = ["nsenter", "-t", str(self.holders[k].pid), "-n", "-m", "-u", f"--wd={kwargs.pop('cwd', ROOT)}"]
        return subprocess.Popen([*ns, *argv], **kwargs)

    def shm(self, k: int) -> list[str]:
        """What node ``k``'s /dev/shm holds."""
        return sorted(os.listdir(f"/proc/{self.holders[k].pid}/root/dev/shm"))

    def members(self) -> list[int]:
        """The live processes in the nodes' network namespaces."""
        out = []
        for ns in self.net.ns:
            listed = subprocess.run(["ip", "netns", "pids", ns], check=False, capture_output=True, text=True)
            out += [int(pid) for pid in listed.stdout.split()]
        holders = {p.pid for p in self.holders}
        return sorted(pid for pid in out if pid not in holders)

    def close(self, timeout: float = 30.0) -> list[int]:
        """Stops the nodes (see the class's docstring). Idempotent."""
        for p in self.ray:
            if p.poll() is None:
                p.terminate()
        deadline = time.monotonic() + timeout
        for p in self.ray:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.ray.clear()
        killed = []
        while time.monotonic() < deadline + 10:
            left = self.members() if self.holders else []
            if not left:
                break
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
                except ProcessLookupError:
                    pass
            time.sleep(0.1)
        self.net.close()  # the holders, the namespaces (their tmpfs with them), the bridge
        for holder in self.holders:
            holder.stdout.close()
        self.holders.clear()
        self._log.close()
        shutil.rmtree(self.temp_dir, ignore_errors=True)
        return sorted(set(killed))

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def main(argv: list[str] | None = None) -> None:
    """The cluster's process (in its network namespace): starts the nodes, prints their address,
    and shuts them down when stdin closes."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("nodes", type=int)
    parser.add_argument("cpus", help="each node's CPUs, comma-separated")
    parser.add_argument("object_store_mb", type=int)
    parser.add_argument("temp_dir")
    args = parser.parse_args(argv)
    # Cluster writes the head's address to <RAY_TMPDIR or /tmp>/ray/ray_current_cluster whatever the
    # node's temp_dir, and fails where that folder does not exist (a clean machine: no /tmp/ray until
    # some Ray has made it). Ours is in the cluster's own temp_dir, removed with it.
    os.environ["RAY_TMPDIR"] = args.temp_dir
    os.makedirs(os.path.join(args.temp_dir, "ray"), exist_ok=True)
    from ray.cluster_utils import Cluster

    store = args.object_store_mb << 20
    cpus = [int(n) for n in args.cpus.split(",")]
    head = {"num_cpus": cpus[0], "object_store_memory": store, "include_dashboard": False, "temp_dir": args.temp_dir}
    cluster = Cluster(initialize_head=True, head_node_args=head)
    try:
        for k in range(1, args.nodes):
            cluster.add_node(num_cpus=cpus[k], object_store_memory=store)
        cluster.wait_for_nodes()
        nodes = [cluster.head_node, *cluster.worker_nodes]
        pids = [info.process.pid for n in nodes for infos in n.all_processes.values() for info in infos]
        info = {"address": cluster.address, "session_dir": cluster.head_node.get_session_dir_path(), "pids": pids}
        sys.stdout.write(json.dumps(info) + "\n")
        sys.stdout.flush()
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a ^C of the test run reaches the tests, which close this
        sys.stdin.buffer.read()  # until the tests close it (or die)
    finally:
        cluster.shutdown()


if __name__ == "__main__":
    main()
