"""Single-GPU measurements that feed experiments/simulate.py (paper-size projections).

    python -m experiments.gpu.bench_gpu                         # on an H100/H200-class machine
    python -m experiments.gpu.bench_gpu --device cpu --quick    # smoke run on a CPU (seconds)

Measures, on one device:

1. ``sparsifiers``: selection time of every sparsifier the reproduced systems use, at gradient-sized
   tensors (experiments/bench_sparsifiers.py's ``bench_config``), and per sparsifier a line
   ``seconds = fixed + per_element * numel`` fitted over the sizes (``compress_fit``);
2. ``offload``: the engine's offload worker (``stream`` on CUDA, ``thread`` on CPU) compressing a
   gradient while the main stream computes: time of compute alone, compression alone, both
   serialized and both with the compression offloaded, and the hidden fraction
   ``(serial - offloaded) / min(compute, compression)``;
3. ``models``: the compute-only step time (forward + backward + optimizer step, no communication)
   of the paper-size models at their per-GPU batch (conf/experiment/*.yaml), with synthetic
   batches, plus their parameter counts (all and 1-D) for the byte formulas.

Writes one JSON file (default experiments/gpu/results/gpu_<device>.json; --out to change).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

from ssfusion_lightning.models import build_model

HERE = Path(__file__).resolve().parent

#: sparsifier of each reproduced system (the presets) plus exact top-k as the reference
SPARSIFIERS = ("topk", "dgc", "threshold_reuse", "adtopk", "gaussiank")
#: paper-size workloads: (model, size, kind, per-GPU batch, sequence length or image size)
PAPER_MODELS = [
    ("resnet152", "imagenet", "image", 64, 224),
    ("vit", "large", "image", 32, 224),
    ("gpt2", "large", "lm", 4, 512),
    ("bert", "large", "lm", 32, 128),
]
#: the same shapes at sizes a CPU smoke run can afford
QUICK_MODELS = [
    ("resnet152", "tiny", "image", 2, 8),
    ("vit", "tiny", "image", 2, 32),
    ("gpt2", "tiny", "lm", 2, 16),
    ("bert", "tiny", "lm", 2, 16),
]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device: torch.device, reps: int, warmup: int = 2) -> list[float]:
    for _ in range(warmup):
        fn()
    _sync(device)
    samples = []
    for _ in range(reps):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        samples.append(time.perf_counter() - start)
    return samples


# --------------------------------------------------------------------------- 1. sparsifiers
def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var > 0 else 0.0
    slope = max(slope, 0.0)
    return max(my - slope * mx, 0.0), slope


def bench_sparsifiers(device: torch.device, quick: bool, density: float) -> tuple[list[dict], dict[str, dict]]:
    import inspect

    from experiments.bench_sparsifiers import bench_config

    # bench_sparsifiers is maintained separately: pass the input distribution only where it takes one
    extra = {"distribution": "normal"} if "distribution" in inspect.signature(bench_config).parameters else {}
    numels = [1 << 12, 1 << 14] if quick else [1 << 20, 1 << 24, 1 << 26]
    reps = 3 if quick else 10
    rows = []
    for numel in numels:
        rows += bench_config(numel, density, device, list(SPARSIFIERS), reps, max(2, reps // 2), **extra)
    fits = {}
    for name in SPARSIFIERS:
        points = [(r["numel"], r["median_ms"] / 1e3) for r in rows if r["sparsifier"] == name]
        fixed, per_element = fit_line([float(n) for n, _ in points], [s for _, s in points])
        fits[name] = {"fixed_seconds": fixed, "per_element_seconds": per_element}
    return rows, fits


# --------------------------------------------------------------------------- 2. offload overlap
def bench_offload(device: torch.device, quick: bool, density: float) -> dict[str, Any]:
    from ssfusion_lightning.engine.offload import Offloader
    from ssfusion_lightning.sparsifiers import build_sparsifier

    mode = "stream" if device.type == "cuda" else "thread"
    size = 128 if quick else 4096
    numel = (1 << 14) if quick else (1 << 24)
    reps = 3 if quick else 10
    a = torch.randn(size, size, device=device)
    grad = torch.randn(numel, device=device)
    sparsifier = build_sparsifier("dgc", density=density)
    k = max(1, math.floor(density * numel))
    chain = 4 if quick else 16

    def compute() -> None:
        x = a
        for _ in range(chain):
            x = torch.tanh(x @ a)

    def compress() -> None:
        sparsifier.select(grad, key="offload", k=k)

    offloader = Offloader(mode, device)
    try:
        def both_offloaded() -> None:
            future = offloader.submit(compress)
            compute()
            future.result()

        def both_serial() -> None:
            compute()
            compress()

        t_compute = statistics.median(timed(compute, device, reps))
        t_compress = statistics.median(timed(compress, device, reps))
        t_serial = statistics.median(timed(both_serial, device, reps))
        t_offloaded = statistics.median(timed(both_offloaded, device, reps))
    finally:
        offloader.shutdown()
    hidden = (t_serial - t_offloaded) / min(t_compute, t_compress) if min(t_compute, t_compress) > 0 else 0.0
    return {
        "mode": mode, "numel": numel, "density": density, "compute_ms": 1e3 * t_compute,
        "compress_ms": 1e3 * t_compress, "serial_ms": 1e3 * t_serial, "offloaded_ms": 1e3 * t_offloaded,
        "hidden_fraction": min(1.0, max(0.0, hidden)), "hidden_fraction_raw": hidden,
    }


# --------------------------------------------------------------------------- 3. compute-only step times
def _batch(kind: str, model: torch.nn.Module, batch: int, length: int, device: torch.device):
    if kind == "image":
        classes = model.head.out_features if hasattr(model, "head") else 1000
        return torch.randn(batch, 3, length, length, device=device), torch.randint(classes, (batch,), device=device)
    vocab = model.vocab_size if hasattr(model, "vocab_size") else 256
    tokens = torch.randint(vocab, (batch, length), device=device)
    return tokens, torch.randint(vocab, (batch, length), device=device)


def bench_model(spec: tuple, device: torch.device, reps: int, precision: str) -> dict[str, Any]:
    name, size, kind, batch, length = spec
    model = build_model(name, size).to(device)
    params = [p for p in model.parameters() if p.requires_grad]
    inputs, targets = _batch(kind, model, batch, length, device)
    optimizer = torch.optim.SGD(params, lr=1e-3, momentum=0.9) if kind == "image" else torch.optim.AdamW(params, lr=1e-4)
    autocast = (
        torch.autocast(device_type=device.type, dtype=torch.bfloat16)
        if precision == "bf16-mixed" else _null()
    )

    def step() -> None:
        with autocast:
            logits = model(inputs)
            loss = F.cross_entropy(logits.flatten(0, logits.dim() - 2).float() if logits.dim() > 2 else logits.float(),
                                   targets.flatten() if logits.dim() > 2 else targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    samples = timed(step, device, reps, warmup=1 if reps <= 2 else 3)
    row = {
        "model": name, "size": size, "kind": kind, "batch": batch, "length": length, "precision": precision,
        "params": sum(p.numel() for p in params), "params_1d": sum(p.numel() for p in params if p.dim() < 2),
        "tensors": len(params), "largest_tensor": max(p.numel() for p in params),
        "step_ms": 1e3 * statistics.median(samples), "step_ms_p25": 1e3 * _quantile(samples, 0.25),
        "step_ms_p75": 1e3 * _quantile(samples, 0.75), "reps": reps,
    }
    if device.type == "cuda":
        row["max_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        torch.cuda.reset_peak_memory_stats(device)
    return row


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _quantile(values: list[float], q: float) -> float:
    values = sorted(values)
    pos = q * (len(values) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return values[lo] + (values[hi] - values[lo]) * (pos - lo)


# --------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda, cuda:i or cpu")
    parser.add_argument("--quick", action="store_true", help="tiny sizes and few repetitions (smoke run)")
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument("--precision", default=None, choices=["32", "bf16-mixed"],
                        help="model step precision (default: bf16-mixed on CUDA, 32 on CPU)")
    parser.add_argument("--reps", type=int, default=None, help="timed steps per model")
    parser.add_argument("--models", nargs="*", default=None, help="subset of model names")
    parser.add_argument("--skip", nargs="*", default=[], choices=["sparsifiers", "offload", "models"])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("CUDA is not available here; run with --device cpu --quick for a smoke test", file=sys.stderr)
        return 2
    precision = args.precision or ("bf16-mixed" if device.type == "cuda" else "32")
    result: dict[str, Any] = {
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__, "quick": args.quick, "density": args.density, "precision": precision,
        "threads": torch.get_num_threads(),
    }
    started = time.perf_counter()
    if "sparsifiers" not in args.skip:
        result["sparsifiers"], result["compress_fit"] = bench_sparsifiers(device, args.quick, args.density)
    if "offload" not in args.skip:
        result["offload"] = bench_offload(device, args.quick, args.density)
        print(f"offload: {result['offload']}", file=sys.stderr, flush=True)
    if "models" not in args.skip:
        specs = QUICK_MODELS if args.quick else PAPER_MODELS
        if args.models:
            specs = [s for s in specs if s[0] in args.models]
        reps = args.reps or (2 if args.quick else 10)
        result["models"] = []
        for spec in specs:
            row = bench_model(spec, device, reps, precision)
            if device.type == "cuda":
                torch.cuda.empty_cache()  # the model and its optimizer state died with bench_model's frame
            result["models"].append(row)
            print(f"model: {row['model']} {row['size']} batch {row['batch']}: {row['step_ms']:.1f} ms/step, "
                  f"{row['params'] / 1e6:.1f}M params", file=sys.stderr, flush=True)
    result["wall_seconds"] = time.perf_counter() - started
    out = args.out or HERE / "results" / f"gpu_{device.type}{'_quick' if args.quick else ''}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
