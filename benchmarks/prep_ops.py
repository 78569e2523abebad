"""Where a sample's prep time goes: imagenet-train's DALI operators at 224, alone and together, on the CPU.

Each line a DALI pipeline fed from memory, encoded or decoded images, the same crop windows and flips (computed
once, outside it), for ``--seconds``: ms per sample and thread, the bound of what the decoded tier buys bit for bit
(docs/decoded-tier.md); ``--max-short-side N``: images capped at N too.

    python -m benchmarks prep_ops --data /var/tmp/coordl-bench/bench --images 4436 --classes 100
"""

import functools
import itertools
import time
from pathlib import Path

import numpy as np

from benchmarks.harness import dataset
from benchmarks.harness.report import log


def options(p) -> None:
    dataset.add_dataset_options(p, data="/var/tmp/coordl-bench/bench", images=4436, classes=100)
    p.add_argument("--samples", type=int, default=640, help="distinct images cycled through")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seconds", type=float, default=3.0, help="timed per pipeline")
    p.add_argument("--max-short-side", type=int, nargs="*", default=[256])


def run(args) -> dict | None:
    from nvidia.dali import fn, pipeline_def, types

    from coordl import draws
    from coordl.prep import windows
    from coordl.prep.recipes import IMAGENET_MEAN, IMAGENET_STD

    data = dataset.dataset_from_args(args)
    files = sorted(f for f in Path(data["root"]).rglob("*") if f.is_file())[: args.samples]
    encoded = [np.fromfile(f, dtype=np.uint8) for f in files]
    B, T = args.batch, args.threads
    norm = {"mean": [m * 255 for m in IMAGENET_MEAN], "std": [s * 255 for s in IMAGENET_STD]}

    def pipeline(build, feeds, **kw):
        """A pipeline of ``build`` over ``feeds``' batches, cycled."""
        it = itertools.cycle([tuple(f[a : a + B] for f in feeds) for a in range(0, len(feeds[0]), B)])

        @pipeline_def(batch_size=B, num_threads=T, device_id=None, **kw)
        def pipe():
            return build(*fn.external_source(source=lambda: next(it), num_outputs=len(feeds), batch=True))

        (p := pipe()).build()
        return p

    def outputs(build, inputs) -> list:
        """``build`` run once over ``inputs``."""
        p = pipeline(build, [inputs], exec_async=False, exec_pipelined=False, prefetch_queue_depth=1)
        return [np.array(t) for _ in range(0, len(inputs), B) for t in p.run()[0]]

    def timed(name, build, feeds) -> dict:
        p = pipeline(build, feeds, prefetch_queue_depth=2)
        for _ in range(4):
            p.run()
        t0, k = time.perf_counter(), 0
        while time.perf_counter() - t0 < args.seconds:
            p.run()
            k += 1
        rate = k * B / (time.perf_counter() - t0)
        log(f"  {name:44s} {rate:7.0f} samples/s  {T * 1e3 / rate:5.2f} ms/sample/thread")
        return {"name": name, "samples_per_s": rate, "ms_per_sample_thread": T * 1e3 / rate}

    def decode(x, cap=None):
        images = fn.decoders.image(x, output_type=types.RGB)
        return images if cap is None else fn.resize(images, resize_shorter=cap)

    resize = functools.partial(fn.resize, resize_x=224, resize_y=224)

    def tail(images, mirror):
        kw = {"dtype": types.FLOAT, "output_layout": "CHW", "mirror": mirror, **norm}
        return fn.crop_mirror_normalize(resize(images), **kw)

    def windows_of(images):
        h, w = np.array([im.shape[:2] for im in images]).T
        u = windows.shape_free(draws.uniforms(0, 0, np.arange(len(images)), windows.COLUMNS), (0.08, 1), (3 / 4, 4 / 3))
        anchor, size = windows.crop_windows(h, w, u, (3 / 4, 4 / 3))
        return list(anchor), list(size), list(windows.flips(u, 0.5)[:, None])

    window = {"axis_names": "WH", "normalized_anchor": False, "normalized_shape": False}
    islice = functools.partial(fn.decoders.image_slice, output_type=types.RGB, **window)
    slice_ = functools.partial(fn.slice, **window)

    def full(cut):  # the window cut, resized, normalised
        return lambda d, a, s, m: tail(cut(d, a, s), m)

    decoded = outputs(decode, encoded)
    anchor, size, mirror = windows_of(decoded)
    cut = zip(decoded, np.array(anchor, dtype=int), np.array(size, dtype=int), strict=True)
    crops = [np.ascontiguousarray(im[y : y + h, x : x + w]) for im, (x, y), (w, h) in cut]
    log(f"{len(files)} images, {T} threads, batch {B}:")
    cases = [
        ("encoded: decode window, resize, normalise", full(islice), [encoded, anchor, size, mirror]),
        ("encoded: decode window", islice, [encoded, anchor, size]),
        ("decoded: slice, resize, normalise", full(slice_), [decoded, anchor, size, mirror]),
        ("decoded: slice", slice_, [decoded, anchor, size]),
        ("window given: resize, normalise", tail, [crops, mirror]),
        ("window given: resize", resize, [crops]),
    ]
    for cap in args.max_short_side:
        capped = outputs(lambda x, cap=cap: decode(x, cap), encoded)
        c_anchor, c_size, c_mirror = windows_of(capped)
        capped_cut = full(lambda d, a, s, cap=cap: slice_(decode(d, cap), a, s))
        cases += [
            (f"capped {cap}, encoded: decode, cap, slice, ...", capped_cut, [encoded, c_anchor, c_size, c_mirror]),
            (f"capped {cap}, decoded: slice, resize, normalise", full(slice_), [capped, c_anchor, c_size, c_mirror]),
        ]
    lines = [timed(name, build, feeds) for name, build, feeds in cases]
    return {"dataset": data, "samples": len(files), "threads": T, "batch": B, "lines": lines}
