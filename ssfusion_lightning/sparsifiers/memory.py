"""Error-feedback memories: what a rank did not send is kept and added to its next gradient."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch
from torch import Tensor

from ssfusion_lightning.registry import Registry


class Memory(ABC):
    """Per-tensor error feedback, keyed by tensor name.

    ``compensate(key, grad)`` returns the tensor to select from (it never aliases ``grad``);
    ``update(key, compensated, sent_indices)`` records what was not applied. ``sent_indices`` are
    the flat positions whose compensated value left this rank and was applied.
    """

    @abstractmethod
    def compensate(self, key: str, grad: Tensor) -> Tensor: ...

    @abstractmethod
    def update(self, key: str, compensated: Tensor, sent_indices: Tensor) -> None: ...

    def residual(self, key: str) -> Tensor | None:
        """The mass this rank still owes for ``key`` (None when nothing is stored)."""
        return None

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        return None

    def reset(self) -> None:
        return None


MEMORIES: Registry[Memory] = Registry("memory")


@MEMORIES.register("none")
class NoMemory(Memory):
    def compensate(self, key: str, grad: Tensor) -> Tensor:
        return grad.clone()

    def update(self, key: str, compensated: Tensor, sent_indices: Tensor) -> None:
        return None


@MEMORIES.register("residual")
class ResidualMemory(Memory):
    """g' = g + e; after selection e = g' with the sent positions zeroed, so sent + e == g' exactly."""

    def __init__(self) -> None:
        self.residuals: dict[str, Tensor] = {}

    def compensate(self, key: str, grad: Tensor) -> Tensor:
        residual = self.residuals.get(key)
        if residual is None:
            return grad.clone()
        return grad + residual.view_as(grad)

    def update(self, key: str, compensated: Tensor, sent_indices: Tensor) -> None:
        residual = self.residuals.get(key)
        if residual is None or residual.shape != compensated.shape:
            residual = torch.empty_like(compensated)
            self.residuals[key] = residual
        residual.copy_(compensated)
        residual.view(-1)[sent_indices] = 0

    def residual(self, key: str) -> Tensor | None:
        return self.residuals.get(key)

    def state_dict(self) -> dict[str, Any]:
        return {"residuals": {k: v.detach().cpu().clone() for k, v in self.residuals.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.residuals = {k: v.clone() for k, v in state["residuals"].items()}

    def to(self, device: torch.device) -> None:
        self.residuals = {k: v.to(device) for k, v in self.residuals.items()}

    def reset(self) -> None:
        self.residuals.clear()
