"""`nonzero`: keep exactly the nonzero elements (lossless; ZEN's case of naturally sparse gradients)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ssfusion_lightning.sparsifiers.base import SPARSIFIERS, Sparsifier
from ssfusion_lightning.sparsifiers.selection import indices_at_least, is_all_finite, sample_positions


@SPARSIFIERS.register("nonzero")
class NonzeroSparsifier(Sparsifier):
    """Every nonzero element (NaN excepted), whatever k is: decompressing gives the input back.

    The count is data-dependent (``exact_k`` False, ``output_count`` None); a tensor of zeros
    gives an empty selection. NaN elements are not kept (the memories refuse non-finite values).
    """

    name = "nonzero"
    exact_k = False

    def __init__(self, density: float = 1.0, **options: Any) -> None:
        super().__init__(density=density, **options)

    def output_count(self, shape: torch.Size, k: int) -> None:
        return None

    def select(self, tensor: Tensor, *, key: str = "", k: int | None = None) -> tuple[Tensor, Tensor]:
        flat = tensor.reshape(-1)
        n = flat.numel()
        probe = flat.index_select(0, sample_positions(n, 1024, flat.device)) if n > 4096 else flat
        if bool((probe != 0).float().mean() > 0.25):  # mostly nonzero: one plain pass, one output
            indices = flat.nonzero().view(-1)
            values = flat.index_select(0, indices)
            if not is_all_finite(values):
                keep = ~torch.isnan(values)
                indices, values = indices[keep], values[keep]
            return values, indices
        indices = indices_at_least(flat, 0.0)  # |x| > 0, chunked on CPU
        return flat.index_select(0, indices), indices
