"""The ``coordl`` command: demo, dataset generation, and housekeeping of the shared-memory cache and
the local-storage tier."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import time

from coordl.units import format_bytes, parse_bytes

__all__ = ["main"]


def stats_table(rows: list[dict]) -> str:
    """A plain-text table of per-epoch ``CoordLoader.stats()`` dicts."""
    cols = [
        ("epoch", lambda s: str(s["epoch"])),
        ("samples", lambda s: str(s["samples"])),
        ("time s", lambda s: f"{s['elapsed_s']:.2f}"),
        ("samples/s", lambda s: f"{s['samples_per_s']:.0f}"),
        ("cache hits", lambda s: str(s["cache_hits"])),
        ("storage reads", lambda s: str(s["storage_reads"])),
        ("storage MB", lambda s: format_bytes(s["storage_bytes"], "MB", with_unit=False)),
        ("cached MB", lambda s: format_bytes(s["cache_bytes"], "MB", with_unit=False)),
        ("stall s", lambda s: f"{s['stall_s']:.2f}"),
    ]
    cells = [[name for name, _ in cols]] + [[f(s) for _, f in cols] for s in rows]
    widths = [max(len(r[k]) for r in cells) for k in range(len(cols))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _demo(args) -> int:
    import coordl
    from coordl.tools.datagen import make_dataset

    with tempfile.TemporaryDirectory(prefix="coordl-demo-") as tmp:
        root = args.dir or os.path.join(tmp, "train")
        print(f"Generating {args.images} ImageNet-like JPEGs in {root} ...", flush=True)
        summary = make_dataset(root, num_images=args.images, num_classes=args.classes, seed=0, progress=not args.quiet)
        print(summary, flush=True)
        print(
            f"\nTraining loop: {args.epochs} epochs, batch size {args.batch_size}, "
            f"the node's cache = {args.cache:.0%} of the dataset (never evicted), DALI on the CPU\n",
            flush=True,
        )
        rows = []
        with coordl.CoordLoader(
            coordl.Index.scan(root, index_dir="" if not args.dir else None),
            batch_size=args.batch_size,
            pipeline="imagenet-train",
            device_id=None,
            cache=args.cache,
            shuffle=True,
        ) as loader:
            for epoch in range(args.epochs):
                loader.set_epoch(epoch)
                bar = _progress(len(loader), f"epoch {epoch}", disable=args.quiet)
                for images, _labels in loader:
                    bar.update(1)
                    bar.set_postfix_str(f"{tuple(images.shape)}")
                bar.close()
                rows.append(loader.stats())
        print("\n" + stats_table(rows))
        first, last = rows[0], rows[-1]
        print(
            f"\nEpoch 0 read all {first['storage_reads']} samples from storage and filled the cache with "
            f"{last['cache_items']} of them ({format_bytes(last['cache_bytes'], 'MB')}). Later epochs read only the "
            f"rest: {last['storage_reads']} samples, {format_bytes(last['storage_bytes'], 'MB')} "
            f"(dataset {format_bytes(summary.total_bytes, 'MB')} - cache {format_bytes(last['cache_bytes'], 'MB')})."
        )
    return 0


def _progress(total: int, desc: str, disable: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="batch", disable=disable, file=sys.stderr, leave=True)


def _make_dataset(args) -> int:
    from coordl.tools.datagen import make_dataset

    try:
        summary = make_dataset(
            args.root,
            num_images=args.images,
            total_bytes=args.size,
            num_classes=args.classes,
            photos_dir=args.photos,
            size=(args.width, args.height),
            quality=args.quality,
            seed=args.seed,
            progress=not args.quiet,
        )
    except (ValueError, FileNotFoundError) as e:  # bad arguments or root: no traceback
        print(f"coordl make-dataset: error: {e}", file=sys.stderr)
        return 2
    print(summary)
    return 0


def _byte_size(text: str) -> int:
    """argparse type of ``make-dataset --size``: ``500MB``, ``2GB``, ``1.5GiB`` or plain bytes."""
    try:
        size = parse_bytes(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"cannot parse size {text!r}; expected e.g. 500MB, 2GB, 1.5GiB or a whole number of bytes"
        ) from None
    if size < 1:
        raise argparse.ArgumentTypeError(f"size must be at least 1 byte, got {text!r}")
    return size


def _positive_int(text: str) -> int:
    v = int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text}")
    return v


def _non_negative_int(text: str) -> int:
    v = int(text)
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be at least 0, got {text}")
    return v


def _analyze(args) -> int:
    from coordl.analyze.run import main

    return main(args)


def _cache_ls(args) -> int:
    from coordl.shm import limits, names, reaper

    if args.disk:
        from coordl.fetch import disk

        try:
            found = disk.describe(args.disk)
        except disk.ForeignFolderError as e:
            print(f"coordl cache ls: error: {e}", file=sys.stderr)
            return 1
        if found is None:
            print(f"no coordl local-storage tier in {args.disk}")
        else:
            budget = (
                format_bytes(found.budget) if found.budget else "auto (what its file system has free, less keep_free)"
            )
            print(
                f"local-storage tier {disk.tier_folder(args.disk)}: {format_bytes(found.used)} on disk; budget {budget}"
                + (f"; {format_bytes(found.reserved)} reserved by writers" if found.reserved else "")
            )

    directory = names.shm_dir()
    groups = reaper.list_groups(directory)
    if not groups:
        print(f"no coordl shared memory in {directory}")
    else:
        print(f"{'fingerprint':<18} {'files':>5} {'MB':>10}  state")
    for g in groups:
        state = "in use" if g.in_use else "unused"
        if g.keep:
            state += ", kept warm"
        print(f"{g.fingerprint:<18} {g.files:>5} {format_bytes(g.bytes, 'MB', with_unit=False):>10}  {state}")
    level = limits.tightest()
    if level is not None:
        # Shared memory counts against this limit: it bounds what a cache made from here may take.
        print(
            f"memory limit: {format_bytes(level.limit)} ({level.name}), {format_bytes(level.used)} in use; "
            f"a cache may take {format_bytes(level.room)} more ({format_bytes(level.margin)} kept free)"
        )
    return 0


def _cache_clean(args) -> int:
    from coordl.shm import names, reaper

    if args.disk:
        from coordl.fetch import disk

        try:
            done = disk.remove(args.disk)
        except disk.ForeignFolderError as e:
            print(f"coordl cache clean: error: {e}", file=sys.stderr)
            return 1
        folder = disk.tier_folder(args.disk)
        if done is None:
            print(f"no coordl local-storage tier in {args.disk}")
        elif done:
            print(f"removed the local-storage tier {folder}")
        else:
            print(f"left the local-storage tier {folder}: a running process uses it")
            return 1
        return 0

    directory = names.shm_dir()
    removed = reaper.reap(directory, include_kept=not args.keep_warm)
    for g in removed:
        print(f"removed {g.fingerprint}: {g.files} files, {format_bytes(g.bytes, 'MB')}")
    busy = [g for g in reaper.list_groups(directory) if g.in_use]
    if busy:
        print(f"left {len(busy)} group(s) in use by running processes")
    if not removed:
        print(f"nothing to remove in {directory}")
    return 0


def _cache_verify(args) -> int:
    from coordl.fetch import disk

    try:
        report = disk.verify(args.disk)
    except disk.ForeignFolderError as e:
        print(f"coordl cache verify: error: {e}", file=sys.stderr)
        return 1
    if report is None:
        print(f"no coordl local-storage tier in {args.disk}")
        return 0
    for line in report.lines():
        print(line)
    return 0 if report.clean else 1


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="coordl", description=__doc__)
    p.add_argument("-v", "--verbose", action="store_true", help="log what coordl does")
    sub = p.add_subparsers(dest="command", required=True)

    d = sub.add_parser("demo", help="generate a small dataset and train-loop over it twice")
    d.add_argument("--images", type=int, default=600, help="JPEGs to generate (default 600)")
    d.add_argument("--classes", type=int, default=10)
    d.add_argument("--epochs", type=int, default=2)
    d.add_argument("--batch-size", type=int, default=32)
    d.add_argument("--cache", type=float, default=0.5, help="cache budget as a fraction of the dataset")
    d.add_argument("--dir", help="where to put the dataset (default: a temp dir, removed afterwards)")
    d.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    d.set_defaults(func=_demo)

    m = sub.add_parser(
        "make-dataset",
        help="generate an ImageNet-like ImageFolder tree of JPEGs",
        description="Generate a deterministic ImageNet-like ImageFolder tree of JPEGs of a "
        "given image count or total size, then print its file count, total bytes and "
        "mean size. Running it again with the same arguments is a cheap no-op.",
    )
    m.add_argument("root")
    howmany = m.add_mutually_exclusive_group(required=True)
    howmany.add_argument("--images", type=int, help="number of JPEGs")
    howmany.add_argument(
        "--size",
        type=_byte_size,
        help="total size: the fewest JPEGs that add up to at least SIZE, e.g. 500MB, 2GB, 1.5GiB or plain bytes",
    )
    m.add_argument("--classes", type=int, default=10)
    m.add_argument("--photos", help="folder of large photographs to crop from (else generated images)")
    m.add_argument("--width", type=int, default=400)
    m.add_argument("--height", type=int, default=350)
    m.add_argument("--quality", type=int, default=90)
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("-q", "--quiet", action="store_true")
    m.set_defaults(func=_make_dataset)

    a = sub.add_parser(
        "analyze",
        help="measure data stalls of a training script and predict what more resources buy",
        description="Runs the training command (which must use coordl.CoordLoader) once per DS-Analyzer phase, "
        "each bounded by a number of steps: G (its step on synthetic batches), P and R (a cached subset, "
        "the loader alone and with training), S (storage reads), F (training from a cold cache). Then prints "
        "the rates, the stall split, the bottleneck and what-if predictions, and saves JSON and a plot.",
        usage="coordl analyze [options] -- python train.py [args ...]",
    )
    a.add_argument("--steps", type=_positive_int, default=100, help="measured steps per phase (default 100)")
    a.add_argument("--warmup", type=_non_negative_int, default=5, help="steps before measuring (default 5)")
    a.add_argument("--out", default="coordl-analyze", help="folder for logs and the report (default ./coordl-analyze)")
    a.add_argument("--json", help="where to write the JSON report (default OUT/report.json)")
    a.add_argument("--plot", help="where to write the PNG plot (default OUT/report.png)")
    a.add_argument("--timeout", type=float, default=900, help="seconds a phase may take (default 900)")
    a.add_argument(
        "--subset-batches",
        type=_positive_int,
        default=16,
        help="batches per rank in phase P's cached subset (default 16)",
    )
    a.add_argument("--storage-seconds", type=float, default=20.0, help="longest storage measurement (default 20)")
    a.add_argument(
        "--network-bandwidth",
        type=_byte_size,
        default=1_250_000_000,
        help="bytes/s between nodes for the multi-node and remote-CPU what-ifs (default 1.25GB, i.e. 10 Gbit/s)",
    )
    a.add_argument("command", nargs=argparse.REMAINDER, help="the training command, after --")
    a.set_defaults(func=_analyze)

    c = sub.add_parser("cache", help="inspect or clean coordl's shared memory (and local-storage tiers)")
    csub = c.add_subparsers(dest="cache_command", required=True)
    ls = csub.add_parser("ls", help="list caches in the shm directory")
    ls.add_argument("--disk", metavar="PATH", help="also the local-storage tier of coordl.Cache(disk=PATH)")
    ls.set_defaults(func=_cache_ls)
    cl = csub.add_parser("clean", help="remove every cache no running process uses")
    cl.add_argument("--keep-warm", action="store_true", help="keep caches made with coordl.Cache(keep=True)")
    cl.add_argument(
        "--disk",
        metavar="PATH",
        help="remove the local-storage tier of coordl.Cache(disk=PATH) instead (unless in use)",
    )
    cl.set_defaults(func=_cache_clean)
    v = csub.add_parser(
        "verify",
        help="check every entry of a local-storage tier and its ledger (exit 1 when something was fixed)",
        description="Check every entry of the local-storage tier of coordl.Cache(disk=PATH) (its header, size, "
        "stamp and CRC-32), remove the damaged ones and what killed writers left, and set the ledger to what the "
        "folder takes on disk. Prints what it found and fixed; exits 0 when the tier was clean, 1 otherwise (or "
        "when a running process uses it).",
    )
    v.add_argument("--disk", metavar="PATH", required=True, help="the folder given as coordl.Disk(PATH)")
    v.set_defaults(func=_cache_verify)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    t0 = time.perf_counter()
    code = args.func(args)
    logging.getLogger(__name__).info("done in %.1f s", time.perf_counter() - t0)
    return code


if __name__ == "__main__":
    sys.exit(main())
