"""`behind`: fuse first, then one selection over the whole buffer ("sparsification behind fusion").

Cheap (one selection per buffer) but a small tensor can lose all its elements to larger ones in
the same buffer: the "tensor missing" problem that motivates SAFusion.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from ssfusion_lightning.engine.plan import Buffer, ParamSpec, Plan
from ssfusion_lightning.fusion.base import (
    FUSION_POLICIES,
    CompressContext,
    Encoded,
    FusionPolicy,
    PendingUpdate,
    PlanContext,
    byte_capped_plan,
)
from ssfusion_lightning.sparsifiers import k_for


@FUSION_POLICIES.register("behind")
class BehindPolicy(FusionPolicy):
    name = "behind"

    def plan(self, params: Sequence[tuple[int, ParamSpec]], ctx: PlanContext) -> Plan:
        sparse = not ctx.sparsifier.is_dense
        return byte_capped_plan(params, ctx, ctx.buffer_bytes, lambda spec: sparse, lambda spec: spec.numel, ctx.first_buffer_bytes)

    def compress(
        self, buffer: Buffer, grads: Sequence[Tensor | None], dense_out: Tensor | None, ctx: CompressContext
    ) -> Encoded:
        if not buffer.sparse_slots:
            return super().compress(buffer, grads, dense_out, ctx)
        # Error feedback stays per tensor, so re-planned buffers never lose a residual. A parameter
        # this rank's backward did not reach (None) joins the fused tensor as zeros, with no
        # compensation and no update: whatever of it is selected sends zeros.
        compensated = [
            torch.zeros(slot.shape, dtype=ctx.dtype, device=ctx.device) if grad is None else ctx.compensate(slot.name, grad)
            for slot, grad in zip(buffer.slots, grads)
        ]
        fused = torch.cat([c.reshape(-1) for c in compensated])
        k = k_for(fused.numel(), ctx.sparsifier.density)
        values, indices = ctx.select(fused, f"buffer{buffer.index}", k)
        updates = []
        for slot, tensor, grad in zip(buffer.slots, compensated, grads):
            if grad is None:
                continue
            mine = (indices >= slot.offset) & (indices < slot.offset + slot.numel)
            updates.append(PendingUpdate(slot.name, tensor, indices[mine] - slot.offset, slot.offset))
        return Encoded(
            dense=None,
            values=values * ctx.scale,
            indices=indices,
            updates=updates,
            max_count=ctx.sparsifier.count_bound(fused.shape, k),
            shared_indices=ctx.sparsifier.shared_indices,
        )
