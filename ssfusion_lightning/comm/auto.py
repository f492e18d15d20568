"""``auto``: per buffer, the scheme the agreed cost model says is fastest.

The choice is ``commcost.choose_scheme`` on the buffer's shape (F dense, N sparse, k selected per
rank, bytes per value), the agreed alpha-beta links, P and the selections' spread. Every input is
identical on every rank (the plan, and the cost profile the ranks agreed on with an all-reduce
max), so every rank records the same scheme in the plan (``Buffer.comm``) and launches the same
collectives. Before the costs are measured the links are the cost model's defaults and the
selections are taken as independent: a deterministic first choice.

While the costs are not yet measured, the nonzeros of each exact sparse sum are counted: the sum
is the same on every rank, and the engine agrees the resulting spread with the other costs.

Sparsifying must pay for itself: once the costs are measured, a buffer whose dense all-reduce
(all of it, as a DDP bucket) is modelled faster than its selections plus its best scheme is sent
dense (``dense_fallback``) by the all-reduce candidates: no selection, nothing left in error
feedback, what it still owes goes out with it. On a fast link this is what keeps the engine from being slower than DDP. Before the
costs are measured the compression cost is a guess, so the sparse plan is the first choice. The
selections are charged as one call over all of the buffer's sparse elements: the compression
line's fixed part is measured per call, and a buffer selected in one batched call reads it whole,
so charging it per tensor had counted it once for every tensor of the buffer.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Sequence

import torch.distributed as dist

from ssfusion_lightning.comm.base import COMMUNICATORS, DENSE, CommContext, Communicator, PendingReduction, Reduced
from ssfusion_lightning.comm.channels import ChannelSet
from ssfusion_lightning.comm.schemes import index_bytes
from ssfusion_lightning.commcost import (
    EXACT_SCHEMES,
    HIERARCHICAL,
    HIERARCHICAL_SCHEMES,
    RELAY_SCHEME,
    SCHEMES,
    BufferShape,
    Links,
    choose_scheme,
    hierarchical_parts,
    measured_spread,
    scheme_seconds,
)
from ssfusion_lightning.costmodel import CostProfile
from ssfusion_lightning.vocabulary import Buffer, Encoded, Plan

log = logging.getLogger(__name__)

#: a flat scheme runs on the communicator ``comm=<scheme>`` builds, so a buffer auto puts on a scheme
#: communicates as that scheme pinned would. (It ran allgather as hybrid, the dense part all-reduced
#: on a second channel beside the allgather: 1.04-1.07x the pinned allgather's step, side by side,
#: on the emulated cluster, where the two parts share one link; REPORT, "comm=auto against every
#: fixed collective".)
RUNNER_OPTIONS = {"zen": {"choice": "zen"}}  # auto chooses between zen and sparcml itself
CANDIDATES = SCHEMES + HIERARCHICAL_SCHEMES
#: a buffer the plan did not assign (a sparse-gradient parameter's): summed exactly by allgather
UNASSIGNED = "allgather"
#: above this share of serial CPU (``CostProfile.serial_cpu``) the hierarchical schemes do not compete
SERIAL_HIERARCHY_LIMIT = 0.5
#: the schemes that can carry a buffer sent dense
DENSE_SCHEMES = ("allreduce", HIERARCHICAL + "allreduce")


class _Counted(PendingReduction):
    """A reduction whose sparse sum's nonzeros are recorded when it is waited for."""

    def __init__(self, pending: PendingReduction, record) -> None:
        self._pending = pending
        self._record = record

    def wait(self, timeout: float | None = None) -> Reduced:
        reduced = self._pending.wait(timeout)
        if reduced.sparse is not None:
            self._record(int(reduced.sparse.count_nonzero()))
        return reduced


@COMMUNICATORS.register("auto")
class AutoCommunicator(Communicator):
    """Per buffer, the fastest of ``schemes`` under the agreed cost model (see the module doc).

    ``schemes``: the candidates, among allreduce, allgather, zen, sparcml, oktopk and
    "hierarchical:<one of those>" (comm/hierarchical.py with that cross-node step) and
    "hierarchical:relay" (cross allgather under the relay node step); default: all.
    The hierarchical ones compete only where nodes hold several ranks each (``ranks_per_node``)
    and there are several nodes. Leave out oktopk (both forms) for an exact sum everywhere: Ok-Topk
    keeps about k entries of the sum.
    ``dense_fallback``: send a buffer dense where that is modelled faster than sparsifying it
    (see the module doc), when allreduce (flat or hierarchical) is a candidate; False keeps every
    planned selection.
    ``dense_trial_steps``: with the fallback, once the costs are measured, time this many steps of
    the sparse plan, as many with the auto cut's tensors in one buffer (where it made several) and,
    where the link leaves dense a chance, as many sent dense, and keep the fastest
    (``engine/trial.py``); 0 leaves the choice to the model alone. ``min_sparse_speedup`` (every
    communicator's option): how many times faster a step the sparse plan must measure to stay.
    """

    name = "auto"
    needs_costs = True
    may_use_hierarchy = True
    sums_dense = True  # every candidate all-reduces the dense part

    def __init__(
        self, schemes: Sequence[str] = CANDIDATES, dense_fallback: bool = True, dense_trial_steps: int = 16, **options: Any
    ) -> None:
        if not isinstance(dense_fallback, bool):
            raise ValueError(f"auto communicator: dense_fallback must be true or false, got {dense_fallback!r}")
        super().__init__(dense_trial_steps=dense_trial_steps, **options)
        if not dense_fallback:  # the trial's dense phase is the fallback's: without it, no trial
            self.dense_trial_steps = 0
        if isinstance(schemes, str) or not schemes or any(s not in CANDIDATES for s in schemes):
            raise ValueError(f"auto communicator: schemes must be a non-empty list of {', '.join(CANDIDATES)}; got {schemes!r}")
        self.schemes = tuple(s for s in CANDIDATES if s in schemes)  # one order, whatever order was given
        self.dense_fallback = dense_fallback
        self.exact = not any(s.endswith("oktopk") for s in self.schemes)
        self._runners = {s: _runner_for(s) for s in (*self.schemes, UNASSIGNED)}
        self._samples: list[tuple[int, int, float]] = []  # (N, k, K) of exact sums before costs
        self._measuring = True
        self._lock = threading.Lock()

    # ------------------------------------------------------------ the decision
    def assign(self, plan: Plan, context: CommContext) -> Plan:
        costs = context.costs or CostProfile(world_size=context.world_size)
        links = Links.measured(context.world_size, costs.allreduce, costs.allgather)
        candidates, hierarchy = self._candidates(context.layout, costs)
        self._measuring = not costs.measured
        buffers, notes = [], []
        for buffer in plan.buffers:
            value_bytes = context.value_bytes.get(buffer.index, 4)
            shape = buffer_shape(buffer, value_bytes)
            scheme = choose_scheme(shape, links, candidates, costs.selection_spread, hierarchy)
            seconds = scheme_seconds(scheme, shape, links, costs.selection_spread, hierarchy)
            compress = costs.compress_seconds(buffer.sparse_numel) if buffer.sparse_slots else 0.0
            chosen, note = Buffer(buffer.index, buffer.slots, buffer.channel, scheme), scheme
            dense_candidates = tuple(s for s in DENSE_SCHEMES if s in candidates)
            if self.dense_fallback and costs.measured and buffer.sparse_slots and dense_candidates:
                whole = BufferShape(buffer.numel, 0, 0, value_bytes, shape.index_bytes)
                dense = choose_scheme(whole, links, dense_candidates, costs.selection_spread, hierarchy)
                dense_seconds = scheme_seconds(dense, whole, links, costs.selection_spread, hierarchy)
                if costs.dense_measured_faster or dense_seconds < seconds + compress:
                    chosen, note, shape, seconds, compress = buffer.densified(dense), DENSE, whole, dense_seconds, 0.0
            buffers.append(chosen)
            notes.append(note)
            if _rank() == 0:  # every rank chose the same: one log line per buffer, not P
                log.info(
                    "ssfusion auto: buffer %d (%d dense, %d sparse, k=%d, P=%d, %s costs) -> %s via %s "
                    "(modelled %.3g ms, compression %.3g ms)",
                    buffer.index, buffer.dense_numel, buffer.sparse_numel, shape.k, context.world_size,
                    "measured" if costs.measured else "default", note, chosen.comm, 1e3 * seconds, 1e3 * compress,
                )
        return Plan(tuple(buffers), {**plan.notes, "comm": notes})

    def _candidates(
        self, layout: tuple[int, int] | None, costs: CostProfile
    ) -> tuple[tuple[str, ...], tuple[Links, Links] | None]:
        """The schemes that apply on this layout, and the (node-local, cross-node) links of the
        hierarchical ones; with no node of several ranks among several nodes, the flat ones only."""
        flat = tuple(s for s in self.schemes if not s.startswith(HIERARCHICAL))
        if layout is None or layout[0] <= 1 or layout[1] <= 1 or len(flat) == len(self.schemes):
            if not flat:
                raise ValueError(
                    f"auto communicator: every candidate in {list(self.schemes)} is hierarchical, but the layout "
                    f"{'has no node groups' if layout is None else f'is {layout[1]} node(s) of {layout[0]} rank(s)'}: "
                    "add a flat scheme, or set ranks_per_node so that several nodes hold several ranks each"
                )
            return flat, None
        per_node, nodes = layout
        node = Links.measured(per_node, costs.node_link, costs.node_link)
        across = Links.measured(nodes, costs.cross_link, costs.cross_link)
        if costs.serial_cpu > SERIAL_HIERARCHY_LIMIT and flat:
            # with no core to spare beside the backward, the striped sync's extra collectives (three
            # node and cross steps, and their count rounds, per buffer) and its passes over the part
            # cost more CPU than the cross-node bytes they save: on 2 nodes x 2 ranks with one core
            # per rank it ran at 0.86-0.90 x the flat allgather (REPORT, "the node step A/B"). Relay
            # makes no pass over the part and one collective more, of O(P k): it stays.
            return flat + tuple(s for s in self.schemes if s == RELAY_SCHEME), (node, across)
        return self.schemes, (node, across)

    # ------------------------------------------------------------ running it
    def _runner(self, buffer: Buffer) -> Communicator:
        return self._runners[buffer.comm or UNASSIGNED]

    def launch(self, encoded: Encoded, buffer: Buffer, channels: ChannelSet) -> PendingReduction:
        pending = self._runner(buffer).launch(encoded, buffer, channels)
        if self._measuring and sums_exactly(buffer.comm or UNASSIGNED) and encoded.values is not None and buffer.sparse_slots:
            k = sum(slot.k for slot in buffer.sparse_slots)
            return _Counted(pending, lambda nonzeros: self._record(buffer.sparse_numel, k, nonzeros))
        return pending

    def _record(self, numel: int, k: int, nonzeros: int) -> None:
        with self._lock:
            self._samples.append((numel, k, float(nonzeros)))

    def selection_spread(self, world_size: int) -> float | None:
        with self._lock:
            return measured_spread(self._samples, world_size)

    def carries_votes(self, buffer: Buffer) -> bool:
        return self._runner(buffer).carries_votes(buffer)

    def set_plan(self, plan: Plan) -> None:
        for runner in self._runners.values():
            runner.set_plan(plan)

    def state_dict(self) -> dict[str, Any]:
        return {name: runner.state_dict() for name, runner in self._runners.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name, runner in self._runners.items():
            runner.load_state_dict(state.get(name, {}))


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _runner_for(scheme: str) -> Communicator:
    if scheme.startswith(HIERARCHICAL):
        # a node step left to node="auto" is the one commcost.hierarchical_seconds costs the candidate with
        cross, step = hierarchical_parts(scheme)
        return COMMUNICATORS.build("hierarchical", cross=cross, node=step or "auto")
    return COMMUNICATORS.build(scheme, **RUNNER_OPTIONS.get(scheme, {}))


def sums_exactly(scheme: str) -> bool:
    """Whether ``scheme`` leaves every rank the exact sum (a hierarchical one: its cross-node step's)."""
    return (hierarchical_parts(scheme)[0] if scheme.startswith(HIERARCHICAL) else scheme) in EXACT_SCHEMES


def buffer_shape(buffer: Buffer, value_bytes: int) -> BufferShape:
    """The model's view of a buffer (positions on the wire as the schemes send them)."""
    k = sum(slot.k for slot in buffer.sparse_slots)
    return BufferShape(buffer.dense_numel, buffer.sparse_numel, k, value_bytes, index_bytes(buffer.sparse_numel))
