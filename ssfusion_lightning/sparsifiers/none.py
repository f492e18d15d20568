"""`none`: keep every element (dense); the exact-equivalence baseline against DDP."""

from __future__ import annotations

import torch
from torch import Tensor

from ssfusion_lightning.sparsifiers.base import SPARSIFIERS, Sparsifier


@SPARSIFIERS.register("none")
class NoneSparsifier(Sparsifier):
    name = "none"
    is_dense = True

    def __init__(self, density: float = 1.0, **options) -> None:
        super().__init__(density=density, **options)

    def k_for(self, numel: int) -> int:
        return numel

    def output_count(self, shape: torch.Size, k: int) -> int:
        return shape.numel()

    def select(self, tensor: Tensor, *, key: str = "", k: int | None = None) -> tuple[Tensor, Tensor]:
        flat = tensor.reshape(-1)
        return flat, torch.arange(flat.numel(), device=flat.device)
