"""Each preset does what its paper says: Ok-Topk's bytes, error feedback across re-plans, DGC
momentum on dense slots, SSFusion-O offloading, SAFusion alignment, ZEN's choice, and the
strategy's process groups running concurrently."""

from __future__ import annotations

import threading
import time
from concurrent.futures import TimeoutError as FutureTimeout

import pytest
import torch
import torch.distributed as dist
from torch import nn

from ssfusion_lightning.comm import COMMUNICATORS, ChannelSet
from ssfusion_lightning.comm.channels import result
from ssfusion_lightning.comm.zen import zen_or_sparcml
from ssfusion_lightning.costmodel import CostProfile, Link
from ssfusion_lightning.engine.engine import EngineConfig, FusionEngine, dense_version, offload_decisions
from ssfusion_lightning.fusion import FUSION_POLICIES, CompressContext, ErrorFeedback, PlanContext
from ssfusion_lightning.fusion.base import exact_count
from ssfusion_lightning.sparsifiers import build_memory, build_sparsifier
from ssfusion_lightning.vocabulary import Buffer, Plan, Slot


def make_engine(model, fusion, comm, sparsifier="topk", density=0.1, memory="residual", offload="none", buffer_bytes=25 << 20):
    return FusionEngine(
        list(model.named_parameters()),
        build_sparsifier(sparsifier, density=density),
        build_memory(memory),
        FUSION_POLICIES.build(fusion),
        COMMUNICATORS.build(comm),
        ChannelSet([dist.new_group(backend="gloo") for _ in range(2)], torch.device("cpu")),
        EngineConfig(buffer_bytes=buffer_bytes, offload=offload, profile_steps=2),
    )


# ----------------------------------------------------------------------------- Ok-Topk preset
def oktopk_preset_run(steps: int = 10):
    """The oktopk preset's components (threshold_reuse, behind, oktopk) at density 1%."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(140, 140), nn.Tanh(), nn.Linear(140, 140))
    engine = make_engine(model, "behind", "oktopk", "threshold_reuse", density=0.01)
    engine.attach()
    torch.manual_seed(1 + dist.get_rank())
    received, kept = [], []
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        model(torch.randn(8, 140)).pow(2).sum().backward()
        received.append(engine.finish().bytes_received)
        kept.append([state.last_count for state in engine.communicator.states.values()])
    k = sum(slot.k for buffer in engine.plan.buffers for slot in buffer.sparse_slots)
    numel = sum(buffer.numel for buffer in engine.plan.buffers)
    engine.close()
    return received, kept, k, numel


@pytest.mark.parametrize("world", [2, 4])
def test_oktopk_preset_selects_k_globally_within_its_byte_bound(rank_pools, world):
    results = rank_pools(world).run(oktopk_preset_run)
    _, kept, k, numel = results[0]
    assert k == sum(max(1, int(0.01 * n)) for n in (140 * 140, 140, 140 * 140, 140))  # density x n, not n
    assert k < numel / 50
    for counts in kept[1:]:  # about k global entries every round (the top-k of the sum)
        assert all(k / 2 <= c <= 4 * k / 3 for c in counts), (counts, k)
    # Ok-Topk's bound (ALGORITHMS.md section 7): 3(P-1)/P * k(v+x) received per rank, mean over
    # ranks and rounds, fp32 values and int32 positions, the counts and threshold rounds included
    bound = 3 * (world - 1) / world * k * (4 + 4)
    mean = sum(sum(r[0]) for r in results) / (world * len(results[0][0]))
    assert mean <= bound, (mean, bound)


# ----------------------------------------------------------------------------- error feedback across re-plans
class Mixed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 30)
        self.fc2 = nn.Linear(30, 20)
        self.head = nn.Linear(20, 1)

    def forward(self, x):
        return self.head(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


def replan_conservation_run(fusion: str, steps: int = 8):
    """sent (dense and sparse) + residual == accumulated gradient, exactly, while the plan changes:
    the profiled re-plan of cost-driven policies, then every tensor turned dense, then back."""
    torch.manual_seed(0)
    model = Mixed().double()
    engine = make_engine(model, fusion, "allgather", buffer_bytes=1200)
    sent_log = []
    launch = engine.communicator.launch

    def recording(encoded, buffer, channels):
        sent_log.append((buffer, encoded.dense.clone() if encoded.dense is not None else None,
                         encoded.values.clone() if encoded.values is not None else None,
                         encoded.indices.clone() if encoded.indices is not None else None))
        return launch(encoded, buffer, channels)

    engine.communicator.launch = recording
    engine.attach()
    world = dist.get_world_size()
    names = dict(model.named_parameters())
    total_grad = {n: torch.zeros_like(p) for n, p in names.items()}
    total_sent = {n: torch.zeros_like(p) for n, p in names.items()}
    torch.manual_seed(100 + dist.get_rank())
    sparse_plan = None
    for step in range(steps):
        if step == steps - 3:  # every tensor dense for one round: the residuals must go out with it
            sparse_plan = engine.plan
            engine.set_plan(dense_version(sparse_plan))
        elif step == steps - 2:
            engine.set_plan(sparse_plan)
        model.zero_grad(set_to_none=True)
        sent_log.clear()
        model(torch.randn(4, 8, dtype=torch.float64)).pow(2).sum().backward()
        for n, p in names.items():
            total_grad[n] += p.grad
        engine.finish()
        if step == steps - 3:
            owed_after_dense = [n for n in names if engine.memory.residual(n) is not None]
        for buffer, dense, values, indices in sent_log:
            for slot in buffer.slots:
                flat = total_sent[slot.name].view(-1)
                if not slot.sparse:
                    flat += dense[slot.offset : slot.offset + slot.numel] * world
                    continue
                mine = (indices >= slot.offset) & (indices < slot.offset + slot.numel)
                flat.index_add_(0, indices[mine] - slot.offset, values[mine] * world)
    engine.close()
    errors = {}
    for n in names:
        residual = engine.memory.residual(n)
        owed = torch.zeros_like(total_sent[n]) if residual is None else residual.view_as(total_sent[n])
        errors[n] = (total_sent[n] + owed - total_grad[n]).abs().max().item()
    return errors, owed_after_dense


@pytest.mark.parametrize("fusion", ["selective", "partial", "adaptive", "ahead"])
def test_error_feedback_survives_replans(pool2, fusion):
    for errors, owed_after_dense in pool2.run(replan_conservation_run, fusion):
        assert max(errors.values()) < 1e-12, errors
        assert owed_after_dense == [], owed_after_dense  # the dense round sent every residual


# ----------------------------------------------------------------------------- DGC momentum on dense and sparse slots
def test_dgc_momentum_is_applied_once_on_dense_and_sparse_slots():
    """Hand computation with momentum m: a dense slot sends u_t = m u_(t-1) + g_t (momentum SGD);
    a sparse slot sends the top of v_t = v_(t-1) + u_t and masks u and v where it sent."""
    m, scale = 0.5, 1.0
    memory = build_memory("dgc", momentum=m)
    ctx = CompressContext(build_sparsifier("topk", density=0.5), ErrorFeedback(memory), scale)
    policy = FUSION_POLICIES.build("ahead")
    dense = Slot("d", 0, (2,), 0, 2, False, 2)
    sparse = Slot("s", 1, (2,), 0, 2, True, 1)
    grads = [torch.tensor([1.0, 2.0]), torch.tensor([3.0, 1.0])]
    sent_dense, sent_sparse = [], []
    for g in grads:
        out = torch.empty(2)
        piece = policy.compress_slot(dense, g, out, ctx)
        memory.settle_dense("d", piece.update.grad)
        sent_dense.append(out.clone())
        piece = policy.compress_slot(sparse, g, None, ctx)
        memory.update("s", piece.update.grad, piece.update.sent)
        sent_sparse.append((piece.values.clone(), piece.indices.clone()))
    # dense: u1 = g1 = [1, 2]; u2 = 0.5 * [1, 2] + [3, 1] = [3.5, 2]
    assert torch.equal(sent_dense[0], torch.tensor([1.0, 2.0]))
    assert torch.equal(sent_dense[1], torch.tensor([3.5, 2.0]))
    assert torch.equal(memory.momenta["d"], torch.tensor([3.5, 2.0]))  # unmasked: momentum carries on
    # sparse: u1 = v1 = [1, 2] -> sends index 1 (2.0), masks u and v there: u = [1, 0], v = [1, 0]
    # u2 = 0.5 * [1, 0] + [3, 1] = [3.5, 1]; v2 = [1, 0] + [3.5, 1] = [4.5, 1] -> sends index 0 (4.5)
    assert sent_sparse[0][1].tolist() == [1] and sent_sparse[0][0].tolist() == [2.0]
    assert sent_sparse[1][1].tolist() == [0] and sent_sparse[1][0].tolist() == [4.5]
    assert torch.equal(memory.residual("s"), torch.tensor([0.0, 1.0]))
    assert torch.equal(memory.momenta["s"], torch.tensor([0.0, 1.0]))


def test_a_sparse_tensor_turned_dense_flushes_its_residual():
    memory = build_memory("residual")
    ctx = CompressContext(build_sparsifier("topk", density=0.5), ErrorFeedback(memory), 1.0)
    policy = FUSION_POLICIES.build("ahead")
    piece = policy.compress_slot(Slot("w", 0, (2,), 0, 2, True, 1), torch.tensor([1.0, 2.0]), None, ctx)
    memory.update("w", piece.update.grad, piece.update.sent)
    assert torch.equal(memory.residual("w"), torch.tensor([1.0, 0.0]))
    out = torch.empty(2)
    piece = policy.compress_slot(Slot("w", 0, (2,), 0, 2, False, 2), torch.tensor([0.5, 0.5]), out, ctx)
    assert torch.equal(out, torch.tensor([1.5, 0.5]))  # the residual went out with the dense send
    memory.settle_dense("w", piece.update.grad)
    assert memory.residual("w") is None
    piece = policy.compress_slot(Slot("w", 0, (2,), 0, 2, False, 2), torch.tensor([0.5, 0.5]), out, ctx)
    assert piece.update is None and torch.equal(out, torch.tensor([0.5, 0.5]))  # nothing more owed


# ----------------------------------------------------------------------------- SSFusion-O
def one_buffer_plan(sizes: list[int], sparse: list[bool]) -> Plan:
    slots, dense_offset, sparse_offset = [], 0, 0
    for i, (n, s) in enumerate(zip(sizes, sparse)):
        slots.append(Slot(f"p{i}", i, (n,), sparse_offset if s else dense_offset, n, s, max(1, n // 100) if s else n))
        if s:
            sparse_offset += n
        else:
            dense_offset += n
    return Plan((Buffer(0, tuple(slots), 0),))


def test_offload_decisions_at_hand_computed_points():
    # backward 10 ms per tensor, compression 4 ms per 1e6 elements (no fixed part)
    costs = CostProfile(
        backward={f"p{i}": 0.010 for i in range(4)}, compress_fixed=0.0, compress_per_element=4e-9, measured=True
    )
    # One buffer of four 1e6-element sparse tensors: deadline = 4 * 10 + 4 * 4 = 56 ms.
    # p0 ready at 10, worker free -> offloaded, worker busy until 14; p1 ready at 20 -> offloaded
    # (until 24); p2 at 30 -> until 34; p3 at 40 -> ends at 44 <= 56: offloaded. Nothing stays.
    plan = one_buffer_plan([10**6] * 4, [True] * 4)
    assert offload_decisions(plan, costs) == {0, 1, 2, 3}
    # Compression 15 ms per tensor: p0 offloaded (worker until 25); p1 ready at 20 < 25: main thread
    # (clock 35); p2 ready at 45 >= 25: offloaded (until 60); p3 ready at 55 < 60: main thread.
    slow = CostProfile(
        backward={f"p{i}": 0.010 for i in range(4)}, compress_fixed=0.0, compress_per_element=15e-9, measured=True
    )
    assert offload_decisions(plan, slow) == {0, 2}
    # A dense tensor is never offloaded, and a job that would end after the deadline is not either:
    # one sparse tensor of 1e7 elements (40 ms) ready at 10 ms, deadline 10 + 10 + 40 = 60: 50 <= 60.
    mixed = one_buffer_plan([10**7, 10], [True, False])
    assert offload_decisions(mixed, costs) == {0}


EVENTS: list[tuple[str, str, str]] = []
EVENTS_LOCK = threading.Lock()


def record(what: str, key: str = "") -> None:
    with EVENTS_LOCK:
        EVENTS.append((what, key, threading.current_thread().name))


class SlowBackward(torch.autograd.Function):
    """Identity whose backward sleeps (without the GIL): the main thread is busy in backward
    between the second layer's gradients and the first layer's."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        record("slow backward starts")
        time.sleep(0.3)
        record("slow backward ends")
        return grad


class TwoLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(16, 64)
        self.second = nn.Linear(64, 64)

    def forward(self, x):
        return self.second(SlowBackward.apply(torch.relu(self.first(x))))


def offload_run(offload: str):
    torch.manual_seed(0)
    model = TwoLayer()
    engine = make_engine(model, "ahead", "allgather", offload=offload)
    select = engine.sparsifier.select

    def recording(tensor, *, key="", k=None):
        record("select", key)
        return select(tensor, key=key, k=k)

    engine.sparsifier.select = recording
    one_recorded_round(engine, model)
    return list(EVENTS), len(engine.plan.buffers)


def one_recorded_round(engine, model) -> None:
    """One backward and finish of ``model`` under ``engine`` with ``EVENTS`` recording it, then close."""
    engine.attach()
    EVENTS.clear()
    model(torch.randn(4, 16)).pow(2).sum().backward()
    engine.finish()
    engine.close()


def test_offload_runs_on_the_worker_while_backward_is_busy_in_one_buffer(pool2):
    for events, buffers in pool2.run(offload_run, "thread"):
        assert buffers == 1
        selections = [e for e in events if e[0] == "select"]
        assert len(selections) == 4 and {name for _, _, name in selections} == {"ssfusion-offload_0"}, events
        # the second layer's tensors were selected on the worker during the slow backward, before
        # the first layer's gradients existed (ordering from events, not timing thresholds)
        ends = [i for i, e in enumerate(events) if e[0] == "slow backward ends"][0]
        early = {key for what, key, _ in events[:ends] if what == "select"}
        assert early == {"second.weight", "second.bias"}, events


def auto_offload_engine(serial_cpu: float):
    """TwoLayer under offload="auto" on agreed costs that let the worker take every tensor, unless
    ``serial_cpu`` says its CPU work delays the main thread."""
    torch.manual_seed(0)
    model = TwoLayer()
    engine = make_engine(model, "ahead", "allgather", offload="auto")
    engine.costs = CostProfile(
        backward={n: 0.01 for n, _ in model.named_parameters()},
        compress_fixed=0.0,
        compress_per_element=1e-9,
        serial_cpu=serial_cpu,
    )
    engine.set_plan(engine.plan)
    return model, engine


def auto_offload_run(serial_cpu=0.0):
    _, engine = auto_offload_engine(serial_cpu)
    offloaded = sorted(engine.names[i] for i in engine._offloaded)
    buffers = len(engine.plan.buffers)
    engine.close()
    return offloaded, buffers


def test_offload_auto_offloads_within_one_buffer(pool2):
    for offloaded, buffers in pool2.run(auto_offload_run):
        assert buffers == 1 and offloaded == ["first.bias", "first.weight", "second.bias", "second.weight"], offloaded


def test_offload_auto_offloads_nothing_when_the_worker_takes_the_backwards_core(pool2):
    """The same costs, but a worker thread's CPU work delays the main thread (one core per rank)."""
    for offloaded, buffers in pool2.run(auto_offload_run, 1.0):
        assert buffers == 1 and offloaded == [], offloaded


def launching_threads(serial_cpu: float):
    """The threads that launch each buffer of one round under offload="auto" with the given serial
    CPU share (0: the worker takes every tensor, 1: it takes none)."""
    model, engine = auto_offload_engine(serial_cpu)
    launch = engine.communicator.launch

    def recording(encoded, buffer, channels):
        record("launch", str(buffer.index))
        return launch(encoded, buffer, channels)

    engine.communicator.launch = recording
    one_recorded_round(engine, model)
    return sorted({name for what, _, name in EVENTS if what == "launch"})


def test_launches_go_through_the_worker_only_where_the_plan_offloads(pool2):
    """Behind offloaded pieces a launch must queue on the worker (plan order on the channels);
    with nothing offloaded the main thread launches itself, with no hand-off per buffer."""
    for serial_cpu, thread in ((0.0, "ssfusion-offload_0"), (1.0, "MainThread")):
        for threads in pool2.run(launching_threads, serial_cpu):
            assert threads == [thread], (serial_cpu, threads)


# ----------------------------------------------------------------------------- SAFusion alignment
def test_alignment_pads_a_short_selection_without_a_full_topk(monkeypatch):
    flat = torch.arange(100, dtype=torch.float32) - 50
    values, indices = flat[[3, 90]], torch.tensor([3, 90])

    def refuse(*args, **kwargs):
        raise AssertionError("a full top-k was run")

    monkeypatch.setattr(torch, "topk", refuse)
    v, i = exact_count(values, indices, flat, 5)
    assert i.tolist() == [3, 90, 0, 1, 2]  # the selection, then the first positions it lacks
    assert torch.equal(v, flat[i])  # real values: error feedback stays exact


def test_behind_refuses_a_row_wise_sparsifier():
    ctx = PlanContext(build_sparsifier("adtopk", density=0.01), 1 << 20, 2, 2)
    with pytest.raises(ValueError, match="behind.*adtopk|adtopk.*behind"):
        FUSION_POLICIES.build("behind").plan([], ctx)


# ----------------------------------------------------------------------------- ZEN's choice
def test_zen_chooses_from_the_alpha_beta_model_at_hand_computed_points():
    link = Link(alpha=50e-6, beta=1e-9)
    n, k = 1 << 20, 10_000
    # P = 2, K = 19,900 (nearly disjoint selections), v = x = 4:
    #   zen     = 4 * 50us + 1e-9 * 1/2 * (k * 8 + min(n/8 + 4K, 8K)) = 200us + 119.6us = 319.6us
    #   sparcml = one doubling round: 2 * 50us + 1e-9 * 8 * U(1), U(1) = n (1 - (1 - K/n)^(1/2)) ~ 9,998
    #           = 100us + 80.0us = 180.0us  -> sparcml
    assert zen_or_sparcml(2, n, k, 19_900, 4, link) == "sparcml"
    # P = 16, K = 150,000: zen = 200us + 1e-9 * 15/16 * (80,000 + 131,072 + 600,000) = 960.4us;
    #   sparcml = 4 rounds, 8 * 50us + 1e-9 * 8 * (U(1) + U(2) + U(4) + U(8)) with U(m) = n (1 - (1 - K/n)^(m/16))
    #           ~ 400us + 8e-9 * (10,069 + 20,041 + 39,698 + 77,893) = 400us + 1,181.6us -> zen
    assert zen_or_sparcml(16, n, k, 150_000, 4, link) == "zen"
    # latency-bound, P = 2: zen's 4 rounds (4 ms) against sparcml's one exchange (2 ms)
    assert zen_or_sparcml(2, n, 10, 20, 4, Link(alpha=1e-3, beta=1e-9)) == "sparcml"
    # latency-bound, P = 64, tiny k: zen's 4 rounds against sparcml's 6 doubling rounds (12 messages)
    assert zen_or_sparcml(64, n, 10, 640, 4, Link(alpha=1e-3, beta=1e-9)) == "zen"


def test_zen_counts_one_message_for_sparcml_first_round_when_counts_are_bounded():
    """P = 4, n = 100,000, k = 10,000, K = 39,000 (nearly disjoint), alpha = 1 ms, beta = 1 ns/B:
    zen = 4 ms + 3/4 * (80,000 + min(12,500 + 156,000, 312,000)) ns = 4.186 ms; sparcml moves
    8 * (U(1) + U(2)) = 8 * (11,620 + 21,900) B = 0.268 ms in two doubling rounds: 4 messages
    (4.268 ms, zen wins), or 3 when a rank's own selection travels with its header (3.268 ms)."""
    link = Link(alpha=1e-3, beta=1e-9)
    assert zen_or_sparcml(4, 100_000, 10_000, 39_000, 4, link) == "zen"
    assert zen_or_sparcml(4, 100_000, 10_000, 39_000, 4, link, bounded=True) == "sparcml"


# ----------------------------------------------------------------------------- concurrent process groups
def concurrent_groups_run():
    """Rank 0 blocks group 0 with an all-reduce that rank 1 joins only after a collective on group 1
    completed on both ranks: that needs group 1's channel to run while group 0's is stuck."""
    groups = [dist.new_group(backend="gloo") for _ in range(2)]
    device = torch.device("cpu")
    channels = ChannelSet(groups, device)
    rank = dist.get_rank()

    def allreduce(tensor, group):
        dist.all_reduce(tensor, group=group)
        return tensor

    try:
        if rank == 0:
            blocked = channels[0].submit(allreduce, torch.ones(1))
            second = result(channels[1].submit(allreduce, torch.ones(1)), device, timeout=30)
            first = result(blocked, device, timeout=30)
        else:
            second = result(channels[1].submit(allreduce, torch.ones(1)), device, timeout=30)
            first = result(channels[0].submit(allreduce, torch.ones(1)), device, timeout=30)
    except FutureTimeout:
        return "timed out"
    finally:
        channels.shutdown(wait=False)
    return float(first), float(second)


def test_a_collective_on_group_1_completes_while_group_0_is_blocked(pool2):
    assert pool2.run(concurrent_groups_run) == [(2.0, 2.0), (2.0, 2.0)]
