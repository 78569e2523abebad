"""Runs a recipe as an NVIDIA DALI pipeline fed with raw bytes; with :mod:`coordl.prep.planned`,
the only modules importing DALI.

The pipeline's input is ``fn.external_source`` with a callback that returns the
next raw batch (encoded bytes, labels, sample ids) and each sample's random draws,
a function of ``(seed, epoch, sample)`` (:mod:`coordl.draws`) that the recipe turns
into crop windows and flips (``ctx.random``). DALI decodes and augments on
its own threads; :meth:`DaliPrep.epoch` yields torch tensors. A decoding error
rebuilds the pipeline, finds the bad samples by decoding the failed batch one sample
at a time, and then raises :class:`~coordl.errors.SampleError` naming the file, or
(``on_error="skip"``) drops them and goes on.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import weakref
from collections.abc import Callable, Iterator

import numpy as np
import torch
from nvidia.dali import Pipeline, fn, pipeline_def, types
from nvidia.dali.plugin.pytorch import feed_ndarray, to_torch_type

from coordl import compat, draws, lifecycle
from coordl.accounting import BusyClock
from coordl.errors import SampleError
from coordl.fetch.ahead import DECODE_KEEP, DECODED, RawBatch
from coordl.prep import graph
from coordl.prep.planned import SampleRandom, uses_dali_random
from coordl.prep.protocol import PrepContext, as_recipe

__all__ = ["DaliPrep"]

log = logging.getLogger(__name__)

_preps: weakref.WeakSet = weakref.WeakSet()


def _forget_pipelines_in_child() -> None:
    """In a forked child, the parent's pipelines belong to threads that do not exist here:
    shutting one down (when the child exits, or at collection) raises in C++ and aborts the
    child. So the child lets go of them without shutting them down: their native handles are
    kept alive until the process ends, and the Python objects no longer refer to them."""
    for prep in list(_preps):
        for pipe in (prep._pipe, prep._probe):  # both built in the parent
            if pipe is not None:
                compat.abandon_pipeline(pipe)
        prep._pipe = prep._probe = None


lifecycle.on_fork_child(_forget_pipelines_in_child)


class DaliPrep:
    """A DALI pipeline for one recipe; reused across epochs, rebuilt after an error.

    Args:
        recipe: a recipe (:class:`~coordl.prep.protocol.Recipe`; a callable on encoded bytes is wrapped):
            it answers every question the pipeline asks of it.
        batch_size: the largest batch fed.
        num_threads: DALI CPU threads.
        device_id: GPU to decode and augment on, or None for CPU only.
        seed: the loader's seed: with the epoch and the sample, it decides every draw of
            ``ctx.random`` (the built-in recipes' crop windows and flips).
        rank: this process's rank, and ``role`` what the pipeline is for (a key of :data:`ROLES`):
            with ``seed`` they seed DALI's own random operators, which only custom recipes use
            (their draws depend on the batch a sample is in, so they differ between ranks anyway);
            two pipelines of one process draw different streams.
        on_error: ``"raise"`` or ``"skip"`` for samples that fail to decode.
        tiered: build the pipeline for batches that mix encoded bytes and decoded images (the
            decoded tier, :mod:`coordl.prep.graph`); the recipe must take decoded images.
        boxes: the index's :class:`~coordl.detection.boxes.Boxes`, for a recipe whose target is
            boxes (the crop windows it plans, the image sizes it checks each decoded image against).
    """

    def __init__(
        self,
        recipe,
        *,
        batch_size: int,
        num_threads: int,
        device_id: int | None,
        seed: int,
        rank: int = 0,
        role: str = "loader",
        on_error: str = "raise",
        tiered: bool = False,
        boxes=None,
    ):
        recipe = as_recipe(recipe)
        if recipe.target == "boxes" and boxes is None:
            raise ValueError(f"the recipe {recipe.name!r} needs an index with boxes (coordl.Index.from_coco)")
        self.recipe = recipe
        self.boxes = boxes
        self.batch_size = batch_size
        self.num_threads = num_threads
        self.device_id = device_id
        self.seed = seed
        self.dali_seed = draws.mix(seed, rank, ROLES[role])
        self._epoch = 0  # the epoch whose draws the pipeline is fed
        self._columns: int | None = None  # draws per sample the recipe uses
        self.dali_random: list[str] = []  # DALI random operators the recipe uses
        self.on_error = on_error
        self.tiered = tiered
        self._mode: str | None = None  # the built pipeline's: PLAIN, TIERED or DECODED_ONLY
        self._planned = False  # the built pipeline takes windows computed before it (Recipe.planned)
        self._keep: Callable | None = None  # takes the full images of DECODE_KEEP samples
        gpu = device_id is not None
        decoder = recipe.decoder  # its settings are the recipe's, not the index's
        self.ctx = PrepContext(
            "mixed" if gpu else "cpu", "gpu" if gpu else "cpu", device_id, adjust_orientation=decoder.adjust_orientation
        )
        self.checks_before = recipe.checks_before  # e.g. an audio clip's header
        self.checks_shapes = recipe.checks_after  # e.g. an image's size against its annotations; a clip's length
        self._decoded_type = (_DALI_TYPES[decoder.dtype], decoder.layout)  # the decoded tier's items
        self._empty_decoded = decoder.empty
        self._pipe = None
        self._probe = None  # decodes one sample at a time, to find the bad ones of a failed batch
        self._builds = 0
        self._source: Iterator[RawBatch] | None = None
        self._pending: collections.deque[RawBatch] = collections.deque()
        self._inflight: collections.deque[RawBatch] = collections.deque()
        self.skipped: list[tuple[int, str, str]] = []  # (index, path, reason)
        self._paths: Callable[[int], str] = str
        self._stream = torch.cuda.Stream(device=device_id) if gpu else None
        self.waiting = BusyClock()  # runs while the caller waits for DALI's outputs
        _preps.add(self)

    @property
    def mode(self) -> str | None:
        """The pipeline built last: :data:`PLAIN`, :data:`TIERED` or :data:`DECODED_ONLY` (None: none yet)."""
        return self._mode

    def _draws_per_sample(self) -> int:
        """How many of ``ctx.random``'s numbers the recipe draws per sample (a trace of it, not built)."""
        scratch = Pipeline(batch_size=1, num_threads=1, device_id=self.device_id)
        with scratch:
            encoded = fn.external_source(name="encoded", dtype=types.UINT8, ndim=1)
            uniforms = fn.external_source(name="uniforms", dtype=types.FLOAT, ndim=1)
            ctx = dataclasses.replace(self.ctx, random=SampleRandom(uniforms))
            self.recipe.encoded(encoded, ctx)
        return ctx.random.used

    def _build(self, mode: str):
        if self._columns is None:
            self._columns = self._draws_per_sample()
        # A new seed per build keeps a rebuilt pipeline from replaying DALI's randomness.
        seed = draws.mix(self.dali_seed, self._builds) % (2**31)
        self._builds += 1

        columns = self._columns
        inputs = 4 if columns else 3
        planned = mode == DECODED_ONLY and self.recipe.plans_decoded
        self._planned = planned

        @pipeline_def(
            batch_size=self.batch_size,
            num_threads=self.num_threads,
            device_id=self.device_id,
            seed=seed,
            prefetch_queue_depth=QUEUE_DEPTH,
            enable_conditionals=mode == TIERED,
        )
        def pipeline():
            if planned:  # the training recipe on decoded images, its windows and flips computed here
                images, labels, ids, anchor, size, mirror = fn.external_source(
                    source=self._next_raw,
                    num_outputs=6,
                    batch=True,
                    no_copy=True,
                    dtype=[types.UINT8, types.INT64, types.INT64, types.FLOAT, types.FLOAT, types.INT32],
                    layout=["HWC", None, None, None, None, None],
                )
                return self.recipe.planned(images, anchor, size, mirror, self.ctx), labels, ids
            if mode != TIERED:
                decoded_type, decoded_layout = self._decoded_type if mode == DECODED_ONLY else (types.UINT8, None)
                data, labels, ids, *uniforms = fn.external_source(
                    source=self._next_raw,
                    num_outputs=inputs,
                    batch=True,
                    no_copy=True,
                    dtype=[decoded_type, types.INT64, types.INT64, types.FLOAT][:inputs],
                    layout=[decoded_layout, None, None, None][:inputs],
                )
                ctx = dataclasses.replace(self.ctx, random=SampleRandom(uniforms[0] if uniforms else None))
                if mode == DECODED_ONLY:
                    images, shape = self.recipe.augment(data, ctx), data.shape()
                else:
                    images, shape = self.recipe.encoded_checked(data, ctx)
                if ctx.random.used != columns:
                    raise ValueError("the recipe draws a different number of random numbers every time it is built")
                if self.checks_shapes:
                    return images, labels, ids, shape
                return images, labels, ids
            encoded, decoded, kind, labels, ids, *uniforms = fn.external_source(
                source=self._next_raw,
                num_outputs=inputs + 2,
                batch=True,
                no_copy=True,
                dtype=[types.UINT8, self._decoded_type[0], types.INT32, types.INT64, types.INT64, types.FLOAT][
                    : inputs + 2
                ],
                layout=[None, self._decoded_type[1], None, None, None, None][: inputs + 2],
            )
            ctx = dataclasses.replace(self.ctx, random=SampleRandom(uniforms[0] if uniforms else None))
            images, full, shape = graph.tiered(self.recipe, encoded, decoded, kind, ctx)
            if ctx.random.used != columns:
                raise ValueError("the recipe draws a different number of random numbers every time it is built")
            if self.checks_shapes:
                return images, labels, ids, full, shape
            return images, labels, ids, full

        pipe = pipeline()
        pipe.build()
        self._mode = mode
        if self._builds == 1:
            self.dali_random = uses_dali_random(compat.pipeline_schemas(pipe))
            if self.dali_random:
                log.warning(
                    "coordl: the recipe uses DALI's own random operators (%s): what they draw depends on the "
                    "batch a sample lands in, so its augmentation differs after a resume, on another number of "
                    "ranks and in an hp_group. Draw from ctx.random instead to make it a function of "
                    "(seed, epoch, sample); see docs/guarantees.md",
                    ", ".join(self.dali_random),
                )
        return pipe

    def _next_raw(self):
        while True:
            batch = self._pending.popleft() if self._pending else next(self._source)  # StopIteration ends the epoch
            if self.checks_before:
                batch = self._checked(batch)
            if batch is not None:
                break
        self._inflight.append(batch)
        if self._mode == DECODED_ONLY and not (batch.kinds() == DECODED).all():
            raise RuntimeError("coordl: a batch of an epoch served from the decoded tier alone holds encoded bytes")
        if self._mode == TIERED:
            kind = batch.kinds()
            decoded = kind == DECODED
            encoded = [_EMPTY_BYTES if d else x for x, d in zip(batch.data, decoded.tolist(), strict=True)]
            images = [x if d else self._empty_decoded for x, d in zip(batch.data, decoded.tolist(), strict=True)]
            out = (encoded, images, kind.astype(np.int32), batch.labels, batch.ids)
        else:
            out = (batch.data, batch.labels, batch.ids)
        if not self._columns:
            return out
        epoch = self._epoch if batch.epoch is None else batch.epoch
        decoded = batch.data if self._planned else None
        return (*out, *self.recipe.feed(self.seed, epoch, batch.ids, self._columns, self.boxes, decoded))

    def epoch(
        self,
        source: Iterator[RawBatch],
        path_of: Callable[[int], str],
        epoch: int,
        keep=None,
        *,
        all_decoded: bool = False,
    ) -> Iterator[tuple]:
        """Yields ``(images, labels, ids, number)`` for every batch of ``source``: torch tensors,
        augmented with the draws of ``epoch`` (the epoch whose order the batches follow), and the
        batch's :attr:`~coordl.fetch.ahead.RawBatch.number`. A batch whose every sample was
        skipped (``on_error="skip"``) yields nothing.

        Args:
            keep: where the full decoded images of a tiered pipeline's ``DECODE_KEEP`` samples go
                (the :class:`~coordl.fetch.fetcher.Fetcher`: ``fill(ids, images)``,
                ``abort(ids)``, ``release()``, which gives up the claims of samples never decoded).
            all_decoded: every sample of ``source`` comes from the decoded tier (a tiered prep):
                the batches run through a pipeline of the augmentation alone, without the
                per-sample conditionals that mixed batches need (the same tensors, faster).
        """
        mode = DECODED_ONLY if self.tiered and all_decoded else TIERED if self.tiered else PLAIN
        if mode != self._mode:
            self._pipe = None  # one pipeline at a time: its threads and buffers go with it
        self._epoch = epoch
        self._keep = keep
        self._source = _non_empty(source)
        self._paths = path_of
        self._pending.clear()
        self._inflight.clear()
        if self._pipe is None:
            self._pipe = self._build(mode)
        try:
            self._pipe.schedule_run()
            while True:
                self.waiting.enter()
                try:
                    # Synchronised with the host (no stream given), so the tensors are ready.
                    out = self._pipe.share_outputs()
                except StopIteration:
                    break
                except RuntimeError as e:
                    self._recover(e)
                    self._pipe.schedule_run()
                    continue
                finally:
                    self.waiting.leave()
                batch = self._inflight.popleft()
                if mode == TIERED:
                    self._fill(batch, out[3])
                tensors = self._to_torch(out[:3])
                faults = {}
                if self.checks_shapes:
                    faults = self.recipe.after_decoding(self.boxes, batch.ids, out[-1])
                del out
                self._pipe.release_outputs()
                self._pipe.schedule_run()
                if faults:
                    self._apply_policy(batch.ids, faults)
                    tensors = self._drop(tensors, np.array(sorted(faults), dtype=np.int64))
                    if not len(tensors[2]):
                        continue
                yield (*tensors, batch.number)
            self._pipe.reset()
        except BaseException:
            self._pipe = None  # a pipeline interrupted mid-epoch is not reused
            raise
        finally:
            self._source = None
            if keep is not None:
                keep.release()  # claims of batches fetched but never decoded
            self._keep = None

    def _fill(self, batch: RawBatch, full) -> None:
        """Hands the full decoded images of the batch's ``DECODE_KEEP`` samples to ``keep``."""
        where = np.flatnonzero(batch.kinds() == DECODE_KEEP)
        if not len(where) or self._keep is None:
            return
        ids, first = np.unique(batch.ids[where], return_index=True)  # a padded batch may repeat one
        self._keep.fill(ids, [np.asarray(full[int(k)]) for k in where[first].tolist()])

    def _checked(self, batch: RawBatch) -> RawBatch | None:
        """The batch without the samples whose bytes show a fault before decoding (raised, or with
        ``on_error="skip"`` left out and counted; None when none is left). A left-out sample the
        decoded tier was to keep is given up there."""
        faults = self.recipe.before_decoding(batch)
        if not faults:
            return batch
        self._apply_policy(batch.ids, faults)
        gone = batch.ids[sorted(faults)]
        if self._keep is not None:
            self._keep.abort(np.unique(gone))
        keep = [k for k in range(len(batch.ids)) if k not in faults]
        return batch.subset(keep) if keep else None

    def _apply_policy(self, ids: np.ndarray, faults: dict[int, str]) -> None:
        """Raises a :class:`~coordl.errors.SampleError` for the first of ``faults`` (positions in a
        batch of ``ids``: why), or with ``on_error="skip"`` logs and counts them all."""
        for k, reason in sorted(faults.items()):
            i = int(ids[k])
            if self.on_error == "raise":
                raise SampleError(
                    f"sample {i} ({self._paths(i)}): {reason}. Pass on_error='skip' to skip such samples "
                    "(they are counted in stats()['skipped'])",
                    path=self._paths(i),
                    index=i,
                )
            log.warning("coordl: skipping sample %d (%s): %s", i, self._paths(i), reason)
            self.skipped.append((i, self._paths(i), reason))

    @staticmethod
    def _drop(tensors: tuple, wrong: np.ndarray) -> tuple:
        """The batch's tensors without the rows ``wrong`` (a copy of the rest)."""
        keep = np.setdiff1d(np.arange(len(tensors[2])), wrong)
        return tuple(t[torch.as_tensor(keep, device=t.device)] for t in tensors)

    def _recover(self, error: RuntimeError) -> None:
        """After a failed batch: find the bad samples, apply the policy, rebuild, re-feed."""
        self._pipe = None
        inflight = list(self._inflight)
        self._inflight.clear()
        if not inflight:
            raise error
        bad = {}
        for batch in inflight:
            bad.update(self._find_bad(batch))
            if bad:
                break
        if not bad:
            raise error
        if self.on_error == "raise":
            i, reason = next(iter(bad.items()))
            raise SampleError(
                f"cannot decode sample {i} ({self._paths(i)}): {reason}. Pass on_error='skip' to "
                "skip such samples (they are counted in stats()['skipped'])",
                path=self._paths(i),
                index=i,
            ) from error
        for i, reason in bad.items():
            log.warning("coordl: skipping sample %d (%s): cannot decode: %s", i, self._paths(i), reason)
            self.skipped.append((i, self._paths(i), reason))
        if self._keep is not None:
            self._keep.abort(np.array(sorted(bad), dtype=np.int64))
        for batch in inflight:
            keep = [k for k, i in enumerate(batch.ids) if int(i) not in bad]
            if keep:
                self._pending.append(batch.subset(keep))
        self._pipe = self._build(self._mode)

    def _find_bad(self, batch: RawBatch) -> dict[int, str]:
        """The samples of a failed batch that do not decode, found by decoding them one at a time
        with one probe pipeline, kept across batches and errors. A DALI pipeline does not run again
        after an error, so a sample that fails costs a new probe; one that decodes costs a run."""
        bad = {}
        for i, data, kind in zip(batch.ids, batch.data, batch.kinds(), strict=True):
            if kind == DECODED:
                continue  # decoded before: it decodes
            if self._probe is None:
                self._probe = _probe_pipeline(self.recipe, self.ctx, self.device_id)
            try:
                self._probe.feed_input("x", [data])
                self._probe.run()
            except RuntimeError as e:
                bad[int(i)] = _short(str(e))
                self._probe = None
        return bad

    def _to_torch(self, out) -> tuple:
        """Torch tensors of one batch's outputs (images on the GPU when there is one).

        With DALI's dynamic executor (its default) output buffers stay valid after they are
        handed out, so they are wrapped with DLPack and not copied, as DALI's own PyTorch
        iterator does; otherwise they are copied once.
        """
        zero_copy = self._pipe.exec_dynamic
        result = []
        for k, tl in enumerate(out):
            try:
                t = tl.as_tensor()
            except RuntimeError:
                raise ValueError(
                    "the recipe's output samples differ in shape, so they cannot form one batch tensor; "
                    "end the recipe with a crop or resize to a fixed size"
                ) from None
            on_gpu = k == 0 and self.device_id is not None
            if zero_copy:
                if on_gpu:
                    with torch.cuda.device(self.device_id):
                        result.append(torch.from_dlpack(t))
                else:
                    result.append(torch.from_dlpack(t))
                continue
            arr = torch.empty(
                t.shape(), dtype=to_torch_type[t.dtype], device=f"cuda:{self.device_id}" if on_gpu else "cpu"
            )
            if on_gpu:
                feed_ndarray(t, arr, cuda_stream=self._stream)
            else:
                feed_ndarray(t, arr)
            result.append(arr)
        if self._stream is not None and not zero_copy:
            self._stream.synchronize()
        return tuple(result)

    def close(self) -> None:
        self._pipe = None
        self._probe = None
        self._source = None
        self._pending.clear()
        self._inflight.clear()


#: What a process's pipelines are for, each a stream of DALI's own random numbers of its own:
#: the loader's, an HP group member's staging pipeline, and the loader's rate measurements.
ROLES = {"loader": 0, "staging": 1, "calibrate": 2}
QUEUE_DEPTH = 2  # batches DALI works on ahead of the consumer

#: The pipelines a prep builds: encoded bytes alone; batches that mix encoded bytes and decoded
#: images (DALI's conditionals); decoded images alone (an epoch the decoded tier serves whole).
PLAIN, TIERED, DECODED_ONLY = "plain", "tiered", "decoded"

_EMPTY_BYTES = np.zeros(0, dtype=np.uint8)  # the encoded bytes of a sample that comes decoded
_EMPTY_BYTES.flags.writeable = False
_DALI_TYPES = {"uint8": types.UINT8, "float32": types.FLOAT}  # a decoder's items, as DALI types them


def _non_empty(source: Iterator[RawBatch]) -> Iterator[RawBatch]:
    for batch in source:
        if len(batch.ids):
            yield batch


def _probe_pipeline(recipe, ctx: PrepContext, device_id: int | None):
    """A pipeline that decodes one sample as the recipe's decoder does (an image, or an audio clip)."""

    @pipeline_def(
        batch_size=1, num_threads=1, device_id=device_id, prefetch_queue_depth=1, exec_async=False, exec_pipelined=False
    )
    def probe():
        x = fn.external_source(name="x", dtype=types.UINT8, ndim=1)
        return recipe.decoder.probe(x, ctx)

    pipe = probe()
    pipe.build()
    return pipe


def _short(message: str) -> str:
    """The decoder's own words in a DALI error: the line after ``encountered:`` when there is one."""
    lines = [ln.strip() for ln in message.splitlines() if ln.strip()]
    if "encountered:" in lines:
        after = lines[lines.index("encountered:") + 1 :]
        said = [ln for ln in after if not ln.startswith(("C++ context", "Current pipeline"))]
        if said:
            return said[0][:300]
    useful = [ln for ln in lines if "decode" in ln.lower() or "failure" in ln.lower() or "error" in ln.lower()]
    return (useful[-1] if useful else lines[-1] if lines else "decoding failed")[:300]
