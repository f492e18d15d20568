"""buffer_mb="auto": the cost model's cut is optimal for its model, starts communication during the
backward when the link is the bottleneck, is DDP's layout for dense and before costs, and gives
identical plans on every rank."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import ssfusion_lightning as ssf
from ssfusion_lightning.costmodel import CostProfile, Link
from ssfusion_lightning.fusion import FUSION_POLICIES, PlanContext
from ssfusion_lightning.fusion.cut import (
    DDP_BUFFER_BYTES,
    DDP_FIRST_BUFFER_BYTES,
    cut_buffers,
    cut_by_cost,
    modelled_finish,
)
from ssfusion_lightning.sparsifiers import build_sparsifier
from ssfusion_lightning.vocabulary import ParamSpec, cut_by_bytes


def specs(sizes, dtypes=None):
    dtypes = dtypes or [torch.float32] * len(sizes)
    return [(i, ParamSpec(f"t{i}", (n,), dtype)) for i, (n, dtype) in enumerate(zip(sizes, dtypes))]


def costs_for(params, backward, alpha=1e-4, beta=1e-8, per_element=1e-9, overhead=0.0):
    link = Link(alpha, beta)
    return CostProfile(
        backward={spec.name: backward for _, spec in params},
        compress_fixed=1e-5,
        compress_per_element=per_element,
        allreduce=link,
        allgather=link,
        world_size=4,
        measured=True,
        buffer_overhead=overhead,
    )


SPARSE = (lambda spec: True, lambda spec: max(1, spec.numel // 100))


def all_cuts(params):
    """Every split of ``params`` into consecutive non-empty groups that do not mix dtypes."""
    n = len(params)
    for mask in itertools.product([False, True], repeat=n - 1):
        groups, current = [], [params[0]]
        for item, cut_here in zip(params[1:], mask):
            if cut_here:
                groups.append(current)
                current = []
            current.append(item)
        groups.append(current)
        if all(len({spec.dtype for _, spec in g}) == 1 for g in groups):
            yield groups


@settings(max_examples=150, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 200_000), min_size=1, max_size=8),
    backward=st.floats(0.0, 5e-3),
    alpha=st.floats(0.0, 5e-3),
    beta=st.floats(0.0, 1e-7),
    overhead=st.floats(0.0, 5e-3),
    halves=st.lists(st.booleans(), min_size=8, max_size=8),
    dense_every=st.integers(0, 3),
    serial_cpu=st.sampled_from([0.0, 0.5, 1.0]),
)
def test_cost_cut_is_optimal_for_its_model(sizes, backward, alpha, beta, overhead, halves, dense_every, serial_cpu):
    """Against every cut, on a free core and on busy ones (where each buffer delays the rest of the
    backward and adds to the ranks' spread)."""
    dtypes = [torch.float16 if h else torch.float32 for h in halves[: len(sizes)]]
    params = specs(sizes, dtypes)
    costs = dataclasses.replace(costs_for(params, backward, alpha, beta, overhead=overhead), serial_cpu=serial_cpu)
    sparse_of = (lambda spec: int(spec.name[1:]) % dense_every != 0) if dense_every else SPARSE[0]
    groups = cut_by_cost(params, costs, sparse_of, SPARSE[1])
    assert [item for g in groups for item in g] == params  # order kept, nothing lost
    assert all(len({spec.dtype for _, spec in g}) == 1 for g in groups)
    best = min(modelled_finish(cut, costs, sparse_of, SPARSE[1]) for cut in all_cuts(params))
    assert modelled_finish(groups, costs, sparse_of, SPARSE[1]) <= best * (1 + 1e-12) + 1e-15


def test_slow_link_and_long_backward_give_early_buffers():
    """The link is the bottleneck and every tensor takes 10 ms of backward: communication of the
    first tensors starts long before the backward ends, so the cut has several buffers, and the
    modelled finish beats one buffer's."""
    params = specs([1 << 20] * 12)
    costs = costs_for(params, backward=10e-3, alpha=1e-4, beta=2e-7)  # 40 Mbit/s-like
    groups = cut_by_cost(params, costs, *SPARSE)
    assert len(groups) > 1 and len(groups[0]) < len(params) // 2  # the first launch is early in the backward
    assert modelled_finish(groups, costs, *SPARSE) < modelled_finish([params], costs, *SPARSE)


def test_buffer_overhead_merges_buffers():
    """The same slow link and long backward, but each buffer costs 200 ms of CPU: one buffer."""
    params = specs([1 << 20] * 12)
    costs = dataclasses.replace(costs_for(params, backward=10e-3, alpha=1e-4, beta=2e-7), buffer_overhead=200e-3)
    assert len(cut_by_cost(params, costs, *SPARSE)) == 1


def test_serial_cpu_merges_buffers_and_never_loses_to_one_buffer():
    """On a rank with one core every earlier buffer's overhead pushes the rest of the backward back:
    the cut makes fewer buffers than with a free core, and finishes no later, under that model, than
    the free-core cut or one buffer."""
    params = specs([1 << 18] * 24)
    free = costs_for(params, backward=4e-3, alpha=1e-4, beta=2e-8, overhead=3e-3)
    serial = dataclasses.replace(free, serial_cpu=1.0)
    free_cut, serial_cut = cut_by_cost(params, free, *SPARSE), cut_by_cost(params, serial, *SPARSE)
    assert 1 < len(serial_cut) < len(free_cut)
    assert modelled_finish(serial_cut, serial, *SPARSE) < modelled_finish(free_cut, serial, *SPARSE)
    assert modelled_finish(serial_cut, serial, *SPARSE) <= modelled_finish([params], serial, *SPARSE)


def test_each_buffer_adds_the_ranks_spread_on_a_busy_core():
    """Two tensors, 10 ms of backward each, 1 ms of overhead a buffer, no latency, and a rate at
    which each tensor's pairs take c = 1.5 ms. One buffer ends at 20 + 1 + 2c = 24 ms; two at
    max(20 + 1, 10 + 1 + c) + 1 + c = 23.5 ms, the first buffer delaying the rest of the backward
    by its 1 ms on a busy core (s = 1). The ranks' spread adds 1 ms a buffer: 25 against 25.5 ms,
    so the busy core's cut is one buffer, where the finish alone would pick two."""
    n = 100_000
    params = specs([n, n])
    unit = dataclasses.replace(costs_for(params, 0.0, alpha=0.0, beta=1.0, per_element=0.0), compress_fixed=0.0)
    per_tensor = unit.allgather_buffer_seconds(0, n, SPARSE[1](params[0][1]), 4)
    assert unit.allgather_buffer_seconds(0, 2 * n, 2 * SPARSE[1](params[0][1]), 4) == pytest.approx(2 * per_tensor)
    busy = dataclasses.replace(
        costs_for(params, 10e-3, alpha=0.0, beta=1.5e-3 / per_tensor, per_element=0.0, overhead=1e-3),
        compress_fixed=0.0, serial_cpu=1.0,
    )
    one, two = [params], [params[:1], params[1:]]
    assert modelled_finish(one, busy, *SPARSE) == pytest.approx(24e-3 + 1e-3)
    assert modelled_finish(two, busy, *SPARSE) == pytest.approx(23.5e-3 + 2e-3)
    assert cut_by_cost(params, busy, *SPARSE) == one
    # a free core (s = 0): no delay and no spread, one buffer 24 ms, two max(20, 12.5) + 2.5 = 22.5 ms
    free = dataclasses.replace(busy, serial_cpu=0.0)
    assert modelled_finish(two, free, *SPARSE) == pytest.approx(22.5e-3)
    assert cut_by_cost(params, free, *SPARSE) == two


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 1 << 16), min_size=1, max_size=12),
    backward=st.floats(1e-6, 1e-2),
    overhead=st.floats(0.0, 1e-2),
    serial_cpu=st.floats(0.0, 1.0),
)
def test_the_cut_is_never_later_than_one_buffer(sizes, backward, overhead, serial_cpu):
    params = specs(sizes)
    costs = dataclasses.replace(costs_for(params, backward, overhead=overhead), serial_cpu=serial_cpu)
    groups = cut_by_cost(params, costs, *SPARSE)
    assert [item for group in groups for item in group] == list(params)
    assert modelled_finish(groups, costs, *SPARSE) <= modelled_finish([params], costs, *SPARSE) * (1 + 1e-12)


def test_latency_bound_link_gives_one_buffer():
    params = specs([1000] * 12)
    costs = costs_for(params, backward=1e-6, alpha=5e-3, beta=1e-10)
    assert len(cut_by_cost(params, costs, *SPARSE)) == 1


def test_first_cap_is_kept_by_the_cost_cut():
    params = specs([4096] * 10)
    costs = costs_for(params, backward=1e-6, alpha=5e-3, beta=1e-10)  # would be one buffer
    groups = cut_by_cost(params, costs, *SPARSE, first_cap_bytes=3 * 4096 * 4)
    assert sum(spec.nbytes for _, spec in groups[0]) <= 3 * 4096 * 4


def test_a_trial_that_measured_one_buffer_faster_makes_one_buffer_per_dtype():
    """The cut that would make several buffers (above) makes one per dtype run, first cap kept."""
    params = specs([1 << 20] * 6 + [1 << 18] * 2, [torch.float32] * 6 + [torch.float16] * 2)
    costs = costs_for(params, backward=10e-3, alpha=1e-4, beta=2e-7)
    assert len(cut_buffers(params, None, None, costs, *SPARSE)) > 2
    fused = dataclasses.replace(costs, fused_measured_faster=True)
    assert cut_buffers(params, None, None, fused, *SPARSE) == [params[:6], params[6:]]
    first = 2 * (1 << 20) * 4
    assert cut_buffers(params, None, first, fused, *SPARSE) == [params[:2], params[2:6], params[6:]]
    assert cut_buffers(params, 2e6, None, fused, *SPARSE) == cut_by_bytes(params, 2e6)  # a cap is the user's


def test_auto_is_ddp_layout_without_costs_and_for_dense():
    params = specs([300_000] * 30)
    ddp = cut_by_bytes(params, DDP_BUFFER_BYTES, DDP_FIRST_BUFFER_BYTES)
    assert cut_buffers(params, None, None, None, *SPARSE) == ddp
    unmeasured = CostProfile(world_size=2)
    assert cut_buffers(params, None, None, unmeasured, *SPARSE) == ddp
    dense = (lambda spec: False, lambda spec: spec.numel)
    assert cut_buffers(params, None, None, costs_for(params, 1e-3), *dense) == ddp
    # a number is a plain cap, whatever the costs
    assert cut_buffers(params, 2e6, None, costs_for(params, 1e-3), *SPARSE) == cut_by_bytes(params, 2e6)


@pytest.mark.parametrize("fusion", ["ahead", "selective", "partial", "behind", "aligned"])
def test_every_cut_policy_plans_with_the_cost_cut_under_auto(fusion):
    params = specs([1 << 18] * 10)
    costs = costs_for(params, backward=10e-3, alpha=1e-4, beta=2e-7)
    sparsifier = build_sparsifier("topk", density=0.01)
    auto = FUSION_POLICIES.build(fusion).plan(params, PlanContext(sparsifier, None, 2, 4, costs))
    capped = FUSION_POLICIES.build(fusion).plan(params, PlanContext(sparsifier, 1e9, 2, 4, costs))
    assert len(capped.buffers) == 1
    assert len(auto.buffers) > 1
    assert [s.name for b in auto.buffers for s in b.slots] == [s.name for _, s in params]


def test_buffer_mb_accepts_auto_and_refuses_other_strings():
    assert ssf.SSFusionStrategy().buffer_mb == "auto"
    assert ssf.SSFusionStrategy(buffer_mb=4).buffer_mb == 4.0
    with pytest.raises(ValueError, match='buffer_mb must be a positive number or "auto", got \'big\''):
        ssf.SSFusionStrategy(buffer_mb="big")


class Deep(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(*[nn.Linear(128, 128) for _ in range(8)])

    def forward(self, x):
        return self.layers(x)


def auto_plan_run(steps: int = 8):
    """The engine with buffer_mb="auto": profiles, agrees on costs, re-plans; every rank's plan."""
    import torch.distributed as dist

    from ssfusion_lightning.comm import ChannelSet
    from ssfusion_lightning.comm.collectives import AllgatherCommunicator
    from ssfusion_lightning.engine.engine import EngineConfig, FusionEngine
    from ssfusion_lightning.sparsifiers import build_memory

    torch.manual_seed(0)
    model = Deep()
    engine = FusionEngine(
        list(model.named_parameters()),
        build_sparsifier("topk", density=0.01),
        build_memory("residual"),
        FUSION_POLICIES.build("ahead"),
        AllgatherCommunicator(),
        ChannelSet([dist.new_group(backend="gloo")], torch.device("cpu")),
        EngineConfig(buffer_bytes=None, profile_steps=2),
    )
    engine.attach()
    torch.manual_seed(dist.get_rank())
    fingerprints = []
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        engine.begin_backward()
        model(torch.randn(16, 128)).pow(2).sum().backward()
        engine.finish()
        fingerprints.append(engine.plan.fingerprint())
    measured = engine.costs is not None and engine.costs.measured
    engine.close()
    return fingerprints, measured


def test_auto_plans_are_identical_on_every_rank(pool3):
    results = pool3.run(auto_plan_run)
    assert all(measured for _, measured in results), "the auto cut profiles and agrees on costs"
    assert all(fingerprints == results[0][0] for fingerprints, _ in results)


def test_the_cut_charges_a_small_dense_part_as_riding_in_the_allgather():
    # 2 ranks, 1 ns/B, no backward, compression or overhead; t0: 1000 sparse elements (k = 10),
    # t1: 10 dense ones. Together: 40 dense bytes <= 10 pairs' 64 (40 B of values, positions
    # compact: a 4-byte block count and 2 bytes each), so the allgather carries them:
    #   a_g + (64 + 4 * 10) ns, whatever the all-reduce's latency a_r.
    # t1 alone is a dense buffer and pays its own all-reduce: a_r + 4 * 10 ns.
    params = specs([1000, 10])
    sparse_of = lambda spec: spec.name == "t0"  # noqa: E731
    k_of = lambda spec: spec.numel // 100  # noqa: E731
    costs = dataclasses.replace(
        costs_for(params, 0.0, per_element=0.0), compress_fixed=0.0, world_size=2,
        allreduce=Link(1.0, 1e-9), allgather=Link(50e-6, 1e-9),
    )
    together = [params]
    assert modelled_finish(together, costs, sparse_of, k_of) == pytest.approx(50e-6 + 104e-9)
    assert modelled_finish([params[:1], params[1:]], costs, sparse_of, k_of) == pytest.approx(50e-6 + 64e-9 + 1.0 + 40e-9)
    assert cut_by_cost(params, costs, sparse_of, k_of) == together
