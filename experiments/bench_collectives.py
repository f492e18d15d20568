"""Benchmark of the sparse collectives (allgather, zen, sparcml, oktopk) against dense allreduce.

    python -m experiments.bench_collectives            # full grid: P in {2,3,4}, numel in {2^22, 2^24}, ...
    python -m experiments.bench_collectives --quick    # smoke run (seconds)

For every world size P the script spawns P gloo ranks on this machine. Each configuration
(numel, density, index pattern) gives every rank k = floor(density * numel) distinct indices with
fp32 values, generated from a shared seed so that every rank also knows the others' index sets
(for the formulas and the load figures). Reported per scheme: median wall time over the
repetitions (each the slowest rank's time), bytes received per rank (mean and max over ranks,
from the schemes' own Traffic accounting), the scheme's formula from ALGORITHMS.md section 7 and
the COO lower bound (P-1)/P * k * (v+x). Patterns: random, identical across ranks, disjoint, and
skewed (every index in the front 1/32 of the tensor). For ZEN also the max/mean partition load
(pairs each owner receives) next to that of an even contiguous split of the index space.

Writes experiments/results/collectives.{csv,md,png} (or --out DIR).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
import zlib
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from experiments.common import RESULTS, free_port, pyplot, save_figure, write_csv

V = 4  # fp32 values
X = 4  # int32 positions on the wire (every scheme, numel < 2**31)
SCHEMES = ("allreduce", "allgather", "zen", "sparcml", "oktopk")
PATTERNS = ("random", "identical", "disjoint", "skewed")
SKEW_FRACTION = 32  # skewed pattern: indices in the first numel / 32 elements


# ----------------------------------------------------------------------------- inputs
def _distinct(count: int, high: int, g: torch.Generator) -> torch.Tensor:
    """``count`` distinct uniform random integers in [0, high), in random order."""
    count = min(count, high)
    if count * 4 >= high:
        return torch.randperm(high, generator=g)[:count]
    picked = torch.empty(0, dtype=torch.int64)
    while picked.numel() < count:
        more = torch.randint(0, high, (int((count - picked.numel()) * 1.2) + 16,), generator=g)
        picked = torch.unique(torch.cat([picked, more]))
    return picked[torch.randperm(picked.numel(), generator=g)[:count]]


def index_sets(pattern: str, world: int, numel: int, k: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    if pattern == "random":
        return [_distinct(k, numel, g) for _ in range(world)]
    if pattern == "identical":
        return [_distinct(k, numel, g)] * world
    if pattern == "disjoint":
        pool = _distinct(k * world, numel, g)
        return [pool[r * k : (r + 1) * k] for r in range(world)]
    if pattern == "skewed":
        return [_distinct(k, max(k, numel // SKEW_FRACTION), g) for _ in range(world)]
    raise ValueError(pattern)


# ----------------------------------------------------------------------------- formulas
def formulas(scheme: str, sets: list[torch.Tensor], numel: int, k: int) -> float:
    """Section 7's bytes received per rank (mean over ranks)."""
    from ssfusion_lightning.comm.sparcml import sparcml_expected_bytes
    from ssfusion_lightning.commcost import ring_allreduce_bytes

    world = len(sets)
    if scheme == "allreduce":
        return ring_allreduce_bytes(numel * V, world)
    if scheme == "allgather":
        return (world - 1) * k * (V + X)
    if scheme == "zen":
        K = torch.unique(torch.cat(sets)).numel()  # nonzeros after summing (random values: no cancellation)
        pull = K * V + min(numel / 8, K * X)  # bitmap, or COO when that is smaller
        return (world - 1) / world * (k * (V + X) + pull)
    if scheme == "sparcml":  # sum over rounds of the union sizes * (v+x), per rank
        return statistics.fmean(r for _, r in sparcml_expected_bytes(sets, V, V))
    if scheme == "oktopk":  # upper bound
        return 3 * (world - 1) / world * k * (V + X)
    raise ValueError(scheme)


def load_balance(sets: list[torch.Tensor], numel: int) -> tuple[float, float]:
    """max/mean pairs per owner: ZEN's hash vs an even contiguous split."""
    from ssfusion_lightning.comm.zen import zen_owner

    world = len(sets)
    idx = torch.cat(sets)
    zen = torch.bincount(zen_owner(idx, world), minlength=world).double()
    contiguous = torch.bincount(idx * world // numel, minlength=world).double()
    return float(zen.max() / zen.mean()), float(contiguous.max() / contiguous.mean())


# ----------------------------------------------------------------------------- one rank
def _run_scheme(scheme, values, indices, numel, k, state, group):
    from ssfusion_lightning.comm import SPARSE_SCHEMES, Traffic
    from ssfusion_lightning.comm.collectives import allreduce_dense
    from ssfusion_lightning.comm.oktopk import oktopk_reduce

    traffic = Traffic()
    if scheme == "allreduce":
        dense = torch.zeros(numel, dtype=values.dtype)
        dense[indices] = values
        out, traffic = allreduce_dense(dense, group)
    elif scheme == "oktopk":
        out, _ = oktopk_reduce(values, indices, numel, k, group, traffic, state)
    elif scheme == "allgather":  # as the engine calls it: k bounds every rank's count, no count round
        out = SPARSE_SCHEMES.get(scheme)(values, indices, numel, group, traffic, max_count=k)
    else:
        out = SPARSE_SCHEMES.get(scheme)(values, indices, numel, group, traffic)
    return out, traffic


def _worker(rank: int, world: int, port: int, grid: list[dict], reps: int, result_path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from ssfusion_lightning.comm.oktopk import OkTopkState

    rows = []
    dense_done: dict[int, dict] = {}
    for cfg in grid:
        numel, density, pattern = cfg["numel"], cfg["density"], cfg["pattern"]
        k = max(1, int(density * numel))
        sets = index_sets(pattern, world, numel, k, seed=zlib.crc32(f"{numel}/{density}/{pattern}".encode()))
        g = torch.Generator().manual_seed(1000 + rank)
        values, indices = torch.randn(sets[rank].numel(), generator=g), sets[rank]
        zen_load, contiguous_load = load_balance(sets, numel)
        reference = None
        for scheme in cfg["schemes"]:
            if scheme == "allreduce" and numel in dense_done:  # pattern-independent
                rows.append({**dense_done[numel], "density": density, "pattern": pattern, "k": k})
                continue
            state = OkTopkState()
            times, traffic, out = [], None, None
            for rep in range(reps + 1):  # the first run warms caches (ZEN's partition, Ok-Topk's threshold)
                dist.barrier()
                started = time.perf_counter()
                out, traffic = _run_scheme(scheme, values, indices, numel, k, state, None)
                elapsed = torch.tensor([time.perf_counter() - started], dtype=torch.float64)
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                if rep:
                    times.append(float(elapsed))
            if scheme == "allgather":
                reference = out
            correct = True
            if scheme in ("zen", "sparcml") and reference is not None:
                correct = bool(torch.allclose(out, reference, rtol=1e-5, atol=1e-5))
            recv = torch.tensor([traffic.received, traffic.padded_received, int(correct)], dtype=torch.int64)
            gathered = [torch.empty_like(recv) for _ in range(world)]
            dist.all_gather(gathered, recv)
            received = [int(t[0]) for t in gathered]
            formula = formulas(scheme, sets, numel, k)
            row = {
                "P": world,
                "numel": numel,
                "density": density,
                "k": k,
                "pattern": pattern,
                "scheme": scheme,
                "time_ms": 1000 * statistics.median(times),
                "recv_mean_bytes": statistics.fmean(received),
                "recv_max_bytes": max(received),
                "padded_recv_mean_bytes": statistics.fmean(int(t[1]) for t in gathered),
                "formula_bytes": formula,
                "measured_over_formula": statistics.fmean(received) / formula if formula else float("nan"),
                "coo_lower_bound_bytes": (world - 1) / world * k * (V + X),
                "zen_load_max_over_mean": zen_load,
                "contiguous_load_max_over_mean": contiguous_load,
                "correct": all(int(t[2]) for t in gathered),
            }
            if scheme == "allreduce":
                dense_done[numel] = row
            rows.append(row)
            if rank == 0:
                print(
                    f"P={world} n=2^{int(math.log2(numel))} d={density} {pattern:9s} {scheme:9s} "
                    f"{row['time_ms']:9.1f} ms  recv {row['recv_mean_bytes'] / 1e6:8.3f} MB  "
                    f"x formula {row['measured_over_formula']:.3f}",
                    flush=True,
                )
    if rank == 0:
        Path(result_path).write_text(json.dumps(rows))
    dist.barrier()
    dist.destroy_process_group()


def run_world(world: int, grid: list[dict], reps: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "rows.json")
        mp.spawn(_worker, args=(world, free_port(), grid, reps, path), nprocs=world, join=True)
        return json.loads(Path(path).read_text())


# ----------------------------------------------------------------------------- reporting
def _mb(x: float) -> str:
    return f"{x / 1e6:.3f}"


def markdown(rows: list[dict]) -> str:
    lines = [
        "| P | numel | density | pattern | scheme | time (ms) | recv/rank (MB) | formula (MB) | measured/formula "
        "| COO lower bound (MB) | ZEN load max/mean | contiguous max/mean |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        zen = r["scheme"] == "zen"
        name = r["scheme"] + ("" if r["correct"] else " (WRONG)")
        formula = _mb(r["formula_bytes"]) + (" (bound)" if r["scheme"] == "oktopk" else "")
        zen_load = f"{r['zen_load_max_over_mean']:.3f}" if zen else ""
        contiguous = f"{r['contiguous_load_max_over_mean']:.3f}" if zen else ""
        lines.append(
            f"| {r['P']} | 2^{int(math.log2(r['numel']))} | {r['density']} | {r['pattern']} | {name} | "
            f"{r['time_ms']:.1f} | {_mb(r['recv_mean_bytes'])} | {formula} | {r['measured_over_formula']:.3f} | "
            f"{_mb(r['coo_lower_bound_bytes'])} | {zen_load} | {contiguous} |"
        )
    return "\n".join(lines) + "\n"


def summary(rows: list[dict]) -> str:
    out = []
    for scheme in ("allgather", "zen", "sparcml"):
        ratios = [r["measured_over_formula"] for r in rows if r["scheme"] == scheme]
        if ratios:
            out.append(f"- {scheme}: measured/formula in [{min(ratios):.3f}, {max(ratios):.3f}] over {len(ratios)} runs")
    ok = [r["measured_over_formula"] for r in rows if r["scheme"] == "oktopk"]
    if ok:
        out.append(f"- oktopk: measured / 3(P-1)/P k(v+x) bound in [{min(ok):.3f}, {max(ok):.3f}]")
    skew = [r for r in rows if r["scheme"] == "zen" and r["pattern"] == "skewed"]
    if skew:
        out.append(
            f"- ZEN load max/mean on the skewed pattern: <= {max(r['zen_load_max_over_mean'] for r in skew):.3f} "
            f"(contiguous split: {min(r['contiguous_load_max_over_mean'] for r in skew):.2f}"
            f"-{max(r['contiguous_load_max_over_mean'] for r in skew):.2f})"
        )
    wrong = [r for r in rows if not r["correct"]]
    out.append(f"- outputs checked against allgather: {'all equal' if not wrong else f'{len(wrong)} WRONG'}")
    return "\n".join(out) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    plt = pyplot()

    worlds = sorted({r["P"] for r in rows})
    numel = max(r["numel"] for r in rows)
    density = max(r["density"] for r in rows)
    sparse = [s for s in SCHEMES if s != "allreduce"]
    patterns = [p for p in PATTERNS if any(r["pattern"] == p for r in rows)]
    fig, axes = plt.subplots(2, len(worlds), figsize=(4.5 * len(worlds), 7.5), squeeze=False)
    width = 0.8 / max(1, len(sparse))
    for col, world in enumerate(worlds):
        sel = [r for r in rows if r["P"] == world and r["numel"] == numel and r["density"] == density]
        dense = next((r for r in sel if r["scheme"] == "allreduce"), None)
        for i, scheme in enumerate(sparse):
            by_pattern = {r["pattern"]: r for r in sel if r["scheme"] == scheme}
            xs = [j + (i - (len(sparse) - 1) / 2) * width for j in range(len(patterns))]
            axes[0][col].bar(xs, [by_pattern[p]["time_ms"] if p in by_pattern else 0 for p in patterns], width, label=scheme)
            axes[1][col].bar(
                xs,
                [by_pattern[p]["recv_mean_bytes"] / by_pattern[p]["coo_lower_bound_bytes"] if p in by_pattern else 0 for p in patterns],
                width,
                label=scheme,
            )
        if dense is not None:
            axes[0][col].axhline(dense["time_ms"], color="k", ls="--", lw=1, label="dense allreduce")
        for ax in axes[:, col]:
            ax.set_xticks(range(len(patterns)))
            ax.set_xticklabels(patterns)
        axes[0][col].set_title(f"P={world}, numel=2^{int(math.log2(numel))}, density={density}")
        axes[0][col].set_ylabel("time (ms)")
        axes[1][col].set_ylabel("bytes received / COO lower bound")
        axes[1][col].axhline(1.0, color="k", lw=0.8)
    axes[0][0].legend(fontsize=8)
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: P=2,3, numel=2^16, one density")
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 3, 4])
    parser.add_argument("--numels", type=int, nargs="+", default=[1 << 22, 1 << 24])
    parser.add_argument("--densities", type=float, nargs="+", default=[0.001, 0.01])
    parser.add_argument("--patterns", nargs="+", default=list(PATTERNS), choices=PATTERNS)
    parser.add_argument("--schemes", nargs="+", default=list(SCHEMES), choices=SCHEMES)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--name", default="collectives", help="file stem of the outputs")
    args = parser.parse_args(argv)
    if args.quick:
        args.worlds, args.numels, args.densities, args.reps = [2, 3], [1 << 16], [0.01], 1
        if args.name == "collectives":
            args.name = "collectives_quick"
    grid = [
        {"numel": n, "density": d, "pattern": p, "schemes": args.schemes}
        for n in args.numels
        for d in args.densities
        for p in args.patterns
    ]
    started = time.perf_counter()
    rows: list[dict] = []
    for world in args.worlds:
        rows += run_world(world, grid, args.reps)
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(args.out / f"{args.name}.csv", list(rows[0]), rows)
    header = (
        f"# Sparse collectives on gloo (this machine, {os.cpu_count()} CPU cores; ranks are local processes)\n\n"
        f"Grid: P={args.worlds}, numel={args.numels}, density={args.densities}, patterns={args.patterns}, "
        f"{args.reps} timed repetitions after one warm-up (median of the slowest rank). "
        f"Bytes: received per rank, mean over ranks, fp32 values (v=4) and int32 positions (x=4) in every scheme. "
        f"Formulas (ALGORITHMS.md section 7): allreduce 2(P-1)/P n v; allgather (P-1) k (v+x); "
        f"zen (P-1)/P [k(v+x) + K v + min(n/8, K x)] (bitmap or COO pull, K = nonzeros of the sum); "
        f"sparcml: sum over rounds of the union sizes (v+x); oktopk: the 3(P-1)/P k (v+x) upper bound "
        f"(Ok-Topk rows are measured on a threshold-reuse round). Wall time {time.perf_counter() - started:.0f} s.\n\n"
    )
    text = header + "## Summary\n\n" + summary(rows) + "\n## All runs\n\n" + markdown(rows)
    (args.out / f"{args.name}.md").write_text(text)
    plot(rows, args.out / f"{args.name}.png")
    print(text)


if __name__ == "__main__":
    sys.exit(main())
