"""`behind`: fuse first, then one selection over the whole buffer ("sparsification behind fusion").

Cheap (one selection per buffer) but a small tensor can lose all its elements to larger ones in
the same buffer: the "tensor missing" problem that motivates SAFusion. The buffer's budget is
the sum of its tensors' k (about density x buffer elements), so a collective that selects
globally (Ok-Topk) gets the same k. Shape-aware sparsifiers (ADTopk's rows) are refused: the
fused buffer is 1-D, so they would send every element with an index.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from ssfusion_lightning.fusion.base import FUSION_POLICIES, CompressContext, FusionPolicy, PlanContext, cut_plan
from ssfusion_lightning.sparsifiers import k_for
from ssfusion_lightning.vocabulary import Buffer, Encoded, ParamSpec, PendingUpdate, Plan


@FUSION_POLICIES.register("behind")
class BehindPolicy(FusionPolicy):
    name = "behind"
    per_tensor = False

    def plan(self, params: Sequence[tuple[int, ParamSpec]], ctx: PlanContext) -> Plan:
        if ctx.sparsifier.needs_shape:
            raise ValueError(
                f"fusion='behind' cannot run sparsifier {ctx.sparsifier.name!r}: it selects per row of a "
                "tensor, and behind selects over a fused 1-D buffer; use fusion='ahead', 'partial' or 'layerwise'"
            )
        sparse = not ctx.sparsifier.is_dense
        density = ctx.sparsifier.density
        return cut_plan(params, ctx, lambda spec: sparse, lambda spec: k_for(spec.numel, density))

    def compress(
        self, buffer: Buffer, grads: Sequence[Tensor | None], dense_out: Tensor | None, ctx: CompressContext
    ) -> Encoded:
        if not buffer.sparse_slots:
            return super().compress(buffer, grads, dense_out, ctx)
        # Tensors the user asked to send whole (``dense_params``) go into the dense part as in any
        # policy; the sparse ones are fused and selected together.
        pieces = [
            self.compress_slot(slot, grad, dense_out, ctx) for slot, grad in zip(buffer.slots, grads) if not slot.sparse
        ]
        sparse = [(slot, grad) for slot, grad in zip(buffer.slots, grads) if slot.sparse]
        # Error feedback stays per tensor, so re-planned buffers never lose a residual. A parameter
        # this rank's backward did not reach (None) joins the fused tensor as zeros, with no
        # compensation and no update: whatever of it is selected sends zeros. Each tensor is
        # compensated straight into its slice of the fused one.
        # where the gradients are (host memory when the offload worker staged them there)
        device = next((grad.device for grad in grads if grad is not None), ctx.device)
        fused = torch.empty(buffer.sparse_numel, dtype=ctx.dtype, device=device)
        for slot, grad in sparse:
            part = fused[slot.offset : slot.offset + slot.numel]
            if grad is None:
                part.zero_()
            else:
                ctx.feedback.compensate_into(slot.name, grad, part)
        k = sum(slot.k for slot, _ in sparse)
        values, indices = ctx.select(fused, f"buffer{buffer.index}", k)
        updates = [piece.update for piece in pieces if piece.update is not None]
        for slot, grad in sparse:
            if grad is None:
                continue
            mine = (indices >= slot.offset) & (indices < slot.offset + slot.numel)
            updates.append(PendingUpdate(slot.name, grad, indices[mine] - slot.offset, slot.offset))
        return Encoded(
            dense=dense_out,
            values=values * ctx.scale,
            indices=indices,
            updates=updates,
            max_count=ctx.sparsifier.count_bound(fused.shape, k),
            shared_indices=ctx.sparsifier.shared_indices,
        )
