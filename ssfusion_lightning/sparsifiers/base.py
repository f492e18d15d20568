"""The sparsifier interface: pick which elements of one (error-compensated) tensor to send."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import Any, ClassVar

import torch
from torch import Tensor

from ssfusion_lightning.registry import Registry


def k_for(numel: int, density: float) -> int:
    """Elements kept for a tensor of ``numel`` elements: max(1, floor(density * numel)), never above numel."""
    if numel <= 0:
        return 0
    return min(numel, max(1, math.floor(density * numel)))


def validate_density(density: float) -> float:
    if isinstance(density, bool) or not isinstance(density, (int, float)) or not (0.0 < float(density) <= 1.0):
        raise ValueError(f"density must be a number with 0 < density <= 1, got {density!r}")
    return float(density)


class Sparsifier(ABC):
    """Selects elements of a tensor.

    ``select`` flattens its input and returns ``(values, indices)``: ``values`` in the input's dtype,
    ``indices`` int64 positions into the flattened tensor, with no duplicates.
    ``key`` names the tensor (stateful sparsifiers keep per-tensor state under it); ``k`` overrides
    the count derived from the density (fusion policies use it for per-tensor budgets).
    """

    name: ClassVar[str] = ""
    #: returns exactly k elements (threshold sparsifiers return a count near k)
    exact_k: ClassVar[bool] = True
    #: every rank selects the same positions, so the sum needs no index exchange
    shared_indices: ClassVar[bool] = False
    #: keeps everything: the tensor is sent dense
    is_dense: ClassVar[bool] = False

    def __init__(self, density: float = 0.01, **options: Any) -> None:
        if options:
            raise TypeError(f"{type(self).__name__} got unknown options {sorted(options)}")
        self.density = validate_density(density)
        self.step = 0

    def k_for(self, numel: int) -> int:
        return k_for(numel, self.density)

    def output_count(self, shape: torch.Size, k: int) -> int | None:
        """The exact number of elements ``select`` returns for this shape and k, or None if data-dependent."""
        numel = math.prod(shape)
        return min(k, numel) if self.exact_k else None

    @abstractmethod
    def select(self, tensor: Tensor, *, key: str = "", k: int | None = None) -> tuple[Tensor, Tensor]:
        """Return (values, int64 flat indices) of the selected elements."""

    def advance(self) -> None:
        """Called once per communication round, after every tensor of the round was selected."""
        self.step += 1

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])


SPARSIFIERS: Registry[Sparsifier] = Registry("sparsifier")
