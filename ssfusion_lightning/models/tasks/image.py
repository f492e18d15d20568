"""Image classification task: cross-entropy loss, top-1 accuracy."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

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
        self.num_classes = num_classes
        # Accuracy is counted, not a metric object: a MulticlassAccuracy's sync is 12 collectives (a
        # barrier and two allgathers per state), 35-41 ms an epoch on 4 CPU ranks, inside the training
        # loop's time (experiments/REPORT.md, "Start-up and epoch ends"); Lightning's synced mean takes two.
        self._train_counts: Tensor | None = None

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        images, labels = batch
        logits = self._classify(images)
        loss = F.cross_entropy(logits, labels)
        self._count_train_hits(logits.detach(), labels)
        # No prog_bar and no sync on per-step values: either would force a device sync every step.
        self.log("train/loss", loss)
        return loss

    def _classify(self, images: Tensor) -> Tensor:
        logits = self.model(images)
        if logits.dim() != 2 or logits.shape[1] != self.num_classes:
            raise ValueError(
                f"the model's output has shape {tuple(logits.shape)}, but the task has num_classes={self.num_classes}: "
                f"expected (batch, {self.num_classes})"
            )
        return logits

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
        self._evaluate(batch, "val")

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self._evaluate(batch, "test")

    def _evaluate(self, batch: tuple[Tensor, Tensor], stage: str) -> None:
        images, labels = batch
        logits = self._classify(images)
        # weighted by batch size and summed over the ranks: the loss and accuracy of every rank's samples
        count = len(labels)
        self.log(f"{stage}/loss", F.cross_entropy(logits, labels), sync_dist=True, batch_size=count)
        accuracy = (logits.argmax(1) == labels).float().mean()
        self.log(f"{stage}/acc", accuracy, prog_bar=True, sync_dist=True, batch_size=count)
