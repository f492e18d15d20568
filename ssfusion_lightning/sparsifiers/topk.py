"""`topk`: exact top-k by magnitude, with a sampled threshold pre-filter (see ``selection``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import Tensor

from ssfusion_lightning.sparsifiers import batched
from ssfusion_lightning.sparsifiers.base import SPARSIFIERS, Sparsifier
from ssfusion_lightning.sparsifiers.selection import topk_indices


@SPARSIFIERS.register("topk")
class TopKSparsifier(Sparsifier):
    """Exactly k elements: the k largest magnitudes (ties broken arbitrarily).

    Large tensors go through a pre-filter: a sample bounds the k-th magnitude from below, one
    pass keeps the candidates above the bound, and ``torch.topk`` runs on the candidates only;
    if the bound fails the whole tensor goes to ``torch.topk``. Same selection as
    ``torch.topk(tensor.abs(), k)`` up to ties. ``select_many`` does the same for the tensors of
    a buffer in a few whole-buffer passes (``batched.exact_topk``).
    """

    name = "topk"

    def __init__(self, density: float = 0.01, **options: Any) -> None:
        super().__init__(density=density, **options)

    def select(self, tensor: Tensor, *, key: str = "", k: int | None = None) -> tuple[Tensor, Tensor]:
        flat = tensor.reshape(-1)
        indices = topk_indices(flat, self.resolve_k(flat.numel(), k))
        return flat.index_select(0, indices), indices

    def select_many(
        self, tensors: Sequence[Tensor], keys: Sequence[str], ks: Sequence[int | None]
    ) -> list[tuple[Tensor, Tensor]]:
        return batched.select_many(self, tensors, keys, ks, batched.exact_topk)
