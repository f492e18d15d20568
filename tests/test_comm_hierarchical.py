"""comm="hierarchical": the node layout, exact sums on 4 gloo ranks as 2 nodes x 2 ranks against a
flat sum, Ok-Topk as the cross-node step, and training through the strategy."""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

import ssfusion_lightning as ssf
from ssfusion_lightning.comm import COMMUNICATORS
from ssfusion_lightning.comm.hierarchical import hierarchical_dense_sum, hierarchical_sparse_sum
from ssfusion_lightning.comm.oktopk import OkTopkState
from ssfusion_lightning.comm.topology import create_hierarchy, node_layout
from ssfusion_lightning.comm.traffic import Traffic
from tests.workloads import Regressor, make_trainer, regression_data

NUMEL = 1001  # not a multiple of the ranks per node: the last stripe is padded


def test_node_layout_is_node_major():
    local, cross = node_layout(8, 4)
    assert local == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert cross == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert node_layout(4, 1) == ([[0], [1], [2], [3]], [[0, 1, 2, 3]])
    assert node_layout(4, 4) == ([[0, 1, 2, 3]], [[0], [1], [2], [3]])


@pytest.mark.parametrize("bad", [3, 0, True, "2"])
def test_a_layout_that_does_not_fit_is_refused_naming_the_value(bad):
    with pytest.raises(ValueError, match=f"ranks_per_node.*{bad!r}|ranks_per_node={bad!r}.*valid choices here: 1, 2, 4, 8"):
        node_layout(8, bad)


def test_bad_options_name_the_value_and_the_choices():
    with pytest.raises(ValueError, match="unknown cross 'ring'; valid choices: allreduce, allgather, zen, sparcml, oktopk"):
        COMMUNICATORS.build("hierarchical", cross="ring")
    with pytest.raises(ValueError, match="ranks_per_node must be an integer >= 1 or None.*-2"):
        ssf.SSFusionStrategy(comm="hierarchical", ranks_per_node=-2)


def rank_selection(rank: int, numel: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s distinct positions and integer values (exact in fp32 whatever the order)."""
    g = torch.Generator().manual_seed(100 + rank)
    indices = torch.randperm(numel, generator=g)[:count]
    values = torch.randint(-50, 50, (count,), generator=g).float()
    return values, indices


def flat_sum(world: int, numel: int, count: int) -> torch.Tensor:
    total = torch.zeros(numel)
    for rank in range(world):
        values, indices = rank_selection(rank, numel, count)
        total[indices] += values
    return total


def run_sums(ranks_per_node: int, crosses: list[str]) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    hierarchy = create_hierarchy(rank, world, ranks_per_node, "gloo", None)
    out = {}
    g = torch.Generator().manual_seed(7 + rank)
    dense = torch.randint(-1000, 1000, (NUMEL,), generator=g).float()
    reference = dense.clone()
    dist.all_reduce(reference)
    out["dense"] = (hierarchical_dense_sum(dense.clone(), hierarchy, Traffic()), reference)
    for cross in crosses:
        values, indices = rank_selection(rank, NUMEL, 60)
        total, applied = hierarchical_sparse_sum(values, indices, NUMEL, hierarchy, cross, Traffic(), k=60, state=OkTopkState())
        out[cross] = (total, applied)
    for group in {hierarchy.local, hierarchy.cross}:
        dist.destroy_process_group(group)
    return out


@pytest.mark.parametrize("ranks_per_node", [2, 1, 4])
def test_hierarchical_sums_are_exact_on_4_ranks(pool4, ranks_per_node):
    exact = ["allreduce", "allgather", "zen", "sparcml"]
    results = pool4.run(run_sums, ranks_per_node, exact)
    expected = flat_sum(4, NUMEL, 60)
    for rank, result in enumerate(results):
        total, reference = result["dense"]
        assert torch.equal(total, reference), f"rank {rank}: dense part differs from the flat all-reduce"
        for cross in exact:
            total, applied = result[cross]
            assert applied is None
            assert torch.equal(total, expected), f"rank {rank}, cross {cross}: not the flat sum"


def test_oktopk_across_nodes_keeps_about_k_entries_and_reports_them(pool4):
    results = pool4.run(run_sums, 2, ["oktopk"])
    expected = flat_sum(4, NUMEL, 60)
    first_total, first_applied = results[0]["oktopk"]
    for rank, result in enumerate(results):
        total, applied = result["oktopk"]
        assert torch.equal(total, first_total) and torch.equal(applied, first_applied), f"rank {rank} differs from rank 0"
    # each of the 2 stripes keeps its share of k = 60 (30, within Ok-Topk's [k/2, 2k] band)
    assert 30 <= first_applied.numel() <= 2 * 60
    assert torch.equal(first_total[first_applied], expected[first_applied])  # kept entries are exact sums
    outside = torch.ones(NUMEL, dtype=torch.bool)
    outside[first_applied] = False
    assert not first_total[outside].any()


def train_hierarchical(comm: str, sparsifier: str, comm_options: dict, steps: int = 6) -> dict:
    L.seed_everything(0, verbose=False)
    model = Regressor()
    strategy = ssf.SSFusionStrategy(
        sparsifier=sparsifier, density=0.1, fusion="ahead", comm=comm, comm_options=comm_options,
        ranks_per_node=2, offload="none", buffer_mb=0.002,
    )
    make_trainer(strategy, steps).fit(model, DataLoader(regression_data(), batch_size=16))
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_dense_training_matches_the_flat_allreduce(pool4):
    hierarchical = pool4.run(train_hierarchical, "hierarchical", "none", {})
    flat = pool4.run(train_hierarchical, "allreduce", "none", {})
    for rank in range(4):
        for name, value in hierarchical[rank].items():
            assert torch.equal(value, hierarchical[0][name]), f"rank {rank}: {name} differs from rank 0"
            # fp32 sums in another order: equal up to rounding
            torch.testing.assert_close(value, flat[rank][name], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("cross", ["zen", "oktopk"])
def test_sparse_training_keeps_every_rank_identical(pool4, cross):
    results = pool4.run(train_hierarchical, "hierarchical", "topk", {"cross": cross})
    for rank, params in enumerate(results):
        for name, value in params.items():
            assert torch.equal(value, results[0][name]), f"rank {rank}: {name} differs from rank 0"


def test_the_command_line_builds_a_hierarchical_strategy():
    from ssfusion_lightning.app.builders import build_strategy
    from ssfusion_lightning.app.config import compose_config

    cfg = compose_config(["strategy=ssfusion", "comm=hierarchical", "comm.options.cross=zen", "strategy.ranks_per_node=2"])
    strategy = build_strategy(cfg)
    assert (strategy.comm_name, strategy.comm_options, strategy.ranks_per_node) == ("hierarchical", {"cross": "zen"}, 2)
    assert build_strategy(compose_config(["strategy=ssfusion"])).comm_name == "auto"
