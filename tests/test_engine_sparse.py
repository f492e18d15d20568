"""Sparse training through the engine: conservation of gradient mass, identical ranks, hook order."""

from __future__ import annotations

from contextlib import contextmanager

import lightning as L
import pytest
import torch
import torch.distributed as dist
from torch import nn

import ssfusion_lightning as ssf
from ssfusion_lightning.comm import ChannelSet
from ssfusion_lightning.comm.collectives import AllgatherCommunicator
from ssfusion_lightning.engine.engine import EngineConfig, FusionEngine
from ssfusion_lightning.fusion import FUSION_POLICIES
from ssfusion_lightning.sparsifiers import build_memory, build_sparsifier
from tests.workloads import Regressor, make_trainer, regression_data


class RecordingAllgather(AllgatherCommunicator):
    """Remembers what this rank sent (dense-scattered, unscaled) for every tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.sent: list = []

    def launch(self, encoded, buffer, channels):
        self.sent.append((buffer, encoded.values.clone() if encoded.values is not None else None,
                          encoded.indices.clone() if encoded.indices is not None else None))
        return super().launch(encoded, buffer, channels)


class TwoBranch(nn.Module):
    """Independent branches; ``reverse`` changes the order their hooks fire in backward."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.b = nn.Linear(6, 6)
        self.c = nn.Linear(6, 1)

    def forward(self, x, reverse: bool):
        if reverse:
            yb = self.b(x)
            ya = self.a(x)
        else:
            ya = self.a(x)
            yb = self.b(x)
        return self.c(torch.relu(ya) + torch.relu(yb))


def make_engine(
    model: nn.Module, fusion: str, sparsifier: str = "topk", density: float = 0.1, comm=None, profile_steps: int = 3,
    nonfinite: str = "raise", buffer_bytes: float | None = 600,
):
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return FusionEngine(
        named,
        build_sparsifier(sparsifier, density=density),
        build_memory("residual"),
        FUSION_POLICIES.build(fusion),
        comm or RecordingAllgather(),
        ChannelSet([dist.new_group(backend="gloo"), dist.new_group(backend="gloo")], torch.device("cpu")),
        EngineConfig(buffer_bytes=buffer_bytes, profile_steps=profile_steps, nonfinite=nonfinite),
    )


def conservation_run(fusion: str, steps: int = 6):
    """sent + residual == accumulated local gradient, exactly, for every tensor (float64 math)."""
    torch.manual_seed(0)
    model = TwoBranch().double()
    engine = make_engine(model, fusion)
    engine.attach()
    world = dist.get_world_size()
    total_grad = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    total_sent = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    names = dict(model.named_parameters())
    torch.manual_seed(100 + dist.get_rank())
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        engine.communicator.sent.clear()
        model(torch.randn(4, 6, dtype=torch.float64), reverse=False).pow(2).sum().backward()
        for n, p in names.items():
            total_grad[n] += p.grad
        engine.finish()
        for buffer, values, indices in engine.communicator.sent:
            for slot in buffer.sparse_slots:
                mine = (indices >= slot.offset) & (indices < slot.offset + slot.numel)
                flat = total_sent[slot.name].view(-1)
                flat.index_add_(0, indices[mine] - slot.offset, values[mine] * world)
    engine.close()
    errors = {}
    for n in names:
        residual = engine.memory.residual(n)
        errors[n] = (total_sent[n] + residual.view_as(total_sent[n]) - total_grad[n]).abs().max().item()
    return errors


def test_error_feedback_conserves_gradient_mass(pool2):
    for errors in pool2.run(conservation_run, "ahead"):
        # float64 sums of the same terms in a different order: equal to rounding of a few ulps
        assert max(errors.values()) < 1e-12, errors


def hook_order_run():
    torch.manual_seed(0)
    model = TwoBranch()
    engine = make_engine(model, "layerwise")
    engine.attach()
    # the round's k per tensor: k_for's, with the small tensors' excess taken from the larger (fusion/budget.py)
    ks = {slot.name: slot.k for buffer in engine.plan.buffers for slot in buffer.slots}
    torch.manual_seed(7 + dist.get_rank())
    x = torch.randn(4, 6)
    model(x, reverse=dist.get_rank() == 0).pow(2).sum().backward()
    local = {n: p.grad.clone() for n, p in model.named_parameters()}
    engine.finish()
    order = engine.plan.fingerprint()
    engine.close()
    return local, {n: p.grad.clone() for n, p in model.named_parameters()}, order, ks


def test_hooks_firing_in_different_orders_give_the_same_result(pool2):
    """layerwise topk: the result must equal the sum of each rank's own top-k selection / P."""
    results = pool2.run(hook_order_run)
    ks = results[0][3]
    assert results[1][3] == ks
    assert sum(ks.values()) == max(len(ks), round(0.1 * sum(t.numel() for t in results[0][0].values())))
    for name in results[0][0]:
        expected = torch.zeros_like(results[0][0][name]).view(-1)
        for local, _, _, _ in results:
            flat = local[name].view(-1)
            idx = torch.topk(flat.abs(), ks[name]).indices
            expected[idx] += flat[idx] / 2
        for _, written, _, _ in results:
            assert torch.allclose(written[name].view(-1), expected, atol=1e-7), name
    assert results[0][2] == results[1][2], "ranks disagree on the rebuilt plan"


class StepRecorder(L.Callback):
    """Checks after every optimizer step that all ranks hold identical parameters; records losses."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.identical = True

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))
        flat = torch.cat([p.detach().reshape(-1) for p in pl_module.parameters()])
        gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, flat)
        self.identical &= all(torch.equal(gathered[0], g) for g in gathered)


def sparse_training_run(fusion: str, comm: str, steps: int = 60):
    L.seed_everything(0, verbose=False)
    model = Regressor("plain", lr=0.05)
    recorder = StepRecorder()
    strategy = ssf.SSFusionStrategy(sparsifier="topk", density=0.01, fusion=fusion, comm=comm, offload="none")
    loader = torch.utils.data.DataLoader(regression_data(), batch_size=16, shuffle=True)
    make_trainer(strategy, steps, callbacks=[recorder], max_epochs=-1).fit(model, loader)
    return recorder.losses, recorder.identical


def test_topk_training_keeps_ranks_identical_and_learns(pool2):
    # 1% of this 1,377-parameter MLP is 14 elements a step, its two smallest tensors one each
    for losses, identical in pool2.run(sparse_training_run, "ahead", "allgather", 100):
        assert identical
        first, last = sum(losses[:8]) / 8, sum(losses[-8:]) / 8
        assert last < 0.7 * first, (first, last)


#: where tensors are selected: (BATCH_BELOW, HOST_BATCH_BELOW) of the engine module
SELECTION_PLACES = {
    "small ones batched": (1 << 16, 1 << 16),
    "branch weights in a batch of their own": (16, 1 << 18),
    "branch weights in their hooks": (16, 16),  # too large for the host's batch, as on a GPU
    "each in its hook": (0, 0),
}


@contextmanager
def selection_place(place: str):
    from ssfusion_lightning.engine import engine as engine_module

    engine_module.BATCH_BELOW, engine_module.HOST_BATCH_BELOW = SELECTION_PLACES[place]
    try:
        yield
    finally:
        engine_module.BATCH_BELOW, engine_module.HOST_BATCH_BELOW = 1 << 16, 1 << 18


def batched_against_per_tensor(fusion: str, sparsifier: str, steps: int = 6):
    """The same training with tensors selected in batches per buffer and with every tensor
    selected in its hook: what each rank sends and the parameters it ends with."""
    results = {}
    for place in SELECTION_PLACES:
        with selection_place(place):
            torch.manual_seed(0)
            model = TwoBranch().double()
            # costs are never agreed in these steps: both runs keep the same plan, whatever the timings
            engine = make_engine(model, fusion, sparsifier=sparsifier, density=0.2, profile_steps=100)
            engine.attach()
            torch.manual_seed(100 + dist.get_rank())
            sent = []
            for _ in range(steps):
                model.zero_grad(set_to_none=True)
                engine.communicator.sent.clear()
                model(torch.randn(4, 6, dtype=torch.float64), reverse=False).pow(2).sum().backward()
                engine.finish()
                for buffer, values, indices in engine.communicator.sent:
                    order = torch.argsort(indices)
                    sent.append((buffer.index, values[order], indices[order]))
                with torch.no_grad():
                    for p in model.parameters():
                        p -= 0.1 * p.grad
            engine.close()
            results[place] = (sent, [p.detach().clone() for p in model.parameters()])
    return results


@pytest.mark.parametrize("fusion, sparsifier", [("ahead", "topk"), ("aligned", "dgc"), ("selective", "gaussiank")])
def test_batched_selection_in_the_engine_sends_what_per_tensor_selection_sends(pool2, fusion, sparsifier):
    for results in pool2.run(batched_against_per_tensor, fusion, sparsifier):
        hooked_sent, hooked_params = results["each in its hook"]
        for place in ("small ones batched", "branch weights in a batch of their own", "branch weights in their hooks"):
            batched_sent, batched_params = results[place]
            assert len(batched_sent) == len(hooked_sent) > 0
            for (b1, v1, i1), (b2, v2, i2) in zip(batched_sent, hooked_sent):
                assert b1 == b2 and torch.equal(i1, i2) and torch.equal(v1, v2), place
            assert all(torch.equal(a, b) for a, b in zip(batched_params, hooked_params)), place


def train_two_branch(steps: int, timeline: bool = False, **engine_options) -> FusionEngine:
    """``steps`` rounds of ``TwoBranch`` on an "ahead" engine at density 0.2; the closed engine."""
    torch.manual_seed(0)
    model = TwoBranch()
    engine = make_engine(model, "ahead", density=0.2, **engine_options)
    if timeline:
        engine.timeline.enable()
    engine.attach()
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        engine.begin_backward()
        model(torch.randn(4, 6), reverse=False).pow(2).sum().backward()
        engine.finish()
    engine.close()
    return engine


def where_selected_run(place: str, steps: int = 3):
    """The details of the last round's select spans (a batch's is its tensor count)."""
    with selection_place(place):
        events = train_two_branch(steps, timeline=True).timeline.events()
        last = max(e.step for e in events)
        return [e.detail for e in events if e.step == last and e.name == "select"]


def test_on_the_host_large_tensors_are_selected_in_a_batch_of_their_own_not_in_their_hooks(pool2):
    """With the branch weights (36 elements) counted as large, the host selects them in their
    buffer's batch of larger tensors, apart from the small ones' batch; above the host's bound (as
    on a GPU) they are selected one by one in their hooks."""
    apart = pool2.run(where_selected_run, "branch weights in a batch of their own")
    hooked = pool2.run(where_selected_run, "branch weights in their hooks")
    for batched, one_by_one in zip(apart, hooked):
        assert batched and all(detail.endswith("tensors batched") for detail in batched), batched
        assert {"a.weight", "b.weight"} <= set(one_by_one), one_by_one


def profiled_compression_run(place: str, steps: int = 3):
    """What the cost profiler was told: the sizes of the compressions it saw and the launches'
    overheads; with the plan's sparse tensor sizes."""
    with selection_place(place):
        # the auto cut (buffer_bytes None) profiles; 100 rounds keep it profiling
        engine = train_two_branch(steps, profile_steps=100, buffer_bytes=None)
        sparse = [slot.numel for buffer in engine.plan.buffers for slot in buffer.sparse_slots]
        return [numel for numel, _ in engine._profiler.compress], sparse, len(engine._profiler.launches)


def test_the_profiler_sees_each_large_tensor_of_a_batch_and_one_sample_of_the_small_ones(pool2):
    """The cost cut charges a large tensor the compression line at its size: the batch of large
    tensors reports each of them. The small ones' batch stays one sample of their summed size, as
    their cost is mostly per call. Every launch is still reported."""
    for reported, sparse, launches in pool2.run(profiled_compression_run, "branch weights in a batch of their own"):
        large = [n for n in sparse if n >= 16]
        small = sum(n for n in sparse if n < 16)
        rounds = reported.count(small)
        assert len(large) > 1 and rounds > 0 and launches > 0
        assert sorted(reported) == sorted(large * rounds + [small] * rounds), (reported, sparse)


def zeroing_run(set_to_none: bool, steps: int = 4):
    """The gradients the engine writes and the residuals it keeps over ``steps`` rounds, with the
    optimizer's gradients zeroed in place (they are views of the previous round's decoded sum, and
    the next backward accumulates into them) or set to None."""
    torch.manual_seed(0)
    model = TwoBranch()
    engine = make_engine(model, "ahead")
    engine.attach()
    torch.manual_seed(100 + dist.get_rank())
    written = []
    for _ in range(steps):
        model.zero_grad(set_to_none=set_to_none)
        model(torch.randn(4, 6), reverse=False).pow(2).sum().backward()
        engine.finish()
        written.append([p.grad.clone() for p in model.parameters()])
    engine.close()
    residuals = [engine.memory.residual(n).clone() for n, _ in model.named_parameters() if engine.memory.residual(n) is not None]
    return written, residuals


def test_gradients_zeroed_in_place_give_the_same_rounds(pool2):
    """Written sparse gradients are views of the round's decoded sum; zeroing them in place (the
    optimizer's set_to_none=False) and accumulating the next backward into them must not change
    what the next rounds send, keep or write."""
    for (kept, kept_res), (fresh, fresh_res) in zip(pool2.run(zeroing_run, False), pool2.run(zeroing_run, True)):
        assert len(kept) == len(fresh) and kept_res
        for a, b in zip(kept, fresh):
            assert all(torch.equal(x, y) for x, y in zip(a, b))
        assert all(torch.equal(x, y) for x, y in zip(kept_res, fresh_res))


def compensated_overflow_run():
    """Round 1: rank 1's gradient of ``a.weight`` is finite but its sum with the residual is not."""
    torch.manual_seed(0)
    model = TwoBranch()
    engine = make_engine(model, "ahead", nonfinite="skip")
    engine.attach()
    x = torch.randn(4, 6)
    model(x, reverse=False).pow(2).sum().backward()
    engine.finish()
    if dist.get_rank() == 1:
        engine.memory.residual("a.weight").fill_(torch.finfo(torch.float32).max)
        model.a.weight.register_hook(lambda g: g.abs() * 1e32 + 1e32)  # finite; residual + it is not
    before = {key: value.clone() for key, value in engine.memory.residuals.items()}
    model.zero_grad(set_to_none=True)
    model(x, reverse=False).pow(2).sum().backward()
    grad_finite = bool(torch.isfinite(model.a.weight.grad).all())
    metrics = engine.finish()
    engine.close()
    kept = all(torch.equal(before[key], value) for key, value in engine.memory.residuals.items())
    return grad_finite, metrics.skipped_steps, kept, [p.grad is None for p in model.parameters()]


def test_an_overflow_of_the_compensated_gradient_drops_the_round_on_every_rank(pool2):
    """The vote checks what is selected from (gradient plus residual), not the bare gradient: a
    finite gradient whose compensated sum overflows on one rank drops the round on every rank,
    its error feedback untouched (a commit would have put inf into that rank's residual)."""
    for grad_finite, skipped, kept, cleared in pool2.run(compensated_overflow_run):
        assert grad_finite
        assert skipped == 1
        assert kept
        assert all(cleared)


def slow_large_batch_run(steps: int = 3, pause: float = 0.2):
    """As ``profiled_compression_run``, with every batch of large tensors taking ``pause`` seconds
    longer: what the profiler charged to those tensors and to the launches."""
    import time

    from ssfusion_lightning.engine import engine as engine_module

    original = engine_module.FusionEngine._select_batch

    def slow(self, buffer, batch, profiled=True):
        if not profiled:  # the large tensors' batch
            time.sleep(pause)
        return original(self, buffer, batch, profiled)

    engine_module.FusionEngine._select_batch = slow
    try:
        with selection_place("branch weights in a batch of their own"):
            engine = train_two_branch(steps, profile_steps=100, buffer_bytes=None)
            large = sum(seconds for numel, seconds in engine._profiler.compress if numel >= 16)
            return large, list(engine._profiler.launches)
    finally:
        engine_module.FusionEngine._select_batch = original


def test_the_large_tensors_batch_is_charged_to_them_not_to_the_buffers_launch(pool2):
    """Counted in the launch overhead too, each buffer would pay for its large tensors twice in the
    cost cut: once on the compression line, once per buffer."""
    for large, launches in pool2.run(slow_large_batch_run):
        assert launches and large >= 0.2 * len(launches)
        assert all(seconds < 0.2 for seconds in launches), launches


def plan_builds_run():
    """How often the policy plans, for plans asked for again and for plans whose inputs differ."""
    from dataclasses import replace

    from ssfusion_lightning.costmodel import CostProfile

    model = TwoBranch()
    engine = make_engine(model, "selective", buffer_bytes=None)
    planned = []
    plan = engine.policy.plan
    engine.policy.plan = lambda specs, ctx: planned.append(ctx.costs) or plan(specs, ctx)
    costs = CostProfile(backward={name: 1e-3 for name in engine.names}, world_size=2, measured=True)
    first = engine._build_plan(engine.order, costs)
    again = engine._build_plan(list(engine.order), replace(costs))  # equal inputs, other objects
    fused = engine._build_plan(engine.order, replace(costs, fused_measured_faster=True))
    engine.sparsifier.set_density(0.2)
    denser = engine._build_plan(engine.order, costs)
    engine.sparsifier.set_density(0.1)
    back = engine._build_plan(engine.order, costs)
    reordered = engine._build_plan(list(reversed(engine.order)), costs)
    engine.close()
    return len(planned), again is first, back is first, fused is first, denser.fingerprint() != first.fingerprint(), reordered is first


def test_a_plan_asked_for_again_is_not_planned_again(pool2):
    for planned, again, back, fused, denser_differs, reordered in pool2.run(plan_builds_run):
        # first, fused, denser, reordered planned; again and back kept
        assert planned == 4 and again and back and not fused and denser_differs and not reordered
