"""The cost-driven decisions at hand-computed points: ``choose_threshold`` (selective),
``adaptive_boundaries`` (adaptive) and ``sparse_decisions`` (partial).

Each test builds a CostProfile by hand (backward time per tensor, the compression line, alpha-beta
links), works the policy's rule out in the comment, and asserts the decision on both sides of the
point where it flips. Pure functions: no ranks, no timing.

Units in the comments: microseconds (us). Every tensor is float32 (4 bytes) and the world has 2
ranks, so with the formulas of ssfusion_lightning/costmodel.py

    dense_seconds(n)  = allreduce.alpha + allreduce.beta * 2(P-1)/P * 4n = a_r + b_r * 4n
    sparse_seconds(k) = allgather.alpha + allgather.beta * (P-1) * k * (4 + 4) = a_g + b_g * 8k
    compress(n)       = compress_fixed + compress_per_element * n

and topk at density d sends k = max(1, floor(d * n)) elements of an n-element tensor.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ssfusion_lightning.commcost import ring_allreduce_bytes
from ssfusion_lightning.costmodel import (
    CostProfile,
    Link,
    Profiler,
    fit_line,
    fit_per_size_medians,
    line_through,
    probe_elements,
)
from ssfusion_lightning.fusion import FUSION_POLICIES, PlanContext
from ssfusion_lightning.fusion.adaptive import adaptive_boundaries
from ssfusion_lightning.fusion.partial import sparse_decisions
from ssfusion_lightning.fusion.selective import choose_threshold
from ssfusion_lightning.sparsifiers import build_sparsifier
from ssfusion_lightning.vocabulary import ParamSpec

US = 1e-6
NS_PER_BYTE = 1e-9


def specs(*sizes: int) -> list[tuple[int, ParamSpec]]:
    """Tensors p0, p1, ... of the given sizes, in backward order."""
    return [(i, ParamSpec(f"p{i}", (n,), torch.float32)) for i, n in enumerate(sizes)]


def profile(backward_us=(), compress_fixed_us=0.0, compress_per_element_us=0.0, allreduce_alpha_us=0.0, allgather_alpha_us=0.0):
    """Links at 1 ns per byte; alphas, backward and compression times in microseconds."""
    return CostProfile(
        backward={f"p{i}": t * US for i, t in enumerate(backward_us)},
        compress_fixed=compress_fixed_us * US,
        compress_per_element=compress_per_element_us * US,
        allreduce=Link(allreduce_alpha_us * US, NS_PER_BYTE),
        allgather=Link(allgather_alpha_us * US, NS_PER_BYTE),
        world_size=2,
        measured=True,
    )


def test_the_formulas_the_hand_computations_rely_on():
    costs = profile(compress_fixed_us=5, compress_per_element_us=0.001, allreduce_alpha_us=10, allgather_alpha_us=20)
    assert costs.dense_seconds(1000, 4) == pytest.approx((10 + 4000e-3) * US)  # a_r + 4n ns
    assert costs.sparse_seconds(100, 4) == pytest.approx((20 + 800e-3) * US)  # a_g + 8k ns
    assert costs.compress_seconds(1000) == pytest.approx((5 + 1) * US)
    assert costs.dense_seconds(0, 4) == costs.sparse_seconds(0, 4) == 0.0  # nothing sent: no latency


# --------------------------------------------------------------------------- selective: choose_threshold
# One buffer of p0 (10 elements), p1 (20), p2 (1000): T = 1030. The candidates are tau = 0 and every
# tensor size; tensors with n <= tau go dense. Budget: dense elements F <= density * T; a candidate
# over the budget ends the search. The sparse tensors keep the requested density.
#
# The buffer's communication is the allgather collectives': a dense part with F * 4 <= k * 8 bytes
# rides in the allgather's message (every candidate pays a_g once, and no all-reduce), a larger one
# pays an all-reduce of its own, a_r + b_r * 4F.
#
# density 0.1 (budget 103 elements), b_r = b_g = 1 ns/B, compression c = compress_fixed, no per-element
# cost:
#   tau = 0:    F = 0;  k = 1 + 2 + 100 = 103       3c + a_g + 8 * 103 ns           = 3c + a_g + 0.824 us
#   tau = 10:   F = 10; k = 102; 40 B <= 816 B      2c + a_g + (8 * 102 + 4 * 10) ns = 2c + a_g + 0.856 us
#   tau = 20:   F = 30; k = 100; 120 B <= 800 B     c + a_g + (8 * 100 + 4 * 30) ns  = c + a_g + 0.920 us
#   tau = 1000: F = 1030 > 103, over the budget.
# tau = 10 beats tau = 0 iff c > 0.032 us, tau = 20 beats tau = 10 iff c > 0.064 us (and tau = 0 iff
# c > 0.048 us): tau = 0 below c = 0.032, tau = 10 up to 0.064, tau = 20 above. a_r never enters.
SELECTIVE_BUFFER = specs(10, 20, 1000)


@pytest.mark.parametrize(
    ("compress_us", "tau"),
    [
        (0.030, 0),  # 0.914 < 0.916 (tau = 10) < 0.950 (tau = 20)
        (0.040, 10),  # 0.936 < 0.944 (tau = 0), 0.960 (tau = 20)
        (0.070, 20),  # 0.990 < 0.996 (tau = 10) < 1.034 (tau = 0)
    ],
)
@pytest.mark.parametrize("allreduce_alpha_us", [0.0, 1e6])
def test_selective_threshold_at_hand_computed_points(compress_us, tau, allreduce_alpha_us):
    costs = profile(compress_fixed_us=compress_us, allreduce_alpha_us=allreduce_alpha_us, allgather_alpha_us=50)
    chosen_tau, chosen_density = choose_threshold(SELECTIVE_BUFFER, 0.1, costs, build_sparsifier("topk", density=0.1))
    assert chosen_tau == tau
    assert chosen_density == pytest.approx(0.1)


# float64 tensors of 48 and 60 elements (8-byte values, 12-byte pairs), density 0.5 (budget 54):
#   tau = 0:   F = 0;  k = 24 + 30 = 54                2c + a_g + 12 * 54 ns                      = 2c + a_g + 0.648 us
#   tau = 48:  F = 48; k = 30; 384 B > 360 B: no ride  c + a_r + 8 * 48 ns + a_g + 12 * 30 ns      = c + a_r + a_g + 0.744 us
#   tau = 60:  F = 108 > 54, over the budget.
# tau = 48 iff c + a_r + 0.744 < 2c + 0.648  <=>  a_r < c - 0.096 us: at c = 50 us the flip is at a_r = 49.904 us.
LARGE_DENSE_PART = [(0, ParamSpec("p0", (48,), torch.float64)), (1, ParamSpec("p1", (60,), torch.float64))]


@pytest.mark.parametrize(("allreduce_alpha_us", "tau"), [(49.8, 48), (50.0, 0)])
def test_selective_threshold_pays_an_allreduce_for_a_dense_part_too_large_to_ride(allreduce_alpha_us, tau):
    costs = profile(compress_fixed_us=50, allreduce_alpha_us=allreduce_alpha_us, allgather_alpha_us=50)
    chosen_tau, _ = choose_threshold(LARGE_DENSE_PART, 0.5, costs, build_sparsifier("topk", density=0.5))
    assert chosen_tau == tau


def test_selective_volume_neutral_option_lowers_the_sparse_density():
    # The opt-in earlier rule: the sparse tensors get (density * T - F) / (T - F), so the buffer
    # sends about density * T elements. At c = 26 it picks tau = 20 (F = 30, riding):
    #   tau = 0:  3 * 26 + a_g + 0.824 = 78.824 + a_g
    #   tau = 20: 26 + a_g + 0.120 + 8 * 73 ns = 26.704 + a_g   (k = floor(73 / 1000 * 1000))
    costs = profile(compress_fixed_us=26, allreduce_alpha_us=50, allgather_alpha_us=50)
    topk = build_sparsifier("topk", density=0.1)
    assert choose_threshold(SELECTIVE_BUFFER, 0.1, costs, topk, volume_neutral=True) == (20, pytest.approx(0.073))
    ctx = PlanContext(topk, 1 << 20, 1, 2, costs)
    (buffer,) = FUSION_POLICIES.build("selective", volume_neutral=True).plan(SELECTIVE_BUFFER, ctx).buffers
    assert buffer.sparse_slots[0].k == 73
    with pytest.raises(ValueError, match="volume_neutral must be true or false, got 'yes'"):
        FUSION_POLICIES.build("selective", volume_neutral="yes")


def test_selective_threshold_stops_at_the_dense_budget():
    # density 0.01: budget 10.3 elements. tau = 20 (F = 30) is over it, so however expensive the
    # compression (c = 1000 us) the best allowed candidate is tau = 10 (F = 10):
    #   tau = 0:  3c + a_g + 8 * (1 + 1 + 10) ns      = 3000 + a_g + 0.096 us
    #   tau = 10: 2c + a_g + (40 + 8 * (1 + 10)) ns   = 2000 + a_g + 0.128 us   <- least (40 B ride)
    # and the sparse tensors keep density 0.01
    costs = profile(compress_fixed_us=1000, allreduce_alpha_us=50, allgather_alpha_us=50)
    tau, density = choose_threshold(SELECTIVE_BUFFER, 0.01, costs, build_sparsifier("topk", density=0.01))
    assert tau == 10
    assert density == 0.01
    # with density 0.03 (budget 30.9) tau = 20 is allowed and wins: c + a_g + (120 + 8 * 30) ns
    tau, density = choose_threshold(SELECTIVE_BUFFER, 0.03, costs, build_sparsifier("topk", density=0.03))
    assert tau == 20
    assert density == 0.03


def test_selective_plan_applies_the_threshold():
    # The policy cuts one buffer (cap 1 MB) and plans it with choose_threshold's answer (c = 26 us:
    # tau = 20, as above for any c > 0.064 us): p0, p1 dense, p2 sparse with
    # k = floor(0.1 * 1000) = 100.
    costs = profile(compress_fixed_us=26, allreduce_alpha_us=50, allgather_alpha_us=50)
    ctx = PlanContext(build_sparsifier("topk", density=0.1), 1 << 20, 1, 2, costs)
    plan = FUSION_POLICIES.build("selective").plan(SELECTIVE_BUFFER, ctx)
    assert plan.notes["thresholds"] == [20]
    (buffer,) = plan.buffers
    assert [(slot.name, slot.sparse) for slot in buffer.slots] == [("p0", False), ("p1", False), ("p2", True)]
    assert buffer.sparse_slots[0].k == 100


# --------------------------------------------------------------------------- adaptive: adaptive_boundaries
# Tensors of 100 float32 (400 B) in backward order, topk density 0.1 (k = 10 each), no compression
# cost, allgather b_g = 1 ns/B: a buffer of m tensors takes a_g + 8 * 10m ns = a_g + 0.08m us.
# Walking the tensors, the clock advances by each tensor's backward time; the open buffer closes
# once (clock >= the time the channel frees up) and (its bytes >= a_g / b_g, the latency bytes); the
# channel then frees up at clock + its communication. The tail merges into the buffer before it
# when ready[-1] + comm(merged) <= max(ready[-2] + comm(before), ready[-1]) + comm(last) and the
# merged buffer fits the cap.
def boundaries(backward_us, allgather_alpha_us, cap_bytes=1 << 30, overhead_us=0.0, serial_cpu=0.0):
    costs = dataclasses.replace(
        profile(backward_us, allgather_alpha_us=allgather_alpha_us), buffer_overhead=overhead_us * US, serial_cpu=serial_cpu
    )
    groups = adaptive_boundaries(specs(*[100] * len(backward_us)), costs, build_sparsifier("topk", density=0.1), cap_bytes)
    return [[spec.name for _, spec in group] for group in groups]


def test_adaptive_latency_bytes_decide_how_many_tensors_a_buffer_needs():
    # a_g = 0.4 us: latency bytes 400, one tensor suffices. Backward 1 us each; one tensor's
    # communication (0.48 us) ends before the next tensor is ready, so each closes alone at
    # clocks 1, 2, 3, 4. Tail: separate = max(3 + 0.48, 4) + 0.48 = 4.48, merged 4 + 0.56 = 4.56: kept.
    assert boundaries([1, 1, 1, 1], 0.4) == [["p0"], ["p1"], ["p2"], ["p3"]]
    # a_g = 0.6 us: latency bytes 600, two tensors (800 B) needed: [p0 p1] at clock 2 (channel free
    # at 2 + 0.76 = 2.76), [p2 p3] at clock 4 >= 2.76. Tail: separate = max(2.76, 4) + 0.76 = 4.76,
    # merged 4 + 0.6 + 0.32 = 4.92: kept.
    assert boundaries([1, 1, 1, 1], 0.6) == [["p0", "p1"], ["p2", "p3"]]


@pytest.mark.parametrize(
    ("p1_backward_us", "expected"),
    [
        # a_g = 0.4 us. [p0] closes at clock 1; the channel is busy until 1 + 0.48 = 1.48.
        # p1 ready at 1.5 >= 1.48: closes alone; so do p2 (2.5) and p3 (3.5). Tail: separate =
        # max(2.5 + 0.48, 3.5) + 0.48 = 3.98, merged 3.5 + 0.56 = 4.06: kept. The flip: p1 at 1.48.
        (0.5, [["p0"], ["p1"], ["p2"], ["p3"]]),
        # p1 ready at 1.4 < 1.48: stays open, [p1 p2] closes at 2.4 (channel free at 2.4 + 0.56 =
        # 2.96), [p3] at 3.4. Tail: separate = max(2.96, 3.4) + 0.48 = 3.88, merged 3.4 + 0.64 = 4.04.
        (0.4, [["p0"], ["p1", "p2"], ["p3"]]),
    ],
)
def test_adaptive_waits_for_the_channel(p1_backward_us, expected):
    assert boundaries([1, p1_backward_us, 1, 1], 0.4) == expected


@pytest.mark.parametrize(
    ("p2_backward_us", "cap_bytes", "expected"),
    [
        # a_g = 0.6 us (600 latency bytes). [p0 p1] closes at clock 2, channel free at 2.76. p2
        # (400 B) stays open: the tail. Channel busy when p2 is ready (2 + x < 2.76), so merging
        # pays off iff 2 + x + comm(3 tensors) <= 2.76 + comm(1 tensor) <=> x <= a_g = 0.6.
        (0.5, 1 << 30, [["p0", "p1", "p2"]]),  # merged 2.5 + 0.84 = 3.34 <= separate 2.76 + 0.68 = 3.44
        (0.7, 1 << 30, [["p0", "p1"], ["p2"]]),  # merged 2.7 + 0.84 = 3.54 > separate 3.44
        (0.5, 1000, [["p0", "p1"], ["p2"]]),  # would merge, but 1200 B > the 1000 B cap
    ],
)
def test_adaptive_merges_the_tail_when_it_does_not_finish_later(p2_backward_us, cap_bytes, expected):
    assert boundaries([1, 1, p2_backward_us], 0.6, cap_bytes) == expected


def test_adaptive_buffer_overhead_on_a_busy_core_merges_the_tail():
    """a_g = 0.4 us and 0.3 us of CPU a buffer (o). Free core (s = 0): the channel is busy o longer,
    [p0] closes at 1 (free at 1 + 0.48 + 0.3 = 1.78), p1 at 2, p2 at 3 close alone; tail: separate
    max(3 + 0.78, 4) + 0.78 = 4.78, merged 4 + 0.56 + 0.3 = 4.86: four buffers. Busy core (s = 1):
    each closed buffer also makes the later gradients 0.3 us later: [p0] at 1, [p1] at 2.3, [p2] at
    3.6, p3 ready at 4.9; tail: separate max(3.6 + 0.78, 4.9) + 0.78 + 0.3 = 5.98, merged
    4.9 - 0.3 + 0.56 + 0.3 = 5.46: three buffers."""
    singles = [["p0"], ["p1"], ["p2"], ["p3"]]
    assert boundaries([1, 1, 1, 1], 0.4, overhead_us=0.3) == singles
    assert boundaries([1, 1, 1, 1], 0.4, overhead_us=0.3, serial_cpu=1.0) == [["p0"], ["p1"], ["p2", "p3"]]


# --------------------------------------------------------------------------- partial: sparse_decisions
# topk density 0.1; a_r = a_g = 10 us, b_r = b_g = 1 ns/B, compression 5 us per tensor. A tensor of n
# elements: dense 10 + 0.004n us; sparse 5 (compress) + 10 + 0.0008n us (k = n/10). It goes sparse
# when its compression fits the channel's idle time (channel_free - clock) or sparse < dense:
# 15 + 0.0008n < 10 + 0.004n <=> n > 1562.5. The channel then frees up at
# max(channel_free, clock + compress) + the transfer (sparse) or max(channel_free, clock) + dense.
def decisions(sizes, backward_us, sparsifier="topk"):
    costs = profile(backward_us, compress_fixed_us=5, allreduce_alpha_us=10, allgather_alpha_us=10)
    return sparse_decisions(specs(*sizes), costs, build_sparsifier(sparsifier, density=0.1))


def test_partial_compares_sparse_and_dense_cost():
    assert decisions([1000], [1]) == {"p0": False}  # sparse 15.8 us >= dense 14 us (idle 0 < 5)
    assert decisions([2000], [1]) == {"p0": True}  # sparse 16.6 us < dense 18 us


@pytest.mark.parametrize(
    ("p1_backward_us", "p1_sparse"),
    [
        # p0 (10000): sparse 23 us < dense 50 us -> sparse; the channel frees up at
        # max(0, 1 + 5) + (10 + 8) = 24. p1 (1000, dense on cost alone) ready at 1 + x: idle 23 - x.
        # the flip: idle 23 - x >= 5 <=> x <= 18
        (17.5, True),  # idle 5.5 >= compression 5: hidden, sparse
        (18.5, False),  # idle 4.5 < 5 and 15.8 >= 14: dense
    ],
)
def test_partial_hides_compression_in_the_channels_idle_time(p1_backward_us, p1_sparse):
    assert decisions([10000, 1000], [1, p1_backward_us]) == {"p0": True, "p1": p1_sparse}


def test_partial_counts_a_dense_transfer_as_busy_channel():
    # p0 (1000) dense at clock 1: channel free at 1 + 14 = 15. p1 (1000) at clock 2: idle 13 >= 5,
    # so it goes sparse although it would go dense on cost alone; p2 (1000) at clock 3: the channel
    # is free at max(15, 2 + 5) + 10.8 = 25.8, idle 22.8 >= 5: sparse too.
    assert decisions([1000, 1000, 1000], [1, 1, 1]) == {"p0": False, "p1": True, "p2": True}
    # A dense sparsifier: never sparse, whatever the costs.
    assert decisions([10000, 1000], [1, 1], sparsifier="none") == {"p0": False, "p1": False}


def test_the_cpu_probe_sees_one_core_as_serial():
    """Pinned to one core, a second thread's work takes turns with the main thread's: the probe
    reports a large share of it as delaying the main thread (0.43 on a loaded CI host). A fresh interpreter, so the pinning
    touches nothing else."""
    import subprocess
    import sys

    script = (
        "import os, torch; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); torch.set_num_threads(1);"
        "from ssfusion_lightning.costmodel import measure_serial_cpu; print(measure_serial_cpu())"
    )
    share = float(subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout)
    assert 0.25 <= share <= 1.0, share  # a free core gives about 0; outside load on the pinned core blurs 1


def test_the_cpu_probe_leaves_the_global_generator_alone():
    """It runs on a channel thread beside training: a draw from torch's global generator would
    shift the model's own random stream (dropout, augmentation) at a moment no one chose."""
    from ssfusion_lightning.costmodel import measure_serial_cpu

    torch.manual_seed(5)
    before = torch.get_rng_state()
    measure_serial_cpu(work_elements=1 << 10, repeats=1)
    assert torch.equal(torch.get_rng_state(), before)


def probe_two_ranks_on_two_cores(late_rank: int) -> float:
    """Both ranks pinned to the same two cores, as 2 ranks on a 2-core host; ``late_rank`` comes to
    the probe 1.5 s after the other, whose whole probe takes about 0.4 s (a rank the scheduler
    parked, or one still in a collective)."""
    import os
    import time

    import torch.distributed as dist

    from ssfusion_lightning.costmodel import barrier_of, measure_serial_cpu

    cores, threads = os.sched_getaffinity(0), torch.get_num_threads()
    os.sched_setaffinity(0, sorted(cores)[:2])
    torch.set_num_threads(1)
    try:
        if dist.get_rank() == late_rank:
            time.sleep(1.5)
        return measure_serial_cpu(sync=barrier_of(None, torch.device("cpu")))
    finally:
        os.sched_setaffinity(0, cores)
        torch.set_num_threads(threads)


@pytest.mark.skipif(len(__import__("os").sched_getaffinity(0)) < 2, reason="needs two cores")
def test_ranks_probe_their_shared_cores_at_the_same_moment(pool2):
    """One rank comes to the probe 1.5 s late. Unsynchronized, its probe would run after the other's,
    each would find a core free, and the ranks would agree that a worker thread costs the backward
    nothing (measured: agreed shares of 0.07-0.27 in 7 of 8 tries). The barrier before every timed
    phase makes both time the same moment: 4 threads on 2 cores, each delayed by another. The
    ranks agree on the max, and the offload guard reads it against 0.5."""
    shares = pool2.run(probe_two_ranks_on_two_cores, 1)
    assert max(shares) >= 0.5, shares


def test_the_agreed_serial_share_is_every_ranks_worst(pool2):
    for costs in pool2.run(agree_serial_shares):
        assert costs.serial_cpu == 0.75 and costs.world_size == 2


def agree_serial_shares():
    import torch.distributed as dist

    from ssfusion_lightning.costmodel import agree

    rank = dist.get_rank()
    links = {"allreduce": Link(1e-4, 1e-9), "allgather": Link(1e-4, 1e-9)}
    return agree([1e-3, 0.0, 0.0, 0.0], ["p0"], links, 2, None, torch.device("cpu"), 1.0, [0.75, 0.25][rank])


# --------------------------------------------------------------------------- fitting the links
def test_a_link_is_the_line_through_its_small_and_large_message():
    # the 40 Mbit/s emulated link at P = 4 (allgather; moved bytes, median ms): 3 KB 3.89 ms and
    # 3 MB 659 ms, with 41.5 ms at 192 KB (below the line: the shaper's bucket passes it early).
    # Least squares through all three is led by the 659 ms point and halves the latency (1.9 ms).
    xs, ys = [3072.0, 196608.0, 3145728.0], [3.89e-3, 41.52e-3, 659.14e-3]
    assert fit_line(xs, ys)[0] < 0.5 * 3.89e-3
    alpha, beta = line_through((xs[0], ys[0]), (xs[-1], ys[-1]))
    assert alpha == pytest.approx(3.89e-3 - 3072 * beta) and 3.2e-3 < alpha < 3.89e-3
    assert alpha + beta * xs[-1] == pytest.approx(ys[-1])
    assert 1 / beta == pytest.approx(4.8e6, rel=0.01)  # 40 Mbit/s, 5 MB/s, less the protocol's share


def test_the_compression_line_keeps_the_selections_cost_when_a_rank_waits_for_its_core():
    # 3 profiling rounds of 3 tensors, each selection 20 us + 4 ns per element, and in one round
    # every selection waited 10 ms for a core (a time slice of another rank on the same core)
    true = (20e-6, 4e-9)
    samples = [(n, true[0] + true[1] * n + (10e-3 if round_ == 1 else 0.0))
               for round_ in range(3) for n in (1_000, 10_000, 100_000)]
    fixed, per_element = fit_per_size_medians(samples)
    assert fixed == pytest.approx(true[0], rel=1e-6) and per_element == pytest.approx(true[1], rel=1e-6)
    # least squares through the raw samples takes the waits for a fixed cost of about 3.3 ms
    assert fit_line([float(n) for n, _ in samples], [t for _, t in samples])[0] > 3e-3
    # however long the wait, the medians hold
    samples[5] = (100_000, samples[5][1] + 1.0)
    assert fit_per_size_medians(samples) == (pytest.approx(true[0], rel=1e-6), pytest.approx(true[1], rel=1e-6))
    profiler = Profiler(["w"])
    for numel, seconds in samples:
        profiler.compressed(numel, seconds)
    assert profiler.local_vector()[1:3] == [pytest.approx(true[0], rel=1e-6), pytest.approx(true[1], rel=1e-6)]
    assert fit_per_size_medians([]) == (0.0, 0.0)


def test_a_batch_of_large_tensors_reports_each_its_share_of_the_batchs_time():
    # three tensors compressed together in 10 ms: the line through the shares charges them 10 ms
    # together, with no intercept per tensor
    profiler = Profiler(["w"])
    for _ in range(3):
        profiler.compressed_together([100_000, 300_000, 600_000], 10e-3)
    assert profiler.compress[:3] == [
        (100_000, pytest.approx(1e-3)), (300_000, pytest.approx(3e-3)), (600_000, pytest.approx(6e-3))
    ]
    fixed, per_element = profiler.local_vector()[1:3]
    assert fixed == pytest.approx(0.0, abs=1e-12) and per_element * 1_000_000 == pytest.approx(10e-3)


def test_a_line_never_goes_negative():
    assert line_through((1000.0, 5e-3), (10**6, 4e-3)) == (5e-3, 0.0)  # a slower small message: no negative rate
    assert line_through((1000.0, 1e-6), (10**6, 1.0)) == (0.0, pytest.approx(1e-6, rel=2e-3))  # no negative latency


# --------------------------------------------------------------------------- measure_links: the probe's size
@pytest.mark.parametrize("world", [2, 3, 4, 8, 64, 1024])
@pytest.mark.parametrize("moved", [1 << 10, 1 << 20])
def test_a_link_probe_moves_the_same_bytes_per_rank_at_any_world_size(world, moved):
    # an allgather rank receives (P - 1) messages, a ring all-reduce moves 2(P - 1)/P of its tensor:
    # the probe's tensor is sized so that either moves ``moved`` bytes, to within half an element
    # per message, or sends one element where ``moved`` is less than one per peer
    gather = 4 * probe_elements("allgather", moved, world)
    reduce = 4 * probe_elements("allreduce", moved, world)
    if moved >= 4 * (world - 1):
        assert abs((world - 1) * gather - moved) <= 2 * (world - 1)
    else:
        assert gather == 4
    assert abs(ring_allreduce_bytes(reduce, world) - moved) <= 4


def probe_sizes(slow_rank: int | None = None, slow_above: float = 10.0) -> list[tuple[str, int]]:
    """Run measure_links for both collectives on this rank, recording each call's collective and
    elements, with ``SLOW_WARM_UP_SECONDS`` = ``slow_above`` (10 s: loopback is never that slow,
    however loaded the host). On ``slow_rank`` every large message takes 50 ms longer (after the
    collective, so only that rank's own clock sees it)."""
    import time

    import torch.distributed as dist

    from ssfusion_lightning import costmodel

    seen: list[tuple[str, int]] = []
    real_reduce, real_gather = dist.all_reduce, dist.all_gather
    slow = dist.get_rank() == slow_rank

    def all_reduce(tensor, *args, **kwargs):
        seen.append(("allreduce", tensor.numel()))
        work = real_reduce(tensor, *args, **kwargs)
        if slow and tensor.numel() > 1000:
            time.sleep(0.05)
        return work

    def all_gather(out, tensor, *args, **kwargs):
        seen.append(("allgather", tensor.numel()))
        work = real_gather(out, tensor, *args, **kwargs)
        if slow and tensor.numel() > 1000:
            time.sleep(0.05)
        return work

    dist.all_reduce, dist.all_gather = all_reduce, all_gather
    threshold, costmodel.SLOW_WARM_UP_SECONDS = costmodel.SLOW_WARM_UP_SECONDS, slow_above
    try:
        links = costmodel.measure_links(("allreduce", "allgather"), None, torch.device("cpu"))
    finally:
        dist.all_reduce, dist.all_gather = real_reduce, real_gather
        costmodel.SLOW_WARM_UP_SECONDS = threshold
    assert sorted(links) == ["allgather", "allreduce"]
    assert all(link.alpha >= 0 and link.beta >= 0 for link in links.values())
    return seen


def test_measure_links_probes_with_the_sized_messages(pool4):
    # P = 4: the 1 KB probes 3 times each, one untimed 256 KB warm-up and the agreement on its time
    # (one element), then the 1 MB probes 3 times each (the warm-up was faster than 10 s); an
    # allgather rank sends a third of the bytes it moves
    small = [("allreduce", 171)] * 3 + [("allgather", 85)] * 3
    warm_up = [("allreduce", 43691), ("allreduce", 1)]
    large = [("allreduce", 174763)] * 3 + [("allgather", 87381)] * 3
    for seen in pool4.run(probe_sizes):
        assert seen == small + warm_up + large


def test_a_slow_warm_up_on_one_rank_gives_every_rank_one_timed_large_message(pool2):
    # P = 2 (a rank moves what it sends). With the threshold at 40 ms, rank 1's clock reads the
    # warm-up above it (50 ms more) and rank 0's may not: the agreed (max) time decides, so both
    # ranks time each large message once, at half its size, and stay in step
    small = [("allreduce", 256)] * 3 + [("allgather", 256)] * 3
    warm_up = [("allreduce", 65536), ("allreduce", 1)]
    large = [("allreduce", 131072), ("allgather", 131072)]
    for seen in pool2.run(probe_sizes, 1, 0.04):
        assert seen == small + warm_up + large
