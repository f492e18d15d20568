"""What an engine at the host's floor would cost: issue 14's overlap budgets against the least work a
round of the ssfusion preset must do, measured on this host.

With one core per rank every microsecond of the engine's work lands on the step, so issue 14's
targets set a budget for it. From a side-by-side launch (``experiments/side_by_side.py``, default
results/overlap_side_fused.json), per cell:

- 0.90 of compute-only: the step may be at most compute-only's / 0.90, and ``compute_sync`` (DDP
  exchanging one element a step: the lockstep of two ranks and nothing else) already takes its part,
  so ``compute_only / 0.90 - compute_sync`` is left for compression and exposed communication;
- CPU at most 1.15x compute-only's: ``1.15 x compute_only's - compute_sync's`` process CPU a step;
- at least 1.0x PowerSGD rank 1's speed: ``ddp_powersgd - compute_sync`` of the step.

The floor is the per-element work the preset's round cannot do without, each part as ONE op over
one flat buffer holding all the tensors the plan sparsifies (no per-tensor dispatch, no Python
between the ops, no threshold search: the exact threshold is given), one intra-op thread, hot
caches. It is a lower bound on any implementation built from torch and numpy kernels:

- clip (the LMs, whose recipe clips by norm: ``memory="adam"`` clips each rank's gradient): one norm;
- compensate: the memory's arithmetic out of place, since its contract leaves the state alone until
  the round commits (residual: r + g; momentum correction: u' = m u + g, v' = v + u'; Adam: three
  copies of the state and torch's fused Adam step, the only kernel torch has for it);
- check: one sum over the compensated values (the non-finite vote);
- select: one abs, one compare, one list of positions; gather: the k values;
- commit: the sent positions zeroed, the 90% feedback kept (``memory="auto"``'s), the new state adopted;
- write: the averaged gradient zeroed and the P ranks' k values added in (``SparseSum.dense``);
- the optimizer step the preset runs in place of the user's (SGD without momentum for momentum
  correction, the averaged update for Adam), minus the user's own step, on the whole model.

``--no-contract`` is reported beside: Adam's round with the fused step in place on the state (no
copies), what a memory without the contract's guarantee (a dropped round leaves the state as it was)
would pay.

    python -m experiments.engine_floor                     # results/engine_floor.md
    python -m experiments.engine_floor --rounds 5 --out /tmp/floor   # smoke run
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time

import numpy as np
import torch

from experiments.bench_feedback_round import LARGE
from experiments.common import RESULTS, publish_md
from experiments.e2e_worker import WORKLOADS, build_workload
from ssfusion_lightning.models.tasks.optim import build_optimizer
from ssfusion_lightning.sparsifiers.adam_memory import AveragedUpdate

#: the preset's memory per workload (``memory="auto"`` for the workload's optimizer) and its feedback
MEMORY = {"resnet18": "dgc", "gpt2": "adam", "gpt2_10m": "adam"}
FEEDBACK = 0.9
DENSITY = 0.01
WORLD = 2
MOMENTUM = 0.9
BETAS = (0.9, 0.999)


def _median_ms(samples: list[float]) -> float:
    return 1e3 * statistics.median(samples)


class FlatRound:
    """The floor's ops over one flat buffer of ``n`` elements (see the module's notes)."""

    def __init__(self, n: int, memory: str, contract: bool, clips: bool) -> None:
        self.memory, self.contract, self.clips = memory, contract, clips
        self.grad = torch.randn(n)
        self.state = [torch.randn(n) * 0.1 for _ in range(3)]  # r | (u, v) | (m1, m2, r)
        self.state[-2].abs_()  # Adam's second moment is non-negative
        self.spare = [torch.empty(n) for _ in range(3)]
        self.compensated = torch.empty(n)
        self.magnitudes = torch.empty(n)
        self.mask = np.empty(n, dtype=bool)
        self.averaged = torch.empty(n)
        self.k = max(1, math.ceil(DENSITY * n))
        self.step = torch.tensor(3.0)

    def compensate(self) -> torch.Tensor:
        r, g = self.state, self.grad
        if self.memory == "residual":
            return torch.add(r[0], g, out=self.spare[0])
        if self.memory == "dgc":
            u = torch.mul(r[0], MOMENTUM, out=self.spare[0]).add_(g)
            return torch.add(u, r[1], out=self.spare[1])
        m1, m2, total = (torch.Tensor.copy_(s, t) for s, t in zip(self.spare, r)) if self.contract else r
        self.step += 1
        torch._fused_adam_(
            [total], [g], [m1], [m2], [], [self.step], lr=-1.0, beta1=BETAS[0], beta2=BETAS[1],
            weight_decay=0.0, eps=1e-8, amsgrad=False, maximize=False,
        )
        return total

    def round(self) -> dict[str, float]:
        times: dict[str, float] = {}
        started = time.perf_counter()
        if self.clips:
            float(torch.linalg.vector_norm(self.grad))
        times["clip"] = time.perf_counter() - started

        started = time.perf_counter()
        compensated = self.compensate()
        times["compensate"] = time.perf_counter() - started

        started = time.perf_counter()
        bool(torch.isfinite(compensated.sum()))
        times["check"] = time.perf_counter() - started

        threshold = float(torch.kthvalue(compensated.abs(), compensated.numel() - self.k + 1).values)  # given, untimed
        started = time.perf_counter()
        torch.abs(compensated, out=self.magnitudes)
        np.greater_equal(self.magnitudes.numpy(), threshold, out=self.mask)
        positions = torch.from_numpy(np.flatnonzero(self.mask))
        values = compensated.index_select(0, positions)
        times["select"] = time.perf_counter() - started
        self.sent = (positions, values)

        started = time.perf_counter()
        compensated.index_fill_(0, positions, 0.0).mul_(FEEDBACK)
        if self.memory == "dgc":
            self.spare[0].index_fill_(0, positions, 0.0)
            self.state[:2], self.spare[:2] = self.spare[:2], self.state[:2]
        elif self.memory == "residual" or self.contract:
            self.state, self.spare = self.spare, self.state
        times["commit"] = time.perf_counter() - started

        started = time.perf_counter()
        self.averaged.zero_()
        for _ in range(WORLD):  # every rank's piece (their positions overlap in part)
            self.averaged.index_add_(0, positions, values)
        times["write"] = time.perf_counter() - started
        return times


def optimizer_delta_ms(workload: str, rounds: int) -> float:
    """The preset's optimizer step minus the user's, on the whole model with random gradients."""
    _, model, task, _ = build_workload(workload, False, 0)
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3

    def user_optimizer() -> torch.optim.Optimizer:  # the task's own, as its configure_optimizers builds it
        return build_optimizer(task.model, task.optimizer_name, task.lr, task.weight_decay, task.momentum, task.betas)

    user = user_optimizer()
    preset = user_optimizer()
    if MEMORY[workload] == "adam":
        preset = AveragedUpdate(preset)
    else:
        for group in preset.param_groups:
            group["momentum"] = 0.0
    samples: dict[str, list[float]] = {"user": [], "preset": []}
    with torch.no_grad():
        for _ in range(rounds):
            for name, optimizer in (("user", user), ("preset", preset)):
                started = time.perf_counter()
                optimizer.step()
                samples[name].append(time.perf_counter() - started)
    return _median_ms(samples["preset"]) - _median_ms(samples["user"])


def sparse_elements(workload: str) -> int:
    _, model, _, _ = build_workload(workload, False, 0)
    return sum(p.numel() for p in model.parameters() if p.numel() >= LARGE)


def floor_ms(n: int, memory: str, contract: bool, clips: bool, rounds: int) -> dict[str, float]:
    flat = FlatRound(n, memory, contract, clips)
    flat.round()  # every buffer touched once
    samples: dict[str, list[float]] = {}
    for _ in range(rounds):
        for part, seconds in flat.round().items():
            samples.setdefault(part, []).append(seconds)
    return {part: _median_ms(values) for part, values in samples.items()}


def budgets(side: dict, workload: str) -> dict[str, dict[str, float]]:
    """Per link of the side-by-side launch: the engine's budget for 0.90 of compute-only and for
    1.15x its CPU, and what ssfusion's engine measured there."""
    out = {}
    for cell, schemes in side["results"].items():
        link, name = cell.split()
        if name != workload:
            continue
        only, sync, ssfusion = schemes["compute_only"], schemes["compute_sync"], schemes["ssfusion"]
        out[link] = {
            "step": only["wall_ms"] / 0.90 - sync["wall_ms"],
            "powersgd": schemes["ddp_powersgd"]["wall_ms"] - sync["wall_ms"],
            "cpu": 1.15 * only["proc_ms"] - sync["proc_ms"],
            "compress": ssfusion["compress_ms"],
            "engine_cpu": ssfusion["proc_ms"] - sync["proc_ms"],
        }
    return out


def report(rows: list[dict], side_name: str, rounds: int, command: str) -> str:
    lines = [
        f"`{command}` (one thread, medians of {rounds} rounds; budgets from results/{side_name}.json: "
        "0.90 of compute-only leaves compute_only / 0.90 - compute_sync of the step, 1.15x CPU leaves "
        "1.15 x compute_only's - compute_sync's process CPU, 1.0x PowerSGD rank 1 leaves its step - compute_sync's; \"measured\": ssfusion's compression in that launch, "
        "and its process CPU over compute_sync's)",
        "",
        "| workload | memory | sparse elements | clip | compensate | check | select | commit | write | optimizer step vs the user's "
        "| floor ms | floor without the contract's copies | link | budget for 0.90 ms | budget for 1.0x PowerSGD rank 1 ms "
        "| measured compression ms | CPU budget ms | measured extra CPU ms | the floor fits |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---|",
    ]
    for row in rows:
        parts = row["parts"]
        for link, budget in row["budgets"].items():
            limits = (("0.90", budget["step"]), ("PowerSGD", budget["powersgd"]), ("CPU", budget["cpu"]))
            fits = [what for what, limit in limits if row["floor"] <= limit]
            lines.append(
                f"| {row['workload']} | {row['memory']} | {row['elements']:,} | {parts['clip']:.2f} | {parts['compensate']:.2f} "
                f"| {parts['check']:.2f} | {parts['select']:.2f} | {parts['commit']:.2f} | {parts['write']:.2f} | {row['optimizer']:+.2f} "
                f"| {row['floor']:.2f} | {row['floor_free']:.2f} | {link} | {budget['step']:.1f} | {budget['powersgd']:.1f} | {budget['compress']:.1f} "
                f"| {budget['cpu']:.1f} | {budget['engine_cpu']:.1f} | {', '.join(fits) or 'neither'} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", nargs="+", default=list(MEMORY), choices=list(MEMORY))
    parser.add_argument("--side", default="overlap_side_fused", help="a side_by_side launch in results/ (its .json)")
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--name", default="engine_floor")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    side = json.loads((RESULTS / f"{args.side}.json").read_text())
    rows = []
    for workload in args.workloads:
        memory, n = MEMORY[workload], sparse_elements(workload)
        clips = WORKLOADS[workload]["kind"] == "lm"
        parts = floor_ms(n, memory, True, clips, args.rounds)
        free = floor_ms(n, memory, False, clips, args.rounds) if memory == "adam" else parts
        optimizer = optimizer_delta_ms(workload, args.rounds)
        rows.append({
            "workload": workload, "memory": memory, "elements": n, "parts": parts, "optimizer": optimizer,
            "floor": sum(parts.values()) + optimizer, "floor_free": sum(free.values()) + optimizer,
            "budgets": budgets(side, workload),
        })
    command = "python -m experiments.engine_floor" + (f" --side {args.side}" if args.side != "overlap_side_fused" else "")
    publish_md(report(rows, args.side, args.rounds, command), args.name, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
