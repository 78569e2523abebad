"""Exceptions that coordl raises for problems in the environment, not the caller's arguments.

Mistakes in arguments raise the built-in ``ValueError`` / ``TypeError``. Everything
here derives from :class:`CoordlError`, so ``except coordl.CoordlError`` catches all
of coordl's own failures.
"""

from __future__ import annotations

import os
import sys
import warnings

__all__ = [
    "AnnotationError",
    "CoordlError",
    "DatasetChangedError",
    "GroupConfigError",
    "SampleError",
    "ShardError",
    "SharedMemoryError",
    "StaleStateError",
    "StoreError",
    "warn",
]


class CoordlError(RuntimeError):
    """Base class of coordl's errors about the environment or the data."""


class SharedMemoryError(CoordlError):
    """``/dev/shm`` (or ``COORDL_SHM_DIR``) is missing, too small or not usable."""


class StaleStateError(CoordlError):
    """Shared state left by another process does not match what this process expects."""


class DatasetChangedError(CoordlError):
    """A file differs from the index (size changed, file gone): the index is stale."""


class StoreError(CoordlError):
    """The object store refused the job's credentials, or the dataset's bucket is gone: no sample
    of an ``s3://`` dataset can be read (raised whatever ``on_error`` says)."""


class ShardError(CoordlError, ValueError):
    """A tar shard is not a dataset's shard: not a tar file, truncated, a sample without an image
    member or a label, a key that repeats (the message names the shard and the member)."""


class SampleError(CoordlError):
    """A sample could not be read or decoded.

    Attributes:
        path: the file that failed.
        index: the sample's position in the index.
    """

    def __init__(self, message: str, *, path: str, index: int):
        super().__init__(message)
        self.path = path
        self.index = index

    def __reduce__(self):  # pickled with its keyword arguments: it crosses processes (Ray's actors)
        return _sample_error, (type(self), str(self), self.path, self.index), self.__dict__


def _sample_error(cls, message: str, path: str, index: int) -> SampleError:
    return cls(message, path=path, index=index)


class AnnotationError(CoordlError, ValueError):
    """A detection dataset's annotations are not usable: a file that is not COCO's JSON, an image
    listed but missing, a box of no area or outside its image, an annotation of an unknown image
    or category (the message names the file and the image id).

    Attributes:
        path: the annotations file (or the image file, or the tar shard's member) at fault.
        image_id: the image's id in the annotations, or None when the fault is the file's own.
    """

    def __init__(self, message: str, *, path: str, image_id: int | None = None):
        super().__init__(message)
        self.path = path
        self.image_id = image_id

    def __reduce__(self):  # pickled with its keyword arguments, as SampleError
        return _annotation_error, (type(self), str(self), self.path, self.image_id), self.__dict__


def _annotation_error(cls, message: str, path: str, image_id) -> AnnotationError:
    return cls(message, path=path, image_id=image_id)


class GroupConfigError(CoordlError, ValueError):
    """A job tried to join an ``hp_group`` whose members load differently (the message names
    what differs: dataset, batch size, pipeline, seed...)."""


_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def warn(message: str, category: type[Warning] = RuntimeWarning) -> None:
    """Warns about the line of the caller's code that called into coordl: the innermost frame
    outside the coordl package (a user's ``CoordLoader(...)`` line), however deep in coordl the
    warning is raised, so that ``-W error``, filters by module and the printed location name it."""
    frame, level = sys._getframe(1), 2  # stacklevel 2: the caller of warn()
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)
