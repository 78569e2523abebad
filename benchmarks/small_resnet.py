"""A CPU training script with a small ResNet on CoordLoader: what ``analyze_accuracy`` analyses.

    python -m benchmarks.small_resnet /var/tmp/coordl-bench/train --cache 0.5 --epochs 3

``examples/imagenet/models.py``'s ``resnet_tiny``; one JSON line per epoch (``stats()`` and the loss). An ordinary
script on a dataset made beforehand: ``coordl analyze -- python -m benchmarks.small_resnet ...`` runs it unchanged.
"""

import argparse
import json
import time

import torch
from torch import nn

import coordl
from benchmarks.loaders import model


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.small_resnet", description=__doc__.split("\n")[0])
    p.add_argument("data")
    p.add_argument("--cache", type=float, default=0.5, help="cache budget, fraction of the dataset")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--threads", type=int, help="torch's threads for the model (default: torch's choice)")
    p.add_argument("--prep-threads", type=int, help="DALI's threads (default: coordl's choice, all cores)")
    args = p.parse_args()

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    kw = {"pipeline": coordl.ImageNetTrain(size=112), "device_id": None, "cache": args.cache, "shuffle": True}
    with coordl.CoordLoader(args.data, batch_size=args.batch_size, prep=args.prep_threads, **kw) as loader:
        net, _ = model("resnet_tiny", int(loader.index.labels.max()) + 1)
        opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
        for epoch in range(args.epochs):
            loader.set_epoch(epoch)
            t0, total, n = time.perf_counter(), 0.0, 0
            for images, labels in loader:
                loss = nn.functional.cross_entropy(net(images), labels)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                total, n = total + loss.item(), n + 1
            s = {k: v for k, v in loader.stats().items() if k != "skipped_paths"}
            print(json.dumps(s | {"loss": total / max(1, n), "wall_s": time.perf_counter() - t0}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
