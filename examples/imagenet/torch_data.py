"""The ``--loader torch`` side of the example: PyTorch's own data pipeline, for comparison.

With torchvision installed this is exactly PyTorch's ImageNet example: ``ImageFolder`` with
``RandomResizedCrop, RandomHorizontalFlip, ToTensor, Normalize`` for training and
``Resize, CenterCrop, ToTensor, Normalize`` for validation. Without torchvision (its wheels
on PyPI are CUDA builds that do not import against a CPU torch), the same transforms are
written here with Pillow and numpy, so the comparison runs anywhere.
"""

from __future__ import annotations

import math
import os
import random

import numpy as np
import torch
from PIL import Image

MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)
IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


def datasets(traindir: str, valdir: str, size: int, resize: int):
    """``(train_set, val_set)`` with the standard ImageNet transforms."""
    try:
        import torchvision.datasets as tvd
        import torchvision.transforms as T
    except Exception:  # noqa: BLE001 - not installed, or a CUDA build on a CPU torch
        return (ImageFolder(traindir, TrainTransform(size)), ImageFolder(valdir, ValTransform(size, resize)))
    norm = T.Normalize(MEAN, STD)
    train = tvd.ImageFolder(
        traindir, T.Compose([T.RandomResizedCrop(size), T.RandomHorizontalFlip(), T.ToTensor(), norm])
    )
    val = tvd.ImageFolder(valdir, T.Compose([T.Resize(resize), T.CenterCrop(size), T.ToTensor(), norm]))
    return train, val


class ImageFolder(torch.utils.data.Dataset):
    """``root/<class>/<file>``, classes sorted, like ``torchvision.datasets.ImageFolder``."""

    def __init__(self, root: str, transform):
        self.classes = sorted(e.name for e in os.scandir(root) if e.is_dir())
        if not self.classes:
            raise FileNotFoundError(f"no class folders in {root}")
        self.samples = []
        for label, name in enumerate(self.classes):
            for dirpath, _, files in sorted(os.walk(os.path.join(root, name), followlinks=True)):
                self.samples += [
                    (os.path.join(dirpath, f), label) for f in sorted(files) if f.lower().endswith(IMG_EXTENSIONS)
                ]
        self.transform = transform

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int):
        path, label = self.samples[i]
        with open(path, "rb") as f:
            image = Image.open(f).convert("RGB")
        return self.transform(image), label


def _to_tensor(image: Image.Image) -> torch.Tensor:
    a = torch.from_numpy(np.asarray(image, dtype=np.float32) / 255.0).permute(2, 0, 1)
    return (a - torch.tensor(MEAN).view(3, 1, 1)) / torch.tensor(STD).view(3, 1, 1)


class TrainTransform:
    """RandomResizedCrop(size, scale=(0.08, 1), ratio=(3/4, 4/3)), flip with p=0.5, normalise."""

    def __init__(self, size: int):
        self.size = size

    def __call__(self, image: Image.Image) -> torch.Tensor:
        w, h = image.size
        box = (0, 0, w, h)
        for _ in range(10):  # torchvision's rule: 10 tries, then a center crop of clamped aspect
            area = w * h * random.uniform(0.08, 1.0)
            aspect = math.exp(random.uniform(math.log(3 / 4), math.log(4 / 3)))
            cw, ch = round(math.sqrt(area * aspect)), round(math.sqrt(area / aspect))
            if 0 < cw <= w and 0 < ch <= h:
                x, y = random.randint(0, w - cw), random.randint(0, h - ch)
                box = (x, y, x + cw, y + ch)
                break
        else:
            cw = min(w, round(h * 4 / 3)) if w / h > 4 / 3 else w
            ch = min(h, round(w * 4 / 3)) if h / w > 4 / 3 else h
            x, y = (w - cw) // 2, (h - ch) // 2
            box = (x, y, x + cw, y + ch)
        image = image.resize((self.size, self.size), Image.BILINEAR, box=box)
        if random.random() < 0.5:
            image = image.transpose(Image.FLIP_LEFT_RIGHT)
        return _to_tensor(image)


class ValTransform:
    """Resize the shorter side to ``resize``, center-crop ``size``, normalise."""

    def __init__(self, size: int, resize: int):
        self.size, self.resize = size, resize

    def __call__(self, image: Image.Image) -> torch.Tensor:
        w, h = image.size
        s = self.resize / min(w, h)
        image = image.resize((max(self.size, round(w * s)), max(self.size, round(h * s))), Image.BILINEAR)
        w, h = image.size
        x, y = (w - self.size) // 2, (h - self.size) // 2
        return _to_tensor(image.crop((x, y, x + self.size, y + self.size)))
