"""CoordLoader: a drop-in replacement for ``torch.utils.data.DataLoader`` on DALI with a MinIO cache.

The chain, each link in its own module: :mod:`~coordl.index` (samples) ->
:mod:`~coordl.sampler` (this rank's order for the epoch) ->
:mod:`~coordl.fetch` (raw bytes: node cache, then storage) ->
:mod:`~coordl.prep.dali` (decode + augment) -> this iterator (torch tensors).
The loader owns the resume state: which epoch, and how many batches the consumer
has received.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import hashlib
import json
import logging
import os
import queue
import threading
import time
from collections.abc import Sequence

import numpy as np

from coordl import sampler, world
from coordl.accounting import StepWaits, print_epoch_line
from coordl.errors import CoordlError
from coordl.fetch import Fetcher
from coordl.fetch.ahead import FetchAhead, RawBatch, Stopped
from coordl.fetch.cache import MinIOCache, resolve_budget
from coordl.index import IMG_EXTENSIONS, Index
from coordl.prep.recipes import ImageNetTrain, ImageNetVal, recipe_key, resolve_recipe
from coordl.shm import names, reaper

__all__ = ["CoordLoader"]

log = logging.getLogger(__name__)

STATE_VERSION = 1
_reaped = False


def _reap_once(directory: str) -> None:
    """Reclaims, once per process, what crashed jobs left in the shm directory."""
    global _reaped
    if _reaped:
        return
    _reaped = True
    try:
        for g in reaper.reap(directory):
            log.info("coordl: removed %d bytes of shared memory left by a dead job (%s)", g.bytes, g.fingerprint)
    except OSError as e:  # an unreadable directory is reported when the cache is opened
        log.debug("coordl: reaping %s failed: %s", directory, e)


class CoordLoader:
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
        keep_cache: keep the cache in shared memory after the last user leaves.
        rank: this process's rank (default: ``torch.distributed`` or ``RANK``).
        world_size: number of ranks (default: ``torch.distributed`` or ``WORLD_SIZE``).
        device_id: GPU for decoding and outputs; ``"auto"`` uses GPU ``LOCAL_RANK`` under a
            launcher that sets it (torchrun), else the current CUDA device, else the CPU;
            None forces the CPU.
        num_threads: DALI threads (default: CPU cores / ranks on this node).
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
            ``set_epoch``, the rank's shard) so that it can guarantee and resume it.
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
        if num_workers is not None and (isinstance(num_workers, bool) or not isinstance(num_workers, int)
                                        or num_workers < 0):  # fmt: skip
            raise ValueError(f"num_workers must be a non-negative int, got {num_workers!r}")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        if on_error not in ("raise", "skip"):
            raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
        if not isinstance(seed, int):
            raise TypeError(f"seed must be an int, got {type(seed).__name__}")
        if io_threads < 1 or prefetch_batches < 1:
            raise ValueError("io_threads and prefetch_batches must be at least 1")
        if hp_group is not None and (not isinstance(hp_group, str) or not hp_group):
            raise ValueError(f"hp_group must be a non-empty string, got {hp_group!r}")
        if peers not in ("auto", True, False):
            raise ValueError(f"peers must be 'auto', True or False, got {peers!r}")
        if peer_timeout <= 0 or peer_retry_after < 0:
            raise ValueError("peer_timeout must be positive and peer_retry_after non-negative")
        if hp_idle_timeout <= 0:
            raise ValueError(f"hp_idle_timeout must be positive, got {hp_idle_timeout!r}")
        self.log_epochs = bool(log_epochs) or os.environ.get("COORDL_LOG_EPOCHS", "") not in ("", "0")
        self.hp_group = hp_group
        self.hp_staging = hp_staging
        self.hp_idle_timeout = float(hp_idle_timeout)
        self._area = None
        self._gprep = None
        self._group_in_step = True
        self._produced_total = 0  # group batches this loader's producers made
        self._produced_mark = 0  # every group pass so far had the order of this loader's epoch
        self.batch_size = batch_size
        self.shuffle = bool(shuffle)
        self.drop_last = bool(drop_last)
        self.seed = seed
        self.return_index = return_index
        self.on_error = on_error
        self.prefetch_batches = prefetch_batches
        self.world = world.detect(rank, world_size)
        self.dataset = _as_dataset(data)
        self.backend = "dali" if self.dataset is None else "torch"
        torch_args = {"collate_fn": collate_fn, "worker_init_fn": worker_init_fn, "timeout": timeout,
                      "multiprocessing_context": multiprocessing_context, "generator": generator,
                      "prefetch_factor": prefetch_factor, "persistent_workers": persistent_workers,
                      "pin_memory_device": pin_memory_device}  # fmt: skip
        if self.backend == "dali":
            given = [k for k, v in torch_args.items() if v not in (None, 0, False, "")]
            if given:
                raise ValueError(
                    f"{', '.join(given)} apply to the torch backend, which runs a dataset of coordl.datasets "
                    "(e.g. coordl.datasets.ImageFolder(root, transform=...)); a folder or a list is decoded by DALI"
                )
            self.index = _make_index(data, extensions, index_dir)
            self.recipe = resolve_recipe(pipeline)
            self.device_id = _resolve_device(device_id)
        else:
            if pipeline != "imagenet-train":
                raise ValueError("pipeline= is for DALI; with a dataset, its transform is the pre-processing")
            if hp_group is not None:
                raise ValueError(
                    "hp_group is not available on the torch backend yet: use a folder or a list of files, "
                    "decoded by DALI, for coordinated pre-processing"
                )
            self.index = self.dataset.index
            self.recipe = None
            self.device_id = None  # the batches are collate_fn's, on the CPU (pinned with pin_memory)
        if len(self.index) == 0:
            raise ValueError("the dataset has no samples")
        cores = os.cpu_count() or 1
        self.num_threads = num_threads or num_workers or max(1, cores // max(1, self.world.local_world_size))
        self.num_workers = 0 if num_workers is None else num_workers
        self.persistent_workers = bool(persistent_workers)
        torch_args.pop("generator")  # kept apart: coordl seeds its own one before every pass
        self._torch_args = dict(torch_args, pin_memory=bool(pin_memory))
        self._own_generator = generator is None
        self._generator = generator
        self._loader_obj = None  # the torch backend's DataLoader, made on the first pass
        self._epoch = 0
        self._order_epoch = 0  # the sampler epoch of the current pass (an HP group's may differ)
        self._resume_order: int | None = None
        self._pending_epoch: int | None = None  # set_epoch() during a pass: for the next one
        self._delivered = 0  # batches of self._epoch the consumer has received
        self._resume_from = 0
        self._iter: _Pass | None = None
        self._stats: dict = {}
        self._closed = False
        self.cache = self._open_cache(cache_bytes, keep_cache)
        self._fetcher = Fetcher(self.index, self.cache, drop_page_cache=self.cache is not None)
        self._prep = None
        self._pool = None
        self._peer_pool = None
        self.locality_aware = bool(locality_aware)
        self._peers = self._open_peers(peers, peer_timeout, peer_retry_after, peer_interface, peer_port)
        if self.backend == "torch":
            from coordl.prep import torch_backend

            self._batch_sampler = torch_backend.EpochBatches()
            if self._own_generator:
                import torch

                self._generator = torch.Generator()
            return
        self._pool = cf.ThreadPoolExecutor(io_threads, thread_name_prefix="coordl-io")
        from coordl.prep.dali import DaliPrep  # DALI is imported when a loader is made, not with coordl

        self._prep = DaliPrep(
            self.recipe,
            batch_size=batch_size,
            num_threads=self.num_threads,
            device_id=self.device_id,
            seed=seed * 7919 + self.world.rank,
            on_error=on_error,
        )

    def _open_peers(self, peers, timeout, retry_after, interface, port):
        """The partitioned cache, when this job spans several nodes (see ``peers``)."""
        from coordl.fetch import peer

        if peers is False:
            return None
        why = None
        if self.backend != "dali":
            why = "it serves the DALI backend (a folder or a list of files), not the torch backend yet"
        elif self.hp_group is not None:
            why = "an hp_group shares prep within one node"
        elif not peer.enabled(self.world):
            why = ("the job runs on one node, or torch.distributed is not initialized (call "
                   "torch.distributed.init_process_group before making the loader)")  # fmt: skip
        if why is not None:
            if peers is True:
                raise ValueError(f"peers=True, but the partitioned cache cannot run: {why}")
            return None
        if port is None:
            port = world.env_int("COORDL_PEER_PORT", 0)
        self._peer_pool = cf.ThreadPoolExecutor(8, thread_name_prefix="coordl-peer")
        return peer.PeerGroup(self.world, self.index, self.cache, timeout=float(timeout),
                              retry_after=float(retry_after), address=None, interface=interface, port=port)  # fmt: skip

    def _open_cache(self, cache_bytes, keep: bool) -> MinIOCache | None:
        directory = names.shm_dir()
        budget = resolve_budget(cache_bytes, self.index.total_bytes, directory, num_items=len(self.index))
        self._analyze_budget = budget  # the budget DS-Analyzer's fetch phase uses
        if budget == 0 and cache_bytes == "auto":
            log.warning("coordl: no room for a cache in %s; reading every sample from storage", directory)
        if budget == 0:
            return None
        _reap_once(directory)
        # Per user: segments are 0600, so two users of one dataset get a cache each.
        group = hashlib.sha256(f"{self.index.fingerprint}:{os.getuid()}".encode()).hexdigest()[:16]
        return MinIOCache(group, self.index.sizes, budget, keep=keep, directory=directory, dataset=self.index.fingerprint)

    def _dataloader(self):
        """The torch backend's ``DataLoader`` (one for the loader's life: persistent workers persist)."""
        if self._loader_obj is None:
            from coordl.prep import torch_backend as tb

            spec = None
            c = self.cache
            if c is not None:  # each worker attaches to the same cache by itself
                spec = tb.CacheSpec(c.fingerprint, c.budget, c.keep, c.directory, c.dataset)
            items = tb.Items(self.dataset, self._fetcher, spec, self.on_error)
            args = dict(self._torch_args, generator=self._generator)
            self._loader_obj = tb.make_dataloader(items, self._batch_sampler, num_workers=self.num_workers, **args)
        return self._loader_obj

    # -- DataLoader-like surface -----------------------------------------------------------
    def __len__(self) -> int:
        per_rank = sampler.shard_size(len(self.index), self.world.world_size, self.drop_last)
        return sampler.num_batches(per_rank, self.batch_size, self.drop_last)

    @property
    def epoch(self) -> int:
        """The epoch the next (or current) pass delivers."""
        return self._epoch

    def set_epoch(self, epoch: int) -> None:
        """Chooses the epoch of the next pass (its order is decided by ``(seed, epoch)``).

        Optional: after a complete pass the loader moves to the next epoch by itself. As with
        ``DistributedSampler``, a pass already running keeps its epoch; the next ``iter()``
        uses the new one. Setting the epoch a resumed state is in keeps the resume position.
        """
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"epoch must be a non-negative int, got {epoch!r}")
        if self._iter is not None and self._iter.active:
            self._pending_epoch = epoch
        elif epoch != self._epoch:
            self._pending_epoch = None
            self._epoch, self._delivered, self._resume_from = epoch, 0, 0

    def __iter__(self):
        if self._closed:
            raise RuntimeError("this CoordLoader is closed")
        if self._iter is not None:
            self._iter.close()  # a new pass abandons an unfinished one, as with DataLoader
        if os.environ.get("COORDL_ANALYZE"):  # `coordl analyze` runs this script
            from coordl.analyze import probe

            phase = probe.claim(self)
            if phase is not None:
                self._iter = phase
                return phase
        if self._pending_epoch is not None:
            if self._pending_epoch != self._epoch:
                self._epoch, self._resume_from, self._resume_order = self._pending_epoch, 0, None
            self._pending_epoch = None
        start = self._resume_from
        order_epoch = self._resume_order if self._resume_order is not None else self._epoch
        self._resume_from, self._resume_order = 0, None
        self._delivered = start
        self._resume_from_started = start
        if self.hp_group is not None and start == 0:
            from coordl.staging.hp import GroupPass

            self._iter = GroupPass(self, self._epoch)
            return self._iter
        # Alone: a plain pass, or the rest of an HP group's epoch this job resumes mid-way
        # (it joins the group at the next epoch).
        self._order_epoch = order_epoch
        order = sampler.epoch_order(len(self.index), self.seed, order_epoch, self.shuffle)
        if self._peers is not None:
            self._peers.sync()  # a collective: every rank learns who holds what
        if self._peers is not None and self.locality_aware:
            from coordl import placement

            w, p = self.world, self._peers
            batches = placement.locality_batches(order, w.rank, w.world_size, self.batch_size, self.drop_last,
                                                 p.holder, p.rank_nodes, start=start)  # fmt: skip
        else:
            ids = sampler.shard(order, self.world.rank, self.world.world_size, self.drop_last)
            batches = sampler.batches(ids, self.batch_size, self.drop_last, start=start)
        if self.backend == "torch":
            from coordl.prep.torch_backend import TorchPass

            self._iter = TorchPass(self, self._epoch, batches)
        else:
            self._iter = _Pass(self, self._epoch, batches)
        return self._iter

    def _on_batch(self, position: int) -> None:
        self._delivered = position

    def _on_pass_end(self, p) -> None:
        self._stats = p.stats(complete=True)
        if self.log_epochs:
            print_epoch_line(self._stats, self.world.rank)
        self._epoch += 1
        self._delivered = 0

    # -- resume ---------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The position of delivery: JSON-able, a few integers and strings."""
        epoch, batches = self._epoch, self._delivered
        order_epoch = self._order_epoch if batches else None
        if self._resume_order is not None:
            order_epoch = self._resume_order
        if self._pending_epoch is not None and self._pending_epoch != epoch:
            epoch, batches, order_epoch = self._pending_epoch, 0, None
        state = {
            "version": STATE_VERSION,
            "seed": self.seed,
            "epoch": epoch,
            "batches": batches,
            "rank": self.world.rank,
            "world_size": self.world.world_size,
            "batch_size": self.batch_size,
            "drop_last": self.drop_last,
            "shuffle": self.shuffle,
            "dataset": self.index.fingerprint,
            "config": self._config_fingerprint(),
        }
        if order_epoch is not None and order_epoch != epoch:
            state["order_epoch"] = order_epoch  # an HP group's pass follows the group's order
        return state

    def load_state_dict(self, state: dict) -> None:
        """Continues from ``state``: the next pass delivers exactly the batches not yet received.

        Raises:
            ValueError: ``state`` was saved by a differently configured loader (the message
                names the field) or is malformed.
        """
        if not isinstance(state, dict):
            raise TypeError(f"state must be a dict from state_dict(), got {type(state).__name__}")
        mine = self.state_dict()
        missing = sorted(set(mine) - set(state) - {"order_epoch"})
        if missing:
            raise ValueError(f"state is missing {', '.join(missing)}; was it made by CoordLoader.state_dict()?")
        for key in ("version", "seed", "rank", "world_size", "batch_size", "drop_last", "shuffle", "dataset", "config"):
            if state[key] != mine[key]:
                raise ValueError(
                    f"cannot resume: state has {key}={state[key]!r} but this loader has {key}={mine[key]!r}"
                )
        epoch, batches = state["epoch"], state["batches"]
        order_epoch = state.get("order_epoch", epoch)
        if not (isinstance(epoch, int) and epoch >= 0 and isinstance(batches, int) and 0 <= batches <= len(self)):
            raise ValueError(f"state has an invalid position: epoch={epoch!r}, batches={batches!r} of {len(self)}")
        if not (isinstance(order_epoch, int) and order_epoch >= 0):
            raise ValueError(f"state has an invalid order_epoch: {order_epoch!r}")
        if self._iter is not None:
            self._iter.close()
        self._pending_epoch = None
        # A state saved after the last batch (before the loop saw StopIteration) resumes as an
        # empty pass of that epoch, so a script that calls set_epoch(epoch) again does not replay it.
        self._epoch, self._delivered, self._resume_from = epoch, batches, batches
        self._resume_order = order_epoch if batches else None

    def _config_fingerprint(self) -> str:
        prep = recipe_key(self.recipe) if self.backend == "dali" else f"torch:{type(self.dataset).__qualname__}"
        key = [self.index.fingerprint, prep, self.batch_size, self.drop_last, self.shuffle]
        return hashlib.sha256(json.dumps(key).encode()).hexdigest()[:16]

    # -- stats ----------------------------------------------------------------------------
    def stats(self) -> dict:
        """Counters of the current epoch, or of the last finished one if none is running.

        Where the bytes came from: ``cache_hits``, ``cache_hit_bytes``, ``peer_reads``,
        ``peer_bytes``, ``storage_reads``, ``storage_bytes``, ``admitted`` (items this process
        put into the cache); the cache: ``cache_bytes`` (resident in the node's cache),
        ``cache_items``, ``cache_budget``. Where the time went: ``elapsed_s``, ``stall_s``
        (the consumer waited for batches), split into ``stall_fetch_s`` (the pipeline was
        waiting for sample bytes) and ``stall_prep_s`` (it was decoding and augmenting; an HP
        group member's waits are not split), ``compute_s`` (the consumer's own time between
        batches), ``wait_p50_s``/``wait_p95_s``/``wait_max_s`` (per-step waits),
        ``fetch_wait_s`` (the pipeline waited for storage), ``read_s`` (storage reads, summed
        over threads; on the torch backend every read, over workers), ``prep_s`` (DALI: the
        pipeline waited for DALI's outputs; torch backend: decode, transforms and
        ``collate_fn``, summed over workers). Also ``epoch``, ``batches``, ``samples``,
        ``samples_per_s``, ``skipped`` and ``skipped_paths``.
        """
        if self._iter is not None and self._iter.active:
            return self._iter.stats(complete=False)
        return dict(self._stats) if self._stats else self._empty_stats()

    def _empty_stats(self) -> dict:
        if self.hp_group is not None:
            from coordl.staging.hp import GroupPass

            return GroupPass.base_stats(self, self._epoch)
        return _Pass.base_stats(self, self._epoch)

    # -- lifetime -------------------------------------------------------------------------
    def close(self) -> None:
        """Stops background work and leaves the cache (the last user removes it). Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._iter is not None:
            self._iter.close()
            self._iter = None
        if self._area is not None:
            self._area.close()
        if self._loader_obj is not None:
            it = getattr(self._loader_obj, "_iterator", None)  # persistent workers
            if it is not None and hasattr(it, "_shutdown_workers"):
                it._shutdown_workers()
            self._loader_obj = None
        if self._peer_pool is not None:
            self._peer_pool.shutdown(wait=True, cancel_futures=True)
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        if self._peers is not None:
            self._peers.close()
        if self._prep is not None:
            self._prep.close()
        if self._gprep is not None:
            self._gprep.close()
        if self.cache is not None:
            self.cache.close()

    # -- HP group ---------------------------------------------------------------------------
    def _group_area(self):
        """This loader's staging area, attached on the first pass."""
        if self._area is None:
            from coordl.staging.area import StagingArea

            _reap_once(names.shm_dir())
            shape, dtype = self._staged_format()
            config = {
                "dataset": self.index.fingerprint,
                "pipeline": recipe_key(self.recipe),
                "batch_size": self.batch_size,
                "drop_last": self.drop_last,
                "shuffle": self.shuffle,
                "seed": self.seed,
                "world_size": self.world.world_size,
                "on_error": self.on_error,
            }
            self._area = StagingArea(
                self.hp_group, self.world.rank, config, batch_size=self.batch_size, batches_per_pass=len(self),
                sample_shape=shape, dtype=dtype, epoch=self._epoch, bound=self.hp_staging,
                idle_timeout=self.hp_idle_timeout,
            )  # fmt: skip
        return self._area

    def _staged_format(self) -> tuple[tuple[int, ...], str]:
        """Shape and dtype of one staged image: the recipe's output, or uint8 pixels that the
        consumer normalises (on a GPU, or when ``COORDL_HP_STAGE_UINT8=1``)."""
        r = self.recipe
        if isinstance(r, (ImageNetTrain, ImageNetVal)):
            raw = r.dtype == "float32" and (self.device_id is not None or os.environ.get("COORDL_HP_STAGE_UINT8") == "1")
            return (3, r.size, r.size), "uint8" if raw else r.dtype
        # A custom recipe: run it on one sample to learn its output.
        i = 0
        data = self._fetcher.fetch(i)
        raw = RawBatch(np.array([i], np.int64), [data], self.index.labels[[i]])
        images, _, _ = next(iter(self._prep.epoch(iter([raw]), self.index.paths.__getitem__)))
        return tuple(images.shape[1:]), str(images.dtype).removeprefix("torch.")

    def _group_prep(self):
        """The DALI pipeline that makes this member's share of the group's batches."""
        area = self._area
        r = self.recipe
        if isinstance(r, (ImageNetTrain, ImageNetVal)) and area.dtype == "uint8" and r.dtype == "float32":
            if self._gprep is None:
                from coordl.prep.dali import DaliPrep

                self._gprep = DaliPrep(
                    dataclasses.replace(r, dtype="uint8"), batch_size=self.batch_size, num_threads=self.num_threads,
                    device_id=self.device_id, seed=self.seed * 7919 + self.world.rank + 104729, on_error=self.on_error,
                )  # fmt: skip
            return self._gprep
        return self._prep

    def _group_normalize(self):
        """``(mean, std)`` (x255, shaped for NCHW) when staged pixels still need normalising."""
        r = self.recipe
        if self._area.dtype == "uint8" and isinstance(r, (ImageNetTrain, ImageNetVal)) and r.dtype == "float32":
            import torch

            mean = torch.tensor([m * 255 for m in r.mean]).view(1, 3, 1, 1)
            std = torch.tensor([s * 255 for s in r.std]).view(1, 3, 1, 1)
            return mean, std
        return None

    def _output_device(self):
        import torch

        return torch.device("cpu") if self.device_id is None else torch.device("cuda", self.device_id)

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
        return (
            f"CoordLoader({self.index.root or f'{len(self.index)} samples'!s}, batch_size={self.batch_size}, "
            f"{self._prep_repr()}, rank={self.world.rank}/{self.world.world_size}, "
            f"cache={'off' if self.cache is None else self.cache.budget})"
        )


    def _prep_repr(self) -> str:
        if self.backend == "torch":
            return f"dataset={type(self.dataset).__name__}, num_workers={self.num_workers}"
        return f"pipeline={getattr(self.recipe, 'name', 'custom')!r}"


class _Pass:
    """One pass over an epoch: a driver thread runs fetch + DALI, the consumer takes ready batches."""

    _END = object()

    def __init__(self, loader: CoordLoader, epoch: int, batches: list[np.ndarray]):
        self.loader = loader
        self.epoch = epoch
        self.active = True
        self._stop = threading.Event()
        self._queue: queue.Queue = queue.Queue(maxsize=2)
        self._batches = 0
        self._samples = 0
        self._waits = StepWaits()
        self._t0 = time.perf_counter()
        self._elapsed = 0.0
        self._prep0 = loader._prep.waiting.total()
        loader._fetcher.reset_counters()
        self._ahead = FetchAhead(
            loader._fetcher,
            batches,
            loader.index.labels,
            loader._pool,
            depth=loader.prefetch_batches,
            on_error=loader.on_error,
            stop=self._stop,
            peers=loader._peers,
            peer_pool=loader._peer_pool,
        )
        self._served0 = loader._peers.served() if loader._peers is not None else (0, 0)
        self._skipped_before = len(loader._prep.skipped)
        self._start = loader._resume_from_started
        self._cursor = 0  # batches before this one have been delivered or skipped whole
        self._thread = threading.Thread(target=self._drive, name="coordl-prep", daemon=True)
        self._thread.start()

    def _drive(self) -> None:
        paths = self.loader.index.paths
        try:
            for tensors in self.loader._prep.epoch(iter(self._ahead), paths.__getitem__):
                if not self._put(tensors):
                    return
            self._put(self._END)
        except Stopped:
            return
        except BaseException as e:  # noqa: BLE001 - handed to the consumer with its traceback
            if not self._stop.is_set():
                self._put(_Failure(e))

    def _put(self, item) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def __iter__(self):
        return self

    def __next__(self):
        if not self.active:
            raise StopIteration
        fetching = self._ahead.waiting
        f0, t0 = fetching.total(), time.perf_counter()
        while True:
            try:
                item = self._queue.get(timeout=1.0)
                break
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    self.close()
                    raise CoordlError("coordl's pre-processing thread stopped without a result") from None
        wait = time.perf_counter() - t0
        if item is self._END:
            self._waits.add_tail(wait)
            self._elapsed = time.perf_counter() - self._t0
            self.active = False
            self._thread.join()
            self.loader._on_pass_end(self)
            raise StopIteration
        if isinstance(item, _Failure):
            self.close()
            raise item.error
        self._waits.record(wait, fetch=fetching.total() - f0)
        images, labels, ids = item
        self._batches += 1
        self._samples += len(labels)
        self.loader._on_batch(self._start + self._number(int(ids[0])) + 1)
        if self.loader.return_index:
            return images, labels, ids
        return images, labels

    def _number(self, first: int) -> int:
        """The number of the batch just delivered, whose first id is ``first``: the next batch
        holding it (a batch skipped whole is passed over; padding may repeat an id later)."""
        batches = self._ahead.batches
        while self._cursor < len(batches) - 1 and first not in batches[self._cursor]:
            self._cursor += 1
        self._cursor += 1
        return self._cursor - 1

    def __len__(self) -> int:
        return len(self._ahead.batches) - self._batches

    @staticmethod
    def base_stats(loader: CoordLoader, epoch: int) -> dict:
        cache = loader.cache
        return {
            "epoch": epoch,
            "batches": 0,
            "samples": 0,
            "cache_hits": 0,
            "cache_hit_bytes": 0,
            "storage_reads": 0,
            "storage_bytes": 0,
            "peer_reads": 0,
            "peer_bytes": 0,
            "peer_served_reads": 0,
            "peer_served_bytes": 0,
            "admitted": 0,
            "cache_bytes": cache.resident_bytes if cache else 0,
            "cache_items": cache.resident_items if cache else 0,
            "cache_budget": cache.budget if cache else 0,
            "stall_s": 0.0,
            "stall_fetch_s": 0.0,
            "stall_prep_s": 0.0,
            "compute_s": 0.0,
            "wait_p50_s": 0.0,
            "wait_p95_s": 0.0,
            "wait_max_s": 0.0,
            "fetch_wait_s": 0.0,
            "read_s": 0.0,
            "prep_s": 0.0,
            "elapsed_s": 0.0,
            "samples_per_s": 0.0,
            "skipped": 0,
            "skipped_paths": [],
        }

    def stats(self, complete: bool) -> dict:
        elapsed = self._elapsed if complete else time.perf_counter() - self._t0
        skipped = self._ahead.skipped + self.loader._prep.skipped[self._skipped_before :]
        c = self.loader._fetcher.counters
        return pass_stats(self.base_stats(self.loader, self.epoch), c, batches=self._batches, samples=self._samples,
                          waits=self._waits, fetch_wait_s=self._ahead.wait_s, read_s=c.storage_ns / 1e9,
                          prep_s=self.loader._prep.waiting.total() - self._prep0, elapsed_s=elapsed,
                          skipped_paths=[p for _, p, _ in skipped], served=self._served())  # fmt: skip

    def _served(self) -> tuple[int, int]:
        peers = self.loader._peers
        if peers is None:
            return 0, 0
        reads, nbytes = peers.served()
        return reads - self._served0[0], nbytes - self._served0[1]

    def close(self) -> None:
        """Stops the driver thread; idempotent."""
        if self._stop.is_set() and not self._thread.is_alive():
            return
        self.active = False
        self._stop.set()
        while self._thread.is_alive():
            try:
                while True:
                    self._queue.get_nowait()
            except queue.Empty:
                pass
            self._thread.join(timeout=0.1)


def pass_stats(s: dict, c, *, batches: int, samples: int, waits: StepWaits, fetch_wait_s: float, read_s: float,
               prep_s: float, elapsed_s: float, skipped_paths: list[str], served: tuple[int, int] = (0, 0)) -> dict:
    """Fills a pass's statistics ``s`` from its counters and the fetcher's ``c``."""
    s.update(
        batches=batches,
        samples=samples,
        cache_hits=c.cache_hits,
        cache_hit_bytes=c.cache_hit_bytes,
        storage_reads=c.storage_reads,
        storage_bytes=c.storage_bytes,
        peer_reads=c.peer_reads,
        peer_bytes=c.peer_bytes,
        peer_served_reads=served[0],
        peer_served_bytes=served[1],
        admitted=c.admitted,
        fetch_wait_s=fetch_wait_s,
        read_s=read_s,
        prep_s=prep_s,
        elapsed_s=elapsed_s,
        samples_per_s=samples / elapsed_s if elapsed_s > 0 else 0.0,
        skipped=len(skipped_paths),
        skipped_paths=skipped_paths[:100],
    )
    s.update(waits.summary(elapsed_s))
    return s


class _Failure:
    def __init__(self, error: BaseException):
        self.error = error


def _as_dataset(data):
    """The dataset of the torch backend, or None for data that DALI decodes."""
    from coordl.datasets import FileDataset

    if isinstance(data, FileDataset):
        return data
    converted = _from_torchvision(data)
    if converted is not None:
        return converted
    try:
        from torch.utils.data import Dataset
    except ImportError:  # pragma: no cover
        return None
    if isinstance(data, Dataset):
        raise TypeError(
            f"CoordLoader reads the files of a dataset itself, so it needs a dataset that separates reading from "
            f"decoding: coordl.datasets.ImageFolder, DatasetFolder or FileDataset (see the torch backend guide); "
            f"got {type(data).__module__}.{type(data).__qualname__}"
        )
    return None


def _from_torchvision(data):
    """A torchvision folder dataset with its default (path-opening) loader, as coordl's equivalent."""
    from coordl.datasets import FileDataset, _is_torchvision_path_loader, pil_decode

    if not type(data).__module__.startswith("torchvision.") or not hasattr(data, "samples"):
        return None
    if not _is_torchvision_path_loader(getattr(data, "loader", None)):
        return None
    log.info("coordl: reading %s through coordl (Pillow decoding, the same transforms)", type(data).__name__)
    ds = FileDataset(data.samples, pil_decode, transform=data.transform, target_transform=data.target_transform)
    ds.classes, ds.class_to_idx, ds.root = list(data.classes), dict(data.class_to_idx), data.root
    return ds


def _make_index(data, extensions, index_dir) -> Index:
    if isinstance(data, Index):
        return data
    if isinstance(data, (str, os.PathLike)):
        return Index.scan(data, extensions=extensions, index_dir=index_dir)
    if isinstance(data, Sequence):
        return Index.from_list(data)
    raise TypeError(
        f"data must be a folder, a list of (path, label) pairs or an Index, got {type(data).__name__}"
    )


def _resolve_device(device_id) -> int | None:
    if device_id is None:
        return None
    if device_id == "auto":
        import torch

        if not torch.cuda.is_available():
            return None
        local_rank = os.environ.get("LOCAL_RANK")
        if local_rank is not None and local_rank.isdigit():
            return int(local_rank) % torch.cuda.device_count()
        return torch.cuda.current_device()
    if isinstance(device_id, bool) or not isinstance(device_id, int) or device_id < 0:
        raise ValueError(f"device_id must be 'auto', None or a GPU number, got {device_id!r}")
    return device_id
