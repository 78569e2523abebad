"""ResNet-50 training on one GPU fed by four loaders, and the same loaders' prep alone (issue 46).

``coordl`` (GPU decode), ``dali`` (DALI's own GPU pipeline), ``coordl-cpu`` (batches copied to the GPU) and
``torch`` (:mod:`benchmarks.loaders`), each in a child: a warm-up epoch, then ``--epochs`` of ``train`` (a bf16
ResNet-50 step per batch) and ``prep`` (the batches alone), alternating; loaders ABBA for ``--reps``. Per loader
and mode: samples/s, stall fraction (time in ``next()``, and coordl's ``stall_s``, over epoch time), CPU seconds
per sample; the JSON written after every run, a run skipped when less of ``--budget`` is left than one took.

    python -m benchmarks gpu --out benchmarks/results/gpu.json      # on the GPU machine, < 6 minutes
    python -m benchmarks gpu --cpu-smoke --out /tmp/gpu-smoke.json  # the CPU side: ~1 minute on 2 cores
"""

import argparse
import importlib.util
import os
import statistics
import time

from benchmarks.harness import cli, compare, dataset, jobs, limits, measure, report
from benchmarks.loaders import Loader, model

DATA, SMOKE_DATA = "/var/tmp/coordl-bench/gpu", "/var/tmp/coordl-bench/gpu-smoke"
LOADERS = ("coordl", "dali", "coordl-cpu", "torch")
MODES, WARMUP = ("train", "prep"), 1  # a run: WARMUP epochs of train, then each mode --epochs times
CLASSES = 1000  # the model's outputs: ImageNet's head, whatever the dataset's folders


class TrainStep:
    """One training step of ``arch`` per batch: forward and loss under bf16 autocast, channels_last
    activations, backward, SGD with momentum; on GPU ``device_id`` or (None) the CPU."""

    def __init__(self, arch: str, device_id: int | None):
        import torch

        torch.manual_seed(0)
        self.device = torch.device("cpu" if device_id is None else f"cuda:{device_id}")
        net, self.origin = model(arch, CLASSES)
        self.model = net.to(self.device, memory_format=torch.channels_last).train()
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
        self.loss = torch.nn.CrossEntropyLoss()
        self.params = sum(p.numel() for p in self.model.parameters())

    def __call__(self, batch) -> None:
        import torch

        images = batch[0].contiguous(memory_format=torch.channels_last)
        with torch.autocast(self.device.type, dtype=torch.bfloat16):
            loss = self.loss(self.model(images), batch[1])
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()  # no .item(): the loop does not wait for the GPU between steps


def job(args) -> None:
    """One loader in this process: a warm-up epoch, then ``--epochs`` epochs of each mode, alternating;
    prints its figures as JSON, last."""
    import torch

    device_id = None if args.cpu_smoke else args.device_id
    if device_id is not None:
        torch.cuda.set_device(device_id)
        torch.backends.cudnn.benchmark = True
    sync = (lambda: torch.cuda.synchronize(device_id)) if device_id is not None else (lambda: None)  # GPU work done
    t0 = time.perf_counter()
    loader = Loader(args.job, args.data, args.batch_size, args.threads, seed=1, device_id=device_id)
    step = TrainStep(args.arch, device_id)
    out = {"loader": args.job, "device_id": device_id, "samples": loader.n, "model": args.arch, "epochs": []}
    out |= {"model_from": step.origin, "params": step.params, "build_s": time.perf_counter() - t0}
    schedule = [("train", True)] * WARMUP + [(m, False) for _ in range(args.epochs) for m in MODES]
    try:
        for k, (mode, warmup) in enumerate(schedule):
            e = measure.timed(loader.batches(k), step if mode == "train" else None, sync)
            e |= {"mode": mode, "warmup": warmup}
            if last := e.pop("last"):
                e |= {"shape": list(last[0].shape), "device": str(last[0].device)}
            if (stats := loader.counters()) is not None:
                e["stats"] = stats
            out["epochs"].append(e)
            rate = e["samples"] / e["seconds"]
            print(f"    {args.job} epoch {k} {mode}{' (warm-up)' if warmup else ''}: {rate:.1f} samples/s")
    finally:
        loader.close()
    if device_id is not None:
        out["gpu"] = torch.cuda.get_device_name(device_id)
        out["peak_gpu_memory_bytes"] = torch.cuda.max_memory_allocated(device_id)
    jobs.say(**out)


def summary(run: dict) -> dict:
    """Per mode, over the measured epochs: samples/s, stall fractions and CPU seconds per sample."""
    out = {}
    for mode in MODES:
        if es := [e for e in run["epochs"] if e["mode"] == mode and not e["warmup"]]:
            seconds = sum(e["seconds"] for e in es)
            out[mode] = {"epochs": len(es), **measure.steady({"epochs": es})}
            out[mode]["stall_fraction"] = sum(e["wait_s"] for e in es) / seconds
            if all("stats" in e for e in es):  # coordl's own accounting
                out[mode]["stats_stall_fraction"] = sum(e["stats"]["stall_s"] for e in es) / seconds
    return out


def medians(result: dict) -> dict:
    """Per loader and mode, the median of the runs' figures; and coordl's ratios to each other loader."""
    med: dict[str, dict] = {}
    for name, runs in result["runs"].items():
        if cells := [r["summary"] for r in runs if "summary" in r]:
            med[name] = {m: {k: statistics.median(c[m][k] for c in cells) for k in s} for m, s in cells[0].items()}
    c = med.get("coordl", {})
    pairs = [(o, m) for o in med if o != "coordl" for m in c if m in med[o]]
    ratios = {f"coordl/{o} {m}": c[m]["samples_per_s"] / med[o][m]["samples_per_s"] for o, m in pairs}
    return {"median": med, "ratios": ratios}


def images(args) -> dict:
    """Makes (or finds) the dataset and reads every file once, so that it is in the page cache."""
    if lacking := [m for m in ("PIL", "tqdm") if importlib.util.find_spec(m) is None]:
        lacking = " and ".join(lacking)  # coordl.tools.datagen writes JPEGs with Pillow, shows progress with tqdm
        raise SystemExit(f"cannot make the dataset: {lacking} not installed (GPU machine: scripts/gpu_extras.sh)")
    t0 = time.perf_counter()
    figures = dataset.dataset_from_args(args)
    figures["make_s"], t0 = time.perf_counter() - t0, time.perf_counter()
    read = limits.read_through(os.path.join(d, f) for d, _, files in os.walk(figures["root"]) for f in files)
    return figures | {"page_cache_read_s": time.perf_counter() - t0, "page_cache_read_bytes": read}


def options(p) -> None:
    p.add_argument("--job", choices=LOADERS, help=argparse.SUPPRESS)
    dataset.add_dataset_options(p, data=None, images=20000, classes=100)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="DALI threads / DataLoader workers (all CPUs)")
    p.add_argument("--epochs", type=int, default=1, help="measured epochs of each mode per run (default: 1)")
    p.add_argument("--reps", type=int, default=1, help="rounds of runs, in a rotating order (default: 1)")
    p.add_argument("--loaders", default=",".join(LOADERS), help="(default: %(default)s)")
    p.add_argument("--arch", default="resnet50", help="the model (default: resnet50; --cpu-smoke: resnet_tiny)")
    p.add_argument("--device-id", type=int, default=0, help="the GPU (default: 0)")
    p.add_argument("--budget", type=float, default=330.0, help="seconds for the runs, data included (default: 330)")
    p.add_argument("--run-timeout", type=float, default=120.0, help="seconds one loader's run may take (default: 120)")
    smoke = "the CPU side: 64 small images, every loader on the CPU (DataLoader: 2 workers), resnet_tiny, batch 16"
    p.add_argument("--cpu-smoke", action="store_true", help=smoke)


def run(args) -> dict | None:
    if args.job:
        return job(args)
    started = time.perf_counter()
    args.data = args.data or (SMOKE_DATA if args.cpu_smoke else DATA)
    args.synthetic = args.synthetic or not args.photos  # the photographs do not travel to the GPU machine
    if args.cpu_smoke:
        args.images, args.classes, args.width, args.height = 64, 4, 160, 120
        args.batch_size, args.threads, args.epochs, args.reps = 16, 2, 1, 1
        args.arch = "resnet_tiny" if args.arch == "resnet50" else args.arch
    args.loaders = args.loaders.split(",")
    if not args.cpu_smoke and not importlib.import_module("torch").cuda.is_available():
        raise SystemExit("no CUDA device: run this on a GPU machine, or --cpu-smoke for its CPU side")
    data = images(args)
    args.root = data["root"]
    print(f"dataset: {dataset.describe(data)}, in the page cache after {data['page_cache_read_s']:.1f} s")
    config = {k: getattr(args, k) for k in ("batch_size", "threads", "epochs", "reps", "arch")} | {"warmup": WARMUP}
    config |= {"device": "cpu" if args.cpu_smoke else f"cuda:{args.device_id}", "budget_s": args.budget}
    result = {"cpu_smoke": args.cpu_smoke, "dataset": data, "config": config}
    print(f"{config}: runs in ABBA order")
    kw = {k: getattr(args, k) for k in ("batch_size", "threads", "epochs", "arch", "device_id", "cpu_smoke")}
    command = lambda name: jobs.scenario_command("gpu", *jobs.flags(job=name, data=args.root, **kw))  # noqa: E731
    saved = lambda runs: cli.save(args, result | {"runs": runs})  # noqa: E731 (what finished survives an interruption)
    when = {"deadline": started + args.budget, "timeout": args.run_timeout, "saved": saved}
    result["runs"] = compare.alone(args.loaders, args.reps, command, lambda run: {"summary": summary(run)}, **when)
    result |= medians(result)
    result["wall_s"] = time.perf_counter() - started
    if [r for rs in result["runs"].values() for r in rs if "error" in r]:
        cli.save(args, result)
        print(table(result))
        raise SystemExit(f"a run failed; wrote {args.out}")
    return result


def table(result: dict) -> str:
    rows = []
    for name, runs in result["runs"].items():
        for mode, m in result["median"].get(name, {}).items():
            rows.append([name, mode, m["samples_per_s"], f"{m['stall_fraction']:.3f}"])
            rows[-1] += [m.get("stats_stall_fraction"), f"{1000 * m['cpu_s_per_sample']:.2f}"]
        rows += [[name, "-", r.get("skipped") or r["error"].splitlines()[-1]] for r in runs if "summary" not in r]
    head = "loader|mode|samples/s|stall (next)|stall (stats)|CPU-ms/sample"
    return "\n".join([report.table(head, rows), *(f"{key}: {r:.3f}" for key, r in result["ratios"].items())])
