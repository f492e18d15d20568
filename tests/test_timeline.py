"""The engine's timeline: its spans are well-formed and ordered as the data path orders them, and
communication of the first buffer starts while backward still runs. Every assertion is about the
order of recorded events, none about how long anything took."""

from __future__ import annotations

import pickle
import time
from collections import defaultdict

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch._C._profiler import _ExperimentalConfig
from torch.profiler import ProfilerActivity, profile
from torch.utils.data import DataLoader

import ssfusion_lightning as ssf
from ssfusion_lightning.comm import COMMUNICATORS, ChannelSet
from ssfusion_lightning.engine.engine import EngineConfig, FusionEngine
from ssfusion_lightning.fusion import FUSION_POLICIES
from ssfusion_lightning.sparsifiers import build_memory, build_sparsifier
from ssfusion_lightning.timeline import MARKS, PHASES, Event, Timeline, chrome_trace
from tests.workloads import Regressor, make_trainer, regression_data

BUFFER_PHASES = ("select", "pack", "launch", "comm", "wait", "write")


class SlowInputGradient(torch.autograd.Function):
    """Identity whose backward sleeps: the input layer's gradient, the last one of the backward,
    comes late, as behind a real network's early layers. The sleep gives the channel threads the
    interpreter; the assertions stay about order."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        time.sleep(0.02)
        return grad


class Deep(nn.Module):
    """Six 32x32 layers: one or two per 6 KB buffer, so the plan has several buffers."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(32, 32) for _ in range(6))

    def forward(self, x):
        x = self.layers[0](x)
        x = SlowInputGradient.apply(x)
        for layer in self.layers[1:]:
            x = torch.tanh(layer(x))
        return x


def build_engine(model, fusion, offload="none", timeline=None):
    groups = [dist.new_group(backend="gloo") for _ in range(2)]
    return FusionEngine(
        list(model.named_parameters()),
        build_sparsifier("topk", density=0.1),
        build_memory("residual"),
        FUSION_POLICIES.build(fusion),
        COMMUNICATORS.build("hybrid"),
        ChannelSet(groups, torch.device("cpu")),
        EngineConfig(buffer_bytes=6 * 1024, first_buffer_bytes=2 * 1024, offload=offload, profile_steps=2),
        timeline=timeline,
    )


def train(engine, model, rounds):
    engine.attach()
    for step in range(rounds):
        model.zero_grad(set_to_none=True)
        g = torch.Generator().manual_seed(step * 10 + dist.get_rank())
        engine.begin_backward()
        model(torch.randn(16, 32, generator=g)).pow(2).sum().backward()
        engine.finish()
    engine.close()


ROUNDS = 5


def recorded_run(configs):
    """Per config: the plan's buffer count and the timeline's events (recording on from the start)."""
    out = {}
    for fusion, offload in configs:
        torch.manual_seed(0)
        model = Deep()
        engine = build_engine(model, fusion, offload, Timeline(enabled=True))
        train(engine, model, ROUNDS)
        out[(fusion, offload)] = (len(engine.plan.buffers), engine.timeline.events())
    return out


def unrecorded_run():
    torch.manual_seed(0)
    model = Deep()
    engine = build_engine(model, "selective")
    train(engine, model, 2)
    return engine.timeline.enabled, engine.timeline.events(), len(engine.timeline._events)


CONFIGS = [("selective", "none"), ("selective", "thread"), ("behind", "none")]


@pytest.fixture(scope="module")
def recorded(rank_pools):
    return rank_pools(2).run(recorded_run, CONFIGS)


def by_phase(events: list[Event]) -> dict[tuple[str, int | None], list[Event]]:
    grouped: dict[tuple[str, int | None], list[Event]] = defaultdict(list)
    for event in events:
        grouped[(event.name, event.buffer)].append(event)
    return grouped


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "-".join(c))
def test_spans_are_well_formed_and_belong_to_their_rank_and_round(recorded, config):
    for rank, per_config in enumerate(recorded):
        buffers, events = per_config[config]
        assert buffers >= 3, f"the test wants a plan of several buffers, got {buffers}"
        assert {e.step for e in events} == set(range(ROUNDS))
        for event in events:
            assert event.rank == rank
            assert event.name in PHASES + MARKS, event
            assert event.end_ns >= event.start_ns, event
            if event.name not in BUFFER_PHASES:
                assert event.buffer is None, event  # marks and control collectives belong to no buffer
        for step in range(ROUNDS):
            round_events = [e for e in events if e.step == step]
            assert [e.name for e in round_events if e.is_mark] == ["backward.begin", "backward.end"], step
            # every buffer of the round's plan launched once, and every span names one of them
            launched = [e.buffer for e in round_events if e.name == "launch"]
            assert launched == list(range(len(launched))), (step, launched)
            assert {e.buffer for e in round_events if e.name in BUFFER_PHASES} == set(launched)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "-".join(c))
def test_every_buffer_follows_the_data_path_in_order(recorded, config):
    for per_config in recorded:
        buffers, events = per_config[config]
        step = ROUNDS - 1  # a steady round: the plan was rebuilt after round 0 and after profiling
        phases = by_phase([e for e in events if e.step == step])
        for b in range(buffers):
            (launch,) = phases[("launch", b)]
            comms = phases[("comm", b)]
            (wait,) = phases[("wait", b)]
            (write,) = phases[("write", b)]
            selects = phases[("select", b)]
            assert comms and selects, (config, b, sorted(phases))
            # selection ends before the buffer's message is packed (per-tensor: its last pack span,
            # after the one that copies its dense tensors in) or launched (whole buffer)
            packed = phases[("pack", b)][-1].start_ns if config[0] != "behind" else launch.start_ns
            assert all(s.end_ns <= packed for s in selects)
            # the collectives are submitted inside the launch, and end before the wait returns
            assert all(launch.start_ns <= c.start_ns and c.end_ns <= wait.end_ns for c in comms)
            assert wait.end_ns <= write.start_ns
            if b > 0:  # buffers launch in plan order
                assert phases[("launch", b - 1)][0].start_ns <= launch.start_ns


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "-".join(c))
def test_communication_of_buffer_0_starts_before_backward_ends(recorded, config):
    for per_config in recorded:
        buffers, events = per_config[config]
        for step in range(1, ROUNDS):  # round 0 runs DDP's registration-order guess
            phases = by_phase([e for e in events if e.step == step])
            (end,) = phases[("backward.end", None)]
            first_comm = min(c.start_ns for c in phases[("comm", 0)])
            assert first_comm < end.start_ns, (config, step)
            # the last buffer holds the input layer, whose gradient is the last one of the backward
            last_launch = phases[("launch", buffers - 1)][0]
            assert first_comm < last_launch.start_ns


def test_recording_is_off_by_default_and_keeps_nothing(pool2):
    for enabled, events, stored in pool2.run(unrecorded_run):
        assert (enabled, events, stored) == (False, [], 0)


def test_chrome_trace_has_one_process_per_rank_and_one_track_per_thread(recorded):
    events = [e for per_config in recorded for e in per_config[("selective", "thread")][1] if e.step == ROUNDS - 1]
    trace = chrome_trace(events)["traceEvents"]
    spans = [t for t in trace if t["ph"] == "X"]
    assert len(spans) == sum(not e.is_mark for e in events)
    assert {t["pid"] for t in spans} == {0, 1}
    threads = {(t["pid"], t["args"]["name"]) for t in trace if t["name"] == "thread_name"}
    assert {name.split("_")[0] for _, name in threads} >= {"MainThread", "ssfusion-comm0", "ssfusion-offload"}
    assert any(t["name"] == "ssfusion.comm[0]" for t in spans)
    assert sum(t["ph"] == "i" for t in trace) == 4  # backward begin and end on each rank


def test_timeline_pickles_with_its_events():
    timeline = Timeline(enabled=True, rank=3)
    with timeline.span("select", 0, "fc.weight"):
        pass
    clone = pickle.loads(pickle.dumps(timeline))
    assert clone.events() == timeline.events() and clone.events()[0].detail == "fc.weight"
    with clone.span("comm", 1):
        pass
    assert [e.name for e in clone.events()] == ["select", "comm"]


# ---------------------------------------------------------------- torch.profiler and Lightning
def profiled_fit_run():
    strategy = ssf.SSFusionStrategy(
        sparsifier="topk", density=0.1, fusion="ahead", comm="hybrid", offload="none", timeline=True
    )
    trainer = make_trainer(strategy, 3)
    # worker threads' ranges reach the trace only when the profiler profiles every thread
    config = _ExperimentalConfig(profile_all_threads=True)
    with profile(activities=[ProfilerActivity.CPU], experimental_config=config) as prof:
        trainer.fit(Regressor(), DataLoader(regression_data(), batch_size=16))
    names = {e.name for e in prof.events() if e.name.startswith("ssfusion.")}
    return names, strategy.timeline.events()


def test_torch_profiler_and_the_strategy_timeline_see_the_phases(pool2):
    for names, events in pool2.run(profiled_fit_run):
        assert {"ssfusion.select[0]", "ssfusion.pack[0]", "ssfusion.launch[0]", "ssfusion.comm[0]"} <= names
        assert {"ssfusion.wait[0]", "ssfusion.write[0]", "ssfusion.control"} <= names
        # recording outlives the engine (torn down after fit): three rounds, each with its marks
        assert sorted(e.step for e in events if e.name == "backward.end") == [0, 1, 2]
        assert {e.name for e in events} >= {"select", "pack", "launch", "comm", "wait", "write"}
