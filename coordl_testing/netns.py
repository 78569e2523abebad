"""Several "nodes" on one machine: a network namespace and a private /dev/shm per node.

:class:`Cluster` makes a bridge and, per node, a namespace joined to it by a veth pair
(node k is ``10.<net>.0.<k+1>``), optionally shapes every link with ``tbf``, and runs
commands in a node with ``ip netns exec`` and ``unshare -m``, so that each node sees its
own tmpfs at /dev/shm as a separate machine would; ``popen(..., cgroups=[...])`` also puts a
node's command into v1 cgroups of its own (a blkio throttle, say) and lets it read its own
counters there; ``popen(..., hostname=...)`` gives the command a host name of its own. Everything
it makes is removed on exit, and the names carry the process id and a count of the process's
clusters, so that clusters can exist side by side. Needs root, ``ip`` and ``unshare``;
:func:`unavailable` says why not when they are missing.

Used by ``examples/multinode/simulate.py``, ``benchmarks/multinode.py`` and the multi-node
tests. It is test support, not part of the installed package: the example puts the repository
root on ``sys.path`` to import it, so that it still runs by its path from any folder.
"""

from __future__ import annotations

import itertools
import os
import shlex
import shutil
import signal
import subprocess
import time

__all__ = ["Cluster", "unavailable"]


_V1 = "/sys/fs/cgroup"
_made = itertools.count()  # clusters made by this process


def _hierarchy(path: str) -> str:
    """The v1 hierarchy (``blkio``, ``memory``...) of a cgroup folder below /sys/fs/cgroup."""
    rel = os.path.relpath(os.path.realpath(path), _V1)
    if rel.startswith(".."):
        raise ValueError(f"{path} is not a v1 cgroup folder below {_V1}")
    return rel.split(os.sep)[0]


def _kill_all(members, timeout: float = 10.0) -> None:
    """SIGKILLs the pids ``members()`` lists until it lists none (or ``timeout`` passes)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pids = members()
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)


def _kill_members(path: str, timeout: float = 10.0) -> None:
    """SIGKILLs every process in the cgroup ``path`` and waits until it is empty."""

    def members() -> list[int]:
        try:
            with open(os.path.join(path, "cgroup.procs")) as f:
                return [int(x) for x in f.read().split()]
        except FileNotFoundError:
            return []

    _kill_all(members, timeout)


def _kill_netns_members(ns: str, timeout: float = 10.0) -> None:
    """SIGKILLs every process in network namespace ``ns`` and waits until none is left."""

    def members() -> list[int]:
        out = subprocess.run(["ip", "netns", "pids", ns], check=False, capture_output=True, text=True).stdout
        return [int(x) for x in out.split()]

    _kill_all(members, timeout)


def _run(*argv: str) -> None:
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def unavailable() -> str | None:
    """Why network namespaces cannot be used here, or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "unshare", "tc"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    name = f"cdlp{os.getpid() % 100000}"
    try:
        _run("ip", "netns", "add", name)
    except subprocess.CalledProcessError as e:
        return f"ip netns add failed: {e.stderr.decode().strip()}"
    _run("ip", "netns", "del", name)
    return None


class Cluster:
    """``nodes`` namespaces on one bridge.

    Args:
        nodes: how many.
        rate: ``tbf`` rate of every link in both directions (e.g. ``"1gbit"``), or None.
        shm_bytes: size of each node's private /dev/shm.
    """

    def __init__(self, nodes: int, *, rate: str | None = None, shm_bytes: int = 256 << 20):
        self.nodes = nodes
        self.rate = rate
        self.shm_bytes = shm_bytes
        tag = f"{os.getpid() % 10000}{next(_made) % 10}"  # two clusters of one process side by side
        self.net = 77 + os.getpid() % 100  # 10.<net>.0.0/24
        self.bridge = f"cdlb{tag}"
        self.ns = [f"cdln{tag}_{k}" for k in range(nodes)]
        self.veth = [f"cdlv{tag}_{k}" for k in range(nodes)]
        self.procs: list[subprocess.Popen] = []
        self.cgroups: list[str] = []  # given to popen: close() empties them

    def address(self, k: int) -> str:
        return f"10.{self.net}.0.{k + 1}"

    def __enter__(self):
        try:
            _run("ip", "link", "add", self.bridge, "type", "bridge")
            _run("ip", "link", "set", self.bridge, "up")
            for k in range(self.nodes):
                ns, veth = self.ns[k], self.veth[k]
                _run("ip", "netns", "add", ns)
                _run("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
                _run("ip", "link", "set", veth, "master", self.bridge)
                _run("ip", "link", "set", veth, "up")
                _run("ip", "netns", "exec", ns, "ip", "addr", "add", f"{self.address(k)}/24", "dev", "eth0")
                _run("ip", "netns", "exec", ns, "ip", "link", "set", "eth0", "up")
                _run("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
                if self.rate:
                    tbf = ["root", "tbf", "rate", self.rate, "burst", "256kb", "latency", "50ms"]
                    _run("tc", "qdisc", "add", "dev", veth, *tbf)  # towards the node
                    _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "eth0", *tbf)  # from the node
        except BaseException:
            self.close()
            raise
        return self

    def popen(
        self,
        k: int,
        argv: list[str],
        *,
        env: dict | None = None,
        cgroups: list[str] | None = None,
        hostname: str | None = None,
        **kwargs,
    ) -> subprocess.Popen:
        """Starts ``argv`` in node ``k``, with a private tmpfs at /dev/shm.

        Args:
            k: the node.
            argv: the command.
            env: its environment.
            cgroups: v1 cgroup folders of this command alone (``/sys/fs/cgroup/<controller>/...``,
                made by the caller), which it joins before it enters the namespace, so that every
                process it starts is in them too. ``ip netns exec`` hides the host's /sys/fs/cgroup,
                so each of their hierarchies is mounted again (read-only) inside the node at the same
                path, where the command can read its own counters (``blkio.throttle.io_service_bytes``,
                say). :meth:`close` kills whatever is left in them: launchers such as torchrun start
                their workers in sessions of their own, out of reach of a process-group kill. The
                caller removes the cgroups after :meth:`close`.
            hostname: the command's host name, in a UTS namespace of its own (``unshare -u``), as
                a separate machine has one; None: the host's.
            **kwargs: passed to :class:`subprocess.Popen`.
        """
        for path in cgroups or ():
            if os.path.dirname(os.path.realpath(path)) == _V1:
                raise ValueError(f"{path} is the root of a cgroup hierarchy; give the node a cgroup of its own")
        inner = [f"mount -t tmpfs -o size={self.shm_bytes},mode=1777 tmpfs /dev/shm"]
        if hostname is not None:
            inner.append(f"hostname {shlex.quote(hostname)}")
        outer = []
        if cgroups:
            inner.append("mount -t tmpfs -o size=1m,mode=755 tmpfs /sys/fs/cgroup")
            for hierarchy in sorted({_hierarchy(path) for path in cgroups}):
                where = shlex.quote(f"{_V1}/{hierarchy}")
                inner.append(f"mkdir -p {where} && mount -t cgroup -o ro,{hierarchy} cgroup {where}")
            outer = [f"echo $$ > {shlex.quote(os.path.join(path, 'cgroup.procs'))}" for path in cgroups]
        script = " && ".join([*inner, 'exec "$@"'])
        full = [
            "ip",
            "netns",
            "exec",
            self.ns[k],
            "unshare",
            "-m",
            *(["-u"] if hostname is not None else []),
            "--propagation",
            "private",
            "sh",
            "-c",
            script,
            "sh",
            *argv,
        ]
        if outer:  # join the cgroups first: everything below inherits them
            full = ["sh", "-c", " && ".join([*outer, 'exec "$@"']), "sh", *full]
        p = subprocess.Popen(full, env=env, start_new_session=True, **kwargs)
        self.procs.append(p)
        self.cgroups.extend(cgroups or ())
        return p

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait()
        self.procs.clear()
        for path in self.cgroups:
            _kill_members(path)
        self.cgroups.clear()
        for ns in self.ns:
            _kill_netns_members(ns)  # torchrun's workers run in sessions of their own
            subprocess.run(["ip", "netns", "del", ns], check=False, stderr=subprocess.DEVNULL)
        for veth in self.veth:
            subprocess.run(["ip", "link", "del", veth], check=False, stderr=subprocess.DEVNULL)
        subprocess.run(["ip", "link", "del", self.bridge], check=False, stderr=subprocess.DEVNULL)

    def __exit__(self, *exc) -> None:
        self.close()
