"""Scripts that tests/test_ray.py runs as Ray drivers, in the test cluster's network namespace.

``python tests/ray_driver.py SCENARIO ROOT OUT [ARG]``: connects to the cluster at
``RAY_ADDRESS`` (through ``CoordLoader(prep=coordl.RayPrep(...))``), runs one scenario over the
dataset at ROOT and writes what it saw to OUT as JSON (Ray redirects a driver's stdout). A
scenario checks several things at once, because every driver pays seconds to connect and to
start its actors; the tests assert on the JSON.

The reference of every comparison is the same loader with local prep, made in the same script.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import random
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import torch

import coordl
from coordl import CoordLoader, ImageNetTrain

RECIPE = ImageNetTrain(size=16)
BS = 8


def write(out: str, result: dict) -> None:
    """Writes ``result`` to ``out`` (atomically: a reader never sees half of it)."""
    with open(out + ".tmp", "w") as f:
        json.dump(result, f, default=str)
    os.replace(out + ".tmp", out)


def dali(root: str, prep, **kw) -> CoordLoader:
    kw = {"batch_size": BS, "shuffle": True, "pipeline": RECIPE, **kw}
    return CoordLoader(root, device_id=None, seed=7, return_index=True, prep=prep, **kw)


def epochs(loader, n: int, images: dict | None = None) -> list[dict]:
    """``n`` epochs of ``loader``: per epoch, the samples in delivery order and their labels;
    images by ``(epoch, sample)`` into ``images``."""
    out = []
    for epoch in range(n):
        loader.set_epoch(epoch)
        ids, labels = [], []
        for x, y, i in loader:
            ids += i.tolist()
            labels += y.tolist()
            if images is not None:
                for image, sample in zip(x, i.tolist()):
                    images[(epoch, sample)] = image.clone()
        out.append({"ids": ids, "labels": labels})
    return out


def compare(images: dict, reference: dict) -> dict:
    """Samples whose image differs from the reference's (bit for bit), and the largest difference."""
    bad = [f"{e}:{i}" for (e, i), x in images.items() if not torch.equal(x, reference[(e, i)])]
    diff = max(((x.float() - reference[k].float()).abs().max().item() for k, x in images.items()), default=0.0)
    return {"bad": bad[:20], "bad_count": len(bad), "max_diff": diff, "compared": len(images)}


def wait_actors(loader, n: int, timeout: float = 30.0) -> None:
    """Waits until ``n`` actors of ``loader`` are ready (before its first pass: then nothing else polls)."""
    pool = loader.resources.remote.pool
    deadline = time.monotonic() + timeout
    while len(pool.ready) < n and time.monotonic() < deadline:
        pool.poll(0.1)


def actor_pids(loader) -> list[int]:
    return [int(info["worker"].rsplit(":", 1)[1]) for info in loader.resources.remote.pool.ready.values()]


def actor_procs(loader) -> list[list[int]]:
    """``[pid, start time]`` of each ready actor's process: the machine starts tens of processes a
    second and pids wrap at 32768, so a pid alone may name another process a minute later."""
    return [[pid, started(pid)] for pid in actor_pids(loader)]


def started(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks after boot); None: no such process, or a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] == "Z" else int(fields[19])


# -- scenarios ------------------------------------------------------------------------------------
def equal_dali(root: str, out: str) -> None:
    """Remote-only, both, reads="trainer", output="uint8" against local prep, two epochs each."""
    ref_images: dict = {}
    with dali(root, 1) as loader:
        result = {"reference": epochs(loader, 2, ref_images), "labels": loader.index.labels.tolist()}
    runs = {
        "remote": coordl.RayPrep(workers=2, local=False),
        "both": coordl.RayPrep(workers=2, local=True, threads=1),
        "trainer": coordl.RayPrep(workers=2, local=False, reads="trainer"),
        "uint8": coordl.RayPrep(workers=2, local=False, output="uint8"),
    }
    for name, prep in runs.items():
        images: dict = {}
        with dali(root, prep) as loader:
            wait_actors(loader, 2)  # else the local pipeline, which needs no start, may do every unit
            result[name] = {"epochs": epochs(loader, 2, images), "stats": loader.stats()}
            result[name]["reads"] = sorted({v["reads"] for v in loader.resources.remote.pool.ready.values()})
        result[name].update(compare(images, ref_images))
    write(out, result)


def transform(image):
    """A random crop and flip from Python's and torch's global generators (coordl seeds them per sample)."""
    from PIL import Image

    w, h = image.size
    x, y = random.randint(0, w - 24), random.randint(0, h - 24)
    image = image.crop((x, y, x + 24, y + 24))
    if torch.rand(()).item() < 0.5:
        image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    return torch.from_numpy(np.asarray(image).copy()).permute(2, 0, 1)


SLOW_S = 1.0  # an actor's time per sample in :func:`slow_close`


def slow_transform(image):
    """:func:`transform`, :data:`SLOW_S` slower in an actor."""
    import ray

    if ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None:
        time.sleep(SLOW_S)
    return transform(image)


def slow_close(root: str, out: str) -> None:
    """A loader closed while its actors (reading through their node's cache) are in the middle
    of units that take longer than they have to leave: how long the close took, and the actors."""
    data = coordl.datasets.ImageFolder(root, transform=slow_transform)
    with CoordLoader(data, batch_size=BS, num_workers=0, prep=coordl.RayPrep(workers=2, local=True)) as loader:
        wait_actors(loader, 2, timeout=120)
        caches = [info["cache"] for info in loader.resources.remote.pool.ready.values()]
        procs = actor_procs(loader)
        it = iter(loader)
        next(it)
        time.sleep(SLOW_S)  # the actors have begun their units: BS x SLOW_S seconds each
        t0 = time.monotonic()
        loader.close()
        closed_s = time.monotonic() - t0
    write(out, {"closed_s": closed_s, "caches": caches, "procs": procs})


def equal_torch(root: str, out: str) -> None:
    """The torch backend's ImageFolder with a random transform: remote-only and both against local."""

    def make(prep=None):
        return torch_loader(root, prep)

    ref_images: dict = {}
    with make() as loader:
        result = {"reference": epochs(loader, 2, ref_images)}
    for name, prep in {
        "remote": coordl.RayPrep(workers=2, local=False),
        "both": coordl.RayPrep(workers=2, local=True),
    }.items():
        images: dict = {}
        with make(prep) as loader:
            wait_actors(loader, 2)
            result[name] = {"epochs": epochs(loader, 2, images), "stats": loader.stats()}
        result[name].update(compare(images, ref_images))
    write(out, result)


def torch_loader(root: str, prep=None, **kw) -> CoordLoader:
    data = coordl.datasets.ImageFolder(root, transform=transform)
    kw = {"batch_size": BS, "shuffle": True, **kw} | ({} if prep is None else {"prep": prep})
    return CoordLoader(data, num_workers=0, seed=7, return_index=True, **kw)


def resume(root: str, out: str, cut: str, backend: str = "dali") -> None:
    """tests/test_resume.py's resumed run, 2 ranks -> 3, with RayPrep: ranks of 2 take ``cut``
    batches of epoch 0, rank 0's state resumes 3 ranks, which finish epoch 0 and run epoch 1
    (``backend``: ``"dali"``, or ``"torch"``: the ImageFolder of :func:`equal_torch`)."""
    make = dali if backend == "dali" else torch_loader
    ref_images: dict = {}
    with make(root, 1 if backend == "dali" else None) as loader:
        epochs(loader, 2, ref_images)
    prep = coordl.RayPrep(workers=2, local=False)
    images: dict = {}
    before, states = [], []
    for rank in range(2):
        with make(root, prep, shard=coordl.Shard(rank=rank, world_size=2)) as loader:
            for k, (x, _, ids) in enumerate(loader):
                before += ids.tolist()
                images.update({(0, i): image.clone() for image, i in zip(x, ids.tolist())})
                if k + 1 == int(cut):
                    break
            states.append(json.loads(json.dumps(loader.state_dict())))
    after: dict = {0: [], 1: []}
    for rank in range(3):
        with make(root, prep, shard=coordl.Shard(rank=rank, world_size=3)) as loader:
            loader.load_state_dict(states[0])
            for epoch in (0, 1):
                loader.set_epoch(epoch)
                for x, _, ids in loader:
                    after[epoch] += ids.tolist()
                    images.update({(epoch, i): image.clone() for image, i in zip(x, ids.tolist())})
    result = {"states_equal": states[0] == states[1], "state": states[0], "before": before, "after": after}
    result.update(compare(images, ref_images))
    write(out, result)


def custom_recipe(encoded, ctx):
    """A custom recipe whose every random choice comes from ``ctx.random``: a RandomResizedCrop
    window decoded alone, a brightness and a flip."""
    from nvidia.dali import fn, types

    anchor, size = ctx.random.crop_window(fn.peek_image_shape(encoded), scale=(0.25, 1.0))
    images = fn.decoders.image_slice(
        encoded,
        anchor,
        size,
        device=ctx.decoder_device,
        output_type=types.RGB,
        axis_names="WH",
        normalized_anchor=False,
        normalized_shape=False,
    )
    images = fn.resize(images, device=ctx.device, resize_x=16, resize_y=16)
    images = fn.brightness(images, device=ctx.device, brightness=ctx.random.uniform((0.7, 1.3)))
    return fn.crop_mirror_normalize(
        images,
        device=ctx.device,
        dtype=types.FLOAT,
        output_layout="CHW",
        mirror=ctx.random.coin_flip(0.5),
        mean=[127.5] * 3,
        std=[127.5] * 3,
    )


def custom(root: str, out: str) -> None:
    """:func:`custom_recipe` prepared by actors only, against local prep, two epochs."""
    ref_images: dict = {}
    with dali(root, 1, pipeline=custom_recipe) as loader:
        result = {"reference": epochs(loader, 2, ref_images)}
    # The recipe's draws change its tensors: epoch 1's differ from epoch 0's, sample for sample.
    result["fresh"] = sum(not torch.equal(ref_images[(0, i)], ref_images[(1, i)]) for i in range(len(ref_images) // 2))
    images: dict = {}
    with dali(root, coordl.RayPrep(workers=2, local=False), pipeline=custom_recipe) as loader:
        result["remote"] = {"epochs": epochs(loader, 2, images), "stats": loader.stats()}
    result["remote"].update(compare(images, ref_images))
    write(out, result)


def resume_plain(root: str, out: str, cut: str) -> None:
    """A state saved after ``cut`` batches of a pass with RayPrep(local=False), resumed by a loader
    without RayPrep, which finishes the epoch and runs the next; the reference is that loader
    uninterrupted."""
    ref_images: dict = {}
    with dali(root, 1) as loader:
        result = {"reference": epochs(loader, 2, ref_images)}
    images: dict = {}
    before = []
    with dali(root, coordl.RayPrep(workers=2, local=False)) as loader:
        for x, _, ids in loader:
            before += ids.tolist()
            images.update({(0, i): image.clone() for image, i in zip(x, ids.tolist())})
            if len(before) == int(cut) * BS:
                state = json.loads(json.dumps(loader.state_dict()))  # during the pass, as a checkpoint is
                break
        result["remote_units"] = loader.stats()["remote_units"]
    with dali(root, 1) as loader:
        loader.load_state_dict(state)
        result["after"] = epochs(loader, 2, images)
    result.update(state=state, before=before, **compare(images, ref_images))
    write(out, result)


def start_timeout(root: str, out: str, seconds: str) -> None:
    """RayPrep(local=False) whose actor asks for more CPUs than any node has: the pass fails with
    CoordlError after START_TIMEOUT_S (here ``seconds``), and close() ends the actor Ray never placed."""
    import ray
    from ray._private import state as ray_state

    from coordl.remote import raypass

    raypass.START_TIMEOUT_S = float(seconds)  # the pass's own name for it (imported from coordl.remote.actors)
    loader = dali(root, coordl.RayPrep(workers=1, local=False, cpus_per_worker=4))
    actors = [a._actor_id.hex() for a in loader.resources.remote.pool._actors]  # requested now
    it = iter(loader)
    t0 = time.monotonic()
    try:
        next(it)
        result = {"raised": None}
    except Exception as e:  # noqa: BLE001 - recorded for the test
        result = {"raised": type(e).__name__, "coordl": isinstance(e, coordl.CoordlError), "message": str(e)}
    result["seconds"] = time.monotonic() - t0
    result["before"] = {a: ray_state.actors(a)["State"] for a in actors}
    del it
    loader.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        result["after"] = {a: ray_state.actors(a)["State"] for a in actors}
        if all(s == "DEAD" for s in result["after"].values()):
            break
        time.sleep(0.05)
    result["cluster_cpus"] = ray.cluster_resources().get("CPU")
    write(out, result)


def kill(root: str, out: str) -> None:
    """kill -9 of an actor mid-epoch (workers=2, local=False); then one more epoch."""
    with dali(root, coordl.RayPrep(workers=2, local=False), batch_size=4) as loader:
        wait_actors(loader, 2)
        ids, killed = [], None
        for k, (_, _, i) in enumerate(loader):
            ids += i.tolist()
            if k == 3:
                killed = actor_procs(loader)[0]
                os.kill(killed[0], signal.SIGKILL)
        stats = loader.stats()
        second = epochs(loader, 1)[0]["ids"]
        write(out, {"killed": killed, "ids": ids, "stats": stats, "second": second, "after": loader.stats()})


def life(root: str, out: str, mode: str) -> None:
    """A user's script that ends as ``mode`` says, mid-epoch: break (then close), raise
    SystemExit(3), SIGINT, SIGTERM, SIGKILL, a whole epoch and no close(), or (collect) the loader
    and its pass dropped and collected while the script goes on."""
    # SIGINT raises KeyboardInterrupt, as in a terminal, even when the tests run as a background job of
    # a shell (which starts them with SIGINT ignored, and Python then leaves it ignored).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if mode == "plain":  # Ray without coordl, for the exit status of a KeyboardInterrupt
        import ray

        ray.init(address=os.environ["RAY_ADDRESS"])
        write(out, {"procs": []})
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(10)
        raise SystemExit("SIGINT did not interrupt a plain Ray script within 10 s")
    if mode == "collect":
        return collect(root, out)
    loader = dali(root, coordl.RayPrep(workers=2, local=False), batch_size=4)
    result: dict = {}
    for k, _ in enumerate(loader):
        if k == 0:
            result["procs"] = ready_procs(loader)
            write(out, result)
        if k == 2 and mode != "noclose":
            if mode == "break":
                break
            if mode == "raise":
                raise SystemExit(3)
            signum = {"interrupt": signal.SIGINT, "term": signal.SIGTERM}.get(mode, signal.SIGKILL)
            write(out, {**result, "signalled_at": time.time()})
            os.kill(os.getpid(), signum)
            time.sleep(10)
    if mode == "break":  # close() ends the actors at once, while the script goes on
        t0 = time.monotonic()
        loader.close()
        result["ended_s"] = until_gone(result["procs"], t0)
    result["end"] = mode
    write(out, result)


def ready_procs(loader) -> list[list[int]]:
    """:func:`actor_procs` of ``loader``'s two actors, once both are ready (at most 20 s)."""
    deadline = time.monotonic() + 20
    while len(loader.resources.remote.pool.ready) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    return actor_procs(loader)


def until_gone(procs, t0: float, timeout: float = 20.0) -> float:
    """Seconds from ``t0`` until every process of ``procs`` (:func:`actor_procs`) is gone (at most
    ``timeout``)."""
    while time.monotonic() - t0 < timeout and any(s is not None and started(pid) == s for pid, s in procs):
        time.sleep(0.01)
    return time.monotonic() - t0


def collect(root: str, out: str) -> None:
    """A loader dropped mid-pass (``del loader, it``) and collected (``gc.collect()``): it closes,
    and its actors end, while the script goes on."""
    import gc
    import weakref

    loader = dali(root, coordl.RayPrep(workers=2, local=False), batch_size=4)
    it = iter(loader)
    next(it)
    result = {"procs": ready_procs(loader)}
    write(out, result)
    next(it), next(it)
    collected = weakref.ref(loader)
    t0 = time.monotonic()
    del loader, it
    gc.collect()
    result["collected"] = collected() is None
    result["ended_s"] = until_gone(result["procs"], t0)
    result["end"] = "collect"
    write(out, result)


def auto(root: str, out: str) -> None:
    """workers="auto" on a prep-bound loader: the pool grows within the cluster's CPUs."""
    result = {}
    for name, prep in {
        "remote": coordl.RayPrep(workers="auto", local=False),
        "both": coordl.RayPrep(workers="auto", local=True, threads=1),
    }.items():
        samples = []
        with dali(root, prep, batch_size=4) as loader:
            pool = loader.resources.remote.pool
            t0 = time.monotonic()
            epoch = 0
            # Until a second actor is ready, or for the 120 s an actor has to start (START_TIMEOUT_S): on busy
            # cores an actor takes tens of seconds to import DALI and build its pipeline.
            while time.monotonic() - t0 < 120 and not (samples and max(r for _, r, _ in samples) >= 2):
                loader.set_epoch(epoch)
                for _ in loader:
                    samples.append((round(time.monotonic() - t0, 2), len(pool.ready), pool.size))
                epoch += 1
            result[name] = {"samples": samples, "stats": loader.stats(), "epochs": epoch}
    write(out, result)


def in_flight(root: str, out: str) -> None:
    """RayPrep(in_flight=3) and a slow consumer: units claimed and not taken (all, and by actors),
    sampled every 2 ms."""
    result = {}
    for name, prep in {
        "remote": coordl.RayPrep(workers=2, local=False, in_flight=3),
        "both": coordl.RayPrep(workers=2, local=True, threads=1, in_flight=3),
    }.items():
        with dali(root, prep, batch_size=4) as loader:
            wait_actors(loader, 2)
            seen, remote, stop = collections.Counter(), collections.Counter(), threading.Event()
            depth = [None]

            def sample(loader=loader, seen=seen, remote=remote, stop=stop, depth=depth):
                while not stop.is_set():
                    p = loader._pass_ref() if loader._pass_ref is not None else None
                    if p is not None:
                        seen[p._units.in_flight()] += 1
                        remote[p._units.remote_in_flight()] += 1
                        depth[0] = getattr(p._units, "local_depth", None)
                    time.sleep(0.002)

            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()
            ids = []
            for k, (_, _, i) in enumerate(loader):
                ids += i.tolist()
                time.sleep(0.1 if k < 12 else 0.0)
            stop.set()
            sampler.join()
            result[name] = {"in_flight": dict(seen), "remote_in_flight": dict(remote), "local_depth": depth[0]}
            result[name].update(ids=ids, stats=loader.stats())
    write(out, result)


def errors(root: str, out: str) -> None:
    """A dataset with a corrupt JPEG, prepared by actors: on_error="raise" raises SampleError naming it;
    "skip" skips it and counts it."""
    result = {}
    prep = coordl.RayPrep(workers=1, local=False)
    for backend in ("dali", "torch"):

        def make(on_error, backend=backend):
            if backend == "dali":
                return dali(root, prep, on_error=on_error, shuffle=False)
            data = coordl.datasets.ImageFolder(root, transform=transform)
            return CoordLoader(data, batch_size=BS, seed=7, return_index=True, prep=prep, on_error=on_error)

        with make("raise") as loader:
            try:
                for _ in loader:
                    pass
                result[f"{backend}_raise"] = {"raised": None}
            except Exception as e:  # noqa: BLE001 - recorded for the test
                result[f"{backend}_raise"] = {
                    "raised": type(e).__name__,
                    "mro": [c.__name__ for c in type(e).__mro__],
                    "message": str(e),
                    "path": getattr(e, "path", None),
                }
        with make("skip") as loader:
            ids = [i for _, _, batch in loader for i in batch.tolist()]
            result[f"{backend}_skip"] = {"ids": ids, "stats": loader.stats()}
    write(out, result)


def no_cluster(root: str, out: str, address: str) -> None:
    """A loader whose RayPrep(address) has no cluster: the error, and how long it took."""
    t0 = time.monotonic()
    try:
        dali(root, coordl.RayPrep(address=address)).close()
        result = {"raised": None}
    except Exception as e:  # noqa: BLE001 - recorded for the test
        result = {"raised": type(e).__name__, "coordl": isinstance(e, coordl.CoordlError), "message": str(e)}
    write(out, {**result, "seconds": time.monotonic() - t0})


def gpu(root: str, out: str) -> None:
    """A trainer on GPU 0: actors' batches (CPU pipelines) arrive on the GPU, equal to local CPU prep;
    uint8 ones are normalised there; with local=True the trainer's share is decoded on the GPU."""
    ref_images: dict = {}
    with dali(root, 1) as loader:
        result = {"reference": epochs(loader, 1, ref_images)}
    runs = {
        "remote": coordl.RayPrep(workers=2, local=False),
        "uint8": coordl.RayPrep(workers=2, local=False, output="uint8"),
        "both": coordl.RayPrep(workers=2, local=True, threads=1),
    }
    for name, prep in runs.items():
        images: dict = {}
        with dali(root, prep, device_id=0) as loader:
            wait_actors(loader, 2)
            devices = set()
            ids = []
            for x, _, i in loader:
                devices.add(str(x.device))
                ids += i.tolist()
                for image, sample in zip(x, i.tolist()):
                    images[(0, sample)] = image.cpu()
            result[name] = {"devices": sorted(devices), "ids": ids, "stats": loader.stats()}
        result[name].update(compare(images, ref_images))
    write(out, result)


def hp_member(root: str, out: str) -> None:
    """One trial of an HP group whose batches its Ray actors make (RayPrep(local=False))."""
    images: dict = {}
    result: dict = {"epochs": []}
    with dali(root, coordl.RayPrep(workers=1, local=False), hp_group="sweep") as loader:
        wait_actors(loader, 1)
        for _ in range(2):
            batches = [(x.clone(), i.tolist()) for x, _, i in loader]
            stats = loader.stats()
            order = stats["order_epoch"]  # the group's epoch this pass followed (a late joiner's may differ)
            images.update({(order, s): image for x, ids in batches for image, s in zip(x, ids)})
            result["epochs"].append(
                {
                    "ids": [s for _, ids in batches for s in ids],
                    "order_epoch": order,
                    "produced": stats["produced"],
                    "shared": stats["consumed_shared"],
                }
            )
        result["stats"] = stats
    torch.save({f"{e}:{i}": x for (e, i), x in images.items()}, out + ".pt")
    write(out, result)


def hp(root: str, out: str) -> None:
    """Two trials of one HP group, each a process with one actor making group batches, against a
    loader alone with local prep."""
    ref_images: dict = {}
    with dali(root, 1) as loader:
        result = {"reference": epochs(loader, 3, ref_images)}
    outs = [f"{out}.member{k}" for k in range(2)]
    members = [subprocess.Popen([sys.executable, __file__, "hp_member", root, o]) for o in outs]
    result["rcs"] = [m.wait(timeout=180) for m in members]
    result["members"] = []
    for o in outs:
        with open(o) as f:
            member = json.load(f)
        images = {tuple(map(int, k.split(":"))): x for k, x in torch.load(o + ".pt").items()}
        member.update(compare(images, ref_images))
        result["members"].append(member)
    write(out, result)


def detection(images: str, out: str) -> None:
    """A COCO set with SSDTrain (``make_coco``'s layout: ``images`` is ``<root>/train``): actors
    only (node reads, and uint8 pixels) against local prep, two epochs; each sample's pixels and boxes."""
    annotations = os.path.join(os.path.dirname(images), "annotations", "instances_train.json")
    index = coordl.Index.from_coco(images, annotations)
    recipe = coordl.SSDTrain(size=32)
    result = {}
    runs = {"reference": 1, "remote": coordl.RayPrep(workers=2, local=False)}
    runs["uint8"] = coordl.RayPrep(workers=2, local=False, output="uint8")
    seen = {}
    for name, prep in runs.items():
        got = {}
        with CoordLoader(index, BS, True, pipeline=recipe, device_id=None, seed=7, return_index=True, prep=prep) as ld:
            if name != "reference":
                wait_actors(ld, 2)
            for epoch in range(2):
                ld.set_epoch(epoch)
                for x, targets, i in ld:
                    for image, t, sample in zip(x, targets, i.tolist()):
                        got[(epoch, sample)] = (image.clone(), t["boxes"].tolist(), t["labels"].tolist())
            stats = ld.stats()
        seen[name] = got
        ref = seen["reference"]
        result[name] = {
            "samples": sorted(f"{e}:{i}" for e, i in got),
            "boxes_differ": sum(got[k][1:] != ref[k][1:] for k in got),
            "max_diff": max((got[k][0].float() - ref[k][0].float()).abs().max().item() for k in got),
            "remote_units": stats.get("remote_units", 0),
        }
    write(out, result)


def audio(root: str, out: str) -> None:
    """A folder of audio clips with AudioTrain (a gain too): actors only against local prep, two
    epochs; each clip's window."""
    recipe = coordl.AudioTrain(sample_rate=8000, samples=4000, gain=(-3.0, 3.0))
    result, seen = {}, {}
    for name, prep in (("reference", 1), ("remote", coordl.RayPrep(workers=2, local=False))):
        got = {}
        with CoordLoader(root, BS, True, pipeline=recipe, device_id=None, seed=7, return_index=True, prep=prep) as ld:
            if name != "reference":
                wait_actors(ld, 2)
            for epoch in range(2):
                ld.set_epoch(epoch)
                for x, y, i in ld:
                    for w, label, sample in zip(x, y.tolist(), i.tolist()):
                        got[(epoch, sample)] = (w.clone(), label)
            stats = ld.stats()
        seen[name] = got
        ref = seen["reference"]
        result[name] = {
            "samples": sorted(f"{e}:{i}" for e, i in got),
            "differ": sum(not torch.equal(got[k][0], ref[k][0]) or got[k][1] != ref[k][1] for k in got),
            "remote_units": stats.get("remote_units", 0),
        }
    write(out, result)


def hp_stage(root: str, out: str) -> None:
    """A trial with RayPrep(local=False) that starts an HP group without stage_batch: the staged
    batch it chose, and one epoch's samples."""
    with dali(root, coordl.RayPrep(workers=1, local=False), hp_group="ray-first") as loader:
        wait_actors(loader, 1)
        ids = [s for _, _, i in loader for s in i.tolist()]
        write(out, {"ids": ids, "stage_batch": loader.stats()["stage_batch"]})


def term(root: str, out: str) -> None:
    """A trainer with RayPrep (one actor, and the trainer's own DALI thread) in its training loop
    until SIGTERM: it writes its actor's process once the actor is ready, then trains for ever."""
    loader = dali(root, coordl.RayPrep(workers=1, local=True, threads=1), batch_size=4)
    wait_actors(loader, 1)
    write(out, {"procs": actor_procs(loader)})
    for epoch in range(10**6):
        loader.set_epoch(epoch)
        for _ in loader:
            time.sleep(0.005)  # the training step


def one_node(root: str, out: str) -> None:
    """A cluster whose only node is the trainer's: RayPrep(local=False) fails when the loader is
    made, in how long (once connected); RayPrep(local=True) warns once that no actor will start and
    prepares two epochs on this machine; on_trainer_node=True starts its actor here."""
    import warnings

    t0 = time.monotonic()
    dali(root, coordl.RayPrep(workers=0, local=True)).close()  # connects: what follows is the check alone
    result = {"connect_s": time.monotonic() - t0}
    t0 = time.monotonic()
    try:
        dali(root, coordl.RayPrep(workers=1, local=False)).close()
        result["raised"] = None
    except Exception as e:  # noqa: BLE001 - recorded for the test
        result.update(raised=type(e).__name__, coordl=isinstance(e, coordl.CoordlError), message=str(e))
    result["seconds"] = time.monotonic() - t0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with dali(root, coordl.RayPrep(workers=2, local=True)) as loader:
            result["epochs"] = epochs(loader, 2)
            pool = loader.resources.remote.pool
            result.update(started=pool.started, remote_units=loader.stats()["remote_units"])
    result["warnings"] = [f"{w.category.__name__}: {w.message}" for w in caught]
    with dali(root, coordl.RayPrep(workers=1, local=False, on_trainer_node=True)) as loader:
        ids = epochs(loader, 1)[0]["ids"]
        result["here"] = {"ids": ids, "remote_units": loader.stats()["remote_units"]}
    write(out, result)


def pool_race(root: str, out: str) -> None:
    """Four threads polling the pool at once while its two actors start (as a pass's and an HP
    group member's dispatch threads may), then an epoch: what each saw go wrong, and the pool."""
    with dali(root, coordl.RayPrep(workers=2, local=False), batch_size=4) as loader:
        pool = loader.resources.remote.pool
        errors: list[str] = []

        def poll() -> None:
            deadline = time.monotonic() + 60
            while len(pool.ready) < 2 and time.monotonic() < deadline:
                try:
                    pool.poll(0.5)
                except Exception as e:  # noqa: BLE001 - reported
                    errors.append(repr(e))
                    return

        threads = [threading.Thread(target=poll) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        seen = {"ready": len(pool.ready), "size": pool.size, "started": pool.started, "died": pool.died}
        ids = epochs(loader, 1)[0]["ids"]
        write(out, {"errors": errors, **seen, "ids": ids, "stats": loader.stats()})


SCENARIOS = {
    f.__name__: f
    for f in (
        audio,
        detection,
        equal_dali,
        equal_torch,
        custom,
        resume,
        resume_plain,
        kill,
        life,
        auto,
        slow_close,
        in_flight,
        errors,
        start_timeout,
        no_cluster,
        one_node,
        gpu,
        hp_member,
        hp,
        hp_stage,
        term,
        pool_race,
    )
}

if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    SCENARIOS[sys.argv[1]](*sys.argv[2:])
