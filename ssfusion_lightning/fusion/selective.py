"""`selective`: SSFusion's selective sparsification before fusion.

Per buffer, a size threshold tau_g: tensors with n_i <= tau_g go dense (no compression cost, no
indices), larger ones sparse. tau_g is chosen among the buffer's tensor sizes to minimise the
modelled time sum T_compress(sparse tensors) + T_comm(buffer) (T_bp is the same for every choice)
under the budget "dense elements F <= density * T". The sparse tensors then get the density
(density*T - F) / (T - F), so the buffer still sends about density*T elements (volume-neutral).
"""

from __future__ import annotations

from typing import Sequence

from ssfusion_lightning.costmodel import CostProfile
from ssfusion_lightning.engine.plan import Buffer, ParamSpec, Plan
from ssfusion_lightning.fusion.base import FUSION_POLICIES, FusionPolicy, PlanContext, cut, make_slots, planned_k


def choose_threshold(items: Sequence[tuple[int, ParamSpec]], density: float, costs: CostProfile, sparsifier) -> tuple[int, float]:
    """(tau_g, density of the sparse tensors) with the least modelled time for one buffer."""
    total = sum(spec.numel for _, spec in items)
    element = items[0][1].nbytes // max(1, items[0][1].numel)
    best: tuple[float, int, float] | None = None
    for tau in [0, *sorted({spec.numel for _, spec in items})]:
        dense = sum(spec.numel for _, spec in items if spec.numel <= tau)
        if dense > density * total:
            break
        sparse_density = (density * total - dense) / (total - dense) if total > dense else density
        sparse = [spec for _, spec in items if spec.numel > tau]
        sent = sum(planned_k(sparsifier, spec, max(sparse_density, 1e-12)) for spec in sparse)
        seconds = (
            sum(costs.compress_seconds(spec.numel) for spec in sparse)
            + costs.dense_seconds(dense, element)
            + costs.sparse_seconds(sent, element)
        )
        if best is None or seconds < best[0]:
            best = (seconds, tau, sparse_density)
    assert best is not None
    return best[1], best[2]


@FUSION_POLICIES.register("selective")
class SelectivePolicy(FusionPolicy):
    name = "selective"
    needs_costs = True

    def plan(self, params: Sequence[tuple[int, ParamSpec]], ctx: PlanContext) -> Plan:
        costs = ctx.costs or CostProfile(world_size=ctx.world_size)
        buffers, thresholds = [], []
        # the cut sees every tensor sparse at the density; the thresholds are chosen per buffer after
        sparse = not ctx.sparsifier.is_dense
        groups = cut(params, ctx, lambda spec: sparse, lambda spec: planned_k(ctx.sparsifier, spec))
        for index, items in enumerate(groups):
            if ctx.sparsifier.is_dense:
                tau, sparse_density = max(spec.numel for _, spec in items), 1.0
            else:
                tau, sparse_density = choose_threshold(items, ctx.sparsifier.density, costs, ctx.sparsifier)
            slots = make_slots(
                items,
                lambda spec, tau=tau: spec.numel > tau,
                lambda spec, d=sparse_density: planned_k(ctx.sparsifier, spec, d),
            )
            buffers.append(Buffer(index, slots, channel=index % ctx.num_channels))
            thresholds.append(tau)
        return Plan(tuple(buffers), {"thresholds": thresholds, "measured_costs": costs.measured})
