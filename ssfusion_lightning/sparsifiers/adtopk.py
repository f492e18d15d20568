"""`adtopk`: ADTopk's all-dimension top-k -- the top elements of EVERY row, so no output channel is left out."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from ssfusion_lightning.sparsifiers.base import SPARSIFIERS, Sparsifier


def row_budget(shape: tuple[int, ...] | torch.Size, k: int) -> tuple[int, int, int] | None:
    """(rows, cols, per-row k) for a tensor viewed as a matrix with dim 0 as rows; None when it goes dense."""
    if len(shape) <= 1:
        return None
    rows = int(shape[0])
    cols = math.prod(shape[1:])
    if rows == 0 or cols == 0:
        return rows, cols, 0
    per_row = min(cols, max(1, math.ceil(k / rows)))
    if per_row >= cols:
        return None
    return rows, cols, per_row


@SPARSIFIERS.register("adtopk")
class ADTopkSparsifier(Sparsifier):
    """View the tensor as a matrix (dim 0 = rows, the other dims flattened into columns) and keep
    the top ``k_row`` magnitudes of every row.

    How the flat budget k maps: ``k_row = max(1, ceil(k / rows))`` (capped at cols), i.e.
    ceil(density * cols) for the default k = floor(density * n) up to that floor's rounding. The
    count is deterministic: ``output_count(shape, k) = rows * k_row`` -- at least one element
    per row, so the real density is at least 1/cols and can exceed the configured one (count
    the real k in volume figures). 0-d and 1-D tensors go dense (every element).
    ``exact_k`` is False because the count is not k, but ``output_count`` is exact.
    """

    name = "adtopk"
    exact_k = False

    def __init__(self, density: float = 0.01, **options: Any) -> None:
        super().__init__(density=density, **options)

    def output_count(self, shape: torch.Size, k: int) -> int:
        shape = tuple(shape)
        numel = math.prod(shape)
        budget = row_budget(shape, self.resolve_k(numel, k))
        return numel if budget is None else budget[0] * budget[2]

    def select_rows(self, tensor: Tensor, k: int) -> Tensor:
        """Flat int64 indices of the per-row selection (every index when the tensor goes dense)."""
        flat = tensor.reshape(-1)
        budget = row_budget(tuple(tensor.shape), k)
        if budget is None:
            return torch.arange(flat.numel(), device=flat.device)
        rows, cols, per_row = budget
        if per_row == 0:
            return torch.empty(0, dtype=torch.int64, device=flat.device)
        columns = torch.topk(flat.view(rows, cols).abs(), per_row, dim=1, sorted=False).indices
        starts = torch.arange(0, rows * cols, cols, dtype=torch.int64, device=flat.device)
        return (columns + starts.unsqueeze(1)).view(-1)

    def select(self, tensor: Tensor, *, key: str = "", k: int | None = None) -> tuple[Tensor, Tensor]:
        flat = tensor.reshape(-1)
        indices = self.select_rows(tensor, self.resolve_k(flat.numel(), k))
        return flat.index_select(0, indices), indices
