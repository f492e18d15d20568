"""Image classification task: cross-entropy loss, top-1 accuracy."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn
from torchmetrics.classification import MulticlassAccuracy

from ssfusion_lightning.models.tasks.base import Task


class ImageClassifier(Task):
    """Trains ``model`` on batches ``(images (N, C, H, W) float, labels (N,) int64)``.

    Logs ``train/loss`` per step, and per epoch ``train/acc``, ``val/loss``, ``val/acc``, ``test/loss``, ``test/acc``.
    """

    def __init__(
        self,
        model: nn.Module,
        num_classes: int,
        optimizer: str = "sgd",
        lr: float = 0.1,
        weight_decay: float = 5e-4,
        momentum: float = 0.9,
        betas: tuple[float, float] = (0.9, 0.999),
        lr_schedule: str = "constant",
        warmup_steps: int = 0,
    ) -> None:
        super().__init__(model, optimizer, lr, weight_decay, momentum, betas, lr_schedule, warmup_steps)
        self.save_hyperparameters(ignore=["model"])
        # One metric object per stage: their states must not mix, and each syncs across ranks itself.
        self.train_acc = MulticlassAccuracy(num_classes, average="micro")
        self.val_acc = MulticlassAccuracy(num_classes, average="micro")
        self.test_acc = MulticlassAccuracy(num_classes, average="micro")

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        images, labels = batch
        logits = self.model(images)
        loss = F.cross_entropy(logits, labels)
        self.train_acc.update(logits.detach(), labels)
        # No prog_bar and no sync on per-step values: either would force a device sync every step.
        self.log("train/loss", loss)
        return loss

    def on_train_epoch_end(self) -> None:
        # Logged here, not from training_step: Lightning moves a logged metric object to its device
        # on every call (0.4 ms a step on one core), for a value it reads once an epoch anyway.
        # compute() has synced it across ranks already; sync_dist averages equal values and keeps
        # Lightning from warning that an epoch-level value was not synced.
        if self.train_acc.update_called:
            self.log("train/acc", self.train_acc.compute(), sync_dist=True)
        self.train_acc.reset()

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self._evaluate(batch, "val", self.val_acc)

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self._evaluate(batch, "test", self.test_acc)

    def _evaluate(self, batch: tuple[Tensor, Tensor], stage: str, accuracy: MulticlassAccuracy) -> None:
        images, labels = batch
        logits = self.model(images)
        accuracy.update(logits, labels)
        self.log(f"{stage}/loss", F.cross_entropy(logits, labels), sync_dist=True)
        self.log(f"{stage}/acc", accuracy, prog_bar=True)
