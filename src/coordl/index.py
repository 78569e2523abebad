"""The immutable table of samples (path, label, size): scan, load, save, fingerprint.

Built once by scanning a class-per-folder tree with torchvision ``ImageFolder``'s
rules (classes are the sorted sub-folder names; files sorted, found by
``os.walk(followlinks=True)``; the same image extensions), or from an explicit list
of ``(path, label)``. A scanned index is saved in the index directory
(``$COORDL_INDEX_DIR``, else ``$XDG_CACHE_HOME/coordl``, else ``~/.cache/coordl``)
with the modification times of every folder of the tree, so a restart checks a few
thousand folder times instead of listing a million files; a changed tree is rescanned.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["IMG_EXTENSIONS", "Index", "default_index_dir"]

log = logging.getLogger(__name__)

#: torchvision.datasets.folder.IMG_EXTENSIONS
IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
FORMAT_VERSION = 1


def default_index_dir() -> str:
    """Where scanned indexes are saved (see the module docstring)."""
    if os.environ.get("COORDL_INDEX_DIR"):
        return os.environ["COORDL_INDEX_DIR"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "coordl")


@dataclass(frozen=True, eq=False)
class Index:
    """Samples of a dataset in ImageFolder order.

    Attributes:
        paths: absolute path of every sample.
        labels: class index of every sample (int64).
        sizes: bytes of every sample's file (int64).
        classes: class names, ``classes[label]`` (empty for a list-built index without names).
        root: the scanned folder, or None for a list-built index.
        fingerprint: 16 hex digits naming this exact sample table.
    """

    paths: tuple[str, ...]
    labels: np.ndarray
    sizes: np.ndarray
    classes: tuple[str, ...]
    root: str | None
    fingerprint: str
    saved_path: str | None = None  # where this index is saved, if it is

    def __len__(self) -> int:
        return len(self.paths)

    @property
    def total_bytes(self) -> int:
        return int(self.sizes.sum())

    @property
    def class_to_idx(self) -> dict[str, int]:
        return {c: i for i, c in enumerate(self.classes)}

    # -- building --------------------------------------------------------------------
    @classmethod
    def build(cls, paths: Sequence[str], labels, sizes, classes=(), root=None) -> Index:
        """An index from parallel sequences, with its fingerprint computed."""
        labels = np.ascontiguousarray(labels, dtype=np.int64)
        sizes = np.ascontiguousarray(sizes, dtype=np.int64)
        h = hashlib.sha256()
        h.update("\0".join(paths).encode("utf-8", "surrogateescape"))
        h.update(labels.tobytes())
        h.update(sizes.tobytes())
        return cls(tuple(paths), labels, sizes, tuple(classes), root, h.hexdigest()[:16])

    @classmethod
    def from_list(cls, samples: Iterable[tuple[str | os.PathLike, int]], classes: Sequence[str] = ()) -> Index:
        """An index of explicit ``(path, label)`` pairs, in the order given.

        Raises:
            ValueError: the list is empty or a label is not a non-negative int.
            FileNotFoundError: a path does not exist (the message names it).
        """
        paths, labels, sizes = [], [], []
        for item in samples:
            try:
                path, label = item
            except (TypeError, ValueError):
                raise ValueError(f"expected (path, label) pairs, got {item!r}") from None
            if isinstance(label, bool) or not isinstance(label, (int, np.integer)) or label < 0:
                raise ValueError(f"label of {path} must be a non-negative int, got {label!r}")
            path = os.path.abspath(os.fspath(path))
            sizes.append(_size(path))
            paths.append(path)
            labels.append(int(label))
        if not paths:
            raise ValueError("the list of samples is empty")
        return cls.build(paths, labels, sizes, classes)

    @classmethod
    def scan(
        cls,
        root: str | os.PathLike,
        *,
        extensions: Sequence[str] = IMG_EXTENSIONS,
        index_dir: str | None = None,
        rebuild: bool = False,
        is_valid_file: Callable[[str], bool] | None = None,
        allow_empty: bool = False,
    ) -> Index:
        """The index of an ImageFolder tree, loaded from the index directory when still valid.

        Args:
            root: folder with one sub-folder per class.
            extensions: file endings that count as samples (case-insensitive).
            index_dir: where to save and look for the index; ``""`` disables saving.
            rebuild: rescan even if a saved index is valid.
            is_valid_file: a function of a path that decides which files count, instead of
                ``extensions`` (an index scanned with one is not saved).
            allow_empty: accept class folders without a valid file.

        Raises:
            FileNotFoundError: ``root`` is missing, has no class folders, or a class
                folder has no file with an accepted extension (the message names them).
        """
        root = os.path.abspath(os.fspath(root))
        if not os.path.isdir(root):
            raise FileNotFoundError(f"dataset folder {root} does not exist or is not a folder")
        extensions = tuple(e.lower() for e in extensions)
        index_dir = default_index_dir() if index_dir is None else index_dir
        if is_valid_file is not None:
            index_dir = ""  # a predicate has no key to save the index under
        saved = _saved_path(index_dir, root, extensions, allow_empty) if index_dir else None
        if saved and not rebuild:
            index = _load_if_fresh(saved, root)
            if index is not None:
                return dataclasses.replace(index, saved_path=saved)
        index, dirs = _scan(root, extensions, is_valid_file, allow_empty)
        if saved:
            try:
                _save(index, dirs, saved)
                index = dataclasses.replace(index, saved_path=saved)
            except OSError as e:
                log.warning("coordl: could not save the index to %s (%s); it will be rescanned next time", saved, e)
        return index

    def forget_saved(self) -> None:
        """Deletes the saved copy of this index, so that the next start scans the tree again."""
        if self.saved_path:
            try:
                os.unlink(self.saved_path)
            except FileNotFoundError:
                pass


def _size(path: str) -> int:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise FileNotFoundError(f"sample {path} does not exist") from None
    except OSError as e:
        raise OSError(e.errno, f"cannot stat sample {path}: {e.strerror}") from None
    return st.st_size


def _scan(
    root: str, extensions: tuple[str, ...], is_valid_file=None, allow_empty: bool = False
) -> tuple[Index, list[tuple[str, int]]]:
    valid = is_valid_file or (lambda path: path.lower().endswith(extensions))
    classes = sorted(e.name for e in os.scandir(root) if e.is_dir())
    if not classes:
        raise FileNotFoundError(f"no class folders found in {root}; expected one sub-folder per class")
    dirs = [(root, os.stat(root).st_mtime_ns)]
    paths, labels, sizes, empty = [], [], [], []
    for label, name in enumerate(classes):
        found = 0
        for folder, subdirs, files in sorted(os.walk(os.path.join(root, name), followlinks=True)):
            dirs.append((folder, os.stat(folder).st_mtime_ns))
            for fname in sorted(files):
                path = os.path.join(folder, fname)
                if valid(path):
                    sizes.append(_size(path))
                    paths.append(path)
                    labels.append(label)
                    found += 1
        if not found:
            empty.append(name)
    if empty and not allow_empty:
        shown = ", ".join(empty[:10]) + (f" and {len(empty) - 10} more" if len(empty) > 10 else "")
        raise FileNotFoundError(
            f"found no valid file for the classes {shown} in {root}. Supported extensions are: {', '.join(extensions)}"
        )
    return Index.build(paths, labels, sizes, classes, root), dirs


def _saved_path(index_dir: str, root: str, extensions: tuple[str, ...], allow_empty: bool = False) -> str:
    key = [root, list(extensions)] + ([True] if allow_empty else [])  # the key of earlier versions when False
    key = hashlib.sha256(json.dumps(key).encode()).hexdigest()[:16]
    return os.path.join(index_dir, f"index-{key}.npz")


def _save(index: Index, dirs: list[tuple[str, int]], path: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    meta = {
        "version": FORMAT_VERSION,
        "root": index.root,
        "classes": list(index.classes),
        "fingerprint": index.fingerprint,
        "dirs": dirs,
    }
    blob = "\0".join(index.paths).encode("utf-8", "surrogateescape")
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        np.savez(
            f,
            meta=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8),
            paths=np.frombuffer(blob, dtype=np.uint8),
            labels=index.labels,
            sizes=index.sizes,
        )
    os.replace(tmp, path)  # readers see the old index or the new one, never half of one


def _load_if_fresh(path: str, root: str) -> Index | None:
    if not os.path.exists(path):
        return None
    try:
        with np.load(path) as z:
            meta = json.loads(z["meta"].tobytes())
            if meta.get("version") != FORMAT_VERSION or meta.get("root") != root:
                return None
            for folder, mtime in meta["dirs"]:
                if os.stat(folder).st_mtime_ns != mtime:
                    log.info("coordl: %s changed since the index was saved; rescanning", folder)
                    return None
            paths = z["paths"].tobytes().decode("utf-8", "surrogateescape").split("\0")
            index = Index.build(paths, z["labels"], z["sizes"], meta["classes"], root)
    except (OSError, ValueError, KeyError, json.JSONDecodeError) as e:
        log.info("coordl: saved index %s unusable (%s); rescanning", path, e)
        return None
    if index.fingerprint != meta["fingerprint"]:
        return None
    # A folder whose mtime kept its value still lists the same names; a class folder
    # added or removed changes root's mtime. So the saved index is the tree's.
    return index
