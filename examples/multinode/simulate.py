"""Simulates a job on several nodes on this one machine, with torchrun and the partitioned cache.

Each "node" is a network namespace joined to a bridge (node k is ``10.<net>.0.<k+1>`` on its
``eth0``) with a private tmpfs at /dev/shm, so each node has its own MinIO cache and its own
address, as a separate machine has; ``--rate`` shapes every link (``tc tbf``). In each node it
runs the torchrun command you would run on that machine:

    torchrun --nnodes N --node-rank k --nproc-per-node P --master-addr <node 0> --master-port 29500 \\
        SCRIPT DATA --cache CACHE ARGS...

SCRIPT is ``examples/imagenet/train.py`` unless ``--script`` names another, and ARGS are the
arguments after ``--``. Every line a node prints is shown as ``[node k] ...``.

    sudo python examples/multinode/simulate.py --demo                   # 2 nodes, generated data
    sudo python examples/multinode/simulate.py --data /data/imagenet-100 --nodes 4 --rate 1gbit \\
        -- -a resnet18 --epochs 3
    python examples/multinode/simulate.py --demo --no-netns             # without root

Run it by its path, from any folder, with coordl installed (``pip install -e .``): the
namespaces come from :mod:`coordl_testing.netns`, the repository's test support, which pip does
not install; the script puts the repository root on ``sys.path`` to import it. They need root,
``ip``, ``unshare`` and ``tc``.
Without them (or with ``--no-netns``) the nodes share this machine's network and /dev/shm:
node k serves its cache on 127.0.0.<k+1> and keeps it in a folder of its own
(``COORDL_SHM_DIR``); the job is the same. Whatever
happens (a node fails, Ctrl-C), every process, namespace, bridge and shm folder it made is
removed before it returns; the exit code is 0 when every node succeeded, 1 when one failed,
2 when the simulation could not start and 130 after Ctrl-C (or SIGTERM).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
# coordl_testing (the namespaces) is at the repository root, not in the installed package: the
# root goes on sys.path so that this script runs by its path from any folder.
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from coordl.units import format_bytes, parse_bytes  # noqa: E402
from coordl_testing import netns  # noqa: E402  (namespaces, bridge, private /dev/shm)

TRAIN = ROOT / "examples" / "imagenet" / "train.py"
DEMO = Path("/tmp/coordl-multinode-demo")
# The demo dataset is small, so the demo trains a small model on small images by default, and
# keeps its checkpoints next to the data (arguments after -- come later and win).
DEMO_ARGS = ["-a", "resnet_tiny", "--image-size", "64", "--epochs", "3", "-b", "32", "-j", "2", "-p", "100"]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    args = _parser().parse_args(argv[: len(argv) - len(extra) - (1 if "--" in argv else 0)])
    if args.nodes < 1 or args.nproc_per_node < 1:
        print("simulate: --nodes and --nproc-per-node must be at least 1", file=sys.stderr)
        return 2
    script = Path(args.script) if args.script else TRAIN
    if not script.is_file():
        print(f"simulate: no training script at {script}; pass --script PATH", file=sys.stderr)
        return 2
    data = Path(args.data) if args.data else (DEMO if args.demo else None)
    if data is None:
        print("simulate: give --data DIR (with train/ and val/) or --demo", file=sys.stderr)
        return 2
    why = "--no-netns was given" if args.no_netns else netns.unavailable()
    if why and args.rate:
        print(f"simulate: --rate needs network namespaces, which cannot be used: {why}", file=sys.stderr)
        return 2
    if args.demo:
        _make_demo(data)
    if args.script is None and not ((data / "train").is_dir() and (data / "val").is_dir()):
        print(f"simulate: {data} must hold train/ and val/ folders (or use --demo)", file=sys.stderr)
        return 2
    if args.demo and args.script is None:
        extra = [*DEMO_ARGS, "--checkpoint-dir", str(data / "checkpoints"), *extra]

    if why:
        print(
            f"simulate: no network namespaces ({why}); the nodes share this machine's network "
            "(127.0.0.<k+1>) and /dev/shm (a folder per node)",
            flush=True,
        )
    try:
        shm_bytes = parse_bytes(args.shm) if args.shm != "auto" else _auto_shm(data)
    except ValueError as e:
        print(f"simulate: --shm: {e}", file=sys.stderr)
        return 2
    command = [str(script), str(data), "--cache", args.cache, *extra]
    t0 = time.monotonic()
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)  # a scheduler's or `kill`'s: cleaned up as Ctrl-C is
    try:
        codes = _run_on_loopback(args, command) if why else _run_in_namespaces(args, command, shm_bytes)
    except KeyboardInterrupt:  # before the nodes ran; what was made is removed
        codes = None
    took = time.monotonic() - t0
    if codes is None:
        print(f"simulate: interrupted after {took:.1f} s; every node stopped and cleaned up", flush=True)
        return 130
    failed = [str(k) for k, c in enumerate(codes) if c not in (0, None)]
    stopped = [str(k) for k, c in enumerate(codes) if c is None]
    verdict = f"FAILED on node(s) {', '.join(failed)}" if failed else "finished"
    if stopped:  # only ever after another node failed
        verdict += f", stopped node(s) {', '.join(stopped)}"
    shown = ", ".join("stopped" if c is None else str(c) for c in codes)
    print(
        f"simulate: {args.nodes} node(s) x {args.nproc_per_node} rank(s) {verdict} in {took:.1f} s "
        f"(exit codes [{shown}])",
        flush=True,
    )
    return 1 if failed or stopped else 0


def _interrupt(signum, frame) -> None:
    # The first Ctrl-C (or SIGTERM) stops the nodes; a second must not interrupt the cleanup.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise KeyboardInterrupt


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="%(prog)s [options] [-- ARGS for the training script]",
    )
    p.add_argument("--data", help="dataset folder with train/ and val/ (ImageFolder trees), the same on every node")
    p.add_argument(
        "--demo",
        action="store_true",
        help=f"generate a small dataset (512 + 128 JPEGs, 10 classes) in --data, else {DEMO}",
    )
    p.add_argument("--nodes", type=int, default=2, help="simulated nodes (default 2)")
    p.add_argument("--nproc-per-node", type=int, default=1, help="ranks per node (default 1)")
    p.add_argument(
        "--cache",
        default="0.6",
        help="cache budget per node, passed to the script: a fraction of the dataset (0.6: two "
        "nodes hold it all), bytes ('2GB') or 'auto' (default 0.6)",
    )
    p.add_argument("--rate", help="link rate of every node, e.g. 1gbit or 100mbit (default: unshaped)")
    p.add_argument(
        "--shm",
        default="auto",
        help="size of each node's /dev/shm, e.g. 4GB (default: twice the dataset, at least 256MB, "
        "at most this machine's /dev/shm)",
    )
    p.add_argument("--master-port", type=int, default=None, help="torchrun's port (default 29500, or a free one)")
    p.add_argument("--script", help=f"training script to run (default {TRAIN.relative_to(ROOT)})")
    p.add_argument("--no-netns", action="store_true", help="run the nodes on loopback addresses, without root")
    p.add_argument(
        "--grace",
        type=float,
        default=30.0,
        help="seconds the other nodes get to finish once one has failed (default 30)",
    )
    return p


def _make_demo(data: Path) -> None:
    from coordl.tools.datagen import make_dataset  # a second call with the same arguments is a cheap no-op

    print(f"simulate: demo dataset in {data}", flush=True)
    make_dataset(data / "train", num_images=512, num_classes=10, seed=0, progress=False)
    make_dataset(data / "val", num_images=128, num_classes=10, seed=1, progress=False)


def _auto_shm(data: Path) -> int:
    size = sum(f.stat().st_size for f in data.rglob("*") if f.is_file())
    host = os.statvfs("/dev/shm")
    return min(max(2 * size, 256 << 20), host.f_blocks * host.f_frsize)


def _environment() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("COORDL_SHM")}
    # The nodes import coordl from this checkout, whatever else is installed; print lines as they come.
    env["PYTHONPATH"] = os.pathsep.join(x for x in [str(ROOT / "src"), env.get("PYTHONPATH")] if x)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _torchrun(args, k: int, master: str, port: int, command: list[str]) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        str(args.nodes),
        "--node-rank",
        str(k),
        "--nproc-per-node",
        str(args.nproc_per_node),
        "--master-addr",
        master,
        "--master-port",
        str(port),
        *command,
    ]


def _run_in_namespaces(args, command: list[str], shm_bytes: int) -> list[int | None] | None:
    env = _environment()
    env["GLOO_SOCKET_IFNAME"] = "eth0"  # gloo's interface; coordl's servers then use its address too
    port = args.master_port or 29500  # every namespace has its own ports
    with netns.Cluster(args.nodes, rate=args.rate, shm_bytes=shm_bytes) as cluster:
        rate = f", links at {args.rate}" if args.rate else ""
        print(
            f"simulate: {args.nodes} network namespaces on bridge {cluster.bridge}, node k at "
            f"{cluster.address(0)[:-1]}<k+1>, /dev/shm of {format_bytes(shm_bytes, 'MB', digits=0)} each{rate}",
            flush=True,
        )
        nodes = []

        def pids():
            return [_namespace_pids(ns) for ns in cluster.ns]

        try:
            for k in range(args.nodes):
                argv = _torchrun(args, k, cluster.address(0), port, command)
                print(f"simulate: node {k}: {_show(argv)}", flush=True)
                nodes.append(cluster.popen(k, argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
            return _supervise(nodes, args.grace, pids)
        finally:
            _stop(nodes, pids)  # also what a crashed torchrun left in its namespace
    # Cluster.close (the with) removed the namespaces, their /dev/shm mounts, the links and the bridge.


def _run_on_loopback(args, command: list[str]) -> list[int | None] | None:
    env = _environment()
    port = args.master_port or _free_port()
    shm = [Path(f"/dev/shm/coordl-simulate-{os.getpid()}-node{k}") for k in range(args.nodes)]
    nodes = []
    try:
        for k in range(args.nodes):
            shm[k].mkdir()
            node_env = dict(env, COORDL_SHM_DIR=str(shm[k]), COORDL_PEER_ADDR=f"127.0.0.{k + 1}")
            argv = _torchrun(args, k, "127.0.0.1", port, command)
            print(
                f"simulate: node {k}: COORDL_SHM_DIR={shm[k]} COORDL_PEER_ADDR=127.0.0.{k + 1} {_show(argv)}",
                flush=True,
            )
            nodes.append(
                subprocess.Popen(
                    argv, env=node_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
                )
            )
        return _supervise(nodes, args.grace, lambda: [_descendants(p.pid) for p in nodes])
    finally:
        _stop(nodes, lambda: [_descendants(p.pid) for p in nodes])
        for path in shm:
            shutil.rmtree(path, ignore_errors=True)


def _supervise(nodes: list[subprocess.Popen], grace: float, pids) -> list[int | None] | None:
    """Shows every node's output, prefixed, until all have exited; None on Ctrl-C, else each node's
    exit code, or None for a node stopped because another failed.

    Once a node fails, the others get ``grace`` seconds to finish: a node waiting for a dead
    one in a collective (or torchrun's agent at its exit barrier) would wait for minutes.
    """
    lock = threading.Lock()
    pumps = [threading.Thread(target=_pump, args=(k, p.stdout, lock), daemon=True) for k, p in enumerate(nodes)]
    for t in pumps:
        t.start()
    interrupted = []
    try:
        deadline = None
        while None in [p.poll() for p in nodes]:  # a list: poll every node, each time
            if deadline is None and any(p.returncode not in (None, 0) for p in nodes):
                deadline = time.monotonic() + grace
            if deadline is not None and time.monotonic() > deadline:
                with lock:
                    print(f"simulate: a node failed; stopping the others after {grace:.0f} s", flush=True)
                break
            time.sleep(0.2)
    except KeyboardInterrupt:
        interrupted.append(True)
        with lock:
            print("simulate: interrupted; stopping every node", flush=True)
    finally:
        stopped = [p.poll() is None for p in nodes]
        _stop(nodes, pids, wait=10.0 if interrupted else 2.0)  # time to save a checkpoint on Ctrl-C
        for t in pumps:
            t.join(5)
    return None if interrupted else [None if s else p.returncode for p, s in zip(nodes, stopped)]


def _pump(k: int, stream, lock: threading.Lock) -> None:
    for line in iter(stream.readline, b""):
        with lock:
            sys.stdout.write(f"[node {k}] {line.decode(errors='replace')}")
            sys.stdout.flush()
    stream.close()


def _stop(nodes: list[subprocess.Popen], pids, wait: float = 10.0) -> None:
    """Stops every node that still runs: SIGTERM to torchrun, which stops its workers, then SIGKILL
    to whatever is left (torchrun starts its workers in sessions of their own)."""
    alive = [p for p in nodes if p.poll() is None]
    leftovers = {pid for group in pids() for pid in group}
    for p in alive:
        _signal(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline and any(p.poll() is None for p in alive):
        time.sleep(0.1)
    leftovers |= {pid for group in pids() for pid in group}
    for pid in leftovers | {p.pid for p in alive if p.poll() is None}:
        _signal(pid, signal.SIGKILL)
    for p in alive:
        p.wait()


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _namespace_pids(ns: str) -> list[int]:
    out = subprocess.run(["ip", "netns", "pids", ns], check=False, capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


def _descendants(root: int) -> list[int]:
    """Every process below ``root``, from /proc (a snapshot)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _show(argv: list[str]) -> str:
    """The command as a user types it: ``torchrun ...`` with paths relative to the repository."""
    words = ["torchrun", *argv[3:]]
    return " ".join(os.path.relpath(w, ROOT) if w.startswith(str(ROOT)) else w for w in words)


if __name__ == "__main__":
    sys.exit(main())
