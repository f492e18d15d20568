"""`adtopk_interleaved`: ADTopk's interleaved sparsification -- ADTopk and flat top-k on alternate steps."""

from __future__ import annotations

from typing import Any

from torch import Tensor

from ssfusion_lightning.sparsifiers.adtopk import ADTopkSparsifier
from ssfusion_lightning.sparsifiers.base import SPARSIFIERS
from ssfusion_lightning.sparsifiers.selection import topk_indices


@SPARSIFIERS.register("adtopk_interleaved")
class InterleavedADTopkSparsifier(ADTopkSparsifier):
    """Steps with ``(step + phase) % 2 == 0`` use ADTopk (top of every row), the others flat exact
    top-k over the whole tensor with the SAME count, ``rows * k_row``, so the payload size never
    changes between the two kinds of step and ``output_count`` is exact and step-independent.
    The phase follows the checkpointed step counter. Option ``phase`` (0 or 1, default 0: the
    first step is an ADTopk step). 0-d and 1-D tensors go dense.
    """

    name = "adtopk_interleaved"

    def __init__(self, density: float = 0.01, phase: int = 0, **options: Any) -> None:
        super().__init__(density=density, **options)
        if phase not in (0, 1) or isinstance(phase, bool):
            raise ValueError(f"phase must be 0 or 1, got {phase!r}")
        self.phase = phase

    @property
    def adtopk_step(self) -> bool:
        return (self.step + self.phase) % 2 == 0

    def select(self, tensor: Tensor, *, key: str = "", k: int | None = None) -> tuple[Tensor, Tensor]:
        flat = tensor.reshape(-1)
        k = self.resolve_k(flat.numel(), k)
        if self.adtopk_step:
            indices = self.select_rows(tensor, k)
        else:
            count = self.output_count(tensor.shape, k)
            indices = topk_indices(flat, count)  # every index when count covers the tensor
        return flat.index_select(0, indices), indices
