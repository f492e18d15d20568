"""`topk`: exact top-k by magnitude."""

from __future__ import annotations

import torch
from torch import Tensor

from ssfusion_lightning.sparsifiers.base import SPARSIFIERS, Sparsifier


@SPARSIFIERS.register("topk")
class TopKSparsifier(Sparsifier):
    name = "topk"

    def select(self, tensor: Tensor, *, key: str = "", k: int | None = None) -> tuple[Tensor, Tensor]:
        flat = tensor.reshape(-1)
        k = self.k_for(flat.numel()) if k is None else min(k, flat.numel())
        _, indices = torch.topk(flat.abs(), k, sorted=False)
        return flat[indices], indices
