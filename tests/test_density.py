"""The density a run asks for is the density it sends: DGC's warm-up schedule, the effective
density of every fusion policy, and local gradient clipping scaled by the world size."""

from __future__ import annotations

import math

import lightning as L
import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils.data import DataLoader

from ssfusion_lightning.comm import COMMUNICATORS, ChannelSet
from ssfusion_lightning.costmodel import CostProfile
from ssfusion_lightning.engine.engine import EngineConfig, FusionEngine
from ssfusion_lightning.fusion import FUSION_POLICIES, PlanContext
from ssfusion_lightning.fusion.budget import reduced_counts, within_budget
from ssfusion_lightning.sparsifiers import build_memory, build_sparsifier
from ssfusion_lightning.sparsifiers.schedule import DensityWarmup
from ssfusion_lightning.vocabulary import ParamSpec

POLICIES = ["layerwise", "behind", "ahead", "aligned", "adaptive", "selective", "partial"]


# --------------------------------------------------------------------------- the schedule
def test_dgc_paper_instance():
    # 4 stages over 4 epochs of 100 steps, target 0.1%: 25.1%, 6.3%, 1.58%, 0.398%, then 0.1%
    warmup = DensityWarmup(steps=400, stages=4)
    got = [warmup.density(step, 0.001) for step in (0, 99, 100, 199, 200, 300, 399, 400, 10**6)]
    expected = [0.001**0.2] * 2 + [0.001**0.4] * 2 + [0.001**0.6, 0.001**0.8, 0.001**0.8, 0.001, 0.001]
    assert got == pytest.approx(expected, rel=1e-12)
    assert got[0] == pytest.approx(0.2512, abs=1e-4) and got[4] == pytest.approx(0.01585, abs=1e-5)


@settings(max_examples=200, deadline=None)
@given(
    steps=st.integers(1, 10_000),
    stages=st.integers(1, 8),
    target=st.floats(1e-4, 1.0),
    step=st.integers(0, 20_000),
)
def test_schedule_matches_the_formula(steps, stages, target, step):
    warmup = DensityWarmup(steps, stages)
    density = warmup.density(step, target)
    if step >= steps:
        assert density == target
    else:
        stage = math.floor(step * stages / steps)
        assert 0 <= stage < stages
        assert density == target ** ((stage + 1) / (stages + 1))
        assert target <= density <= 1.0
    # never denser later, and stage by stage the same factor sparser
    assert warmup.density(step + 1, target) <= density
    if stages > 1 and steps >= stages:
        first_step = [-(-s * steps // stages) for s in range(stages)]  # ceil: where stage s begins
        ratios = [warmup.density(a, target) / warmup.density(b, target) for a, b in zip(first_step, first_step[1:])]
        assert max(ratios) == pytest.approx(min(ratios), rel=1e-9)


def test_no_warmup_is_the_target_at_once():
    assert DensityWarmup().density(0, 0.01) == 0.01


@pytest.mark.parametrize(
    ("steps", "stages", "message"),
    [(-1, 4, "steps must be an integer >= 0, got -1"), (10, 0, "stages must be an integer >= 1, got 0"), (1.5, 4, "got 1.5")],
)
def test_bad_schedules_are_refused(steps, stages, message):
    with pytest.raises(ValueError, match=message):
        DensityWarmup(steps, stages)


def test_strategy_options_are_checked():
    from ssfusion_lightning.strategy import SSFusionStrategy

    with pytest.raises(ValueError, match="both given"):
        SSFusionStrategy(density_warmup_steps=10, density_warmup_epochs=2)
    with pytest.raises(ValueError, match="density_warmup_epochs must be a number >= 0, got -1"):
        SSFusionStrategy(density_warmup_epochs=-1)
    with pytest.raises(ValueError, match="stages must be an integer >= 1, got 0"):
        SSFusionStrategy(density_warmup_steps=10, density_warmup_stages=0)
    config = SSFusionStrategy(density_warmup_epochs=4).engine_config()
    assert (config["density_warmup_steps"], config["density_warmup_epochs"], config["density_warmup_stages"]) == (0, 4.0, 4)


# --------------------------------------------------------------------------- effective density of the plans
def _plan(policy: str, sizes: list[int], density: float, sparsifier: str = "topk"):
    specs = [(i, ParamSpec(f"p{i}", (n,), torch.float32)) for i, n in enumerate(sizes)]
    costs = CostProfile(world_size=4)
    ctx = PlanContext(build_sparsifier(sparsifier, density=density), 64 * 1024, 2, 4, costs)
    return FUSION_POLICIES.build(policy).plan(specs, ctx)


@settings(max_examples=60, deadline=None)
@given(
    policy=st.sampled_from(POLICIES),
    sizes=st.lists(st.one_of(st.integers(1, 64), st.integers(1_000, 60_000)), min_size=1, max_size=24),
    density=st.sampled_from([0.1, 0.01, 0.001]),
)
def test_every_policy_plans_the_requested_density_of_its_sparse_tensors(policy, sizes, density):
    sparsifier = build_sparsifier("topk", density=density)
    plan = within_budget(_plan(policy, sizes, density), sparsifier)
    sparse = [slot for buffer in plan.buffers for slot in buffer.sparse_slots]
    asked = density * sum(slot.numel for slot in sparse)
    planned = sum(slot.k for slot in sparse)
    # never more than asked (rounded), unless every tensor's one element is already more
    assert planned <= max(len(sparse), round(asked)), (planned, asked)
    # k = max(1, floor(density * n)) per tensor before the budget: under by less than one element each
    assert planned > asked - len(sparse) or planned == len(sparse), (planned, asked)
    assert all(1 <= slot.k <= slot.numel for slot in sparse)


@settings(max_examples=300, deadline=None)
@given(
    ks_numels=st.lists(st.tuples(st.integers(1, 40), st.integers(1, 4000)), min_size=1, max_size=60),
    density=st.sampled_from([0.1, 0.01, 0.001, 0.0001]),
)
def test_the_budget_takes_back_exactly_the_excess(ks_numels, density):
    ks = [k for k, _ in ks_numels]
    numel = sum(n for _, n in ks_numels)
    budget = max(len(ks), round(density * numel))
    out = reduced_counts(ks, numel, density)
    assert len(out) == len(ks) and all(1 <= new <= old for new, old in zip(out, ks))
    if sum(ks) <= budget:
        assert out == ks  # a plan within its budget is left as it is
    else:
        assert sum(out) == budget
        # shared in proportion to k - 1: no tensor gives up more than its share rounded up
        excess, spare = sum(ks) - budget, sum(k - 1 for k in ks)
        assert all(old - new <= math.ceil(excess * (old - 1) / spare) for new, old in zip(out, ks))


def test_small_tensors_no_longer_raise_the_plan_above_its_density():
    # the digits CNN's shape of the problem: a large tensor and many below 1 / density
    sizes = [32768] + [512] * 17
    sparsifier = build_sparsifier("topk", density=0.001)
    before = _plan("ahead", sizes, 0.001)
    after = within_budget(before, sparsifier)
    assert sum(slot.k for b in before.buffers for slot in b.sparse_slots) == 32 + 17  # 18% over 41.5
    assert sum(slot.k for b in after.buffers for slot in b.sparse_slots) == 41
    assert [slot.k for b in after.buffers for slot in b.slots][1:] == [1] * 17  # the small ones keep one each
    # ADTopk sends at least one element a row of a matrix: those counts are left as they are
    adtopk = build_sparsifier("adtopk", density=0.001)
    specs = [(0, ParamSpec("w", (64, 64), torch.float32))] + [(i, ParamSpec(f"b{i}", (64,), torch.float32)) for i in range(1, 21)]
    plan = FUSION_POLICIES.build("ahead").plan(specs, PlanContext(adtopk, 64 * 1024, 2, 4, CostProfile(world_size=4)))
    assert sum(slot.k for b in plan.buffers for slot in b.sparse_slots) > 0.001 * 64 * 84
    assert within_budget(plan, adtopk) == plan


# --------------------------------------------------------------------------- the engine on 2 ranks
class Wide(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(64, 256)
        self.fc2 = nn.Linear(256, 128)
        self.head = nn.Linear(128, 10)

    def forward(self, x):
        return self.head(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


def _engine(model, fusion, sparsifier, density, comm="hybrid", warmup=DensityWarmup(), memory="residual"):
    groups = [dist.new_group(backend="gloo") for _ in range(2)]
    return FusionEngine(
        list(model.named_parameters()),
        build_sparsifier(sparsifier, density=density),
        build_memory(memory),
        FUSION_POLICIES.build(fusion),
        COMMUNICATORS.build(comm),
        ChannelSet(groups, torch.device("cpu")),
        EngineConfig(buffer_bytes=64 * 1024, density_warmup=warmup, profile_steps=100),
    )


def _rounds(engine, model, rounds: int):
    engine.attach()
    out = []
    for step in range(rounds):
        model.zero_grad(set_to_none=True)
        g = torch.Generator().manual_seed(100 * step + dist.get_rank())
        model(torch.randn(16, 64, generator=g)).pow(2).sum().backward()
        metrics = engine.finish()
        ks = sum(slot.k for buffer in engine.plan.buffers for slot in buffer.sparse_slots)
        out.append((metrics.requested_density, metrics.effective_density, metrics.selected_elements, ks, engine.plan.fingerprint()))
    engine.close()
    return out


def effective_density_run(sparsifiers):
    out = {}
    for fusion in POLICIES:
        for sparsifier in sparsifiers:
            torch.manual_seed(0)
            model = Wide()
            out[(fusion, sparsifier)] = _rounds(_engine(model, fusion, sparsifier, 0.02), model, 4)
    return out


def test_every_policy_sends_the_requested_density(pool2):
    # the presets' sparsifiers (adtopk aside: its per-row count is at least 1/cols, see adtopk.py);
    # gaussiank, sidco and redsync keep their papers' wider count bands
    results = pool2.run(effective_density_run, ["topk", "dgc", "threshold_reuse"])
    for key, rounds in results[0].items():
        for requested, effective, selected, _, _ in rounds[1:]:  # round 0 plans in registration order
            assert requested == 0.02
            assert 0.9 * requested <= effective <= 1.1 * requested, (key, effective)
            assert selected > 0


class ManySmall(nn.Module):
    """One tensor of 32,768 elements and 17 of 512: at density 0.1% each small one's single element
    is twice what it asks for, and together they would raise the plan 18% above its density."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(64, 512)
        self.norms = nn.Sequential(*[nn.LayerNorm(512) for _ in range(8)])

    def forward(self, x):
        return self.norms(self.fc(x))


def small_tensors_run(fusion, sparsifier):
    torch.manual_seed(0)
    model = ManySmall()
    return _rounds(_engine(model, fusion, sparsifier, 0.001), model, 3)


@pytest.mark.parametrize(("fusion", "sparsifier"), [("selective", "topk"), ("ahead", "dgc"), ("layerwise", "topk")])
def test_small_tensors_do_not_raise_what_the_engine_sends(pool2, fusion, sparsifier):
    for rounds in pool2.run(small_tensors_run, fusion, sparsifier):
        for requested, effective, selected, ks, _ in rounds[1:]:
            assert ks == 41  # round(0.001 * 41,472), each small tensor one element
            assert 0.9 * requested <= effective <= 1.1 * requested, effective
            assert selected <= ks


def warmup_run(fusion, sparsifier, comm, memory):
    torch.manual_seed(0)
    model = Wide()
    engine = _engine(model, fusion, sparsifier, 0.001, comm=comm, warmup=DensityWarmup(8, 4), memory=memory)
    return _rounds(engine, model, 11)


@pytest.mark.parametrize(
    ("fusion", "sparsifier", "comm", "memory"),
    [("selective", "topk", "hybrid", "residual"), ("ahead", "dgc", "allgather", "dgc"), ("behind", "threshold_reuse", "oktopk", "residual")],
)
def test_the_plan_follows_the_warmup_on_every_rank(pool2, fusion, sparsifier, comm, memory):
    ranks = pool2.run(warmup_run, fusion, sparsifier, comm, memory)
    warmup = DensityWarmup(8, 4)
    for step, (r0, r1) in enumerate(zip(*ranks)):
        assert r0[4] == r1[4], f"step {step}: the ranks' plans differ"
        requested, effective, _, _, _ = r0
        assert requested == pytest.approx(warmup.density(step, 0.001))
        if sparsifier == "topk":  # exact k: what the plan of this step asked for, to the element
            assert r0[2] == ranks[0][step - 1][3] if step else True
    # the plan made after each round is the next round's: k shrinks stage by stage, then stays
    ks = [r[3] for r in ranks[0]]
    assert ks[1] > ks[3] > ks[5] > ks[7] == ks[8] == ks[10]


# --------------------------------------------------------------------------- local clipping
def test_dgc_local_clipping_scales_with_the_world_size():
    memory = build_memory("dgc", momentum=0.0, clip_norm=5.0)
    memory.set_world_size(4)  # each rank clips at 5 / sqrt(4) = 2.5
    grad = torch.tensor([3.0, 4.0, 0.0, 0.0])
    assert torch.allclose(memory.compensate("w", grad), grad / 2)
    memory.update("w", grad, torch.tensor([0, 1]))
    assert torch.equal(memory.residual("w"), torch.zeros(4))


# --------------------------------------------------------------------------- under Lightning
class DensityPerStep(L.Callback):
    def __init__(self) -> None:
        self.densities: list[float] = []
        self.seen = None

    def on_train_start(self, trainer, pl_module):
        self.seen = trainer.strategy.last_metrics

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        metrics = trainer.strategy.last_metrics
        if metrics is not self.seen:  # a synchronized micro-batch
            self.seen = metrics
            self.densities.append(metrics.requested_density)


def warmup_epochs_run():
    from ssfusion_lightning.strategy import SSFusionStrategy
    from tests.workloads import Regressor, make_trainer, regression_data

    L.seed_everything(3, verbose=False)
    record = DensityPerStep()
    strategy = SSFusionStrategy(
        sparsifier="topk", density=0.05, fusion="ahead", offload="none", density_warmup_epochs=1.5, density_warmup_stages=3
    )
    trainer = make_trainer(strategy, 8, max_epochs=-1, accumulate_grad_batches=2, callbacks=[record])
    trainer.fit(Regressor(), DataLoader(regression_data(), batch_size=16))
    return record.densities


def test_warmup_in_epochs_counts_optimizer_steps(pool2):
    # 256 samples, batch 16, 2 ranks: 8 batches per epoch, 4 optimizer steps with accumulation 2;
    # 1.5 epochs = 6 steps in 3 stages of 2 steps
    expected = [0.05 ** (1 / 4)] * 2 + [0.05 ** (2 / 4)] * 2 + [0.05 ** (3 / 4)] * 2 + [0.05] * 2
    for densities in pool2.run(warmup_epochs_run):
        assert densities == pytest.approx(expected, rel=1e-12)


# --------------------------------------------------------------------------- momentum correction under Lightning
def momentum_takeover_run(strategy_kwargs):
    import lightning.pytorch.strategies as strategies

    from ssfusion_lightning.strategy import SSFusionStrategy
    from tests.workloads import Regressor, make_trainer, regression_data

    L.seed_everything(4, verbose=False)
    model = Regressor()  # SGD with momentum 0.9
    strategy = SSFusionStrategy(**strategy_kwargs) if strategy_kwargs else strategies.DDPStrategy()
    seen = {}

    class Seen(L.Callback):
        def on_train_end(self, trainer, pl_module):
            engine = getattr(trainer.strategy, "engine", None)
            seen["memory"] = engine.memory.momentum if engine is not None else None
            seen["optimizer"] = trainer.optimizers[0].param_groups[0]["momentum"]

    trainer = make_trainer(strategy, 6, callbacks=[Seen()])
    trainer.fit(model, DataLoader(regression_data(), batch_size=16))
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return params, seen["optimizer"], seen["memory"]


def test_dgc_memory_takes_over_the_sgd_momentum_and_trains_like_ddp(pool2):
    # dense slots (sparsifier none): momentum correction is SGD's momentum, applied once, by the
    # memory instead of the optimizer; the same math as DDP + SGD(momentum=0.9), summed in another order
    # (the engine's own rounds: with the hand-off DDP's reducer and the SGD's momentum take over)
    dense_dgc = dict(sparsifier="none", memory="dgc", fusion="ahead", comm="allreduce", offload="none", ddp_handoff=False)
    ours = pool2.run(momentum_takeover_run, dense_dgc)
    ddp = pool2.run(momentum_takeover_run, None)
    for (params, optimizer_momentum, memory_momentum), (reference, ddp_momentum, _) in zip(ours, ddp):
        assert optimizer_momentum == 0.0 and memory_momentum == 0.9 and ddp_momentum == 0.9
        torch.testing.assert_close(params, reference, rtol=1e-5, atol=1e-6)
    assert torch.equal(ours[0][0], ours[1][0])


def adam_under_dgc_memory_run(momentum):
    import warnings

    from ssfusion_lightning.strategy import SSFusionStrategy
    from tests.workloads import Regressor, make_trainer, regression_data

    class AdamRegressor(Regressor):
        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-3)

    L.seed_everything(4, verbose=False)
    strategy = SSFusionStrategy(
        sparsifier="topk", density=0.1, memory="dgc", memory_options={"momentum": momentum}, fusion="ahead",
        comm="allgather", offload="none",
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_trainer(strategy, 2).fit(AdamRegressor(), DataLoader(regression_data(), batch_size=16))
    return [str(w.message) for w in caught if "memory='dgc'" in str(w.message)]


def test_dgc_memory_warns_when_it_finds_no_momentum_to_take_over(pool2):
    # with Adam the memory's own momentum 0.9 accumulates the gradients Adam then steps with:
    # a second momentum nobody asked for, so rank 0 says so once; with momentum 0 it is silent
    noted = pool2.run(adam_under_dgc_memory_run, 0.9)
    assert len(noted[0]) == 1 and noted[1] == []
    assert "optimizers: Adam" in noted[0][0] and "momentum 0.9" in noted[0][0]
    assert pool2.run(adam_under_dgc_memory_run, 0.0) == [[], []]


def test_dgc_memory_refuses_momentum_it_cannot_apply():
    from ssfusion_lightning.sparsifiers import build_memory

    param = nn.Parameter(torch.zeros(3))
    other = nn.Parameter(torch.zeros(3))
    memory = build_memory("dgc")
    with pytest.raises(ValueError, match=r"different momenta \[0.5, 0.9\]"):
        memory.take_momentum_from([torch.optim.SGD([{"params": [param], "momentum": 0.9}, {"params": [other], "momentum": 0.5}], lr=0.1)])
    with pytest.raises(ValueError, match="nesterov=True"):
        memory.take_momentum_from([torch.optim.SGD([param], lr=0.1, momentum=0.9, nesterov=True)])
    plain = torch.optim.SGD([param], lr=0.1)
    assert memory.take_momentum_from([plain, torch.optim.Adam([other])]) is None and memory.momentum == 0.9


def test_dgc_memory_moves_its_momentum_to_the_sgd_and_back():
    """hand_to_optimizer: the averaged u becomes the SGD's buffer and the momentum the group's again,
    the memory keeps none; take_from_optimizer: the buffer is u again and the group's momentum 0.
    DDP's reducer may run the dense rounds only where the SGD steps every tensor and nothing clips."""
    weight, bias, stray = (nn.Parameter(torch.zeros(n)) for n in (4, 2, 3))
    params = {"weight": weight, "bias": bias}
    sgd = torch.optim.SGD([{"params": [weight]}, {"params": [bias]}], lr=0.1, momentum=0.9)
    memory = build_memory("dgc")
    assert memory.take_momentum_from([sgd], [weight, bias]) == 0.9 and memory.ddp_can_take_over
    assert [group["momentum"] for group in sgd.param_groups] == [0.0, 0.0]
    memory.settle_dense("weight", torch.arange(4.0))
    averaged: list[list[float]] = []

    def halve_(tensors: list[torch.Tensor]) -> None:  # two ranks, the other's u all zeros
        averaged.extend(t.tolist() for t in tensors)
        torch._foreach_mul_(tensors, 0.5)

    memory.hand_to_optimizer(params, halve_)
    assert averaged == [[0.0, 1.0, 2.0, 3.0]]
    assert [group["momentum"] for group in sgd.param_groups] == [0.9, 0.9] and memory.momenta == {}
    assert sgd.state[weight]["momentum_buffer"].tolist() == [0.0, 0.5, 1.0, 1.5] and "momentum_buffer" not in sgd.state[bias]

    weight.grad, bias.grad = torch.ones(4), torch.ones(2)
    sgd.step()  # the bias's buffer starts from its gradient, as a fresh u would
    assert memory.take_from_optimizer(params) and not memory.take_from_optimizer(params)
    assert [group["momentum"] for group in sgd.param_groups] == [0.0, 0.0] and all(not state for state in sgd.state.values())
    torch.testing.assert_close(memory.momenta["weight"], torch.tensor([1.0, 1.45, 1.9, 2.35]))
    assert memory.momenta["bias"].tolist() == [1.0, 1.0]

    uncovered = build_memory("dgc")
    uncovered.take_momentum_from([torch.optim.SGD([weight], lr=0.1, momentum=0.9)], [weight, stray])
    clipped = build_memory("dgc", clip_norm=1.0)
    clipped.take_momentum_from([torch.optim.SGD([weight], lr=0.1, momentum=0.9)], [weight])
    assert not uncovered.ddp_can_take_over and not clipped.ddp_can_take_over and not build_memory("dgc").ddp_can_take_over
