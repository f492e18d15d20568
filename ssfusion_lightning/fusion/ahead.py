"""`ahead`: SAFusion's sparsification-ahead fusion.

Each tensor is sparsified with its own k_i = max(1, floor(density * n_i)) as it arrives, then the
sparse pieces are fused into byte-capped buffers, so no tensor is ever left without an element.
"""

from __future__ import annotations

from typing import Sequence

from ssfusion_lightning.fusion.base import FUSION_POLICIES, FusionPolicy, PlanContext, cut_plan, planned_k
from ssfusion_lightning.vocabulary import ParamSpec, Plan


@FUSION_POLICIES.register("ahead")
class AheadPolicy(FusionPolicy):
    name = "ahead"

    def plan(self, params: Sequence[tuple[int, ParamSpec]], ctx: PlanContext) -> Plan:
        sparse = not ctx.sparsifier.is_dense
        return cut_plan(params, ctx, lambda spec: sparse, lambda spec: planned_k(ctx.sparsifier, spec))
