"""Object detection on the CPU: coordl's SSDTrain against DALI's COCO pipeline and a DataLoader; an HP group.

Scenarios (``--scenarios``):

- ``prep``: prep-bound, the whole dataset in memory (page cache warm, coordl's cache holding it), no
  training step: ``coordl`` (``SSDTrain(size=300)``), ``dali`` (NVIDIA's SSD300 pipeline) and ``torch``
  (``DataLoader(CocoDetection(transforms=PythonSSD()))``), see :mod:`benchmarks.detection_baselines`;
  ``--loaders ...,dali-1`` adds DALI's with ``num_attempts=1``. A child process per run: a warm-up
  epoch, then ``--epochs`` epochs for samples/s and CPU seconds per sample (process tree); ABBA,
  ``--reps`` times; the medians, coordl/dali and coordl/torch.
- ``hp``: two coordl trials (``x.sum()`` per batch) in the HP group ``bench-detect`` vs apart, ABBA:
  per-trial samples/s after the first epoch; speedup = group / separate.

Also measured: the Python a coordl batch costs outside DALI (``crops.plan``, ``targets``). The dataset is
COCO-like (``coordl.tools.datagen.coco.make_coco``), photo crops with 1-8 solid rectangles each.

    python -m benchmarks detection                 # 1500 images, 3 reps: about 11 minutes on 2 cores
    python -m benchmarks detection --smoke --data /tmp/coco-smoke --out /tmp/detection.json
"""

from __future__ import annotations

import statistics
import time

from benchmarks import detection_baselines as baselines
from benchmarks.harness import compare, dataset, jobs

LOADERS = ("coordl", "dali", "torch")  # the default set; also "dali-1"


def options(p) -> None:
    g = p.add_argument_group("dataset", "generated under --data if missing, found again by a later run")
    g.add_argument("--data", default="/var/tmp/coordl-bench/coco", help="dataset root (default: %(default)s)")
    g.add_argument("--images", type=int, default=1500, help="JPEGs to generate (default: %(default)s)")
    dataset.add_source_options(g)
    g.add_argument("--width", type=int, default=640, help="mean image width, +-12.5%% (default: %(default)s)")
    g.add_argument("--height", type=int, default=480, help="mean image height, +-12.5%% (default: %(default)s)")
    g.add_argument("--quality", type=int, default=90, help="JPEG quality (default: %(default)s)")
    g.add_argument("--dataset-seed", type=int, default=0, help="the generator's seed (default: 0)")
    compare.add_options(p, LOADERS, jobs_of=(*LOADERS, "dali-1"))
    p.add_argument("--scenarios", default="prep,hp", help="prep, hp or both (default: prep,hp)")
    p.add_argument("--smoke", action="store_true", help="40 small images, batch 16, 1 rep, 1 epoch: a test's run")


def coco(args) -> dict:
    """Generates (or finds) the dataset; returns its figures."""
    from coordl.tools.datagen.coco import make_coco

    photos = dataset.photos_of(args)
    spread = lambda m: (m - m // 8, m + m // 8)  # noqa: E731
    kw = {"seed": args.dataset_seed, "width": spread(args.width), "height": spread(args.height), "boxes": (1, 8)}
    s = make_coco(args.data, args.images, quality=args.quality, photos_dir=photos, **kw)
    truths = list(s.truths.values())
    n, pixels = len(truths), sum(t.width * t.height for t in truths)
    out = {"root": s.root, "images": s.images, "annotations": s.annotations, "files": n, "total_bytes": s.total_bytes}
    out |= {"mean_bytes": round(s.total_bytes / n), "bytes_per_pixel": round(s.total_bytes / pixels, 3)}
    out |= {
        "mean_width": round(sum(t.width for t in truths) / n),
        "mean_height": round(sum(t.height for t in truths) / n),
    }
    out |= {"boxes": sum(len(t.boxes) for t in truths), "empty_images": sum(not t.boxes for t in truths)}
    return out | {"jpeg_quality": args.quality, "source": "photographs" if photos else "generated"}


def command(args):
    kw = {"batch_size": args.batch_size, "threads": args.threads, "data": args.data, "images": args.images}
    kw |= {"width": args.width, "height": args.height, "quality": args.quality, "dataset_seed": args.dataset_seed}
    argv = [*jobs.flags(**kw), *dataset.source_argv(args)]
    return lambda name, *extra: jobs.scenario_command("detection", "--job", name, *argv, *extra)


def job(args) -> None:
    import coordl

    c = coco(args)
    if args.job.startswith("dali"):
        attempts = 1 if args.job == "dali-1" else 50
        loader = baselines.DaliCoco(c["images"], c["annotations"], args.batch_size, args.threads, attempts=attempts)
    elif args.job == "torch":
        loader = baselines.torch_loader(c["images"], c["annotations"], args.batch_size, args.threads)
    else:
        index = coordl.Index.from_coco(c["images"], c["annotations"])
        loader = baselines.coordl_loader(index, args.batch_size, args.threads, group=args.group)
    compare.job(args, loader, (lambda b: b[0].sum()) if args.step == "touch" else None)


def python_per_batch(args) -> dict:
    """Milliseconds of Python per coordl batch outside DALI: ``crops.plan`` and ``targets.targets`` (the
    batch's targets from its plan's boxes, as ``SSDTrain.targets`` makes them)."""
    import numpy as np

    import coordl
    from coordl.detection import crops, targets

    c = coco(args)
    index = coordl.Index.from_coco(c["images"], c["annotations"])
    recipe, b = coordl.SSDTrain(size=baselines.SIZE), min(args.batch_size, len(index))
    ids = np.random.default_rng(0).permutation(len(index))[:b]
    plans = [crops.plan(recipe, index.boxes, 0, epoch, ids) for epoch in range(50)]
    image_ids = index.boxes.image_ids[ids].tolist()
    steps = {
        "plan": lambda epoch: crops.plan(recipe, index.boxes, 0, epoch, ids),
        "targets": lambda epoch: targets.targets(
            plans[epoch].xyxy, plans[epoch].labels, plans[epoch].counts, image_ids
        ),
    }
    out = {"batch": b}
    for name, f in steps.items():
        times = []
        for epoch in range(50):
            t0 = time.perf_counter()
            f(epoch)
            times.append(time.perf_counter() - t0)
        out[f"{name}_ms"] = 1000 * statistics.median(times)
    return out


def run(args) -> dict | None:
    if args.job:
        return job(args)
    if args.smoke:
        args.images, args.width, args.height, args.batch_size = 40, 320, 240, 16
        args.reps, args.epochs, args.hp_epochs = 1, 1, 2
    args.loaders, scenarios = args.loaders.split(","), args.scenarios.split(",")
    c = coco(args)
    print(f"dataset: {c['files']} files, {c['total_bytes'] / 1e6:.1f} MB, {c['boxes']} boxes ({c['source']})")
    result = {"dataset": c, "python_per_batch": python_per_batch(args)}
    if "prep" in scenarios:
        print(f"prep-bound, batch {args.batch_size}, {args.threads} threads/workers, runs alternating")
        result["prep"] = compare.prep(args, command(args))
    if "hp" in scenarios:
        print("two trials, hp_group='bench-detect' vs separate")
        result["hp"] = compare.hp(args, command(args), "bench-detect")
    return result


def table(results: dict) -> str:
    pb = results["python_per_batch"]
    head = f"coordl's Python per batch of {pb['batch']}: plan {pb['plan_ms']:.2f} ms, targets {pb['targets_ms']:.2f} ms"
    return head + "\n" + compare.table(results)
