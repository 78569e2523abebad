"""Trains a ResNet on ImageNet with coordl: PyTorch's ImageNet example, with CoordLoader for data.

The same flags as https://github.com/pytorch/examples/tree/main/imagenet, the same
training (SGD with momentum, step decay every 30 epochs, top-1/top-5 validation,
``checkpoint.pth.tar`` and ``model_best.pth.tar``). What differs is the data:

- ``--loader coordl`` (default): the training and validation sets are CoordLoaders with the
  ``imagenet-train`` and ``imagenet-val`` recipes, decoded by DALI (on the GPU when there is
  one), with the node's cache of raw samples in ``/dev/shm`` (never evicted) shared by every rank
  and, on several nodes, served to the other nodes. Checkpoints hold rank 0's
  ``loader.state_dict()``, which resumes every rank, so ``--resume`` continues in the middle of an
  epoch where the checkpoint was taken (``--save-every N`` batches, and on SIGTERM, e.g. a
  pre-emption), also on another number of ranks or nodes.
- ``--loader torch``: ``torch.utils.data.DataLoader`` over an ``ImageFolder`` with the same
  transforms (torchvision's when installed), for comparison. It resumes at epoch starts only.

After every epoch it prints where the epoch's time went: waiting for data vs training, and
for coordl the loader's own split (fetch vs pre-processing) and where the bytes came from.

    python examples/imagenet/train.py /data/imagenet -a resnet50 -b 256 -j 8
    torchrun --nproc-per-node 8 examples/imagenet/train.py /data/imagenet -a resnet50
    python examples/imagenet/train.py /tmp/demo -a resnet_tiny --image-size 112 --epochs 2   # CPU demo

A demo dataset: ``coordl make-dataset /tmp/demo/train --images 1000`` and
``coordl make-dataset /tmp/demo/val --images 200 --seed 1``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import models  # noqa: E402 - this folder's modules

parser = argparse.ArgumentParser(
    description=__doc__.split("\n\n")[0],
    epilog="Distributed: run under torchrun; every rank reads WORLD_SIZE, RANK and LOCAL_RANK from it.",
)
parser.add_argument("data", metavar="DIR", help="dataset folder holding train/ and val/ (one sub-folder per class)")
parser.add_argument(
    "-a",
    "--arch",
    metavar="ARCH",
    default="resnet18",
    help="model: resnet18 (default), resnet34, resnet50, resnet_tiny (a CPU demo model), or any "
    "torchvision model when torchvision is installed",
)
parser.add_argument(
    "-j",
    "--workers",
    default=4,
    type=int,
    metavar="N",
    help="data-loading threads (coordl: DALI threads) or worker processes (torch) per rank",
)
parser.add_argument("--epochs", default=90, type=int, metavar="N", help="number of total epochs to run")
parser.add_argument("--start-epoch", default=0, type=int, metavar="N", help="manual epoch number (useful on restarts)")
parser.add_argument("-b", "--batch-size", default=256, type=int, metavar="N", help="mini-batch size per rank")
parser.add_argument("--lr", "--learning-rate", default=0.1, type=float, metavar="LR", help="initial learning rate")
parser.add_argument("--momentum", default=0.9, type=float, metavar="M", help="momentum")
parser.add_argument("--wd", "--weight-decay", default=1e-4, type=float, metavar="W", dest="weight_decay")
parser.add_argument("-p", "--print-freq", default=10, type=int, metavar="N", help="print every N batches")
parser.add_argument("--resume", default="", type=str, metavar="PATH", help="checkpoint to resume from")
parser.add_argument("-e", "--evaluate", action="store_true", help="evaluate the model on the validation set only")
parser.add_argument(
    "--seed", default=None, type=int, help="seed of the model's initialisation and of the data order and augmentation"
)
parser.add_argument("--gpu", default=None, type=int, help="GPU to use (default: LOCAL_RANK's under torchrun, else 0)")
parser.add_argument("--cpu", action="store_true", help="train on the CPU even if a GPU is present")
parser.add_argument(
    "--dist-backend", default=None, type=str, help="torch.distributed backend (default: nccl on GPUs, gloo on the CPU)"
)
parser.add_argument(
    "--loader",
    choices=("coordl", "torch"),
    default="coordl",
    help="coordl's CoordLoader (default) or torch.utils.data.DataLoader, for comparison",
)
parser.add_argument(
    "--cache",
    default="auto",
    help="coordl: cache budget per node, as CoordLoader's cache=: 'auto', a fraction of the "
    "dataset (0.5), a size (40GB) or 0",
)
parser.add_argument("--image-size", default=224, type=int, help="training and validation crop size")
parser.add_argument(
    "--save-every",
    default=0,
    type=int,
    metavar="N",
    help="coordl: also checkpoint every N training batches (resume continues mid-epoch)",
)
parser.add_argument("--checkpoint-dir", default=".", help="where checkpoint.pth.tar and model_best.pth.tar go")
parser.add_argument(
    "--log-samples",
    default="",
    metavar="DIR",
    help="coordl: append the ids of the samples each rank trains on to DIR/rank<r>.jsonl, one line "
    "per batch, to check what a resume trains on",
)

best_acc1 = 0.0


class Run:
    """What every function needs: the arguments, the device and the distributed world."""

    def __init__(self, args):
        self.args = args
        self.distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
        self.rank, self.world_size, self.local_rank = 0, 1, int(os.environ.get("LOCAL_RANK", "0"))
        use_gpu = torch.cuda.is_available() and not args.cpu
        if use_gpu:
            torch.cuda.set_device(args.gpu if args.gpu is not None else self.local_rank)
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            self.device = torch.device("cpu")
        if self.distributed:
            dist.init_process_group(args.dist_backend or ("nccl" if use_gpu else "gloo"))
            self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.stop_requested = False

    def log(self, *a) -> None:
        if self.rank == 0:
            print(*a, flush=True)

    def log_samples(self, epoch: int, batch: int, ids: torch.Tensor) -> None:
        """With ``--log-samples``: the samples this rank trained on in batch ``batch`` of ``epoch``."""
        folder = Path(self.args.log_samples)
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / f"rank{self.rank}.jsonl", "a") as f:  # whole lines, also if the run is killed
            f.write(json.dumps({"epoch": epoch, "batch": batch, "ids": ids.tolist()}) + "\n")

    def any_rank(self, flag: bool) -> bool:
        """True on every rank if it is true on one (so that all ranks stop at the same batch)."""
        if not self.distributed:
            return flag
        t = torch.tensor([int(flag)], device=self.device if dist.get_backend() == "nccl" else "cpu")
        dist.all_reduce(t)
        return bool(t.item())


def main() -> None:
    args = parser.parse_args()
    if args.loader == "torch" and args.save_every:
        parser.error("--save-every needs --loader coordl: a DataLoader cannot resume in the middle of an epoch")
    if args.loader == "torch" and args.log_samples:
        parser.error("--log-samples needs --loader coordl")
    if args.seed is not None:
        random.seed(args.seed)
        torch.manual_seed(args.seed)
    run = Run(args)
    # A pre-emption (SIGTERM) saves a checkpoint at the next batch and exits; resume continues there.
    signal.signal(signal.SIGTERM, lambda *_: setattr(run, "stop_requested", True))
    traindir, valdir = os.path.join(args.data, "train"), os.path.join(args.data, "val")
    for d in (traindir, valdir):
        if not os.path.isdir(d):
            sys.exit(f"{d} is not a folder: DIR must hold train/ and val/ (make one with `coordl make-dataset`)")

    train_loader, val_loader, num_classes, sampler = make_loaders(run, traindir, valdir)
    model, origin = models.create(args.arch, num_classes)
    run.log(
        f"=> {args.arch} from {origin}, {sum(p.numel() for p in model.parameters()) / 1e6:.2f} M parameters, "
        f"{num_classes} classes; data: {args.loader}; device: {run.device}; {run.world_size} rank(s)"
    )
    model = model.to(run.device)
    if run.distributed:
        model = nn.parallel.DistributedDataParallel(
            model, device_ids=[run.device.index] if run.device.index is not None else None
        )
    criterion = nn.CrossEntropyLoss().to(run.device)
    optimizer = torch.optim.SGD(model.parameters(), args.lr, momentum=args.momentum, weight_decay=args.weight_decay)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=30, gamma=0.1)

    global best_acc1
    if args.resume:
        resume(run, model, optimizer, scheduler, train_loader)
    if args.evaluate:
        validate(run, val_loader, model, criterion)
        return finish(run, train_loader, val_loader)

    for epoch in range(args.start_epoch, args.epochs):
        if sampler is not None:
            sampler.set_epoch(epoch)
        elif args.loader == "coordl":
            train_loader.set_epoch(epoch)  # keeps a resumed mid-epoch position of this epoch
        completed = train(run, train_loader, model, criterion, optimizer, scheduler, epoch)
        if not completed:  # stopped by SIGTERM: the checkpoint is saved, resume continues there
            return finish(run, train_loader, val_loader)
        acc1 = validate(run, val_loader, model, criterion)
        scheduler.step()
        is_best = acc1 > best_acc1
        best_acc1 = max(acc1, best_acc1)
        save_checkpoint(run, model, optimizer, scheduler, train_loader, epoch + 1, is_best)
    finish(run, train_loader, val_loader)


def make_loaders(run: Run, traindir: str, valdir: str):
    args = run.args
    if args.loader == "coordl":
        import coordl

        cache = args.cache
        try:
            cache = float(cache) if "." in cache else int(cache)
        except ValueError:
            pass  # 'auto' or a size like '40GB'
        device_id = None if run.device.type == "cpu" else run.device.index
        common = dict(
            batch_size=args.batch_size,
            seed=args.seed or 0,
            device_id=device_id,
            cache=cache,
            prep=coordl.Prep(threads=args.workers or None),  # -j 0: DALI's default threads
        )
        train = coordl.CoordLoader(
            traindir,
            pipeline=coordl.ImageNetTrain(size=args.image_size),
            shuffle=True,
            return_index=bool(args.log_samples),
            **common,
        )
        # return_index: the padding that evens out the ranks' shards is counted once in the accuracy.
        val = coordl.CoordLoader(
            valdir,
            pipeline=coordl.ImageNetVal(size=args.image_size, resize=args.image_size * 8 // 7),
            shuffle=False,
            return_index=True,
            **common,
        )
        return train, val, len(train.index.classes), None

    import torch_data

    train_set, val_set = torch_data.datasets(traindir, valdir, args.image_size, args.image_size * 8 // 7)
    sampler = val_sampler = None
    if run.distributed:
        sampler = torch.utils.data.distributed.DistributedSampler(train_set, seed=args.seed or 0)
        val_sampler = torch.utils.data.distributed.DistributedSampler(val_set, shuffle=False, drop_last=True)
    pin = run.device.type == "cuda"
    train = torch.utils.data.DataLoader(
        train_set,
        batch_size=args.batch_size,
        shuffle=sampler is None,
        num_workers=args.workers,
        pin_memory=pin,
        sampler=sampler,
        persistent_workers=args.workers > 0,
    )
    val = torch.utils.data.DataLoader(
        val_set,
        batch_size=args.batch_size,
        shuffle=False,
        num_workers=args.workers,
        pin_memory=pin,
        sampler=val_sampler,
    )
    return train, val, len(train_set.classes), sampler


def train(run: Run, loader, model, criterion, optimizer, scheduler, epoch: int) -> bool:
    """One epoch (or its rest, after a mid-epoch resume); False if stopped by SIGTERM."""
    args = run.args
    coordl_loader = args.loader == "coordl"
    batches = iter(loader)
    # After a resume, coordl's pass starts at the batch where the checkpoint was taken and holds
    # the rest of the epoch; on another number of ranks, the samples not yet trained on, dealt anew.
    start = batches.start if coordl_loader else 0
    total = start + len(batches)
    base = loader.state_dict().get("base", 0) if coordl_loader else 0
    if start or base:
        run.log(
            f"=> resuming epoch {epoch} at batch {start} of {total}"
            + (
                f", which deal the {len(loader.index) - base} samples the epoch had left when the number of "
                f"ranks changed"
                if base
                else ""
            )
        )
    batch_time, data_time = AverageMeter("Time", ":6.3f"), AverageMeter("Data", ":6.3f")
    losses, top1, top5 = AverageMeter("Loss", ":.4e"), AverageMeter("Acc@1", ":6.2f"), AverageMeter("Acc@5", ":6.2f")
    progress = ProgressMeter(total, [batch_time, data_time, losses, top1, top5], prefix=f"Epoch: [{epoch}]")
    model.train()
    t_epoch = end = time.perf_counter()
    waited, samples, i = 0.0, 0, start - 1
    for i, batch in enumerate(batches, start):
        images, target = batch[0], batch[1]
        dt = time.perf_counter() - end
        data_time.update(dt)
        waited += dt
        images = images.to(run.device, non_blocking=True)
        target = target.to(run.device, non_blocking=True)
        output = model(images)
        loss = criterion(output, target)
        acc1, acc5 = accuracy(output, target, topk=(1, 5))
        losses.update(loss.item(), images.size(0))
        top1.update(acc1.item(), images.size(0))
        top5.update(acc5.item(), images.size(0))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if args.log_samples:
            run.log_samples(epoch, i, batch[2])
        samples += images.size(0)
        batch_time.update(time.perf_counter() - end)
        if i % args.print_freq == 0:
            run.log(progress.display(i))
        stop = run.any_rank(run.stop_requested)
        if stop or (coordl_loader and args.save_every and (i + 1) % args.save_every == 0 and i + 1 < total):
            save_checkpoint(run, model, optimizer, scheduler, loader, epoch, False)
            if stop:
                epoch_summary(
                    run,
                    loader,
                    epoch,
                    time.perf_counter() - t_epoch,
                    waited,
                    samples,
                    start,
                    i + 1 - start,
                    stopped=True,
                )
                run.log(f"=> stopped by SIGTERM after batch {i + 1} of epoch {epoch}; --resume continues there")
                return False
        end = time.perf_counter()
    epoch_summary(run, loader, epoch, time.perf_counter() - t_epoch, waited, samples, start, i + 1 - start)
    return True


def epoch_summary(
    run: Run,
    loader,
    epoch: int,
    seconds: float,
    waited: float,
    samples: int,
    start: int,
    batches: int,
    stopped: bool = False,
) -> None:
    """Where the epoch's time went, and for coordl where its bytes came from, over all ranks."""
    total = [samples, waited, seconds]
    stats = loader.stats() if run.args.loader == "coordl" else None
    everyone = [(total, stats)]
    if run.distributed:
        everyone = [None] * run.world_size
        dist.all_gather_object(everyone, (total, stats))
    if run.rank != 0:
        return
    samples = sum(t[0] for t, _ in everyone)
    waited = max(t[1] for t, _ in everyone)  # the slowest rank's wait is what DDP waits for
    seconds = max(t[2] for t, _ in everyone)
    line = (
        f"Epoch [{epoch}] summary: {batches} batches from batch {start}, {seconds:.1f} s, "
        f"{samples / max(seconds, 1e-9):.1f} samples/s; waited for data {waited:.1f} s "
        f"({waited / max(seconds, 1e-9):.0%})"
    )
    if stats is not None:
        from coordl.units import format_bytes  # coordl is imported only with --loader coordl

        s = [st for _, st in everyone]

        def total_of(key):
            return sum(x.get(key, 0) for x in s)

        line += (
            f": fetch {max(x['stall_fetch_s'] for x in s):.1f} s, prep {max(x['stall_prep_s'] for x in s):.1f} s; "
            f"storage {format_bytes(total_of('storage_bytes'), 'MB')} in {total_of('storage_reads')} reads, "
            f"cache hits {total_of('cache_hits')} ({format_bytes(total_of('cache_hit_bytes'), 'MB')}), "
            f"peers {format_bytes(total_of('peer_bytes'), 'MB')}; "
            f"node cache {format_bytes(s[0]['cache_bytes'], 'MB', with_unit=False)} "
            f"of {format_bytes(s[0]['cache_budget'], 'MB')}"
        )
        if stopped:
            line += " (stopped early: the bytes include batches the loader had fetched ahead of training)"
    print(line, flush=True)


def validate(run: Run, loader, model, criterion) -> float:
    """Top-1 accuracy on the validation set; every sample counted once over all ranks."""
    args = run.args
    batch_time, losses = AverageMeter("Time", ":6.3f"), AverageMeter("Loss", ":.4e")
    top1, top5 = AverageMeter("Acc@1", ":6.2f"), AverageMeter("Acc@5", ":6.2f")
    progress = ProgressMeter(len(loader), [batch_time, losses, top1, top5], prefix="Test: ")
    model.eval()
    per_sample = {}  # index -> (top-1 correct, top-5 correct, loss)
    with torch.no_grad():
        end = time.perf_counter()
        for i, batch in enumerate(loader):
            images, target = batch[0].to(run.device, non_blocking=True), batch[1].to(run.device, non_blocking=True)
            output = model(images)
            loss = nn.functional.cross_entropy(output, target, reduction="none")
            hit1, hit5 = correct_k(output, target, topk=(1, 5))
            n = images.size(0)
            losses.update(loss.mean().item(), n)
            top1.update(hit1.float().mean().item() * 100, n)
            top5.update(hit5.float().mean().item() * 100, n)
            ids = batch[2].tolist() if len(batch) > 2 else range(len(per_sample), len(per_sample) + n)
            for k, j in enumerate(ids):
                per_sample[j] = (bool(hit1[k]), bool(hit5[k]), float(loss[k]))
            batch_time.update(time.perf_counter() - end)
            if i % args.print_freq == 0:
                run.log(progress.display(i))
            end = time.perf_counter()
    if run.distributed:
        parts = [None] * run.world_size
        dist.all_gather_object(parts, per_sample)
        per_sample = {k: v for p in parts for k, v in p.items()}
    n = max(len(per_sample), 1)
    acc1 = 100 * sum(v[0] for v in per_sample.values()) / n
    acc5 = 100 * sum(v[1] for v in per_sample.values()) / n
    loss = sum(v[2] for v in per_sample.values()) / n
    run.log(f" * Acc@1 {acc1:.3f} Acc@5 {acc5:.3f} Loss {loss:.4f} ({len(per_sample)} images)")
    return acc1


def resume(run: Run, model, optimizer, scheduler, train_loader) -> None:
    global best_acc1
    args = run.args
    if not os.path.isfile(args.resume):
        sys.exit(f"=> no checkpoint found at {args.resume!r}")
    checkpoint = torch.load(args.resume, map_location=run.device, weights_only=False)
    args.start_epoch = checkpoint["epoch"]
    best_acc1 = checkpoint["best_acc1"]
    unwrapped(model).load_state_dict(checkpoint["state_dict"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    scheduler.load_state_dict(checkpoint["scheduler"])
    state = checkpoint.get("loader")
    if isinstance(state, list):  # an earlier version of this script saved every rank's state, all alike
        state = state[0]
    if args.loader == "coordl" and state:
        # Rank 0's state resumes every rank, on the number of ranks it was saved with or another.
        train_loader.load_state_dict(state)
    elif checkpoint.get("mid_epoch"):
        sys.exit("=> this checkpoint was taken in the middle of an epoch; resume it with --loader coordl")
    where = f", batch {state['batches']} on {state['world_size']} rank(s)" if mid_epoch(state) else ""
    run.log(f"=> loaded checkpoint {args.resume!r} (epoch {checkpoint['epoch']}{where})")


def save_checkpoint(run: Run, model, optimizer, scheduler, train_loader, epoch: int, is_best: bool) -> None:
    """``checkpoint.pth.tar`` (written atomically): ``epoch`` is the epoch to continue with."""
    if run.rank != 0:
        return
    # Every rank has trained on as many batches (DDP), so rank 0's loader state is every rank's.
    loader_state = train_loader.state_dict() if run.args.loader == "coordl" else None
    state = {
        "epoch": epoch,
        "arch": run.args.arch,
        "state_dict": unwrapped(model).state_dict(),
        "best_acc1": best_acc1,
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "loader": loader_state,
        "mid_epoch": mid_epoch(loader_state),
    }
    folder = Path(run.args.checkpoint_dir)
    folder.mkdir(parents=True, exist_ok=True)
    path, tmp = folder / "checkpoint.pth.tar", folder / "checkpoint.pth.tar.tmp"
    torch.save(state, tmp)
    os.replace(tmp, path)  # a kill -9 while saving leaves the previous checkpoint whole
    where = f"epoch {epoch}, batch {loader_state['batches']}" if state["mid_epoch"] else f"start of epoch {epoch}"
    print(f"=> saved {path} ({where})", flush=True)
    if is_best:
        shutil.copyfile(path, folder / "model_best.pth.tar")


def mid_epoch(loader_state: dict | None) -> bool:
    """Whether a coordl loader state is in the middle of an epoch."""
    return bool(loader_state and (loader_state["batches"] or loader_state.get("base", 0)))


def finish(run: Run, *loaders) -> None:
    if run.distributed:
        dist.barrier()  # every node keeps serving its cache to the others until the last one is done
    for loader in loaders:
        if hasattr(loader, "close"):
            loader.close()
    if run.distributed:
        dist.destroy_process_group()


def unwrapped(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


class AverageMeter:
    def __init__(self, name: str, fmt: str = ":f"):
        self.name, self.fmt = name, fmt
        self.val = self.avg = self.sum = 0.0
        self.count = 0

    def update(self, val: float, n: int = 1) -> None:
        self.val = val
        self.sum += val * n
        self.count += n
        self.avg = self.sum / self.count

    def __str__(self) -> str:
        return ("{name} {val" + self.fmt + "} ({avg" + self.fmt + "})").format(**self.__dict__)


class ProgressMeter:
    def __init__(self, num_batches: int, meters, prefix: str = ""):
        width = len(str(num_batches))
        self.batch_fmt = "[{:" + str(width) + "d}/" + str(num_batches) + "]"
        self.meters, self.prefix = meters, prefix

    def display(self, batch: int) -> str:
        return "\t".join([self.prefix + self.batch_fmt.format(batch)] + [str(m) for m in self.meters])


def correct_k(output: torch.Tensor, target: torch.Tensor, topk=(1,)) -> list[torch.Tensor]:
    """Per sample, whether the target is among the top k predictions, for each k."""
    maxk = min(max(topk), output.size(1))
    pred = output.topk(maxk, 1, True, True).indices
    hits = pred.eq(target.view(-1, 1))
    return [hits[:, : min(k, maxk)].any(1) for k in topk]


def accuracy(output: torch.Tensor, target: torch.Tensor, topk=(1,)) -> list[torch.Tensor]:
    """The top-k accuracies in percent, as in PyTorch's example."""
    return [c.float().mean() * 100 for c in correct_k(output, target, topk)]


if __name__ == "__main__":
    main()
