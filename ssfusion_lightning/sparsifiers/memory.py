"""Error-feedback memories: what a rank did not send is kept and added to its next gradient.

Invariant of every memory: a NaN or Inf never enters its state. ``update`` checks the
compensated tensor first (one cheap reduction); a non-finite one leaves the stored state of that
key untouched and raises ``FloatingPointError`` naming the key -- what to do with the step (skip,
stop, reset) is the strategy's policy. ``load_state_dict`` refuses non-finite state the same way.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch
from torch import Tensor

from ssfusion_lightning.registry import Registry
from ssfusion_lightning.sparsifiers.selection import accumulation_dtype, all_finite


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

    def compensate_dense(self, key: str, grad: Tensor) -> Tensor | None:
        """The tensor a dense slot sends instead of ``grad``, or None when ``grad`` goes as it is.

        A tensor the plan sends dense may still hold state from rounds it was sparse (a re-plan,
        the end of a warm-up): that mass must go out with its next send, never be dropped.
        """
        return None

    def settle_dense(self, key: str, compensated: Tensor) -> None:
        """After ``compensate_dense``'s tensor went out whole: nothing is owed for ``key`` any more."""
        return None

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


def check_finite(key: str, tensor: Tensor, what: str = "compensated gradient") -> None:
    if not all_finite(tensor):
        raise FloatingPointError(
            f"non-finite values (NaN/Inf) in the {what} of {key!r}: refused by error feedback, "
            "its stored state is unchanged"
        )


def _zero_at(tensor: Tensor, sent_indices: Tensor) -> None:
    if sent_indices.numel():
        tensor.view(-1).index_fill_(0, sent_indices.to(device=tensor.device, dtype=torch.int64), 0)


@MEMORIES.register("none")
class NoMemory(Memory):
    """No error feedback: what is not sent is dropped."""

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
        if residual is None or residual.numel() != grad.numel():
            return grad.clone()
        return grad + residual.view_as(grad)

    def update(self, key: str, compensated: Tensor, sent_indices: Tensor) -> None:
        check_finite(key, compensated)
        residual = self.residuals.get(key)
        if residual is None or residual.shape != compensated.shape or residual.dtype != compensated.dtype:
            residual = torch.empty_like(compensated)
            self.residuals[key] = residual
        residual.copy_(compensated)
        _zero_at(residual, sent_indices)

    def compensate_dense(self, key: str, grad: Tensor) -> Tensor | None:
        return self.compensate(key, grad) if key in self.residuals else None

    def settle_dense(self, key: str, compensated: Tensor) -> None:
        check_finite(key, compensated)
        self.residuals.pop(key, None)

    def residual(self, key: str) -> Tensor | None:
        return self.residuals.get(key)

    def state_dict(self) -> dict[str, Any]:
        return {"residuals": {k: v.detach().cpu().clone() for k, v in self.residuals.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        residuals = {k: v.clone() for k, v in state["residuals"].items()}
        for key, value in residuals.items():
            check_finite(key, value, "saved residual")
        self.residuals = residuals

    def to(self, device: torch.device) -> None:
        self.residuals = {k: v.to(device) for k, v in self.residuals.items()}

    def reset(self) -> None:
        self.residuals.clear()


@MEMORIES.register("dgc")
class DGCMemory(Memory):
    """Deep Gradient Compression's momentum correction with optional local gradient clipping.

    Per key: g <- clip(g) (scaled to L2 norm ``clip_norm`` when larger; None/0 disables);
    u <- momentum * u + g; v <- v + u; select from v; then u and v are zeroed at the sent
    positions (momentum factor masking). The sent values are the accumulated velocity, so use
    the optimizer WITHOUT its own momentum. ``compensate`` computes the new u and v without
    storing them; ``update`` stores both (refusing non-finite values, leaving the old state).
    ``residual(key)`` is v: at every step, sent + v == the compensated tensor exactly.

    A dense slot (selective/partial plans, warm-up) gets the same optimizer semantics: it sends
    v + u with u <- momentum * u + g and keeps u unmasked, so with every position sent each round
    this is momentum SGD, momentum applied once and never lost; v is flushed and dropped.
    """

    def __init__(self, momentum: float = 0.9, clip_norm: float | None = None) -> None:
        if isinstance(momentum, bool) or not isinstance(momentum, (int, float)) or not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must be a number in [0, 1), got {momentum!r}")
        bad_clip = isinstance(clip_norm, bool) or not isinstance(clip_norm, (int, float)) or clip_norm < 0
        if clip_norm is not None and bad_clip:
            raise ValueError(f"clip_norm must be None or a number >= 0, got {clip_norm!r}")
        self.momentum = float(momentum)
        self.clip_norm = float(clip_norm) if clip_norm else None
        self.momenta: dict[str, Tensor] = {}
        self.velocities: dict[str, Tensor] = {}
        self._pending: dict[str, Tensor] = {}  # new momentum computed by compensate, stored by update

    def _clip(self, grad: Tensor) -> Tensor:
        if self.clip_norm is None:
            return grad
        norm = float(torch.linalg.vector_norm(grad, dtype=accumulation_dtype(grad.dtype)))
        if norm > self.clip_norm:
            return grad * (self.clip_norm / norm)
        return grad

    def compensate(self, key: str, grad: Tensor) -> Tensor:
        grad = self._clip(grad)
        momentum = self.momenta.get(key)
        velocity = self.velocities.get(key)
        if momentum is None or momentum.shape != grad.shape or momentum.dtype != grad.dtype:
            momentum, velocity = torch.zeros_like(grad), None
        new_momentum = momentum * self.momentum + grad
        self._pending[key] = new_momentum
        # no velocity: a dense round flushed it (or this is the first round)
        return new_momentum.clone() if velocity is None else velocity + new_momentum

    def update(self, key: str, compensated: Tensor, sent_indices: Tensor) -> None:
        new_momentum = self._pending.pop(key, None)
        if new_momentum is None or new_momentum.shape != compensated.shape:
            raise RuntimeError(f"DGCMemory.update({key!r}) without a matching compensate")
        check_finite(key, compensated)
        check_finite(key, new_momentum, "momentum")
        velocity = compensated.clone()
        _zero_at(velocity, sent_indices)
        _zero_at(new_momentum, sent_indices)
        self.momenta[key] = new_momentum
        self.velocities[key] = velocity

    def compensate_dense(self, key: str, grad: Tensor) -> Tensor:
        return self.compensate(key, grad)

    def settle_dense(self, key: str, compensated: Tensor) -> None:
        new_momentum = self._pending.pop(key, None)
        if new_momentum is None or new_momentum.shape != compensated.shape:
            raise RuntimeError(f"DGCMemory.settle_dense({key!r}) without a matching compensate_dense")
        check_finite(key, compensated)
        check_finite(key, new_momentum, "momentum")
        self.momenta[key] = new_momentum
        self.velocities.pop(key, None)

    def residual(self, key: str) -> Tensor | None:
        return self.velocities.get(key)

    def state_dict(self) -> dict[str, Any]:
        return {
            "momenta": {k: v.detach().cpu().clone() for k, v in self.momenta.items()},
            "velocities": {k: v.detach().cpu().clone() for k, v in self.velocities.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        momenta = {k: v.clone() for k, v in state["momenta"].items()}
        velocities = {k: v.clone() for k, v in state["velocities"].items()}
        for key in momenta:
            check_finite(key, momenta[key], "saved momentum")
        for key in velocities:
            check_finite(key, velocities[key], "saved velocity")
        self.momenta, self.velocities = momenta, velocities
        self._pending.clear()

    def to(self, device: torch.device) -> None:
        self.momenta = {k: v.to(device) for k, v in self.momenta.items()}
        self.velocities = {k: v.to(device) for k, v in self.velocities.items()}

    def reset(self) -> None:
        self.momenta.clear()
        self.velocities.clear()
        self._pending.clear()
