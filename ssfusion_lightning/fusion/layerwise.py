"""`layerwise`: one buffer per tensor, per-tensor sparsification and communication (no fusion)."""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence

from ssfusion_lightning.fusion.base import FUSION_POLICIES, FusionPolicy, PlanContext, cut_plan, planned_k
from ssfusion_lightning.vocabulary import ParamSpec, Plan


@FUSION_POLICIES.register("layerwise")
class LayerwisePolicy(FusionPolicy):
    name = "layerwise"

    def plan(self, params: Sequence[tuple[int, ParamSpec]], ctx: PlanContext) -> Plan:
        sparse = not ctx.sparsifier.is_dense
        one_per_tensor = replace(ctx, buffer_bytes=0, first_buffer_bytes=None)
        return cut_plan(params, one_per_tensor, lambda spec: sparse, lambda spec: planned_k(ctx.sparsifier, spec))
