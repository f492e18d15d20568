"""`selective`: SSFusion's selective sparsification before fusion.

Per buffer, a size threshold tau_g: tensors with n_i <= tau_g go dense (no compression cost, no
indices), larger ones sparse. tau_g is chosen among the buffer's tensor sizes to minimise the
modelled time sum T_compress(sparse tensors) + T_comm(buffer) (T_bp is the same for every choice)
under the budget "dense elements F <= density * T", which bounds the extra bytes.

Within ``prefer_dense_within`` (default 5%) of the least modelled time, the candidate with the
most dense elements wins. Selecting a small tensor costs accuracy that the time model does not
see: on the digits CNN at P = 4, a plan with no dense tensors reached 83.0% at step 80 where one
with its 1,410 smallest elements dense reached 93.6% (experiments/REPORT.md, "The compression line
and the dense fallback"). Candidates that close are also within the model's own error, whose
step-time gap to measurement is 3-9% (experiments/simulate.py's validation).

The sparse tensors keep the requested density. ``volume_neutral=True`` restores an earlier rule,
density (density*T - F) / (T - F) for the sparse tensors, so that the buffer sends about density*T
elements in all: it starves the large tensors (on resnet18, 325 elements over 694,784 parameters,
0.05% instead of 1%) and costs accuracy, so it is opt-in.
"""

from __future__ import annotations

from typing import Sequence

from ssfusion_lightning.costmodel import CostProfile
from ssfusion_lightning.fusion.base import FUSION_POLICIES, FusionPolicy, PlanContext, cut, make_slots, planned_k
from ssfusion_lightning.vocabulary import Buffer, ParamSpec, Plan


def choose_threshold(
    items: Sequence[tuple[int, ParamSpec]],
    density: float,
    costs: CostProfile,
    sparsifier,
    volume_neutral: bool = False,
    prefer_dense_within: float = 0.0,
) -> tuple[int, float]:
    """(tau_g, density of the sparse tensors) for one buffer: the least modelled time, or the
    largest tau_g whose time is within ``prefer_dense_within`` (a fraction) of the least."""
    total = sum(spec.numel for _, spec in items)
    element = items[0][1].nbytes // max(1, items[0][1].numel)
    candidates: list[tuple[float, int, float]] = []
    for tau in [0, *sorted({spec.numel for _, spec in items})]:
        dense = sum(spec.numel for _, spec in items if spec.numel <= tau)
        if dense > density * total:
            break
        neutral = volume_neutral and total > dense
        sparse_density = (density * total - dense) / (total - dense) if neutral else density
        sparse = [spec for _, spec in items if spec.numel > tau]
        sent = sum(planned_k(sparsifier, spec, max(sparse_density, 1e-12)) for spec in sparse)
        seconds = (
            sum(costs.compress_seconds(spec.numel) for spec in sparse)
            + costs.dense_seconds(dense, element)
            + costs.sparse_seconds(sent, element)
        )
        candidates.append((seconds, tau, sparse_density))
    least = min(seconds for seconds, _, _ in candidates)
    # candidates come in increasing tau: the last one within reach is the densest
    _, tau, sparse_density = [c for c in candidates if c[0] <= least * (1 + prefer_dense_within)][-1]
    return tau, sparse_density


@FUSION_POLICIES.register("selective")
class SelectivePolicy(FusionPolicy):
    name = "selective"
    needs_costs = True

    def __init__(self, volume_neutral: bool = False, prefer_dense_within: float = 0.05, **options) -> None:
        super().__init__(**options)
        if not isinstance(volume_neutral, bool):
            raise ValueError(f"volume_neutral must be true or false, got {volume_neutral!r}")
        if isinstance(prefer_dense_within, bool) or not isinstance(prefer_dense_within, (int, float)) or not (
            0 <= prefer_dense_within < 1
        ):
            raise ValueError(f"prefer_dense_within must be a fraction in [0, 1), got {prefer_dense_within!r}")
        self.volume_neutral = volume_neutral
        self.prefer_dense_within = float(prefer_dense_within)

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
                tau, sparse_density = choose_threshold(
                    items, ctx.sparsifier.density, costs, ctx.sparsifier, self.volume_neutral, self.prefer_dense_within
                )
            slots = make_slots(
                items,
                lambda spec, tau=tau: spec.numel > tau,
                lambda spec, d=sparse_density: planned_k(ctx.sparsifier, spec, d),
            )
            buffers.append(Buffer(index, slots, channel=index % ctx.num_channels))
            thresholds.append(tau)
        return Plan(tuple(buffers), {"thresholds": thresholds, "measured_costs": costs.measured})
