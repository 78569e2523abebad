"""One trial of a learning-rate sweep: a small CNN trained on an ImageFolder dataset.

Every trial started with the same ``--hp-group`` on this machine shares one fetch and
one pre-processing pass with the others: each batch is decoded once, by one of them,
and trained on by all. Nothing else in the script knows about it.

    python examples/hpsearch/train.py /path/to/train --lr 0.05 --hp-group lr-sweep

After every epoch it prints a line for people and a JSON line for the tool that runs it
(``launch.py`` and ``halving.py`` read those): the mean training loss, the accuracy and
the loader's statistics (``consumed_shared``: batches of the epoch that other trials made)::

    lr=0.05 epoch 0: loss 2.156, train acc 21.0%, 412 samples/s, waited 0.3 s for data, 6/10 batches ...
    {"event": "epoch", "lr": 0.05, "epoch": 0, "epochs": 3, "loss": 2.156, "acc": 0.21, "batches": 10,
     "consumed_shared": 6, "produced": 3, "hp_members": 3, "wait_max_s": 0.04, ...}
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

import common  # this folder's module (the script's folder is on sys.path)
import torch
from torch import nn

import coordl


def tiny_cnn(num_classes: int) -> nn.Module:
    def block(cin, cout):
        return nn.Sequential(nn.Conv2d(cin, cout, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU())

    return nn.Sequential(
        block(3, 16), block(16, 32), block(32, 64), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, num_classes)
    )


def train(args) -> None:
    torch.manual_seed(0)
    loader = coordl.CoordLoader(
        args.data,
        batch_size=args.batch_size,
        pipeline=coordl.ImageNetTrain(size=args.size),
        hp_group=args.hp_group,
        shuffle=True,
    )
    model = tiny_cnn(len(loader.index.classes))
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    common.wait_for_go(args.start_together)  # launch.py/halving.py start their first trials together
    with loader:
        for epoch in range(args.epochs):
            loader.set_epoch(epoch)
            t0, total, correct, loss_sum = time.perf_counter(), 0, 0, 0.0
            for images, labels in loader:
                out = model(images)
                loss = nn.functional.cross_entropy(out, labels)
                opt.zero_grad()
                loss.backward()
                opt.step()
                total += len(labels)
                correct += int((out.argmax(1) == labels).sum())
                loss_sum += loss.item() * len(labels)
            report(args, epoch, loss_sum / total, correct / total, total / (time.perf_counter() - t0), loader.stats())


def report(args, epoch: int, loss: float, acc: float, samples_per_s: float, s: dict) -> None:
    """Prints an epoch's line for people, then its JSON line for the tool that runs the trial."""
    shared = f", {s['consumed_shared']}/{s['batches']} batches made by other trials" if args.hp_group else ""
    say(
        f"lr={args.lr:g} epoch {epoch}: loss {loss:.3f}, train acc {acc:.1%}, {samples_per_s:.0f} samples/s, "
        f"waited {s['stall_s']:.1f} s for data{shared}"
    )
    line = {"event": "epoch", "lr": args.lr, "epoch": epoch, "epochs": args.epochs, "loss": loss, "acc": acc}
    keys = (
        "batches",
        "samples_per_s",
        "stall_s",
        "wait_max_s",
        "consumed_shared",
        "produced",
        "hp_members",
        "order_epoch",
    )
    line.update({k: s[k] for k in keys if k in s})
    line = {k: round(v, 4) if isinstance(v, float) else v for k, v in line.items()}
    line.update(pid=os.getpid(), time=round(time.time(), 3))
    say(json.dumps(line))


def say(text: str) -> None:
    """Writes one whole line at once. Trials started together share their launcher's stdout, and print()
    writes a line and its newline in two calls when Python runs unbuffered (PYTHONUNBUFFERED, -u): another
    trial's line could land between them and join two lines into one the tool cannot parse."""
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("data", help="ImageFolder-style folder (one sub-folder per class)")
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("-b", "--batch-size", type=int, default=64)
    p.add_argument("--size", type=int, default=64, help="training crop size (the same for every trial)")
    p.add_argument("--hp-group", help="share loading with the other trials that name this group")
    p.add_argument("--start-together", help=argparse.SUPPRESS)  # a folder: wait there for the launcher's go
    args = p.parse_args()
    # coordl says when this trial joins a group in the middle of an epoch, or a member died.
    logging.basicConfig(format="%(message)s")
    logging.getLogger("coordl").setLevel(logging.INFO)
    try:
        train(args)
    except KeyboardInterrupt:  # stopped by the tool that runs it: the loader has left the group
        print(f"lr={args.lr:g}: interrupted", file=sys.stderr, flush=True)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
