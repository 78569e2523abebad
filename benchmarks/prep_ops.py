"""Where a sample's prep time goes: imagenet-train's DALI operators at 224, alone and together, on the CPU.

From encoded bytes and from decoded images.

    python -m benchmarks prep_ops --data /var/tmp/coordl-bench/bench --images 4436 --classes 100

Each line is a DALI pipeline fed without a break, from memory, with the same crop windows and
flips (computed once, outside the pipeline), for ``--seconds``; the milliseconds are per sample
and per thread. They bound what the decoded tier can buy bit for bit: a decoded image skips the
decode of its window, not its slice, resize and normalisation. ``--max-short-side N`` adds the
same with images capped at a shorter side of N (``ImageNetTrain(max_short_side=N)``).
Writes ``prep_ops.json`` to ``--out``.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from benchmarks.harness import cli, dataset
from benchmarks.harness.report import log

OUT = str(cli.RESULTS)  # a folder: prep_ops.json


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
    mean = [m * 255 for m in IMAGENET_MEAN]
    std = [s * 255 for s in IMAGENET_STD]

    def run_once(inputs, build):
        @pipeline_def(
            batch_size=B, num_threads=T, device_id=None, exec_async=False, exec_pipelined=False, prefetch_queue_depth=1
        )
        def pipe():
            return build(fn.external_source(name="x", dtype=types.UINT8, ndim=1))

        out = []
        p = pipe()
        p.build()
        for a in range(0, len(inputs), B):
            p.feed_input("x", inputs[a : a + B])
            out += [np.array(t) for t in p.run()[0]]
        return out

    def decode(x, cap=None):
        images = fn.decoders.image(x, output_type=types.RGB)
        return images if cap is None else fn.resize(images, resize_shorter=cap)

    def timed(name, build, feeds) -> dict:
        n = len(feeds[0])

        def source():
            k = 0
            while True:
                a = (k * B) % n
                k += 1
                yield tuple(f[a : a + B] for f in feeds)

        it = source()

        @pipeline_def(batch_size=B, num_threads=T, device_id=None, prefetch_queue_depth=2)
        def pipe():
            return build(*fn.external_source(source=lambda: next(it), num_outputs=len(feeds), batch=True))

        p = pipe()
        p.build()
        for _ in range(4):
            p.run()
        t0, k = time.perf_counter(), 0
        while time.perf_counter() - t0 < args.seconds:
            p.run()
            k += 1
        dt = time.perf_counter() - t0
        rate = k * B / dt
        log(f"  {name:44s} {rate:7.0f} samples/s  {T * 1e3 / rate:5.2f} ms/sample/thread")
        return {"name": name, "samples_per_s": rate, "ms_per_sample_thread": T * 1e3 / rate}

    def tail(images, mirror):
        images = fn.resize(images, resize_x=224, resize_y=224)
        kw = {"dtype": types.FLOAT, "output_layout": "CHW", "mirror": mirror, "mean": mean, "std": std}
        return fn.crop_mirror_normalize(images, **kw)

    def windows_of(images):
        h, w = np.array([im.shape[:2] for im in images]).T
        u = windows.shape_free(draws.uniforms(0, 0, np.arange(len(images)), windows.COLUMNS), (0.08, 1), (3 / 4, 4 / 3))
        anchor, size = windows.crop_windows(h, w, u, (3 / 4, 4 / 3))
        return list(anchor), list(size), list(windows.flips(u, 0.5)[:, None])

    def cut(images, anchor, size):
        return [
            np.ascontiguousarray(im[int(y) : int(y + s[1]), int(x) : int(x + s[0])])
            for im, (x, y), s in zip(images, anchor, size, strict=True)
        ]

    def islice(d, a, s):
        kw = {"axis_names": "WH", "normalized_anchor": False, "normalized_shape": False, "output_type": types.RGB}
        return fn.decoders.image_slice(d, a, s, **kw)

    def slice_(d, a, s):
        return fn.slice(d, a, s, axis_names="WH", normalized_anchor=False, normalized_shape=False)

    decoded = run_once(encoded, decode)
    anchor, size, mirror = windows_of(decoded)
    crops = cut(decoded, anchor, size)
    log(f"{len(files)} images, {T} threads, batch {B}:")
    full = lambda cut: lambda d, a, s, m: tail(cut(d, a, s), m)  # noqa: E731 - the window cut, resize, normalise
    cases = [
        ("encoded: decode window, resize, normalise", full(islice), [encoded, anchor, size, mirror]),
        ("encoded: decode window", islice, [encoded, anchor, size]),
        ("decoded: slice, resize, normalise", full(slice_), [decoded, anchor, size, mirror]),
        ("decoded: slice", slice_, [decoded, anchor, size]),
        ("window given: resize, normalise", tail, [crops, mirror]),
        ("window given: resize", lambda c: fn.resize(c, resize_x=224, resize_y=224), [crops]),
    ]
    for cap in args.max_short_side:
        capped = run_once(encoded, lambda x, cap=cap: decode(x, cap))
        c_anchor, c_size, c_mirror = windows_of(capped)
        capped_cut = full(lambda d, a, s, cap=cap: slice_(decode(d, cap), a, s))
        cases += [
            (f"capped {cap}, encoded: decode, cap, slice, ...", capped_cut, [encoded, c_anchor, c_size, c_mirror]),
            (f"capped {cap}, decoded: slice, resize, normalise", full(slice_), [capped, c_anchor, c_size, c_mirror]),
        ]
    lines = [timed(name, build, feeds) for name, build, feeds in cases]
    return {"dataset": data, "samples": len(files), "threads": T, "batch": B, "lines": lines}


def out_path(args) -> Path:
    return Path(args.out) / "prep_ops.json"
