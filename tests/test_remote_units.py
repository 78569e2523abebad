"""coordl.remote.handout: units handed out in order, re-run after a death, delivered once, in order,
with the remote runners' share bounded; coordl.remote.shipping: the trainer's reads for actors,
ahead. Threads and real files: no Ray."""

import random
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from coordl.errors import CoordlError
from coordl.fetch import storage
from coordl.fetch.ahead import FetchAhead
from coordl.fetch.fetcher import Fetcher
from coordl.index import Index
from coordl.remote.actors import GROW_ABOVE, SHRINK_BELOW, scale_step
from coordl.remote.handout import EMPTY, LOCAL, REMOTE, Units
from coordl.remote.shipping import TrainerReads
from coordl.remote.worker import Unit
from coordl.threads import daemon_pool


def units(count, bound=4):
    stop = threading.Event()
    return Units(count, lambda: bound, stop), stop


def test_units_are_handed_out_in_order_and_taken_in_order():
    u, _ = units(5)
    got = [u.claim(LOCAL, block=False) for _ in range(5)]
    assert got == [0, 1, 2, 3, 4]
    assert u.claim(LOCAL, block=False) is None
    for n in reversed(got):
        assert u.put(n, f"r{n}")
    assert [u.take(n) for n in range(5)] == [f"r{n}" for n in range(5)]
    assert u.finished()


def test_a_second_result_for_a_unit_is_dropped():
    u, _ = units(2)
    assert u.claim(REMOTE, block=False) == 0
    assert u.put(0, "first")
    assert not u.put(0, "second")
    assert u.take(0) == "first"
    assert not u.put(0, "late")  # after it was taken, too


def test_local_claims_stop_at_the_local_depth_and_the_two_bounds_add_up():
    stop = threading.Event()
    u = Units(20, lambda: 3, stop, local_depth=2)
    assert [u.claim(LOCAL, block=False) for _ in range(3)] == [0, 1, None]
    assert [u.claim(REMOTE, block=False) for _ in range(4)] == [2, 3, 4, None]
    u.put(0, "a")
    u.put(1, "b")
    assert u.claim(LOCAL, block=False) is None  # results not yet taken still count: they wait in memory
    assert u.in_flight() == 5  # at most bound + local_depth
    u.take(0)
    assert u.claim(LOCAL, block=False) == 5
    claimed = []
    waiter = threading.Thread(target=lambda: claimed.append(u.claim(LOCAL, block=True)))
    waiter.start()  # between runs, holding no unit unfinished, the local pipeline waits for room
    waiter.join(0.3)
    assert claimed == []
    u.take(1)
    waiter.join(5)
    assert claimed == [6]


def test_remote_claims_stop_at_the_bound_and_local_ones_do_not():
    u, _ = units(20, bound=3)
    assert [u.claim(REMOTE, block=False) for _ in range(4)] == [0, 1, 2, None]
    assert u.remote_in_flight() == 3
    assert [u.claim(LOCAL, block=False) for _ in range(5)] == [3, 4, 5, 6, 7]  # local: its own queue bounds it
    u.put(0, "a")
    assert u.claim(REMOTE, block=False) is None  # a result not yet taken still counts
    u.take(0)
    assert u.claim(REMOTE, block=False) == 8
    assert u.in_flight() == 8  # 1..8 claimed, none taken
    assert u.remote_in_flight() == 3  # 1, 2, 8


def test_a_retried_unit_goes_first_and_is_delivered_once():
    u, _ = units(4)
    assert [u.claim(REMOTE, block=False) for _ in range(2)] == [0, 1]
    u.retry(0)  # its runner died
    u.retry(0)  # reported twice: still one re-run
    assert u.retried == 1
    assert u.claim(LOCAL, block=False) == 0  # before the new units
    assert u.claim(LOCAL, block=False) == 2
    u.put(0, "again")
    u.retry(0)  # a death reported after the unit had its result: nothing to re-run
    assert u.claim(LOCAL, block=False) == 3
    assert u.claim(LOCAL, block=False) is None
    assert u.take(0) == "again"


def test_a_blocking_claim_waits_for_a_retry_and_ends_when_every_unit_has_a_result():
    u, _ = units(2)
    assert u.claim(REMOTE, block=False) == 0
    assert u.claim(REMOTE, block=False) == 1
    got = []
    t = threading.Thread(target=lambda: got.append(u.claim(LOCAL, block=True)))
    t.start()
    t.join(0.3)
    assert t.is_alive()  # nothing free, but not every unit has a result: it waits
    u.retry(1)
    t.join(5)
    assert got == [1]
    t = threading.Thread(target=lambda: got.append(u.claim(LOCAL, block=True)))
    t.start()
    u.put(0, "a")
    u.put(1, "b")
    t.join(5)
    assert got == [1, None]


def test_a_runners_failure_and_a_stop_reach_the_consumer():
    u, stop = units(3)
    u.fail(ValueError("the recipe failed"))
    with pytest.raises(ValueError, match="the recipe failed"):
        u.take(0)
    u, stop = units(3)
    stop.set()
    with pytest.raises(CoordlError, match="closed"):
        u.take(0)
    u, stop = units(3)
    with pytest.raises(CoordlError, match="nobody is left"):
        u.take(0, alive=lambda: False)


def test_empty_units_are_results_like_any_other():
    u, _ = units(1)
    u.claim(LOCAL, block=False)
    u.put(0, EMPTY)
    assert u.take(0) is EMPTY


def test_random_runners_with_deaths_deliver_every_unit_once_in_order():
    rng = random.Random(7)
    n = 300
    u, stop = units(n, bound=5)

    def runner(who, seed):
        r = random.Random(seed)
        while True:
            k = u.claim(who, block=True)
            if k is None:
                return
            if who == REMOTE and r.random() < 0.1:
                u.retry(k)  # died
                continue
            u.put(k, k)
            if r.random() < 0.05:
                u.put(k, -1)  # a duplicate, as after a retry whose first run also finished

    threads = [threading.Thread(target=runner, args=(w, rng.random())) for w in (LOCAL, REMOTE, REMOTE)]
    for t in threads:
        t.start()
    assert [u.take(k) for k in range(n)] == list(range(n))
    for t in threads:
        t.join(10)
    assert not any(t.is_alive() for t in threads)


def test_a_unit_given_back_unrun_goes_first_and_is_no_re_run():
    u, _ = units(6, bound=3)
    assert [u.claim(REMOTE, block=False) for _ in range(4)] == [0, 1, 2, None]  # the bound
    for n in (2, 1):  # read ahead for actors that are gone, given back newest first
        u.give_back(n)
    assert [u.claim(LOCAL, block=False) for _ in range(3)] == [1, 2, 3]
    assert u.retried == 0 and u.remote_in_flight() == 1


def test_trainer_reads_run_ahead_at_once_and_each_unit_carries_only_its_own_skips(dataset_copy, monkeypatch):
    """RayPrep(reads="trainer"): the reads of the units submitted ahead run at once on the I/O
    pool, so three units of a storage that answers in 0.3 s are read in about 0.3 s, not 0.9 s
    (read one at a time as an actor asks for each); a unit carries the samples its own read
    skipped, not the loader's whole history of them (every unit carried them all)."""
    index = Index.scan(dataset_copy)
    for i in (3, 45):
        Path(index.paths[i]).unlink()
    real = storage.read_many

    def slow(paths, sizes, buffers, *, drop_page_cache):  # a storage that answers each read in 0.3 s
        time.sleep(0.3)
        return real(paths, sizes, buffers, drop_page_cache=drop_page_cache)

    monkeypatch.setattr(storage, "read_many", slow)
    pool, stop = daemon_pool(4, "test-reads"), threading.Event()
    try:
        ahead = FetchAhead(
            Fetcher(index, None, drop_page_cache=False), [], index.labels, pool, threads=4, depth=1,
            on_error="skip", stop=stop,
        )  # fmt: skip
        reads = TrainerReads(ahead, stop=stop, carry_skipped=True)
        t0 = time.monotonic()
        for k in range(3):
            reads.submit(Unit(k, np.arange(40 * k, 40 * k + 40), 0), f"key{k}")
        assert reads.keys() == ["key0", "key1", "key2"]
        got = [reads.take() for _ in range(3)]
        took = time.monotonic() - t0
    finally:
        pool.shutdown()
    assert [key for _, key in got] == ["key0", "key1", "key2"] and not reads
    assert took < 0.6, f"three reads ahead took {took:.2f} s: one at a time"
    for unit, _ in got:
        assert [bytes(d) for d in unit.data] == [Path(index.paths[i]).read_bytes() for i in unit.ids]
    assert [[i for i, _, _ in unit.skipped] for unit, _ in got] == [[3], [45], []]
    assert [i for i, _, _ in ahead.skipped] == [3, 45]


def test_workers_auto_grows_on_stalls_with_free_cpus_and_shrinks_when_batches_wait():
    base = dict(elapsed=1.0, ready=0, actors=2, starting=0, free_cpus=4, cpus=1, most=8, least=1)
    assert scale_step(**dict(base, waited=GROW_ABOVE * 1.5)) == 1
    assert scale_step(**dict(base, waited=GROW_ABOVE * 1.5, starting=1)) == 0  # one is starting
    assert scale_step(**dict(base, waited=GROW_ABOVE * 1.5, free_cpus=0.5)) == 0  # no CPUs for another
    assert scale_step(**dict(base, waited=GROW_ABOVE * 1.5, most=2)) == 0  # max_workers
    assert scale_step(**dict(base, waited=SHRINK_BELOW / 2, ready=3)) == -1
    assert scale_step(**dict(base, waited=SHRINK_BELOW / 2, ready=2)) == 0  # actors only in step
    assert scale_step(**dict(base, waited=SHRINK_BELOW / 2, ready=3, actors=1)) == 0  # least
    assert scale_step(**dict(base, waited=0.03)) == 0  # between the two


def test_workers_auto_adds_no_actor_while_one_is_starting():
    """A loop that waits all along, on a cluster of 16 free CPUs, with actors that take 5 s to
    start (DALI's import and pipeline on busy cores): one look a second (prep.SCALE_EVERY_S) adds an
    actor only once the last one added is ready, so the pool grows by what its actors change, not
    to every free CPU while none of them has started yet (it reached 16 in 16 s)."""
    start_s, cpus = 5, 16
    started: list[int] = [0]  # when each actor was added (s); the first at the loader's start
    most_starting = 0
    for t in range(1, 21):
        starting = sum(1 for s in started if t - s < start_s)
        most_starting = max(most_starting, starting)
        step = scale_step(
            waited=1.0,
            elapsed=1.0,
            ready=0,
            actors=len(started),
            starting=starting,
            free_cpus=cpus - len(started),
            cpus=1,
            most=1 << 20,
            least=0,
        )
        if step > 0:
            started.append(t)
    assert most_starting == 1
    assert started == [0, 5, 10, 15, 20]


# -- the option object and what a loader refuses with it (before it connects to Ray) ---------------


def test_rayprep_validates_its_fields():
    import coordl

    assert coordl.RayPrep().workers == "auto"
    assert coordl.RayPrep(workers=" AUTO ").workers == "auto"
    for bad, match in [
        (dict(workers=-1), "workers"),
        (dict(workers=True), "workers"),
        (dict(workers=0, local=False), "nobody"),
        (dict(reads="s3"), "reads"),
        (dict(output="float16"), "output"),
        (dict(in_flight=0), "in_flight"),
        (dict(cpus_per_worker=0), "cpus_per_worker"),
        (dict(threads=0), "threads"),
        (dict(max_workers=0), "max_workers"),
    ]:
        with pytest.raises(ValueError, match=match):
            coordl.RayPrep(**bad)
    with pytest.raises(TypeError, match="address"):
        coordl.RayPrep(address="")
    with pytest.raises(ValueError, match=r"RayPrep\(address='ray://head:10001'\) is a Ray Client address"):
        coordl.RayPrep(address="ray://head:10001")  # the trainer must be a node: refused with the reason
    with pytest.raises(TypeError, match="local"):
        coordl.RayPrep(local="yes")


def test_prep_takes_a_rayprep(tiny_dataset):
    import coordl
    from coordl.options import Options

    o = Options.of(cache=0, peers=False, hp_group=None, shard=None, prep=coordl.RayPrep(workers=2), fetch=None)
    assert o.prep == coordl.RayPrep(workers=2)
    with pytest.raises(TypeError, match="coordl.RayPrep"):
        Options.of(cache=0, peers=False, hp_group=None, shard=None, prep="ray", fetch=None)


def test_a_loader_refuses_what_remote_prep_cannot_do(tiny_dataset):
    import coordl

    with pytest.raises(ValueError, match="decoded tier"):
        coordl.CoordLoader(
            tiny_dataset, pipeline="imagenet-train", cache=coordl.Cache(decoded="1MB"), prep=coordl.RayPrep()
        )
    with pytest.raises(ValueError, match="output='pipeline'"):
        coordl.CoordLoader(tiny_dataset, pipeline=lambda x, ctx: x, prep=coordl.RayPrep(output="uint8"))
    ds = coordl.datasets.ImageFolder(tiny_dataset)
    with pytest.raises(ValueError, match="DALI's pipelines"):
        coordl.CoordLoader(ds, prep=coordl.RayPrep(output="uint8"))


def test_without_ray_installed_the_error_says_how_to_install_it(tiny_dataset, monkeypatch):
    import sys

    import coordl

    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    with pytest.raises(ImportError, match=r"coordl\[ray\]"):
        coordl.CoordLoader(tiny_dataset, pipeline="imagenet-train", prep=coordl.RayPrep())


def test_a_ray_client_address_in_ray_address_is_refused_with_the_reason(tiny_dataset, monkeypatch):
    """RayPrep() ("auto") with RAY_ADDRESS=ray://...: refused when the loader is made, before Ray is asked."""
    pytest.importorskip("ray")
    import coordl

    monkeypatch.setenv("RAY_ADDRESS", "ray://head:10001")
    with pytest.raises(CoordlError, match=r"RAY_ADDRESS='ray://head:10001' is a Ray Client address.*--num-cpus=0"):
        coordl.CoordLoader(tiny_dataset, pipeline="imagenet-train", device_id=None, prep=coordl.RayPrep())


def test_a_torch_backend_batch_travels_as_arrays_and_comes_back_as_the_same_tensors():
    import collections

    import numpy as np
    import torch

    from coordl.remote.worker import Arrays, as_arrays, as_tensors

    pair = collections.namedtuple("pair", "image label")
    batch = {
        "x": torch.rand(2, 3, 4),
        "y": [torch.tensor([1, 2]), "a name"],
        "p": pair(torch.ones(2, dtype=torch.float16), 3),
        "mask": torch.ones(2, dtype=torch.bool),  # no NumPy twin: pickled as it is
        "n": np.arange(3),  # the user's own array stays an array
    }
    sent = as_arrays(batch)
    assert isinstance(sent["x"], Arrays) and isinstance(sent["y"][0], Arrays) and isinstance(sent["p"].image, Arrays)
    assert isinstance(sent["mask"], torch.Tensor) and isinstance(sent["n"], np.ndarray)
    sent["x"].array.flags.writeable = False  # as Ray hands it over
    back = as_tensors(sent)
    assert torch.equal(back["x"], batch["x"]) and back["x"].data_ptr() != batch["x"].data_ptr()
    back["x"][0, 0, 0] = 5.0  # a tensor of its own: writable
    assert torch.equal(back["y"][0], batch["y"][0]) and back["y"][1] == "a name"
    assert type(back["p"]) is pair and back["p"].image.dtype == torch.float16 and back["p"].label == 3
    assert torch.equal(back["mask"], batch["mask"]) and isinstance(back["n"], np.ndarray)


# -- a batch from an actor, on the trainer --------------------------------------------------------
def _allocations(f, at_least: int):
    """``(result, n)``: what ``f()`` returns, and how many buffers of ``at_least`` bytes it
    allocated: torch's (its profiler's memory events, freed or not) and NumPy's (tracemalloc's peak,
    in such buffers). Each copy of a batch needs one."""
    import tracemalloc

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as p:
        tracemalloc.start()
        try:
            out = f()
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    leaves = ("aten::empty", "aten::empty_strided")  # where torch's memory comes from (the others nest them)
    by_torch = sum(1 for e in p.events() if e.name in leaves and e.cpu_memory_usage >= at_least)
    return out, by_torch + peak // at_least


@pytest.mark.parametrize("dtype,cast", [("float32", None), ("uint8", "float32")])
def test_a_batch_from_the_object_store_is_copied_once_into_the_loops_tensor(dtype, cast):
    """Ray hands the trainer a read-only view of its object store; the tensor the loop gets is made
    from it in one copy, cast on the way (uint8 pixels normalised on a CPU trainer): one buffer of
    the batch's size is allocated, and it is the loop's tensor (the copy out of the view, then a
    cast, made two)."""
    import torch

    from coordl.remote.raypass import own_tensor, own_tensors
    from coordl.remote.worker import Arrays

    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 255, (16, 3, 32, 32)).astype(dtype)
    store = np.frombuffer(pixels.tobytes(), dtype).reshape(pixels.shape)  # read-only, as Ray's
    assert not store.flags.writeable
    want = torch.float32 if cast else None
    t, buffers = _allocations(lambda: own_tensor(store, dtype=want), pixels.size)
    assert buffers == 1, f"{buffers} copies of the batch"
    assert t.dtype == (want or torch.from_numpy(pixels).dtype) and not t.is_pinned()
    assert torch.equal(t, torch.from_numpy(pixels.astype(cast or dtype)))
    assert not np.shares_memory(t.numpy(), store), "the loop's tensor is its own, not the store's"
    batch, buffers = _allocations(lambda: own_tensors({"x": [Arrays(store)], "n": 3}), pixels.size)
    assert buffers == 1 and batch["n"] == 3 and torch.equal(batch["x"][0], torch.from_numpy(pixels))
    assert batch["x"][0].untyped_storage().data_ptr() == batch["x"][0].data_ptr()


@pytest.mark.gpu
def test_a_batch_for_a_gpu_trainer_is_copied_once_into_pinned_memory():
    """With a GPU trainer, the one copy out of the store lands in pinned memory, so the copy to
    the GPU that follows runs asynchronously."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU")
    from coordl.remote.raypass import own_tensor

    pixels = np.arange(16 * 3 * 8 * 8, dtype=np.uint8).reshape(16, 3, 8, 8)
    store = np.frombuffer(pixels.tobytes(), np.uint8).reshape(pixels.shape)
    t, buffers = _allocations(lambda: own_tensor(store, pinned=True), pixels.size)
    assert t.is_pinned() and buffers == 1
    assert torch.equal(t.to("cuda", non_blocking=True).cpu(), torch.from_numpy(pixels))
