"""The four loaders and the training step :mod:`benchmarks.gpu` measures, on a GPU or (``device=None``) on the CPU.

Every loader runs the ImageNet training augmentation (random-resized crop to 224, scale 0.08-1, aspect
3/4-4/3, horizontal flip, normalise, CHW float32) and yields ``(images, labels)`` already on the training
device, one epoch per iteration:

``coordl``
    ``CoordLoader(root, pipeline="imagenet-train", device_id=0)``: DALI decodes on the GPU (``mixed``);
    its node's cache at its default size.
``dali``
    DALI's own pipeline: ``fn.readers.file(random_shuffle=True)``, ``fn.decoders.image(device="mixed")``,
    ``fn.random_resized_crop``, ``fn.crop_mirror_normalize`` with a coin-flip mirror, ``DALIGenericIterator``.
``coordl-cpu``
    ``CoordLoader(..., device_id=None)``: DALI on the CPU; each batch is then copied to the GPU.
``torch``
    ``DataLoader`` over :class:`benchmarks.loaders.PillowImageFolder` with
    :class:`~benchmarks.loaders.TrainAugment` (Pillow decode), ``pin_memory``, persistent workers; each batch
    copied to the GPU with ``non_blocking=True``.

With ``device=None`` (``--cpu-smoke``) the same classes run with DALI on the CPU (``device_id=None``, CPU ops)
and nothing is copied. :class:`TrainStep` is one ResNet-50 training step: bf16 autocast, channels_last, SGD.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from benchmarks.loaders import MEAN, SIZE, STD

LOADERS = ("coordl", "dali", "coordl-cpu", "torch")
MODELS = Path(__file__).resolve().parents[1] / "examples" / "imagenet" / "models.py"


def missing(name: str) -> str | None:
    """Why loader ``name`` cannot run here, or None: ``torch`` needs Pillow (the GPU machine may lack it)."""
    if name == "torch" and importlib.util.find_spec("PIL") is None:
        return "Pillow is not installed: the DataLoader baseline decodes with it (scripts/gpu_extras.sh fetches it)"
    return None


def make(name: str, root: str, batch_size: int, threads: int, device_id: int | None):
    """Loader ``name`` (one of :data:`LOADERS`) over the folder ``root``; ``device_id`` None: all on the CPU."""
    if name in ("coordl", "coordl-cpu"):
        gpu = device_id if name == "coordl" else None
        return CoordlLoader(root, batch_size, threads, gpu, device_id)
    if name == "dali":
        return DaliLoader(root, batch_size, threads, device_id)
    if name == "torch":
        return TorchLoader(root, batch_size, threads, device_id)
    raise ValueError(f"unknown loader {name!r}; choose from {', '.join(LOADERS)}")


def _to(device_id: int | None, *tensors, non_blocking: bool = False) -> tuple:
    """``tensors`` on GPU ``device_id`` (None: left where they are); coordl's labels stay on the CPU even
    when its images come from the GPU."""
    if device_id is None:
        return tensors
    device = f"cuda:{device_id}"
    return tuple(t if t.is_cuda else t.to(device, non_blocking=non_blocking) for t in tensors)


class CoordlLoader:
    """``CoordLoader`` decoding on ``decode_on`` (a GPU, or None: the CPU); batches delivered to ``device_id``."""

    def __init__(self, root: str, batch_size: int, threads: int, decode_on: int | None, device_id: int | None):
        import coordl

        self.device_id = device_id
        self.loader = coordl.CoordLoader(
            root,
            batch_size=batch_size,
            shuffle=True,
            pipeline="imagenet-train",
            device_id=decode_on,
            prep=threads,
        )
        self.n = len(self.loader.index)

    def epoch(self, epoch: int):
        self.loader.set_epoch(epoch)
        for images, labels in self.loader:
            yield _to(self.device_id, images, labels)

    def stats(self) -> dict:
        s = self.loader.stats()
        keys = ("stall_s", "elapsed_s", "samples", "cache_hits", "storage_reads", "cache_items", "cache_budget")
        return {k: s.get(k) for k in keys}

    def close(self) -> None:
        self.loader.close()


class DaliLoader:
    """DALI's own training pipeline, decoding with ``mixed`` on GPU ``device_id`` (None: all on the CPU)."""

    def __init__(self, root: str, batch_size: int, threads: int, device_id: int | None, seed: int = 1):
        from nvidia.dali import fn, pipeline_def, types
        from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy

        gpu = device_id is not None

        @pipeline_def(batch_size=batch_size, num_threads=threads, device_id=device_id, seed=seed)
        def pipe():
            jpegs, labels = fn.readers.file(file_root=root, random_shuffle=True, name="Reader")
            images = fn.decoders.image(jpegs, device="mixed" if gpu else "cpu", output_type=types.RGB)
            images = fn.random_resized_crop(
                images, size=[SIZE, SIZE], random_area=[0.08, 1.0], random_aspect_ratio=[3 / 4, 4 / 3]
            )
            images = fn.crop_mirror_normalize(
                images,
                dtype=types.FLOAT,
                output_layout="CHW",
                mirror=fn.random.coin_flip(probability=0.5),
                mean=[m * 255 for m in MEAN],
                std=[s * 255 for s in STD],
            )
            return images, labels.gpu() if gpu else labels

        p = pipe()
        p.build()
        self.n = p.reader_meta("Reader")["epoch_size"]
        self.it = DALIGenericIterator(
            p, ["images", "labels"], reader_name="Reader", last_batch_policy=LastBatchPolicy.PARTIAL, auto_reset=True
        )

    def epoch(self, epoch: int):
        for (out,) in self.it:
            yield out["images"], out["labels"].flatten().long()

    def close(self) -> None:
        del self.it


class TorchLoader:
    """``DataLoader`` with ``workers`` Pillow workers, pinned batches copied to GPU ``device_id`` (None: stay)."""

    def __init__(self, root: str, batch_size: int, workers: int, device_id: int | None, seed: int = 0):
        import torch

        from benchmarks.loaders import PillowImageFolder, TrainAugment

        self.device_id = device_id
        dataset = PillowImageFolder(root, TrainAugment())
        self.n = len(dataset)
        self.loader = torch.utils.data.DataLoader(
            dataset,
            batch_size=batch_size,
            shuffle=True,
            num_workers=workers,
            pin_memory=device_id is not None,
            persistent_workers=workers > 0,
            generator=torch.Generator().manual_seed(seed),
        )

    def epoch(self, epoch: int):
        for images, labels in self.loader:
            yield _to(self.device_id, images, labels, non_blocking=True)

    def close(self) -> None:
        del self.loader


def resnet(arch: str, classes: int):
    """``examples/imagenet/models.py``'s ``create``: torchvision's model when it imports, else the same
    layer plan in plain torch. Returns ``(model, where it came from)``."""
    spec = importlib.util.spec_from_file_location("coordl_example_models", MODELS)
    models = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(models)
    return models.create(arch, classes)


class TrainStep:
    """One training step of ``arch`` per batch: forward and loss under bf16 autocast, channels_last
    activations, backward, SGD with momentum; on GPU ``device_id`` or (None) the CPU."""

    def __init__(self, arch: str, classes: int, device_id: int | None, seed: int = 0):
        import torch

        torch.manual_seed(seed)
        self.device = torch.device("cpu" if device_id is None else f"cuda:{device_id}")
        model, self.origin = resnet(arch, classes)
        self.model = model.to(self.device, memory_format=torch.channels_last).train()
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
        self.loss = torch.nn.CrossEntropyLoss()
        self.params = sum(p.numel() for p in self.model.parameters())

    def __call__(self, images, labels) -> None:
        import torch

        images = images.contiguous(memory_format=torch.channels_last)
        with torch.autocast(self.device.type, dtype=torch.bfloat16):
            loss = self.loss(self.model(images), labels)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()  # no .item(): the loop does not wait for the GPU between steps
