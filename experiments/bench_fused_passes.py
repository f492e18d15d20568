"""Would fusing error feedback's compensation into the selection's first pass make it cheaper on CPU?

    python -m experiments.bench_fused_passes                 # gpt2_10m's 24 sparse weight matrices
    python -m experiments.bench_fused_passes --quick         # smoke run (seconds)

The engine compensates a tensor (c = residual + gradient, a full-size result) and then makes the
selection's one pass over it (``selection.indices_at_least``: |c| into a scratch, compare, collect
positions). A fused kernel would read the residual and the gradient once and keep c in cache. This
measures the three ways torch and numpy can do that work, on tensors of the sizes the engine sees
(one round: every tensor once, in turn, so the inputs come from memory, not from cache):

- ``fresh``: c as a new tensor per call (``Memory.compensate``), then the selection pass;
- ``reused``: c written into one buffer reused across calls (``Memory.compensate_into``), then the pass;
- ``chunk_fused``: per chunk of ``--chunk`` elements, c = r + g, |c|, compare and positions while
  the chunk is in cache; c never exists whole.

Each variant returns the same positions and values (checked). Reported per variant: the median
time of a round over interleaved rounds, its ratio to ``reused`` and the minor page faults per
round (a fresh multi-MiB result that the allocator maps anew is page-faulted in on first touch).
One thread (``torch.set_num_threads(1)``), as each rank runs in the end-to-end benchmark.

Writes experiments/results/fused_passes.{csv,md,png} (or --out DIR) and prints the table.
"""

from __future__ import annotations

import argparse
import platform
import resource
import statistics
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from experiments.common import RESULTS, pyplot, save_figure, write_csv
from ssfusion_lightning.sparsifiers.selection import indices_at_least

#: gpt2_10m (dim 384, depth 6): per block qkv, projection and the two MLP matrices
GPT2_10M = [384 * 1152, 384 * 384, 384 * 1536, 1536 * 384] * 6
#: the share of elements at or above the pass's threshold (the DGC search floor's, about 1.7%)
SHARE = 0.017
FIELDS = ("variant", "tensors", "elements", "chunk", "median_ms", "x_reused", "faults_per_round")

Round = Callable[[], list[tuple[np.ndarray, np.ndarray]]]


def inputs(numels: list[int], seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor], list[float]]:
    """Residuals, heavy-tailed gradients and each tensor's threshold (the top ``SHARE`` of |r + g|)."""
    generator = torch.Generator().manual_seed(seed)
    residuals = [0.1 * torch.randn(n, generator=generator) for n in numels]
    grads = [torch.randn(n, generator=generator) * torch.rand(n, generator=generator) for n in numels]
    thresholds = [float(torch.quantile((r + g)[: 1 << 16].abs(), 1 - SHARE)) for r, g in zip(residuals, grads)]
    return residuals, grads, thresholds


def variants(residuals: list[torch.Tensor], grads: list[torch.Tensor], thresholds: list[float], chunk: int) -> dict[str, Round]:
    largest = max(r.numel() for r in residuals)
    reused = torch.empty(largest)
    piece, magnitude, mask = torch.empty(chunk), torch.empty(chunk), np.empty(chunk, dtype=bool)
    piece_np, magnitude_np = piece.numpy(), magnitude.numpy()

    def selected(c: torch.Tensor, threshold: float) -> tuple[np.ndarray, np.ndarray]:
        positions = indices_at_least(c, threshold)
        return positions.numpy(), c.index_select(0, positions).numpy()

    def fresh() -> list[tuple[np.ndarray, np.ndarray]]:
        return [selected(r + g, t) for r, g, t in zip(residuals, grads, thresholds)]

    def into_reused() -> list[tuple[np.ndarray, np.ndarray]]:
        return [selected(torch.add(r, g, out=reused[: r.numel()]), t) for r, g, t in zip(residuals, grads, thresholds)]

    def chunk_fused() -> list[tuple[np.ndarray, np.ndarray]]:
        out = []
        for r, g, t in zip(residuals, grads, thresholds):
            positions, values = [], []
            for start in range(0, r.numel(), chunk):
                length = min(chunk, r.numel() - start)
                torch.add(r[start : start + length], g[start : start + length], out=piece[:length])
                torch.abs(piece[:length], out=magnitude[:length])
                np.greater_equal(magnitude_np[:length], np.float32(t), out=mask[:length])
                hits = np.flatnonzero(mask[:length])
                values.append(piece_np[:length][hits])
                positions.append(hits + start)
            out.append((np.concatenate(positions), np.concatenate(values)))
        return out

    return {"fresh": fresh, "reused": into_reused, "chunk_fused": chunk_fused}


def measure(rounds: dict[str, Round], repeats: int) -> dict[str, tuple[list[float], float]]:
    """Interleaved rounds: per variant its round times and its minor page faults per round."""
    times: dict[str, list[float]] = {name: [] for name in rounds}
    faults: dict[str, int] = {name: 0 for name in rounds}
    for fn in rounds.values():
        fn()
    for _ in range(repeats):
        for name, fn in rounds.items():
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            started = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - started)
            faults[name] += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    return {name: (times[name], faults[name] / repeats) for name in rounds}


def check_equal(rounds: dict[str, Round]) -> None:
    reference = rounds["reused"]()
    for name, fn in rounds.items():
        for (p, v), (p0, v0) in zip(fn(), reference):
            if not (np.array_equal(p, p0) and np.array_equal(v, v0)):
                raise AssertionError(f"{name} selected other positions or values than reused")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: small tensors, few rounds")
    parser.add_argument("--repeats", type=int, default=31, help="rounds per variant, interleaved")
    parser.add_argument("--chunk", type=int, default=1 << 18, help="elements per chunk of chunk_fused")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--name", default="fused_passes")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    numels = [n // 64 for n in GPT2_10M[:8]] if args.quick else GPT2_10M
    repeats = 3 if args.quick else args.repeats
    residuals, grads, thresholds = inputs(numels, args.seed)
    rounds = variants(residuals, grads, thresholds, min(args.chunk, max(numels)))
    check_equal(rounds)
    measured = measure(rounds, repeats)
    base = statistics.median(measured["reused"][0])
    rows = [
        {
            "variant": name, "tensors": len(numels), "elements": sum(numels), "chunk": args.chunk if name == "chunk_fused" else "",
            "median_ms": round(1e3 * statistics.median(times), 3), "x_reused": round(statistics.median(times) / base, 3),
            "faults_per_round": round(faults, 1),
        }
        for name, (times, faults) in measured.items()
    ]
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(args.out / f"{args.name}.csv", FIELDS, rows)
    header = (
        f"Compensation and the selection's first pass, one round over {len(numels)} tensors ({sum(numels):,} fp32 "
        f"elements, {100 * SHARE:.1f}% at or above the threshold); 1 thread, {platform.machine()}, torch "
        f"{torch.__version__}; medians of {repeats} interleaved rounds.\n\n"
        "| variant | median ms | x reused | minor page faults per round |\n|---|---:|---:|---:|\n"
    )
    table = header + "".join(f"| {r['variant']} | {r['median_ms']} | {r['x_reused']} | {r['faults_per_round']} |\n" for r in rows)
    (args.out / f"{args.name}.md").write_text(table)
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5, 3))
    ax.bar([r["variant"] for r in rows], [r["median_ms"] for r in rows], color=["#bbb", "#4a7", "#47a"])
    ax.set_ylabel("ms per round (median)")
    ax.set_title(f"compensate + select pass, {sum(numels) / 1e6:.1f}M elements")
    save_figure(fig, args.out / f"{args.name}.png")
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
