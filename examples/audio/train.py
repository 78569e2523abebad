"""Trains M5 (a 1-D CNN on raw waveforms) to tell tones apart, with coordl's audio loaders.

The data are two class-per-folder trees of audio clips, ``DIR/train/<class>/...`` and
``DIR/val/<class>/...``, generated with ``coordl.tools.datagen.tones.make_tones`` when ``DIR``
holds none: each class a sine tone of its own frequency, in noise, at mixed sample rates (16 to
44.1 kHz), mono and stereo, 1 to 6 s long, as WAV, FLAC and Ogg Vorbis files. The training
loader is a CoordLoader with ``coordl.AudioTrain`` (decode, downmix to mono, resample to
``--sample-rate``, a random window of ``--samples``), the validation loader one with
``coordl.AudioVal`` (the centre window). The model is ``M5`` (model.py), trained with Adam.

    python examples/audio/train.py --data /tmp/tones      # under a minute on 2 CPU cores

Every epoch prints one line: the mean training loss, where the epoch's time went (waiting for
data vs training, and the loader's own split), the validation loss and accuracy.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import coordl
from coordl.tools.datagen.audioset import MANIFEST
from coordl.tools.datagen.tones import make_tones

sys.path.insert(0, str(Path(__file__).resolve().parent))
from model import M5  # noqa: E402 - this folder's module

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--data", required=True, metavar="DIR", help="DIR/train and DIR/val; generated there if missing")
parser.add_argument("--classes", default=4, type=int, metavar="N", help="classes (tones) to generate (4)")
parser.add_argument("--per-class", default=24, type=int, metavar="N", help="training clips per class to generate (24)")
parser.add_argument("--val-per-class", default=12, type=int, metavar="N", help="validation clips per class (12)")
parser.add_argument("--epochs", default=8, type=int, metavar="N", help="epochs to train (8)")
parser.add_argument("-b", "--batch-size", default=16, type=int, metavar="N", help="batch size (16)")
parser.add_argument("--sample-rate", default=8000, type=int, metavar="HZ", help="rate clips are resampled to (8000)")
parser.add_argument("--samples", default=16000, type=int, metavar="N", help="the window's length in samples (16000)")
parser.add_argument("--n-channel", default=32, type=int, metavar="N", help="M5's width: n, n, 2n, 2n channels (32)")
parser.add_argument("--lr", default=1e-2, type=float, help="Adam's peak learning rate (0.01); cosine decay")
parser.add_argument("--wd", "--weight-decay", default=1e-4, type=float, dest="weight_decay", help="(1e-4)")
parser.add_argument("--seed", default=0, type=int, help="seed of the model's initialisation, the order and the windows")
parser.add_argument(
    "--cache", default="auto", help="CoordLoader's cache=: 'auto', a fraction of the dataset (0.5), a size, 0"
)
parser.add_argument("--threads", default=0, type=int, help="DALI's threads per loader (0: coordl decides)")
parser.add_argument("--hp-group", default=None, metavar="NAME", help="the training loader's hp_group= (a sweep's)")
parser.add_argument("--cpu", action="store_true", help="train on the CPU even if a GPU is present")


def main() -> None:
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.cpu else "cpu")
    if args.epochs < 1:
        parser.error(f"--epochs must be at least 1, got {args.epochs}")
    shortest = M5(2).min_samples
    if args.samples < shortest:
        parser.error(f"--samples {args.samples} is too short for M5's four pools: it needs at least {shortest}")
    train_loader, val_loader = make_loaders(args, device)
    classes = train_loader.index.classes
    if list(val_loader.index.classes) != list(classes):
        sys.exit(f"the training classes {list(classes)} and the validation classes differ: {val_loader.index.classes}")
    model = M5(len(classes), n_channel=args.n_channel).to(device)
    print(
        f"=> M5 (n_channel {args.n_channel}), {sum(p.numel() for p in model.parameters()) / 1e3:.1f} k parameters, "
        f"{len(classes)} classes ({', '.join(classes)}); {len(train_loader.index)} training clips, "
        f"{len(val_loader.index)} validation clips; windows of {args.samples} samples at {args.sample_rate} Hz "
        f"({args.samples / args.sample_rate:g} s); device: {device}",
        flush=True,
    )
    optimizer = torch.optim.Adam(model.parameters(), args.lr, weight_decay=args.weight_decay)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs * len(train_loader))

    accuracies, losses, start = [], [], time.perf_counter()
    for epoch in range(args.epochs):
        loss, timing = train(model, train_loader, optimizer, scheduler, device)
        val_loss, correct, total = validate(model, val_loader, device)
        losses.append(loss)
        accuracies.append(correct / max(total, 1))
        print(
            f"epoch {epoch + 1}/{args.epochs}: train loss {loss:.3f}, {timing} | val loss {val_loss:.3f}, "
            f"accuracy {accuracies[-1]:.1%} ({correct}/{total} clips)",
            flush=True,
        )
    epochs = f"{args.epochs} epoch{'s' * (args.epochs != 1)}"
    print(
        f"=> {epochs} in {time.perf_counter() - start:.1f} s; training loss {losses[0]:.3f} -> {losses[-1]:.3f}, "
        f"validation accuracy {accuracies[0]:.1%} -> {accuracies[-1]:.1%}",
        flush=True,
    )
    train_loader.close()
    val_loader.close()


def make_loaders(args, device: torch.device) -> tuple[coordl.CoordLoader, coordl.CoordLoader]:
    """The training and validation loaders, over the datasets in ``--data`` (made when missing)."""
    data = Path(args.data)
    train_dir = dataset(data / "train", args.classes, args.per_class, seed=0)
    val_dir = dataset(data / "val", args.classes, args.val_per_class, seed=1)  # other clips, the same tones
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
    window = dict(sample_rate=args.sample_rate, samples=args.samples)
    train = coordl.CoordLoader(
        train_dir, shuffle=True, pipeline=coordl.AudioTrain(**window), hp_group=args.hp_group, **common
    )
    # Not in the HP group: the group shares one dataset and pipeline, the training loader's.
    val = coordl.CoordLoader(val_dir, pipeline=coordl.AudioVal(**window), **common)
    return train, val


def dataset(folder: Path, classes: int, per_class: int, seed: int) -> Path:
    """``folder``: tones generated there when it holds no dataset, and generated again when a
    generated one was made with other arguments (``--classes``, ``--per-class``). A dataset that
    make_tones did not make (clips of your own, a class per folder) is used as it is."""
    generated = folder / MANIFEST
    if not generated.exists() and folder.is_dir() and any(p.is_dir() for p in folder.iterdir()):
        return folder
    before = generated.stat().st_mtime_ns if generated.exists() else None
    t = time.perf_counter()
    made = make_tones(folder, classes=classes, per_class=per_class, seed=seed)  # at once when made already
    if generated.stat().st_mtime_ns != before:
        print(f"=> made {len(made)} clips in {folder} ({time.perf_counter() - t:.1f} s)", flush=True)
    return folder


def train(model: M5, loader, optimizer, scheduler, device: torch.device) -> tuple[float, str]:
    """One epoch: the mean loss per batch and where the time went."""
    model.train()
    total, batches, clips, waited = 0.0, 0, 0, 0.0
    start = end = time.perf_counter()
    for waveforms, labels in loader:
        waited += time.perf_counter() - end
        waveforms, labels = waveforms.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        loss = F.cross_entropy(model(waveforms), labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()
        total += loss.item()
        batches, clips = batches + 1, clips + len(labels)
        end = time.perf_counter()
    seconds = time.perf_counter() - start
    s = loader.stats()
    timing = (
        f"{batches} batches, {seconds:.1f} s, {clips / max(seconds, 1e-9):.1f} clips/s; waited for data "
        f"{waited:.1f} s ({waited / max(seconds, 1e-9):.0%}): fetch {s['stall_fetch_s']:.1f} s, prep "
        f"{s['stall_prep_s']:.1f} s; storage {s['storage_bytes'] / 1e6:.1f} MB in {s['storage_reads']} reads, "
        f"cache hits {s['cache_hits']}"
    )
    return total / max(batches, 1), timing


@torch.no_grad()
def validate(model: M5, loader, device: torch.device) -> tuple[float, int, int]:
    """``(mean loss per clip, clips classified right, clips)`` on the validation set."""
    model.eval()
    loss, correct, total = 0.0, 0, 0
    for waveforms, labels in loader:
        waveforms, labels = waveforms.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        logits = model(waveforms)
        loss += float(F.cross_entropy(logits, labels, reduction="sum"))
        correct += int((logits.argmax(1) == labels).sum())
        total += len(labels)
    return loss / max(total, 1), correct, total


if __name__ == "__main__":
    main()
