"""The immutable table of samples (path, label, size): scan, load, save, fingerprint.

Built once by scanning a class-per-folder tree with torchvision ``ImageFolder``'s
rules (classes are the sorted sub-folder names; files sorted, found by
``os.walk(followlinks=True)``; the same image extensions), or from an explicit list
of ``(path, label)``. An ``s3://bucket/prefix`` root is listed by the same rules over keys
(:mod:`coordl.s3.listing`), and its index also holds every object's ETag. A scanned index is
saved in the index directory (``$COORDL_INDEX_DIR``, else ``$XDG_CACHE_HOME/coordl``, else
``~/.cache/coordl``) with the modification times of every folder of the tree, so a restart
checks a few thousand folder times instead of listing a million files; a changed tree is
rescanned. A saved ``s3://`` index is reused after one listing of the root's prefix (its classes
listed at once); a key added to a class is seen when the index is rebuilt (``rebuild=True``,
``COORDL_REINDEX=1``), a class added or a key removed lists it again.

Currency: a reused index is checked against its dataset when it is loaded (:mod:`coordl.currency`):
a stat of every file (threads), or that one listing; a sample whose size, modification time or ETag
changed since the index was saved gets its new ones in the index (and the saved file), so that no
tier serves the old bytes (:attr:`Index.version` names the caches; the local tier's entries are
stamped with them), and :attr:`Index.changed` counts them.

Memory: an index holds five flat arrays and no Python object per sample (the paths are a
:class:`~coordl.paths.PathTable`), so a forked worker that reads it copies nothing. A saved
index is one file, ``index-<key>.idx`` (:mod:`coordl.indexfile`), that every process maps
read-only: the processes of a node share one copy of it in the page cache, and loading it
reads the header, the metadata and the folders' times, not the samples.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from coordl import currency, env, indexfile
from coordl import saved as saved_store
from coordl.detection.boxes import Boxes
from coordl.paths import PathTable
from coordl.s3 import url as s3url
from coordl.tars import IMAGE_EXTENSIONS as TAR_IMAGE_EXTENSIONS
from coordl.tars import Shards

__all__ = ["IMG_EXTENSIONS", "Index", "default_index_dir"]

log = logging.getLogger(__name__)

#: torchvision.datasets.folder.IMG_EXTENSIONS
IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


def default_index_dir() -> str:
    """Where scanned indexes are saved (see the module docstring)."""
    if env.text("COORDL_INDEX_DIR"):
        return env.text("COORDL_INDEX_DIR")
    base = env.text("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "coordl")


@dataclass(frozen=True, eq=False)
class Index:
    """Samples of a dataset in ImageFolder order.

    Attributes:
        paths: absolute path of every sample: a read-only sequence of ``str``
            (:class:`~coordl.paths.PathTable`), ``paths[i]`` decoded on each access.
        labels: class index of every sample (int64; read-only when the index was loaded).
        sizes: bytes of every sample's file (int64; read-only when the index was loaded).
        classes: class names, ``classes[label]`` (empty for a list-built index without names).
        root: the scanned folder, or None for a list-built index.
        fingerprint: 16 hex digits naming this exact sample table: the first 16 of the
            SHA-256 of the paths joined by NUL (UTF-8), the labels and the sizes (int64,
            little-endian), and the ETags joined by NUL when there are. The same samples give
            the same fingerprint in every process.
        etags: the ETag of every sample of an ``s3://`` dataset (a
            :class:`~coordl.paths.PathTable` of strings), or None for files.
        shards: where the samples of a dataset of tar shards lie (:class:`~coordl.tars.Shards`), or
            None. Then ``paths[i]`` is ``<shard>:<member>``, and ``sizes[i]`` the image member's size.
        boxes: the targets of a detection dataset (:class:`~coordl.detection.boxes.Boxes`: every
            sample's boxes, their labels, its image's size and id), or None for a dataset of
            classes. Then every ``labels[i]`` is 0. Part of the fingerprint.
        mtimes: the modification time in ns of the file each sample lies in, as the index last saw
            it (int64; for tar shards, its shard's), or None for ``s3://`` (its ETags play that
            part). Not part of the fingerprint (a copy of the files, or ``touch``, is the same
            dataset to a resume state), but of :attr:`version`.
        changed: how many samples the check found changed (size, modification time or ETag) when
            this index was loaded from its saved copy; 0 for an index made anew.
    """

    paths: PathTable
    labels: np.ndarray
    sizes: np.ndarray
    classes: tuple[str, ...]
    root: str | None
    fingerprint: str
    saved_path: str | None = None  # where this index is saved, if it is
    etags: PathTable | None = None
    shards: Shards | None = None
    boxes: Boxes | None = None
    mtimes: np.ndarray | None = None
    changed: int = 0

    def __len__(self) -> int:
        return len(self.paths)

    @property
    def total_bytes(self) -> int:
        return int(self.sizes.sum())

    @functools.cached_property
    def version(self) -> str:
        """16 hex digits naming this version of the samples' bytes, as far as the index can tell: the
        fingerprint and every file's modification time (the fingerprint itself where there are none,
        ``s3://``, whose ETags it holds). Names the node's caches: a memory cache kept from another
        version of a file is never attached."""
        if self.mtimes is None:
            return self.fingerprint
        h = hashlib.sha256(self.fingerprint.encode())
        h.update(np.ascontiguousarray(self.mtimes, dtype="<i8"))
        return h.hexdigest()[:16]

    def location(self, i: int) -> tuple[str, int, int]:
        """The file (or object) sample ``i`` lies in, where it starts there and its size: its own
        file from 0, or its tar shard from its member's offset."""
        if self.shards is not None:
            sh = self.shards
            return sh.files[int(sh.of[i])], int(sh.offsets[i]), int(self.sizes[i])
        return self.paths[i], 0, int(self.sizes[i])

    @property
    def class_to_idx(self) -> dict[str, int]:
        return {c: i for i, c in enumerate(self.classes)}

    # -- building --------------------------------------------------------------------
    @property
    def in_store(self) -> bool:
        """Whether the samples are objects in an object store (``s3://``), or in its objects, not files."""
        return self.etags is not None or (self.shards is not None and self.shards.etags is not None)

    @classmethod
    def build(
        cls,
        paths: Sequence[str] | PathTable,
        labels,
        sizes,
        classes=(),
        root=None,
        etags=None,
        shards=None,
        boxes: Boxes | None = None,
        mtimes=None,
    ) -> Index:
        """An index from parallel sequences, with its fingerprint computed (and, for tar shards, the
        shards' paths, each sample's shard and offset; for a detection dataset, its boxes; for files,
        their modification times in ns, :attr:`mtimes`).

        Raises:
            ValueError: the sequences differ in length, or a path contains a NUL.
        """
        table = paths if isinstance(paths, PathTable) else PathTable.from_strings(paths)
        labels = np.ascontiguousarray(labels, dtype="<i8")
        sizes = np.ascontiguousarray(sizes, dtype="<i8")
        if not len(table) == len(labels) == len(sizes):
            raise ValueError(
                f"Index.build got {len(table)} paths, {len(labels)} labels and {len(sizes)} sizes; "
                "give one of each per sample"
            )
        h = hashlib.sha256()
        h.update(table.blob)  # the paths joined by NUL: the bytes that version 1 hashed
        h.update(labels)
        h.update(sizes)
        if etags is not None:
            etags = etags if isinstance(etags, PathTable) else PathTable.from_strings(etags)
            if len(etags) != len(table):
                raise ValueError(f"Index.build got {len(etags)} ETags for {len(table)} samples")
            h.update(etags.blob)
        if shards is not None:
            h.update(shards.files.blob)
            h.update(np.ascontiguousarray(shards.of, dtype="<i8"))
            h.update(np.ascontiguousarray(shards.offsets, dtype="<i8"))
            if shards.etags is not None:
                h.update(shards.etags.blob)
        if boxes is not None:
            if len(boxes) != len(table):
                raise ValueError(f"Index.build got boxes of {len(boxes)} samples for {len(table)} samples")
            h.update(b"boxes")
            boxes.hash_into(h)
        if mtimes is not None:
            mtimes = np.ascontiguousarray(mtimes, dtype="<i8")
            if len(mtimes) != len(table):
                raise ValueError(f"Index.build got {len(mtimes)} modification times for {len(table)} samples")
        return cls(
            table,
            labels,
            sizes,
            tuple(classes),
            root,
            h.hexdigest()[:16],
            etags=etags,
            shards=shards,
            boxes=boxes,
            mtimes=mtimes,
        )

    @classmethod
    def from_list(cls, samples: Iterable[tuple[str | os.PathLike, int]], classes: Sequence[str] = ()) -> Index:
        """An index of explicit ``(path, label)`` pairs, in the order given: files, or ``s3://``
        URLs (all of them; their sizes and ETags are asked of the store).

        Raises:
            ValueError: the list is empty, mixes files and URLs, or a label is not a non-negative int.
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
            if s3url.is_url(path):
                s3url.split(path)  # a bucket, or a ValueError that names the URL
            else:
                path = os.path.abspath(os.fspath(path))
            paths.append(path)
            labels.append(int(label))
        if not paths:
            raise ValueError("the list of samples is empty")
        in_store = [s3url.is_url(p) for p in paths]
        if not any(in_store):
            stats = [_stat(p) for p in paths]
            return cls.build(
                paths, labels, [st.st_size for st in stats], classes, mtimes=[st.st_mtime_ns for st in stats]
            )
        if not all(in_store):
            local = paths[in_store.index(False)]
            raise ValueError(f"the list mixes s3:// URLs and files ({local}); an index reads from one or the other")
        from coordl.s3 import listing

        sizes, etags = listing.stat_many(paths)
        return cls.build(paths, labels, sizes, classes, etags=etags)

    @classmethod
    def from_tars(
        cls,
        data,
        *,
        image: Sequence[str] = TAR_IMAGE_EXTENSIONS,
        label: Callable[[dict[str, bytes]], int] | None = None,
        index_dir: str | None = None,
        rebuild: bool = False,
        skip: bool = False,
        stream: bool | None = None,
        boxes: bool = False,
    ) -> Index:
        """The index of a dataset in tar shards (WebDataset's format, :mod:`coordl.tars`), loaded
        from the index directory while every shard keeps its size and modification time (an
        ``s3://`` shard: its size and ETag).

        Args:
            data: a brace pattern (``/data/train-{000000..000146}.tar``), a folder of ``.tar``
                files, a tar file, or a list of them; or the same as ``s3://`` URLs (a prefix for a
                folder).
            image: the extensions of a sample's image member, in the order one is chosen.
            label: a function of a sample's other members (``{extension: bytes}``) that returns its
                label; default: the integer in its ``.cls`` member. (An index made with a function
                is not saved: nothing names the function.)
            index_dir, rebuild: as :meth:`scan`.
            skip: leave out (and log) a sample without an image member or label, instead of raising.
            stream: how ``s3://`` shards are indexed: False, by range GETs of their headers (a
                GET a sample; few bytes where members are large); True, by one GET of each whole
                shard (every byte, a GET a shard); None (the default), by range GETs in each
                shard until they move half as many bytes as they go past (members of a few KB),
                and the rest of that shard by one GET.
            boxes: a detection dataset: each sample's target is its ``.json`` member, COCO's fields
                for one image (``width``, ``height``, ``annotations`` of ``bbox``, ``category_id``
                and ``iscrowd``, and optionally ``image_id``), read by the rules of
                :meth:`from_coco`; with ``skip``, a bad box is left out and counted.

        Raises:
            FileNotFoundError: no shard, or a shard is missing.
            ShardError: a shard is not a tar file, is truncated, or holds a sample without an image
                member or a label, or a key twice (the message names the shard and member).
        """
        from coordl import tars

        if boxes and label is not None:
            raise ValueError("Index.from_tars takes boxes=True (the .json members) or a label function, not both")
        files = tars.shard_list(data)
        root = os.fspath(data) if isinstance(data, (str, os.PathLike)) else None
        image = tuple(e.lower().lstrip(".") for e in image)
        index_dir = default_index_dir() if index_dir is None else index_dir
        made_from = tars.made_from(files)
        saved = None
        if index_dir and label is None:
            key = ["tars", files, list(image), skip] + (["boxes"] if boxes else [])
            if s3url.is_url(files[0]):
                key.append({"store": saved_store.store_name()})
            saved = os.path.join(index_dir, f"index-{saved_store.name(key)}{indexfile.SUFFIX}")
        if saved and not (rebuild or env.flag("COORDL_REINDEX")):
            opened = saved_store.load(saved, cls)
            if opened is not None and opened[0].shards is not None and opened[1] == made_from:
                return dataclasses.replace(opened[0], saved_path=saved)
            if opened is not None:
                log.info("coordl: shards of %s changed since the index was saved; indexing again", root or files[0])
        label = tars.JSON if boxes else label
        paths, labels, sizes, shards = tars.index(files, made_from, image=image, label=label, skip=skip, stream=stream)
        table = None
        if boxes:
            from coordl.detection import dataset

            table = dataset.boxes_of_members(paths, labels, on_error="skip" if skip else "raise")
            labels = np.zeros(len(paths), dtype=np.int64)
        mtimes = None if shards.etags is not None else np.array([s[1] for s in made_from], np.int64)[shards.of]
        index = cls.build(paths, labels, sizes, (), root, shards=shards, boxes=table, mtimes=mtimes)
        return saved_store.publish(index, made_from, saved) if saved else index

    @classmethod
    def from_coco(
        cls,
        images: str | os.PathLike,
        annotations: str | os.PathLike,
        *,
        skip_empty: bool = False,
        on_error: str = "raise",
        index_dir: str | None = None,
        rebuild: bool = False,
    ) -> Index:
        """The index of a COCO-format detection dataset: the images of ``annotations``, in the
        order of their ids (as ``torchvision.datasets.CocoDetection``), each with its boxes
        (:attr:`boxes`), loaded from the index directory while the annotations file keeps its size
        and modification time and the images' folder its modification time.

        Args:
            images: the folder the ``file_name`` of every image is relative to, or an ``s3://`` prefix.
            annotations: an ``instances_*.json`` file (COCO's instances format).
            skip_empty: leave out images without a box (crowd boxes do not count); kept by default.
            on_error: ``"raise"`` an :class:`~coordl.errors.AnnotationError` at a missing image, a
                box of no area or outside its image, or an annotation of an unknown image or category;
                ``"skip"`` leaves it out and counts it (``index.boxes.skipped``, ``loader.stats()``).
            index_dir, rebuild: as :meth:`scan`.

        Raises:
            FileNotFoundError: no annotations file, or no images folder.
            AnnotationError: the file is not COCO's JSON, or (``on_error="raise"``) a fault above;
                the message names the file and the image id.
        """
        from coordl.detection import dataset

        if on_error not in ("raise", "skip"):
            raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
        images = s3url.normalize(images) if s3url.is_url(images) else os.path.abspath(os.fspath(images))
        annotations = os.path.abspath(os.fspath(annotations))
        index_dir = default_index_dir() if index_dir is None else index_dir
        made_from = dataset.made_from(images, annotations)
        saved = None
        if index_dir:
            key = ["coco", images, annotations, skip_empty, on_error]
            if s3url.is_url(images):
                key.append({"store": saved_store.store_name()})
            saved = os.path.join(index_dir, f"index-{saved_store.name(key)}{indexfile.SUFFIX}")
        if saved and not (rebuild or env.flag("COORDL_REINDEX")):

            def check(index: Index, dirs: list) -> Index | None:
                if index.boxes is None or dirs != made_from:
                    return None
                return saved_store.renewed(index, currency.of_samples(index), dirs, saved, images)

            index = saved_store.reused(saved, cls, check)
            if index is not None:
                return index
        found = dataset.coco_samples(images, annotations, skip_empty=skip_empty, on_error=on_error)
        labels = np.zeros(len(found.paths), dtype=np.int64)
        index = cls.build(
            found.paths, labels, found.sizes, (), images, etags=found.etags, boxes=found.boxes, mtimes=found.mtimes
        )
        return saved_store.publish(index, made_from, saved) if saved else index

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
            root: folder with one sub-folder per class, or ``s3://bucket/prefix`` with one
                prefix per class.
            extensions: file endings that count as samples (case-insensitive).
            index_dir: where to save and look for the index; ``""`` disables saving.
            rebuild: rescan even if a saved index is valid (also ``COORDL_REINDEX=1``).
            is_valid_file: a function of a path that decides which files count, instead of
                ``extensions`` (an index scanned with one is not saved).
            allow_empty: accept class folders without a valid file.

        Raises:
            FileNotFoundError: ``root`` is missing, has no class folders, or a class
                folder has no file with an accepted extension (the message names them).
            StoreError: an ``s3://`` root's store refused the credentials, or has no such bucket.
        """
        in_store = s3url.is_url(root)
        if in_store:
            root = s3url.normalize(root)
        else:
            root = os.path.abspath(os.fspath(root))
            if not os.path.isdir(root):
                raise FileNotFoundError(f"dataset folder {root} does not exist or is not a folder")
        extensions = tuple(e.lower() for e in extensions)
        index_dir = default_index_dir() if index_dir is None else index_dir
        if is_valid_file is not None:
            index_dir = ""  # a predicate has no key to save the index under
        saved = saved_store.tree_path(index_dir, root, extensions, allow_empty) if index_dir else None
        rebuild = rebuild or env.flag("COORDL_REINDEX")
        if saved and not rebuild:

            def check(index: Index, dirs: list) -> Index | None:
                return saved_store.current_tree(index, dirs, root, saved, extensions, allow_empty)

            index = saved_store.reused(saved, cls, check)
            if index is not None:
                return index
        if in_store:
            index, dirs = _scan_store(root, extensions, is_valid_file, allow_empty), []
        else:
            index, dirs = _scan(root, extensions, is_valid_file, allow_empty)
        return saved_store.publish(index, dirs, saved) if saved else index

    def forget_saved(self) -> None:
        """Deletes the saved copy of this index, so that the next start scans the tree again."""
        if self.saved_path:
            try:
                os.unlink(self.saved_path)
            except FileNotFoundError:
                pass


def _stat(path: str) -> os.stat_result:
    try:
        return os.stat(path)
    except FileNotFoundError:
        raise FileNotFoundError(f"sample {path} does not exist") from None
    except OSError as e:
        raise OSError(e.errno, f"cannot stat sample {path}: {e.strerror}") from None


def _scan(
    root: str, extensions: tuple[str, ...], is_valid_file=None, allow_empty: bool = False
) -> tuple[Index, list[tuple[str, int]]]:
    valid = is_valid_file or (lambda path: path.lower().endswith(extensions))
    classes = sorted(e.name for e in os.scandir(root) if e.is_dir())
    if not classes:
        raise FileNotFoundError(f"no class folders found in {root}; expected one sub-folder per class")
    dirs = [(root, os.stat(root).st_mtime_ns)]
    paths, labels, sizes, mtimes, empty = [], [], [], [], []
    for label, name in enumerate(classes):
        folders, found, found_sizes, found_mtimes = _scan_class(os.path.join(root, name), valid)
        dirs += folders
        paths += found
        sizes += found_sizes
        mtimes += found_mtimes
        labels.append(np.full(len(found), label, dtype=np.int64))
        if not found:
            empty.append(name)
    if empty and not allow_empty:
        shown = ", ".join(empty[:10]) + (f" and {len(empty) - 10} more" if len(empty) > 10 else "")
        raise FileNotFoundError(
            f"found no valid file for the classes {shown} in {root}. Supported extensions are: {', '.join(extensions)}"
        )
    return Index.build(paths, np.concatenate(labels), sizes, classes, root, mtimes=mtimes), dirs


def _scan_class(
    top: str, valid: Callable[[str], bool]
) -> tuple[list[tuple[str, int]], list[str], list[int], list[int]]:
    """The folders (with their times), sample paths, sizes and modification times of one class folder."""
    folders, paths, sizes, mtimes = [], [], [], []
    for folder, _, files in sorted(os.walk(top, followlinks=True)):
        folders.append((folder, os.stat(folder).st_mtime_ns))
        for fname in sorted(files):
            path = f"{folder}/{fname}"  # os.path.join's result: os.walk's folders never end with a slash
            if valid(path):
                st = _stat(path)
                sizes.append(st.st_size)
                mtimes.append(st.st_mtime_ns)
                paths.append(path)
    return folders, paths, sizes, mtimes


def _scan_store(root: str, extensions: tuple[str, ...], is_valid_file=None, allow_empty: bool = False) -> Index:
    from coordl.s3 import listing

    found = listing.scan(root, extensions, is_valid_file, allow_empty)
    return Index.build(found.urls, found.labels, found.sizes, found.classes, root, etags=found.etags)
