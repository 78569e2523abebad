"""What a loader reads and which backend pre-processes it: an index of files that DALI decodes with
a recipe, or a dataset of :mod:`coordl.datasets` that the torch backend's workers transform; and
the arguments each backend refuses, checked here once."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

from coordl import env
from coordl.config import TorchOptions
from coordl.index import Index
from coordl.options import Fetch, Options
from coordl.prep.recipes import resolve_recipe
from coordl.prep.site import site

__all__ = ["DATA_KINDS", "Source", "as_dataset", "make_index", "open_source", "resolve_device"]

#: What ``data=`` may be, as :func:`make_index` and :func:`as_dataset` tell them apart (the
#: loader's docstring names each; tests/test_surface.py checks it).
DATA_KINDS = (
    "folder",
    "s3://",
    "tar shards",
    "(path, label) pairs",
    "Index",
    "coordl.datasets",
)

PIPELINE_NEEDED = (
    "CoordLoader needs pipeline= for a folder, a list of files or an Index: how DALI decodes and "
    "augments them. The two usual choices: pipeline='imagenet-train' (random resized crop and flip, "
    "normalised: for training) or pipeline='imagenet-val' (resize, centre crop, normalised: for "
    "evaluation); or a coordl.ImageNetTrain(...)/ImageNetVal(...) with other sizes, or a recipe of "
    "your own (docs/user-guide.md#custom-dali-recipes); for a detection dataset, 'ssd-train' or 'ssd-val'"
)


@dataclass(frozen=True)
class Source:
    """A loader's data and the backend that pre-processes it.

    Attributes:
        backend: ``"dali"`` or ``"torch"``.
        index: the samples.
        dataset: the torch backend's dataset, or the index (what ``loader.dataset`` is).
        recipe: DALI's recipe, or None on the torch backend.
        device_id: the GPU DALI decodes on and delivers to, or None (the CPU; the torch backend).
    """

    backend: str
    index: Index
    dataset: object
    recipe: object
    device_id: int | None


def open_source(
    data, pipeline, device_id, torch_options: TorchOptions, options: Options, on_error: str = "raise"
) -> Source:
    """The backend for ``data`` with the loader's arguments checked (``ValueError`` names what a
    backend refuses), and the samples indexed (``on_error="skip"``: a tar shard's sample without an
    image member or a label is left out, and logged).

    Raises:
        ValueError: an argument the backend does not take, a missing ``pipeline``, or no samples.
        TypeError: ``data`` is of no kind a loader reads.
    """
    dataset = as_dataset(data)
    if dataset is None:
        given = [k for k in torch_options.given() if k != "collate_fn"]  # DALI's batches may be laid out too
        if torch_options.num_workers:
            raise ValueError(
                f"num_workers={torch_options.num_workers} starts DataLoader worker processes, which the torch "
                "backend (a dataset of coordl.datasets) uses; DALI decodes a folder or a list on threads of this "
                "process: pass prep=coordl.Prep(threads=N) instead (default: the CPUs this process may use)"
            )
        if given:
            raise ValueError(
                f"{', '.join(given)} apply to the torch backend, which runs a dataset of coordl.datasets "
                "(e.g. coordl.datasets.ImageFolder(root, transform=...)); a folder or a list is decoded by DALI"
            )
        if pipeline is None:
            raise ValueError(PIPELINE_NEEDED)
        recipe = resolve_recipe(pipeline)
        index = make_index(data, skip=on_error == "skip", **recipe.index_options())
        recipe.check_index(index)
        source = Source("dali", index, index, recipe, resolve_device(device_id))
    else:
        if pipeline is not None:
            raise ValueError("pipeline= is for DALI; with a dataset, its transform is the pre-processing")
        if options.hp_group is not None:
            raise ValueError(
                "hp_group is not available on the torch backend yet: use a folder or a list of files, "
                "decoded by DALI, for coordinated pre-processing"
            )
        if device_id != "auto":
            raise ValueError(
                "device_id= is where DALI decodes and delivers; on the torch backend the batches are collate_fn's, "
                "on the CPU: move them with .to(device) (pin_memory=True pins them for that)"
            )
        if options.fetch != Fetch():
            raise ValueError(
                "fetch= tunes the DALI backend's reads; the torch backend's workers read their own batches"
            )
        # The batches are collate_fn's, on the CPU (pinned with pin_memory).
        source = Source("torch", dataset.index, dataset, None, None)
    site(options.prep).check(source.backend, source.recipe, options.cache)
    if len(source.index) == 0:
        raise ValueError("the dataset has no samples")
    return source


def as_dataset(data):
    """The dataset of the torch backend, or None for data that DALI decodes."""
    from coordl.datasets import FileDataset, from_torchvision

    if isinstance(data, FileDataset):
        return data
    converted = from_torchvision(data)
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


def make_index(data, *, skip: bool = False, boxes: bool = False, audio: bool = False) -> Index:
    """The index of a folder (scanned with the defaults of :meth:`Index.scan`; ``audio``: of audio
    files, :data:`~coordl.audio.formats.AUDIO_EXTENSIONS`), tar shards (a pattern, a folder of
    ``.tar`` files or a list of them: :meth:`Index.from_tars`; ``boxes``: their samples' ``.json``
    members; ``audio``: their audio members), a list of ``(path, label)`` pairs, or an index."""
    from coordl import tars
    from coordl.audio.formats import AUDIO_EXTENSIONS

    if isinstance(data, Index):
        return data
    if tars.is_tar_data(data):
        if audio:
            return Index.from_tars(data, skip=skip, image=tuple(e.lstrip(".") for e in AUDIO_EXTENSIONS))
        return Index.from_tars(data, skip=skip, boxes=boxes)
    if isinstance(data, (str, os.PathLike)):
        return Index.scan(data, extensions=AUDIO_EXTENSIONS) if audio else Index.scan(data)
    if isinstance(data, Sequence):
        return Index.from_list(data)
    raise TypeError(
        f"data must be a folder (or an s3:// prefix), tar shards, a list of (path, label) pairs, an Index or a "
        f"dataset of coordl.datasets, got {type(data).__name__}"
    )


def resolve_device(device_id) -> int | None:
    """The GPU for ``device_id`` (``"auto"``, None or a number), or None for the CPU."""
    if device_id is None:
        return None
    if device_id == "auto":
        import torch

        if not torch.cuda.is_available():
            return None
        local_rank = env.integer("LOCAL_RANK", -1)
        if local_rank >= 0:
            return local_rank % torch.cuda.device_count()
        return torch.cuda.current_device()
    if isinstance(device_id, bool) or not isinstance(device_id, int) or device_id < 0:
        raise ValueError(f"device_id must be 'auto', None or a GPU number, got {device_id!r}")
    return device_id
