"""Language modelling task: token-level cross-entropy and perplexity, for causal and masked LMs alike."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn
from torchmetrics.text import Perplexity

from ssfusion_lightning.data.sequences import IGNORE_INDEX
from ssfusion_lightning.models.tasks.base import Task


class LanguageModel(Task):
    """Trains ``model`` (token ids (N, T) -> logits (N, T, V)) on batches ``(inputs (N, T), targets (N, T))``.

    ``targets`` are aligned with the model's output positions and hold ``IGNORE_INDEX`` where there is
    nothing to predict. The data decides the objective: next-token targets make it a causal LM,
    targets only at masked positions make it a masked LM, so the loss is the same either way.

    Logs ``train/loss`` per step, and per epoch ``val/loss``, ``val/ppl``, ``test/loss``, ``test/ppl``.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: str = "adamw",
        lr: float = 3e-4,
        weight_decay: float = 0.01,
        momentum: float = 0.9,
        betas: tuple[float, float] = (0.9, 0.999),
        lr_schedule: str = "constant",
        warmup_steps: int = 0,
    ) -> None:
        super().__init__(model, optimizer, lr, weight_decay, momentum, betas, lr_schedule, warmup_steps)
        self.save_hyperparameters(ignore=["model"])
        self.val_ppl = Perplexity(ignore_index=IGNORE_INDEX)
        self.test_ppl = Perplexity(ignore_index=IGNORE_INDEX)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        inputs, targets = batch
        loss = _token_loss(self.model(inputs), targets)
        # No prog_bar and no sync on per-step values: either would force a device sync every step.
        self.log("train/loss", loss)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self._evaluate(batch, "val", self.val_ppl)

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self._evaluate(batch, "test", self.test_ppl)

    def _evaluate(self, batch: tuple[Tensor, Tensor], stage: str, perplexity: Perplexity) -> None:
        inputs, targets = batch
        logits = self.model(inputs)
        # The metric takes log(softmax) itself; in half precision that underflows for unlikely targets.
        perplexity.update(logits.float(), targets)
        self.log(f"{stage}/loss", _token_loss(logits, targets), sync_dist=True)
        self.log(f"{stage}/ppl", perplexity, prog_bar=True)


def _token_loss(logits: Tensor, targets: Tensor) -> Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX)
