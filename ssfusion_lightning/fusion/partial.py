"""`partial`: ADTopk's partial sparsification.

Only tensors whose compression pays for itself are sparsified, one decision per tensor from the
cost model: a tensor goes sparse when compressing it hides in the channel's idle time or when
compression plus the sparse transfer is cheaper than sending it dense. Buffers are byte-capped.
"""

from __future__ import annotations

from typing import Sequence

from ssfusion_lightning.costmodel import CostProfile
from ssfusion_lightning.fusion.base import FUSION_POLICIES, FusionPolicy, PlanContext, cut, make_slots, planned_k
from ssfusion_lightning.vocabulary import Buffer, ParamSpec, Plan


def sparse_decisions(params: Sequence[tuple[int, ParamSpec]], costs: CostProfile, sparsifier) -> dict[str, bool]:
    decisions: dict[str, bool] = {}
    clock = channel_free = 0.0
    for _, spec in params:
        clock += costs.backward_seconds(spec.name)
        element = spec.nbytes // max(1, spec.numel)
        compress = costs.compress_seconds(spec.numel)
        sparse_cost = compress + costs.sparse_seconds(planned_k(sparsifier, spec), element)
        dense_cost = costs.dense_seconds(spec.numel, element)
        idle = max(0.0, channel_free - clock)
        sparse = not sparsifier.is_dense and (compress <= idle or sparse_cost < dense_cost)
        decisions[spec.name] = sparse
        channel_free = max(channel_free, clock + (compress if sparse else 0.0)) + (
            sparse_cost - compress if sparse else dense_cost
        )
    return decisions


@FUSION_POLICIES.register("partial")
class PartialPolicy(FusionPolicy):
    name = "partial"
    needs_costs = True

    def plan(self, params: Sequence[tuple[int, ParamSpec]], ctx: PlanContext) -> Plan:
        costs = ctx.costs or CostProfile(world_size=ctx.world_size)
        decisions = sparse_decisions(params, costs, ctx.sparsifier)
        buffers = tuple(
            Buffer(
                index,
                make_slots(items, lambda spec: decisions[spec.name], lambda spec: planned_k(ctx.sparsifier, spec)),
                index % ctx.num_channels,
            )
            for index, items in enumerate(
                cut(params, ctx, lambda spec: decisions[spec.name], lambda spec: planned_k(ctx.sparsifier, spec))
            )
        )
        return Plan(buffers, {"sparse_tensors": sum(decisions.values()), "measured_costs": costs.measured})
