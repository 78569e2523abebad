"""The option objects of :class:`~coordl.CoordLoader`: one frozen, validated record per feature.

Each feature of the loader takes one argument: its option object, or a shorthand for the common
case, which :meth:`of` turns into the object:

============  ===========================================  ==========================================
argument      option object                                shorthand
============  ===========================================  ==========================================
``cache``     :class:`Cache` (size, decoded tier, keep,    a size: ``"40GB"``, bytes, ``0.5``, ``0``
              the local-storage tier: :class:`Disk`)
``peers``     :class:`Peers` (the partitioned cache)       ``"auto"``, ``True``, ``False``
``hp_group``  :class:`HPGroup` (coordinated prep)          the group's name: ``"sweep"``
``shard``     :class:`Shard` (rank, world size, tail)      none: the job's rank and world size
``prep``      :class:`Prep` (DALI's threads), or             a thread count: ``4``
              :class:`RayPrep` (prep on a Ray cluster)
``fetch``     :class:`Fetch` (reads from storage)          none
============  ===========================================  ==========================================

:class:`Options` holds a loader's six (:mod:`coordl.renamed`: the arguments of earlier versions
that one of them replaced). Sizes are parsed and ``"auto"`` recognised here, once: the rest of
coordl sees :data:`AUTO`, an ``int`` of bytes, or (for :attr:`Cache.size`) a ``float`` fraction
of the dataset. Where :class:`Prep` and :class:`RayPrep` make the loader's
batches is :mod:`coordl.prep.site`'s, the one place that tells them apart.
"""

from __future__ import annotations

import math
from dataclasses import KW_ONLY, dataclass

from coordl.renamed import refusing
from coordl.units import parse_bytes

__all__ = [
    "AUTO",
    "Cache",
    "Disk",
    "Fetch",
    "HPGroup",
    "Options",
    "Peers",
    "Prep",
    "RayPrep",
    "Shard",
]

AUTO = "auto"


def _auto(value) -> bool:
    return isinstance(value, str) and value.strip().lower() == AUTO


def _size(value, name: str, *, fraction: bool, example: str = "'4GB'", zero: bool = True) -> int | float | str:
    """``value`` as :data:`AUTO`, bytes, or (``fraction``) a float fraction of the dataset in [0, 1]."""
    if _auto(value):
        return AUTO
    if isinstance(value, float) and not fraction:
        raise TypeError(f"{name}={value!r}: give bytes (an int or a string such as {example}), 'auto'{' or 0' * zero}")
    try:
        parse_bytes(value, 1)
    except (TypeError, ValueError) as e:
        raise type(e)(f"{name}={value!r}: {e}, or 'auto'") from None
    return float(value) if isinstance(value, float) else value if isinstance(value, int) else parse_bytes(value)


def _positive_int(value, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def _seconds(value, name: str, *, zero: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number of seconds, got {value!r}")
    if math.isnan(value) or value < 0 or (value == 0 and not zero):
        raise ValueError(f"{name} must be {'non-negative' if zero else 'positive'}, got {value!r}")


@dataclass(frozen=True)
class Disk:
    """The node's local-storage tier under the memory cache (``Cache(disk=...)``): samples of a
    dataset that lies elsewhere (``s3://``, a network file system, another device) kept in a folder
    on local storage once read, for every later epoch, job and run of the node (CoorDL's own
    architecture; see :mod:`coordl.fetch.disk`).

    Attributes:
        path: an existing folder on local storage (NVMe); the tier is its sub-folder
            ``coordl-disk-<uid>``, private to the user.
        size: the tier's budget, what its files take on disk: ``"auto"`` (no bound but
            ``keep_free``), or bytes (an ``int`` or a string such as ``"2TB"``). A process alone with
            the tier sets it; one that shares it lowers it to a smaller ``size``.
        direct: read the tier with ``O_DIRECT`` instead of dropping its pages after each read.
        peers_first: with the partitioned cache, ask the other nodes' memory caches before this tier
            (where the network delivers faster than the local disk); default: this tier first.
        keep_free: what the tier leaves free on its file system, for checkpoints and everything
            else: ``"auto"`` (5% of the file system, at least 1 GiB), bytes (``"200GB"``), or a
            ``float`` fraction of the file system; checked at every write.
    """

    path: str
    _: KW_ONLY  # the fields after the first are given by name: Disk("/nvme", size="2TB")
    size: int | str = AUTO
    direct: bool = False
    peers_first: bool = False
    keep_free: int | float | str = AUTO

    def __post_init__(self):
        import os

        if not isinstance(self.path, (str, os.PathLike)) or not os.fspath(self.path):
            raise TypeError(f"Disk(path) must be a folder's path, got {self.path!r}")
        object.__setattr__(self, "path", os.path.abspath(os.fspath(self.path)))
        size = _size(self.size, "Disk(size)", fraction=False, example="'2TB'", zero=False)
        if size != AUTO and size < 1:
            raise ValueError(f"Disk(size) must be positive bytes or 'auto', got {self.size!r}")
        object.__setattr__(self, "size", size)
        if isinstance(self.keep_free, float) and not 0.0 <= self.keep_free < 1.0:
            raise ValueError(
                f"Disk(keep_free) as a float is a fraction of the file system in [0, 1), got {self.keep_free!r}"
            )
        keep = _size(self.keep_free, "Disk(keep_free)", fraction=True, example="'200GB'")
        object.__setattr__(self, "keep_free", keep)
        for name in ("direct", "peers_first"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"Disk({name}) must be a bool, got {getattr(self, name)!r}")

    @classmethod
    def of(cls, value) -> Disk | None:
        """``Cache(disk=...)`` as given: a :class:`Disk`, a folder's path, or None (no tier)."""
        if value is None or value is False or isinstance(value, cls):
            return value or None
        return cls(value)


@dataclass(frozen=True)
class Cache:
    """The node's cache of samples in shared memory (``CoordLoader(cache=...)``), shared by every
    process of the machine that loads the same dataset. The first process to make it decides its
    budget and split; later ones attach to it.

    Attributes:
        size: the budget of the whole cache: ``"auto"`` (half of the free shared memory, at most
            the dataset and what the memory limit leaves), bytes (an ``int`` or a string such as
            ``"40GB"``), a ``float`` in [0, 1] (that fraction of the dataset's files), or ``0``
            for no cache.
        decoded: the decoded tier's share of ``size`` (DALI on the CPU): decoded images that later
            epochs and other jobs on the node augment without decoding again. ``0`` (default):
            encoded bytes only. Bytes (an ``int`` or a string such as ``"4GB"``), or ``"auto"``:
            measure prep and storage on a few samples and split ``size`` as DS-Analyzer's model
            predicts is fastest (``size="auto"`` may then take up to the decoded dataset's size).
            The delivered tensors are the same either way.
        keep: keep the cache in shared memory after the last process leaves, so that the next
            run on the same dataset starts warm.
        disk: a local-storage tier under the cache, for a dataset that lies elsewhere: a
            :class:`Disk`, or a folder's path (``Disk(path)``); None (default): none.
    """

    size: int | float | str = AUTO
    _: KW_ONLY  # the fields after the first are given by name: Cache("40GB", decoded="8GB")
    decoded: int | str = 0
    keep: bool = False
    disk: Disk | str | None = None

    def __post_init__(self):
        object.__setattr__(self, "size", _size(self.size, "Cache(size)", fraction=True))
        decoded = 0 if self.decoded is False or self.decoded is None else self.decoded
        object.__setattr__(self, "decoded", _size(decoded, "Cache(decoded)", fraction=False))
        if not isinstance(self.keep, bool):
            raise TypeError(f"Cache(keep) must be a bool, got {self.keep!r}")
        object.__setattr__(self, "disk", Disk.of(self.disk))

    @classmethod
    def of(cls, value) -> Cache:
        """``cache=`` as given: a :class:`Cache`, or a size (``False`` is ``0``: no cache)."""
        if isinstance(value, cls):
            return value
        return cls(size=0 if value is False else value)


@dataclass(frozen=True)
class Peers:
    """The partitioned cache (``CoordLoader(peers=...)``): in a job on several nodes, every node's
    cache serves the other nodes' misses over TCP (DALI backend).

    Attributes:
        enabled: ``"auto"``: on when the job spans several nodes (``WORLD_SIZE >
            LOCAL_WORLD_SIZE``) and ``torch.distributed`` is initialized. ``True``: on, or an
            error that says why it cannot be. ``False``: off. When on, every rank must iterate its
            loaders in the same order (each pass starts with one collective on a gloo group).
        locality_aware: split each global batch so that every rank takes the samples its own node
            caches (the same global batches, equal local batch sizes). ``False``:
            ``DistributedSampler``'s shards exactly.
        timeout: seconds a request to another node may take before its samples are read from
            storage instead.
        retry_after: seconds a node that failed is then left alone.
        linger: when this node's loader closes, its server keeps serving the ranks of other nodes
            that have not finished their pass (each tells every server when it has); a rank that
            sends nothing for ``linger`` seconds is not waited for (None: ``3 * timeout``; 0: stop
            at once). On SIGTERM nothing waits.
        interface: the network interface whose address this node's server binds to and
            advertises (default ``$COORDL_PEER_IFNAME``, else ``$GLOO_SOCKET_IFNAME``, else the
            one that routes to ``MASTER_ADDR``).
        port: the server's port (default ``$COORDL_PEER_PORT``, else any free port).
    """

    enabled: bool | str = AUTO
    _: KW_ONLY  # the fields after the first are given by name
    locality_aware: bool = True
    timeout: float = 10.0
    retry_after: float = 60.0
    linger: float | None = None
    interface: str | None = None
    port: int | None = None

    def __post_init__(self):
        enabled = AUTO if _auto(self.enabled) else self.enabled
        if enabled not in (AUTO, True, False):
            raise ValueError(f"peers must be 'auto', True or False, got {self.enabled!r}")
        object.__setattr__(self, "enabled", enabled)
        _seconds(self.timeout, "Peers(timeout)")
        _seconds(self.retry_after, "Peers(retry_after)", zero=True)
        if self.linger is not None:
            _seconds(self.linger, "Peers(linger)", zero=True)
        if self.port is not None and (isinstance(self.port, bool) or not isinstance(self.port, int)):
            raise TypeError(f"Peers(port) must be an int, got {self.port!r}")
        if self.port is not None and not 0 <= self.port < 65536:
            raise ValueError(f"Peers(port) must be a TCP port (0 for any), got {self.port!r}")

    @classmethod
    def of(cls, value) -> Peers:
        """``peers=`` as given: a :class:`Peers`, or ``"auto"``, ``True``, ``False``."""
        return value if isinstance(value, cls) else cls(enabled=value)


@dataclass(frozen=True)
class HPGroup:
    """Coordinated prep (``CoordLoader(hp_group=...)``): the jobs of a hyper-parameter search on
    one machine that name the same group fetch and pre-process each sample once, by one of them,
    and all consume it. Members must load the same dataset with the same pipeline, seed and
    shuffling (else :class:`~coordl.GroupConfigError`); each has its own ``batch_size`` and
    ``drop_last``, and cuts its batches from the group's staged ones.

    Attributes:
        name: the group's name, shared by its members.
        stage_batch: samples per staged batch. A member whose batches lie inside staged ones
            (its batch size divides this one) receives views of them, without a copy; others get
            copies. None (default): the first member's ``batch_size``, doubled while the double
            is at most 256 samples and an eighth of the rank's epoch, and 16 of it fit in the
            staging bound (``"auto"``: 2 GiB) and in half the free shared memory; so a sweep of
            power-of-two batch sizes up to that gets views, whichever trial starts first. With
            ``RayPrep``, the first member's ``batch_size`` (its actors make batches of it). The
            group's first member decides.
        staging: the memory bound of the group's staging area of ready batches: ``"auto"``
            (16 batches, at most 2 GiB, at least 4) or bytes (an ``int`` or a string such as
            ``"1GB"``). The group's first member decides.
        idle_timeout: seconds a member that is between epochs may keep the others waiting on a
            full staging area before it is dropped (it rejoins at a later epoch).
    """

    name: str
    _: KW_ONLY  # the fields after the first are given by name: HPGroup("sweep", staging="4GB")
    staging: int | str = AUTO
    idle_timeout: float = 60.0
    stage_batch: int | None = None

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"hp_group must be a non-empty string, got {self.name!r}")
        staging = _size(self.staging, "HPGroup(staging)", fraction=False, example="'1GB'", zero=False)
        object.__setattr__(self, "staging", staging)
        _seconds(self.idle_timeout, "HPGroup(idle_timeout)")
        if self.stage_batch is not None:
            _positive_int(self.stage_batch, "HPGroup(stage_batch)")

    @classmethod
    def of(cls, value) -> HPGroup | None:
        """``hp_group=`` as given: a :class:`HPGroup`, a name, or None (no group)."""
        if value is None or isinstance(value, cls):
            return value
        return cls(value)


@dataclass(frozen=True)
class Shard:
    """This process's shard of every epoch (``CoordLoader(shard=...)``), as
    ``DistributedSampler`` deals it: rank ``r`` of ``W`` gets ``order[r::W]``.

    Attributes:
        rank: this process's rank. None: ``torch.distributed``'s, else ``$RANK``, else 0, read
            when the first pass starts (a framework may start the process group after the loader
            is made).
        world_size: the number of ranks. None: as ``rank``, from ``torch.distributed``, else
            ``$WORLD_SIZE``, else 1.
        pad: how the order is shared when the ranks do not divide it. ``True`` (default): it is
            padded by repeating its head, so every rank gets ``ceil(n / W)`` samples (at most
            ``W - 1`` repeats per epoch). ``False``: its tail is left out, so every rank gets
            ``floor(n / W)`` and none repeats. ``pad=False`` is ``DistributedSampler``'s
            ``drop_last=True``; ``CoordLoader(drop_last=...)`` is ``DataLoader``'s, which
            drops each rank's last incomplete batch.
    """

    rank: int | None = None
    _: KW_ONLY  # the fields after the first are given by name
    world_size: int | None = None
    pad: bool = True

    def __post_init__(self):
        for name in ("rank", "world_size"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
                raise TypeError(f"Shard({name}) must be an int or None, got {v!r}")
        if self.world_size is not None and self.world_size < 1:
            raise ValueError(f"Shard(world_size) must be at least 1, got {self.world_size}")
        if self.rank is not None and self.rank < 0:
            raise ValueError(f"Shard(rank) must be non-negative, got {self.rank}")
        if self.rank is not None and self.world_size is not None and self.rank >= self.world_size:
            raise ValueError(f"rank {self.rank} is not in a world of size {self.world_size}")
        if not isinstance(self.pad, bool):
            raise TypeError(f"Shard(pad) must be a bool, got {self.pad!r}")

    @classmethod
    def of(cls, value) -> Shard:
        """``shard=`` as given: a :class:`Shard`, or None (the job's rank and world size)."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        raise TypeError(f"shard must be a coordl.Shard, got {type(value).__name__}")


@dataclass(frozen=True)
class Prep:
    """How DALI pre-processes on this machine (``CoordLoader(prep=...)``).

    Attributes:
        threads: DALI's CPU threads. None: the CPUs this process may use (its affinity and its
            cgroup's CPU quota) divided by the ranks on the node, or, with
            ``Cache(decoded="auto")``, the fewest that prep as fast (Lobster's rule).
    """

    threads: int | None = None

    def __post_init__(self):
        if self.threads is not None:
            _positive_int(self.threads, "Prep(threads)")

    @classmethod
    def of(cls, value) -> Prep:
        """``prep=`` as given: a :class:`Prep`, a thread count, None (the defaults), or a
        :class:`RayPrep` (returned as it is)."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, int) and not isinstance(value, bool):
            return cls(threads=value)
        if isinstance(value, RayPrep):
            return value
        raise TypeError(f"prep must be a coordl.Prep, a coordl.RayPrep or a number of threads, got {value!r}")


READS = ("auto", "node", "trainer")  # RayPrep(reads)
OUTPUTS = ("pipeline", "uint8")  # RayPrep(output)


def refuse_ray_client(address: str, given: str, error: type[Exception]) -> None:
    """Raises ``error`` when ``address`` is a Ray Client address (``ray://``), naming it as ``given``
    (e.g. ``RAY_ADDRESS='ray://...'``): the trainer must be a node of the cluster."""
    if address.strip().lower().startswith("ray://"):
        raise error(
            f"coordl: {given} is a Ray Client address: the trainer must be a node of the cluster, not a client "
            "of it (prepared batches reach it through its node's object store, and actors read through the "
            "nodes' caches). Run the training script on a machine that runs `ray start` (on the trainer's "
            "machine: `ray start --address=<head>:6379 --num-cpus=0`, so that no actor is placed there) and give "
            "RayPrep(address='<head>:6379') or 'auto'; see docs/remote-prep.md"
        )


@dataclass(frozen=True)
class RayPrep:
    """Batches prepared by Ray actors on the machines of a Ray cluster, and by the local pipeline
    while ``local`` is True (``CoordLoader(prep=coordl.RayPrep(...))``; see docs/remote-prep.md).

    The trainer keeps the order, the sharding, exactly-once, resume and ``stats()``; a unit of
    work is one batch: ``(epoch, batch number, sample ids, seed)``, which every actor turns into the
    same tensors the local pipeline would (bit for bit on the CPU).

    Attributes:
        address: the Ray cluster: ``"auto"`` (``RAY_ADDRESS``, else the cluster this machine
            runs), ``"host:port"`` of its head. Used as it is when the script has called
            ``ray.init`` itself.
        workers: Ray actors preparing batches, each with ``cpus_per_worker`` CPUs; ``"auto"``
            grows the pool while the training loop waits for batches and the cluster has free
            CPUs, and shrinks it while prepared batches wait for the loop.
        local: this machine's pipeline (DALI's threads, or the torch backend's workers) takes
            units too; the split follows the measured rates, as each takes the next unit when free.
        threads: the local DALI pipeline's threads (as ``Prep(threads)``); None: the default.
        cpus_per_worker: Ray CPUs each actor reserves, and its DALI threads.
        reads: where actors get the samples' bytes: ``"node"`` (they read the dataset where it
            lives, through their node's cache: the same path on a shared file system, or
            ``s3://``), ``"trainer"`` (the trainer reads them and ships the encoded bytes), or
            ``"auto"`` (``"node"`` for an actor that can read the dataset, else ``"trainer"``).
        output: what actors send back: ``"pipeline"`` (the pipeline's output), or ``"uint8"`` (the
            built-in recipes' pixels before normalisation, a quarter of the bytes, normalised on
            the trainer's device).
        in_flight: units of work handed to actors and not yet taken by the training loop, at
            most (None: two per ready actor, plus two, plus with ``local`` the local pipeline's
            queue times the actors' rate over its rate, 1 to 16). Bounds the memory prepared
            batches hold in Ray's object store.
        max_workers: the most actors ``workers="auto"`` starts (None: as many as the cluster's
            free CPUs allow).
        on_trainer_node: actors may run on the trainer's own Ray node. False (the default): they
            run on the other nodes only, whatever CPUs the trainer's node lends to Ray, since the
            training loop and the local pipeline use the trainer's CPUs.
    """

    address: str = AUTO
    _: KW_ONLY  # the fields after the first are given by name
    workers: int | str = AUTO
    local: bool = True
    threads: int | None = None
    cpus_per_worker: int = 1
    reads: str = AUTO
    output: str = "pipeline"
    in_flight: int | None = None
    max_workers: int | None = None
    on_trainer_node: bool = False

    def __post_init__(self):
        if not isinstance(self.address, str) or not self.address.strip():
            raise TypeError(f"RayPrep(address) must be 'auto' or 'host:port', got {self.address!r}")
        refuse_ray_client(self.address, f"RayPrep(address={self.address!r})", ValueError)
        if self.address not in (AUTO, "local"):
            from coordl.remote import address

            try:
                address.split(self.address)
            except ValueError as e:
                raise ValueError(f"RayPrep(address): {e}") from None
        if _auto(self.workers):
            object.__setattr__(self, "workers", AUTO)
        else:
            if isinstance(self.workers, bool) or not isinstance(self.workers, int) or self.workers < 0:
                raise ValueError(f"RayPrep(workers) must be 'auto' or an int >= 0, got {self.workers!r}")
        if not isinstance(self.local, bool):
            raise TypeError(f"RayPrep(local) must be True or False, got {self.local!r}")
        if self.workers == 0 and not self.local:
            raise ValueError("RayPrep(workers=0, local=False) leaves nobody to prepare batches")
        if self.threads is not None:
            _positive_int(self.threads, "RayPrep(threads)")
        _positive_int(self.cpus_per_worker, "RayPrep(cpus_per_worker)")
        if self.reads not in READS:
            raise ValueError(f"RayPrep(reads) must be one of {', '.join(map(repr, READS))}, got {self.reads!r}")
        if self.output not in OUTPUTS:
            raise ValueError(f"RayPrep(output) must be one of {', '.join(map(repr, OUTPUTS))}, got {self.output!r}")
        if self.in_flight is not None:
            _positive_int(self.in_flight, "RayPrep(in_flight)")
        if self.max_workers is not None:
            _positive_int(self.max_workers, "RayPrep(max_workers)")
        if not isinstance(self.on_trainer_node, bool):
            raise TypeError(f"RayPrep(on_trainer_node) must be True or False, got {self.on_trainer_node!r}")


@dataclass(frozen=True)
class Fetch:
    """How the DALI backend reads samples its node's cache does not hold (``CoordLoader(fetch=...)``).

    Attributes:
        threads: threads reading from storage: the most reads that run at once. A batch's misses
            are read in as many parts as the storage's latency asks for (one from the page cache;
            up to ``threads`` for NVMe or network storage, measured from the reads' own timing).
        batches_ahead: batches whose samples are read ahead of pre-processing. Raise it when the
            storage has a long latency; each costs a batch of encoded bytes in memory.
    """

    threads: int = 8
    _: KW_ONLY  # the fields after the first are given by name
    batches_ahead: int = 2

    def __post_init__(self):
        _positive_int(self.threads, "Fetch(threads)")
        _positive_int(self.batches_ahead, "Fetch(batches_ahead)")

    @classmethod
    def of(cls, value) -> Fetch:
        """``fetch=`` as given: a :class:`Fetch`, or None (the defaults)."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        raise TypeError(f"fetch must be a coordl.Fetch, got {type(value).__name__}")


# coordl 0.2's Shard(pad) was Shard(drop_last) in earlier builds of 0.2 (see coordl.renamed).
Shard.__init__ = refusing({"drop_last": "pad= (drop_last=True is pad=False)"}, "coordl.Shard")(Shard.__init__)


@dataclass(frozen=True)
class Options:
    """A loader's option objects, shorthands resolved (``loader.options``)."""

    cache: Cache
    peers: Peers
    hp_group: HPGroup | None
    shard: Shard
    prep: Prep | RayPrep
    fetch: Fetch

    @classmethod
    def of(cls, *, cache, peers, hp_group, shard, prep, fetch) -> Options:
        """The option objects of a loader's arguments, each an object or its shorthand."""
        return cls(
            cache=Cache.of(cache),
            peers=Peers.of(peers),
            hp_group=HPGroup.of(hp_group),
            shard=Shard.of(shard),
            prep=Prep.of(prep),
            fetch=Fetch.of(fetch),
        )
