"""A training script as a user writes it for several nodes, for the partitioned-cache tests.

Launched by torchrun (one per "node"), it calls ``init_process_group("gloo")``, iterates a
CoordLoader for ``--epochs`` epochs with a tiny step, and writes what every rank saw
(sample ids per batch) and ``stats()`` per epoch to ``<out>/rank<r>.json``.

``--die-rank R --die-at E,B`` makes rank R kill itself (SIGKILL) after batch B of epoch E.
``--leave-at B`` makes every rank break out of its last epoch after batch B and end the script
without ``close()`` or ``destroy_process_group()``, as many training scripts end.
``--stall R,E,B,S`` makes rank R sleep S seconds after batch B of epoch E (its node falls behind);
``--sleep-before-close R,S`` makes rank R sleep S seconds after its last epoch, before it closes
its loader (an evaluation, a checkpoint). No ``barrier()`` comes before ``close()``, so nodes
whose last epochs end out of step close their loaders at different times, as in most scripts.
Every rank adds how long its ``close()`` took (``close_s``) to its record once it has closed.
``--sigterm-at-end R`` makes rank R send itself SIGTERM after its last epoch (a preempted job),
once its record holds its pid and the time (``sigterm_at``).
``--disk DIR`` gives each node a local-storage tier in ``DIR/node<k>`` (``--peers-first 1``: asked after
the other nodes' memory). ``--coco ANNOTATIONS`` reads a COCO detection set (``data`` is its images
folder) with SSDTrain and records every sample's delivered boxes.
``--device none|auto|N`` is the loader's ``device_id`` (``none``, the default: the CPU); each rank
records the device it resolved to (``device_id``) and, per epoch, the devices its batches were on.
``--stop-at E,B`` makes every rank stop after B batches of epoch E and add its ``state_dict()``
to its record, as a job checkpoints before it is pre-empted; ``--resume STATE`` makes every rank
load that state (a JSON file) first and continue from its epoch.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time

import torch
import torch.distributed as dist

import coordl


def save(record: dict, out: str) -> None:
    """Writes ``record`` to ``<out>/rank<r>.json`` at once (a reader never sees half of it)."""
    path = os.path.join(out, f"rank{record['rank']}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(record, f)
    os.replace(path + ".tmp", path)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("data")
    p.add_argument("out")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("-b", "--batch-size", type=int, default=8)
    p.add_argument("--cache", default="0.6", help="fraction of the dataset, or bytes")
    p.add_argument("--size", type=int, default=32)
    p.add_argument("--peers", choices=("auto", "off"), default="auto")
    p.add_argument("--locality", type=int, default=1)
    p.add_argument("--step-ms", type=float, default=0.0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--die-rank", type=int, default=-1)
    p.add_argument("--die-at", default="1,2")
    p.add_argument("--peer-timeout", type=float, default=10.0)
    p.add_argument("--leave-at", type=int, default=-1)
    p.add_argument("--stop-at", default="")
    p.add_argument("--resume", default="")
    p.add_argument("--stall", default="")
    p.add_argument("--sleep-before-close", default="")
    p.add_argument("--sigterm-at-end", type=int, default=-1)
    p.add_argument("--coco", default="", help="a COCO annotations file: data is its images, the recipe SSDTrain")
    p.add_argument("--disk", default="", help="a local-storage tier per node: DISK/node<k>")
    p.add_argument("--peers-first", type=int, default=0, help="with --disk: Disk(peers_first=...)")
    p.add_argument("--device", default="none", help="device_id: none (the CPU), auto, or a GPU number")
    a = p.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    cache = float(a.cache) if "." in a.cache else int(a.cache)
    if a.disk:  # each node its own tier, as each machine has its own drive
        folder = os.path.join(a.disk, f"node{os.environ['GROUP_RANK']}")  # the node's drive, mounted
        os.makedirs(folder, exist_ok=True)
        cache = coordl.Cache(size=cache, disk=coordl.Disk(folder, peers_first=bool(a.peers_first)))
    data, recipe = a.data, coordl.ImageNetTrain(size=a.size)
    if a.coco:
        data, recipe = coordl.Index.from_coco(a.data, a.coco), coordl.SSDTrain(size=a.size)
    loader = coordl.CoordLoader(
        data,
        batch_size=a.batch_size,
        pipeline=recipe,
        device_id=None if a.device == "none" else "auto" if a.device == "auto" else int(a.device),
        return_index=True,
        seed=5,
        cache=cache,
        prep=a.threads,
        peers=coordl.Peers(
            enabled="auto" if a.peers == "auto" else False, locality_aware=bool(a.locality), timeout=a.peer_timeout
        ),
        shuffle=True,
    )
    # Every rank has made its loader, and so attached to its node's cache, before any rank reads: on a few
    # samples a rank could otherwise end its epochs and close before the other made its loader, leaving the
    # cache as its last user (which removes it), and the node's ranks would not share one cache.
    dist.barrier()
    die_epoch, die_batch = (int(x) for x in a.die_at.split(","))
    stop = tuple(int(x) for x in a.stop_at.split(",")) if a.stop_at else None
    stall = tuple(float(x) for x in a.stall.split(",")) if a.stall else (-1, -1, -1, 0)
    first = 0
    if a.resume:
        with open(a.resume) as f:
            state = json.load(f)
        loader.load_state_dict(state)
        first = state["epoch"]
    record = {"rank": rank, "world_size": dist.get_world_size(), "device_id": loader.device_id, "epochs": []}
    for epoch in range(first, a.epochs):
        loader.set_epoch(epoch)
        t0 = time.perf_counter()
        batches, boxes, devices = [], {}, set()
        for k, (images, labels, ids) in enumerate(loader):
            assert images.dtype == torch.float32 and len(labels) == len(ids)
            batches.append(ids.tolist())
            devices.add(str(images.device))
            if a.coco:  # the targets: each sample's boxes
                boxes.update({str(i): t["boxes"].tolist() for i, t in zip(ids.tolist(), labels)})
            if a.step_ms:
                time.sleep(a.step_ms / 1000)
            if (rank, epoch, k) == stall[:3]:
                time.sleep(stall[3])
            if rank == a.die_rank and (epoch, k) == (die_epoch, die_batch):
                os.kill(os.getpid(), signal.SIGKILL)
            if epoch == a.epochs - 1 and k == a.leave_at:
                break
            if (epoch, k + 1) == stop:
                record["state"] = loader.state_dict()  # what this rank would checkpoint
                break
        record["epochs"].append(
            {
                "epoch": epoch,
                "batches": batches,
                "devices": sorted(devices),
                "stats": loader.stats(),
                "time_s": time.perf_counter() - t0,
            }
        )
        if a.coco:
            record["epochs"][-1]["boxes"] = boxes
        save(record, a.out)
        if "state" in record:
            break
    if a.sleep_before_close and rank == int(a.sleep_before_close.split(",")[0]):
        time.sleep(float(a.sleep_before_close.split(",")[1]))
    if rank == a.sigterm_at_end:
        record.update(pid=os.getpid(), sigterm_at=time.time())
        save(record, a.out)
        os.kill(os.getpid(), signal.SIGTERM)  # coordl's handler closes the loader, then the process ends
    if a.leave_at >= 0:
        return  # no close(): coordl releases what the process holds by itself
    t0 = time.monotonic()
    loader.close()
    record["close_s"] = time.monotonic() - t0
    save(record, a.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
