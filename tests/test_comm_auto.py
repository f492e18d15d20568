"""comm="auto": the per-buffer decision at hand-computed points, its properties over costs and P
(hypothesis), and a short training run on 4 gloo ranks that ends with identical parameters (the
4-rank pool the hierarchical tests use: starting another pool would cost more than the run).

Units in the comments: microseconds (us), bytes (B); links at 1 ns per byte, fp32 values and int32
positions (v = x = 4, a pair 8 B). With ``Links.measured`` (ssfusion_lightning/commcost.py) the
all_to_all link is the allgather's and one point-to-point message costs alpha_g / (P-1).
"""

from __future__ import annotations

import math

import lightning as L
import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

import ssfusion_lightning as ssf
from ssfusion_lightning.comm import COMMUNICATORS
from ssfusion_lightning.comm.base import CommContext
from ssfusion_lightning.commcost import (
    EXACT_SCHEMES,
    HIERARCHICAL_SCHEMES,
    RELAY,
    RELAY_SCHEME,
    SCHEMES,
    BufferShape,
    Link,
    Links,
    buffer_seconds,
    choose_scheme,
    expected_nonzeros,
    hierarchical_parts,
    hierarchical_seconds,
    measured_spread,
    oktopk_collectives,
    scheme_seconds,
)
from ssfusion_lightning.costmodel import CostProfile
from ssfusion_lightning.fusion.cut import recut_dense_runs
from ssfusion_lightning.presets import SYSTEM_PRESETS
from ssfusion_lightning.vocabulary import Buffer, Plan, Slot
from tests.workloads import Regressor, checkpoint_and_resume, make_trainer, regression_data

US = 1e-6


def links(world: int, alpha_us: float = 50.0, ns_per_byte: float = 1.0) -> Links:
    link = Link(alpha_us * US, ns_per_byte * 1e-9)
    return Links.measured(world, link, link)


# --------------------------------------------------------------------------- hand-computed points
def test_allgather_at_two_ranks_with_a_tiny_k():
    # P = 2, N = 10^6, k = 10, alpha = 50 us everywhere (a message: 50 us / (P-1) = 50 us):
    #   allreduce  50 + 2 * 1/2 * 4 * 10^6 ns          = 4050 us
    #   allgather  50 + 1 * 10 * 8 ns                  = 50.08 us
    #   zen        4 * 50 + ...                        > 200 us
    #   sparcml    one doubling round: 2 * 50 + ...    > 100 us
    #   oktopk     6 collectives                       > 300 us
    shape = BufferShape(dense=0, sparse=10**6, k=10)
    assert choose_scheme(shape, links(2)) == "allgather"
    assert buffer_seconds("allgather", shape, links(2)) == pytest.approx(50.08 * US)
    assert buffer_seconds("allreduce", shape, links(2)) == pytest.approx(4050 * US)


@pytest.mark.parametrize("density", [0.5, 0.9])
def test_dense_allreduce_at_large_p_with_a_dense_ish_k(density):
    # P = 256, N = 10^6, k = density * N. With K = N (independent selections cover everything):
    #   allreduce  50 + 2 * 255/256 * 4 * 10^6 ns                        = 8018.75 us
    #   zen        200 + 255/256 * (8k + min(N/8 + 4N, 8N)) ns >= 200 + 255/256 * (4 + 4.125) * 10^6 ns = 8293 us
    #   allgather  255 * 8k ns >= 10^9 ns; oktopk >= (2 + 1/3) * 255/256 * 8k ns >= 9,297 us; sparcml: unions of N
    shape = BufferShape(dense=0, sparse=10**6, k=int(density * 10**6))
    assert choose_scheme(shape, links(256)) == "allreduce"
    assert buffer_seconds("allreduce", shape, links(256)) == pytest.approx(8018.75 * US)


def test_oktopk_at_large_p_and_zen_among_exact_schemes_or_when_selections_coincide():
    # P = 256, N = 10^8, k = 10^6 (1%). Independent selections: K = N (1 - 0.99^256) = 92.37 * 10^6.
    #   allreduce  2 * 255/256 * 4 * 10^8 ns                               = 797 ms
    #   allgather  255 * 8 * 10^6 ns                                       = 2040 ms
    #   zen        255/256 * (8 * 10^6 + min(12.5 * 10^6 + 4K, 8K)) ns     = 388 ms
    #   oktopk     split 255/256 * 8 * 10^6 ns = 7968.75 us, the kept entries 1.1x that and the
    #              balance a third of them on a reused threshold's round (1x and 1/3 on an exact
    #              one): 31/32 * 2.467 * 7968.75 + 1/32 * 2.333 * 7968.75 = 19.62 ms; 4 collectives
    #              and 2 grid gathers (255 * 24 * 8 B) 31 rounds in 32: 4 * 50 us + 2.04 us + 31/32
    #              * 2 * 98.96 us = 0.39 ms; every 32 rounds the exact threshold's gather of K/P
    #              magnitudes per owner: 255 * 4K/256 ns / 32 = 11.50 ms -> 31.5 ms
    shape = BufferShape(dense=0, sparse=10**8, k=10**6)
    assert expected_nonzeros(10**8, 10**6, 256) == pytest.approx(92.37e6, rel=1e-3)
    assert choose_scheme(shape, links(256)) == "oktopk"
    assert buffer_seconds("oktopk", shape, links(256)) == pytest.approx(31.5e-3, rel=0.01)
    assert choose_scheme(shape, links(256), EXACT_SCHEMES) == "zen"
    # every rank selects the same positions (spread 0): K = k, so zen's pull shrinks to 8k B:
    #   zen = 255/256 * 16 * 10^6 ns = 15.9 ms < oktopk's 19.62 + 0.39 ms (its threshold gather: 4k/256 B per owner)
    assert choose_scheme(shape, links(256), spread=0.0) == "zen"


def test_hierarchical_sync_wins_when_the_node_link_is_fast():
    # 2 nodes x 4 ranks (P = 8); cross-node and flat links 50 us + 1 ns/B, the node link 5 us +
    # 0.01 ns/B. N = 10^6, k = 10^4 (1%); independent selections.
    # Flat: allgather 50 + 7 * (4 * 10^4 + 16 * 4 + 2 * 10^4) ns = 470.45 us (4 B values; positions
    #   compact: a 4-byte count per 2^16-element block, 2 B each); sparcml (messages of 50/7 us) 6 * 7.14 +
    #   8 * (10^4 + 19,900 + 39,404) ns = 597 us; zen 200 + 7/8 * (8 * 10^4 + 434,020) ns = 650 us;
    #   oktopk 4 collectives 200 us + counts 0.06 us + split 70 us + 31/32 * (kept 77 + balance 25.7
    #   + 2 grid gathers 102.7 us) + 1/32 * (kept 70 + balance 23.3 + the exact threshold's sizes,
    #   kept counts and 7 * 4 * K/8 ns of magnitudes: 420.5 us) + the regions' all-reduce 50.1 / 64 us
    #   = 486 us -> allgather.
    # Hierarchical: inside the node, the sparse node step (its 0.5 MB against the dense step's 6 MB),
    #   positions compact as above: the 3 other local ranks' k pairs, 3 * 60,064 B: 5 + 1.80 us; a
    #   count round, 5 us; the other stripes' shares of the sum's 77,255 nonzeros (8 independent
    #   selections), 19,313.8 each, 3 * (6 * 19,313.8 + 64) B: 5 + 3.48 us -> 20.28 us (the dense
    #   step: 2 * (5 + 30) = 70 us); a node's union of 4 selections is 39,404, 9,851 per stripe of
    #   250,000; across the 2 nodes the allgather sends 9,851 values and their compact positions (4
    #   blocks): 50 + 59.12 us, plus the count round a stripe's unbounded count needs, 50.008 us ->
    #   179.41 us in all (cross sparcml: its header and 9,851 pairs of 8 B, 100 + 78.8 us -> 199.09
    #   us; cross zen and oktopk pay >= 200 us of latency).
    # Relay forms no sums: each rank's 10^4 pairs cross to the other node in one allgather of 2,
    #   50 + 60.064 us; then the node all-gathers what its 3 other ranks received, 2 pieces of k
    #   pairs and their int32 counts each, 3 * (2 * 8 * 10^4 + 8) B: 5 + 4.80024 us -> 119.86 us.
    shape = BufferShape(dense=0, sparse=10**6, k=10**4)
    flat = links(8)
    hierarchy = (links(4, alpha_us=5, ns_per_byte=0.01), links(2))
    assert choose_scheme(shape, flat) == "allgather"
    assert buffer_seconds("allgather", shape, flat) == pytest.approx(470.448e-6, rel=1e-9)
    assert buffer_seconds("oktopk", shape, flat) == pytest.approx(486e-6, rel=0.01)
    striped = tuple(s for s in HIERARCHICAL_SCHEMES if s != RELAY_SCHEME)
    best = choose_scheme(shape, flat, SCHEMES + striped, hierarchy=hierarchy)
    assert best == "hierarchical:allgather"
    assert scheme_seconds(best, shape, flat, hierarchy=hierarchy) == pytest.approx(179.41e-6, rel=1e-4)
    assert scheme_seconds("hierarchical:sparcml", shape, flat, hierarchy=hierarchy) == pytest.approx(199.09e-6, rel=1e-4)
    assert choose_scheme(shape, flat, SCHEMES + HIERARCHICAL_SCHEMES, hierarchy=hierarchy) == RELAY_SCHEME
    assert scheme_seconds(RELAY_SCHEME, shape, flat, hierarchy=hierarchy) == pytest.approx(119.86424e-6, rel=1e-9)


def test_relay_is_charged_as_the_relay_node_step_of_the_cross_allgather():
    shape = BufferShape(dense=300, sparse=10**5, k=10**3)
    flat, node, across = links(4), links(2, alpha_us=5, ns_per_byte=0.01), links(2)
    pinned = hierarchical_seconds("allgather", shape, node, across, step=RELAY)
    assert scheme_seconds(RELAY_SCHEME, shape, flat, hierarchy=(node, across)) == pinned
    assert pinned != hierarchical_seconds("allgather", shape, node, across)  # not the node step auto picks
    assert hierarchical_parts(RELAY_SCHEME) == ("allgather", RELAY)
    assert hierarchical_parts("hierarchical:zen") == ("zen", None)
    with pytest.raises(ValueError, match="unknown scheme 'hierarchical:ring'; valid choices: .*hierarchical:relay"):
        hierarchical_parts("hierarchical:ring")


def test_auto_offers_hierarchical_schemes_only_on_nodes_of_several_ranks():
    plan = plan_of([(0, 10**6, 10**4)])
    fast_node = CostProfile(
        allreduce=Link(50 * US, 1e-9), allgather=Link(50 * US, 1e-9), node_link=Link(5 * US, 1e-11),
        cross_link=Link(50 * US, 1e-9), world_size=8, measured=True,
    )
    # the schemes alone: the default compression cost (4 ms here) would send this buffer dense
    auto = COMMUNICATORS.build("auto", dense_fallback=False)
    assert auto.assign(plan, CommContext(8, fast_node, {0: 4}, (4, 2))).buffers[0].comm == RELAY_SCHEME
    striped = COMMUNICATORS.build("auto", schemes=[*SCHEMES, "hierarchical:sparcml"], dense_fallback=False)
    assert striped.assign(plan, CommContext(8, fast_node, {0: 4}, (4, 2))).buffers[0].comm == "hierarchical:sparcml"
    for layout in (None, (8, 1), (1, 8)):
        assert auto.assign(plan, CommContext(8, fast_node, {0: 4}, layout)).buffers[0].comm == "allgather"
    only_hierarchical = COMMUNICATORS.build("auto", schemes=["hierarchical:zen"])
    with pytest.raises(ValueError, match="every candidate .* is hierarchical, but the layout has no node groups"):
        only_hierarchical.assign(plan, CommContext(8, fast_node, {0: 4}, None))


def test_auto_keeps_to_flat_schemes_and_relay_without_a_core_to_spare():
    """With one core per rank (serial CPU above the limit) the striped hierarchical sync's extra
    collectives and passes are taken from the backward: auto offers the flat schemes and relay
    (no pass over the part, one collective more) only, unless the user left it no flat one."""
    plan = plan_of([(0, 10**6, 10**4)])
    costs = dict(
        allreduce=Link(50 * US, 1e-9), allgather=Link(50 * US, 1e-9), node_link=Link(5 * US, 1e-11),
        cross_link=Link(50 * US, 1e-9), world_size=8, measured=True,
    )
    striped = COMMUNICATORS.build("auto", schemes=[*SCHEMES, "hierarchical:sparcml"], dense_fallback=False)
    auto = COMMUNICATORS.build("auto", dense_fallback=False)
    for serial, expected, expected_all in (
        (0.0, "hierarchical:sparcml", RELAY_SCHEME), (0.5, "hierarchical:sparcml", RELAY_SCHEME),
        (0.51, "allgather", RELAY_SCHEME), (1.0, "allgather", RELAY_SCHEME),
    ):
        context = CommContext(8, CostProfile(serial_cpu=serial, **costs), {0: 4}, (4, 2))
        assert striped.assign(plan, context).buffers[0].comm == expected, serial
        assert auto.assign(plan, context).buffers[0].comm == expected_all, serial
    only_hierarchical = COMMUNICATORS.build("auto", schemes=["hierarchical:zen"], dense_fallback=False)
    context = CommContext(8, CostProfile(serial_cpu=1.0, **costs), {0: 4}, (4, 2))
    assert only_hierarchical.assign(plan, context).buffers[0].comm == "hierarchical:zen"


def test_a_buffer_without_a_sparse_part_goes_dense():
    assert choose_scheme(BufferShape(dense=1000, sparse=0, k=0), links(64)) == "allreduce"


def test_spread_is_measured_from_the_sums_nonzeros():
    # 4 ranks, 1000 elements, k = 10: independent selections give K = 1000 (1 - 0.99^4) = 39.4
    assert measured_spread([(1000, 10, 10.0)], 4) == 0.0  # everyone picked the same positions
    assert measured_spread([(1000, 10, 1000 * (1 - 0.99**4))], 4) == pytest.approx(1.0)
    assert measured_spread([(1000, 10, 10 + 0.5 * (1000 * (1 - 0.99**4) - 10))], 4) == pytest.approx(0.5)
    assert measured_spread([(1000, 10, 40.0)], 1) is None  # one rank tells nothing


def test_bad_candidates_are_refused_with_the_valid_choices():
    with pytest.raises(ValueError, match="schemes must be .*allreduce, allgather, zen, sparcml, oktopk.*'ring'"):
        COMMUNICATORS.build("auto", schemes=["ring"])
    with pytest.raises(ValueError, match="schemes must be"):
        COMMUNICATORS.build("auto", schemes="zen")


# --------------------------------------------------------------------------- the dense fallback
AUTO_FALLBACK = COMMUNICATORS.build("auto")


def one_buffer_plan() -> Plan:
    # a dense slot of 1000 and a sparse slot of 10^6 elements with k = 10^4 (1%)
    return plan_of([(1000, 10**6, 10**4)])


def profile(ns_per_byte: float, measured: bool = True) -> CostProfile:
    # compression: 20 us + 4 ns per element (the defaults), so 4020 us for the sparse slot
    link = Link(50 * US, ns_per_byte * 1e-9)
    return CostProfile(allreduce=link, allgather=link, world_size=2, measured=measured)


def test_a_buffer_goes_dense_where_its_all_reduce_beats_selection_plus_the_best_scheme():
    # P = 2, 1 ns/B: the whole buffer's all-reduce is 50 + 1/2 * 2 * 4 * 1,001,000 ns = 4054 us;
    # sparse: 4020 us of selection + the dense part's all-reduce (54 us) + an allgather of
    # 10^4 pairs (50 + 80 us) = 4204 us -> dense
    plan = AUTO_FALLBACK.assign(one_buffer_plan(), CommContext(2, profile(1.0), {0: 4}))
    buffer = plan.buffers[0]
    assert plan.notes["comm"] == ["dense"] and buffer.comm == "allreduce"
    assert not buffer.sparse_slots and [(s.offset, s.numel, s.k) for s in buffer.slots] == [(0, 1000, 1000), (1000, 10**6, 10**6)]
    # 100 ns/B: all-reduce 400.45 ms against 4.02 + 0.45 + 8.05 ms: the selection pays for itself
    plan = AUTO_FALLBACK.assign(one_buffer_plan(), CommContext(2, profile(100.0), {0: 4}))
    assert plan.notes["comm"] == ["allgather"] and plan.buffers[0].slots == one_buffer_plan().buffers[0].slots


def test_a_buffers_selections_are_charged_as_one_call():
    # 100 sparse tensors of 10^4 elements, k = 100 each, and a compression line read from one
    # batched call of the buffer: 8 ms fixed, nothing per element. P = 2, 50 us + 10 ns/B:
    # sparse = 8 ms + an allgather of 10^4 pairs (50 us + 800 us) = 8.85 ms; dense = 50 us +
    # 1/2 * 2 * 4 * 10^6 * 10 ns = 40.05 ms -> sparse. Charging 8 ms per tensor (800 ms) sent it dense.
    slots = tuple(Slot(f"s{i}", i, (10**4,), i * 10**4, 10**4, True, 100) for i in range(100))
    plan = Plan((Buffer(0, slots, 0),))
    link = Link(50 * US, 10e-9)
    costs = CostProfile(allreduce=link, allgather=link, world_size=2, measured=True, compress_fixed=8e-3, compress_per_element=0.0)
    assigned = AUTO_FALLBACK.assign(plan, CommContext(2, costs, {0: 4}))
    assert assigned.notes["comm"] == ["allgather"] and assigned.buffers[0].slots == slots


@pytest.mark.parametrize(
    "auto, costs",
    [
        (COMMUNICATORS.build("auto"), profile(1.0, measured=False)),  # the first plan, before any cost is measured
        (COMMUNICATORS.build("auto", schemes=["allgather", "zen"]), profile(1.0)),  # no all-reduce candidate
        (COMMUNICATORS.build("auto", dense_fallback=False), profile(1.0)),
    ],
    ids=["unmeasured", "no-allreduce-candidate", "switched-off"],
)
def test_the_selections_stay_where_the_fallback_does_not_apply(auto, costs):
    plan = auto.assign(one_buffer_plan(), CommContext(2, costs, {0: 4}))
    assert plan.notes["comm"] != ["dense"] and plan.buffers[0].slots == one_buffer_plan().buffers[0].slots


def test_runs_of_buffers_sent_dense_take_the_layout_of_dense_buffers():
    # buffers 0-1 and 3 went dense, buffer 2 stayed sparse; fp32 tensors of 100, 50, 30 | 500 |
    # 80, 20 elements. Caps of 400 B, the first buffer's 200 B: run 0-1 -> [a] (400 B > 200 B:
    # alone, as DDP's first bucket), [b, c] (320 B); buffer 2 as it was; run 3 -> [e, f] (400 B)
    plan = Plan(
        (
            Buffer(0, (Slot("a", 0, (100,), 0, 100, False, 100), Slot("b", 1, (50,), 100, 50, False, 50)), 0, "allreduce"),
            Buffer(1, (Slot("c", 2, (30,), 0, 30, False, 30),), 1, "allreduce"),
            Buffer(2, (Slot("d", 3, (500,), 0, 500, True, 5),), 0, "allgather"),
            Buffer(3, (Slot("e", 4, (80,), 0, 80, False, 80), Slot("f", 5, (20,), 80, 20, False, 20)), 1, "allreduce"),
        ),
        {"comm": ["dense", "dense", "allgather", "dense"], "thresholds": [0, 0, 0, 0]},
    )
    recut = recut_dense_runs(plan, "dense", lambda position: torch.float32, 3, 400, 200)
    assert [[(s.name, s.offset) for s in b.slots] for b in recut.buffers] == [
        [("a", 0)], [("b", 0), ("c", 50)], [("d", 0)], [("e", 0), ("f", 80)],
    ]
    assert [(b.index, b.channel, b.comm) for b in recut.buffers] == [
        (0, 0, "allreduce"), (1, 1, "allreduce"), (2, 2, "allgather"), (3, 0, "allreduce"),
    ]
    assert recut.notes == {"comm": ["dense", "dense", "allgather", "dense"], "thresholds": [0, 0, 0, 0]}
    assert all(not s.sparse and s.k == s.numel for b in recut.buffers if b.comm == "allreduce" for s in b.slots)
    assert recut_dense_runs(Plan(plan.buffers, {"comm": ["allreduce"] * 4}), "dense", None, 3, 400, 200).buffers == plan.buffers


def test_dense_fallback_must_be_a_bool():
    with pytest.raises(ValueError, match="dense_fallback must be true or false, got 'yes'"):
        COMMUNICATORS.build("auto", dense_fallback="yes")


# --------------------------------------------------------------------------- properties
link_values = st.tuples(st.floats(1e-7, 1e-2), st.floats(1e-12, 1e-7))


@st.composite
def buffers(draw):
    sparse = draw(st.integers(0, 10**8))
    k = draw(st.integers(1, max(1, sparse))) if sparse else 0
    return BufferShape(draw(st.integers(0, 10**6)), sparse, k, draw(st.sampled_from([2, 4])))


@settings(max_examples=300, deadline=None)
@given(
    st.sampled_from([1, 2, 4, 8]), st.integers(1, 128), link_values, link_values, link_values, link_values,
    buffers(), st.floats(0.0, 1.0),
)
def test_auto_is_never_modelled_slower_than_dense_or_the_best_fixed_scheme(per_node, nodes, ar, ag, node, cross, shape, spread):
    world = per_node * nodes
    if world < 2:
        return
    model = Links.measured(world, Link(*ar), Link(*ag))
    hierarchy = (Links.measured(per_node, Link(*node), Link(*node)), Links.measured(nodes, Link(*cross), Link(*cross)))
    candidates = SCHEMES + HIERARCHICAL_SCHEMES
    choice = choose_scheme(shape, model, candidates, spread, hierarchy)
    auto = scheme_seconds(choice, shape, model, spread, hierarchy)
    fixed = {scheme: scheme_seconds(scheme, shape, model, spread, hierarchy) for scheme in candidates}
    assert auto <= fixed["allreduce"]
    assert auto <= 1.05 * min(fixed.values())
    assert choose_scheme(shape, model, candidates, spread, hierarchy) == choice  # a pure function


@settings(max_examples=200, deadline=None)
@given(
    st.integers(2, 1024), link_values, link_values, st.floats(0.0, 1e-3), st.floats(0.0, 1e-7),
    st.lists(st.tuples(st.integers(0, 10**5), st.integers(1, 10**7), st.floats(1e-4, 1.0)), min_size=1, max_size=4),
)
def test_with_its_selections_a_planned_buffer_is_never_modelled_slower_than_dense(world, ar, ag, fixed, per_element, shapes):
    costs = CostProfile(
        allreduce=Link(*ar), allgather=Link(*ag), world_size=world, measured=True,
        compress_fixed=fixed, compress_per_element=per_element,
    )
    model = Links.measured(world, costs.allreduce, costs.allgather)
    plan = plan_of([(dense, sparse, max(1, int(sparse * density))) for dense, sparse, density in shapes])
    assigned = COMMUNICATORS.build("auto").assign(plan, CommContext(world, costs, {b.index: 4 for b in plan.buffers}))
    for before, after in zip(plan.buffers, assigned.buffers):
        dense = buffer_seconds("allreduce", BufferShape(before.numel, 0, 0), model)
        selection = sum(costs.compress_seconds(slot.numel) for slot in after.sparse_slots)
        shape = BufferShape(after.dense_numel, after.sparse_numel, sum(slot.k for slot in after.sparse_slots))
        assert buffer_seconds(after.comm, shape, model) + selection <= dense * (1 + 1e-9)


def plan_of(shapes: list[tuple[int, int, int]]) -> Plan:
    """One buffer per (dense, sparse, k): a dense slot and a sparse slot."""
    out = []
    for index, (dense, sparse, k) in enumerate(shapes):
        slots = []
        if dense:
            slots.append(Slot(f"d{index}", 2 * index, (dense,), 0, dense, False, dense))
        if sparse:
            slots.append(Slot(f"s{index}", 2 * index + 1, (sparse,), 0, sparse, True, k))
        out.append(Buffer(index, tuple(slots), index % 2))
    return Plan(tuple(out))


alpha_values, beta_values = st.floats(1e-7, 1e-2), st.floats(1e-12, 1e-7)


@settings(max_examples=60, deadline=None)
@given(
    st.sampled_from([1, 2, 4, 8]),
    st.integers(1, 256),
    st.lists(
        st.tuples(*[alpha_values, beta_values] * 4, st.floats(0, 1), st.floats(0, 1)), min_size=2, max_size=4
    ),
    st.lists(st.tuples(st.integers(0, 10**5), st.integers(0, 10**7), st.floats(1e-4, 1.0)), min_size=1, max_size=6),
)
def test_every_rank_assigns_the_same_plan_from_the_agreed_costs(per_node, nodes, measured, shapes):
    """Each simulated rank measured its own numbers (the flat links, the node-local and cross-node
    links, the selections' spread, its serial CPU share); agreement (elementwise max, as ``agree``
    does with an all-reduce) gives every rank the same profile, and every rank's own communicator
    then records the same scheme for every buffer, flat or hierarchical."""
    world = per_node * nodes
    if world < 2:
        return
    agreed = [max(column) for column in zip(*measured)]
    links_of = [Link(agreed[i], agreed[i + 1]) for i in range(0, 8, 2)]
    profile = CostProfile(
        allreduce=links_of[0], allgather=links_of[1], node_link=links_of[2], cross_link=links_of[3],
        selection_spread=agreed[8], serial_cpu=agreed[9], world_size=world, measured=True,
    )
    plan = plan_of([(dense, sparse, max(1, int(sparse * density)) if sparse else 0) for dense, sparse, density in shapes])
    context = CommContext(world, profile, {b.index: 4 for b in plan.buffers}, (per_node, nodes))
    plans = [COMMUNICATORS.build("auto").assign(plan, context) for _ in measured]
    assert len({p.fingerprint() for p in plans}) == 1
    assert all(p.notes["comm"] == plans[0].notes["comm"] for p in plans)
    candidates = SCHEMES + (HIERARCHICAL_SCHEMES if per_node > 1 and nodes > 1 else ())
    assert all(b.comm in candidates for b in plans[0].buffers)


def test_the_choice_is_part_of_the_plan_fingerprint():
    # allgather 50 + 80 ns, allreduce 50 + 400 us; with an allgather latency of 1 s, allreduce
    plan = plan_of([(0, 100_000, 10)])
    fast = CommContext(2, CostProfile(world_size=2, measured=True), {0: 4})
    slow_gather = CommContext(2, CostProfile(allgather=Link(1.0, 1e-9), world_size=2, measured=True), {0: 4})
    auto = COMMUNICATORS.build("auto", dense_fallback=False)  # the schemes alone
    a, b = auto.assign(plan, fast), auto.assign(plan, slow_gather)
    assert (a.buffers[0].comm, b.buffers[0].comm) == ("allgather", "allreduce")
    assert a.fingerprint() != b.fingerprint()


def test_the_choices_and_measured_links_survive_a_checkpoint():
    from ssfusion_lightning.engine.state import decode_costs, decode_plan, encode_costs, encode_plan

    plan = COMMUNICATORS.build("auto").assign(plan_of([(0, 100_000, 10), (5, 10**6, 10**4)]), CommContext(8, None, {0: 4, 1: 4}))
    restored = decode_plan(encode_plan(plan))
    assert [b.comm for b in restored.buffers] == [b.comm for b in plan.buffers] and restored.fingerprint() == plan.fingerprint()
    costs = CostProfile(node_link=Link(1e-6, 2e-12), cross_link=Link(3e-5, 4e-9), selection_spread=0.25, measured=True)
    assert decode_costs(encode_costs(costs)) == costs
    old = encode_costs(costs)
    for field in ("node_link", "cross_link", "selection_spread"):  # a checkpoint from before these fields
        del old[field]
    assert decode_costs(old).selection_spread == 1.0


def test_auto_is_the_ssfusion_presets_default():
    assert SYSTEM_PRESETS["ssfusion"][1]["comm"] == "auto"
    assert SYSTEM_PRESETS["ssfusion_spawn"][1]["comm"] == "auto"


# --------------------------------------------------------------------------- Ok-Topk's rounds, counted
def oktopk_inputs(world: int, block: int, shared: int, own: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per rank (values, positions): in every block j of ``block`` elements, the ``shared`` positions
    at the block's start that every rank selects (values about 10), then ``own`` positions of the
    rank's own (values about 2^-rank). The blocks' starts are every rank's P-quantiles, so they are
    the regions' edges; the top k of the sum is the shared positions and rank 0's own ones."""
    inputs = []
    for rank in range(world):
        positions, values = [], []
        for j in range(world):
            start = j * block
            mine = start + shared + rank * own
            positions += [*range(start, start + shared), *range(mine, mine + own)]
            values += [10 + 0.01 * i for i in range(shared)] + [2.0**-rank * (1 + 0.001 * (j * own + i)) for i in range(own)]
        inputs.append((torch.tensor(values), torch.tensor(positions)))
    return inputs


def oktopk_round_collectives(inputs, numel: int, k: int, rounds: int) -> list[tuple[list[tuple[str, int]], int]]:
    """Per round: every collective ``oktopk_reduce`` issued with the bytes this rank received in it,
    and the global kept count."""
    import ssfusion_lightning.comm.oktopk as oktopk
    from ssfusion_lightning.comm.oktopk import OkTopkState, oktopk_reduce
    from ssfusion_lightning.comm.traffic import Traffic

    calls: list[str] = []

    class Recording:  # torch.distributed as oktopk.py sees it; each collective is followed by one Traffic.add
        def __getattr__(self, name):
            target = getattr(dist, name)
            if name not in ("all_reduce", "all_gather", "all_to_all_single"):
                return target
            return lambda *args, **kwargs: calls.append(name) or target(*args, **kwargs)

    class Received(Traffic):
        def __init__(self) -> None:
            super().__init__()
            self.each: list[int] = []

        def add(self, sent, received, *padded) -> None:
            self.each.append(int(received))
            super().add(sent, received, *padded)

    values, positions = inputs[dist.get_rank()]
    state, out = OkTopkState(), []
    oktopk.dist = Recording()
    try:
        for _ in range(rounds):
            calls.clear()
            traffic = Received()
            oktopk_reduce(values, positions, numel, k, None, traffic, state)
            assert len(calls) == len(traffic.each)
            out.append((list(zip(calls, traffic.each)), state.last_count))
    finally:
        oktopk.dist = dist
    return out


def test_oktopk_rounds_issue_the_collectives_and_bytes_the_model_counts(pool4):
    # P = 4 regions of 1000 elements; per region 5 shared positions and 5 of each rank's own:
    # k = 4 * 10 = 40 per rank, K = 4 * (5 + 4 * 5) = 100 nonzeros in the sum, 25 per region. Round 0
    # re-cuts the regions and finds the exact threshold, round 1 reuses it (pair 8 B, counts 8 B):
    #   re-cut     all-reduce of 3 boundaries: 2 * 3/4 * 24                   =  36 B
    #   counts     all_to_all: 3 * 8                                           =  24 B
    #   split      all_to_all: 3/4 * 40 * 8                                    = 240 B
    #   exact      sizes 24 B, top magnitudes 3 * 25 * 4 = 300 B, kept counts 24 B
    #   reused     two grids of 24 counts: 2 * 3 * 24 * 8                     = 1152 B
    #   balance    every owner keeps 10 = C/P, nothing crosses a slice: 0 B; modelled 1/3 * 240 = 80 B
    #   kept       allgather of C = k = 40 entries: 3/4 * 40 * 8              = 240 B
    # round 0: 36 + 24 + 240 + 348 + 0 + 240 = 888 B (modelled 968 B); round 1: 24 + 240 + 1152 + 0 + 240
    # = 1656 B (modelled 1736 B)
    world, block, shared, own = 4, 1000, 5, 5
    numel, k, nonzeros = world * block, world * (shared + own), world * (shared + world * own)
    results = pool4.run(oktopk_round_collectives, oktopk_inputs(world, block, shared, own), numel, k, 2)
    kinds = {"all_reduce": "allreduce", "all_gather": "allgather", "all_to_all_single": "alltoall"}
    shape = BufferShape(dense=0, sparse=numel, k=k)
    for step, (exact, recut, total) in enumerate(((True, True, 888), (False, False, 1656))):
        model = oktopk_collectives(shape, world, nonzeros, exact, recut, kept=k)
        rounds = [rank[step] for rank in results]
        assert all(kept == k for _, kept in rounds)
        for calls, _ in rounds:
            assert [kinds[name] for name, _ in calls] == [kind for kind, _ in model]
        received = [sum(calls[i][1] for calls, _ in rounds) / world for i in range(len(model))]
        balance = len(model) - 2
        assert received[balance] == 0 and model[balance][1] == pytest.approx(80)
        assert received[:balance] + received[-1:] == pytest.approx([nbytes for _, nbytes in model[:balance] + model[-1:]])
        assert sum(received) == total and sum(nbytes for _, nbytes in model) == pytest.approx(total + 80)


# --------------------------------------------------------------------------- training on 2 ranks
def train_auto(steps: int = 8, **options) -> dict:
    """The ssfusion preset's configuration (dgc, selective, offload auto, comm auto), small buffers."""
    L.seed_everything(0, verbose=False)
    model = Regressor()
    preset = {key: value for key, value in SYSTEM_PRESETS["ssfusion"][1].items() if key != "start_method"}
    strategy = ssf.SSFusionStrategy(**{**preset, "density": 0.1, "buffer_mb": 0.002, **options})
    make_trainer(strategy, steps).fit(model, DataLoader(regression_data(), batch_size=16))
    engine_plan = strategy._final_engine_state["plan"]
    costs = strategy._final_engine_state["costs"]
    return {
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "comm": [b["comm"] for b in engine_plan["buffers"]],
        "measured": costs is not None,
        "spread": None if costs is None else costs["selection_spread"],
    }


def test_training_with_auto_gives_identical_parameters_on_every_rank(pool4):
    results = pool4.run(train_auto)
    first = results[0]
    assert first["measured"], "auto must measure the links before it freezes its choices"
    assert len(first["comm"]) > 1 and all(c in SCHEMES for c in first["comm"])
    check_identical(results)


def test_auto_runs_its_sparse_candidates_alike_on_every_rank(pool4):
    # on loopback, small buffers go dense (one all-reduce's latency beats two collectives): take
    # the dense all-reduce away, so that the sparse runners carry the training
    results = pool4.run(train_auto, comm_options={"schemes": ["allgather", "zen", "sparcml", "oktopk"]})
    assert results[0]["measured"] and all(c in ("allgather", "zen", "sparcml", "oktopk") for c in results[0]["comm"])
    check_identical(results)
    # the selections' spread, measured on the first rounds' sums, is agreed like every other cost
    assert len({r["spread"] for r in results}) == 1 and 0.0 <= results[0]["spread"] <= 1.0


def test_shared_positions_measure_no_spread(pool4):
    # randomk: every rank draws the same positions, so the sums have k nonzeros: spread 0
    shared = pool4.run(train_auto, sparsifier="randomk", fusion="ahead")
    assert [r["spread"] for r in shared] == [0.0] * 4


def test_relay_measures_the_spread_of_its_exact_sums(pool4):
    # relay's cross step is an exact allgather: its sums are counted like the flat ones
    options = dict(sparsifier="randomk", fusion="ahead", ranks_per_node=2)
    shared = pool4.run(train_auto, **options, comm_options={"schemes": ["hierarchical:relay"], "dense_fallback": False})
    assert [r["spread"] for r in shared] == [0.0] * 4


def resume_auto(path: str) -> tuple[list[str], list[str], bool]:
    """Train 6 steps and checkpoint, then resume to step 9: the plan's choices come back as
    they were saved, and the saved costs are used (nothing is profiled again)."""
    L.seed_everything(0, verbose=False)
    options = dict(sparsifier="topk", density=0.1, fusion="ahead", comm="auto", offload="none", buffer_mb=0.002)
    first, _, resumed = checkpoint_and_resume(
        lambda: ssf.SSFusionStrategy(**options), path, 6, 9,
        lambda engine: {"comm": [b.comm for b in engine.plan.buffers], "profiling": engine._profiler is not None},
    )
    saved = [b["comm"] for b in first._final_engine_state["plan"]["buffers"]]
    return saved, resumed["comm"], resumed["profiling"]


def test_a_resumed_run_keeps_the_choices_of_the_checkpoint(pool4, tmp_path):
    for saved, restored, profiling in pool4.run(resume_auto, str(tmp_path / "auto.ckpt")):
        assert saved == restored and all(saved) and not profiling


def test_auto_runs_hierarchical_candidates_on_2_nodes_of_2_ranks(pool4):
    options = dict(ranks_per_node=2, comm_options={"schemes": ["hierarchical:zen", "hierarchical:allgather"]})
    results = pool4.run(train_auto, **options)
    assert results[0]["measured"] and all(c.startswith("hierarchical:") for c in results[0]["comm"])
    check_identical(results)


def test_auto_runs_relay_on_2_nodes_of_2_ranks(pool4):
    results = pool4.run(train_auto, ranks_per_node=2, comm_options={"schemes": ["hierarchical:relay"], "dense_fallback": False})
    assert results[0]["measured"] and set(results[0]["comm"]) == {RELAY_SCHEME}
    check_identical(results)


def test_auto_runs_relay_as_the_hierarchical_sync_with_its_node_step_pinned():
    runner = COMMUNICATORS.build("auto", schemes=["allgather", RELAY_SCHEME])._runners[RELAY_SCHEME]
    assert (runner.name, runner.cross, runner.node) == ("hierarchical", "allgather", RELAY)


def test_auto_runs_a_flat_scheme_as_that_scheme_pinned():
    """A buffer auto puts on a scheme communicates as ``comm=<scheme>`` would: allgather keeps the
    dense part on the allgather's channel (no hybrid split), and zen is zen, not zen-or-sparcml."""
    auto = COMMUNICATORS.build("auto")
    for scheme in SCHEMES:
        runner, pinned = auto._runners[scheme], COMMUNICATORS.build(scheme)
        assert type(runner) is type(pinned), scheme
        assert getattr(runner, "split", None) == getattr(pinned, "split", None), scheme
    assert auto._runners["allgather"].split is False and auto._runners["zen"].choice == "zen"


def fallback_run() -> dict:
    """ahead/topk at 10% under auto: three sparse rounds leave residuals, then costs that make
    sparsifying a loss (a fast link, an expensive selection) re-plan every buffer dense. The first
    dense round must send each rank's gradient plus everything it still owed."""
    import torch.distributed as dist

    from ssfusion_lightning.comm import ChannelSet
    from ssfusion_lightning.engine.engine import EngineConfig, FusionEngine
    from ssfusion_lightning.fusion import FUSION_POLICIES
    from ssfusion_lightning.sparsifiers import build_memory, build_sparsifier

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2)).double()
    engine = FusionEngine(
        list(model.named_parameters()), build_sparsifier("topk", density=0.1), build_memory("residual"),
        FUSION_POLICIES.build("ahead"), COMMUNICATORS.build("auto"),
        ChannelSet([dist.new_group(backend="gloo")], torch.device("cpu")),
        EngineConfig(buffer_bytes=600, profile_steps=100),  # nothing measured: the costs are the test's
    )
    engine.attach()
    torch.manual_seed(1 + dist.get_rank())

    def backward() -> None:
        model.zero_grad(set_to_none=True)
        model(torch.randn(4, 8, dtype=torch.float64)).pow(2).sum().backward()

    for _ in range(3):
        backward()
        engine.finish()
    sparse_comm = list(engine.plan.notes["comm"])
    owed = {n: engine.memory.residual(n) for n, _ in model.named_parameters()}
    fast = Link(50e-6, 1e-12)
    engine.costs = CostProfile(allreduce=fast, allgather=fast, world_size=4, measured=True, compress_fixed=1e-3)
    engine.set_plan(engine._build_plan(engine.order, engine.costs))
    backward()
    sent = {n: p.grad + (0 if owed[n] is None else owed[n].view_as(p.grad)) for n, p in model.named_parameters()}
    engine.finish()
    result = {
        "sparse_comm": sparse_comm,
        "comm": list(engine.plan.notes["comm"]),
        "owed_before": sum(int(r is not None and bool(r.any())) for r in owed.values()),
        "owed_after": [n for n, _ in model.named_parameters() if engine.memory.residual(n) is not None],
        "sent": sent,
        "written": {n: p.grad.clone() for n, p in model.named_parameters()},
    }
    engine.close()
    return result


def test_a_buffer_switched_to_dense_sends_what_its_tensors_still_owe(pool4):
    results = pool4.run(fallback_run)
    first = results[0]
    assert "dense" not in first["sparse_comm"] and set(first["comm"]) == {"dense"}
    assert first["owed_before"] > 0, "the sparse rounds must leave residuals behind"
    for rank, res in enumerate(results):
        assert res["owed_after"] == [], f"rank {rank} still holds residuals for {res['owed_after']}"
        for name, written in res["written"].items():
            expected = sum(r["sent"][name] for r in results) / len(results)
            torch.testing.assert_close(written, expected, rtol=0, atol=1e-12, msg=f"rank {rank}: {name}")


def check_identical(results: list[dict]) -> None:
    first = results[0]
    for rank, res in enumerate(results):
        assert res["comm"] == first["comm"], f"rank {rank} chose {res['comm']}, rank 0 {first['comm']}"
        for name, value in res["params"].items():
            assert torch.equal(value, first["params"][name]), f"rank {rank}: {name} differs from rank 0"
            assert math.isfinite(float(value.abs().sum()))
