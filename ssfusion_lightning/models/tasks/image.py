"""Image classification task: cross-entropy loss, top-1 accuracy."""

from __future__ import annotations

import torch
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
        # Training accuracy is counted, not a metric object: a MulticlassAccuracy's sync is 12 collectives
        # (a barrier and two allgathers per state), 35-41 ms each epoch on 4 CPU ranks, inside the
        # training loop's time (experiments/REPORT.md, "train/acc in two all-reduces"); the counts take two.
        self._train_counts: Tensor | None = None
        # One metric object per evaluation stage: their states must not mix, and each syncs across ranks itself.
        self.val_acc = MulticlassAccuracy(num_classes, average="micro")
        self.test_acc = MulticlassAccuracy(num_classes, average="micro")

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        images, labels = batch
        logits = self.model(images)
        loss = F.cross_entropy(logits, labels)
        self._count_train_hits(logits.detach(), labels)
        # No prog_bar and no sync on per-step values: either would force a device sync every step.
        self.log("train/loss", loss)
        return loss

    def _count_train_hits(self, logits: Tensor, labels: Tensor) -> None:
        # on the logits' device and never read back per step: reading would sync a GPU every step
        if self._train_counts is None:
            self._train_counts = torch.zeros(2, dtype=torch.long, device=logits.device)
        self._train_counts[0] += (logits.argmax(1) == labels).sum()
        self._train_counts[1] += labels.numel()

    def on_train_epoch_end(self) -> None:
        # Logged here, not from training_step: logging every step costs a call a step (0.4 ms on one
        # core) for a value read once an epoch. Lightning's epoch value is sum(value x batch_size) /
        # sum(batch_size), each sum taken over the ranks under sync_dist: with the rank's accuracy and
        # its sample count that is the accuracy of every rank's samples, in two all-reduces.
        if self._train_counts is not None:
            hits, seen = self._train_counts.tolist()
            self.log("train/acc", hits / seen, batch_size=int(seen), sync_dist=True)
        self._train_counts = None

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
