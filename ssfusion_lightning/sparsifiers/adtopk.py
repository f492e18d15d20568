"""`adtopk`: ADTopk's all-dimension top-k -- the top elements of EVERY row, so no output channel is left out."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from ssfusion_lightning.sparsifiers.base import SPARSIFIERS, Sparsifier
from ssfusion_lightning.sparsifiers.selection import CHUNK, scratch


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


def row_topk(matrix: Tensor, per_row: int) -> Tensor:
    """Column indices (rows, per_row) of the largest magnitudes of every row; exact up to ties.

    Each row is folded in halves (``maximum``) up to three times, so a fold slot holds the largest
    magnitude of G = 2^levels strided columns. The top ``per_row`` elements of a row all lie in
    the ``per_row`` groups with the largest maxima (a group ranked lower has ``per_row`` group
    maxima, i.e. distinct elements, above it), so top-k runs on the fold (G times smaller) and
    then on the G * per_row members of the chosen groups. On CPU, blocks of rows go through a
    reused scratch buffer instead of one full-size ``abs()``.
    """
    rows, cols = matrix.shape
    levels = 0
    while levels < 3 and cols % (2 << levels) == 0 and 4 * per_row * (2 << levels) <= cols:
        levels += 1
    if matrix.device.type == "cpu":
        block = min(rows, max(1, CHUNK // cols))
        mag_buffer, _ = scratch(matrix.dtype, block * cols)
        out = torch.empty(rows, per_row, dtype=torch.int64)
        for start in range(0, rows, block):
            stop = min(start + block, rows)
            mag = mag_buffer[: (stop - start) * cols].view(stop - start, cols)
            torch.abs(matrix[start:stop], out=mag)
            out[start:stop] = _row_topk_of(mag, per_row, levels)
        return out
    return _row_topk_of(matrix.abs(), per_row, levels)


def _row_topk_of(mag: Tensor, per_row: int, levels: int) -> Tensor:
    if levels == 0:
        return torch.topk(mag, per_row, dim=1, sorted=False).indices
    rows, cols = mag.shape
    groups = 1 << levels
    fold, width = mag, cols
    for _ in range(levels):
        width //= 2
        fold = torch.maximum(fold[:, :width], fold[:, width : 2 * width])
    best = torch.topk(fold, per_row, dim=1, sorted=False).indices  # group ids in [0, cols / G)
    offsets = torch.arange(0, cols, cols // groups, dtype=torch.int64, device=mag.device)
    members = (best.unsqueeze(2) + offsets.view(1, 1, groups)).view(rows, per_row * groups)
    chosen = torch.topk(torch.gather(mag, 1, members), per_row, dim=1, sorted=False).indices
    return torch.gather(members, 1, chosen)


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
    needs_shape = True
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
        columns = row_topk(flat.view(rows, cols), per_row)
        starts = torch.arange(0, rows * cols, cols, dtype=torch.int64, device=flat.device)
        return (columns + starts.unsqueeze(1)).view(-1)

    def select(self, tensor: Tensor, *, key: str = "", k: int | None = None) -> tuple[Tensor, Tensor]:
        flat = tensor.reshape(-1)
        indices = self.select_rows(tensor, self.resolve_k(flat.numel(), k))
        return flat.index_select(0, indices), indices
