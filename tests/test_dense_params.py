"""``dense_params``: named tensors sent whole at every step, whatever the fusion policy plans.

A language model's tied embedding loses accuracy when it is sparsified (REPORT, "Dense warm-up,
momentum correction and the LM plateau"); these tests check that the named tensors are summed
exactly, keep no residual, and that every other tensor is still sparsified with error feedback.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import ssfusion_lightning as ssf
from ssfusion_lightning.app.validation import check_strategy
from ssfusion_lightning.comm import COMMUNICATORS, ChannelSet
from ssfusion_lightning.costmodel import CostProfile
from ssfusion_lightning.engine.engine import EngineConfig, FusionEngine, dense_positions
from ssfusion_lightning.fusion import FUSION_POLICIES, PlanContext
from ssfusion_lightning.sparsifiers import build_memory, build_sparsifier
from ssfusion_lightning.vocabulary import ParamSpec
from tests.test_ddp_equivalence import assert_bitwise_equal, run_pair
from tests.test_density import Wide

POLICIES = ["layerwise", "behind", "ahead", "aligned", "adaptive", "selective", "partial"]


# --------------------------------------------------------------------------- the plan
@settings(max_examples=80, deadline=None)
@given(
    policy=st.sampled_from(POLICIES),
    sizes=st.lists(st.one_of(st.integers(1, 64), st.integers(1_000, 40_000)), min_size=1, max_size=16),
    data=st.data(),
)
def test_named_tensors_are_dense_and_both_parts_stay_packed(policy, sizes, data):
    specs = [(i, ParamSpec(f"p{i}", (n,), torch.float32)) for i, n in enumerate(sizes)]
    ctx = PlanContext(build_sparsifier("topk", density=0.01), 32 * 1024, 2, 4, CostProfile(world_size=4))
    planned = FUSION_POLICIES.build(policy).plan(specs, ctx)
    whole = frozenset(data.draw(st.sets(st.sampled_from(range(len(sizes))))))
    plan = planned.sending_dense(whole)
    assert [[s.param for s in b.slots] for b in plan.buffers] == [[s.param for s in b.slots] for b in planned.buffers]
    for before, after in zip(planned.buffers, plan.buffers):
        for old, new in zip(before.slots, after.slots):
            if new.param in whole:
                assert not new.sparse and new.k == new.numel
            else:  # everything else as the policy planned it
                assert (new.sparse, new.k) == (old.sparse, old.k)
        for part in (after.dense_slots, after.sparse_slots):
            offsets = [s.offset for s in part]
            assert offsets == [sum(s.numel for s in part[:j]) for j in range(len(part))]
    assert plan.sending_dense(range(len(sizes))).buffers == tuple(b.densified() for b in planned.buffers)


def test_patterns_match_names_and_a_pattern_that_matches_nothing_is_refused():
    names = ["embed.weight", "blocks.0.norm.weight", "blocks.0.norm.bias", "blocks.0.fc.weight", "head.bias"]
    assert dense_positions(names, ["embed.*", "*.bias"]) == {0, 2, 4}
    assert dense_positions(names, []) == frozenset()
    with pytest.raises(ValueError, match=r"pattern '\*embedding\*' matches no parameter name; the names are: embed.weight"):
        dense_positions(names, ["*embed*", "*embedding*"])


def test_the_strategy_and_the_config_check_the_patterns():
    assert ssf.SSFusionStrategy(dense_params="*bias").dense_params == ("*bias",)
    assert ssf.SSFusionStrategy(dense_params=["a", "b*"]).dense_params == ("a", "b*")
    for bad in ([""], [3], 5):
        with pytest.raises(ValueError, match="dense_params must be a list"):
            ssf.SSFusionStrategy(dense_params=bad)
    base = {"kind": "ssfusion", "name": "x"}
    check_strategy({**base, "dense_params": ["*embed*"]})
    with pytest.raises(ValueError, match="dense_params"):
        check_strategy({**base, "dense_params": "*embed*"})


# --------------------------------------------------------------------------- every tensor named: DDP, bit for bit
ALL_DENSE = dict(sparsifier="topk", density=0.01, comm="hybrid", offload="none", process_groups=1, dense_params=["*"])


def all_named_runs():
    return [run_pair("plain", "ddp", dict(ALL_DENSE, fusion=fusion, buffer_mb=0.001)) for fusion in ("selective", "behind")]


def test_top_k_with_every_tensor_named_dense_equals_ddp(pool2):
    for pair in zip(*pool2.run(all_named_runs)):
        assert_bitwise_equal(pair)


# --------------------------------------------------------------------------- some tensors named, on 2 ranks
NAMED = ("head.*", "fc2.bias")


def mixed_run(fusion: str, comm: str):
    torch.manual_seed(0)
    model = Wide()
    groups = [dist.new_group(backend="gloo") for _ in range(2)]
    memory = build_memory("residual")
    engine = FusionEngine(
        list(model.named_parameters()),
        build_sparsifier("topk", density=0.02),
        memory,
        FUSION_POLICIES.build(fusion),
        COMMUNICATORS.build(comm),
        ChannelSet(groups, torch.device("cpu")),
        EngineConfig(buffer_bytes=64 * 1024, dense_params=NAMED, profile_steps=2),
    )
    engine.attach()
    world = dist.get_world_size()
    rounds = []
    for step in range(5):
        model.zero_grad(set_to_none=True)
        g = torch.Generator().manual_seed(100 * step + dist.get_rank())
        model(torch.randn(16, 64, generator=g)).pow(2).sum().backward()
        local = {n: p.grad.clone() for n, p in model.named_parameters()}
        before = {n: _residual(memory, n, p) for n, p in model.named_parameters()}
        engine.finish()
        written = {n: p.grad.clone() for n, p in model.named_parameters()}
        after = {n: _residual(memory, n, p) for n, p in model.named_parameters()}
        # what the ranks had to send (gradient plus residual), summed on the default group
        owed = {n: local[n] + before[n] for n in local}
        for tensor in owed.values():
            dist.all_reduce(tensor)
        kept = {n: t.clone() for n, t in after.items()}
        for tensor in kept.values():
            dist.all_reduce(tensor)
        sparse = {s.name for b in engine.plan.buffers for s in b.sparse_slots}
        rounds.append((written, owed, kept, after, sparse, world))
    engine.close()
    return rounds


def _residual(memory, name: str, param: nn.Parameter) -> torch.Tensor:
    residual = memory.residual(name)
    return torch.zeros_like(param) if residual is None else residual.detach().clone().view_as(param)


@pytest.mark.parametrize(("fusion", "comm"), [("selective", "hybrid"), ("behind", "allgather"), ("ahead", "zen")])
def test_named_tensors_are_summed_exactly_and_the_rest_conserves_its_mass(pool2, fusion, comm):
    ranks = pool2.run(mixed_run, fusion, comm)
    for written, owed, kept, after, sparse, world in ranks[0]:
        assert sparse and not {n for n in sparse if n.startswith("head.") or n == "fc2.bias"}
        for name in written:
            if name.startswith("head.") or name == "fc2.bias":
                assert torch.equal(written[name], owed[name] / world), name
                assert not after[name].any(), f"{name} kept a residual"
            else:  # every element owed is either applied (P x the mean) or kept by some rank
                torch.testing.assert_close(written[name] * world + kept[name], owed[name], rtol=1e-5, atol=1e-5)
                if name in sparse:
                    assert (written[name] != 0).float().mean() < 0.2, f"{name} was not sparsified"
    for r0, r1 in zip(*ranks):
        for name in r0[0]:
            assert torch.equal(r0[0][name], r1[0][name]), f"{name} differs across ranks"
