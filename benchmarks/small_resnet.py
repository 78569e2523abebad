"""A CPU training script with a small ResNet on CoordLoader: what ``analyze_accuracy`` analyses.

    python -m benchmarks.small_resnet /var/tmp/coordl-bench/train --cache 0.5 --epochs 3

Prints one JSON line per epoch (the loader's ``stats()`` plus the epoch's loss). It is an
ordinary script: ``coordl analyze -- python -m benchmarks.small_resnet ...`` runs it unchanged.
Like ``examples/imagenet/train.py`` it takes the path of a dataset made beforehand, not the
benchmarks' dataset options.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from torch import nn

import coordl


class Block(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return torch.relu(out + (x if self.down is None else self.down(x)))


class SmallResNet(nn.Module):
    """ResNet-10 shape (one basic block per stage) at a quarter of ResNet-18's width."""

    def __init__(self, num_classes: int, width: int = 16):
        super().__init__()
        w = width
        self.stem = nn.Sequential(
            nn.Conv2d(3, w, 7, 2, 3, bias=False), nn.BatchNorm2d(w), nn.ReLU(), nn.MaxPool2d(3, 2, 1)
        )
        self.layers = nn.Sequential(Block(w, w, 1), Block(w, 2 * w, 2), Block(2 * w, 4 * w, 2), Block(4 * w, 8 * w, 2))
        self.fc = nn.Linear(8 * w, num_classes)

    def forward(self, x):
        x = self.layers(self.stem(x))
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


def main() -> int:
    raw = argparse.RawDescriptionHelpFormatter
    p = argparse.ArgumentParser(prog="python -m benchmarks.small_resnet", description=__doc__, formatter_class=raw)
    p.add_argument("data")
    p.add_argument("--cache", type=float, default=0.5, help="cache budget, fraction of the dataset")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--size", type=int, default=112, help="training crop")
    p.add_argument("--width", type=int, default=16)
    p.add_argument("--threads", type=int, help="torch's threads for the model (default: torch's choice)")
    p.add_argument("--prep-threads", type=int, help="DALI's threads (default: coordl's choice, all cores)")
    args = p.parse_args()

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    kw = {"pipeline": coordl.ImageNetTrain(size=args.size), "device_id": None, "cache": args.cache, "shuffle": True}
    with coordl.CoordLoader(args.data, batch_size=args.batch_size, prep=args.prep_threads, **kw) as loader:
        classes = int(loader.index.labels.max()) + 1
        model = SmallResNet(classes, args.width)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
        for epoch in range(args.epochs):
            loader.set_epoch(epoch)
            t0, total, n = time.perf_counter(), 0.0, 0
            for images, labels in loader:
                loss = nn.functional.cross_entropy(model(images), labels)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                total, n = total + loss.item(), n + 1
            s = loader.stats()
            s.pop("skipped_paths", None)
            s.update(loss=total / max(1, n), wall_s=time.perf_counter() - t0)
            print(json.dumps(s), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
