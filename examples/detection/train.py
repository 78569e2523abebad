"""Trains a small SSD object detector on a COCO-format dataset with coordl.

The data are a COCO dataset (``DIR/train``, ``DIR/val`` and
``DIR/annotations/instances_{train,val}.json``), generated with
``coordl.tools.datagen.coco.make_coco`` when ``DIR`` does not hold one: solid-colour
rectangles, one colour per category, on a noisy background. The training loader is a
CoordLoader with ``coordl.SSDTrain`` (SSD300 v1.1's augmentation: IoU-constrained random crop,
flip, colour twist; then a resize to ``--size``), the validation loader one with
``coordl.SSDVal`` (the resize only). The model is ``TinySSD`` (model.py), trained with SSD's
loss, or with ``--model torchvision`` torchvision's SSD300-VGG16.

    python examples/detection/train.py --data /tmp/coco-demo      # about 2 minutes on 2 CPU cores

Every epoch prints one line: the mean training loss, where the epoch's time went (waiting for
data vs training, and the loader's own split), the validation loss and mAP/recall at IoU 0.5.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path

import torch

import coordl
from coordl.tools.datagen.coco import make_coco

sys.path.insert(0, str(Path(__file__).resolve().parent))
from metrics import Detections  # noqa: E402 - this folder's modules
from model import SSDLoss, TinySSD, detect, torchvision_ssd  # noqa: E402

MODELS = ("tiny", "torchvision", "torchvision-ssdlite")
# What the loader normalised with (ImageNet's), undone for torchvision, which normalises itself.
MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)
GENERATED = b'"description": "synthetic rectangles by coordl.tools.datagen.coco"'  # make_coco's JSON

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--data", required=True, metavar="DIR", help="the COCO dataset; generated here if missing")
parser.add_argument("--train-split", default="train", help="DIR/<split> and DIR/annotations/instances_<split>.json")
parser.add_argument("--val-split", default="val", help="the same for validation (COCO 2017: val2017)")
parser.add_argument("--images", default=256, type=int, metavar="N", help="training images to generate (256)")
parser.add_argument("--val-images", default=64, type=int, metavar="N", help="validation images to generate (64)")
parser.add_argument("--epochs", default=12, type=int, metavar="N", help="epochs to train (12)")
parser.add_argument("-b", "--batch-size", default=16, type=int, metavar="N", help="batch size (16)")
parser.add_argument("--size", default=128, type=int, help="side of the square images the loaders deliver (128)")
parser.add_argument(
    "--model",
    choices=MODELS,
    default="tiny",
    help="tiny: model.py's TinySSD (default); torchvision: torchvision's ssd300_vgg16; torchvision-ssdlite: "
    "its ssdlite320_mobilenet_v3_large (both untrained, need torchvision)",
)
parser.add_argument("--optimizer", choices=("adam", "sgd"), default="adam", help="adam (default) or SGD with momentum")
parser.add_argument("--lr", type=float, default=None, help="peak learning rate (adam: 3e-3, sgd: 0.05); cosine decay")
parser.add_argument("--momentum", default=0.9, type=float, help="SGD's momentum (0.9)")
parser.add_argument("--wd", "--weight-decay", default=5e-4, type=float, dest="weight_decay", help="(5e-4)")
parser.add_argument("--seed", default=0, type=int, help="seed of the model's initialisation and of the data order")
parser.add_argument(
    "--cache", default="auto", help="CoordLoader's cache=: 'auto', a fraction of the dataset (0.5), a size, 0"
)
parser.add_argument("--threads", default=0, type=int, help="DALI's threads per loader (0: coordl decides)")
parser.add_argument("--cpu", action="store_true", help="train on the CPU even if a GPU is present")


def main() -> None:
    args = parser.parse_args()
    if args.model != "tiny" and importlib.util.find_spec("torchvision") is None:
        parser.error(f"--model {args.model} needs torchvision (pip install torchvision); --model tiny does not")
    torch.manual_seed(args.seed)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.cpu else "cpu")
    train_loader, val_loader, names = make_loaders(args, device)
    ids = sorted(names)
    # COCO's category ids (1, 2, 3, 7, ...) -> class indices 1..C; 0 is the background.
    to_class = torch.zeros(max(ids) + 1, dtype=torch.int64)
    to_class[torch.tensor(ids)] = torch.arange(1, len(ids) + 1)
    if args.model == "tiny":
        model = TinySSD(len(ids), size=args.size)
        criterion = SSDLoss(model.defaults).to(device)
        about = f"TinySSD, {len(model.defaults)} default boxes"
    else:
        model, criterion = torchvision_ssd(args.model, len(ids)), None
        about = f"torchvision's {type(model).__name__} ({args.model})"
    model = model.to(device)
    print(
        f"=> {about}, {sum(p.numel() for p in model.parameters()) / 1e6:.2f} M parameters, {len(ids)} classes "
        f"({', '.join(names[i] for i in ids)}); {len(train_loader.index)} training images, "
        f"{len(val_loader.index)} validation images at {args.size}x{args.size}; device: {device}",
        flush=True,
    )
    lr = args.lr or (3e-3 if args.optimizer == "adam" else 0.05)
    if args.optimizer == "adam":
        optimizer = torch.optim.Adam(model.parameters(), lr, weight_decay=args.weight_decay)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr, momentum=args.momentum, weight_decay=args.weight_decay)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs * len(train_loader))

    step = Step(args.model, model, criterion, to_class, device)
    losses, start = [], time.perf_counter()
    for epoch in range(args.epochs):
        loss, timing = train(step, train_loader, optimizer, scheduler)
        losses.append(loss[0])
        val = validate(step, val_loader, len(ids))
        print(f"epoch {epoch + 1}/{args.epochs}: {loss_line(loss)}, {timing} | {val}", flush=True)
    dropped = f"; {step.dropped} boxes of less than a pixel left out" if step.dropped else ""
    print(
        f"=> {args.epochs} epochs in {time.perf_counter() - start:.1f} s; training loss {losses[0]:.3f} -> "
        f"{losses[-1]:.3f}{dropped}",
        flush=True,
    )
    train_loader.close()
    val_loader.close()


def make_loaders(args, device: torch.device) -> tuple[coordl.CoordLoader, coordl.CoordLoader, dict[int, str]]:
    """The training and validation loaders, and the datasets' category names by id."""
    data = Path(args.data)
    train_set = dataset(data, args.train_split, args.images, seed=0)
    val_set = dataset(data, args.val_split, args.val_images, seed=1)
    cache = args.cache
    try:
        cache = float(cache) if "." in cache else int(cache)
    except ValueError:
        pass  # 'auto' or a size such as '40MB'
    common = dict(
        batch_size=args.batch_size,
        device_id=None if device.type == "cpu" else device.index or 0,
        seed=args.seed,
        cache=cache,
        prep=coordl.Prep(threads=args.threads or None),
    )
    train_index, val_index = coordl.Index.from_coco(*train_set), coordl.Index.from_coco(*val_set)
    train = coordl.CoordLoader(train_index, shuffle=True, pipeline=coordl.SSDTrain(size=args.size), **common)
    val = coordl.CoordLoader(val_index, pipeline=coordl.SSDVal(size=args.size), **common)
    return train, val, categories(train_index, val_index)


def dataset(root: Path, split: str, images: int, seed: int) -> tuple[Path, Path]:
    """``(images folder, annotations json)`` of ``split``: generated when missing, and generated
    again when a generated one has another number of images. A dataset make_coco did not make
    (COCO itself) is used as it is."""
    folder, annotations = root / split, root / "annotations" / f"instances_{split}.json"
    if annotations.exists():
        with open(annotations, "rb") as f:  # make_coco's JSON says so in its first bytes; COCO's is 450 MB
            if GENERATED not in f.read(4096):
                return folder, annotations
    before = annotations.stat().st_mtime_ns if annotations.exists() else None
    t = time.perf_counter()
    made = make_coco(root, images, seed=seed, split=split)  # returns at once when it made these already
    if Path(made.annotations).stat().st_mtime_ns != before:
        print(f"=> made {images} {split} images in {made.images} ({time.perf_counter() - t:.1f} s)", flush=True)
    return Path(made.images), Path(made.annotations)


def categories(*indexes) -> dict[int, str]:
    """Category id -> name of the datasets: those their JSON lists, else the ids their boxes have."""
    names = {}
    for index in indexes:
        names |= index.boxes.categories or {int(c): str(int(c)) for c in set(index.boxes.labels.tolist())}
    if not names:
        sys.exit("the annotations list no categories and hold no boxes: nothing to detect")
    return names


class Step:
    """One batch through the model: the training loss, or the detections and validation loss."""

    def __init__(self, kind: str, model, criterion, to_class: torch.Tensor, device: torch.device):
        self.kind, self.model, self.criterion, self.device = kind, model, criterion, device
        self.to_class = to_class.to(device)
        self.mean = torch.tensor(MEAN, device=device)[:, None, None]
        self.std = torch.tensor(STD, device=device)[:, None, None]
        self.dropped = 0  # ground-truth boxes without area: none expected from the loader

    def targets(self, targets: list[dict]) -> list[dict]:
        """The batch's boxes on the device, with class indices 1..C instead of COCO's ids."""
        out = []
        for t in targets:
            boxes, labels = t["boxes"].to(self.device).float().reshape(-1, 4), t["labels"].to(self.device).long()
            keep = (boxes[:, 2] - boxes[:, 0] >= 1) & (boxes[:, 3] - boxes[:, 1] >= 1)
            self.dropped += int((~keep).sum())
            out.append({"boxes": boxes[keep], "labels": self.to_class[labels][keep]})
        return out

    def loss(self, images: torch.Tensor, targets: list[dict]) -> tuple[torch.Tensor, float, float]:
        """``(loss, box part, class part)`` of a batch, with the model in its current mode."""
        images = images.to(self.device, non_blocking=True)
        if self.kind != "tiny":  # torchvision's SSDs normalise images of [0, 1] themselves
            parts = self.model(list(images * self.std + self.mean), targets)
            return sum(parts.values()), parts["bbox_regression"].item(), parts["classification"].item()
        scores, offsets = self.model(images)
        goal = self.criterion.targets([t["boxes"] for t in targets], [t["labels"] for t in targets])
        loss, box, cls = self.criterion(scores, offsets, *goal)
        return loss, box.item(), cls.item()

    @torch.no_grad()
    def detect(self, images: torch.Tensor, targets: list[dict]) -> tuple[list[dict], float | None]:
        """The detections of a batch (the model in eval mode) and its loss, where the model gives one."""
        images = images.to(self.device, non_blocking=True)
        if self.kind != "tiny":  # in eval mode torchvision's models return detections only
            return self.model(list(images * self.std + self.mean)), None
        scores, offsets = self.model(images)
        goal = self.criterion.targets([t["boxes"] for t in targets], [t["labels"] for t in targets])
        return detect(scores, offsets, self.model.defaults), float(self.criterion(scores, offsets, *goal)[0])


def train(step: Step, loader, optimizer, scheduler) -> tuple[tuple[float, float, float], str]:
    """One epoch: the mean ``(loss, box part, class part)`` and where the time went."""
    step.model.train()
    totals, batches, samples, waited = [0.0, 0.0, 0.0], 0, 0, 0.0
    start = end = time.perf_counter()
    for images, targets in loader:
        waited += time.perf_counter() - end
        loss, box, cls = step.loss(images, step.targets(targets))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()
        for i, v in enumerate((loss.item(), box, cls)):
            totals[i] += v
        batches, samples = batches + 1, samples + len(images)
        end = time.perf_counter()
    seconds = time.perf_counter() - start
    s = loader.stats()
    timing = (
        f"{batches} batches, {seconds:.1f} s, {samples / max(seconds, 1e-9):.1f} images/s; waited for data "
        f"{waited:.1f} s ({waited / max(seconds, 1e-9):.0%}): fetch {s['stall_fetch_s']:.1f} s, prep "
        f"{s['stall_prep_s']:.1f} s; storage {s['storage_bytes'] / 1e6:.1f} MB in {s['storage_reads']} reads, "
        f"cache hits {s['cache_hits']}"
    )
    return tuple(t / max(batches, 1) for t in totals), timing


def validate(step: Step, loader, num_classes: int) -> str:
    """The validation line: mean loss (TinySSD), mAP and recall at IoU 0.5."""
    step.model.eval()
    found, losses = Detections(num_classes), []
    for images, targets in loader:
        truths = step.targets(targets)
        detections, loss = step.detect(images, truths)
        found.add(detections, truths)
        if loss is not None:
            losses.append(loss)
    s = found.summary()
    loss = f"loss {sum(losses) / len(losses):.3f}, " if losses else ""
    return (
        f"val {loss}mAP@0.5 {s['map50']:.3f}, recall@0.5 {s['recall50']:.3f} ({s['images']} images, {s['boxes']} boxes)"
    )


def loss_line(loss: tuple[float, float, float]) -> str:
    return f"train loss {loss[0]:.3f} (box {loss[1]:.3f}, class {loss[2]:.3f})"


if __name__ == "__main__":
    main()
