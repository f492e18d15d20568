"""Micro-benchmark of the step ``memory="adam"`` puts in place of the user's AdamW: ``AveragedUpdate``
applies the ranks' averaged update, p <- p - lr (update + weight_decay p), once a step over every
parameter of the workload.

    python -m experiments.bench_averaged_update --workload gpt2_10m
    python -m experiments.bench_averaged_update --workload gpt2 --steps 5      # smoke run

Side by side in one process, one intra-op thread, interleaved step by step on the same gradients, for an
AdamW built as torch builds it by default (``fused=None``, the workload's groups and weight decay):
``AveragedUpdate.step`` as it ships; torch's SGD step over the same groups, which is what
``AveragedUpdate`` ran before it called the fused kernel itself (with the group's flags at torch's default,
on the host a loop of two passes a tensor, one into a fresh tensor); and that AdamW's own step, and the
fused AdamW's (the workloads' own), which compute-only and DDP pay for the optimizer. Median time and
minor page faults a step: results/<name>.md.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time
from typing import Callable

import torch

from experiments.common import publish_md
from experiments.e2e_worker import WORKLOADS, build_workload
from ssfusion_lightning.models.tasks.optim import build_optimizer
from ssfusion_lightning.sparsifiers import build_memory


def measure(workload: str, steps: int) -> list[dict[str, float | str]]:
    torch.manual_seed(0)
    spec, model, _, _ = build_workload(workload, False, 0)
    task = spec["task"]
    groups = build_optimizer(model, task["optimizer"], task["lr"], task["weight_decay"]).param_groups
    settings = {"lr": groups[0]["lr"], "betas": groups[0]["betas"]}

    def adamw(fused: bool | None) -> torch.optim.AdamW:
        """The workload's AdamW (its groups and weight decay) over its own copy of the parameters."""
        copies = [{"params": [p.detach().clone() for p in g["params"]], "weight_decay": g["weight_decay"]} for g in groups]
        return torch.optim.AdamW(copies, fused=fused, **settings)

    default, fused = adamw(None), adamw(True)
    (replacement,) = build_memory("adam").take_over([adamw(None)])
    for optimizer in (default, fused, replacement):
        for p in (p for g in optimizer.param_groups for p in g["params"]):
            p.grad = torch.randn_like(p) * 1e-3
    params = [p for g in replacement.param_groups for p in g["params"]]
    stepping: dict[str, Callable[[], object]] = {
        "AveragedUpdate.step (fused SGD kernel)": replacement.step,
        "torch SGD step on the groups (before)": lambda: torch.optim.SGD.step(replacement),
        "AdamW step, torch's default": default.step,
        "AdamW step, fused (the workloads')": fused.step,
    }
    samples: dict[str, dict[str, list[float]]] = {name: {"ms": [], "faults": []} for name in stepping}
    for _ in range(steps):
        for name, step in stepping.items():
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            started = time.perf_counter()
            step()
            samples[name]["ms"].append(1e3 * (time.perf_counter() - started))
            samples[name]["faults"].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults)
    elements = sum(p.numel() for p in params)
    return [
        {"step": name, "tensors": len(params), "elements": elements,
         "ms": statistics.median(s["ms"]), "faults": statistics.median(s["faults"])}
        for name, s in samples.items()
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default="gpt2_10m", choices=sorted(WORKLOADS))
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--name", default="averaged_update")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = measure(args.workload, args.steps)
    command = f"python -m experiments.bench_averaged_update --workload {args.workload} --steps {args.steps} --name {args.name}"
    lines = [
        f"`{command}` (one intra-op thread; medians over {args.steps} interleaved steps)",
        "",
        "| step | tensors | elements | ms | minor page faults |",
        "|---|---:|---:|---:|---:|",
        *[f"| {r['step']} | {r['tensors']} | {r['elements']:,} | {r['ms']:.2f} | {r['faults']:.0f} |" for r in rows],
    ]
    publish_md("\n".join(lines), args.name, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
