"""Benchmark of the sparsifiers: selection time and quality on one large gradient-like tensor.

    python -m experiments.bench_sparsifiers                  # N in {2^20, 2^24}, density in {0.001, 0.01}
    python -m experiments.bench_sparsifiers --device cuda    # adds N = 2^26
    python -m experiments.bench_sparsifiers --quick          # smoke run (seconds)
    python -m experiments.bench_sparsifiers --threads 1 2    # both CPU thread counts, one table

For every (N, density) the input is an fp32 tensor of N standard-normal values (``--distribution``
laplace / student_t3 for heavier tails) shaped as a square-ish matrix (rows = output channels for adtopk; every other sparsifier flattens it), the
same tensor for every sparsifier. Reported per sparsifier:

- ``median_ms`` (and ``mean_ms``): wall time of ``select`` over the repetitions, ``advance()``
  called between them, so stateful sparsifiers run their steady state (threshold_reuse: one
  exact step every ``tau`` = 32, its median is a reuse step, its mean includes the exact ones);
- ``x_abs``: median time / median time of one ``tensor.abs()`` (a fresh N-element result, as any
  out-of-place elementwise op), the abs() timings interleaved with the sparsifier's so both see
  the same machine load;
- ``x_topk``: median time / median time of ``torch.topk(tensor.abs(), k)``;
- ``count_over_k``: selected elements / k, k = max(1, floor(density * N));
- ``mass``: sum of squares of the selected values / that of the true top-k (can exceed 1 for a
  sparsifier that selects more than k).

Writes experiments/results/sparsifiers.{csv,md,png} (or --out DIR) and prints the Markdown table.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from experiments.common import RESULTS, pyplot, save_figure, write_csv
from ssfusion_lightning.sparsifiers import available_sparsifiers, build_sparsifier

#: sparsifiers with a target of the issue: (max x_abs at N = 2^24, density 0.01 on CPU, min mass)
TARGETS = {"topk": (5.0, None), "dgc": (3.0, 0.9), "gaussiank": (3.0, 0.9), "threshold_reuse": (3.0, 0.9)}
FIELDS = [
    "device",
    "threads",
    "numel",
    "density",
    "sparsifier",
    "k",
    "count",
    "count_over_k",
    "mass",
    "median_ms",
    "mean_ms",
    "min_ms",
    "abs_ms",
    "topk_ms",
    "x_abs",
    "x_topk",
    "reps",
]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device: torch.device) -> float:
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


def matrix_shape(numel: int) -> tuple[int, int]:
    rows = 1 << (int(math.log2(numel)) // 2)
    return rows, numel // rows


def make_input(numel: int, distribution: str, generator: torch.Generator) -> torch.Tensor:
    shape = matrix_shape(numel)
    if distribution == "normal":
        return torch.randn(shape, generator=generator)
    if distribution == "laplace":
        u = torch.rand(shape, generator=generator).clamp_(1e-7, 1 - 1e-7)
        return torch.where(u < 0.5, torch.log(2 * u), -torch.log(2 - 2 * u))
    # Student-t with 3 degrees of freedom: heavy tails, like many real gradients
    chi2 = sum(torch.randn(shape, generator=generator) ** 2 for _ in range(3))
    return torch.randn(shape, generator=generator) / torch.sqrt(chi2 / 3)


def bench_config(
    numel: int, density: float, device: torch.device, names: list[str], reps: int, topk_reps: int, distribution: str
):
    generator = torch.Generator().manual_seed(numel ^ int(density * 1e6))
    tensor = make_input(numel, distribution, generator).to(device)
    flat = tensor.reshape(-1)
    k = max(1, math.floor(density * numel))

    true_top = torch.topk(flat.abs(), k).values
    true_mass = float(true_top.double().pow(2).sum())
    for _ in range(2):
        _timed(lambda: flat.abs(), device)
    topk_ms = 1e3 * statistics.median(
        _timed(lambda: torch.topk(flat.abs(), k, sorted=False), device) for _ in range(topk_reps)
    )

    rows = []
    for name in names:
        sparsifier = build_sparsifier(name, density=density)
        values, indices = sparsifier.select(tensor, key="bench", k=k)  # warm-up (and first exact step)
        sparsifier.advance()
        times, abs_times = [], []
        for _ in range(reps):
            abs_times.append(_timed(lambda: flat.abs(), device))
            times.append(_timed(lambda: sparsifier.select(tensor, key="bench", k=k), device))
            sparsifier.advance()
        values, indices = sparsifier.select(tensor, key="bench", k=k)
        assert indices.dtype == torch.int64 and torch.equal(values, flat[indices])
        median, abs_median = statistics.median(times), statistics.median(abs_times)
        rows.append(
            {
                "device": device.type,
                "threads": torch.get_num_threads() if device.type == "cpu" else "",
                "numel": numel,
                "density": density,
                "sparsifier": name,
                "k": k,
                "count": indices.numel(),
                "count_over_k": round(indices.numel() / k, 4),
                "mass": round(float(values.double().pow(2).sum()) / true_mass, 4),
                "median_ms": round(1e3 * median, 3),
                "mean_ms": round(1e3 * statistics.mean(times), 3),
                "min_ms": round(1e3 * min(times), 3),
                "abs_ms": round(1e3 * abs_median, 3),
                "topk_ms": round(topk_ms, 3),
                "x_abs": round(median / abs_median, 3),
                "x_topk": round(1e3 * median / topk_ms, 4),
                "reps": reps,
            }
        )
        print(_row_line(rows[-1]), file=sys.stderr, flush=True)
    return rows


def _row_line(row: dict) -> str:
    return (
        f"N=2^{int(math.log2(row['numel']))} d={row['density']} {row['sparsifier']:>18}: "
        f"{row['median_ms']:9.2f} ms  x_abs={row['x_abs']:6.2f}  x_topk={row['x_topk']:7.3f}  "
        f"count/k={row['count_over_k']:.3f}  mass={row['mass']:.3f}"
    )


def markdown(rows: list[dict], header: str) -> str:
    lines = [
        header,
        "",
        "| device | threads | N | density | sparsifier | median ms | x abs() | x torch.topk | count / k | top-k mass |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['device']} | {r['threads']} | 2^{int(math.log2(r['numel']))} | {r['density']} | {r['sparsifier']} | "
            f"{r['median_ms']:.2f} | {r['x_abs']:.2f} | {r['x_topk']:.3f} | {r['count_over_k']:.3f} | {r['mass']:.3f} |"
        )
    checks = []
    for r in rows:
        target = TARGETS.get(r["sparsifier"])
        if target is None or r["numel"] != 1 << 24 or r["density"] != 0.01 or r["device"] != "cpu":
            continue
        max_ratio, min_mass = target
        ok = r["x_abs"] <= max_ratio and (min_mass is None or r["mass"] >= min_mass)
        mass_text = f", mass {r['mass']:.3f} (target >= {min_mass})" if min_mass is not None else ""
        checks.append(
            f"- {r['sparsifier']} ({r['threads']} thread{'s' if r['threads'] != 1 else ''}): {r['x_abs']:.2f}x abs() "
            f"(target <= {max_ratio}x){mass_text}: {'met' if ok else 'NOT met'}"
        )
    if checks:
        lines += ["", "Targets (N = 2^24, density 0.01, CPU):", *checks]
    lines += [
        "",
        "Notes: `x abs()` divides by one out-of-place `abs()` of the same tensor; at N = 2^24 its",
        "64 MiB result is freshly mapped and page-faulted, as for any out-of-place op of that size.",
        "At N = 2^20 the abs() takes well under a millisecond, so the ratios there mostly measure",
        "the fixed cost of a selection's few dozen small ops. Every op is a parallel region: with several",
        "threads on a loaded machine each region can wait for a descheduled thread, which hits a",
        "many-op selection far more than the single-op abs(); compare thread counts only within",
        "one run and look at the load averages above.",
    ]
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path, distribution: str = "normal") -> None:
    plt = pyplot()

    configs = sorted({(str(r["threads"]), r["numel"], r["density"]) for r in rows})
    names = sorted({r["sparsifier"] for r in rows})
    fig, axes = plt.subplots(1, 2, figsize=(15, 5.5))
    width = 0.8 / max(1, len(configs))
    for ci, (threads, numel, density) in enumerate(configs):
        by_name = {
            r["sparsifier"]: r
            for r in rows
            if str(r["threads"]) == threads and r["numel"] == numel and r["density"] == density
        }
        xs = [i + ci * width for i in range(len(names))]
        label = f"N=2^{int(math.log2(numel))}, d={density}" + (f", {threads} thr" if threads else "")
        axes[0].bar(xs, [by_name[n]["x_abs"] if n in by_name else 0 for n in names], width, label=label)
        axes[1].bar(xs, [min(by_name[n]["mass"], 2.0) if n in by_name else 0 for n in names], width, label=label)
    titles = ("time / one abs() pass (log)", "share of the true top-k's squared L2 mass (clipped at 2)")
    for ax, title in zip(axes, titles):
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(names))])
        ax.set_xticklabels(names, rotation=45, ha="right")
        ax.set_title(title)
        ax.legend(fontsize=6, ncol=2)
    axes[0].set_yscale("log")
    axes[0].axhline(1.0, color="grey", lw=0.8)
    axes[1].axhline(0.9, color="grey", lw=0.8, ls="--")
    device = rows[0]["device"] if rows else "?"
    fig.suptitle(f"sparsifiers on {device}, fp32, {distribution} input")
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:i]")
    parser.add_argument("--quick", action="store_true", help="small sizes, few repetitions (smoke run)")
    parser.add_argument("--sparsifiers", nargs="*", default=None, help="subset of sparsifier names")
    parser.add_argument("--reps", type=int, default=None, help="timed repetitions per sparsifier")
    parser.add_argument(
        "--threads", type=int, nargs="*", default=None, help="CPU intra-op thread counts to run with (default: torch's)"
    )
    parser.add_argument(
        "--distribution", default="normal", choices=("normal", "laplace", "student_t3"), help="input values"
    )
    parser.add_argument("--out", type=Path, default=RESULTS, help="directory of sparsifiers.{csv,md,png}")
    args = parser.parse_args(argv)

    device = torch.device(args.device)
    thread_counts = args.threads or [torch.get_num_threads()]
    names = args.sparsifiers or available_sparsifiers()
    if args.quick:
        sizes, densities, reps, topk_reps = [1 << 18], [0.01], args.reps or 3, 2
    else:
        sizes = [1 << 20, 1 << 24] + ([1 << 26] if device.type == "cuda" else [])
        densities, reps, topk_reps = [0.001, 0.01], args.reps or 15, 5

    load_before = os.getloadavg()[0]
    rows = []
    for threads in thread_counts:
        torch.set_num_threads(threads)
        for numel in sizes:
            for density in densities:
                rows.extend(bench_config(numel, density, device, names, reps, topk_reps, args.distribution))

    cpu = platform.processor() or platform.machine()
    header = (
        f"Sparsifier benchmark: device {device}"
        + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else f" ({cpu}, {os.cpu_count()} cores)")
        + f", torch {torch.__version__}, fp32 {args.distribution} input, {reps} repetitions (median)"
        + (", --quick" if args.quick else "")
        + f", load average {load_before:.1f} at the start and {os.getloadavg()[0]:.1f} at the end."
    )
    table = markdown(rows, header)
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(args.out / "sparsifiers.csv", FIELDS, rows)
    (args.out / "sparsifiers.md").write_text(table)
    plot(rows, args.out / "sparsifiers.png", args.distribution)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
