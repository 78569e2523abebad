"""CoordLoader: a drop-in replacement for ``torch.utils.data.DataLoader`` on DALI with a MinIO cache.

The loader wires the chain and owns the position; everything else is a collaborator:
:mod:`~coordl.config` (validated settings), :mod:`~coordl.schedule` (this rank's batches of a
pass), :mod:`~coordl.position` (epoch and batches delivered; resume),
:mod:`~coordl.resources` (index, cache, fetcher, pools, peers, pipeline), and a pass per
``iter()`` (:mod:`~coordl.backends.dali`, :mod:`~coordl.backends.torch`,
:mod:`~coordl.staging.member`). :mod:`~coordl.lifecycle` closes loaders a script leaves open.
"""

from __future__ import annotations

import logging
import os
import weakref
from collections.abc import Sequence

from coordl import env, lifecycle, threads, world
from coordl.accounting import print_epoch_line
from coordl.config import GroupOptions, LoaderConfig, PeerOptions, TorchOptions, fingerprint, identity
from coordl.index import IMG_EXTENSIONS, Index
from coordl.passes import Pass, PassStats, pass_stats
from coordl.position import Position, check_state
from coordl.prep.recipes import recipe_key, resolve_recipe
from coordl.resources import Resources
from coordl.schedule import Locality, Schedule
from coordl.sources import as_dataset, make_index, resolve_device
from coordl.surface import DataLoaderAttributes

__all__ = ["CoordLoader"]

log = logging.getLogger(__name__)

STATE_VERSION = 2


class CoordLoader(DataLoaderAttributes):
    """Iterates ``(images, labels)`` batches of an image dataset, like a ``DataLoader``.

    Two backends share the order, sharding, resume, cache and statistics. A folder, a list or
    an index is decoded and augmented by DALI (``pipeline``). A dataset of
    :mod:`coordl.datasets` (``ImageFolder(root, transform=...)``, ``DatasetFolder``,
    ``FileDataset``) runs the *torch backend*: PyTorch ``DataLoader`` workers read the bytes
    through the node's cache and apply the dataset's own Python transforms, and batches are
    whatever its ``collate_fn`` makes.

    Args:
        data: an ImageFolder-style folder (one sub-folder per class), a list of
            ``(path, label)`` pairs, an :class:`~coordl.index.Index`, or a dataset of
            :mod:`coordl.datasets` (the torch backend).
        batch_size: samples per batch.
        pipeline: ``"imagenet-train"`` (random resized crop, flip, normalise),
            ``"imagenet-val"`` (resize, center crop, normalise), a recipe object
            (:class:`coordl.ImageNetTrain`, :class:`coordl.ImageNetVal`) or a callable
            ``f(encoded, ctx)`` returning DALI ops (see the user guide).
        shuffle: reshuffle every epoch, seeded by ``(seed, epoch)``.
        drop_last: drop the last incomplete batch, and shard without padding.
        seed: seed of the order and of the augmentation.
        cache_bytes: MinIO cache budget: ``"auto"`` (half of the free shared memory,
            at most the dataset), bytes (int), a string (``"40GB"``), a float fraction
            of the dataset, or 0 for no cache.
        decoded_cache: the node's decoded tier (DALI on the CPU): decoded images that later
            epochs and other jobs on this node augment without decoding again, taken out of
            ``cache_bytes``. ``0`` (default): encoded bytes only. ``"auto"``: measure prep from
            encoded bytes and from decoded images, and storage, on a few samples (6-10 s on 2 cores)
            and split ``cache_bytes`` as DS-Analyzer's model predicts is fastest (``"auto"`` for
            ``cache_bytes`` then takes up to the decoded dataset's size). Or bytes (int or
            ``"4GB"``), or a float fraction of ``cache_bytes``. The delivered tensors are the same
            either way. See the decoded-tier guide.
        keep_cache: keep the cache in shared memory after the last user leaves.
        rank: this process's rank (default: ``torch.distributed``, else ``RANK``, read when a pass
            starts, so a framework may start the process group after the loader is made).
        world_size: number of ranks (default: ``torch.distributed``, else ``WORLD_SIZE``, read
            when a pass starts).
        device_id: GPU for decoding and outputs; ``"auto"`` uses GPU ``LOCAL_RANK`` under a
            launcher that sets it (torchrun), else the current CUDA device, else the CPU;
            None forces the CPU.
        num_threads: DALI threads (default: CPU cores / ranks on this node, or what ``decoded_cache="auto"`` chose).
        io_threads: threads reading from storage.
        prefetch_batches: batches fetched ahead of pre-processing.
        return_index: also yield each sample's position in the index.
        on_error: ``"raise"`` (default) stops at an unreadable or undecodable sample with
            its path; ``"skip"`` leaves it out of its batch and counts it in ``stats()``.
        extensions: file endings that count as images when scanning a folder.
        index_dir: where scanned indexes are saved (default: ``$COORDL_INDEX_DIR``, else
            ``$XDG_CACHE_HOME/coordl``, else ``~/.cache/coordl``); ``""`` saves none.
        hp_group: a name shared by the jobs of a hyper-parameter search on this machine: each
            batch is then fetched and pre-processed once, by one of them, and consumed by all
            (see the coordinated-prep guide). Members must use the same dataset, batch size,
            pipeline, seed and shuffling; a mismatch raises :class:`~coordl.GroupConfigError`.
        hp_staging: memory bound of the group's staging area of ready batches: ``"auto"``
            (16 batches, at most 2 GiB, at least 4) or bytes (int or ``"1GB"``).
        hp_idle_timeout: seconds a member that is between epochs may keep the others waiting
            on a full staging area before it is dropped (it rejoins at a later epoch).
        num_workers: the torch backend's worker processes (``DataLoader``'s meaning; default 0,
            loading in the main process). With DALI, the number of DALI threads when
            ``num_threads`` is not given.
        pin_memory, collate_fn, worker_init_fn, timeout, multiprocessing_context, generator,
        prefetch_factor, persistent_workers, pin_memory_device: as for ``DataLoader``, on
            the torch backend. ``generator`` defaults to one seeded by ``(seed, epoch, rank)``,
            so workers' random transforms repeat from run to run. ``pin_memory`` has no effect
            with DALI, whose outputs are on their device already.
        log_epochs: print one line of statistics per epoch to stderr (where the time went, where
            the bytes came from); also turned on by the environment variable ``COORDL_LOG_EPOCHS=1``.
        peers: the partitioned cache (DALI backend): ``"auto"`` turns it on when the job spans
            several nodes (``WORLD_SIZE > LOCAL_WORLD_SIZE``) and ``torch.distributed`` is
            initialized; then every node's cache serves the other nodes' misses over TCP.
            ``False`` turns it off. Every rank must then iterate its loaders in the same order
            (each pass starts with one collective on a gloo group), as with any collective.
        locality_aware: with the partitioned cache, split each global batch so that every rank
            takes the samples its own node caches (same global batches, equal local batch sizes;
            which rank gets which sample changes). See the multi-node guide.
        peer_timeout: seconds a request to another node may take before its samples are read
            from storage instead; that node is then left alone for ``peer_retry_after`` seconds.
        peer_retry_after: see ``peer_timeout``.
        peer_interface: the network interface whose address this node's cache server binds to
            and advertises (default ``$COORDL_PEER_IFNAME``, else ``$GLOO_SOCKET_IFNAME``, else
            the one that routes to ``MASTER_ADDR``).
        peer_port: the server's port (default ``$COORDL_PEER_PORT``, else any free port).
        sampler, batch_sampler: not accepted: coordl decides the order (``shuffle``, ``seed``,
            ``set_epoch``, the rank's shard) so that it can guarantee and resume it. The attributes
            ``loader.sampler`` and ``loader.batch_sampler`` describe that order as ``DataLoader``'s do.
    """

    def __init__(
        self,
        data: str | os.PathLike | Sequence[tuple[str, int]] | Index,
        batch_size: int = 1,
        *,
        pipeline="imagenet-train",
        shuffle: bool = True,
        drop_last: bool = False,
        seed: int = 0,
        cache_bytes: int | float | str = "auto",
        decoded_cache: int | float | str | bool = 0,
        keep_cache: bool = False,
        rank: int | None = None,
        world_size: int | None = None,
        device_id: int | str | None = "auto",
        num_threads: int | None = None,
        io_threads: int = 8,
        prefetch_batches: int = 2,
        return_index: bool = False,
        on_error: str = "raise",
        extensions: Sequence[str] = IMG_EXTENSIONS,
        index_dir: str | None = None,
        hp_group: str | None = None,
        hp_staging: int | str = "auto",
        hp_idle_timeout: float = 60.0,
        num_workers: int | None = None,
        pin_memory: bool = False,
        collate_fn=None,
        worker_init_fn=None,
        timeout: float = 0,
        multiprocessing_context=None,
        generator=None,
        prefetch_factor: int | None = None,
        persistent_workers: bool = False,
        pin_memory_device: str = "",
        log_epochs: bool = False,
        peers: bool | str = "auto",
        locality_aware: bool = True,
        peer_timeout: float = 10.0,
        peer_retry_after: float = 60.0,
        peer_interface: str | None = None,
        peer_port: int | None = None,
        sampler=None,
        batch_sampler=None,
    ):
        if sampler is not None or batch_sampler is not None:
            raise ValueError(
                "CoordLoader decides the order of samples itself (shuffle=, seed=, set_epoch(), one shard per "
                "rank) so that every epoch is exactly-once and resumable; drop sampler=/batch_sampler="
            )
        if num_workers is not None and (
            isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0
        ):
            raise ValueError(f"num_workers must be a non-negative int, got {num_workers!r}")
        self.config = LoaderConfig(
            batch_size, shuffle, drop_last, seed, on_error, return_index, io_threads, prefetch_batches, log_epochs
        )
        self.group_options = GroupOptions(hp_group, hp_staging, hp_idle_timeout) if hp_group is not None else None
        self.peer_options = PeerOptions(
            peers, locality_aware, peer_timeout, peer_retry_after, peer_interface, peer_port
        )
        self.torch_options = TorchOptions(
            num_workers or 0,
            bool(pin_memory),
            collate_fn,
            worker_init_fn,
            timeout,
            multiprocessing_context,
            prefetch_factor,
            bool(persistent_workers),
            pin_memory_device,
        )
        self._explicit_world = (rank, world_size)
        self._world: world.World | None = None  # read when the first pass starts
        self._member = None  # this loader's part in its HP group, made on the first pass
        self._torch_sampler = None
        self._pass_ref = None  # the running pass (weakly: a dropped pass closes itself)
        self._last: PassStats | None = None
        self._pid = os.getpid()
        self._closed = True  # until the resources are open
        if rank is not None or world_size is not None:
            world.detect(rank, world_size)  # an impossible rank is the caller's mistake: say so now
        dataset = as_dataset(data)
        self.backend = "dali" if dataset is None else "torch"
        if self.backend == "dali":
            given = self.torch_options.given() + (["generator"] if generator is not None else [])
            if given:
                raise ValueError(
                    f"{', '.join(given)} apply to the torch backend, which runs a dataset of coordl.datasets "
                    "(e.g. coordl.datasets.ImageFolder(root, transform=...)); a folder or a list is decoded by DALI"
                )
            self.index = make_index(data, extensions, index_dir)
            self.recipe = resolve_recipe(pipeline)
            self.device_id = resolve_device(device_id)
            self.dataset = self.index
            import coordl.prep.dali  # noqa: F401 - DALI's import takes seconds: now, not in the first pass

            lifecycle.before_dali_exit()
        else:
            if pipeline != "imagenet-train":
                raise ValueError("pipeline= is for DALI; with a dataset, its transform is the pre-processing")
            if hp_group is not None:
                raise ValueError(
                    "hp_group is not available on the torch backend yet: use a folder or a list of files, "
                    "decoded by DALI, for coordinated pre-processing"
                )
            self.index = dataset.index
            self.recipe = None
            self.device_id = None  # the batches are collate_fn's, on the CPU (pinned with pin_memory)
            self.dataset = dataset
        if len(self.index) == 0:
            raise ValueError("the dataset has no samples")
        self._check_peers_possible()
        self._num_threads_arg = num_threads
        self._own_generator = generator is None
        self.generator = generator
        if self.backend == "torch" and generator is None:
            import torch

            self.generator = torch.Generator()  # seeded before every pass by (seed, epoch, rank)
        self.schedule = Schedule(
            len(self.index), self.config.batch_size, self.config.shuffle, self.config.drop_last, self.config.seed
        )
        self.position = Position(len(self.index), self.config.batch_size)
        from coordl import tiers

        choose_threads = not (num_threads or self.torch_options.num_workers)
        self.tiers = tiers.plan_for(self, cache_bytes, decoded_cache, keep_cache, choose_threads=choose_threads)
        self._num_threads_arg = num_threads or self.tiers.threads
        self.resources = Resources(
            self.index,
            self.tiers.encoded,
            self.tiers.encoded_budget,
            decoded_spec=self.tiers.decoded,
            io_threads=io_threads if self.backend == "dali" else 0,
        )
        self._closed = False
        lifecycle.track(self)

    # -- where the job is ------------------------------------------------------------------------
    @property
    def world(self) -> world.World:
        """This process's place in the job: fixed by the first pass, read from the job until then."""
        return self._world if self._world is not None else world.detect(*self._explicit_world)

    @property
    def num_threads(self) -> int:
        """DALI's threads: ``num_threads``, else ``num_workers``, else the node's cores over its ranks."""
        cores = os.cpu_count() or 1
        return (
            self._num_threads_arg
            or self.torch_options.num_workers
            or max(1, cores // max(1, self.world.local_world_size))
        )

    def __len__(self) -> int:
        return self.schedule.num_batches(self.world.world_size)

    @property
    def epoch(self) -> int:
        """The epoch the next (or current) pass delivers."""
        return self.position.epoch

    def set_epoch(self, epoch: int) -> None:
        """Chooses the epoch of the next pass (its order is decided by ``(seed, epoch)``).

        Optional: after a complete pass the loader moves to the next epoch by itself. As with
        ``DistributedSampler``, a pass already running keeps its epoch; the next ``iter()``
        uses the new one. Setting the epoch a resumed state is in keeps the resume position.
        """
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"epoch must be a non-negative int, got {epoch!r}")
        self.position.set_epoch(epoch)

    # -- passes -------------------------------------------------------------------------------------
    def __iter__(self) -> Pass:
        if self._closed:
            raise RuntimeError("this CoordLoader is closed")
        running = self._running()
        if running is not None:
            running.close()  # a new pass abandons an unfinished one, as with DataLoader
        self._start_world()
        if os.environ.get("COORDL_ANALYZE"):  # `coordl analyze` runs this script
            from coordl.analyze import probe

            phase = probe.claim(self)
            if phase is not None:
                self._pass_ref = weakref.ref(phase)
                return phase
        begin = self.position.begin(self._world.world_size)
        if self.group_options is not None and begin.start == 0 and begin.base == 0:
            p = self._group_member().open_pass(begin.epoch, self._hooks())
            self.position.follow_order(p.order_epoch)
        else:
            # Alone: a plain pass, or the rest of an HP group's epoch this job resumes mid-way
            # (it joins the group at the next epoch).
            locality = None
            peers = self.resources.peers
            if peers is not None:
                peers.sync()  # a collective: every rank learns who holds what
                if self.locality_aware:
                    locality = Locality(peers.holder, peers.rank_nodes)
            w = self._world
            batches = self.schedule.batches(begin.order_epoch, w.rank, w.world_size, begin.start, locality, begin.base)
            p = self.open_pass(
                batches, epoch=begin.epoch, order_epoch=begin.order_epoch, start=begin.start, **self._hooks()
            )
        self._pass_ref = weakref.ref(p)
        return p

    def open_pass(
        self,
        batches,
        *,
        epoch: int | None = None,
        order_epoch: int | None = None,
        start: int = 0,
        resources: Resources | None = None,
        **hooks,
    ) -> Pass:
        """A pass of this loader's backend over ``batches`` (sample ids per batch), outside the
        loader's position unless ``hooks`` say otherwise: the entry DS-Analyzer's phases use.

        Args:
            batches: the batches to deliver, in order.
            epoch: the epoch it belongs to (default: the loader's).
            order_epoch: the epoch whose order ``batches`` follow, which keys the samples'
                random augmentation (default: ``epoch``).
            start: the epoch's batch number of ``batches[0]``.
            resources: collaborators to use instead of the loader's (a private cache).
            **hooks: ``on_batch``, ``on_end``, ``on_stop`` (see :class:`~coordl.passes.Pass`).
        """
        self._start_world()
        res = resources if resources is not None else self.resources
        epoch = self.position.epoch if epoch is None else epoch
        order_epoch = epoch if order_epoch is None else order_epoch
        hooks.setdefault("owner", self)
        if self.backend == "torch":
            from coordl.backends.torch import TorchPass, seed_for

            self._start_dataloader(res)
            if self._own_generator:
                # The workers' seeds follow (seed, epoch, rank): a rerun augments alike, ranks differ.
                self.generator.manual_seed(seed_for(self.seed, epoch, self._world.rank))
            return TorchPass(
                res,
                self.config,
                batches,
                sampler=self._torch_sampler,
                persistent=self.persistent_workers,
                workers=self.num_workers,
                epoch=epoch,
                order_epoch=order_epoch,
                start=start,
                **hooks,
            )
        from coordl.backends.dali import DaliPass

        self._start_prep(res)
        return DaliPass(res, self.config, batches, epoch=epoch, order_epoch=order_epoch, start=start, **hooks)

    def _hooks(self) -> dict:
        """The position's hooks. A pass holds them, and so its loader, as a ``DataLoader`` iterator
        holds its ``DataLoader``; a pass's threads hold neither."""
        return {"on_batch": self._delivered, "on_end": self._ended, "on_stop": self._stopped}

    def _delivered(self, batches: int) -> None:
        self.position.delivered_to(batches)

    def _ended(self, p: Pass) -> None:
        self._last = p.stats()
        if self.log_epochs:
            print_epoch_line(self._last.as_dict(), self.world.rank)
        self.position.end()

    def _stopped(self, p: Pass) -> None:
        if not self._closed:
            self._last = p.stats()
        self.position.stop()

    def _running(self) -> Pass | None:
        p = self._pass_ref() if self._pass_ref is not None else None
        return p if p is not None and p.active else None

    def _start_world(self) -> None:
        """Reads the job's world when the first pass starts (a framework starts its process group
        after the script made its loaders)."""
        if self._world is None:
            self._world = world.detect(*self._explicit_world)
            self._start_peers()

    def _check_peers_possible(self) -> None:
        """``peers=True`` that can never work is refused when the loader is made."""
        from coordl.fetch import peer

        why = peer.refusal(self.peer_options, self.backend, self.group_options is not None, self.world, early=True)
        if why is not None and self.peer_options.mode is True:
            raise ValueError(f"peers=True, but the partitioned cache cannot run: {why}")

    def _start_peers(self) -> None:
        """The partitioned cache, when this job spans several nodes (see ``peers``)."""
        from coordl.fetch import peer

        o, res = self.peer_options, self.resources
        why = peer.refusal(o, self.backend, self.group_options is not None, self._world)
        if why is not None:
            if o.mode is True:
                raise ValueError(f"peers=True, but the partitioned cache cannot run: {why}")
            return
        res.peer_pool = threads.DaemonPool(8, thread_name_prefix="coordl-peer", initializer=lifecycle.quiet_thread)
        res.peers = peer.PeerGroup(
            self._world,
            self.index,
            res.cache,
            timeout=float(o.timeout),
            retry_after=float(o.retry_after),
            address=None,
            interface=o.interface,
            port=o.port if o.port is not None else env.integer("COORDL_PEER_PORT", 0, minimum=0),
        )

    def _start_prep(self, res: Resources) -> None:
        if res.lender is not None:
            self._start_prep(res.lender)
            res.prep = res.lender.prep
        if res.prep is None:
            from coordl.prep.dali import DaliPrep

            res.prep = DaliPrep(
                self.recipe,
                batch_size=self.batch_size,
                num_threads=self.num_threads,
                device_id=self.device_id,
                seed=self.seed,
                dali_seed=self.seed * 7919 + self._world.rank,
                on_error=self.on_error,
                tiered=res.decoded is not None,
            )
            lifecycle.before_dali_exit()

    def _start_dataloader(self, res: Resources) -> None:
        if res.dataloader is None:
            from coordl.backends import torch as tb

            self._torch_sampler = tb.EpochBatches()
            items = tb.Items(self.dataset, res.fetcher, res.cache_spec, self.on_error)
            res.dataloader = tb.make_dataloader(items, self._torch_sampler, self.torch_options, self.generator)

    def _group_member(self):
        if self._member is None:
            from coordl.staging.member import GroupMember

            self._start_prep(self.resources)
            self._member = GroupMember(
                self.group_options,
                self.resources,
                self.config,
                self.recipe,
                self._world,
                self.device_id,
                self.num_threads,
                self.identity(),
                batches_per_pass=len(self),
                epoch=self.position.epoch,
            )
        return self._member

    # -- resume -------------------------------------------------------------------------------------
    def identity(self) -> dict:
        """What identifies this loader's configuration (see :func:`coordl.config.identity`)."""
        prep = recipe_key(self.recipe) if self.backend == "dali" else f"torch:{type(self.dataset).__qualname__}"
        return identity(
            dataset=self.index.fingerprint,
            prep=prep,
            batch_size=self.batch_size,
            drop_last=self.drop_last,
            shuffle=self.shuffle,
            seed=self.seed,
        )

    def state_dict(self) -> dict:
        """The position of delivery, JSON-able: a few integers and strings.

        The same on every rank when every rank has received as many batches (as in DDP), so one
        rank's state resumes every rank, at this or another world size (see :meth:`load_state_dict`).
        """
        return {
            "version": STATE_VERSION,
            "seed": self.seed,
            "world_size": self.world.world_size,
            **self.position.state_dict(),
            "batch_size": self.batch_size,
            "drop_last": self.drop_last,
            "shuffle": self.shuffle,
            "dataset": self.index.fingerprint,
            "config": fingerprint(self.identity()),
        }

    def load_state_dict(self, state: dict) -> None:
        """Continues from ``state``: the next pass delivers exactly the samples not yet received.

        At the world size the state was saved at, the next pass continues the epoch's batches
        where every rank was. At another world size (other nodes, other ranks per node), the
        samples of the epoch that no rank had received are dealt to the new ranks, padded or cut
        as ``DistributedSampler`` pads or cuts an epoch; the epochs after it follow the new world.

        Raises:
            ValueError: ``state`` was saved by a differently configured loader (the message
                names the field) or is malformed.
        """
        check_state(state, self.state_dict(), len(self.index), self.schedule.num_batches)
        running = self._running()
        if running is not None:
            running.close()
        self.position.load_state_dict(state)

    # -- stats ----------------------------------------------------------------------------------------
    def stats(self) -> dict:
        """Counters of the current epoch, or of the last pass if none is running: where the bytes
        came from (per tier), where the time went (see :class:`~coordl.passes.PassStats`)."""
        running = self._running()
        if running is not None:
            return running.stats().as_dict()
        if self._last is not None:
            return self._last.as_dict()
        from coordl.fetch.fetcher import FetchCounters

        s = pass_stats(self.position.epoch, None if self._closed else self.cache, FetchCounters())
        if self.group_options is not None:
            from coordl.staging.member import EMPTY_GROUP_STATS

            s.extra.update(EMPTY_GROUP_STATS)
        return s.as_dict()

    # -- lifetime ---------------------------------------------------------------------------------------
    def close(self) -> None:
        """Stops background work and leaves the cache (the last user removes it). Idempotent.

        A loader a script leaves open is closed when it is garbage collected, at exit, and on
        SIGTERM; a forked child never closes its parent's loaders.
        """
        if self._closed:
            return
        self._closed = True
        if os.getpid() != self._pid:  # a forked child's copy: the parent's threads and memberships
            return
        running = self._pass_ref() if self._pass_ref is not None else None
        if running is not None:
            running.close()
        if self._member is not None:
            self._member.close()
        self.resources.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - never raise from a finaliser
            pass

    def __repr__(self) -> str:
        if self.backend == "torch":
            prep = f"dataset={type(self.dataset).__name__}, num_workers={self.num_workers}"
        else:
            prep = f"pipeline={getattr(self.recipe, 'name', 'custom')!r}"
        w = self.world
        return (
            f"CoordLoader({self.index.root or f'{len(self.index)} samples'!s}, batch_size={self.batch_size}, "
            f"{prep}, rank={w.rank}/{w.world_size}, cache={'off' if self.cache is None else self.cache.budget})"
        )
