"""Fusion policies: how tensors are grouped into buffers and where sparsification happens."""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Sequence

import torch
from torch import Tensor

from ssfusion_lightning.engine.plan import Buffer, ParamSpec, Plan, Slot, cut_by_bytes
from ssfusion_lightning.registry import Registry
from ssfusion_lightning.sparsifiers import Memory, Sparsifier, k_for


@dataclass
class PlanContext:
    """Everything a policy may plan from; identical on every rank."""

    sparsifier: Sparsifier
    buffer_bytes: float
    num_channels: int
    world_size: int
    costs: Any = None  # agreed CostProfile for cost-driven policies (None before profiling)
    #: cap of the buffer that closes first in backward order (None: buffer_bytes)
    first_buffer_bytes: float | None = None


@dataclass
class PendingUpdate:
    """An error-feedback update that waits for the communication result (Ok-Topk filters it)."""

    key: str
    compensated: Tensor
    sent: Tensor  # flat positions in the compensated tensor
    offset: int  # where the tensor starts in the buffer's sparse part


@dataclass
class Encoded:
    """One buffer, ready to send: the dense part and the sparse part, both already scaled by 1/P."""

    dense: Tensor | None
    values: Tensor | None
    indices: Tensor | None  # int64 positions in the buffer's sparse part
    updates: list[PendingUpdate] = field(default_factory=list)
    #: every rank sends the same count (no size exchange needed)
    equal_counts: bool = False
    #: no rank sends more elements than this (the plan's k, for sparsifiers that never exceed k)
    max_count: int | None = None
    #: every rank selected the same positions (randomk): the values can be all-reduced
    shared_indices: bool = False


@dataclass
class CompressContext:
    sparsifier: Sparsifier
    memory: Memory
    scale: float  # 1 / world size, applied while packing as DDP does
    #: called with (numel, seconds) for every selection while the engine profiles
    on_selected: Callable[[int, float], None] | None = None

    def select(self, compensated: Tensor, key: str, k: int) -> tuple[Tensor, Tensor]:
        if self.on_selected is None:
            return self.sparsifier.select(compensated, key=key, k=k)
        started = time.perf_counter()
        selected = self.sparsifier.select(compensated, key=key, k=k)
        self.on_selected(compensated.numel(), time.perf_counter() - started)
        return selected


class FusionPolicy(ABC):
    name: ClassVar[str] = ""
    #: the plan depends on profiled costs, so it is rebuilt once they are agreed
    needs_costs: ClassVar[bool] = False
    #: every rank sends exactly the planned count per tensor (no size exchange)
    aligned: ClassVar[bool] = False

    def __init__(self, **options: Any) -> None:
        if options:
            raise TypeError(f"fusion policy {self.name!r} got unknown options {sorted(options)}")

    @abstractmethod
    def plan(self, params: Sequence[tuple[int, ParamSpec]], ctx: PlanContext) -> Plan:
        """Cut ``params`` (position, spec) given in backward order into buffers."""

    def compress(self, buffer: Buffer, grads: Sequence[Tensor], dense_out: Tensor | None, ctx: CompressContext) -> Encoded:
        """Per-tensor compression: dense slots are packed into ``dense_out``, sparse slots are
        compensated and selected one by one with their own k (sparsification ahead of fusion)."""
        values, indices, updates = [], [], []
        for slot, grad in zip(buffer.slots, grads):
            if not slot.sparse:
                torch.mul(grad.reshape(-1), ctx.scale, out=dense_out[slot.offset : slot.offset + slot.numel])
                continue
            compensated = ctx.memory.compensate(slot.name, grad)
            v, i = ctx.select(compensated, slot.name, slot.k)
            if self.aligned:
                v, i = exact_count(v, i, compensated.reshape(-1), slot.k)
            values.append(v * ctx.scale)
            indices.append(i + slot.offset)
            updates.append(PendingUpdate(slot.name, compensated, i, slot.offset))
        return Encoded(
            dense=dense_out,
            values=torch.cat(values) if values else None,
            indices=torch.cat(indices) if indices else None,
            updates=updates,
            equal_counts=self.aligned,
            max_count=count_bound(buffer, ctx.sparsifier),
            shared_indices=ctx.sparsifier.shared_indices,
        )


def count_bound(buffer: Buffer, sparsifier: Sparsifier) -> int | None:
    """Most elements any rank can send for the buffer's sparse slots, if the sparsifier bounds it."""
    bounds = [sparsifier.count_bound(torch.Size(slot.shape), slot.k) for slot in buffer.sparse_slots]
    return None if any(b is None for b in bounds) else sum(bounds)


def exact_count(values: Tensor, indices: Tensor, flat: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """SAFusion alignment: trim a larger selection to its k largest magnitudes; replace a smaller
    one by the exact top-k, so every rank contributes exactly k elements for this tensor."""
    count = values.numel()
    if count == k:
        return values, indices
    if count > k:
        keep = torch.topk(values.abs(), k, sorted=False).indices
        return values[keep], indices[keep]
    top = torch.topk(flat.abs(), k, sorted=False).indices
    return flat[top], top


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


def byte_capped_plan(
    params: Sequence[tuple[int, ParamSpec]], ctx: PlanContext, cap_bytes: float, sparse_of, k_of, first_cap_bytes: float | None = None
) -> Plan:
    buffers = tuple(
        Buffer(index, make_slots(items, sparse_of, k_of), channel=index % ctx.num_channels)
        for index, items in enumerate(cut_by_bytes(params, cap_bytes, first_cap_bytes))
    )
    return Plan(buffers)
