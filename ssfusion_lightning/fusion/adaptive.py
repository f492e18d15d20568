"""`adaptive`: SAFusion's intra-worker adaptive buffer sizing (with inter-worker alignment).

Buffer boundaries come from measured backward time per tensor, compression time and the
alpha-beta model: a buffer is closed once its gradients are ready no earlier than the channel
frees up (so its communication overlaps the backward of the next tensors) and it is large enough
to amortise the link latency; the tail is merged into the previous buffer when that does not
finish later (the last communication is exposed anyway). Selections are aligned (exact k_i).

Each buffer also costs the measured CPU of one buffer (``CostProfile.buffer_overhead``, o): its
channel is busy that much longer. On a rank whose engine threads share its core (``serial_cpu``
s > 0) that CPU is taken from the backward, so each closed buffer makes the later gradients ready
s * o later, and the ranks' backward passes end s * o further apart (``fusion/cut.py`` measures
both); the tail merge counts both. With o = 0 the rule is SAFusion's as published.
"""

from __future__ import annotations

import math
from typing import Sequence

from ssfusion_lightning.costmodel import CostProfile
from ssfusion_lightning.fusion.base import FUSION_POLICIES, FusionPolicy, PlanContext, make_slots, planned_k
from ssfusion_lightning.vocabulary import Buffer, ParamSpec, Plan


def buffer_seconds(items: Sequence[tuple[int, ParamSpec]], costs: CostProfile, sparsifier) -> tuple[float, float]:
    """(compression seconds, communication seconds) of one buffer of sparse tensors."""
    if not items:
        return 0.0, 0.0
    element = items[0][1].nbytes // max(1, items[0][1].numel)
    if sparsifier.is_dense:
        return 0.0, costs.dense_seconds(sum(s.numel for _, s in items), element)
    compress = sum(costs.compress_seconds(spec.numel) for _, spec in items)
    return compress, costs.sparse_seconds(sum(planned_k(sparsifier, spec) for _, spec in items), element)


def adaptive_boundaries(
    params: Sequence[tuple[int, ParamSpec]], costs: CostProfile, sparsifier, cap_bytes: float, first_cap_bytes: float | None = None
) -> list[list[tuple[int, ParamSpec]]]:
    latency_bytes = costs.allgather.alpha / costs.allgather.beta if costs.allgather.beta > 0 else 0.0
    overhead, delay = costs.buffer_overhead, costs.serial_cpu * costs.buffer_overhead
    groups: list[list[tuple[int, ParamSpec]]] = []
    ready_at: list[float] = []
    current: list[tuple[int, ParamSpec]] = []
    clock = channel_free = 0.0
    for item in params:
        spec = item[1]
        cap = cap_bytes if groups or first_cap_bytes is None else first_cap_bytes
        if current and (sum(s.nbytes for _, s in current) + spec.nbytes > cap or spec.dtype != current[0][1].dtype):
            groups.append(current)
            ready_at.append(clock)
            clock += delay
            current = []
        clock += costs.backward_seconds(spec.name)
        current.append(item)
        compress, comm = buffer_seconds(current, costs, sparsifier)
        payload = sum(s.nbytes for _, s in current)
        if clock >= channel_free and payload >= latency_bytes:
            groups.append(current)
            ready_at.append(clock)
            channel_free = clock + compress + comm + overhead
            clock += delay
            current = []
    if current:
        groups.append(current)
        ready_at.append(clock)
    if len(groups) >= 2:
        # The backward is over when the last buffer is ready: merge it into the previous one
        # when the merged communication does not finish later than the two separate ones (the
        # separate ones' extra buffer also delayed the last gradients and spreads the ranks).
        *_, before, last = groups
        c1, m1 = buffer_seconds(before, costs, sparsifier)
        c2, m2 = buffer_seconds(last, costs, sparsifier)
        separate = max(ready_at[-2] + c1 + m1 + overhead, ready_at[-1] + c2) + m2 + overhead + delay
        cm, mm = buffer_seconds(before + last, costs, sparsifier)
        merged = ready_at[-1] - delay + cm + mm + overhead
        merged_bytes = sum(s.nbytes for _, s in before + last)
        merged_cap = cap_bytes if len(groups) > 2 or first_cap_bytes is None else first_cap_bytes
        if merged <= separate and merged_bytes <= merged_cap and before[0][1].dtype == last[0][1].dtype:
            groups[-2:] = [before + last]
    return groups


@FUSION_POLICIES.register("adaptive")
class AdaptivePolicy(FusionPolicy):
    name = "adaptive"
    needs_costs = True
    aligned = True

    def plan(self, params: Sequence[tuple[int, ParamSpec]], ctx: PlanContext) -> Plan:
        costs = ctx.costs or CostProfile(world_size=ctx.world_size)
        sparse = not ctx.sparsifier.is_dense
        cap = math.inf if ctx.buffer_bytes is None else ctx.buffer_bytes  # "auto": the sizing is this policy's own
        buffers = tuple(
            Buffer(index, make_slots(items, lambda spec: sparse, lambda spec: planned_k(ctx.sparsifier, spec)), index % ctx.num_channels)
            for index, items in enumerate(adaptive_boundaries(params, costs, ctx.sparsifier, cap, ctx.first_buffer_bytes))
        )
        return Plan(buffers, {"measured_costs": costs.measured})
