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
    ``benchmarks.loaders.dataloader`` over ``PillowImageFolder`` with ``TrainAugment`` (Pillow decode),
    ``pin_memory``, persistent workers; each batch copied to the GPU with ``non_blocking=True``.

With ``device=None`` (``--cpu-smoke``) the same classes run with DALI on the CPU (``device_id=None``, CPU ops)
and nothing is copied. :class:`TrainStep` is one ResNet-50 training step: bf16 autocast, channels_last, SGD.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from benchmarks.loaders import MEAN, SIZE, STD, dali_iterator

LOADERS = ("coordl", "dali", "coordl-cpu", "torch")
MODELS = Path(__file__).resolve().parents[1] / "examples" / "imagenet" / "models.py"


def missing(name: str) -> str | None:
    """Why loader ``name`` cannot run here, or None: ``torch`` needs Pillow (the GPU machine may lack it)."""
    if name == "torch" and importlib.util.find_spec("PIL") is None:
        return "Pillow is not installed: the DataLoader baseline decodes with it (scripts/gpu_extras.sh fetches it)"
    return None


class Loader:
    """Loader ``name`` (one of :data:`LOADERS`) over the folder ``root``, batches delivered to GPU ``device_id``
    (None: all on the CPU): ``n``, ``epoch(k)`` (``(images, labels)``), ``stats()`` (coordl's) and ``close()``."""

    def __init__(self, name: str, root: str, batch_size: int, threads: int, device_id: int | None, seed: int = 1):
        """``seed``: DALI's pipeline's (the DataLoader's generator is seeded 0)."""
        self.name, self.device_id, gpu = name, device_id, device_id is not None
        if name in ("coordl", "coordl-cpu"):  # coordl-cpu: DALI on the CPU, batches copied to the GPU
            import coordl

            decode_on = device_id if name == "coordl" else None
            kw = {"pipeline": "imagenet-train", "device_id": decode_on, "prep": threads}
            self.loader = coordl.CoordLoader(root, batch_size=batch_size, shuffle=True, **kw)
            self.n = len(self.loader.index)
        elif name == "dali":
            from nvidia.dali import fn, pipeline_def, types

            @pipeline_def(batch_size=batch_size, num_threads=threads, device_id=device_id, seed=seed)
            def pipe():
                jpegs, labels = fn.readers.file(file_root=root, random_shuffle=True, name="Reader")
                images = fn.decoders.image(jpegs, device="mixed" if gpu else "cpu", output_type=types.RGB)
                area, aspect = [0.08, 1.0], [3 / 4, 4 / 3]
                images = fn.random_resized_crop(images, size=[SIZE, SIZE], random_area=area, random_aspect_ratio=aspect)
                mean, std, mirror = (
                    [m * 255 for m in MEAN],
                    [s * 255 for s in STD],
                    fn.random.coin_flip(probability=0.5),
                )
                kw = {"dtype": types.FLOAT, "output_layout": "CHW", "mirror": mirror, "mean": mean, "std": std}
                return fn.crop_mirror_normalize(images, **kw), labels.gpu() if gpu else labels

            self.loader = dali_iterator(p := pipe())
            self.n = p.reader_meta("Reader")["epoch_size"]
        elif name == "torch":
            from benchmarks.loaders import PillowImageFolder, TrainAugment, dataloader

            self.n = len(dataset := PillowImageFolder(root, TrainAugment()))
            self.loader = dataloader(dataset, batch_size, threads, 0, pin_memory=gpu)
        else:
            raise ValueError(f"unknown loader {name!r}; choose from {', '.join(LOADERS)}")
        if name.startswith("coordl"):
            self.stats = self._stats

    def epoch(self, epoch: int):
        if self.name == "dali":
            yield from ((out["images"], out["labels"].flatten().long()) for (out,) in self.loader)
            return
        if self.name != "torch":
            self.loader.set_epoch(epoch)
        for images, labels in self.loader:
            yield _to(self.device_id, images, labels, non_blocking=self.name == "torch")

    def _stats(self) -> dict:
        s = self.loader.stats()
        keys = ("stall_s", "elapsed_s", "samples", "cache_hits", "storage_reads", "cache_items", "cache_budget")
        return {k: s.get(k) for k in keys}

    def close(self) -> None:
        if self.name.startswith("coordl"):
            self.loader.close()
        del self.loader


def _to(device_id: int | None, *tensors, non_blocking: bool = False) -> tuple:
    """``tensors`` on GPU ``device_id`` (None: left where they are); coordl's labels stay on the CPU even
    when its images come from the GPU."""
    if device_id is None:
        return tensors
    device = f"cuda:{device_id}"
    return tuple(t if t.is_cuda else t.to(device, non_blocking=non_blocking) for t in tensors)


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
