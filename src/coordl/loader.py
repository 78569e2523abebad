"""CoordLoader: a drop-in replacement for ``torch.utils.data.DataLoader`` on DALI, with the node's cache.

The loader wires the chain and owns the position; everything else is a collaborator:
:mod:`~coordl.options` (one option object per feature), :mod:`~coordl.sources` (the data and its
backend), :mod:`~coordl.tiers` (the node's cache, planned), :mod:`~coordl.schedule` (this rank's
batches of a pass), :mod:`~coordl.position` (epoch and batches delivered; resume),
:mod:`~coordl.resources` (what passes share, made when the first pass starts) and a pass per
``iter()`` (:mod:`~coordl.backends.dali`, :mod:`~coordl.backends.torch`,
:mod:`~coordl.staging.member`). :mod:`~coordl.lifecycle` closes loaders a script leaves open.
"""

from __future__ import annotations

import functools
import os
import weakref
from collections.abc import Sequence

from coordl import cpus, lifecycle, sources, world
from coordl.accounting import print_epoch_line, standing_fields
from coordl.config import LoaderConfig, TorchOptions, fingerprint, identity
from coordl.fetch import disk, peer
from coordl.fetch.fetcher import FetchCounters
from coordl.index import Index
from coordl.options import AUTO, Cache, Fetch, HPGroup, Options, Peers, Prep, RayPrep, Shard
from coordl.passes import Pass, PassStats, pass_stats
from coordl.position import VERSION, Position, check_state
from coordl.prep import calibrate
from coordl.prep.site import site
from coordl.renamed import refuse_renamed
from coordl.resources import Resources
from coordl.sampler import ORDER_VERSION
from coordl.schedule import Locality, Schedule
from coordl.tiers import plan as tiers
from coordl.views import DataLoaderAttributes

__all__ = ["CoordLoader"]


class CoordLoader(DataLoaderAttributes):
    """Iterates batches of a dataset, like a ``DataLoader``: what the recipe's targets make (images
    and labels for the ImageNet recipes, images and boxes for SSD's, clips and labels for audio's),
    or what the dataset's ``collate_fn`` makes on the torch backend.

    ``DataLoader``'s arguments keep their meaning and default. Two backends share the order,
    sharding, resume, cache and statistics: files are decoded and augmented by DALI
    (``pipeline``); a dataset of :mod:`coordl.datasets` (``ImageFolder(root, transform=...)``,
    ``DatasetFolder``, ``FileDataset``) runs the *torch backend*: PyTorch ``DataLoader`` workers
    read the bytes through the node's cache and apply the dataset's own Python transforms.

    Args:
        data: an ImageFolder-style folder (one sub-folder per class; ``coordl.Index.scan(root,
            extensions=..., index_dir=...)`` scans one with other settings), an ``s3://`` prefix of
            one, tar shards (a pattern, a folder of ``.tar`` files or a list of them), a list of
            ``(path, label)`` pairs, an :class:`~coordl.index.Index`, or a dataset of
            :mod:`coordl.datasets` (the torch backend).
        batch_size: samples per batch.
        shuffle: reshuffle every epoch, in the order decided by ``(seed, epoch)``; ``False``
            (``DataLoader``'s default): the index's order.
        sampler, batch_sampler: not accepted: coordl decides the order (``shuffle``, ``seed``,
            ``set_epoch``, the rank's shard) so that it can guarantee and resume it. The attributes
            ``loader.sampler`` and ``loader.batch_sampler`` describe that order as ``DataLoader``'s do.
        num_workers: the torch backend's worker processes (0: loading in the main process). DALI
            decodes on threads instead (``prep``).
        collate_fn, pin_memory, timeout, worker_init_fn, multiprocessing_context, generator,
        prefetch_factor, persistent_workers, pin_memory_device: as for ``DataLoader``, on the torch
            backend. ``generator`` defaults to one seeded by ``(seed, epoch, rank)``, so workers'
            random transforms repeat from run to run. ``pin_memory`` has no effect with DALI, whose
            outputs are on their device already.
        drop_last: drop each rank's last incomplete batch (``DataLoader``'s). Whether the ranks'
            shards are padded or cut is ``shard=coordl.Shard(pad=...)``
            (padded by default, as ``DistributedSampler``).
        in_order: must be True: batches arrive in the epoch's order, which resume counts on.
        pipeline: how DALI pre-processes the files (required for them): ``"imagenet-train"`` (random
            resized crop, flip, normalise), ``"imagenet-val"`` (resize, center crop, normalise),
            ``"ssd-train"``, ``"ssd-val"`` (detection: boxes move with the pixels), ``"audio-train"``,
            ``"audio-val"`` (clips and their labels), a recipe object (:class:`coordl.ImageNetTrain`,
            :class:`coordl.ImageNetVal`, :class:`coordl.SSDTrain`, :class:`coordl.SSDVal`,
            :class:`coordl.AudioTrain`, :class:`coordl.AudioVal`, :class:`coordl.DecodedRecipe`, a
            subclass of :class:`coordl.Recipe`) or a callable ``f(encoded, ctx)`` returning DALI ops
            (docs/recipes.md).
        seed: seed of the order and of the augmentation.
        device_id: GPU for decoding and outputs; ``"auto"`` uses GPU ``LOCAL_RANK`` under a
            launcher that sets it (torchrun), else the current CUDA device, else the CPU;
            None forces the CPU.
        cache: the node's cache: a :class:`coordl.Cache`, or its size (``"auto"``, bytes, a string
            such as ``"40GB"``, a float fraction of the dataset, or 0 for none).
        peers: the partitioned cache across nodes: a :class:`coordl.Peers`, or ``"auto"``,
            ``True``, ``False``.
        hp_group: coordinated prep with the other jobs of a hyper-parameter search on this
            machine: a :class:`coordl.HPGroup`, or the group's name.
        shard: this process's rank, the world size and the shards' tail: a :class:`coordl.Shard`
            (default: the job's, read when the first pass starts).
        prep: where and with how many threads batches are prepared: a :class:`coordl.Prep` (or its
            thread count) on this machine, or a :class:`coordl.RayPrep` on a Ray cluster's actors.
        fetch: the DALI backend's reads from storage: a :class:`coordl.Fetch`.
        on_error: ``"raise"`` (default) stops at an unreadable or undecodable sample with
            its path; ``"skip"`` leaves it out of its batch and counts it in ``stats()``.
        return_index: also yield each sample's position in the index.
        log_epochs: print one line of statistics per epoch to stderr (where the time went, where
            the bytes came from); also turned on by the environment variable ``COORDL_LOG_EPOCHS=1``.
    """

    @refuse_renamed
    def __init__(
        self,
        data: str | os.PathLike | Sequence[tuple[str, int]] | Index,
        batch_size: int = 1,
        shuffle: bool = False,
        sampler=None,
        batch_sampler=None,
        num_workers: int = 0,
        collate_fn=None,
        pin_memory: bool = False,
        drop_last: bool = False,
        timeout: float = 0,
        worker_init_fn=None,
        multiprocessing_context=None,
        generator=None,
        *,
        prefetch_factor: int | None = None,
        persistent_workers: bool = False,
        pin_memory_device: str = "",
        in_order: bool = True,
        pipeline=None,
        seed: int = 0,
        device_id: int | str | None = "auto",
        cache: Cache | int | float | str = AUTO,
        peers: Peers | bool | str = AUTO,
        hp_group: HPGroup | str | None = None,
        shard: Shard | None = None,
        prep: Prep | RayPrep | int | None = None,
        fetch: Fetch | None = None,
        on_error: str = "raise",
        return_index: bool = False,
        log_epochs: bool = False,
    ):
        if sampler is not None or batch_sampler is not None:
            raise ValueError(
                "CoordLoader decides the order of samples itself (shuffle=, seed=, set_epoch(), one shard per "
                "rank) so that every epoch is exactly-once and resumable; drop sampler=/batch_sampler="
            )
        if in_order is not True:
            raise ValueError("in_order must be True: batches arrive in the epoch's order, which resume counts on")
        self._closed = True  # until the caches are open
        self.options = Options.of(cache=cache, peers=peers, hp_group=hp_group, shard=shard, prep=prep, fetch=fetch)
        self.config = LoaderConfig(
            batch_size=batch_size,
            shuffle=shuffle,
            drop_last=drop_last,
            seed=seed,
            on_error=on_error,
            return_index=return_index,
            log_epochs=log_epochs,
            batches_ahead=self.options.fetch.batches_ahead,
        )
        self.torch_options = TorchOptions(
            num_workers=num_workers,
            pin_memory=bool(pin_memory),
            collate_fn=collate_fn,
            worker_init_fn=worker_init_fn,
            timeout=timeout,
            multiprocessing_context=multiprocessing_context,
            generator=generator,
            prefetch_factor=prefetch_factor,
            persistent_workers=bool(persistent_workers),
            pin_memory_device=pin_memory_device,
        )
        source = sources.open_source(data, pipeline, device_id, self.torch_options, self.options, on_error)
        self.backend, self.index, self.dataset = source.backend, source.index, source.dataset
        self.recipe, self.device_id = source.recipe, source.device_id
        # What the loader is decides whether the partitioned cache can serve it; where it runs, at
        # the first pass. peers=True that can never work is refused now.
        self._peers_refusal = peer.refusal(self.options.peers, self.backend, self.options.hp_group is not None)
        if self._peers_refusal is not None and self.options.peers.enabled is True:
            raise ValueError(f"peers=True, but the partitioned cache cannot run: {self._peers_refusal}")
        site(self.options.prep).connect()  # RayPrep's cluster: none there is an error now, not at the first pass
        if self.backend == "dali":
            import coordl.prep.dali  # noqa: F401 - DALI's import takes seconds: now, not in the first pass

            lifecycle.before_dali_exit()
        if self.backend == "torch" and generator is None:
            import torch

            generator = torch.Generator()  # seeded before every pass by (seed, epoch, rank)
        self.generator = generator
        self._own_generator = generator is not self.torch_options.generator
        self.schedule = Schedule(
            samples=len(self.index),
            batch_size=self.config.batch_size,
            shuffle=self.config.shuffle,
            drop_last=self.config.drop_last,
            seed=self.config.seed,
            shard_drop_last=not self.options.shard.pad,
        )
        self.position = Position(len(self.index), self.config.batch_size)
        self._world: world.World | None = None  # read when the first pass starts
        self._resources: Resources | None = None  # made when the first pass starts
        self._member = None  # this loader's part in its HP group, made on the first pass
        self._alone = False  # its HP group's names were another user's: it runs alone (warned once)
        self._pass_ref = None  # the running pass (weakly: a dropped pass closes itself)
        self._last: PassStats | None = None
        self._pid = os.getpid()
        self.tier_plan = self._plan_tiers()
        # The node's tiers, attached (made by the first job); the memory tier is CoorDL's MinIO cache.
        self.node_cache, self.decoded_tier = self.tier_plan.open(self.index.sizes)
        self._disk_spec = disk.spec_for(self.options.cache.disk, self.index)
        self.disk_tier = self._disk_spec.open() if self._disk_spec is not None else None  # the local-storage tier
        self._closed = False
        lifecycle.track(self)

    def _plan_tiers(self) -> tiers.TierPlan:
        """The node's cache for this loader: its budget, and its split when a decoded tier is asked for."""
        w = self.world
        why_not = tiers.refusal(self.backend, self.device_id, self.recipe, w.world_size > w.local_world_size)
        measure = functools.partial(
            calibrate.measure,
            self.recipe,
            self.index,
            num_threads=self.options.prep.threads or self._default_threads(),
            seed=self.seed,
            batch_size=self.batch_size,
            io_threads=self.options.fetch.threads,
            choose_threads=self.options.prep.threads is None,  # then it picks the fewest that prep as fast
        )
        return tiers.plan(
            self.index,
            self.options.cache,
            why_not=why_not,
            measure=measure,
            form=self.recipe.decoded_form() if self.recipe is not None else None,
        )

    # -- where the job is ------------------------------------------------------------------------
    @property
    def world(self) -> world.World:
        """This process's place in the job: fixed by the first pass, read from the job until then."""
        if self._world is not None:
            return self._world
        shard = self.options.shard
        return world.detect(shard.rank, shard.world_size)

    def _default_threads(self) -> int:
        return max(1, cpus.available() // max(1, self.world.local_world_size))

    @property
    def num_threads(self) -> int:
        """DALI's threads: ``Prep(threads)``, else what ``Cache(decoded="auto")`` chose, else the CPUs
        this process may use over the ranks on its node."""
        return self.options.prep.threads or self.tier_plan.threads or self._default_threads()

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
        res = self.resources
        w = self._world
        begin = self.position.begin(w.world_size)
        if self.options.hp_group is not None and begin.start == 0 and begin.base == 0 and self._group_member():
            alone = functools.partial(self.open_pass, epoch=begin.epoch)  # if the group detaches this job
            p = self._group_member().open_pass(begin.epoch, self._hooks(), alone)
            self.position.follow_order(p.order_epoch)
        else:
            # Alone: a plain pass, or the rest of an HP group's epoch this job resumes mid-way
            # (it joins the group at the next epoch).
            locality = None
            if res.peers is not None:
                res.peers.sync()  # a collective: every rank learns who holds what
                if self.options.peers.locality_aware:
                    locality = Locality(res.peers.holder, res.peers.rank_nodes)
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
            resources: collaborators to use instead of the loader's
                (:meth:`Resources.with_cache <coordl.resources.Resources.with_cache>`: a private cache).
            **hooks: ``on_batch``, ``on_end``, ``on_stop`` (see :class:`~coordl.passes.Pass`).
        """
        res = resources if resources is not None else self.resources
        epoch = self.position.epoch if epoch is None else epoch
        order_epoch = epoch if order_epoch is None else order_epoch
        hooks.setdefault("owner", self)
        if res.remote is not None:
            from coordl.remote.raypass import RayPass

            if self.backend == "torch" and self._own_generator:
                from coordl.backends.torch import seed_for

                self.generator.manual_seed(seed_for(self.seed, epoch, self._world.rank))
            pin = self.torch_options.pin_memory_device if self.torch_options.pin_memory else None
            return RayPass(
                res,
                self.config,
                batches,
                backend=self.backend,
                persistent=self.persistent_workers,
                pin_memory=pin if self.backend == "torch" else None,
                epoch=epoch,
                order_epoch=order_epoch,
                start=start,
                **hooks,
            )
        if self.backend == "torch":
            from coordl.backends.torch import TorchPass, seed_for

            if self._own_generator:
                # The workers' seeds follow (seed, epoch, rank): a rerun augments alike, ranks differ.
                self.generator.manual_seed(seed_for(self.seed, epoch, self._world.rank))
            return TorchPass(
                res,
                self.config,
                batches,
                persistent=self.persistent_workers,
                workers=self.num_workers,
                epoch=epoch,
                order_epoch=order_epoch,
                start=start,
                **hooks,
            )
        from coordl.backends.dali import DaliPass

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

    # -- what passes share, made when the first pass starts -------------------------------------------
    @property
    def resources(self) -> Resources:
        """The passes' collaborators (:class:`~coordl.resources.Resources`), made complete when the
        first pass starts, or when this is first read: the job's world is read then, and fixed (a
        framework starts its process group after the script made its loaders)."""
        if self._resources is None:
            if self._closed:
                raise RuntimeError("this CoordLoader is closed")
            shard = self.options.shard
            self._world = world.detect(shard.rank, shard.world_size)
            self._resources = self._open_resources()
        return self._resources

    def _open_resources(self) -> Resources:
        w, o, dali = self._world, self.options, self.backend == "dali"
        why = self._peers_refusal or peer.world_refusal(w)
        if why is not None and o.peers.enabled is True:
            raise ValueError(f"peers=True, but the partitioned cache cannot run: {why}")
        prep = dict(recipe=self.recipe, batch_size=self.batch_size, num_threads=self.num_threads)
        prep.update(device_id=self.device_id, seed=self.seed, on_error=self.on_error)
        dataloader = dict(dataset=self.dataset, on_error=self.on_error, options=self.torch_options)
        delivery = None
        if dali:
            from coordl.delivery import Delivery

            delivery = Delivery(
                self.recipe,
                self.index.boxes,
                self.seed,
                return_index=self.config.return_index,
                collate_fn=self.torch_options.collate_fn,
            )
        remote = site(o.prep).actors(
            backend=self.backend,
            config=self.config,
            cache=o.cache,
            recipe=self.recipe,
            torch_options=self.torch_options,
            device_id=self.device_id,
        )
        return Resources.open(
            self.index,
            self.node_cache,
            self.decoded_tier,
            self.tier_plan.encoded,
            disk=self.disk_tier,
            disk_spec=self._disk_spec,
            world=w,
            io_threads=o.fetch.threads if dali else 0,
            peers=o.peers if why is None else None,
            prep=prep if dali else None,
            dataloader=None if dali else dict(dataloader, generator=self.generator),
            remote=remote,
            delivery=delivery,
        )

    def _group_member(self):
        if self._member is None and not self._alone:
            from coordl.staging.member import GroupMember

            self._member = GroupMember.attach(
                options=self.options.hp_group,
                resources=self.resources,
                config=self.config,
                schedule=self.schedule,
                recipe=self.recipe,
                world=self._world,
                device_id=self.device_id,
                num_threads=self.num_threads,
                identity=self.identity(),
                epoch=self.position.epoch,
                producers=site(self.options.prep).group_producers(),
            )
            self._alone = self._member is None
        return self._member

    # -- resume -------------------------------------------------------------------------------------
    def identity(self) -> dict:
        """What identifies this loader's configuration (see :func:`coordl.config.identity`)."""
        prep = self.recipe.key() if self.backend == "dali" else f"torch:{type(self.dataset).__qualname__}"
        return identity(
            dataset=self.index.fingerprint,
            prep=prep,
            batch_size=self.batch_size,
            drop_last=self.drop_last,
            shard_drop_last=self.schedule.shard_drop_last,
            shuffle=self.shuffle,
            seed=self.seed,
            order=ORDER_VERSION,
        )

    def state_dict(self) -> dict:
        """The position of delivery, JSON-able: a few integers and strings.

        The same on every rank when every rank has received as many batches (as in DDP), so one
        rank's state resumes every rank, at this or another world size (see :meth:`load_state_dict`).
        """
        return {
            "version": VERSION,
            "order": ORDER_VERSION,
            "seed": self.seed,
            "world_size": self.world.world_size,
            **self.position.state_dict(),
            "batch_size": self.batch_size,
            "drop_last": self.drop_last,
            "shard_drop_last": self.schedule.shard_drop_last,
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
            ValueError: ``state`` was saved by a differently configured loader (the message names
                the field), with another epoch order (another version of coordl), or is malformed.
        """
        check_state(state, self.state_dict(), len(self.index), self.schedule.num_batches)
        running = self._running()
        if running is not None:
            running.close()
        self.position.load_state_dict(state)

    # -- stats ----------------------------------------------------------------------------------------
    def stats(self) -> dict:
        """Counters of the current epoch, or of the last pass if none is running: where the bytes
        came from (per tier), where the time went (see :class:`~coordl.passes.PassStats`), and
        ``index_changed``: the samples whose file or object the index's check found changed (size,
        modification time or ETag) since the index was saved, read from the store again in this run
        (:attr:`Index.changed <coordl.index.Index.changed>`). A detection dataset's also say what
        indexing left out (``index_skipped``: images, boxes and annotations, with ``on_error="skip"``)."""
        return {**self._stats(), **standing_fields(self.index, self.disk_tier)}

    def _stats(self) -> dict:
        running = self._running()
        if running is not None:
            return running.stats().as_dict()
        if self._last is not None:
            return self._last.as_dict()
        s = pass_stats(self.position.epoch, None if self._closed else self.node_cache, FetchCounters())
        if self.options.hp_group is not None:
            from coordl.staging.member import EMPTY_GROUP_STATS

            s.extra.update(EMPTY_GROUP_STATS)
        s.extra.update(site(self.options.prep).stats_fields())
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
        if self._resources is not None:
            self._resources.close()
        for cache in (self.decoded_tier, self.node_cache):
            if cache is not None:
                cache.close()
        if self._resources is not None and self._resources.remote is not None:
            self._resources.remote.remove_left_cache(self.node_cache)  # held by actors killed while starting
        if self.disk_tier is not None:
            self.disk_tier.close()  # after the writes this process queued (bounded)

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
            prep = f"pipeline={self.recipe.name or 'custom'!r}"
        w, cache = self.world, self.node_cache
        return (
            f"CoordLoader({self.index.root or f'{len(self.index)} samples'!s}, batch_size={self.batch_size}, "
            f"{prep}, rank={w.rank}/{w.world_size}, cache={'off' if cache is None else cache.budget})"
        )
