"""The three detection loaders :mod:`benchmarks.detection` compares, each doing SSD300 v1.1's
training augmentation with the same batch size and CPU threads, and yielding ``(images, targets)``.

``coordl``
    ``coordl.CoordLoader`` with ``coordl.SSDTrain(size=300)``, its node's cache holding the dataset.
``dali``
    DALI's own COCO pipeline, as NVIDIA's SSD300 reference builds it (DeepLearningExamples,
    ``PyTorch/Detection/SSD/ssd/coco_pipeline.py``): ``fn.readers.coco`` (buffer shuffle),
    ``fn.random_bbox_crop``, ``fn.decoders.image_slice``, ``fn.bb_flip``, ``fn.resize``, ``fn.hsv``,
    ``fn.brightness_contrast``, ``fn.crop_mirror_normalize``; boxes and labels as ragged outputs
    (``DALIRaggedIterator``), turned into the same targets as coordl's (pixels of the output, int64
    labels). Without the reference's anchor encoding (``fn.box_encoder``), which coordl does not do.
``dali-1``
    ``dali`` with ``num_attempts=1``. DALI tries ``num_attempts`` windows for each minimum IoU it draws
    before drawing again, so at 50 it crops more often (smaller windows, less to decode) than the
    PyTorch reference's ``SSDCropping``, which draws the option again for every window, as coordl's
    SSDTrain does; at 1 DALI draws as they do (not in the default set).
``torch``
    ``torch.utils.data.DataLoader`` over ``coordl.datasets.CocoDetection`` (Pillow decode) with
    :class:`PythonSSD`, the same augmentation in Pillow and numpy, and the collate of torchvision's
    detection references (``tuple(zip(*batch))``); persistent workers.
"""

from __future__ import annotations

import os

import numpy as np

SIZE = 300
MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)
THRESHOLDS = (0.1, 0.3, 0.5, 0.7, 0.9)


class PythonSSD:
    """SSD300 v1.1's training augmentation in Pillow and numpy: ``transforms(image, target)``.

    The crop is the reference's ``SSDCropping``: a try picks "no crop", a minimum IoU or "any
    window" uniformly; a window of 0.3-1.0 of each side with ``w / h`` in [0.5, 2] is placed
    uniformly and taken when every box overlaps it by more than the minimum and a box's centre lies
    inside it; after ``tries`` tries the whole image. Boxes whose centre is in the window are kept,
    clipped, moved and scaled. Then a resize to ``size`` (bilinear), a horizontal flip of pixels and
    boxes with probability 0.5, hue (degrees) and saturation in HSV (one round trip), brightness and
    contrast around 128 back to the uint8 range, normalise, CHW float32: coordl's SSDTrain's order.
    """

    def __init__(self, size: int = SIZE, tries: int = 50, seed: int = 0):
        self.size, self.tries, self.seed = size, tries, seed
        self._rng, self._pid = None, None
        self._mean = np.array(MEAN, dtype=np.float32) * 255
        self._inv_std = 1 / (np.array(STD, dtype=np.float32) * 255)

    def rng(self) -> np.random.Generator:
        if self._pid != os.getpid():  # a forked worker draws its own stream, not its parent's copy
            self._rng, self._pid = np.random.default_rng([self.seed, os.getpid()]), os.getpid()
        return self._rng

    def window(self, rng, boxes: np.ndarray, width: int, height: int) -> tuple[int, int, int, int]:
        """The crop window ``x0, y0, x1, y1`` in whole pixels (the whole image: no crop)."""
        options = (None, *THRESHOLDS, -np.inf)
        if len(boxes):
            area = (boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1])
            cx, cy = (boxes[:, 0] + boxes[:, 2]) / 2, (boxes[:, 1] + boxes[:, 3]) / 2
            for _ in range(self.tries):
                minimum = options[rng.integers(len(options))]
                if minimum is None:
                    break
                w, h = rng.uniform(0.3, 1.0), rng.uniform(0.3, 1.0)
                left, top = rng.uniform(0, 1 - w), rng.uniform(0, 1 - h)
                if not 0.5 <= w / h <= 2:
                    continue
                x0, y0 = int(left * width), int(top * height)
                x1, y1 = int((left + w) * width), int((top + h) * height)
                iw = np.clip(np.minimum(boxes[:, 2], x1) - np.maximum(boxes[:, 0], x0), 0, None)
                ih = np.clip(np.minimum(boxes[:, 3], y1) - np.maximum(boxes[:, 1], y0), 0, None)
                inter = iw * ih
                iou = inter / (area + (x1 - x0) * (y1 - y0) - inter)
                inside = (cx > x0) & (cx < x1) & (cy > y0) & (cy < y1)
                if x1 > x0 and y1 > y0 and (iou > minimum).all() and inside.any():
                    return x0, y0, x1, y1
        return 0, 0, width, height

    def __call__(self, image, target):
        import torch
        from PIL import Image

        rng, size = self.rng(), self.size
        boxes = target["boxes"].numpy().astype(np.float64).reshape(-1, 4)
        labels = target["labels"]
        width, height = image.size
        x0, y0, x1, y1 = self.window(rng, boxes, width, height)
        if (x0, y0, x1, y1) != (0, 0, width, height):
            image = image.crop((x0, y0, x1, y1))
        cx, cy = (boxes[:, 0] + boxes[:, 2]) / 2, (boxes[:, 1] + boxes[:, 3]) / 2
        keep = (cx > x0) & (cx < x1) & (cy > y0) & (cy < y1)
        boxes = boxes[keep]
        boxes[:, [0, 2]] = (np.clip(boxes[:, [0, 2]], x0, x1) - x0) * (size / (x1 - x0))
        boxes[:, [1, 3]] = (np.clip(boxes[:, [1, 3]], y0, y1) - y0) * (size / (y1 - y0))
        image = image.resize((size, size), Image.BILINEAR)
        if rng.random() < 0.5:
            image = image.transpose(Image.FLIP_LEFT_RIGHT)
            boxes[:, [0, 2]] = size - boxes[:, [2, 0]]
        brightness, contrast, saturation = rng.uniform(0.875, 1.125), rng.uniform(0.5, 1.5), rng.uniform(0.5, 1.5)
        hue = rng.uniform(-18.0, 18.0)
        hsv = np.array(image.convert("HSV"))  # torchvision's adjust_hue for PIL images, with saturation too
        hsv[..., 0] += np.uint8(round(hue / 360 * 255) % 256)  # wraps around, as hue does
        hsv[..., 1] = np.clip(hsv[..., 1] * saturation, 0, 255).astype(np.uint8)
        pixels = np.asarray(Image.fromarray(hsv, "HSV").convert("RGB"), dtype=np.float32)
        pixels *= brightness * contrast  # brightness * (128 + contrast * (x - 128)), to uint8 as DALI does
        pixels += brightness * 128 * (1 - contrast)
        np.clip(pixels, 0, 255, out=pixels)
        np.rint(pixels, out=pixels)
        pixels -= self._mean
        pixels *= self._inv_std
        chw = torch.from_numpy(np.ascontiguousarray(pixels.transpose(2, 0, 1)))
        out = {"boxes": torch.from_numpy(boxes.astype(np.float32)), "labels": labels[torch.from_numpy(keep)]}
        return chw, {**out, "image_id": target["image_id"]}


def collate(batch):
    """torchvision's detection references' collate: a tuple of images and a tuple of targets."""
    return tuple(zip(*batch))


def torch_loader(images: str, annotations: str, batch_size: int, workers: int, seed: int = 0):
    """``DataLoader(CocoDetection(transforms=PythonSSD()))``, shuffled, persistent workers."""
    import coordl
    from benchmarks.loaders import dataloader

    data = coordl.datasets.CocoDetection(images, annotations, transforms=PythonSSD(seed=seed))
    return dataloader(data, batch_size, workers, seed, collate_fn=collate)


class DaliCoco:
    """NVIDIA's SSD300 COCO pipeline on DALI's CPU (``device_id=None``); iterate for one epoch of
    ``(images, targets)``, ``targets`` as coordl's (boxes in pixels of the output)."""

    def __init__(self, images: str, annotations: str, batch_size: int, threads: int, seed: int = 1, attempts: int = 50):
        from nvidia.dali import fn, pipeline_def, types
        from nvidia.dali.plugin.pytorch import DALIRaggedIterator, LastBatchPolicy

        @pipeline_def(batch_size=batch_size, num_threads=threads, device_id=None, seed=seed, prefetch_queue_depth=2)
        def pipe():
            # avoid_class_remapping: COCO's category ids, as coordl's labels
            kw = {"ratio": True, "ltrb": True, "random_shuffle": True, "skip_empty": False, "image_ids": True}
            kw |= {"avoid_class_remapping": True}
            jpegs, bboxes, labels, ids = fn.readers.coco(
                name="Reader", file_root=images, annotations_file=annotations, **kw
            )
            kw = {"aspect_ratio": [0.5, 2.0], "thresholds": [0, *THRESHOLDS], "scaling": [0.3, 1.0]}
            kw |= {"bbox_layout": "xyXY", "allow_no_crop": True, "num_attempts": attempts}
            begin, size, bboxes, labels = fn.random_bbox_crop(bboxes, labels, **kw)
            pixels = fn.decoders.image_slice(jpegs, begin, size, output_type=types.RGB)
            flip = fn.random.coin_flip(probability=0.5)
            bboxes = fn.bb_flip(bboxes, ltrb=True, horizontal=flip)
            pixels = fn.resize(pixels, resize_x=SIZE, resize_y=SIZE)
            hue, saturation = fn.random.uniform(range=[-18.0, 18.0]), fn.random.uniform(range=[0.5, 1.5])
            pixels = fn.hsv(pixels, dtype=types.FLOAT, hue=hue, saturation=saturation)
            brightness, contrast = fn.random.uniform(range=[0.875, 1.125]), fn.random.uniform(range=[0.5, 1.5])
            kw = {"contrast_center": 128, "dtype": types.UINT8, "brightness": brightness, "contrast": contrast}
            pixels = fn.brightness_contrast(pixels, **kw)
            mean, std = [m * 255 for m in MEAN], [s * 255 for s in STD]
            kw = {"mean": mean, "std": std, "mirror": flip, "dtype": types.FLOAT, "output_layout": "CHW"}
            pixels = fn.crop_mirror_normalize(pixels, **kw)
            return pixels, bboxes * float(SIZE), labels, ids

        (p := pipe()).build()
        dense, ragged = DALIRaggedIterator.DENSE_TAG, DALIRaggedIterator.SPARSE_LIST_TAG
        kw = {"reader_name": "Reader", "output_types": [dense, ragged, ragged, dense]}
        kw |= {"last_batch_policy": LastBatchPolicy.PARTIAL, "auto_reset": True}
        self.it = DALIRaggedIterator(p, ["images", "boxes", "labels", "ids"], **kw)

    def __iter__(self):
        for (out,) in self.it:
            ids = out["ids"].flatten().tolist()
            targets = zip(out["boxes"], out["labels"], ids, strict=True)
            yield out["images"], [{"boxes": b, "labels": c.long(), "image_id": i} for b, c, i in targets]


def coordl_loader(index, batch_size: int, threads: int, group: str | None = None, seed: int = 0):
    """``CoordLoader(SSDTrain(size=300))`` over ``index``, its cache the whole dataset (filled by the
    first epoch), in the HP group ``group`` when given."""
    import coordl

    kw = {"pipeline": coordl.SSDTrain(size=SIZE), "device_id": None, "cache": coordl.Cache(size=1.0), "seed": seed}
    kw |= {"prep": coordl.Prep(threads=threads), **({"hp_group": group} if group else {})}
    return coordl.CoordLoader(index, batch_size=batch_size, shuffle=True, **kw)
