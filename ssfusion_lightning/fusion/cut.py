"""Where buffers end: a byte cap, or (``buffer_bytes=None``, "auto") the cut the cost model says
finishes the round's communication earliest.

The cost cut is a dynamic program over the tensors in backward order. Tensor i is ready to launch
at ``R_i``: the backward up to it plus the compression of every sparse tensor up to it (the main
thread does both, per tensor in the hook or per buffer at its launch: the same sum either way).
A buffer (a, b] starts its communication when its last tensor is ready and the link has finished
the previous buffer, and takes the alpha-beta time of the allgather collectives on it (the sparse
all-gather of k (value, position) pairs, with a small dense part riding in its message and a larger
one all-reduced first: ``CostProfile.allgather_buffer_seconds``), plus the measured CPU overhead of one buffer (its launch
and its collective's work on a channel thread: on a rank with one core, 40 buffers of resnet18
made the backward 2.7x longer, experiments/results/timeline.md). With F(b, m) the earliest finish
of the first b tensors in m buffers,

    F(b, m) = min over a < b of  max(R_b + s * o * (m - 1), F(a, m - 1)) + comm(a, b)

where o is the buffer overhead and s the measured share of other threads' CPU work that delays
the backward (``CostProfile.serial_cpu``): on a rank with one core (s = 1) every earlier buffer's
launch and collective push the rest of the backward back. The cut minimises F(n, m) + s * o * m
over m. The second term is the ranks' spread: each buffer's work lands on each rank's core at a
different point of its backward, so the ranks' backward passes end further apart the more buffers
there are, and the round ends when the later one's last collective does (gpt2_10m at P = 2, one core a rank: 1 ms more apart and 1.5 ms more backward a buffer, from
3 to 32 buffers, results/timeline_spread.md; o was 1.2-1.5 ms). Both terms grow with each buffer,
so a prefix's cut that finishes no earlier and has no fewer buffers than another is never part of
the best: the program keeps, for every prefix, the cuts that no other beats on both (a Pareto front
of finish and buffer count), and is exact for this model (test_cost_cut_is_optimal_for_its_model
checks it against every cut). With s = 0 the count costs nothing and one cut per prefix is kept.
Ties go to fewer buffers. The costs are the ones every rank agreed on, so every rank computes the
same cut.

Without costs yet (the profiling rounds), and for a dense sparsifier, "auto" is DDP's layout: a
1 MiB first buffer, then 25 MiB ones, so the dense engine sums exactly as DDP does.
"""

from __future__ import annotations

import math
from dataclasses import replace
from itertools import groupby
from typing import Callable, Sequence

import torch

from ssfusion_lightning.costmodel import CostProfile
from ssfusion_lightning.vocabulary import Buffer, ParamSpec, Plan, cut_by_bytes

Item = tuple[int, ParamSpec]

#: DDP's bucket caps: its first bucket, then every other one
DDP_FIRST_BUFFER_BYTES = 1024 * 1024
DDP_BUFFER_BYTES = 25 * 1024 * 1024
#: the most tensors one buffer of the cost cut may hold (bounds the program to O(n * window))
WINDOW = 512


def cut_buffers(
    params: Sequence[Item],
    cap_bytes: float | None,
    first_cap_bytes: float | None,
    costs: CostProfile | None,
    sparse_of: Callable[[ParamSpec], bool],
    k_of: Callable[[ParamSpec], int],
) -> list[list[Item]]:
    """The plan's groups: ``cap_bytes`` given: greedy byte caps; None ("auto"): the cost cut when
    agreed costs exist and some tensor is sparse (one buffer where the plan trial measured that
    faster), else DDP's layout."""
    if cap_bytes is not None:
        return cut_by_bytes(params, cap_bytes, first_cap_bytes)
    if costs is None or not costs.measured or not any(sparse_of(spec) for _, spec in params):
        return cut_by_bytes(params, *dense_caps(None, first_cap_bytes))
    if costs.fused_measured_faster:
        return cut_by_bytes(params, math.inf, first_cap_bytes)
    return cut_by_cost(params, costs, sparse_of, k_of, first_cap_bytes)


def dense_caps(cap_bytes: float | None, first_cap_bytes: float | None) -> tuple[float, float | None]:
    """The byte caps of buffers sent dense: the configured ones, or DDP's layout for "auto"."""
    if cap_bytes is not None:
        return cap_bytes, first_cap_bytes
    return DDP_BUFFER_BYTES, DDP_FIRST_BUFFER_BYTES if first_cap_bytes is None else first_cap_bytes


def recut_dense_runs(
    plan: Plan, marker: str, dtype_of: Callable[[int], torch.dtype], num_channels: int,
    cap_bytes: float | None, first_cap_bytes: float | None,
) -> Plan:
    """Every run of adjacent buffers whose note in ``plan.notes["comm"]`` is ``marker`` (sent
    dense by comm=auto's fallback) re-cut as dense buffers are (``dense_caps``). The cut was made
    for sparse buffers: on a small model one buffer, whose all-reduce would start only after the
    whole backward, where DDP's small first bucket starts during it. Other buffers stay as they
    are; all are renumbered in order."""
    notes = list(plan.notes.get("comm", ()))
    if marker not in notes:
        return plan
    cap, first = dense_caps(cap_bytes, first_cap_bytes)
    recut: list[tuple[Buffer, bool]] = []
    for is_dense, members in groupby(zip(plan.buffers, notes), key=lambda pair: pair[1] == marker):
        run = [buffer for buffer, _ in members]
        if not is_dense:
            recut += [(buffer, False) for buffer in run]
            continue
        slots = [slot for buffer in run for slot in buffer.slots]
        specs = [(j, ParamSpec(slot.name, slot.shape, dtype_of(slot.param))) for j, slot in enumerate(slots)]
        for group in cut_by_bytes(specs, cap, first if run[0] is plan.buffers[0] else None):
            recut.append((Buffer(0, tuple(slots[j] for j, _ in group), 0, run[0].comm).densified(), True))
    buffers = tuple(replace(buffer, index=i, channel=i % num_channels) for i, (buffer, _) in enumerate(recut))
    return Plan(buffers, {**plan.notes, "comm": [marker if dense else buffer.comm for buffer, dense in recut]})


def cut_by_cost(
    params: Sequence[Item],
    costs: CostProfile,
    sparse_of: Callable[[ParamSpec], bool],
    k_of: Callable[[ParamSpec], int],
    first_cap_bytes: float | None = None,
) -> list[list[Item]]:
    """The groups that minimise the modelled finish of the last buffer's communication (see the
    module docstring); a buffer never mixes dtypes, and the first one respects ``first_cap_bytes``."""
    n = len(params)
    if n == 0:
        return []
    ready, dense_numel, sparse_numel, sparse_pairs, nbytes = [0.0], [0], [0], [0], [0]
    clock = 0.0
    for _, spec in params:
        sparse = sparse_of(spec)
        clock += costs.backward_seconds(spec.name) + (costs.compress_seconds(spec.numel) if sparse else 0.0)
        ready.append(clock)
        dense_numel.append(dense_numel[-1] + (0 if sparse else spec.numel))
        sparse_numel.append(sparse_numel[-1] + (spec.numel if sparse else 0))
        sparse_pairs.append(sparse_pairs[-1] + (k_of(spec) if sparse else 0))
        nbytes.append(nbytes[-1] + spec.nbytes)
    element = [spec.nbytes // max(1, spec.numel) for _, spec in params]

    def comm(a: int, b: int) -> float:
        return costs.buffer_overhead + costs.allgather_buffer_seconds(
            dense_numel[b] - dense_numel[a], sparse_numel[b] - sparse_numel[a], sparse_pairs[b] - sparse_pairs[a],
            element[b - 1],
        )

    # fronts[b]: the cuts of the first b tensors that no other beats on both finish and buffer
    # count, as (finish, buffers, a, state of a's front), fewest buffers first. Both the later
    # buffers' finish and the spread grow with each, so one of these is the prefix of the best cut.
    spread = costs.serial_cpu * costs.buffer_overhead
    fronts: list[list[tuple[float, int, int, int]]] = [[(0.0, 0, 0, 0)]] + [[] for _ in range(n)]
    for b in range(1, n + 1):
        dtype = params[b - 1][1].dtype
        best: dict[int, tuple[float, int, int]] = {}  # per buffer count: the earliest finish, a, state
        for a in range(b - 1, max(-1, b - 1 - WINDOW), -1):
            if params[a][1].dtype != dtype:
                break
            if a == 0 and first_cap_bytes is not None and nbytes[b] > first_cap_bytes and b > 1:
                continue
            cost = comm(a, b)
            for state, (finish, count, _, _) in enumerate(fronts[a]):
                launch = ready[b] + spread * count
                candidate = max(launch, finish) + cost
                kept = best.get(count + 1)
                if kept is None or candidate < kept[0]:
                    best[count + 1] = (candidate, a, state)
                if launch >= finish:
                    break  # a's later states have more buffers, so they launch later and finish later than this
        fronts[b] = pareto_front(best, keep_one=spread == 0)
    state = min(range(len(fronts[n])), key=lambda i: (fronts[n][i][0] + spread * fronts[n][i][1], fronts[n][i][1]))
    groups: list[list[Item]] = []
    b = n
    while b > 0:
        _, _, a, state = fronts[b][state]
        groups.append(list(params[a:b]))
        b = a
    return groups[::-1]


def pareto_front(best: dict[int, tuple[float, int, int]], keep_one: bool) -> list[tuple[float, int, int, int]]:
    """From the earliest finish per buffer count, the (finish, buffers, a, state) that no other beats
    on both, fewest buffers first; only the earliest finish when buffers cost nothing later
    (``keep_one``). Ties go to fewer buffers."""
    front: list[tuple[float, int, int, int]] = []
    for count in sorted(best):
        finish, a, state = best[count]
        if not front or finish < front[-1][0]:
            front.append((finish, count, a, state))
    return [min(front, key=lambda c: c[0])] if keep_one else front


def modelled_finish(groups: Sequence[Sequence[Item]], costs: CostProfile, sparse_of, k_of) -> float:
    """The end of the round under the same model (for tests and reports): the finish of the last
    buffer's communication, plus the ranks' spread of ``serial_cpu * buffer_overhead`` a buffer."""
    clock = link_free = 0.0
    for count, group in enumerate(groups):
        dense = sparse = pairs = 0
        for _, spec in group:
            is_sparse = sparse_of(spec)
            clock += costs.backward_seconds(spec.name) + (costs.compress_seconds(spec.numel) if is_sparse else 0.0)
            dense += 0 if is_sparse else spec.numel
            sparse += spec.numel if is_sparse else 0
            pairs += k_of(spec) if is_sparse else 0
        size = group[-1][1].nbytes // max(1, group[-1][1].numel)
        comm = costs.buffer_overhead + costs.allgather_buffer_seconds(dense, sparse, pairs, size)
        link_free = max(clock + costs.serial_cpu * costs.buffer_overhead * count, link_free) + comm
    return link_free + costs.serial_cpu * costs.buffer_overhead * len(groups)
