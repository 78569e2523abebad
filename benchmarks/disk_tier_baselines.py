"""The baselines of ``benchmarks.disk_tier`` (:data:`LOADERS`): LitData's and Mosaic Streaming's local caches over
the chunks :func:`convert` makes of the same files (``{"image": the JPEG's bytes, "label": int}``): LitData's
``optimize`` (``chunk_bytes``, 2 workers) read by its ``StreamingDataset(cache_dir, max_cache_size, shuffle=True)``
in a ``StreamingDataLoader``; Mosaic's ``MDSWriter`` (``size_limit``) read by its ``StreamingDataset(remote, local,
cache_limit, shuffle=True)`` in a ``DataLoader`` (endpoint: ``S3_ENDPOINT_URL``); ``workers`` workers each. Both
decode with Pillow and augment with :class:`benchmarks.loaders.TrainAugment` (crop 224, flip, normalise).
"""

import functools
import io
import sys
import time
import types
from pathlib import Path

from benchmarks.loaders import TrainAugment

AUGMENT = TrainAugment()
# Mosaic's vision datasets (streaming.vision, 0.13) import torchvision, not installed (its wheels require another
# torch) and not used here: a module of that name, empty, stands in for them
NO_VISION = types.ModuleType("streaming.vision")


def _item(labels: dict[str, int], path: str) -> dict:
    """One sample of the conversion: the file's bytes and its label (the rank of its class folder)."""
    return {"image": Path(path).read_bytes(), "label": labels[Path(path).parent.name]}


def convert(kind: str, src: str, out: str, size: str) -> dict:
    """The dataset under ``src`` as ``kind``'s chunks of ``size`` (``8MB``) in ``out``: the seconds (imports apart)."""
    if kind == "litdata":
        import litdata
    else:
        sys.modules.setdefault("streaming.vision", NO_VISION)
        from streaming import MDSWriter
    t0 = time.perf_counter()
    files = sorted(str(p) for p in Path(src).rglob("*") if p.is_file() and not p.name.startswith("."))
    item = functools.partial(_item, {c: k for k, c in enumerate(sorted({Path(p).parent.name for p in files}))})
    if kind == "litdata":
        litdata.optimize(fn=item, inputs=files, output_dir=out, chunk_bytes=size, num_workers=2, verbose=False)
    else:
        with MDSWriter(out=out, columns={"image": "bytes", "label": "int"}, size_limit=size.lower()) as w:
            for p in files:
                w.write(item(p))
    return {"convert_s": time.perf_counter() - t0}


def decode(sample: dict):
    """Pillow decode to RGB, then the training augmentation: ``(CHW float tensor, label)``."""
    from PIL import Image

    with Image.open(io.BytesIO(sample["image"])) as im:
        image = im.convert("RGB")
    return AUGMENT(image), int(sample["label"])


def _litdata(spec: dict):
    import litdata.streaming.downloader as downloader
    from litdata import StreamingDataLoader, StreamingDataset

    # LitData 0.2.76 reads chunks with obstore, whose store it builds without allow_http: an http://
    # endpoint fails with "builder error: BadScheme". This is the one change it needs.
    downloader._OBSTORE_CLIENT_OPTIONS = {**downloader._OBSTORE_CLIENT_OPTIONS, "allow_http": "true"}
    kw = {"cache_dir": spec["local"], "max_cache_size": spec["cache_limit"], "shuffle": True, "transform": decode}
    return StreamingDataLoader(
        StreamingDataset(spec["url"], **kw), batch_size=spec["batch"], num_workers=spec["workers"]
    )


def _mosaic(spec: dict):
    import torch

    sys.modules.setdefault("streaming.vision", NO_VISION)
    from streaming import StreamingDataset

    class Decoded(StreamingDataset):
        def __getitem__(self, i):
            return decode(super().__getitem__(i))

    kw = {"cache_limit": spec["cache_limit"], "shuffle": True, "batch_size": spec["batch"]}
    dataset = Decoded(remote=spec["url"], local=spec["local"], **kw)
    return torch.utils.data.DataLoader(dataset, batch_size=spec["batch"], num_workers=spec["workers"])


LOADERS = {"litdata": _litdata, "mosaic": _mosaic}  # for benchmarks.s3.made
