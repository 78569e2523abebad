"""coordl: a data loader for deep-learning training that removes data stalls.

``CoordLoader`` replaces ``torch.utils.data.DataLoader``: it shards and shuffles like
``DistributedSampler``, decodes and augments with NVIDIA DALI, and keeps raw samples
in a node-wide MinIO cache in shared memory so that every epoch after the first reads
only what the cache cannot hold. Datasets with Python transforms (:mod:`coordl.datasets`,
imported on first use) run on PyTorch's DataLoader workers with the same cache.
"""

from coordl.errors import (
    CoordlError,
    DatasetChangedError,
    GroupConfigError,
    SampleError,
    SharedMemoryError,
    StaleStateError,
    StoreError,
)
from coordl.index import Index
from coordl.loader import CoordLoader
from coordl.prep.recipes import DecodedRecipe, ImageNetTrain, ImageNetVal, PrepContext

__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "datasets":  # imports torch: only when used
        import importlib

        return importlib.import_module("coordl.datasets")
    raise AttributeError(f"module 'coordl' has no attribute {name!r}")


__all__ = [
    "CoordLoader",
    "CoordlError",
    "DatasetChangedError",
    "DecodedRecipe",
    "GroupConfigError",
    "ImageNetTrain",
    "ImageNetVal",
    "Index",
    "PrepContext",
    "SampleError",
    "SharedMemoryError",
    "StaleStateError",
    "StoreError",
    "__version__",
]
