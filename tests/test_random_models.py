"""Hypothesis-generated models on 2 ranks: no hang, identical ranks, the gradient the drawn policy x
collective must write (rebuilt from what each rank sent), and DDP's result when dense."""

from __future__ import annotations

import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from ssfusion_lightning.comm import COMMUNICATORS, ChannelSet
from ssfusion_lightning.engine.engine import EngineConfig, FusionEngine
from ssfusion_lightning.fusion import FUSION_POLICIES
from ssfusion_lightning.sparsifiers import build_memory, build_sparsifier
from tests.test_fusion_policies import expected_gradients

POLICIES = ["layerwise", "behind", "ahead", "aligned", "adaptive", "selective", "partial"]
COMMS = ["allreduce", "allgather", "hybrid", "zen", "sparcml", "oktopk"]

specs = st.fixed_dictionaries(
    {
        "widths": st.lists(st.integers(1, 12), min_size=2, max_size=5),
        "frozen": st.one_of(st.none(), st.integers(0, 3)),
        "unused_on": st.sampled_from(["none", "rank1", "all"]),
        "reuse": st.booleans(),
        "tied": st.booleans(),
        "seed": st.integers(0, 2**16),
    }
)


class RandomNet(nn.Module):
    def __init__(self, spec: dict) -> None:
        super().__init__()
        widths = spec["widths"]
        self.spec = spec
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(widths, widths[1:]))
        last = widths[-1]
        self.square = nn.Linear(last, last)
        self.side = nn.Linear(widths[0], last)
        self.tied_out = nn.Linear(last, last, bias=False)
        if spec["tied"]:
            self.tied_out.weight = self.square.weight
        if spec["frozen"] is not None and spec["frozen"] < len(self.layers):
            self.layers[spec["frozen"]].requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        for layer in self.layers:
            h = torch.tanh(layer(h))
        h = self.square(h)
        if self.spec["reuse"]:
            h = self.square(torch.tanh(h))
        unused = self.spec["unused_on"] == "all" or (self.spec["unused_on"] == "rank1" and dist.get_rank() == 1)
        if not unused:
            h = h + self.side(x)
        return self.tied_out(h).pow(2).mean()


def _clone(tensor: torch.Tensor | None) -> torch.Tensor | None:
    return None if tensor is None else tensor.detach().clone()


def record_launches(engine: FusionEngine, rounds: list[dict]) -> None:
    """Wrap ``engine.communicator.launch``: per round, what this rank sends for every buffer
    [buffer, dense part, values, indices, applied], cloned before the collective can touch it, and
    the sparse-part positions the collective reports as applied globally (Ok-Topk; None: all)."""
    launch = engine.communicator.launch

    def recording(encoded, buffer, channels):
        record = [buffer, _clone(encoded.dense), _clone(encoded.values), _clone(encoded.indices), None]
        rounds[-1]["sent"].append(record)
        pending = launch(encoded, buffer, channels)
        wait = pending.wait

        def waiting(timeout=None):
            reduced = wait(timeout)
            record[4] = _clone(reduced.applied)
            return reduced

        pending.wait = waiting
        return pending

    engine.communicator.launch = recording


def train(spec: dict, fusion: str, comm: str, sparsifier: str, use_ddp: bool, steps: int = 3, record: bool = False):
    """The parameters after ``steps`` SGD steps; with ``record``, also every round's sends and the
    gradients the engine wrote (None where it wrote none)."""
    torch.manual_seed(spec["seed"])
    model = RandomNet(spec).double()
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    optimizer = torch.optim.SGD([p for _, p in named], lr=0.1)
    if use_ddp:
        runner = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
        engine = None
    else:
        runner = model
        groups = [dist.new_group(backend="gloo") for _ in range(2)]
        engine = FusionEngine(
            named,
            build_sparsifier(sparsifier, density=0.3),
            build_memory("residual"),
            FUSION_POLICIES.build(fusion),
            COMMUNICATORS.build(comm),
            ChannelSet(groups, torch.device("cpu")),
            EngineConfig(buffer_bytes=256, find_unused_parameters=True, profile_steps=1),
        )
        engine.attach()
    rounds: list[dict] = []
    if record:
        record_launches(engine, rounds)
    g = torch.Generator().manual_seed(spec["seed"] + 7 * dist.get_rank())
    for _ in range(steps):
        rounds.append({"sent": []})
        optimizer.zero_grad(set_to_none=True)
        runner(torch.randn(4, spec["widths"][0], generator=g, dtype=torch.float64)).backward()
        if engine is not None:
            engine.finish()
        if record:
            rounds[-1]["grads"] = {n: _clone(p.grad) for n, p in named}
        optimizer.step()
    if engine is not None:
        engine.close()
        for group in groups:
            dist.destroy_process_group(group)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return (params, rounds) if record else params


def robustness_run(spec: dict, fusion: str, comm: str):
    return (
        train(spec, fusion, comm, "topk", False, record=True),
        train(spec, "ahead", "allreduce", "none", False),
        train(spec, "", "", "", True),
    )


def reference_gradients(per_rank_sent: list[list[list]]) -> dict[str, torch.Tensor]:
    """What every rank must write for one round: the sum of every rank's dense part and of every
    rank's sparse selection; where the collective applies only some positions (Ok-Topk's global
    top-k), the sum at those positions and zero elsewhere, after checking that they are a magnitude
    cut of the sum (every applied |sum| >= every |sum| sent but not applied)."""
    expected = expected_gradients([[record[:4] for record in sent] for sent in per_rank_sent], len(per_rank_sent))
    for records in zip(*per_rank_sent):
        buffer, applied = records[0][0], records[0][4]
        assert all(r[0] == buffer for r in records), "ranks launched different buffers"
        if applied is None:
            continue
        assert all(torch.equal(r[4], applied) for r in records), "ranks applied different positions"
        summed = torch.zeros(buffer.sparse_numel, dtype=torch.float64)
        sent = torch.zeros(buffer.sparse_numel, dtype=torch.bool)
        for _, _, values, indices, _ in records:
            if values is not None:
                summed.index_add_(0, indices, values)
                sent[indices] = True
        kept = torch.zeros_like(sent)
        kept[applied] = True
        assert not (kept & ~sent).any(), "applied a position no rank sent"
        left_out = sent & ~kept
        if kept.any() and left_out.any():
            assert summed[kept].abs().min() >= summed[left_out].abs().max() - 1e-12, "applied set is not a top-|sum| cut"
        summed[~kept] = 0
        for slot in buffer.sparse_slots:
            expected[slot.name] = summed[slot.offset : slot.offset + slot.numel].view(slot.shape)
    return expected


def assert_reference_gradients(label: str, per_rank_rounds: list[list[dict]]) -> None:
    for step, rounds in enumerate(zip(*per_rank_rounds)):
        expected = reference_gradients([r["sent"] for r in rounds])
        for rank, written in enumerate(r["grads"] for r in rounds):
            assert set(written) == set(expected), f"{label} step {step}: the plan left a parameter out"
            for name, grad in written.items():
                if grad is None:  # no rank used it: the engine leaves .grad alone, and nothing was summed
                    assert not expected[name].any(), f"{label} step {step} rank {rank}: {name} not written"
                    continue
                assert torch.allclose(grad, expected[name], rtol=0, atol=1e-12), f"{label} step {step} rank {rank}: {name}"


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(spec=specs, fusion=st.sampled_from(POLICIES), comm=st.sampled_from(COMMS))
def test_random_models_stay_identical_and_dense_equals_ddp(pool2, spec, fusion, comm):
    ((sparse0, rounds0), dense0, ddp0), ((sparse1, rounds1), dense1, ddp1) = pool2.run(
        robustness_run, spec, fusion, comm, timeout=120
    )
    assert_reference_gradients(f"{fusion}/{comm}", [rounds0, rounds1])
    for name in sparse0:
        assert torch.equal(sparse0[name], sparse1[name]), f"{fusion}/{comm}: {name} differs across ranks"
        assert torch.equal(dense0[name], dense1[name])
        assert torch.equal(dense0[name], ddp0[name]), f"{name}: dense engine differs from DDP"
