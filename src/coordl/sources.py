"""What a loader reads: an index of files for DALI, or a dataset of :mod:`coordl.datasets` for the torch backend."""

from __future__ import annotations

import os
from collections.abc import Sequence

from coordl import env
from coordl.index import Index

__all__ = ["as_dataset", "make_index", "resolve_device"]


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


def make_index(data, extensions, index_dir) -> Index:
    """The index of a folder, a list of ``(path, label)`` pairs, or an index."""
    if isinstance(data, Index):
        return data
    if isinstance(data, (str, os.PathLike)):
        return Index.scan(data, extensions=extensions, index_dir=index_dir)
    if isinstance(data, Sequence):
        return Index.from_list(data)
    raise TypeError(f"data must be a folder, a list of (path, label) pairs or an Index, got {type(data).__name__}")


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
