"""Hypothesis-generated models on 2 ranks: no hang, identical ranks, and DDP's result when dense."""

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


def train(spec: dict, fusion: str, comm: str, sparsifier: str, use_ddp: bool, steps: int = 3):
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
    g = torch.Generator().manual_seed(spec["seed"] + 7 * dist.get_rank())
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        runner(torch.randn(4, spec["widths"][0], generator=g, dtype=torch.float64)).backward()
        if engine is not None:
            engine.finish()
        optimizer.step()
    if engine is not None:
        engine.close()
        for group in groups:
            dist.destroy_process_group(group)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def robustness_run(spec: dict, fusion: str, comm: str):
    return train(spec, fusion, comm, "topk", False), train(spec, "ahead", "allreduce", "none", False), train(spec, "", "", "", True)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(spec=specs, fusion=st.sampled_from(POLICIES), comm=st.sampled_from(COMMS))
def test_random_models_stay_identical_and_dense_equals_ddp(pool2, spec, fusion, comm):
    (sparse0, dense0, ddp0), (sparse1, dense1, ddp1) = pool2.run(robustness_run, spec, fusion, comm, timeout=120)
    for name in sparse0:
        assert torch.equal(sparse0[name], sparse1[name]), f"{fusion}/{comm}: {name} differs across ranks"
        assert torch.equal(dense0[name], dense1[name])
        assert torch.equal(dense0[name], ddp0[name]), f"{name}: dense engine differs from DDP"
