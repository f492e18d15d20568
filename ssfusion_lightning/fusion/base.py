"""Fusion policies: how tensors are grouped into buffers and where sparsification happens."""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Sequence

import torch
from torch import Tensor

from ssfusion_lightning.fusion.cut import cut_buffers
from ssfusion_lightning.registry import Registry
from ssfusion_lightning.sparsifiers import Memory, Sparsifier, k_for
from ssfusion_lightning.vocabulary import Buffer, Encoded, ParamSpec, PendingUpdate, Plan, Slot


@dataclass
class PlanContext:
    """Everything a policy may plan from; identical on every rank."""

    sparsifier: Sparsifier
    #: cap of a buffer; None ("auto"): the cost model's cut (see ``fusion/cut.py``)
    buffer_bytes: float | None
    num_channels: int
    world_size: int
    costs: Any = None  # agreed CostProfile for cost-driven policies (None before profiling)
    #: cap of the buffer that closes first in backward order (None: buffer_bytes)
    first_buffer_bytes: float | None = None


@dataclass
class ErrorFeedback:
    """The error-feedback pair of one round, in one place. Before its selection a tensor is
    compensated (its gradient plus what earlier rounds did not send: the fusion policy calls
    ``compensate``); once the round's result is in, the memory keeps what was not sent (the engine
    calls ``commit`` as it writes the gradients)."""

    memory: Memory
    #: the factor this round's gradients carry (a GradScaler's scale, 0-d tensor), None without one;
    #: the memory keeps its state unscaled. Taken at the round's first selection.
    loss_scale: Tensor | None = None
    #: called with the compensated tensors before anything is selected from them (the engine's
    #: non-finite vote). With it the round commits only after every check passed, so the memory's
    #: commit need not check the same values again (``Memory.update``'s ``verified``).
    check: Callable[[Sequence[Tensor]], None] | None = None

    def compensate(self, key: str, grad: Tensor) -> Tensor:
        return self._checked([self.memory.compensate(key, grad, loss_scale=self.loss_scale)])[0]

    def compensate_many(self, keys: Sequence[str], grads: Sequence[Tensor]) -> list[Tensor]:
        """``compensate`` of several tensors, checked together."""
        return self._checked(self.memory.compensate_many(keys, grads, loss_scale=self.loss_scale))

    def compensate_into(self, key: str, grad: Tensor, out: Tensor) -> Tensor:
        """``compensate`` written into ``out`` (a fused buffer's flat slice), with no temporary."""
        return self._checked([self.memory.compensate_into(key, grad, out, loss_scale=self.loss_scale)])[0]

    def _checked(self, compensated: list[Tensor]) -> list[Tensor]:
        if self.check is not None:
            self.check(compensated)
        return compensated

    def compensate_dense(self, key: str, grad: Tensor) -> Tensor | None:
        """A tensor sent dense: its gradient plus any state it still owes; None when it owes none."""
        return self.memory.compensate_dense(key, grad, loss_scale=self.loss_scale)

    def compensate_dense_many(self, keys: Sequence[str], grads: Sequence[Tensor]) -> list[Tensor | None]:
        """``compensate_dense`` of several tensors."""
        return self.memory.compensate_dense_many(keys, grads, loss_scale=self.loss_scale)

    def compensate_dense_flat(self, keys: Sequence[str], grads: Sequence[Tensor]) -> Tensor | None:
        """``compensate_dense`` of several tensors as one flat tensor, where the memory has that form."""
        return self.memory.compensate_dense_flat(keys, grads, loss_scale=self.loss_scale)

    def commit(self, updates: Sequence[PendingUpdate], applied: Tensor | None) -> None:
        """The round's result is in: keep what was not sent. ``applied``: the positions in the
        buffer's sparse part that the result applied (Ok-Topk keeps about k of the sum); None when
        everything sent was applied."""
        dense = [update for update in updates if update.sent is None]
        if dense:
            self.memory.settle_dense_many([u.key for u in dense], [u.grad for u in dense], loss_scale=self.loss_scale)
        sparse = [update for update in updates if update.sent is not None]
        if not sparse:
            return
        sent = [update.sent for update in sparse]
        if applied is not None:
            applied = applied.to(sent[0].device)  # a buffer's tensors share one device
            sent = [s[torch.isin(s + u.offset, applied)] for s, u in zip(sent, sparse)]
        self.memory.update_many(
            [u.key for u in sparse], [u.grad for u in sparse], sent, loss_scale=self.loss_scale, verified=self.check is not None
        )


@dataclass
class CompressContext:
    sparsifier: Sparsifier
    feedback: ErrorFeedback
    scale: float  # 1 / world size, applied while packing as DDP does
    #: called with (numel, seconds) for every selection while the engine profiles
    on_selected: Callable[[int, float], None] | None = None
    #: dtype and device of the buffer's gradients (the zeros an idle parameter sends)
    dtype: torch.dtype = torch.float32
    device: torch.device | None = None

    def select(self, compensated: Tensor, key: str, k: int) -> tuple[Tensor, Tensor]:
        if self.on_selected is None:
            return self.sparsifier.select(compensated, key=key, k=k)
        started = time.perf_counter()
        selected = self.sparsifier.select(compensated, key=key, k=k)
        self.on_selected(compensated.numel(), time.perf_counter() - started)
        return selected

    def select_many(self, compensated: Sequence[Tensor], keys: Sequence[str], ks: Sequence[int]) -> list[tuple[Tensor, Tensor]]:
        """Several tensors in one batched selection (each exactly as ``select`` would choose)."""
        if self.on_selected is None:
            return self.sparsifier.select_many(compensated, keys, ks)
        started = time.perf_counter()
        selected = self.sparsifier.select_many(compensated, keys, ks)
        self.on_selected(sum(c.numel() for c in compensated), time.perf_counter() - started)
        return selected


@dataclass
class Piece:
    """One slot's share of a buffer: a sparse slot's selection (scaled, shifted into the buffer's
    sparse part) and the error-feedback update that waits for the round's result."""

    values: Tensor | None = None
    indices: Tensor | None = None
    update: PendingUpdate | None = None


class FusionPolicy(ABC):
    name: ClassVar[str] = ""
    #: the plan depends on profiled costs, so it is rebuilt once they are agreed
    needs_costs: ClassVar[bool] = False
    #: every rank sends exactly the planned count per tensor (no size exchange)
    aligned: ClassVar[bool] = False
    #: selection is per tensor, so the engine compresses each tensor as its gradient arrives
    #: (sparsification ahead of fusion); False: the whole buffer is compressed once it is complete
    per_tensor: ClassVar[bool] = True

    def __init__(self, **options: Any) -> None:
        if options:
            raise TypeError(f"fusion policy {self.name!r} got unknown options {sorted(options)}")

    @abstractmethod
    def plan(self, params: Sequence[tuple[int, ParamSpec]], ctx: PlanContext) -> Plan:
        """Cut ``params`` (position, spec) given in backward order into buffers."""

    def compress_slot(self, slot: Slot, grad: Tensor | None, dense_out: Tensor | None, ctx: CompressContext) -> Piece:
        """One tensor: a dense slot is scaled into ``dense_out`` (with any error-feedback state it
        still owes); a sparse slot is compensated and selected with its own k. A None gradient is
        a parameter this rank's backward did not reach: it sends zeros and its error feedback is
        left alone."""
        if not slot.sparse:
            packed = dense_out[slot.offset : slot.offset + slot.numel]
            if grad is None:
                packed.zero_()
                return Piece()
            compensated = ctx.feedback.compensate_dense(slot.name, grad)
            source = grad if compensated is None else compensated
            # written through a view in the slot's shape: a gradient in another memory format
            # (channels_last) lands in logical order with no contiguous copy first
            torch.mul(source, ctx.scale, out=packed.view(slot.shape))
            return Piece(update=None if compensated is None else PendingUpdate(slot.name, grad, None, slot.offset))
        if grad is None:
            v, i = idle_selection(slot, ctx, self.aligned)
            return Piece(v * ctx.scale, i + slot.offset)
        compensated = ctx.feedback.compensate(slot.name, grad)
        return self._sparse_piece(slot, grad, compensated, ctx.select(compensated, slot.name, slot.k), ctx)

    def compress_sparse_slots(self, slots: Sequence[Slot], grads: Sequence[Tensor], ctx: CompressContext) -> list[Piece]:
        """Sparse slots that all have a gradient, compensated one by one and selected in one
        batched call: what ``compress_slot`` gives each, without a selection's fixed cost per
        tensor (which dominates for small tensors)."""
        compensated = ctx.feedback.compensate_many([slot.name for slot in slots], grads)
        selections = ctx.select_many(compensated, [slot.name for slot in slots], [slot.k for slot in slots])
        return [
            self._sparse_piece(slot, grad, tensor, selection, ctx)
            for slot, grad, tensor, selection in zip(slots, grads, compensated, selections)
        ]

    def pack_dense_slots(
        self, slots: Sequence[Slot], grads: Sequence[Tensor], dense_out: Tensor, ctx: CompressContext
    ) -> list[Piece]:
        """Dense slots that all have a gradient, written as ``compress_slot`` writes each, but one
        concatenation and one scaling per run of adjacent slots instead of a call per tensor (the
        per-tensor dispatch cost the dense engine more CPU than DDP's C++ bucket copy)."""
        names = [slot.name for slot in slots]
        one_run = all(a.offset + a.numel == b.offset for a, b in zip(slots, slots[1:]))
        if one_run and dense_out.dtype == grads[0].dtype:
            flat = ctx.feedback.compensate_dense_flat(names, grads)
            if flat is not None:  # every slot owes state, and the memory gave it all in one tensor
                torch.mul(flat, ctx.scale, out=dense_out[slots[0].offset : slots[-1].offset + slots[-1].numel])
                return [Piece(update=PendingUpdate(slot.name, grad, None, slot.offset)) for slot, grad in zip(slots, grads)]
        pieces, run, sources = [], [], []
        owed = ctx.feedback.compensate_dense_many(names, grads)
        for slot, grad, compensated in zip(slots, grads, owed):
            source = grad if compensated is None else compensated
            pieces.append(Piece(update=None if compensated is None else PendingUpdate(slot.name, grad, None, slot.offset)))
            if not source.is_contiguous():
                # through a view in the slot's shape: no contiguous copy of a channels_last gradient
                torch.mul(source, ctx.scale, out=dense_out[slot.offset : slot.offset + slot.numel].view(slot.shape))
                continue
            if run and run[-1].offset + run[-1].numel != slot.offset:
                _write_run(run, sources, dense_out, ctx.scale)
                run, sources = [], []
            run.append(slot)
            sources.append(source.view(-1))
        if run:
            _write_run(run, sources, dense_out, ctx.scale)
        return pieces

    def _sparse_piece(
        self, slot: Slot, grad: Tensor, compensated: Tensor, selection: tuple[Tensor, Tensor], ctx: CompressContext
    ) -> Piece:
        v, i = selection
        if self.aligned:
            v, i = exact_count(v, i, compensated.reshape(-1), slot.k)
        return Piece(v * ctx.scale, i + slot.offset, PendingUpdate(slot.name, grad, i, slot.offset))

    def pack(self, buffer: Buffer, pieces: Sequence[Piece], dense_out: Tensor | None, ctx: CompressContext) -> Encoded:
        """Fuse the buffer's pieces, in slot order, into one message."""
        values = [p.values for p in pieces if p.values is not None]
        indices = [p.indices for p in pieces if p.indices is not None]
        return Encoded(
            dense=dense_out,
            values=torch.cat(values) if values else None,
            indices=torch.cat(indices) if indices else None,
            updates=[p.update for p in pieces if p.update is not None],
            equal_counts=self.aligned,
            max_count=count_bound(buffer, ctx.sparsifier),
            shared_indices=ctx.sparsifier.shared_indices,
        )

    def compress(
        self, buffer: Buffer, grads: Sequence[Tensor | None], dense_out: Tensor | None, ctx: CompressContext
    ) -> Encoded:
        """The whole buffer at once (what the engine calls for policies that are not ``per_tensor``)."""
        pieces = [self.compress_slot(slot, grad, dense_out, ctx) for slot, grad in zip(buffer.slots, grads)]
        return self.pack(buffer, pieces, dense_out, ctx)


def _write_run(run: Sequence[Slot], sources: Sequence[Tensor], dense_out: Tensor, scale: float) -> None:
    """Adjacent dense slots: their tensors concatenated into their range of the buffer, scaled in place."""
    packed = dense_out[run[0].offset : run[-1].offset + run[-1].numel]
    torch.cat(sources, out=packed)
    packed.mul_(scale)


def idle_selection(slot: Slot, ctx: CompressContext, aligned: bool) -> tuple[Tensor, Tensor]:
    """The zeros a sparse slot sends for a parameter that got no gradient on this rank: every rank
    still issues the same collectives, with messages of the shape the others expect."""
    if ctx.sparsifier.shared_indices:
        # values are summed at positions every rank shares; they depend on the step and key only
        positions = ctx.sparsifier.select(torch.zeros(slot.shape, dtype=ctx.dtype, device=ctx.device), key=slot.name, k=slot.k)[1]
    elif aligned:
        positions = torch.arange(slot.k, device=ctx.device)  # every rank sends exactly k pairs
    else:
        positions = torch.empty(0, dtype=torch.int64, device=ctx.device)
    return torch.zeros(positions.numel(), dtype=ctx.dtype, device=ctx.device), positions


def count_bound(buffer: Buffer, sparsifier: Sparsifier) -> int | None:
    """Most elements any rank can send for the buffer's sparse slots, if the sparsifier bounds it."""
    bounds = [sparsifier.count_bound(torch.Size(slot.shape), slot.k) for slot in buffer.sparse_slots]
    return None if any(b is None for b in bounds) else sum(bounds)


def exact_count(values: Tensor, indices: Tensor, flat: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """SAFusion alignment: every rank contributes exactly k elements for this tensor. A larger
    selection is trimmed to its k largest magnitudes; a smaller one is padded with the first
    positions it does not hold, sending their real values (so error feedback stays exact) at
    O(k) cost instead of a top-k over the whole tensor."""
    count = values.numel()
    if count == k:
        return values, indices
    if count > k:
        keep = torch.topk(values.abs(), k, sorted=False).indices
        return values[keep], indices[keep]
    # the first k positions hold at least k - count that are not selected
    candidates = torch.arange(k, device=indices.device)
    padding = candidates[~torch.isin(candidates, indices)][: k - count]
    return torch.cat([values, flat[padding]]), torch.cat([indices, padding])


FUSION_POLICIES: Registry[FusionPolicy] = Registry("fusion policy")


def make_slots(items: Sequence[tuple[int, ParamSpec]], sparse_of, k_of) -> tuple[Slot, ...]:
    """Slots for ``items`` with offsets in their part (dense or sparse) of the buffer."""
    slots = []
    dense_offset = sparse_offset = 0
    for position, spec in items:
        sparse = bool(sparse_of(spec))
        offset = sparse_offset if sparse else dense_offset
        slots.append(Slot(spec.name, position, spec.shape, offset, spec.numel, sparse, k_of(spec) if sparse else spec.numel))
        if sparse:
            sparse_offset += spec.numel
        else:
            dense_offset += spec.numel
    return tuple(slots)


def planned_k(sparsifier: Sparsifier, spec: ParamSpec, density: float | None = None) -> int:
    """Elements a sparse tensor sends: the sparsifier's exact count where it has one."""
    k = k_for(spec.numel, sparsifier.density if density is None else density)
    exact = sparsifier.output_count(torch.Size(spec.shape), k)
    return k if exact is None else exact


def cut(params: Sequence[tuple[int, ParamSpec]], ctx: PlanContext, sparse_of, k_of) -> list[list[tuple[int, ParamSpec]]]:
    """The context's cut of ``params`` into buffers: its byte caps, or the cost cut for "auto"."""
    return cut_buffers(params, ctx.buffer_bytes, ctx.first_buffer_bytes, ctx.costs, sparse_of, k_of)


def cut_plan(params: Sequence[tuple[int, ParamSpec]], ctx: PlanContext, sparse_of, k_of) -> Plan:
    """Buffers as the context cuts them, each tensor sparse or dense by ``sparse_of``."""
    buffers = tuple(
        Buffer(index, make_slots(items, sparse_of, k_of), channel=index % ctx.num_channels)
        for index, items in enumerate(cut(params, ctx, sparse_of, k_of))
    )
    return Plan(buffers)
