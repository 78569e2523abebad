"""A COCO-sized detection index: Index.from_coco cold and from its saved file, and its boxes' memory.

An annotations file shaped like COCO's ``instances_train2017.json`` (``--images`` 118,287 images,
about ``--boxes-per-image`` 7.3 boxes each, 1% crowd, COCO's 80 category ids, sizes around 640x480)
and an empty file per image in ``--data`` (``from_coco`` reads sizes, not pixels); then, each in a
fresh Python, ``Index.from_coco`` cold (parse, check, stat every image, save) and finding the saved
index (``--loads`` times, median). The files are deleted at the end unless ``--keep``.

    python -m benchmarks coco_index
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import time
from pathlib import Path

import numpy as np

from benchmarks.harness import jobs
from benchmarks.index_scale import fresh

CATEGORIES = [i for i in range(1, 91) if i not in (12, 26, 29, 30, 45, 66, 68, 69, 71, 83)]  # COCO's 80 ids


def make(data: Path, images: int, per_image: float, seed: int) -> tuple[Path, Path, float]:
    """The images folder and the annotations file (made unless already there), and seconds it took."""
    folder, ann = data / "train2017", data / "annotations" / f"instances_train_{images}.json"
    if ann.exists():
        return folder, ann, 0.0
    t0 = time.perf_counter()
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    ann.parent.mkdir(parents=True, exist_ok=True)
    widths, heights = rng.integers(320, 641, images), rng.integers(240, 481, images)
    counts = rng.poisson(per_image, images)
    doc = {"images": [], "annotations": [], "categories": [{"id": c, "name": f"c{c}"} for c in CATEGORIES]}
    ann_id = 0
    for i in range(images):
        name = f"{i + 1:012d}.jpg"
        (folder / name).write_bytes(b"x")
        w, h = int(widths[i]), int(heights[i])
        doc["images"].append({"id": i + 1, "file_name": name, "width": w, "height": h})
        for _ in range(int(counts[i])):
            bw, bh = float(rng.uniform(2, w / 2)), float(rng.uniform(2, h / 2))
            x, y = float(rng.uniform(0, w - bw)), float(rng.uniform(0, h - bh))
            ann_id += 1
            box, category = [round(x, 2), round(y, 2), round(bw, 2), round(bh, 2)], int(rng.choice(CATEGORIES))
            one = {"id": ann_id, "image_id": i + 1, "category_id": category, "bbox": box, "area": bw * bh}
            doc["annotations"].append(one | {"iscrowd": int(rng.random() < 0.01)})
    ann.write_text(json.dumps(doc))
    return folder, ann, time.perf_counter() - t0


def child(images: str, annotations: str, index_dir: str) -> dict:
    import coordl

    t0 = time.perf_counter()
    index = coordl.Index.from_coco(images, annotations, index_dir=index_dir)
    seconds, b = time.perf_counter() - t0, index.boxes
    arrays = sum(a.nbytes for a in (b.offsets, b.xyxy, b.labels, b.image_sizes, b.image_ids))
    out = {"seconds": seconds, "images": len(index), "boxes": int(len(b.labels)), "box_bytes": arrays}
    return out | {"file_bytes": os.path.getsize(index.saved_path)}


def options(p) -> None:
    p.add_argument("--data", type=Path, default=Path("/var/tmp/coordl-bench/coco-index"))
    p.add_argument("--images", type=int, default=118_287)
    p.add_argument("--boxes-per-image", type=float, default=7.3)
    p.add_argument("--loads", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--keep", action="store_true")
    p.add_argument("--child", nargs=3, help=argparse.SUPPRESS)  # IMAGES ANNOTATIONS INDEX_DIR: one from_coco


def run(a) -> dict | None:
    if a.child:
        return jobs.say(**child(*a.child))
    folder, ann, made_s = make(a.data, a.images, a.boxes_per_image, a.seed)
    index_dir, annotations_bytes = a.data / "index", ann.stat().st_size
    shutil.rmtree(index_dir, ignore_errors=True)
    try:
        cold, *loads = (
            fresh("coco_index", "--child", str(folder), str(ann), str(index_dir)) for _ in range(1 + a.loads)
        )
    finally:
        shutil.rmtree(index_dir, ignore_errors=True)
        if not a.keep:
            shutil.rmtree(a.data, ignore_errors=True)
    r = {"annotations_bytes": annotations_bytes, "made_s": made_s}
    r |= {k: cold[k] for k in ("images", "boxes", "box_bytes")} | {"index_file_bytes": cold["file_bytes"]}
    return r | {
        "cold_s": cold["seconds"],
        "load_s": statistics.median(x["seconds"] for x in loads),
        "loads_s": [x["seconds"] for x in loads],
    }


def table(r: dict) -> str:
    return (
        f"{r['images']:,} images, {r['boxes']:,} boxes\ncold (parse, check, stat, save): {r['cold_s']:.1f} s\n"
        f"from the saved index: {r['load_s'] * 1e3:.0f} ms\n"
        f"boxes in memory: {r['box_bytes'] / 1e6:.1f} MB; index file {r['index_file_bytes'] / 1e6:.1f} MB"
    )
