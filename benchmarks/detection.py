"""Object detection on the CPU: coordl's SSDTrain against DALI's COCO pipeline and a DataLoader; an HP group.

As :mod:`benchmarks.harness.compare` runs it, each loader doing SSD300 v1.1's training augmentation. ``prep``
(prep-bound, data in memory): ``coordl`` (``SSDTrain(size=300)``), ``dali`` (:class:`DaliCoco`, NVIDIA's SSD300
pipeline), ``dali-1`` (``num_attempts=1``, not by default), ``torch`` (``CocoDetection`` + :class:`PythonSSD`);
``hp``: two coordl trials in an HP group vs apart; the Python of a coordl batch outside DALI. docs/detection.md.

    python -m benchmarks detection                 # 1500 images, 3 reps: about 11 minutes on 2 cores
    python -m benchmarks detection --smoke --data /tmp/coco-smoke --out /tmp/detection.json
"""

import functools
import statistics
import time

import numpy as np

import coordl
from benchmarks.harness import cli, compare, dataset
from benchmarks.loaders import MEAN, STD, dataloader

SIZE, QUALITY = 300, 90  # SSD300's input side; the generated JPEGs' quality
DATA = "/var/tmp/coordl-bench/coco"
THRESHOLDS = (0.1, 0.3, 0.5, 0.7, 0.9)


def options(p) -> None:
    g = compare.add_options(p, LOADERS, ("coordl", "dali", "torch"), "prep,hp", f"dataset root (default: {DATA})")
    g.add_argument("--images", type=int, help="JPEGs to generate (default: 1500; 40 with --smoke)")
    dataset.add_source_options(g)
    g.add_argument("--width", type=int, help="mean image width, +-12.5%% (default: 640; 320 with --smoke)")
    g.add_argument("--height", type=int, help="mean image height, +-12.5%% (default: 480; 240 with --smoke)")


def run(args) -> dict | None:
    cli.defaults(args, args.smoke, data=(DATA, DATA), images=(1500, 40), width=(640, 320), height=(480, 240))
    result = compare.run(args, coco, LOADERS, {"touch": lambda data: compare.touch}, {"hp": "touch"}, "bench-detect")
    return result and {**result, "python_per_batch": python_per_batch(args, result["dataset"])}


def table(results: dict) -> str:
    pb = results["python_per_batch"]
    head = f"coordl's Python per batch of {pb['batch']}: plan {pb['plan_ms']:.2f} ms, targets {pb['targets_ms']:.2f} ms"
    return head + "\n" + compare.table(results)


def coco(args) -> dict:
    """Generates (or finds) the dataset (each side +-12.5%, 1-8 boxes an image); returns its figures."""
    from coordl.tools.datagen.coco import make_coco

    photos, (w, h) = dataset.photos_of(args), (args.width, args.height)
    kw = {"width": (w - w // 8, w + w // 8), "height": (h - h // 8, h + h // 8), "boxes": (1, 8), "quality": QUALITY}
    s = make_coco(args.data, args.images, seed=args.dataset_seed, photos_dir=photos, **kw)
    truths = list(s.truths.values())
    n, pixels = len(truths), sum(t.width * t.height for t in truths)
    out = {"root": s.root, "images": s.images, "annotations": s.annotations, "files": n, "total_bytes": s.total_bytes}
    out |= {"mean_bytes": round(s.total_bytes / n), "bytes_per_pixel": round(s.total_bytes / pixels, 3)}
    out |= {"boxes": sum(len(t.boxes) for t in truths), "empty_images": sum(not t.boxes for t in truths)}
    return out | {"jpeg_quality": QUALITY, "source": "photographs" if photos else "generated"}


def torch_loader(args, data):
    """``CocoDetection`` with :class:`PythonSSD` in a ``DataLoader``."""
    coco = coordl.datasets.CocoDetection(data["images"], data["annotations"], transforms=PythonSSD())
    return dataloader(coco, args.batch_size, args.threads, 0, collate_fn=lambda b: tuple(zip(*b)))


def python_per_batch(args, data: dict) -> dict:
    """Milliseconds of Python per coordl batch outside DALI, medians of 50 epochs: ``crops.plan`` and
    ``targets.targets`` (the batch's targets from its plan's boxes, as ``SSDTrain.targets`` makes them)."""
    from coordl.detection import crops, targets

    index = coordl.Index.from_coco(data["images"], data["annotations"])
    recipe, b = coordl.SSDTrain(size=SIZE), min(args.batch_size, len(index))
    ids = np.random.default_rng(0).permutation(len(index))[:b]
    image_ids, times = index.boxes.image_ids[ids].tolist(), []
    for epoch in range(50):
        t0 = time.perf_counter()
        plan = crops.plan(recipe, index.boxes, 0, epoch, ids)
        t1 = time.perf_counter()
        targets.targets(plan.xyxy, plan.labels, plan.counts, image_ids)
        times.append((t1 - t0, time.perf_counter() - t1))
    plan_s, targets_s = zip(*times)
    return {"batch": b, "plan_ms": 1000 * statistics.median(plan_s), "targets_ms": 1000 * statistics.median(targets_s)}


class PythonSSD(compare.ForkedRng):
    """SSD300 v1.1's training augmentation in Pillow and numpy, in SSDTrain's order: ``transforms(image, target)``.

    The crop is the reference's ``SSDCropping`` (:meth:`window`); boxes whose centre is in the window are kept,
    clipped, moved and scaled; then a bilinear resize to ``size``, a flip of pixels and boxes with probability
    0.5, hue and saturation in HSV, brightness and contrast around 128 back to uint8, normalise, CHW float32.
    """

    mean, inv_std = np.array(MEAN, dtype=np.float32) * 255, 1 / (np.array(STD, dtype=np.float32) * 255)

    def window(self, rng, boxes: np.ndarray, width: int, height: int) -> tuple[int, int, int, int]:
        """The crop window ``x0, y0, x1, y1`` in whole pixels (the whole image: no crop): a try picks "no crop", a
        minimum IoU or "any window"; a window of 0.3-1.0 of each side with ``w / h`` in [0.5, 2] placed uniformly is
        taken when every box overlaps it by more than the minimum and a box's centre is inside; else the image."""
        options = (None, *THRESHOLDS, -np.inf)
        if len(boxes):
            area = (boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1])
            cx, cy = (boxes[:, 0] + boxes[:, 2]) / 2, (boxes[:, 1] + boxes[:, 3]) / 2
            for _ in range(50):  # tries
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

        rng, size, (width, height) = self.rng(), SIZE, image.size
        boxes = target["boxes"].numpy().astype(np.float64).reshape(-1, 4)
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
        pixels -= self.mean
        pixels *= self.inv_std
        chw = torch.from_numpy(np.ascontiguousarray(pixels.transpose(2, 0, 1)))
        out = {"boxes": torch.from_numpy(boxes.astype(np.float32)), "labels": target["labels"][torch.from_numpy(keep)]}
        return chw, {**out, "image_id": target["image_id"]}


class DaliCoco:
    """NVIDIA's SSD300 COCO pipeline on DALI's CPU (``device_id=None``) over the dataset ``data``; iterate for one
    epoch of ``(images, targets)``, ``targets`` as coordl's (boxes in pixels of the output)."""

    def __init__(self, args, data: dict, attempts: int = 50):
        from nvidia.dali import fn, pipeline_def, types
        from nvidia.dali.plugin.pytorch import DALIRaggedIterator, LastBatchPolicy

        @pipeline_def(batch_size=args.batch_size, num_threads=args.threads, device_id=None, seed=1)  # queue depth 2
        def pipe():
            # avoid_class_remapping: COCO's category ids, as coordl's labels
            kw = {"ratio": True, "ltrb": True, "random_shuffle": True, "skip_empty": False, "image_ids": True}
            kw |= {"avoid_class_remapping": True, "file_root": data["images"], "annotations_file": data["annotations"]}
            jpegs, bboxes, labels, ids = fn.readers.coco(name="Reader", **kw)
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


LOADERS = {  # each child's loader (``--job``), from the options and the dataset's figures
    "coordl": lambda args, data: compare.coordl_loader(
        coordl.Index.from_coco(data["images"], data["annotations"]), coordl.SSDTrain(size=SIZE), args
    ),
    "dali": DaliCoco,
    "dali-1": functools.partial(DaliCoco, attempts=1),
    "torch": torch_loader,
}
