"""Map-style datasets whose bytes coordl reads: the torch backend of :class:`~coordl.CoordLoader`.

A dataset here is split in two: *which files* (an :class:`~coordl.index.Index`: paths,
targets, sizes) and *how bytes become an item* (:meth:`FileDataset.decode`, then the
user's ``transform``). coordl does the reading, through the node's MinIO cache and
then storage, in the worker processes of a ``torch.utils.data.DataLoader`` that
:class:`~coordl.CoordLoader` runs; decoding and transforms are ordinary Python, so any
callable works (a user's own, torchvision's).

- :class:`ImageFolder`: torchvision's ``ImageFolder`` (same arguments, classes, sample
  order and items), decoding with Pillow (Pillow-SIMD when installed, as it replaces Pillow).
- :class:`DatasetFolder`: any file type in a class-per-folder tree, with a ``loader``
  that reads a binary file object (audio with ``wave`` or ``soundfile``, NumPy arrays...).
- :class:`FileDataset`: any list of ``(path, target)`` files with a ``decode`` function.
- :class:`CocoDetection`: torchvision's ``CocoDetection`` (COCO's ``instances_*.json``), with the
  targets detection models take (boxes and labels).

Used on their own (``dataset[i]``, or a plain ``DataLoader``) they read files directly.
"""

from __future__ import annotations

import io
import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from coordl.fetch import samples
from coordl.index import IMG_EXTENSIONS, Index

try:  # a Dataset subclass where torch is installed, so that torch's type checks pass
    from torch.utils.data import Dataset as _Base
except ImportError:  # pragma: no cover - coordl depends on torch
    _Base = object

log = logging.getLogger(__name__)

__all__ = [
    "IMG_EXTENSIONS",
    "CocoDetection",
    "DatasetFolder",
    "FileDataset",
    "ImageFolder",
    "TarDataset",
    "from_torchvision",
    "pil_decode",
]


def pil_decode(f) -> Any:
    """Decodes an image file object with Pillow into an RGB ``PIL.Image``, like torchvision's
    ``pil_loader`` (which opens a path instead)."""
    from PIL import Image

    img = Image.open(f)
    return img.convert("RGB")


class FileDataset(_Base):
    """A dataset of files, read by coordl and decoded by ``decode``.

    Items are ``(transform(decode(file)), target_transform(target))``, as with torchvision's
    folder datasets.

    Args:
        samples: ``(path, target)`` pairs (targets are non-negative ints), or an
            :class:`~coordl.index.Index`.
        decode: turns one file into a sample; called with a binary file object (an
            ``io.BytesIO`` of the file's bytes whose ``name`` is the file's path). Errors it
            raises count as an unreadable sample (``on_error`` of the loader decides). Or
            override :meth:`decode` in a subclass.
        transform: applied to each decoded sample.
        target_transform: applied to each target.
    """

    def __init__(
        self,
        samples: Sequence[tuple[str | os.PathLike, int]] | Index,
        decode: Callable[[io.BytesIO], Any] | None = None,
        *,
        transform: Callable | None = None,
        target_transform: Callable | None = None,
    ):
        index = samples if isinstance(samples, Index) else Index.from_list(samples)
        if decode is not None and not callable(decode):
            raise TypeError(f"decode must be callable, got {type(decode).__name__}")
        self._init(index, decode, transform, target_transform)

    def _init(self, index: Index, decode, transform, target_transform) -> None:
        self.index = index
        self._decode = decode
        self.transform = transform
        self.target_transform = target_transform

    # -- the torchvision-style surface ----------------------------------------------------
    @property
    def samples(self) -> list[tuple[str, int]]:
        """``(path, target)`` of every item, in order (paths are absolute)."""
        return list(zip(self.index.paths, self.index.labels.tolist()))

    @property
    def targets(self) -> list[int]:
        """The target of every item (made on each access: the dataset holds no int per item)."""
        return self.index.labels.tolist()

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int):
        i = _check_position(i, len(self))
        return self.item(self.decode(self.open(i)), i)

    # -- the split coordl relies on ---------------------------------------------------------
    def open(self, i: int) -> io.BytesIO:
        """Item ``i``'s file as an in-memory binary file object, read from storage. (A
        CoordLoader reads through the node's cache instead, then calls :meth:`decode`.)"""
        return as_file(samples.read(self.index, i), self.index.paths[i])

    def decode(self, f: io.BytesIO) -> Any:
        """Turns a file into a sample (before ``transform``). Override, or pass ``decode``."""
        if self._decode is None:
            raise NotImplementedError(f"{type(self).__name__} needs a decode function, or override decode()")
        return self._decode(f)

    def item(self, sample, i: int):
        """The dataset's item ``i`` from its decoded sample: the transforms applied."""
        target = int(self.index.labels[i])
        if self.transform is not None:
            sample = self.transform(sample)
        if self.target_transform is not None:
            target = self.target_transform(target)
        return sample, target

    def __repr__(self) -> str:
        lines = [f"Dataset {type(self).__name__}", f"    Number of datapoints: {len(self)}"]
        if getattr(self, "root", None) is not None:
            lines.append(f"    Root location: {self.root}")
        if self.transform is not None:
            lines += ["    " + line for line in repr(self.transform).splitlines()]
        if self.target_transform is not None:
            lines += ["    Target transform: " + repr(self.target_transform)]
        return "\n".join(lines)


class DatasetFolder(FileDataset):
    """torchvision's ``DatasetFolder``: one sub-folder per class, any file type.

    Classes are the sorted sub-folder names; files are found with ``os.walk(followlinks=True)``
    and sorted, exactly as torchvision does.

    Args:
        root: the folder.
        loader: turns a file into a sample. Unlike torchvision's, it receives a binary file
            object (``io.BytesIO``, its ``name`` the path) rather than a path, because coordl
            has already read the bytes; ``PIL.Image.open``, ``wave.open``, ``numpy.load``,
            ``soundfile.read`` and ``torchaudio.load`` all accept one.
        extensions: file endings that count (case-insensitive); exclusive with ``is_valid_file``.
        transform, target_transform: applied to each sample and target.
        is_valid_file: a function of a path deciding which files count.
        allow_empty: accept class folders without a valid file (otherwise an error names them).
        index_dir: where the scanned file list is saved (see :meth:`coordl.index.Index.scan`).
    """

    def __init__(
        self,
        root: str | os.PathLike,
        loader: Callable[[io.BytesIO], Any],
        extensions: Sequence[str] | str | None = None,
        transform: Callable | None = None,
        target_transform: Callable | None = None,
        is_valid_file: Callable[[str], bool] | None = None,
        allow_empty: bool = False,
        *,
        index_dir: str | None = None,
    ):
        if (extensions is None) == (is_valid_file is None):
            raise ValueError("Both extensions and is_valid_file cannot be None or not None at the same time")
        if not callable(loader):
            raise TypeError(f"loader must be callable, got {type(loader).__name__}")
        if isinstance(extensions, str):
            extensions = (extensions,)
        index = Index.scan(
            root,
            extensions=tuple(extensions or ()),
            is_valid_file=is_valid_file,
            allow_empty=allow_empty,
            index_dir=index_dir,
        )
        self.root = os.fspath(root)
        self.loader = loader
        self.extensions = tuple(extensions) if extensions is not None else None
        self.classes = list(index.classes)
        self.class_to_idx = index.class_to_idx
        self._init(index, loader, transform, target_transform)

    @property
    def imgs(self) -> list[tuple[str, int]]:
        return self.samples

    def find_classes(self, directory: str | os.PathLike) -> tuple[list[str], dict[str, int]]:
        """The class names of a folder (or an ``s3://`` prefix) and their indices, as torchvision's ``find_classes``."""
        if isinstance(directory, str) and directory.startswith("s3://"):
            from coordl.s3 import listing

            classes = listing.class_names(directory)
        else:
            classes = sorted(e.name for e in os.scandir(directory) if e.is_dir())
        if not classes:
            raise FileNotFoundError(f"Couldn't find any class folder in {directory}.")
        return classes, {c: i for i, c in enumerate(classes)}


class ImageFolder(DatasetFolder):
    """torchvision's ``ImageFolder`` with coordl reading the files.

    Same arguments, classes, sample order and items as ``torchvision.datasets.ImageFolder``:
    items are ``(transform(image), target_transform(class_index))`` where ``image`` is an RGB
    ``PIL.Image`` decoded by Pillow (Pillow-SIMD when installed).

    Args:
        root: one sub-folder per class.
        transform: applied to each PIL image (any callable; torchvision's transforms work).
        target_transform: applied to each class index.
        loader: turns an image file object into a sample (default :func:`pil_decode`); it
            receives a binary file object, not a path (see :class:`DatasetFolder`).
            torchvision's ``default_loader`` and ``pil_loader``, which open a path, are
            replaced by :func:`pil_decode`, which gives the same images.
        is_valid_file: a function of a path deciding which files count (instead of the
            image extensions).
        allow_empty: accept class folders without an image.
    """

    def __init__(
        self,
        root: str | os.PathLike,
        transform: Callable | None = None,
        target_transform: Callable | None = None,
        loader: Callable[[io.BytesIO], Any] | None = None,
        is_valid_file: Callable[[str], bool] | None = None,
        allow_empty: bool = False,
        *,
        index_dir: str | None = None,
    ):
        if loader is None or _is_torchvision_path_loader(loader):
            loader = pil_decode
        super().__init__(
            root,
            loader,
            IMG_EXTENSIONS if is_valid_file is None else None,
            transform=transform,
            target_transform=target_transform,
            is_valid_file=is_valid_file,
            allow_empty=allow_empty,
            index_dir=index_dir,
        )


class TarDataset(FileDataset):
    """Tar shards in WebDataset's format (:meth:`Index.from_tars <coordl.index.Index.from_tars>`),
    with coordl reading each sample's image member.

    Items are ``(transform(decode(image)), target_transform(label))``: ``decode`` gets the image
    member as a binary file object named ``<shard>:<member>`` (default :func:`pil_decode`, an RGB
    ``PIL.Image``); the label is the integer of the sample's ``.cls`` member, or what ``label``
    computes from its other members.

    Args:
        shards: a brace pattern (``/data/train-{000000..000146}.tar``), a folder of ``.tar`` files,
            a tar file, or a list of them.
        transform, target_transform: as :class:`ImageFolder`'s.
        decode: turns the image member into a sample.
        image: the extensions of a sample's image member, in the order one is chosen.
        label: a function of a sample's other members (``{extension: bytes}``) that returns its label.
        skip: leave out (and log) a sample without an image member or a label, instead of raising
            :class:`~coordl.errors.ShardError`.
    """

    def __init__(
        self,
        shards,
        transform: Callable | None = None,
        target_transform: Callable | None = None,
        *,
        decode: Callable[[io.BytesIO], Any] | None = None,
        image: Sequence[str] | None = None,
        label: Callable[[dict[str, bytes]], int] | None = None,
        skip: bool = False,
        index_dir: str | None = None,
    ):
        from coordl import tars

        index = Index.from_tars(
            shards, image=image or tars.IMAGE_EXTENSIONS, label=label, skip=skip, index_dir=index_dir
        )
        self._init(index, decode or pil_decode, transform, target_transform)
        self.root = os.fspath(shards) if isinstance(shards, (str, os.PathLike)) else None


class CocoDetection(FileDataset):
    """torchvision's ``CocoDetection`` with coordl reading the files: the same signature, images
    and order (by image id), and targets in the form torchvision's detection models take.

    Items are ``transforms(image, target)`` when ``transforms`` is given, else
    ``(transform(image), target_transform(target))``: ``image`` an RGB ``PIL.Image`` decoded by
    Pillow, ``target`` a dict ``{"boxes": float32 (N, 4) x1 y1 x2 y2 in pixels, "labels": int64 (N,),
    "image_id": int}`` (torchvision's own returns the raw list of annotation dicts, which
    its references then convert to this). Crowd boxes are left out, as torchvision's references
    leave them; the annotations are checked as :meth:`Index.from_coco
    <coordl.index.Index.from_coco>` checks them.

    Args:
        root: the folder of the images (or an ``s3://`` prefix).
        annFile: the annotations file (``instances_*.json``).
        transform, target_transform, transforms: as torchvision's.
        skip_empty, on_error, index_dir: as :meth:`Index.from_coco <coordl.index.Index.from_coco>`'s.
    """

    def __init__(
        self,
        root: str | os.PathLike,
        annFile: str | os.PathLike,  # noqa: N803 - torchvision's name
        transform: Callable | None = None,
        target_transform: Callable | None = None,
        transforms: Callable | None = None,
        *,
        skip_empty: bool = False,
        on_error: str = "raise",
        index_dir: str | None = None,
    ):
        if transforms is not None and (transform is not None or target_transform is not None):
            raise ValueError("Only transforms or transform/target_transform can be passed as argument")
        index = Index.from_coco(root, annFile, skip_empty=skip_empty, on_error=on_error, index_dir=index_dir)
        self._init(index, pil_decode, transform, target_transform)
        self.transforms = transforms
        self.root = os.fspath(root)
        self.ids = index.boxes.image_ids.tolist()

    @property
    def targets(self) -> list[dict]:
        """The target of every item (made on each access)."""
        return [self.target(i) for i in range(len(self))]

    def target(self, i: int) -> dict:
        """Item ``i``'s target, before ``target_transform``."""
        import torch

        xyxy, labels = self.index.boxes.of(i)
        return {
            "boxes": torch.from_numpy(np.array(xyxy, dtype=np.float32)).reshape(-1, 4),
            "labels": torch.from_numpy(np.array(labels, dtype=np.int64)),
            "image_id": int(self.index.boxes.image_ids[i]),
        }

    def item(self, sample, i: int):
        target = self.target(i)
        if self.transforms is not None:
            return self.transforms(sample, target)
        if self.transform is not None:
            sample = self.transform(sample)
        if self.target_transform is not None:
            target = self.target_transform(target)
        return sample, target


def as_file(data, path: str) -> io.BytesIO:
    """An in-memory binary file of ``data`` (bytes or a uint8 array), named ``path``."""
    f = io.BytesIO(data.tobytes() if isinstance(data, np.ndarray) else bytes(data))
    f.name = path
    return f


def _is_torchvision_path_loader(fn) -> bool:
    return getattr(fn, "__module__", "") == "torchvision.datasets.folder" and getattr(fn, "__name__", "") in (
        "default_loader",
        "pil_loader",
    )


def from_torchvision(data) -> FileDataset | None:
    """A torchvision folder dataset with its default (path-opening) loader as coordl's equivalent,
    or None for anything else."""
    if not type(data).__module__.startswith("torchvision.") or not hasattr(data, "samples"):
        return None
    if not _is_torchvision_path_loader(getattr(data, "loader", None)):
        return None
    log.info("coordl: reading %s through coordl (Pillow decoding, the same transforms)", type(data).__name__)
    ds = FileDataset(data.samples, pil_decode, transform=data.transform, target_transform=data.target_transform)
    ds.classes, ds.class_to_idx, ds.root = list(data.classes), dict(data.class_to_idx), data.root
    return ds


def _check_position(i, n: int) -> int:
    if isinstance(i, bool) or not isinstance(i, (int, np.integer)):
        raise TypeError(f"dataset indices must be integers, got {type(i).__name__}")
    i = int(i)
    if i < 0:
        i += n
    if not 0 <= i < n:
        raise IndexError(f"index {i} is out of range for a dataset of {n} items")
    return i
