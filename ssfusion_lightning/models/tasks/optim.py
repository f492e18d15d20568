"""Optimizer and learning-rate schedule construction from plain (Hydra-friendly) settings."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

OPTIMIZERS = ("sgd", "adamw")
LR_SCHEDULES = ("constant", "cosine")
#: devices with a fused AdamW kernel in torch
FUSED_ADAM_DEVICES = ("cpu", "cuda")


def check_choice(kind: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"unknown {kind} {value!r}; valid choices: {', '.join(choices)}")


def build_optimizer(
    module: nn.Module,
    name: str,
    lr: float,
    weight_decay: float = 0.0,
    momentum: float = 0.9,
    betas: tuple[float, float] = (0.9, 0.999),
    fused: bool | None = None,
) -> Optimizer:
    """SGD with momentum or AdamW; weight decay applies to weight matrices and kernels only.

    Biases and normalization scales (1-d parameters) are left undecayed: shrinking them towards zero
    only fights the normalization and hurts accuracy.

    AdamW runs fused (``fused=None``: wherever every parameter is on CPU or CUDA). Besides being
    one kernel per tensor, this matters for sparse training on CPU: the unfused step's
    ``exp_avg_sq.sqrt()`` is about 6x slower on the exact zeros that a never-selected element
    keeps there (measured in experiments/REPORT.md, "Adam's sqrt on zeros").
    """
    check_choice("optimizer", name, OPTIMIZERS)
    params = [p for p in module.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    groups = [group for group in groups if group["params"]]
    if name == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=momentum)
    if fused is None:
        fused = all(p.device.type in FUSED_ADAM_DEVICES for p in params)
    return torch.optim.AdamW(groups, lr=lr, betas=tuple(betas), fused=fused)


def build_lr_schedule(optimizer: Optimizer, name: str, total_steps: int, warmup_steps: int = 0) -> LambdaLR:
    """Linear warmup over ``warmup_steps``, then a constant rate or a cosine decay to zero at ``total_steps``."""
    check_choice("lr schedule", name, LR_SCHEDULES)
    if warmup_steps < 0:
        raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        if name == "constant":
            return 1.0
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return LambdaLR(optimizer, factor)
