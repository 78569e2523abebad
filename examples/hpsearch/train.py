"""One trial of a learning-rate sweep: a small CNN trained on an ImageFolder dataset.

Every trial started with the same ``--hp-group`` on this machine shares one fetch and
one pre-processing pass with the others: each batch is decoded once, by one of them,
and trained on by all. Nothing else in the script knows about it.

    python examples/hpsearch/train.py /path/to/train --lr 0.05 --hp-group lr-sweep
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

import coordl


def tiny_cnn(num_classes: int) -> nn.Module:
    def block(cin, cout):
        return nn.Sequential(nn.Conv2d(cin, cout, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU())

    return nn.Sequential(block(3, 16), block(16, 32), block(32, 64), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(64, num_classes))  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("data", help="ImageFolder-style folder (one sub-folder per class)")
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("-b", "--batch-size", type=int, default=64)
    p.add_argument("--size", type=int, default=64, help="training crop size (the same for every trial)")
    p.add_argument("--hp-group", help="share loading with the other trials that name this group")
    args = p.parse_args()

    torch.manual_seed(0)
    loader = coordl.CoordLoader(args.data, batch_size=args.batch_size, pipeline=coordl.ImageNetTrain(size=args.size),
                                hp_group=args.hp_group)  # fmt: skip
    model = tiny_cnn(len(loader.index.classes))
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
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
            s = loader.stats()
            shared = f", {s['consumed_shared']}/{s['batches']} batches made by other trials" if args.hp_group else ""
            print(f"lr={args.lr:g} epoch {epoch}: loss {loss_sum / total:.3f}, train acc {correct / total:.1%}, "
                  f"{total / (time.perf_counter() - t0):.0f} samples/s, waited {s['stall_s']:.1f} s for data{shared}",
                  flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
