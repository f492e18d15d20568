"""Shared LightningModule plumbing: the wrapped model and the optimizer/schedule configuration."""

from __future__ import annotations

from typing import Any

from lightning.pytorch import LightningModule
from torch import Tensor, nn

from ssfusion_lightning.models.tasks.optim import (
    LR_SCHEDULES,
    OPTIMIZERS,
    build_lr_schedule,
    build_optimizer,
    check_choice,
)


class Task(LightningModule):
    """Wraps ``model``; subclasses add the loss and metrics, and call ``save_hyperparameters``."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: str,
        lr: float,
        weight_decay: float,
        momentum: float,
        betas: tuple[float, float],
        lr_schedule: str,
        warmup_steps: int,
    ) -> None:
        super().__init__()
        # Fail at construction rather than when fit() has already set up the data.
        check_choice("optimizer", optimizer, OPTIMIZERS)
        check_choice("lr schedule", lr_schedule, LR_SCHEDULES)
        self.model = model
        self.optimizer_name = optimizer
        self.lr = lr
        self.weight_decay = weight_decay
        self.momentum = momentum
        self.betas = tuple(betas)
        self.lr_schedule = lr_schedule
        self.warmup_steps = warmup_steps

    def forward(self, inputs: Tensor) -> Tensor:
        return self.model(inputs)

    def configure_optimizers(self) -> dict[str, Any]:
        # a fused AdamW unscales a GradScaler's gradients itself, and Lightning then refuses to clip them
        scaled_and_clipped = self.trainer.precision == "16-mixed" and bool(self.trainer.gradient_clip_val)
        optimizer = build_optimizer(
            self.model,
            self.optimizer_name,
            self.lr,
            self.weight_decay,
            self.momentum,
            self.betas,
            fused=False if scaled_and_clipped else None,
        )
        total_steps = int(self.trainer.estimated_stepping_batches)
        schedule = build_lr_schedule(optimizer, self.lr_schedule, total_steps, self.warmup_steps)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}
