"""Error-feedback memories: what a rank did not send is kept and added to its next gradient.

Every memory keeps its state contiguous (flat positions are logical row-major positions, whatever
the gradient's memory format, e.g. channels_last) and divided by ``loss_scale`` when one is given:
a GradScaler's scale changes between steps (down after an overflow, up after a run of finite
steps), and state kept in unscaled units owes the same gradient mass whatever the next scale is
(exactly, for the scaler's power-of-two scales).

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

    ``compensate(key, grad)`` returns the tensor to select from (contiguous, never aliasing
    ``grad``); ``update(key, compensated, sent_indices)`` records what was not applied.
    ``sent_indices`` are the flat positions whose compensated value left this rank and was applied.
    ``loss_scale`` (a 0-d tensor, or None) is the factor ``grad`` and ``compensated`` carry; pass
    the same one to the ``update`` that follows a ``compensate``.
    """

    @abstractmethod
    def compensate(self, key: str, grad: Tensor, loss_scale: Tensor | None = None) -> Tensor: ...

    @abstractmethod
    def update(self, key: str, compensated: Tensor, sent_indices: Tensor, loss_scale: Tensor | None = None) -> None: ...

    def compensate_dense(self, key: str, grad: Tensor, loss_scale: Tensor | None = None) -> Tensor | None:
        """The tensor a dense slot sends instead of ``grad``, or None when ``grad`` goes as it is.

        A tensor the plan sends dense may still hold state from rounds it was sparse (a re-plan,
        the end of a warm-up): that mass must go out with its next send, never be dropped.
        """
        return None

    def settle_dense(self, key: str, compensated: Tensor, loss_scale: Tensor | None = None) -> None:
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
    """Zero the flat positions of a contiguous state tensor (in place, so no other layout will do)."""
    if sent_indices.numel():
        tensor.view(-1).index_fill_(0, sent_indices.to(device=tensor.device, dtype=torch.int64), 0)


def _scale_on(loss_scale: Tensor, like: Tensor) -> Tensor:
    # the offload thread may compress gradients staged in host memory while the scale lives on the GPU
    return loss_scale if loss_scale.device == like.device else loss_scale.to(like.device)


def _scaled(state: Tensor, loss_scale: Tensor) -> Tensor:
    """``state`` (unscaled units) in the units of this round's gradients, as a new tensor in its layout."""
    return torch.mul(state, _scale_on(loss_scale, state))


def _store_unscaled(out: Tensor, compensated: Tensor, loss_scale: Tensor | None) -> None:
    if loss_scale is None:
        out.copy_(compensated)
    else:
        torch.mul(compensated, _scale_on(loss_scale, compensated).reciprocal(), out=out)


@MEMORIES.register("none")
class NoMemory(Memory):
    """No error feedback: what is not sent is dropped."""

    def compensate(self, key: str, grad: Tensor, loss_scale: Tensor | None = None) -> Tensor:
        return grad.clone(memory_format=torch.contiguous_format)

    def update(self, key: str, compensated: Tensor, sent_indices: Tensor, loss_scale: Tensor | None = None) -> None:
        return None


@MEMORIES.register("residual")
class ResidualMemory(Memory):
    """g' = g + e; after selection e = g' with the sent positions zeroed, so sent + e == g' exactly."""

    def __init__(self) -> None:
        self.residuals: dict[str, Tensor] = {}

    def compensate(self, key: str, grad: Tensor, loss_scale: Tensor | None = None) -> Tensor:
        residual = self.residuals.get(key)
        if residual is None or residual.numel() != grad.numel():
            return grad.clone(memory_format=torch.contiguous_format)
        # the contiguous residual comes first: the sum takes its layout (a + b == b + a exactly)
        if loss_scale is None:
            return residual.view_as(grad) + grad
        return _scaled(residual.view_as(grad), loss_scale).add_(grad)

    def update(self, key: str, compensated: Tensor, sent_indices: Tensor, loss_scale: Tensor | None = None) -> None:
        check_finite(key, compensated)
        residual = self.residuals.get(key)
        if residual is None or residual.shape != compensated.shape or residual.dtype != compensated.dtype:
            residual = torch.empty_like(compensated, memory_format=torch.contiguous_format)
            self.residuals[key] = residual
        _store_unscaled(residual, compensated, loss_scale)
        _zero_at(residual, sent_indices)

    def compensate_dense(self, key: str, grad: Tensor, loss_scale: Tensor | None = None) -> Tensor | None:
        return self.compensate(key, grad, loss_scale) if key in self.residuals else None

    def settle_dense(self, key: str, compensated: Tensor, loss_scale: Tensor | None = None) -> None:
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

    def _clip(self, grad: Tensor, loss_scale: Tensor | None) -> Tensor:
        if self.clip_norm is None:
            return grad
        norm = float(torch.linalg.vector_norm(grad, dtype=accumulation_dtype(grad.dtype)))
        limit = self.clip_norm if loss_scale is None else self.clip_norm * float(loss_scale)  # clip_norm is unscaled
        if norm > limit:
            return grad * (limit / norm)
        return grad

    def compensate(self, key: str, grad: Tensor, loss_scale: Tensor | None = None) -> Tensor:
        grad = self._clip(grad, loss_scale)
        momentum = self.momenta.get(key)
        velocity = self.velocities.get(key)
        if momentum is None or momentum.shape != grad.shape or momentum.dtype != grad.dtype:
            momentum = torch.zeros(grad.shape, dtype=grad.dtype, device=grad.device)
            velocity = None
        # the contiguous state comes first, so the results take its layout; no velocity: a dense
        # round flushed it (or this is the first round)
        if loss_scale is None:
            new_momentum = momentum * self.momentum + grad
            compensated = new_momentum.clone() if velocity is None else velocity + new_momentum
        else:
            new_momentum = _scaled(momentum, loss_scale).mul_(self.momentum).add_(grad)
            compensated = new_momentum.clone() if velocity is None else _scaled(velocity, loss_scale).add_(new_momentum)
        self._pending[key] = new_momentum
        return compensated

    def update(self, key: str, compensated: Tensor, sent_indices: Tensor, loss_scale: Tensor | None = None) -> None:
        new_momentum = self._pending.pop(key, None)
        if new_momentum is None or new_momentum.shape != compensated.shape:
            raise RuntimeError(f"DGCMemory.update({key!r}) without a matching compensate")
        check_finite(key, compensated)
        check_finite(key, new_momentum, "momentum")
        velocity = torch.empty_like(compensated, memory_format=torch.contiguous_format)
        _store_unscaled(velocity, compensated, loss_scale)
        if loss_scale is not None:
            new_momentum.mul_(_scale_on(loss_scale, new_momentum).reciprocal())
        _zero_at(velocity, sent_indices)
        _zero_at(new_momentum, sent_indices)
        self.momenta[key] = new_momentum
        self.velocities[key] = velocity

    def compensate_dense(self, key: str, grad: Tensor, loss_scale: Tensor | None = None) -> Tensor:
        return self.compensate(key, grad, loss_scale)

    def settle_dense(self, key: str, compensated: Tensor, loss_scale: Tensor | None = None) -> None:
        new_momentum = self._pending.pop(key, None)
        if new_momentum is None or new_momentum.shape != compensated.shape:
            raise RuntimeError(f"DGCMemory.settle_dense({key!r}) without a matching compensate_dense")
        check_finite(key, compensated)
        check_finite(key, new_momentum, "momentum")
        if loss_scale is not None:
            new_momentum.mul_(_scale_on(loss_scale, new_momentum).reciprocal())
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
