"""comm="hierarchical": the node layout, exact sums on 4 gloo ranks as 2 nodes x 2 ranks against a
flat sum under both node steps, Ok-Topk as the cross-node step, the node step's choice and bytes,
and training through the strategy."""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

import ssfusion_lightning as ssf
from ssfusion_lightning.comm import COMMUNICATORS
from ssfusion_lightning.comm.hierarchical import CROSS_SCHEMES, hierarchical_dense_sum, hierarchical_sparse_sum
from ssfusion_lightning.comm.oktopk import OkTopkState
from ssfusion_lightning.comm.topology import Hierarchy, create_hierarchy, node_layout
from ssfusion_lightning.comm.traffic import Traffic
from ssfusion_lightning.commcost import (
    EXACT_SCHEMES,
    NODE_STEPS,
    RELAY,
    BufferShape,
    choose_node_step,
    node_step_collectives,
)
from ssfusion_lightning.vocabulary import Buffer, Slot
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
    with pytest.raises(ValueError, match="unknown node 'stripes'; valid choices: auto, dense, sparse"):
        COMMUNICATORS.build("hierarchical", node="stripes")
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


#: the node steps that sum inside the node (relay forms no sums: it serves cross allgather only)
SUMMING_STEPS = tuple(step for step in NODE_STEPS if step != RELAY)


def crosses_of(node: str) -> list[str]:
    """The exact cross-node schemes that run under node step ``node``."""
    return ["allgather"] if node == RELAY else list(EXACT_SCHEMES)


def run_sums(ranks_per_node: int, crosses: list[str], node: str = "dense") -> dict:
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
        total, applied = hierarchical_sparse_sum(
            values, indices, NUMEL, hierarchy, cross, Traffic(), k=60, state=OkTopkState(), node=node
        )
        out[cross] = (total, applied)
    for group in {hierarchy.local, hierarchy.cross}:
        dist.destroy_process_group(group)
    return out


@pytest.mark.parametrize("node", NODE_STEPS)
@pytest.mark.parametrize("ranks_per_node", [2, 1, 4])
def test_hierarchical_sums_are_exact_on_4_ranks(pool4, ranks_per_node, node):
    exact = crosses_of(node)
    results = pool4.run(run_sums, ranks_per_node, exact, node)
    expected = flat_sum(4, NUMEL, 60)
    for rank, result in enumerate(results):
        total, reference = result["dense"]
        assert torch.equal(total, reference), f"rank {rank}: dense part differs from the flat all-reduce"
        for cross in exact:
            total, applied = result[cross]
            assert applied is None
            assert torch.equal(total, expected), f"rank {rank}, cross {cross}: not the flat sum"


@pytest.mark.parametrize("node", SUMMING_STEPS)
def test_oktopk_across_nodes_keeps_about_k_entries_and_reports_them(pool4, node):
    results = pool4.run(run_sums, 2, ["oktopk"], node)
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
    if node == "sparse":  # the same node sums reach Ok-Topk: the same entries kept, and reported
        dense_total, dense_applied = pool4.run(run_sums, 2, ["oktopk"], "dense")[0]["oktopk"]
        assert torch.equal(first_total, dense_total) and torch.equal(first_applied, dense_applied)


def positions(seed: int) -> torch.Tensor:
    return torch.randperm(NUMEL, generator=torch.Generator().manual_seed(300 + seed))[:60]


def random_values(rank: int) -> torch.Tensor:
    return torch.randn(60, generator=torch.Generator().manual_seed(400 + rank))


def first_256_then_ones(rank: int) -> torch.Tensor:
    return torch.full((60,), 256.0 if rank == 0 else 1.0)


def run_float_sums(dtype: torch.dtype, values_of, shared_positions: bool) -> dict:
    """Every exact cross scheme under both node steps on 2 nodes x 2 ranks: ``values_of(rank)`` at
    60 positions of NUMEL, each rank's own or (``shared_positions``) the same for all."""
    rank, world = dist.get_rank(), dist.get_world_size()
    hierarchy = create_hierarchy(rank, world, 2, "gloo", None)
    indices = positions(0 if shared_positions else rank)
    values = values_of(rank).to(dtype)
    out = {}
    for node in NODE_STEPS:
        for cross in crosses_of(node):
            out[node, cross] = hierarchical_sparse_sum(values, indices, NUMEL, hierarchy, cross, Traffic(), node=node)[0]
    for group in {hierarchy.local, hierarchy.cross}:
        dist.destroy_process_group(group)
    return out


def bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(torch.int16 if tensor.element_size() == 2 else torch.int32)


def test_fp32_sums_are_bitwise_identical_on_every_rank(pool4):
    results = pool4.run(run_float_sums, torch.float32, random_values, False)
    expected = torch.zeros(NUMEL, dtype=torch.float64)
    for rank in range(4):
        expected[positions(rank)] += random_values(rank).double()
    for key, total in results[0].items():
        torch.testing.assert_close(total.double(), expected, rtol=1e-6, atol=1e-6)
        for rank, result in enumerate(results):
            assert torch.equal(bits(result[key]), bits(total)), f"rank {rank}, node/cross {key}: not rank 0's bits"


def test_low_precision_partial_sums_are_not_rounded_before_crossing_nodes(pool4):
    # every rank sends the same 60 positions: 256 + 1 + 1 + 1 = 259, which bf16 rounds once to 260
    # (its spacing at 256 is 2, ties to even); node sums rounded to bf16 first (256 + 1 -> 256, and
    # 1 + 1 = 2) would cross nodes as 256 and 2 and end at 258
    results = pool4.run(run_float_sums, torch.bfloat16, first_256_then_ones, True)
    for rank, result in enumerate(results):
        for key, total in result.items():
            assert total.dtype == torch.bfloat16
            assert set(total.unique().tolist()) == {0.0, 260.0}, f"rank {rank}, node/cross {key}"
            assert int(total.count_nonzero()) == 60


# --------------------------------------------------------------------------- the node step's bytes and choice
TRAFFIC_NUMEL, TRAFFIC_K = 20_000, 200  # 1% density


def run_node_traffic(node: str, max_count: int | None, ranks_per_node: int = 4) -> tuple[int, torch.Tensor, int]:
    """(bytes sent, sum, padded bytes sent) of one sparse part with a cross allgather; with all 4
    ranks in one node (the default) every byte counted is on the node link."""
    rank, world = dist.get_rank(), dist.get_world_size()
    hierarchy = create_hierarchy(rank, world, ranks_per_node, "gloo", None)
    values, indices = rank_selection(rank, TRAFFIC_NUMEL, TRAFFIC_K)
    traffic = Traffic()
    total, applied = hierarchical_sparse_sum(
        values, indices, TRAFFIC_NUMEL, hierarchy, "allgather", traffic, node=node, max_count=max_count
    )
    assert applied is None
    for group in {hierarchy.local, hierarchy.cross}:
        dist.destroy_process_group(group)
    return traffic.sent, total, traffic.padded_sent


def test_the_sparse_node_step_sends_k_pairs_not_n_values(pool4):
    # 4 ranks in one node, N = 20,000 (stripes of 5,000), k = 200, fp32 values, int32 positions.
    # dense: reduce-scatter and all-gather, each 3 stripes of 5,000 values: 2 * 3 * 20,000 = 120,000 B
    # sparse: a count to each of the 3 others (24 B, none under max_count), 3 copies of 200 pairs
    # (4 B values; positions compact: a 4-byte count for the part's one 2^16 block, then 2 B each),
    # then another count round and 3 copies of the nonzeros of this rank's stripe of the sum, alike
    expected = flat_sum(4, TRAFFIC_NUMEL, TRAFFIC_K)
    dense = pool4.run(run_node_traffic, "dense", None)
    for max_count, count_round in ((None, 24), (TRAFFIC_K, 0)):
        sparse = pool4.run(run_node_traffic, "sparse", max_count)
        for rank, ((sent, total, _), (dense_sent, dense_total, _)) in enumerate(zip(sparse, dense)):
            assert dense_sent == 120_000
            assert torch.equal(total, expected) and torch.equal(dense_total, expected)
            stripe = int(expected[rank * 5000 : (rank + 1) * 5000].count_nonzero())
            assert sent == count_round + 3 * (200 * 6 + 4) + 24 + 3 * (stripe * 6 + 4), f"rank {rank}"
            assert sent < dense_sent / 10


def test_the_node_step_is_sparse_while_the_sum_stays_sparse():
    # 2 nodes x 2 ranks, N = 10^6, fp32 values; the allgathers' positions compact: a 4-byte count per
    # 2^16-element block (16 of them, 64 B), then 2 B each. Bytes a rank receives on the node link:
    #   dense:  reduce-scatter and all-gather, 1/2 * 4 * 10^6 B each            = 4,000,000
    #   sparse: the other local rank's k pairs, 6k + 64; a count (8 B); the other stripe's share of
    #           the sum's K nonzeros, 6K/2 + 64, with K = N (1 - (1 - k/N)^4) (independent selections)
    #     1%  (k = 10^4):    60,064 + 8 + 6 * 19,701.995 + 64   =   178,348 -> sparse
    #     20% (k = 2*10^5):  1,200,064 + 8 + 6 * 295,200 + 64   = 2,971,336 -> sparse
    #     29% (k = 2.9*10^5): 1,740,064 + 8 + 6 * 372,941.6 + 64 = 3,977,786 -> sparse
    #     30% (k = 3*10^5):  1,800,064 + 8 + 6 * 379,950 + 64   = 4,079,836 -> dense
    #     60% (k = 6*10^5):  3,600,064 + 8 + 6 * 487,200 + 64 is more       -> dense
    for k, step, sparse_bytes in ((10**4, "sparse", 178_348), (2 * 10**5, "sparse", 2_971_336), (29 * 10**4, "sparse", 3_977_786),
                                  (30 * 10**4, "dense", 4_079_836)):
        shape = BufferShape(0, 10**6, k)
        assert sum(node_step_collectives("dense", "allgather", shape, 2, 2)) == 4_000_000
        assert sum(node_step_collectives("sparse", "allgather", shape, 2, 2)) == pytest.approx(sparse_bytes, abs=1)
        assert choose_node_step("allgather", shape, 2, 2) == step
    assert choose_node_step("allgather", BufferShape(0, 10**6, 6 * 10**5), 2, 2) == "dense"
    # Ok-Topk shares back about its kept entries (1.1 x k), and their positions (5 B each) after a
    # count: at 1% 60,064 + 8 + (4 * 5,500 + 64 + 2 * 5,500) + 8 + 2.5 * 11,000 against 4,500,000
    # with the byte mask
    shape = BufferShape(0, 10**6, 10**4)
    assert sum(node_step_collectives("sparse", "oktopk", shape, 2, 2)) == pytest.approx(120_644)
    assert sum(node_step_collectives("dense", "oktopk", shape, 2, 2)) == 4_500_000
    assert choose_node_step("oktopk", shape, 2, 2) == "sparse"
    # one rank per node: no node step at all, and nothing to choose
    assert node_step_collectives("sparse", "allgather", shape, 1, 4) == [] and choose_node_step("allgather", shape, 1, 4) == "dense"
    with pytest.raises(ValueError, match="unknown node step 'auto'; valid choices: dense, sparse"):
        node_step_collectives("auto", "allgather", shape, 2, 2)


def sparse_buffer(numel: int, k: int) -> Buffer:
    return Buffer(0, (Slot("w", 0, (numel,), 0, numel, True, k),), 0)


def test_the_communicator_takes_its_node_step_from_the_plan():
    auto, dense = COMMUNICATORS.build("hierarchical"), COMMUNICATORS.build("hierarchical", node="dense")
    for local_rank in (0, 1):
        hierarchy = Hierarchy(None, None, local_rank, 2, 2)
        assert auto.node_step(sparse_buffer(10**6, 10**4), hierarchy, 4) == "sparse"
        assert auto.node_step(sparse_buffer(10**6, 10**4), hierarchy, 2) == "sparse"  # bf16: summed in fp32
        assert auto.node_step(sparse_buffer(10**6, 6 * 10**5), hierarchy, 4) == "dense"
        assert dense.node_step(sparse_buffer(10**6, 10**4), hierarchy, 4) == "dense"


@settings(max_examples=300, deadline=None)
@given(
    st.sampled_from(CROSS_SCHEMES), st.sampled_from([1, 2, 4, 8]), st.integers(1, 256), st.integers(1, 10**8),
    st.floats(1e-6, 1.0), st.sampled_from([2, 4, 8]),
)
def test_every_rank_picks_the_node_step_with_fewer_bytes(cross, per_node, nodes, numel, density, value_bytes):
    k = max(1, int(density * numel))
    comm = COMMUNICATORS.build("hierarchical", cross=cross)
    buffer = sparse_buffer(numel, k)
    steps = {comm.node_step(buffer, Hierarchy(None, None, rank, per_node, nodes), value_bytes) for rank in range(per_node)}
    assert len(steps) == 1  # from the plan and the layout alone: every local rank, every node alike
    shape = BufferShape(0, numel, k, value_bytes)
    nbytes = {step: sum(node_step_collectives(step, cross, shape, per_node, nodes)) for step in SUMMING_STEPS}
    assert nbytes[steps.pop()] == min(nbytes.values())
    if choose_node_step(cross, shape, per_node, nodes) == "sparse":  # fewer selections keep it sparse
        assert choose_node_step(cross, BufferShape(0, numel, max(1, k // 2), value_bytes), per_node, nodes) == "sparse"


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


def test_relay_training_matches_the_flat_allgather_and_keeps_every_rank_identical(pool4):
    relay = pool4.run(train_hierarchical, "hierarchical", "topk", {"cross": "allgather", "node": RELAY})
    flat = pool4.run(train_hierarchical, "allgather", "topk", {})
    for rank, params in enumerate(relay):
        for name, value in params.items():
            assert torch.equal(value, relay[0][name]), f"rank {rank}: {name} differs from rank 0"
            # every rank's pairs, added in another order (0, 2, 1, 3): equal up to rounding
            torch.testing.assert_close(value, flat[rank][name], rtol=1e-5, atol=1e-6)


def test_relay_sends_each_rank_pairs_once_per_other_node_and_the_gathered_pieces_in_the_node(pool4):
    # 2 nodes x 2 ranks, k = 200 pairs: across nodes, a rank's 200 pairs to the one other node, 4 B
    # values and compact positions (a 4-byte count for the part's one 2^16 block, 2 B each): 1,204 B;
    # in the node, the 2 pieces it received (400 pairs of 8 B: fp32, int32) to its 1 neighbour
    # (3,200 B): 4,404 B, as commcost models the two steps. Padded: headers (a count and the block
    # count across nodes; 2 piece counts in the node, both rounded up to 8 B) and no count round
    # under the plan's bound.
    expected = flat_sum(4, TRAFFIC_NUMEL, TRAFFIC_K)
    shape = BufferShape(0, TRAFFIC_NUMEL, TRAFFIC_K, 4)
    for sent, total, padded in pool4.run(run_node_traffic, RELAY, TRAFFIC_K, 2):
        assert torch.equal(total, expected)
        assert sent == 4_404
        assert padded == (8 + 400 + 800) + (8 + 3_200)
        assert node_step_collectives(RELAY, "allgather", shape, 2, 2) == [3_200 + 2 * 4]
    for sent, total, _ in pool4.run(run_node_traffic, RELAY, None, 2):  # unbounded: the counts first
        assert torch.equal(total, expected) and sent == 4_404 + 2 * 8


def test_relay_is_refused_with_a_cross_step_that_sums():
    with pytest.raises(ValueError, match="node='relay' forms no sums, so it needs cross='allgather', got cross='zen'"):
        COMMUNICATORS.build("hierarchical", cross="zen", node=RELAY)
    with pytest.raises(ValueError, match="node step 'relay' needs cross 'allgather', got 'sparcml'"):
        node_step_collectives(RELAY, "sparcml", BufferShape(0, 1000, 10, 4), 2, 2)


def test_the_command_line_builds_a_hierarchical_strategy():
    from ssfusion_lightning.app.builders import build_strategy
    from ssfusion_lightning.app.config import compose_config

    cfg = compose_config(["strategy=ssfusion", "comm=hierarchical", "comm.options.cross=zen", "strategy.ranks_per_node=2"])
    strategy = build_strategy(cfg)
    options = {"cross": "zen", "node": "auto"}
    assert (strategy.comm_name, strategy.comm_options, strategy.ranks_per_node) == ("hierarchical", options, 2)
    assert build_strategy(compose_config(["strategy=ssfusion"])).comm_name == "auto"
