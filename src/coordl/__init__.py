"""coordl: a data loader for deep-learning training that removes data stalls.

``CoordLoader`` replaces ``torch.utils.data.DataLoader``: it shards and shuffles like
``DistributedSampler``, decodes and augments with NVIDIA DALI, and keeps raw samples in the
node's cache in shared memory (never evicted: the paper's MinIO policy) so that every epoch
after the first reads only what the cache cannot hold. Detection datasets (:meth:`Index.from_coco`)
take the SSD recipes (:class:`SSDTrain`, :class:`SSDVal`) and deliver boxes with their pixels;
folders of audio clips take :class:`AudioTrain` and :class:`AudioVal` (decode, resample, a window);
a recipe of one's own subclasses :class:`Recipe` (docs/recipes.md).
Each feature takes one option object
(:class:`Cache`, :class:`Peers`, :class:`HPGroup`, :class:`Shard`, :class:`Prep`,
:class:`Fetch`). Datasets with Python transforms (:mod:`coordl.datasets`, imported on first
use) run on PyTorch's DataLoader workers with the same cache.
"""

from coordl.errors import (
    AnnotationError,
    CoordlError,
    DatasetChangedError,
    GroupConfigError,
    SampleError,
    ShardError,
    SharedMemoryError,
    StaleStateError,
    StoreError,
)
from coordl.index import Index
from coordl.loader import CoordLoader
from coordl.options import Cache, Disk, Fetch, HPGroup, Peers, Prep, RayPrep, Shard
from coordl.prep.recipes import (
    AudioTrain,
    AudioVal,
    DecodedRecipe,
    ImageNetTrain,
    ImageNetVal,
    PrepContext,
    Recipe,
    SSDTrain,
    SSDVal,
)

__version__ = "0.2.0"  # the one place the version is written (pyproject.toml reads it)


def __getattr__(name: str):
    if name == "datasets":  # imports torch: only when used
        import importlib

        return importlib.import_module("coordl.datasets")
    raise AttributeError(f"module 'coordl' has no attribute {name!r}")


__all__ = [
    "AnnotationError",
    "AudioTrain",
    "AudioVal",
    "Cache",
    "CoordLoader",
    "CoordlError",
    "DatasetChangedError",
    "DecodedRecipe",
    "Disk",
    "Fetch",
    "GroupConfigError",
    "HPGroup",
    "ImageNetTrain",
    "ImageNetVal",
    "Index",
    "Peers",
    "Prep",
    "PrepContext",
    "RayPrep",
    "Recipe",
    "SSDTrain",
    "SSDVal",
    "SampleError",
    "Shard",
    "ShardError",
    "SharedMemoryError",
    "StaleStateError",
    "StoreError",
    "__version__",
]
