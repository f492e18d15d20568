"""Error-feedback memories: what a rank did not send is kept and added to its next gradient.

Every memory keeps its state contiguous (flat positions are logical row-major positions, whatever
the gradient's memory format, e.g. channels_last) and divided by ``loss_scale`` when one is given:
a GradScaler's scale changes between steps (down after an overflow, up after a run of finite
steps), and state kept in unscaled units owes the same gradient mass whatever the next scale is
(exactly, for the scaler's power-of-two scales).

A memory owns no copy beyond its state. ``compensate`` returns a temporary to select from and
leaves the state alone (a round may still be dropped); ``update`` commits the round by recomputing
the same compensation in place into the state from the round's gradient (the same operations in
the same order, so bit for bit what was selected from) and zeroing the sent positions. The engine
holds the gradients until the round commits anyway, so nothing the size of the gradients is kept
in between, and a dropped round leaves the state exactly as it was.

Invariant of every memory: a NaN or Inf never enters its state. ``update`` checks the gradient
first (one cheap reduction; the engine, whose vote already checked the compensated tensors, tells it
to skip this: ``verified``); a non-finite one leaves the stored state of that key untouched and
raises ``FloatingPointError`` naming the key -- what to do with the step (skip, stop, reset) is
the strategy's policy. A sum of finite values that overflows (fp16) cannot be undone in place: that
key's state is dropped and the same error raised. ``load_state_dict`` refuses non-finite state too.
"""

from __future__ import annotations

import itertools
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Mapping, Sequence

import torch
from torch import Tensor

from ssfusion_lightning.registry import Registry
from ssfusion_lightning.sparsifiers.selection import all_finite, is_all_finite, statistics_dtype, thread_buffer


class Memory(ABC):
    """Per-tensor error feedback, keyed by tensor name.

    ``compensate(key, grad)`` returns the tensor to select from (contiguous, never aliasing
    ``grad``), a temporary: the state is untouched. ``update(key, grad, sent_indices)`` commits
    the round with the same ``grad``: the state becomes what ``compensate`` returned, with the
    sent positions zeroed (a memory may keep that very tensor as its state, so read it before the
    commit). ``sent_indices`` are the flat positions whose compensated value left
    this rank and was applied. ``loss_scale`` (a 0-d tensor, or None) is the factor ``grad``
    carries; pass the same one to the ``update`` that follows a ``compensate``. ``verified``: the
    caller found the tensor ``compensate`` returned finite. It is a sum of finite state and terms
    that include ``grad``, so ``grad`` is finite too, and so is the state the commit recomputes
    (the same operations): the commit skips its two checks (two passes over the tensor), except
    with a ``loss_scale``, whose unscaling may still overflow.
    """

    #: a dense slot sends its gradient as it is once nothing is owed (``compensate_dense`` gives None):
    #: a round with every tensor dense is then DDP's all-reduce (memories whose dense slots send
    #: their own state, momentum correction's velocity or Adam's update, say False)
    dense_as_is: ClassVar[bool] = True

    @abstractmethod
    def compensate(self, key: str, grad: Tensor, loss_scale: Tensor | None = None) -> Tensor: ...

    @abstractmethod
    def update(
        self, key: str, grad: Tensor, sent_indices: Tensor, loss_scale: Tensor | None = None, verified: bool = False
    ) -> None: ...

    def compensate_into(self, key: str, grad: Tensor, out: Tensor, loss_scale: Tensor | None = None) -> Tensor:
        """``compensate``'s tensor written into ``out`` (flat, ``grad.numel()`` elements, in logical
        order), the same bits; returns ``out``. A fusing policy passes its buffer's slice, so no
        temporary the size of the tensor is made where the memory can compute in place."""
        return out.copy_(self.compensate(key, grad, loss_scale).reshape(-1))

    def compensate_dense(self, key: str, grad: Tensor, loss_scale: Tensor | None = None) -> Tensor | None:
        """The tensor a dense slot sends instead of ``grad``, or None when ``grad`` goes as it is.

        A tensor the plan sends dense may still hold state from rounds it was sparse (a re-plan,
        the end of a warm-up): that mass must go out with its next send, never be dropped.
        """
        return None

    def settle_dense(self, key: str, grad: Tensor, loss_scale: Tensor | None = None) -> None:
        """After ``compensate_dense``'s tensor of ``grad`` went out whole: nothing is owed for
        ``key`` any more (what the memory keeps beyond the residual, e.g. momentum, moves on)."""
        return None

    def compensate_many(self, keys: Sequence[str], grads: Sequence[Tensor], loss_scale: Tensor | None = None) -> list[Tensor]:
        """``compensate`` of several tensors (a buffer's batched sparse slots), in their order."""
        return [self.compensate(key, grad, loss_scale) for key, grad in zip(keys, grads)]

    def update_many(
        self,
        keys: Sequence[str],
        grads: Sequence[Tensor],
        sent_indices: Sequence[Tensor],
        loss_scale: Tensor | None = None,
        verified: bool = False,
    ) -> None:
        """``update`` of several tensors, in their order."""
        for key, grad, sent in zip(keys, grads, sent_indices):
            self.update(key, grad, sent, loss_scale, verified)

    def compensate_dense_many(
        self, keys: Sequence[str], grads: Sequence[Tensor], loss_scale: Tensor | None = None
    ) -> list[Tensor | None]:
        """``compensate_dense`` of several tensors (a buffer's dense slots), in their order."""
        return [self.compensate_dense(key, grad, loss_scale) for key, grad in zip(keys, grads)]

    def compensate_dense_flat(
        self, keys: Sequence[str], grads: Sequence[Tensor], loss_scale: Tensor | None = None
    ) -> Tensor | None:
        """What ``compensate_dense_many`` gives, as one new flat tensor (each key's in logical
        row-major order, in the keys' order), where this memory has that form for these keys and
        every one of them owes state; else None, and the caller takes ``compensate_dense_many``."""
        return None

    def settle_dense_many(self, keys: Sequence[str], grads: Sequence[Tensor], loss_scale: Tensor | None = None) -> None:
        """``settle_dense`` of several tensors, in their order."""
        for key, grad in zip(keys, grads):
            self.settle_dense(key, grad, loss_scale)

    def residual(self, key: str) -> Tensor | None:
        """The mass this rank still owes for ``key`` (None when nothing is stored)."""
        return None

    def owed_states(self) -> list[dict[str, Tensor]]:
        """The state that is gradient mass still owed to the sum (what ``compensate`` adds and a
        dense slot flushes), one dict per kind; what the memory keeps for itself (momentum, Adam's
        moments) is not owed. ``set_aside`` and ``put_back`` move it."""
        return []

    def set_world_size(self, world_size: int) -> None:
        """The number of ranks whose gradients are summed (the engine's, set once)."""
        return None

    @property
    def ddp_can_take_over(self) -> bool:
        """Whether DDP's reducer can run this memory's dense rounds once nothing is owed: its dense
        slots send the gradient as it is (``dense_as_is``), or what they send instead the optimizer
        can compute from the averaged gradient once it has this memory's state (``hand_to_optimizer``)."""
        return self.dense_as_is

    @property
    def in_optimizer(self) -> bool:
        """Whether the optimizer holds this memory's state (``hand_to_optimizer``)."""
        return False

    def hand_to_optimizer(self, params: Mapping[str, Tensor], average_: Callable[[list[Tensor]], None]) -> None:
        """DDP's reducer runs the dense rounds from the next optimizer step on: what this memory keeps
        for them moves to the optimizer. ``params``: key -> parameter; ``average_`` averages tensors
        in place over the ranks (a collective: every rank calls this at the same step)."""
        return None

    def take_from_optimizer(self, params: Mapping[str, Tensor]) -> bool:
        """The engine's hooks run the rounds again, or a checkpoint was loaded whose optimizer holds
        this memory's state: take back what ``hand_to_optimizer`` moved. True where something moved."""
        return False

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        return None

    def reset(self) -> None:
        return None


MEMORIES: Registry[Memory] = Registry("memory")


def set_aside(memory: Memory) -> list[dict[str, Tensor]]:
    """Take what ``memory`` owes out of it (``owed_states``), for ``put_back``. Meanwhile its dense
    slots send their fresh gradients (the memory's own state, momentum or moments, moves on as on
    any dense round) and flush nothing: what a sparse plan owes stays owed through a few dense
    steps taken only to time them (the plan trial's dense window)."""
    held = []
    for state in memory.owed_states():
        held.append(dict(state))
        state.clear()
    return held


def put_back(memory: Memory, held: list[dict[str, Tensor]]) -> None:
    """Return what ``set_aside`` took, added to whatever the memory came to owe for the same key
    since: the sum is what is owed."""
    for state, kept in zip(memory.owed_states(), held):
        for key, tensor in kept.items():
            owed_since = state.get(key)
            if owed_since is None:
                state[key] = tensor
            else:
                owed_since.add_(tensor)


def check_finite(key: str, tensor: Tensor, what: str = "compensated gradient") -> None:
    if not is_all_finite(tensor):
        raise FloatingPointError(
            f"non-finite values (NaN/Inf) in the {what} of {key!r}: refused by error feedback, "
            "its stored state is unchanged"
        )


def validated_clip_norm(clip_norm: Any) -> float | None:
    """A memory's ``clip_norm`` option: None (or 0) for no clipping, else a number > 0."""
    bad = isinstance(clip_norm, bool) or not isinstance(clip_norm, (int, float)) or clip_norm < 0
    if clip_norm is not None and bad:
        raise ValueError(f"clip_norm must be None or a number >= 0, got {clip_norm!r}")
    return float(clip_norm) if clip_norm else None


def validated_feedback(feedback: Any) -> float:
    """A memory's ``feedback`` option: the fraction of the unsent part kept for the next round, in (0, 1]."""
    if isinstance(feedback, bool) or not isinstance(feedback, (int, float)) or not 0 < feedback <= 1:
        raise ValueError(
            f"feedback is the fraction of the unsent part kept for the next round, a number in (0, 1], got {feedback!r} "
            "(1 keeps all of it: error feedback)"
        )
    return float(feedback)


def _keep_(state: Tensor, feedback: float) -> None:
    """After the sent positions are zeroed: keep ``feedback`` of what was not sent."""
    if feedback != 1.0:
        state.mul_(feedback)


class LocallyClipped:
    """DGC's local clipping, for a memory with ``clip_norm``, ``world_size`` and ``_clip_factors``:
    each gradient is scaled to L2 norm ``clip_norm / sqrt(P)`` when larger (P ranks' gradients of
    that norm sum to about ``clip_norm``); ``clip_norm`` is in unscaled units."""

    clip_norm: float | None
    world_size: int
    _clip_factors: dict[str, float]  # taken by compensate, reused by the update that commits
    #: the clipping is the Trainer's, taken for the engine's rounds (memory="auto"): where DDP's
    #: reducer runs the rounds, the Trainer clips the averaged gradient again (the strategy's part)
    clipping_returns_to_trainer: bool = False

    @property
    def clips_only_here(self) -> bool:
        """Local clipping nothing else would do under DDP's reducer, which sums unclipped gradients."""
        return self.clip_norm is not None and not self.clipping_returns_to_trainer

    def set_world_size(self, world_size: int) -> None:
        self.world_size = world_size

    def _clip_factor(self, grad: Tensor, loss_scale: Tensor | None) -> float | None:
        return self._clip_factors_of([grad], loss_scale)[0]

    def _clip_factors_of(self, grads: Sequence[Tensor], loss_scale: Tensor | None) -> list[float | None]:
        """Each gradient's clip factor, None where it is within the limit: the norms read back in
        one transfer (one per gradient cost a language model's round 76 syncs)."""
        if self.clip_norm is None or not grads:
            return [None] * len(grads)
        norms = [torch.linalg.vector_norm(grad, dtype=statistics_dtype(grad.dtype)) for grad in grads]
        values = [float(norms[0])] if len(norms) == 1 else torch.stack(norms).tolist()  # stack promotes exactly
        local = self.clip_norm / math.sqrt(self.world_size)
        limit = local if loss_scale is None else local * float(loss_scale)
        return [limit / norm if norm > limit else None for norm in values]

    def _clipped_contiguous(self, keys: Sequence[str], grads: Sequence[Tensor]) -> list[Tensor]:
        """``compensate``'s clipped gradient of each key (no loss scale), contiguous. On the host the
        scaled ones are written into one per-thread buffer reused across rounds: fresh tensors the size
        of the weights are page-faulted in on every round (gpt2_10m clipped at 1.0: 6,329 faults and
        18 ms of a 45 ms compensation). So each result is valid until this thread's next call."""
        factors = self._clip_factors_of(grads, None)
        for key, factor in zip(keys, factors):
            self._clip_factors.pop(key, None)
            if factor is not None:
                self._clip_factors[key] = factor
        scaled = [i for i, (grad, factor) in enumerate(zip(grads, factors)) if factor is not None and grad.device.type == "cpu"]
        into: dict[int, Tensor] = {}
        if scaled and len({grads[i].dtype for i in scaled}) == 1:
            buffer = thread_buffer("clipped", grads[scaled[0]].dtype, grads[scaled[0]].device, sum(grads[i].numel() for i in scaled))
            start = 0
            for i in scaled:
                into[i] = buffer[start : start + grads[i].numel()].view(grads[i].shape)
                start += grads[i].numel()
        out = []
        for i, (grad, factor) in enumerate(zip(grads, factors)):
            if factor is None:
                out.append(grad.contiguous())
            else:
                out.append(torch.mul(grad, factor, out=into[i]) if i in into else (grad * factor).contiguous())
        return out

    def _clipped(self, key: str, grad: Tensor, loss_scale: Tensor | None, commit: bool) -> Tensor:
        """The round's clipped gradient; the factor ``compensate`` found is the one its commit uses."""
        if commit and key in self._clip_factors:
            factor = self._clip_factors.pop(key)
        else:
            factor = self._clip_factor(grad, loss_scale)
            if not commit and factor is not None:
                self._clip_factors[key] = factor
        return grad if factor is None else grad * factor


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


def _unscale_(state: Tensor, loss_scale: Tensor | None) -> Tensor:
    """Back to unscaled units in place (the same multiply by the reciprocal ``compensate``'s
    results get when they are stored)."""
    return state if loss_scale is None else state.mul_(_scale_on(loss_scale, state).reciprocal())


def _add_scaled_(state: Tensor, addend: Tensor, loss_scale: Tensor | None) -> Tensor:
    """``state`` <- ``state`` * scale + ``addend`` in place: ``compensate``'s sum, in its order."""
    if loss_scale is not None:
        state.mul_(_scale_on(loss_scale, state))
    return state.add_(addend)


def _checked_commit(key: str, tensors: Sequence[Tensor], states: Sequence[dict[str, Tensor]]) -> None:
    """After an in-place commit: a sum that overflowed cannot be undone, so the key's state goes."""
    for tensor in tensors:
        if not is_all_finite(tensor):
            for state in states:
                state.pop(key, None)
            check_finite(key, tensor)


@dataclass
class _FlatGroup:
    """Several keys' states, one tensor per state kind, stored as ``views`` (in the keys' shapes)
    of one flat tensor per kind."""

    flats: list[Tensor]
    views: list[list[Tensor]]
    offsets: list[int]
    shapes: tuple[torch.Size, ...]
    names: tuple[str, ...]


@dataclass
class _HeldFlatRound:
    """A compensation's flat results for a group, with the gradients (and their versions) and the
    results' versions at its end: the commit of the same round adopts them."""

    group: _FlatGroup
    grads: list[tuple[Tensor, int]]
    momenta: Tensor
    velocities: Tensor
    momentum_views: list[Tensor]
    velocity_views: list[Tensor]
    versions: tuple[int, int] = field(init=False)

    def __post_init__(self) -> None:
        self.versions = (self.momenta._version, self.velocities._version)

    def matches(self, group: _FlatGroup, grads: Sequence[Tensor]) -> bool:
        return (
            group is self.group
            and len(grads) == len(self.grads)
            and all(grad is held and grad._version == version for grad, (held, version) in zip(grads, self.grads))
            and (self.momenta._version, self.velocities._version) == self.versions
        )


class _FlatStates:
    """A memory's flat groups. A buffer's slots are dozens of tensors, and a foreach call still pays
    a kernel per tensor: as foreach calls, momentum correction's error feedback took 0.41 ms to
    compensate and 0.67 ms to settle the digits CNN's 49 smallest tensors a step, on one core, and
    0.91 ms to commit its 19 sparse ones. So once every key of a call has its state, that state
    moves into one flat tensor per kind whose views are the stored states, and the many-tensor
    forms make each of their operations one op on it: elementwise the same operations in the same
    order, so the same bits.

    A group is kept while every key's stored state is still its view: a fresh state (a new shape),
    a loaded checkpoint, a reset, an overflow or a half-precision step replaces a state, and the
    group is rebuilt from the states as they are then, or not used."""

    def __init__(self) -> None:
        self._groups: dict[tuple[str, tuple[str, ...]], _FlatGroup] = {}

    def group(
        self, tag: str, states: Sequence[dict[str, Tensor]], keys: Sequence[str], grads: Sequence[Tensor]
    ) -> _FlatGroup | None:
        """The group of ``keys`` over ``states`` (one dict per state kind); None where some key has
        no state of its gradient's shape and dtype in every dict, or the states are not all fp32 or
        all fp64 on one device."""
        names = tuple(keys)
        shapes = tuple(grad.shape for grad in grads)
        group = self._groups.get((tag, names))
        if (
            group is not None
            and group.shapes == shapes
            and all(state.get(key) is view for state, views in zip(states, group.views) for key, view in zip(names, views))
        ):
            return group if all(grad.dtype == group.flats[0].dtype for grad in grads) else None
        tensors = [[state.get(key) for key in names] for state in states]
        first = tensors[0][0]
        if first is None or first.dtype not in (torch.float32, torch.float64):
            return None
        for row in tensors:
            for tensor, grad in zip(row, grads):
                if tensor is None or tensor.shape != grad.shape or tensor.dtype != grad.dtype or tensor.device != first.device:
                    return None
                if grad.dtype != first.dtype:
                    return None
        sizes = [grad.numel() for grad in grads]
        offsets = [0, *itertools.accumulate(sizes)][:-1]
        flats, views = [], []
        for state, row in zip(states, tensors):
            flat = torch.cat([tensor.reshape(-1) for tensor in row])
            kind = [piece.view(shape) for piece, shape in zip(flat.split(sizes), shapes)]
            state.update(zip(names, kind))
            flats.append(flat)
            views.append(kind)
        # a group that shares a key with this one no longer holds that key's state
        for other in [other for other in self._groups if not set(other[1]).isdisjoint(names)]:
            del self._groups[other]
        group = self._groups[(tag, names)] = _FlatGroup(flats, views, offsets, shapes, names)
        return group

    def adopt(
        self, group: _FlatGroup, flats: Sequence[Tensor], views: Sequence[list[Tensor]], states: Sequence[dict[str, Tensor]]
    ) -> list[Tensor]:
        """``flats`` (one per state kind, laid out as ``group``'s) and ``views`` of them in the keys'
        shapes become the group's state: the keys' states are those views from here on. Returns the
        flats they replace."""
        replaced = group.flats
        for state, kind in zip(states, views):
            state.update(zip(group.names, kind))
        group.flats, group.views = list(flats), [list(kind) for kind in views]
        return replaced

    def within(self, tag: str, keys: Sequence[str]) -> list[tuple[str, ...]]:
        """The keys of every group of ``tag`` that lies wholly among ``keys``, the keys' own group
        excepted."""
        wanted = set(keys)
        return [names for group_tag, names in self._groups if group_tag == tag and names != tuple(keys) and wanted.issuperset(names)]

    def clear(self) -> None:
        self._groups.clear()


def _split_as(flat: Tensor, like: Sequence[Tensor]) -> list[Tensor]:
    """``flat`` cut into views in the shapes of ``like``, in order (vectors as the cut gives them)."""
    pieces = flat.split([tensor.numel() for tensor in like])
    return [piece if tensor.dim() == 1 else piece.view(tensor.shape) for piece, tensor in zip(pieces, like)]


def _flat_positions(sent_indices: Sequence[Tensor], offsets: Sequence[int], device: torch.device) -> Tensor:
    """Every key's sent positions, as positions in the group's flat state."""
    return torch.cat([sent.to(device=device, dtype=torch.int64) + offset for sent, offset in zip(sent_indices, offsets)])


def _flat_of(tensors: Sequence[Tensor]) -> Tensor:
    """The tensors' elements, each in logical row-major order, in one new flat tensor (vectors as
    they are: a view of each costs more than its copy into the result)."""
    return torch.cat([tensor if tensor.dim() == 1 else tensor.reshape(-1) for tensor in tensors])


@MEMORIES.register("none")
class NoMemory(Memory):
    """No error feedback: what is not sent is dropped."""

    def compensate(self, key: str, grad: Tensor, loss_scale: Tensor | None = None) -> Tensor:
        return grad.clone(memory_format=torch.contiguous_format)

    def update(
        self, key: str, grad: Tensor, sent_indices: Tensor, loss_scale: Tensor | None = None, verified: bool = False
    ) -> None:
        return None


@MEMORIES.register("residual")
class ResidualMemory(Memory):
    """g' = g + e; after selection e = feedback * g' with the sent positions zeroed, so at feedback 1
    (the default: error feedback) sent + e == g' exactly.

    ``feedback``: the fraction of the unsent part kept, in (0, 1]. Below 1 an entry's backlog stays
    under 1 / (1 - feedback) rounds of gradient.
    """

    def __init__(self, feedback: float = 1.0) -> None:
        self.feedback = validated_feedback(feedback)
        self.residuals: dict[str, Tensor] = {}

    def compensate(self, key: str, grad: Tensor, loss_scale: Tensor | None = None) -> Tensor:
        residual = self.residuals.get(key)
        if residual is None or residual.numel() != grad.numel():
            return grad.clone(memory_format=torch.contiguous_format)
        # the contiguous residual comes first: the sum takes its layout (a + b == b + a exactly)
        if loss_scale is None:
            return residual.view_as(grad) + grad
        return _scaled(residual.view_as(grad), loss_scale).add_(grad)

    def compensate_into(self, key: str, grad: Tensor, out: Tensor, loss_scale: Tensor | None = None) -> Tensor:
        residual = self.residuals.get(key)
        target = out.view(grad.shape)  # logical order, whatever grad's memory format
        if residual is None or residual.numel() != grad.numel():
            target.copy_(grad)
        elif loss_scale is None:
            torch.add(residual.view_as(grad), grad, out=target)
        else:
            torch.mul(residual.view_as(grad), _scale_on(loss_scale, residual), out=target).add_(grad)
        return out

    def update(
        self, key: str, grad: Tensor, sent_indices: Tensor, loss_scale: Tensor | None = None, verified: bool = False
    ) -> None:
        if not verified:
            check_finite(key, grad, "gradient")
        residual = self.residuals.get(key)
        if residual is None or residual.numel() != grad.numel():
            residual = grad.clone(memory_format=torch.contiguous_format)
            self.residuals[key] = residual
        else:
            _add_scaled_(residual.view_as(grad), grad, loss_scale)
        _unscale_(residual, loss_scale)
        if not verified or loss_scale is not None:
            _checked_commit(key, [residual], [self.residuals])
        _zero_at(residual, sent_indices)
        _keep_(residual, self.feedback)

    # The many-tensor forms make the same additions as foreach calls (one dispatch for a buffer's
    # small tensors instead of one each); with a loss scale they take the one-at-a-time path.
    def compensate_many(self, keys: Sequence[str], grads: Sequence[Tensor], loss_scale: Tensor | None = None) -> list[Tensor]:
        owing = self._owing(keys, grads)
        if loss_scale is not None or len(owing) < 2:
            return super().compensate_many(keys, grads, loss_scale)
        out: list[Tensor | None] = [None] * len(keys)
        sums = torch._foreach_add([residual for _, residual in owing], [grads[i] for i, _ in owing])
        for (i, _), total in zip(owing, sums):
            out[i] = total
        return [grad.clone(memory_format=torch.contiguous_format) if total is None else total for grad, total in zip(grads, out)]

    def update_many(
        self,
        keys: Sequence[str],
        grads: Sequence[Tensor],
        sent_indices: Sequence[Tensor],
        loss_scale: Tensor | None = None,
        verified: bool = False,
    ) -> None:
        owing = self._owing(keys, grads)
        if loss_scale is not None or not verified or len(owing) < 2:
            return super().update_many(keys, grads, sent_indices, loss_scale, verified)
        torch._foreach_add_([residual for _, residual in owing], [grads[i] for i, _ in owing])
        owed = {i for i, _ in owing}
        for i, (key, grad, sent) in enumerate(zip(keys, grads, sent_indices)):
            if i not in owed:
                self.residuals[key] = grad.clone(memory_format=torch.contiguous_format)
            _zero_at(self.residuals[key], sent)
            _keep_(self.residuals[key], self.feedback)

    def _owing(self, keys: Sequence[str], grads: Sequence[Tensor]) -> list[tuple[int, Tensor]]:
        """(position, residual in the gradient's shape) of the keys whose residual fits their gradient."""
        owing = []
        for i, (key, grad) in enumerate(zip(keys, grads)):
            residual = self.residuals.get(key)
            if residual is not None and residual.numel() == grad.numel():
                owing.append((i, residual.view_as(grad)))
        return owing

    def compensate_dense(self, key: str, grad: Tensor, loss_scale: Tensor | None = None) -> Tensor | None:
        return self.compensate(key, grad, loss_scale) if key in self.residuals else None

    def settle_dense(self, key: str, grad: Tensor, loss_scale: Tensor | None = None) -> None:
        self.residuals.pop(key, None)

    def residual(self, key: str) -> Tensor | None:
        return self.residuals.get(key)

    def owed_states(self) -> list[dict[str, Tensor]]:
        return [self.residuals]

    def state_dict(self) -> dict[str, Any]:
        return {"residuals": {k: v.detach().cpu().clone() for k, v in self.residuals.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        residuals = {k: v.clone() for k, v in state["residuals"].items()}
        for key, value in residuals.items():
            check_finite(key, value, "saved residual")
        self.residuals = residuals

    def reset(self) -> None:
        self.residuals.clear()


def _momentum_groups(optimizers: Sequence[torch.optim.Optimizer]) -> list[dict[str, Any]]:
    return [g for opt in optimizers if isinstance(opt, torch.optim.SGD) for g in opt.param_groups if g.get("momentum")]


def sgd_momentum(optimizers: Sequence[torch.optim.Optimizer]) -> float | None:
    """The momentum ``memory="dgc"`` takes over from the SGD parameter groups that have one (None
    where none has); ValueError, saying why, where it cannot: several momenta, Nesterov or
    dampening (momentum correction applies plain u = m * u + g)."""
    groups = _momentum_groups(optimizers)
    if not groups:
        return None
    momenta = sorted({float(g["momentum"]) for g in groups})
    if len(momenta) > 1:
        raise ValueError(
            f"memory='dgc' takes over the optimizer's momentum, but its parameter groups use different momenta "
            f"{momenta}; use one momentum for every group, or memory='residual'"
        )
    variants = sorted({f"nesterov={g.get('nesterov')}, dampening={g.get('dampening')}" for g in groups if g.get("nesterov") or g.get("dampening")})
    if variants:
        raise ValueError(
            f"memory='dgc' applies plain momentum (u = m * u + g), but the optimizer uses {variants[0]}; "
            "use nesterov=False and dampening=0, or memory='residual'"
        )
    if not 0.0 <= momenta[0] < 1.0:
        raise ValueError(f"memory='dgc' needs a momentum in [0, 1), the optimizer has {momenta[0]!r}")
    return momenta[0]


@MEMORIES.register("dgc")
class DGCMemory(LocallyClipped, Memory):
    """Deep Gradient Compression's momentum correction with optional local gradient clipping.

    Per key: g <- clip(g) (scaled to L2 norm ``clip_norm / sqrt(P)`` when larger, DGC's local
    clipping: P ranks' gradients of that norm sum to about ``clip_norm``; None/0 disables);
    u <- momentum * u + g; v <- v + u; select from v; then u and v are zeroed at the sent
    positions (momentum factor masking). The sent values are the accumulated velocity, so the
    optimizer must not add momentum again: the strategy moves an SGD optimizer's momentum here
    (``take_momentum_from``). ``compensate`` computes the new u and v as temporaries;
    ``update`` recomputes both in place into the state (refusing a non-finite gradient, leaving
    the old state), except that a batch of sparse slots whose states are one flat group keeps
    the flat u and v its ``compensate_many`` computed, where the gradients are the same.
    ``residual(key)`` is v: at every step, v == feedback * (the compensated tensor - sent), so at
    feedback 1 (the default) sent + v == the compensated tensor exactly.
    ``feedback``: the fraction of the unsent velocity kept, in (0, 1]; u is only masked. Below 1 an
    entry's backlog stays under 1 / (1 - feedback) rounds.

    A dense slot (selective/partial plans, warm-up) gets the same optimizer semantics: it sends
    v + u with u <- momentum * u + g and keeps u unmasked, so with every position sent each round
    this is momentum SGD, momentum applied once and never lost; v is flushed and dropped.

    A plan with every tensor dense is then momentum SGD on the ranks' averaged u, which the SGD
    whose momentum this memory took computes itself from DDP's averaged gradient once its buffer is
    that average: ``hand_to_optimizer`` moves it there and gives the groups their momentum back,
    ``take_from_optimizer`` moves the buffers back. Weight decay then sits inside the momentum, as
    in torch's SGD (here it is added after, by the optimizer with momentum 0).
    """

    dense_as_is = False

    def __init__(self, momentum: float = 0.9, clip_norm: float | None = None, feedback: float = 1.0) -> None:
        if isinstance(momentum, bool) or not isinstance(momentum, (int, float)) or not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must be a number in [0, 1), got {momentum!r}")
        self.momentum = float(momentum)
        self.clip_norm = validated_clip_norm(clip_norm)
        self.feedback = validated_feedback(feedback)
        self.world_size = 1
        self.momenta: dict[str, Tensor] = {}
        self.velocities: dict[str, Tensor] = {}
        self._clip_factors: dict[str, float] = {}  # taken by compensate, reused by the update that commits
        self._flat = _FlatStates()
        #: per sparse group, the flat u' and v' its last ``compensate_many`` computed, which its commit
        #: adopts where nothing changed since; and the host flats the last adoption replaced, for the
        #: next round to compute in (fresh host tensors come as fresh pages)
        self._held: dict[tuple[str, ...], _HeldFlatRound] = {}
        self._flat_spares: dict[tuple[str, ...], list[Tensor]] = {}
        # (optimizer, index of a parameter group) whose momentum moved here: by index, because
        # loading the optimizer's state replaces its group dicts
        self._taken: list[tuple[torch.optim.Optimizer, int]] = []
        self._optimizer_steps_every_tensor = False

    def take_momentum_from(self, optimizers: Sequence[torch.optim.Optimizer], params: Sequence[Tensor] = ()) -> float | None:
        """Momentum correction replaces an SGD optimizer's momentum (applied twice otherwise: once
        here, once in the optimizer): the momentum of the SGD parameter groups that have one moves
        here, and theirs becomes 0. Returns it, or None when no group had momentum. ``params``: the
        tensors this memory keeps momentum for; where those groups hold every one of them, the
        momentum can move back for DDP's reducer (``ddp_can_take_over``)."""
        momentum = sgd_momentum(optimizers)
        if momentum is None:
            return None
        self.momentum = momentum
        self._taken = [
            (optimizer, index)
            for optimizer in optimizers if isinstance(optimizer, torch.optim.SGD)
            for index, group in enumerate(optimizer.param_groups) if group.get("momentum")
        ]
        for _, group in self._taken_groups():
            group["momentum"] = 0.0
        stepped = {id(param) for _, group in self._taken_groups() for param in group["params"]}
        self._optimizer_steps_every_tensor = bool(params) and all(id(param) in stepped for param in params)
        return self.momentum

    def _taken_groups(self) -> list[tuple[torch.optim.Optimizer, dict[str, Any]]]:
        return [(optimizer, optimizer.param_groups[index]) for optimizer, index in self._taken]

    def _owners(self) -> dict[int, torch.optim.Optimizer]:
        """id(parameter) -> the SGD whose momentum this memory took, for the tensors it steps."""
        return {id(param): optimizer for optimizer, group in self._taken_groups() for param in group["params"]}

    @property
    def ddp_can_take_over(self) -> bool:
        """The SGD whose momentum this memory took steps every tensor, and no clipping only this
        memory would do."""
        return self._optimizer_steps_every_tensor and not self.clips_only_here

    @property
    def in_optimizer(self) -> bool:
        return any(group["momentum"] for _, group in self._taken_groups())

    def hand_to_optimizer(self, params: Mapping[str, Tensor], average_: Callable[[list[Tensor]], None]) -> None:
        """Each rank's u holds its own gradients, and a dense round sends their average: that average
        becomes each tensor's SGD momentum buffer, the groups get their momentum back, and this memory
        keeps none (a checkpoint holds the momentum in one place). A tensor without u gets no buffer:
        torch's SGD starts it from its first gradient, as a fresh u here would. Nothing moves where
        the SGD has its momentum already (a run resumed from a checkpoint written while handed off)."""
        if self.in_optimizer:
            return
        keys = [key for key in params if key in self.momenta]
        momenta = [self.momenta[key] for key in keys]
        average_(momenta)
        owner = self._owners()
        for _, group in self._taken_groups():
            group["momentum"] = self.momentum
        for param in params.values():
            optimizer = owner.get(id(param))
            if optimizer is not None:
                optimizer.state[param].pop("momentum_buffer", None)
        for key, momentum in zip(keys, momenta):
            owner[id(params[key])].state[params[key]]["momentum_buffer"] = momentum
        self.momenta.clear()
        self._clear_flat()

    def take_from_optimizer(self, params: Mapping[str, Tensor]) -> bool:
        """The SGD's buffers (the same on every rank: DDP's reducer averaged what they were built
        from) become each rank's u, and its groups' momentum 0 again. Also after loading a checkpoint
        of a run handed to DDP, or of plain DDP: the optimizer's momentum is then its own again."""
        if not self.in_optimizer:
            return False
        groups = self._taken_groups()
        momenta = {float(group["momentum"]) for _, group in groups} - {0.0}
        if len(momenta) > 1:
            raise ValueError(
                f"memory='dgc' takes the optimizer's momentum back, but its parameter groups now use different momenta "
                f"{sorted(momenta)}; use one momentum for every group, or memory='residual'"
            )
        self.momentum = momenta.pop()
        owner = self._owners()
        for key, param in params.items():
            optimizer = owner.get(id(param))
            buffer = None if optimizer is None else optimizer.state[param].pop("momentum_buffer", None)
            if buffer is not None:
                self.momenta[key] = buffer.detach().contiguous()
        for _, group in groups:
            group["momentum"] = 0.0
        self._clear_flat()
        return True

    def untaken_momentum(self, optimizers: Sequence[torch.optim.Optimizer]) -> str | None:
        """The warning for when ``take_momentum_from`` found no momentum to take over and this memory
        still applies its own (None when it applies none): with Adam, or SGD without momentum, the
        optimizer then steps with gradients this memory has accumulated with momentum."""
        if not self.momentum:
            return None
        names = ", ".join(sorted({type(opt).__name__ for opt in optimizers})) or "none"
        return (
            f"memory='dgc' found no SGD optimizer with momentum to take over (optimizers: {names}), so it applies "
            f"its own momentum {self.momentum} to the gradients before the optimizer steps with them, on top of any "
            "moments the optimizer keeps itself; memory='residual' is plain error feedback, and "
            "memory_options={'momentum': 0} keeps memory='dgc' without momentum"
        )

    def _fresh(self, key: str, grad: Tensor) -> bool:
        momentum = self.momenta.get(key)
        return momentum is None or momentum.shape != grad.shape or momentum.dtype != grad.dtype

    def compensate(self, key: str, grad: Tensor, loss_scale: Tensor | None = None) -> Tensor:
        self._clip_factors.pop(key, None)
        grad = self._clipped(key, grad, loss_scale, commit=False)
        fresh = self._fresh(key, grad)
        momentum = torch.zeros(grad.shape, dtype=grad.dtype, device=grad.device) if fresh else self.momenta[key]
        velocity = None if fresh else self.velocities.get(key)
        # the contiguous state comes first, so the results take its layout; no velocity: a dense
        # round flushed it (or this is the first round)
        if loss_scale is None:
            # one temporary, built in place (the commit's order of operations, so the same bits);
            # new_momentum + velocity == velocity + new_momentum exactly
            new_momentum = (momentum * self.momentum).add_(grad)
            return new_momentum if velocity is None else new_momentum.add_(velocity)
        new_momentum = _scaled(momentum, loss_scale).mul_(self.momentum).add_(grad)
        return new_momentum if velocity is None else _scaled(velocity, loss_scale).add_(new_momentum)

    def _commit_momentum(self, key: str, grad: Tensor, loss_scale: Tensor | None) -> Tensor:
        """u <- momentum * u + g in place, in the units of the round's gradients (still scaled)."""
        grad = self._clipped(key, grad, loss_scale, commit=True)
        if self._fresh(key, grad):
            self.momenta[key] = torch.zeros(grad.shape, dtype=grad.dtype, device=grad.device)
            self.velocities.pop(key, None)
        momentum = self.momenta[key]
        if loss_scale is not None:
            momentum.mul_(_scale_on(loss_scale, momentum))
        return momentum.mul_(self.momentum).add_(grad)

    def update(
        self, key: str, grad: Tensor, sent_indices: Tensor, loss_scale: Tensor | None = None, verified: bool = False
    ) -> None:
        if not verified:
            check_finite(key, grad, "gradient")
        momentum = self._commit_momentum(key, grad, loss_scale)
        velocity = self.velocities.get(key)
        if velocity is None:
            velocity = self.velocities[key] = momentum.clone()
        else:
            _add_scaled_(velocity, momentum, loss_scale)
        _unscale_(velocity, loss_scale)
        _unscale_(momentum, loss_scale)
        if not verified or loss_scale is not None:  # verified: v + u was finite, so both are
            _checked_commit(key, [momentum, velocity], [self.momenta, self.velocities])
        _zero_at(velocity, sent_indices)
        _zero_at(momentum, sent_indices)
        _keep_(velocity, self.feedback)

    def compensate_dense(self, key: str, grad: Tensor, loss_scale: Tensor | None = None) -> Tensor:
        return self.compensate(key, grad, loss_scale)

    def settle_dense(self, key: str, grad: Tensor, loss_scale: Tensor | None = None) -> None:
        check_finite(key, grad, "gradient")
        momentum = _unscale_(self._commit_momentum(key, grad, loss_scale), loss_scale)
        self.velocities.pop(key, None)
        _checked_commit(key, [momentum], [self.momenta])

    # A CNN's dense slots are dozens of small tensors (biases, norms), where each op's dispatch costs
    # more than its data: one at a time their momentum took 3.4-4.8 ms a step on the digits CNN's 48
    # small tensors, against 0.01 ms for residual memory, which has nothing to do for them
    # (experiments/REPORT.md, "Momentum correction's dense slots in a few ops"). The many-tensor
    # forms below make the same operations, in the same order per tensor (so the same bits), as
    # foreach calls; with a loss scale or clipping they take the one-at-a-time path.
    def compensate_many(self, keys: Sequence[str], grads: Sequence[Tensor], loss_scale: Tensor | None = None) -> list[Tensor]:
        if loss_scale is not None or self.clip_norm is not None or len(keys) < 2:
            return super().compensate_many(keys, grads, loss_scale)
        group = self._sparse_group(keys, grads, loss_scale)
        if group is None:
            return self._compensate_together(keys, grads)
        return self._compensate_flat(group, grads)

    def _compensate_flat(self, group: _FlatGroup, grads: Sequence[Tensor]) -> list[Tensor]:
        """v' = v + (momentum * u + g) over the group's flats, into flats of their own (the commit's
        operations in its order, so its bits), kept with u' for the commit to adopt: the round's
        state is then computed once, where recomputing it in the commit took twice the passes
        (resnet18's 13 sparse tensors: a round of 1.8 ms)."""
        momenta, velocities = group.flats
        spares = [t for t in self._flat_spares.pop(group.names, []) if t.shape == momenta.shape and t.dtype == momenta.dtype]
        if len(spares) < 2:
            spares = [torch.empty_like(momenta), torch.empty_like(velocities)]
        new_momenta = torch.mul(momenta, self.momentum, out=spares[0])
        momentum_views = _split_as(new_momenta, grads)
        torch._foreach_add_(momentum_views, list(grads))  # in the views: no flat copy of the gradients
        new_velocities = torch.add(new_momenta, velocities, out=spares[1])
        velocity_views = _split_as(new_velocities, grads)
        self._held[group.names] = _HeldFlatRound(
            group, [(grad, grad._version) for grad in grads], new_momenta, new_velocities, momentum_views, velocity_views
        )
        return velocity_views

    def _clear_flat(self) -> None:
        self._flat.clear()
        self._held.clear()
        self._flat_spares.clear()

    def _adopted(self, group: _FlatGroup, grads: Sequence[Tensor]) -> bool:
        """The commit of ``grads`` takes ``_compensate_flat``'s flats as the group's state, where they
        were computed for this very group and gradients and nothing wrote into them since."""
        held = self._held.pop(group.names, None)
        if held is None or not held.matches(group, grads):
            return False
        replaced = self._flat.adopt(
            group, [held.momenta, held.velocities], [held.momentum_views, held.velocity_views], [self.momenta, self.velocities]
        )
        if replaced[0].device.type == "cpu":
            self._flat_spares[group.names] = replaced
        return True

    def update_many(
        self,
        keys: Sequence[str],
        grads: Sequence[Tensor],
        sent_indices: Sequence[Tensor],
        loss_scale: Tensor | None = None,
        verified: bool = False,
    ) -> None:
        if loss_scale is not None or self.clip_norm is not None or not verified or len(keys) < 2:
            return super().update_many(keys, grads, sent_indices, loss_scale, verified)
        # A buffer's slots are compensated in a few batches (the small tensors, the larger ones) and
        # committed at once: each batch's group commits on its own, as a group of the whole buffer
        # would replace them, and be replaced by them, every round (three concatenations of every
        # state a step on resnet18, and no round adopted).
        position = {key: i for i, key in enumerate(keys)}
        committed: set[str] = set()
        for names in self._flat.within("sparse", keys):
            members = [position[key] for key in names]
            if self._commit_group(names, [grads[i] for i in members], [sent_indices[i] for i in members]):
                committed.update(names)
        if committed:
            rest = [i for i, key in enumerate(keys) if key not in committed]
            keys, grads, sent_indices = [keys[i] for i in rest], [grads[i] for i in rest], [sent_indices[i] for i in rest]
            if len(keys) < 2:
                return super().update_many(keys, grads, sent_indices, loss_scale, verified) if keys else None
        if self._commit_group(tuple(keys), grads, sent_indices):
            return None
        for key, grad in zip(keys, grads):
            if self._fresh(key, grad):
                self.momenta[key] = torch.zeros(grad.shape, dtype=grad.dtype, device=grad.device)
                self.velocities.pop(key, None)
        momenta = self._momenta_stepped(keys, grads)
        owing = [(key, momentum) for key, momentum in zip(keys, momenta) if key in self.velocities]
        if owing:
            torch._foreach_add_([self.velocities[key] for key, _ in owing], [momentum for _, momentum in owing])
        for key, momentum, sent in zip(keys, momenta, sent_indices):
            velocity = self.velocities.get(key)
            if velocity is None:
                velocity = self.velocities[key] = momentum.clone()
            _zero_at(velocity, sent)
            _zero_at(momentum, sent)
            _keep_(velocity, self.feedback)

    def _commit_group(self, keys: tuple[str, ...], grads: Sequence[Tensor], sent_indices: Sequence[Tensor]) -> bool:
        """The commit of ``keys`` as one flat group, adopting the round its compensation computed
        where it can; False where they form no group."""
        group = self._sparse_group(keys, grads, None)
        if group is None:
            return False
        adopted = self._adopted(group, grads)
        momenta, velocities = group.flats
        if not adopted:
            momenta.mul_(self.momentum).add_(_flat_of(grads))
            velocities.add_(momenta)
        positions = _flat_positions(sent_indices, group.offsets, momenta.device)
        velocities.index_fill_(0, positions, 0)
        momenta.index_fill_(0, positions, 0)
        _keep_(velocities, self.feedback)
        return True

    def compensate_dense_many(
        self, keys: Sequence[str], grads: Sequence[Tensor], loss_scale: Tensor | None = None
    ) -> list[Tensor | None]:
        if loss_scale is not None or self.clip_norm is not None or len(keys) < 2:
            return super().compensate_dense_many(keys, grads, loss_scale)
        compensated = self.compensate_dense_flat(keys, grads)
        return list(self._compensate_together(keys, grads)) if compensated is None else _split_as(compensated, grads)

    def compensate_dense_flat(
        self, keys: Sequence[str], grads: Sequence[Tensor], loss_scale: Tensor | None = None
    ) -> Tensor | None:
        group = self._dense_group(keys, grads, loss_scale)
        return None if group is None else torch.mul(group.flats[0], self.momentum).add_(_flat_of(grads))

    def _compensate_together(self, keys: Sequence[str], grads: Sequence[Tensor]) -> list[Tensor]:
        """``compensate`` of each key with no loss scale and no clipping, as foreach calls."""
        fresh = [self._fresh(key, grad) for key, grad in zip(keys, grads)]
        momenta = [
            torch.zeros(grad.shape, dtype=grad.dtype, device=grad.device) if new else self.momenta[key]
            for key, grad, new in zip(keys, grads, fresh)
        ]
        compensated = torch._foreach_mul(momenta, self.momentum)
        torch._foreach_add_(compensated, list(grads))
        velocities = [(i, None if new else self.velocities.get(key)) for i, (key, new) in enumerate(zip(keys, fresh))]
        owing = [(i, velocity) for i, velocity in velocities if velocity is not None]
        if owing:
            torch._foreach_add_([compensated[i] for i, _ in owing], [velocity for _, velocity in owing])
        return list(compensated)

    def _momenta_stepped(self, keys: Sequence[str], grads: Sequence[Tensor]) -> list[Tensor]:
        """u <- momentum * u + g for every key, stored and returned. In place where the state is
        single or double precision: new tensors the size of a transformer's weights come as fresh
        pages, faulted in as they are written (2.5x the time of the in-place update on gpt2's).
        Out of place in half precision: there the in-place foreach multiply rounds the factor to
        the state's dtype first, where ``mul_`` does not."""
        momenta = [self.momenta[key] for key in keys]
        if all(momentum.dtype in (torch.float32, torch.float64) for momentum in momenta):
            torch._foreach_mul_(momenta, self.momentum)
        else:
            momenta = torch._foreach_mul(momenta, self.momentum)
            self.momenta.update(zip(keys, momenta))
        torch._foreach_add_(momenta, list(grads))
        return momenta

    def settle_dense_many(self, keys: Sequence[str], grads: Sequence[Tensor], loss_scale: Tensor | None = None) -> None:
        if loss_scale is not None or self.clip_norm is not None or len(keys) < 2:
            return super().settle_dense_many(keys, grads, loss_scale)
        group = self._dense_group(keys, grads, loss_scale)
        if group is not None:
            flat_grad = _flat_of(grads)
            if not is_all_finite(flat_grad):
                return super().settle_dense_many(keys, grads, loss_scale)  # names the first non-finite one
            group.flats[0].mul_(self.momentum).add_(flat_grad)
            if not is_all_finite(group.flats[0]):  # an overflow: that key's state goes, as one at a time
                for key, momentum in zip(keys, group.views[0]):
                    _checked_commit(key, [momentum], [self.momenta])
            return None
        if not bool(all_finite(grads)):
            return super().settle_dense_many(keys, grads, loss_scale)  # names the first non-finite one
        for key, grad in zip(keys, grads):
            if self._fresh(key, grad):
                self.momenta[key] = torch.zeros(grad.shape, dtype=grad.dtype, device=grad.device)
            self.velocities.pop(key, None)
        momenta = self._momenta_stepped(keys, grads)
        if not bool(all_finite(momenta)):  # an overflow: that key's state goes, as one at a time
            for key, momentum in zip(keys, momenta):
                _checked_commit(key, [momentum], [self.momenta])

    def _dense_group(self, keys: Sequence[str], grads: Sequence[Tensor], loss_scale: Tensor | None) -> _FlatGroup | None:
        """Dense slots' flat momenta (``_FlatStates``), once every key has one and owes no velocity."""
        if loss_scale is not None or self.clip_norm is not None or len(keys) < 2 or any(key in self.velocities for key in keys):
            return None
        return self._flat.group("dense", [self.momenta], keys, grads)

    def _sparse_group(self, keys: Sequence[str], grads: Sequence[Tensor], loss_scale: Tensor | None) -> _FlatGroup | None:
        """Sparse slots' flat momenta and velocities (``_FlatStates``), once every key has both: their
        commit is then a few ops over all of them, and one zeroing of all the sent positions."""
        if loss_scale is not None or self.clip_norm is not None or len(keys) < 2:
            return None
        return self._flat.group("sparse", [self.momenta, self.velocities], keys, grads)

    def residual(self, key: str) -> Tensor | None:
        return self.velocities.get(key)

    def owed_states(self) -> list[dict[str, Tensor]]:
        return [self.velocities]

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
        self._clip_factors.clear()
        self._clear_flat()

    def reset(self) -> None:
        self.momenta.clear()
        self.velocities.clear()
        self._clip_factors.clear()
        self._clear_flat()
