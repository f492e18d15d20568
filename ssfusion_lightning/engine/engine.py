"""The fusion engine: plan -> hook -> buffer -> sparsify -> communicate -> write gradients.

Free of Lightning: the strategy creates it with the model's parameters and its own channels,
calls ``finish`` after every backward and toggles ``sync_enabled`` for gradient accumulation.

In the hook of each parameter, as its gradient becomes ready, a per-tensor policy hands that
tensor to the offload worker when the plan offloads it, and compensates and selects a large one
right away (on the host, one of ``HOST_BATCH_BELOW`` elements or more): compression hides behind the
rest of the backward. When a buffer is complete
and every earlier one has launched, its small sparse tensors (below ``BATCH_BELOW`` elements, whose
selection costs mostly its fixed overhead) are selected together in one batched call, on the host
its larger ones below ``HOST_BATCH_BELOW`` in another, and its dense tensors are copied into the
dense part and scaled, a few tensor ops for all of them (a copy costs no more then than in the
hook, and one call per tensor cost more CPU than DDP's bucket copy); then its pieces are packed in
slot order and launched. Whole-buffer policies (``behind``) compress the
complete buffer instead.

Beside this module: a round's state (``round.py``, made afresh for every round), the control
agreements that end a round (``agreement.py``), and the state checkpoints keep (``state.py``).
"""

from __future__ import annotations

import copy
import fnmatch
import logging
import math
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field, replace
from typing import Any, Collection, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ssfusion_lightning.comm import COMMUNICATORS, ChannelSet, Communicator, PendingReduction, Reduced
from ssfusion_lightning.comm.base import DENSE, CommContext
from ssfusion_lightning.comm.channels import Completed
from ssfusion_lightning.comm.schemes import SparseSum, accumulation_dtype
from ssfusion_lightning.commcost import ring_allreduce_bytes
from ssfusion_lightning.costmodel import (
    CostProfile,
    Profiler,
    agree,
    barrier_of,
    measure_link,
    measure_links,
    measure_serial_cpu,
)
from ssfusion_lightning.engine import state as engine_state
from ssfusion_lightning.engine.agreement import Agreement, NonFiniteVote, mean_over_ranks, vote_route
from ssfusion_lightning.engine.errors import CommunicationError, NonFiniteGradientError
from ssfusion_lightning.engine.metrics import StepMetrics
from ssfusion_lightning.engine.offload import Offloader, to_device
from ssfusion_lightning.engine.round import Round
from ssfusion_lightning.engine.trial import DENSE as DENSE_PHASE
from ssfusion_lightning.engine.trial import FUSED, RECUT, SPARSE, PlanTrial
from ssfusion_lightning.fusion import CompressContext, ErrorFeedback, FusionPolicy, PlanContext
from ssfusion_lightning.fusion.base import Piece
from ssfusion_lightning.fusion.budget import within_budget
from ssfusion_lightning.fusion.cut import recut_dense_runs
from ssfusion_lightning.host_cores import every_rank_lacks_spare_core, gather_cores
from ssfusion_lightning.sparsifiers import Memory, Sparsifier
from ssfusion_lightning.sparsifiers.memory import put_back, set_aside
from ssfusion_lightning.sparsifiers.schedule import DensityWarmup
from ssfusion_lightning.sparsifiers.selection import all_finite
from ssfusion_lightning.timeline import Timeline
from ssfusion_lightning.vocabulary import Buffer, Encoded, ParamSpec, Plan, Slot

log = logging.getLogger(__name__)


@dataclass
class EngineConfig:
    #: cap of a fusion buffer; None ("auto"): the cost model's cut once costs are agreed
    buffer_bytes: float | None
    #: cap of the buffer that closes first in backward order (None: buffer_bytes)
    first_buffer_bytes: float | None = None
    warmup_steps: int = 0
    #: the density ramp of the first steps (DGC's warm-up); its length may be set later, once
    #: known (``set_density_warmup``): until then the first stage's density applies
    density_warmup: DensityWarmup = field(default_factory=DensityWarmup)
    find_unused_parameters: bool = False
    offload: str = "none"
    #: rounds measured before cost-driven plans (and offload="auto") are frozen
    profile_steps: int = 3
    #: "raise": every rank raises at a step where some rank's gradient is non-finite;
    #: "skip": every rank drops that step (no gradient written, error feedback untouched)
    nonfinite: str = "raise"
    #: seconds to wait for one buffer's collectives before failing the step
    timeout_seconds: float | None = None
    #: fnmatch patterns of parameter names sent dense at every step, whatever the policy plans
    dense_params: tuple[str, ...] = ()


NONFINITE_POLICIES = ("raise", "skip")
#: sparse tensors below this many elements are selected together when their buffer is complete
#: (one batched selection, ``Sparsifier.select_many``): a selection's fixed cost dominates theirs,
#: while a larger tensor's selection pays for itself in its hook, hidden behind the backward
BATCH_BELOW = 1 << 16
#: on the host, a sparse tensor below this many elements that the main thread selects waits for
#: its buffer even when it is larger than ``BATCH_BELOW``, in a batch of its own. There its hook runs
#: on the core the backward runs on, so its work hides nothing, and between two layers' backward
#: kernels the selection starts with cold caches: gpt2's 147K-element tensors took 0.75 ms a
#: selection in their hooks against 0.27 ms one after another, and batched at the launch a step's
#: compression fell by 12-21% (experiments/REPORT.md, "Large tensors in a batch of their own on the
#: host"). Larger tensors are selected in their hooks: with gpt2_10m's 442K- and 590K-element
#: tensors batched too, its compression rose by 15%, since a gradient autograd just wrote is warmer
#: in the hook than at the launch. A buffer launches no later either way.
HOST_BATCH_BELOW = 1 << 18
#: ``offload="auto"`` offloads nothing when more than this share of a worker thread's CPU work
#: delays the main thread (a rank with one core: measured 35 ms more per step on resnet18 at P = 2)
SERIAL_OFFLOAD_LIMIT = 0.5
#: plans ``_build_plan`` keeps: the trial's check builds the cut's plan and its one-buffer version
PLANS_KEPT = 4


def dense_positions(names: Sequence[str], patterns: Sequence[str]) -> frozenset[int]:
    """Positions of the parameters whose names match one of the fnmatch ``patterns``. A pattern
    that matches nothing is an error: a misspelt name would otherwise leave its tensor sparse."""
    positions = set()
    for pattern in patterns:
        matched = {i for i, name in enumerate(names) if fnmatch.fnmatchcase(name, pattern)}
        if not matched:
            shown = ", ".join(names[:8]) + (f", ... ({len(names)} in all)" if len(names) > 8 else "")
            raise ValueError(f"dense_params pattern {pattern!r} matches no parameter name; the names are: {shown}")
        positions |= matched
    return frozenset(positions)


def dense_version(plan: Plan) -> Plan:
    """The same buffers with every tensor sent dense (warm-up steps)."""
    return Plan(tuple(buffer.densified() for buffer in plan.buffers))


def offload_decisions(plan: Plan, costs: CostProfile) -> frozenset[int]:
    """SSFusion-O's greedy rule per tensor (ALGORITHMS.md section 4), walking the plan in backward
    order: offload a sparse tensor when the worker is free by the time its gradient is ready and
    its compression ends before its buffer would be complete with every compression on the main
    thread. What stays on the main thread delays the rest of the backward. Returns the parameter
    positions to compress on the worker."""
    offloaded, clock, worker_free = set(), 0.0, 0.0
    for buffer in plan.buffers:
        # the buffer's completion with nothing offloaded: the deadline of every offloaded job
        deadline = clock + sum(
            costs.backward_seconds(slot.name) + (costs.compress_seconds(slot.numel) if slot.sparse else 0.0)
            for slot in buffer.slots
        )
        for slot in buffer.slots:
            clock += costs.backward_seconds(slot.name)
            if not slot.sparse:
                continue
            compress = costs.compress_seconds(slot.numel)
            if worker_free <= clock and clock + compress <= deadline:
                offloaded.add(slot.param)
                worker_free = clock + compress
            else:
                clock += compress
    return frozenset(offloaded)


def buffer_offload_decisions(plan: Plan, costs: CostProfile) -> frozenset[int]:
    """The same rule for policies that compress a whole buffer at once (``behind``): a buffer is
    offloaded when the worker is free by the time it is complete and its compression ends before
    the next buffer is complete (the last buffer never: nothing is left to overlap it with)."""
    ready, clock = [], 0.0
    for buffer in plan.buffers:
        clock += sum(costs.backward_seconds(slot.name) for slot in buffer.slots)
        ready.append(clock)
    offloaded, worker_free = set(), 0.0
    for j, buffer in enumerate(plan.buffers):
        compress = sum(costs.compress_seconds(slot.numel) for slot in buffer.sparse_slots)
        if buffer.sparse_slots and j + 1 < len(ready) and worker_free <= ready[j] and ready[j] + compress <= ready[j + 1]:
            worker_free = ready[j] + compress
            offloaded.update(slot.param for slot in buffer.slots)
    return frozenset(offloaded)


def reversed_buffers(plan: Plan, num_channels: int) -> Plan:
    """Launch order reversed (DDP's first-round guess: gradients of late layers are ready first).
    As in DDP's first round, buffers are cut in registration order (a small first buffer then holds
    the first layers) and only then reversed, so every buffer's layout is DDP's bucket's."""
    buffers = tuple(
        replace(buffer, index=i, channel=i % num_channels) for i, buffer in enumerate(reversed(plan.buffers))
    )
    return Plan(buffers, plan.notes)


class FusionEngine:
    """Args beyond the components:
        sparse_gradients: names of the parameters whose gradients are sparse COO tensors
            (``nn.Embedding(sparse=True)``). They stay out of the policy's plan: each is a buffer
            of its own at the end of the round, its nonzeros are the selection, summed exactly by
            the communicator (by allgather where the communicator is approximate) with no error
            feedback, and ``.grad`` gets a coalesced sparse tensor, as DDP leaves it.
        grad_scaler: the GradScaler of fp16 mixed precision, if any. Its scale is in the
            gradients: error feedback keeps its state unscaled, and a non-finite step is the
            scaler's to skip: every rank writes inf into the gradients, whatever ``nonfinite`` says.
        timeline: where the phases of every buffer are recorded (see ``timeline.py``); by default
            a new one that records nothing until enabled.
    """

    def __init__(
        self,
        named_params: Sequence[tuple[str, nn.Parameter]],
        sparsifier: Sparsifier,
        memory: Memory,
        policy: FusionPolicy,
        communicator: Communicator,
        channels: ChannelSet,
        config: EngineConfig,
        sparse_gradients: Collection[str] = (),
        grad_scaler: torch.amp.GradScaler | None = None,
        timeline: Timeline | None = None,
    ) -> None:
        self.params = [p for _, p in named_params]
        self.names = [n for n, _ in named_params]
        self.sparsifier = sparsifier
        self.memory = memory
        self.policy = policy
        self.communicator = communicator
        self.channels = channels
        self.config = config
        self.grad_scaler = grad_scaler
        self._coo = frozenset(i for i, name in enumerate(self.names) if name in set(sparse_gradients))
        #: the parameters whose gradients are sparse COO tensors: they bypass error feedback
        self.sparse_gradient_names = [self.names[i] for i in sorted(self._coo)]
        self._sent_dense = dense_positions(self.names, config.dense_params)
        # Sparse gradients must be summed exactly; Ok-Topk keeps only about k entries of a sum.
        self._coo_communicator = communicator if communicator.exact else COMMUNICATORS.build("allgather")
        self.world_size = dist.get_world_size(channels[0].group) if dist.is_initialized() else 1
        memory.set_world_size(self.world_size)
        self.timeline = timeline if timeline is not None else Timeline()
        self.timeline.rank = dist.get_rank() if dist.is_initialized() else 0
        channels.set_timeline(self.timeline)
        self.step = 0
        self.sync_enabled = True
        self.metrics = StepMetrics()
        self._hooks: list[Any] = []
        self._failed = False
        self._accumulated = engine_state.AccumulatedGradients()
        self._dense_storage: dict[tuple[int, int], Tensor] = {}
        self._decode_storage: dict[tuple[int, int], Tensor] = {}
        # Like DDP: the first round runs in registration order, then the plan is rebuilt once
        # from the gradient-ready order rank 0 observed (DDP skips this with find_unused_parameters).
        self._rebuild_from_ready_order = not config.find_unused_parameters
        self.order = list(reversed(range(len(self.params))))
        self.costs: CostProfile | None = None
        self.offloader = Offloader(config.offload, channels.device) if config.offload != "none" else None
        auto_cut = config.buffer_bytes is None and not sparsifier.is_dense
        comm_costs = communicator.needs_costs and not sparsifier.is_dense  # dense buffers have one choice
        trial_steps = communicator.dense_trial_steps if self.world_size > 1 and not sparsifier.is_dense else 0
        # the trial weighs its windows against the measured link (``_dense_floor``)
        needs_profile = policy.needs_costs or config.offload == "auto" or auto_cut or comm_costs or trial_steps > 0
        self._profile_start = max(1, config.warmup_steps)
        self._profile_end = self._profile_start + config.profile_steps if needs_profile else 0
        self._profiler = Profiler(self.names) if needs_profile else None
        self._trial = PlanTrial(trial_steps, min_sparse_speedup=communicator.min_sparse_speedup) if trial_steps else None
        #: what the memory owed when the trial's dense window began, set aside until it ends
        self._held_owed: list[dict[str, Tensor]] | None = None
        #: DDP's ring all-reduce of every gradient, the traffic of a handed-off step (set by ``hand_off``)
        self._handed_off_bytes = 0
        self._memory_to_optimizer = self._memory_from_optimizer = False  # see hand_off and take_back
        self._step_mark: float | None = None  # where the last round's bookkeeping ended: step times
        self.target_density = sparsifier.density
        self._built_plans: list[tuple[tuple[Any, ...], Plan]] = []
        self._apply_density_schedule()
        self.set_plan(reversed_buffers(self._build_plan(list(range(len(self.params)))), len(channels)))

    # ---------------------------------------------------------------- plan
    def specs(self, order: Sequence[int]) -> list[tuple[int, ParamSpec]]:
        """The planned parameters in ``order`` (sparse-gradient parameters are not the policy's)."""
        return [
            (i, ParamSpec(self.names[i], tuple(self.params[i].shape), self.params[i].dtype)) for i in order if i not in self._coo
        ]

    def _build_plan(self, order: Sequence[int], costs: Any = None) -> Plan:
        """The policy's plan for ``order`` and ``costs`` at the sparsifier's density, its sparse
        tensors sending no more than that density in all (``fusion/budget.py``). The last few are
        kept: the plan trial asks again for plans built before, and the cost cut's program takes about
        23 ms of a rank's CPU for 62 tensors (about 90 ms of the step where 4 ranks share 2 cores)."""
        key = (tuple(order), costs, self.sparsifier.density, self.config)
        for built, plan in self._built_plans:
            if built == key:
                return plan
        ctx = PlanContext(
            self.sparsifier, self.config.buffer_bytes, len(self.channels), self.world_size, costs, self.config.first_buffer_bytes
        )
        plan = within_budget(self.policy.plan(self.specs(order), ctx).sending_dense(self._sent_dense), self.sparsifier)
        self._built_plans = [(key, plan), *self._built_plans[: PLANS_KEPT - 1]]
        return plan

    def scheduled_density(self, step: int) -> float:
        """The density the plan of ``step`` asks for: the warm-up's stage, then the target."""
        if self.sparsifier.is_dense:
            return self.target_density
        return self.config.density_warmup.density(step, self.target_density)

    def _apply_density_schedule(self) -> bool:
        """Set the sparsifier to this step's density; True when it changed (the plan's k are stale).
        A function of the step alone, so every rank changes at the same round."""
        density = self.scheduled_density(self.step)
        if density == self.sparsifier.density:
            return False
        self.sparsifier.set_density(density)
        return True

    def set_density_warmup(self, warmup: DensityWarmup) -> None:
        """Between rounds: a new warm-up (its length in steps became known); re-plans when the
        current step's density changed."""
        self.config = replace(self.config, density_warmup=warmup)
        if self._apply_density_schedule():
            self.set_plan(self._build_plan(self.order, self.costs))

    def set_memory(self, memory: Memory) -> None:
        """Another memory, before the first round (``memory="auto"`` picks one once the optimizers exist)."""
        if self.step:
            raise RuntimeError(f"ssfusion: the error-feedback memory can only be replaced before the first step, not at step {self.step}")
        memory.set_world_size(self.world_size)
        self.memory = memory
        self._new_round()  # the round made with the plan holds the memory it was made with

    def set_plan(self, plan: Plan) -> None:
        # a per-buffer communicator records its scheme in the plan, from the agreed costs
        sizes = {b.index: self.params[b.slots[0].param].element_size() for b in plan.buffers if b.slots}
        hierarchy = self.channels[0].hierarchy
        layout = (hierarchy.ranks_per_node, hierarchy.nodes) if hierarchy is not None else None
        plan = self.communicator.assign(plan, CommContext(self.world_size, self.costs, sizes, layout))
        plan = recut_dense_runs(
            plan, DENSE, lambda position: self.params[position].dtype, len(self.channels),
            self.config.buffer_bytes, self.config.first_buffer_bytes,
        )
        self.plan = plan
        self._dense_plan = dense_version(plan)
        self._coo_buffers = tuple(
            Buffer(index, (self._whole_tensor_slot(position),), index % len(self.channels))
            for index, position in enumerate(sorted(self._coo), start=len(plan.buffers))
        )
        # parameter -> (buffer, slot): the same for the plan and its dense version
        self._slot_of = {**plan.slot_of, **{b.slots[0].param: (b.index, 0) for b in self._coo_buffers}}
        self._dense_storage.clear()
        self._decode_storage.clear()
        self.communicator.set_plan(plan)
        self._offloaded = self._decide_offload(plan)
        self._new_round()

    def _whole_tensor_slot(self, position: int) -> Slot:
        """A sparse-gradient parameter's slot: sparse, any of its elements may be sent."""
        numel = self.params[position].numel()
        return Slot(self.names[position], position, tuple(self.params[position].shape), 0, numel, True, numel)

    def _decide_offload(self, plan: Plan) -> frozenset[int]:
        """Positions of the parameters compressed on the offload worker: thread/stream: every
        sparse one; auto: the greedy rule on agreed costs (none before them)."""
        if self.offloader is None or (self.config.offload == "auto" and self.costs is None):
            return frozenset()
        if self.config.offload == "auto" and self.costs.serial_cpu > SERIAL_OFFLOAD_LIMIT:
            return frozenset()  # the worker would take its CPU from the backward, plus the hand-offs
        if self.config.offload != "auto":
            return frozenset(slot.param for buffer in plan.buffers for slot in buffer.sparse_slots)
        decide = offload_decisions if self.policy.per_tensor else buffer_offload_decisions
        return decide(plan, self.costs)

    @property
    def offloaded_positions(self) -> frozenset[int]:
        """Positions of the parameters the current plan compresses on the offload worker."""
        return self._offloaded

    @property
    def profiling(self) -> bool:
        return self._profiler is not None and self._profile_start <= self.step < self._profile_end

    def begin_backward(self) -> None:
        if self._memory_from_optimizer:
            self.take_memory_from_optimizer()
        self.timeline.step = self.step
        self.timeline.mark("backward.begin")
        held = self._accumulated.put_back(self.names, self.params)
        if held is not None:
            self._round.used_unsynced[:] = held
        if not self.sync_enabled:
            self._accumulated.pending = True  # local gradients pile up until the synchronized backward
        elif self.profiling:
            self._profiler.begin_backward()

    @property
    def active_plan(self) -> Plan:
        return self._dense_plan if self.step < self.config.warmup_steps else self.plan

    # ---------------------------------------------------------------- hooks
    def attach(self) -> None:
        for position, param in enumerate(self.params):
            self._hooks.append(param.register_post_accumulate_grad_hook(self._make_hook(position)))

    def detach(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()

    def _make_hook(self, position: int):
        def hook(param: Tensor) -> None:
            if self.sync_enabled:
                self._mark_ready(position)
            else:
                self._round.used_unsynced[position] = True

        return hook

    def _new_round(self) -> None:
        plan = self.active_plan
        route = vote_route(plan, self.communicator, self.policy.per_tensor, offloads=bool(self._offloaded))
        vote = NonFiniteVote(route, len(plan.buffers) - 1, self.world_size, self.channels[0])
        # the round's buffers: the policy's plan, then one per sparse-gradient parameter
        feedback = ErrorFeedback(self.memory, check=lambda compensated: vote.note(all_finite(compensated)))
        self._round = Round(plan.buffers + self._coo_buffers, len(self.params), feedback, vote)

    def _mark_ready(self, position: int) -> None:
        current = self._round
        if current.used[position]:
            return
        current.used[position] = True
        current.ready_order.append(position)
        if self.profiling:
            self._profiler.ready(self.names[position])
        buffer_index, slot_index = self._slot_of[position]
        buffer = current.buffers[buffer_index]
        if self.policy.per_tensor and position not in self._coo and not self._batched(buffer.slots[slot_index]):
            self._compress_slot(buffer, slot_index)
            if self.profiling:
                self._profiler.resume()  # main-thread compression is not backward time
        current.missing[buffer_index] -= 1
        self._launch_ready()

    def _launch_ready(self) -> None:
        current = self._round
        while current.next < len(current.buffers) and current.missing[current.next] == 0:
            if self.profiling:
                started, current.launch_excluded_seconds = time.perf_counter(), 0.0
                self._launch(current.buffers[current.next])
                self._profiler.launched(time.perf_counter() - started - current.launch_excluded_seconds)
                self._profiler.resume()  # the launch is not backward time
            else:
                self._launch(current.buffers[current.next])
            current.next += 1

    # ---------------------------------------------------------------- buffer -> sparsify -> communicate
    def _dense_out(self, buffer: Buffer) -> Tensor | None:
        if buffer.dense_numel == 0:
            return None
        numel = buffer.dense_numel + (self.world_size if self._round.vote.rides_in_dense(buffer) else 0)
        key = (buffer.index, numel)
        out = self._dense_storage.get(key)
        if out is None:
            first = self.params[buffer.slots[0].param]
            out = torch.empty(numel, dtype=first.dtype, device=first.device)
            self._dense_storage[key] = out
        return out

    def _grad(self, position: int) -> Tensor | None:
        """This round's gradient of a parameter; None for one no backward reached since the last
        round (another optimizer's, in manual optimization): it sends zeros, error feedback untouched."""
        grad = self.params[position].grad if self._round.participates(position) else None
        # a sparse gradient from a module not recognised as such (F.embedding(sparse=True)): sent like any dense one
        return grad.to_dense() if grad is not None and grad.is_sparse else grad

    def _context(self, buffer: Buffer) -> CompressContext:
        if self._round.sparsifier_snapshot is None:
            # selection may move thresholds: restore them if this round is dropped as non-finite
            self._round.sparsifier_snapshot = copy.deepcopy(self.sparsifier.state_dict())
            self._round.feedback.loss_scale = self._current_loss_scale()
        on_selected = self._profiler.compressed if self.profiling else None
        like = self.params[buffer.slots[0].param]
        return CompressContext(self.sparsifier, self._round.feedback, 1.0 / self.world_size, on_selected, like.dtype, like.device)

    def _compress_slot(self, buffer: Buffer, j: int) -> None:
        """Sparsification ahead of fusion: one tensor, as soon as its gradient is ready, here or on
        the offload worker (SSFusion-O) as the plan decided."""
        slot = buffer.slots[j]
        grad, ctx, dense_out = self._grad(slot.param), self._context(buffer), self._dense_out(buffer)
        if grad is not None and slot.param in self._offloaded:
            if self.offloader.stages_on_host:
                grad = self.offloader.stage(slot.param, [grad])[0]
            self._round.pieces[buffer.index][j] = self.offloader.submit(self._timed_slot, slot, grad, dense_out, ctx, True)
        else:
            self._round.pieces[buffer.index][j] = self._timed_slot(slot, grad, dense_out, ctx, False)

    def _timed_slot(
        self, slot: Slot, grad: Tensor | None, dense_out: Tensor | None, ctx: CompressContext, offloaded: bool
    ) -> Piece:
        started = time.perf_counter()
        with self.timeline.span("select", self._slot_of[slot.param][0], slot.name):
            piece = self.policy.compress_slot(slot, grad, dense_out, ctx)
        elapsed = time.perf_counter() - started
        if offloaded:
            self.metrics.offloaded_compress_seconds += elapsed
        else:
            self.metrics.compress_seconds += elapsed
        return piece

    def _launch(self, buffer: Buffer) -> None:
        if buffer.slots[0].param in self._coo:
            self._submit_launch(buffer, self._encode_sparse_gradient(buffer.slots[0]))
        elif not self.policy.per_tensor:
            self._launch_whole(buffer)
        else:
            self._compress_rest(buffer)
            if self._launches_on_worker:  # behind the buffer's offloaded pieces, in plan order
                self._round.launched.append(self.offloader.submit(self._pack_and_launch, buffer))
            else:
                self._round.launched.append(self._pack_and_launch(buffer))

    def _batched(self, slot: Slot) -> bool:
        """Whether a tensor waits for its buffer's batched work instead of its own in the hook: a
        dense one, or a sparse one that is not offloaded and is small (on the host, not large)."""
        if not slot.sparse:
            return True
        if slot.param in self._offloaded:
            return False
        on_host = self.params[slot.param].device.type == "cpu"
        return slot.numel < (HOST_BATCH_BELOW if on_host else BATCH_BELOW)

    def _compress_rest(self, buffer: Buffer) -> None:
        """The buffer's pieces not made in the hooks: its dense tensors, copied in together, its
        small sparse tensors, in one batched selection, on the host its larger ones, in another, and
        those with no gradient on this rank (they send zeros, so every rank issues alike)."""
        pieces, dense, small, large = self._round.pieces[buffer.index], [], [], []
        for j, slot in enumerate(buffer.slots):
            if pieces[j] is None:
                grad = self._grad(slot.param) if self._batched(slot) else None
                if grad is None:
                    self._compress_slot(buffer, j)
                elif not slot.sparse:
                    dense.append((j, grad))
                else:
                    (small if slot.numel < BATCH_BELOW else large).append((j, grad))
        if dense:
            self._pack_dense(buffer, dense)
        if small:
            self._select_batch(buffer, small)
        if large:
            self._select_large_batch(buffer, large)

    def _pack_dense(self, buffer: Buffer, batch: list[tuple[int, Tensor]]) -> None:
        slots = [buffer.slots[j] for j, _ in batch]
        pieces = self._round.pieces[buffer.index]
        with self.timeline.span("pack", buffer.index, f"{len(slots)} dense tensors"):
            made = self.policy.pack_dense_slots(slots, [g for _, g in batch], self._dense_out(buffer), self._context(buffer))
            for (j, _), piece in zip(batch, made):
                pieces[j] = piece

    def _select_batch(self, buffer: Buffer, batch: list[tuple[int, Tensor]], profiled: bool = True) -> None:
        """``profiled=False``: the selection's time is not reported to the cost profile here."""
        slots, grads = [buffer.slots[j] for j, _ in batch], [g for _, g in batch]
        pieces = self._round.pieces[buffer.index]
        ctx = self._context(buffer) if profiled else replace(self._context(buffer), on_selected=None)
        started = time.perf_counter()
        with self.timeline.span("select", buffer.index, f"{len(slots)} tensors batched"):
            for (j, _), piece in zip(batch, self.policy.compress_sparse_slots(slots, grads, ctx)):
                pieces[j] = piece
        self.metrics.compress_seconds += time.perf_counter() - started

    def _select_large_batch(self, buffer: Buffer, batch: list[tuple[int, Tensor]]) -> None:
        """The host's large sparse tensors, compensated and selected together at the launch. The
        cost profile charges them as the cut does, per element: each is reported its share of the
        batch by size (compensation included, as the hook's time was not backward time either), and
        the batch is left out of the buffer's launch overhead. The small tensors' batch stays in the
        overhead: its cost is mostly per call, so per buffer."""
        started = time.perf_counter()
        self._select_batch(buffer, batch, profiled=False)
        elapsed = time.perf_counter() - started
        if self.profiling:
            self._profiler.compressed_together([buffer.slots[j].numel for j, _ in batch], elapsed)
            self._round.launch_excluded_seconds += elapsed

    def _pack_and_launch(self, buffer: Buffer):
        """Runs after every piece of the buffer: the worker is FIFO, so offloaded pieces are done."""
        pieces = [piece.result() if isinstance(piece, Future) else piece for piece in self._round.pieces[buffer.index]]
        with self.timeline.span("pack", buffer.index):
            encoded = self.policy.pack(buffer, pieces, self._dense_out(buffer), self._context(buffer))
            encoded = self._finish_encoding(buffer, encoded)
        return self._launch_encoded(buffer, encoded)

    def _launch_whole(self, buffer: Buffer) -> None:
        """Whole-buffer policies (``behind``): compress the complete buffer at once."""
        grads = [self._grad(slot.param) for slot in buffer.slots]
        if self.offloader is not None and buffer.slots[0].param in self._offloaded:
            if self.offloader.stages_on_host:
                grads = [None if g is None else self.offloader.stage(slot.param, [g])[0] for slot, g in zip(buffer.slots, grads)]
            self._round.launched.append(self.offloader.submit(self._compress_and_launch, buffer, grads))
        else:
            self._submit_launch(buffer, self._compress_buffer(buffer, grads))

    def _submit_launch(self, buffer: Buffer, encoded: Encoded) -> None:
        if self._launches_on_worker:  # behind earlier offloaded buffers, so channels see plan order
            self._round.launched.append(self.offloader.submit(self._launch_encoded, buffer, encoded))
        else:
            self._round.launched.append(self._launch_encoded(buffer, encoded))

    @property
    def _launches_on_worker(self) -> bool:
        """Launches queue on the offload worker only where the plan offloads some compression:
        otherwise the main thread makes them in plan order itself, and a hand-off per buffer to a
        worker with nothing else to do only costs CPU and a wake-up (1 core per rank, 4 ranks on 2 cores)."""
        return self.offloader is not None and bool(self._offloaded)

    def _current_loss_scale(self) -> Tensor | None:
        """The factor this round's gradients carry: the tensor the scaler multiplied the loss by.
        (``GradScaler.get_scale()`` would copy it to the host, a sync in the middle of the backward.)"""
        if self.grad_scaler is None or not self.grad_scaler.is_enabled():
            return None
        return self.grad_scaler._scale

    def _encode_sparse_gradient(self, slot: Slot) -> Encoded:
        """A sparse-gradient parameter's nonzeros, scaled by 1/P: the rows of its COO gradient
        (the whole of a dense one, when the weight is also used densely, e.g. tied to a head);
        none where no backward reached it on this rank."""
        param = self.params[slot.param]
        grad = param.grad if self._round.participates(slot.param) else None
        if grad is None:
            values = param.new_empty(0)
            indices = torch.empty(0, dtype=torch.int64, device=param.device)
        elif grad.is_sparse:
            grad = grad.coalesce()
            row = math.prod(grad.shape[grad.sparse_dim() :])
            rows = _flat_rows(grad.indices(), grad.shape[: grad.sparse_dim()])
            indices = (rows.unsqueeze(1) * row + torch.arange(row, device=rows.device)).reshape(-1)
            values = grad.values().reshape(-1)
        else:
            values, indices = grad.reshape(-1), torch.arange(slot.numel, device=grad.device)
        return Encoded(dense=None, values=values * (1.0 / self.world_size), indices=indices)

    def _compress_buffer(self, buffer: Buffer, grads: list[Tensor | None]) -> Encoded:
        started = time.perf_counter()
        with self.timeline.span("select", buffer.index):
            encoded = self.policy.compress(buffer, grads, self._dense_out(buffer), self._context(buffer))
        self.metrics.compress_seconds += time.perf_counter() - started
        return self._finish_encoding(buffer, encoded)

    def _compress_and_launch(self, buffer: Buffer, grads: list[Tensor | None]):
        return self._launch_encoded(buffer, self._compress_buffer(buffer, grads))

    def _finish_encoding(self, buffer: Buffer, encoded: Encoded) -> Encoded:
        vote = self._round.vote
        if vote.rides_in_dense(buffer):
            vote.vector(out=encoded.dense[buffer.dense_numel :])
        if encoded.values is not None and encoded.values.device != self.channels.device:
            encoded = to_device(encoded, self.channels.device)  # selected on pinned host memory
        if vote.rides_in_sparse(buffer):
            encoded.votes = vote.vector()  # every rank's flag once the buffer is reduced
        return encoded

    def _launch_encoded(self, buffer: Buffer, encoded: Encoded) -> tuple[Buffer, PendingReduction, Encoded]:
        communicator = self._coo_communicator if buffer.slots[0].param in self._coo else self.communicator
        with self.timeline.span("launch", buffer.index):  # the channels name its collectives after the buffer
            pending = communicator.launch(encoded, buffer, self.channels)
        self.metrics.buffers += 1
        self.metrics.dense_tensors += len(buffer.dense_slots)
        self.metrics.sparse_tensors += len(buffer.sparse_slots)
        selected = encoded.values.numel() if encoded.values is not None else 0
        self.metrics.elements_sent += buffer.dense_numel + selected
        if buffer.slots[0].param not in self._coo:
            self.metrics.selected_elements += selected
            self.metrics.sparse_numel += buffer.sparse_numel
        return buffer, pending, encoded

    # ---------------------------------------------------------------- write gradients
    def finish(self) -> StepMetrics:
        """The end of a synchronized backward: launch what is left (missing gradients count as
        zeros), agree, wait, drop the round where a gradient was non-finite, else write the error
        feedback and ``.grad``; then the next round begins, on a new plan when one is due."""
        self.timeline.mark("backward.end")
        if not self.sync_enabled:
            return self.metrics
        self._accumulated.pending = False
        launched = self._launch_rest()
        agreement = self._agree()
        started = time.perf_counter()
        results = [(buffer, self._wait(buffer, pending), encoded) for buffer, pending, encoded in launched]
        unhealthy = agreement.unhealthy(results)
        globally_used = agreement.used()
        self.metrics.exposed_comm_seconds += time.perf_counter() - started
        nonfinite = self._nonfinite(results, unhealthy)
        if nonfinite is not None:
            return self._drop_round(nonfinite, globally_used)
        for buffer, reduced, encoded in results:
            with self.timeline.span("write", buffer.index):
                # error feedback from the round's gradients, before they are overwritten
                self._round.feedback.commit(encoded.updates, reduced.applied)
                self._write_gradients(buffer, reduced, encoded, globally_used)
            self._count_traffic(buffer, reduced)
        metrics = self._end_step()
        self._next_round(agreement)
        return metrics

    def _launch_rest(self) -> list[tuple[Buffer, PendingReduction, Encoded]]:
        """Launch the buffers not launched yet, then wait until every buffer is on its channels:
        the control collectives queue behind them, and ranks must queue them in the same order,
        so the offload worker is drained first."""
        current = self._round
        while current.next < len(current.buffers):
            self._launch(current.buffers[current.next])
            current.next += 1
        return [self._settle(item, "compress and launch") for item in current.launched]

    def _agree(self) -> Agreement:
        """The round's control agreements, queued behind its buffers (see ``agreement.py``)."""
        current, count = self._round, len(self.params)
        used = [current.participates(i) for i in range(count)] if self.config.find_unused_parameters else None
        ready_order = current.ready_order if self._rebuild_from_ready_order else None
        return Agreement(self.channels[0], self._settle, current.vote, count, used, ready_order)

    def _nonfinite(self, results: list[tuple[Buffer, Reduced, Encoded]], unhealthy: list[int]) -> str | None:
        """Where a non-finite gradient showed this round; None where none did. Sparse selections
        are voted on (``unhealthy``: the ranks that saw one); exact sums carry any rank's NaN/Inf
        to every rank, so the dense parts and the summed sparse gradients are checked."""
        if unhealthy:
            return f"on rank(s) {unhealthy}"
        summed = [reduced.dense for _, reduced, _ in results if reduced.dense is not None]
        coo_sums = [
            value
            for buffer, reduced, _ in results
            if buffer.slots[0].param in self._coo
            for value in (reduced.sparse.values() if isinstance(reduced.sparse, SparseSum) else [reduced.sparse])
        ]
        if bool(all_finite(summed + coo_sums)):
            return None
        own = "finite" if bool(all_finite(_local_gradients(self.params))) else "non-finite"
        where = "all-reduced dense gradients" + (" or the summed sparse gradients" if coo_sums else "")
        return f"in the {where} (this rank's own were {own})"

    def _end_step(self) -> StepMetrics:
        """The round is written: the sparsifier moves on, the step counts, and its metrics are handed out."""
        self.sparsifier.advance()
        self.metrics.requested_density = self.sparsifier.density if self.step >= self.config.warmup_steps else 1.0
        self.step += 1
        metrics, self.metrics = self.metrics, StepMetrics()
        return metrics

    def _next_round(self, agreement: Agreement) -> None:
        """A new round, on a new plan where one is due: from rank 0's gradient-ready order (after
        the first round), from the agreed costs (once the profiled rounds are over), at the
        density the schedule asks for, or where the plan trial switches plans."""
        elapsed = None if self._step_mark is None else time.perf_counter() - self._step_mark
        density_changed = self._apply_density_schedule()
        ready_order = agreement.ready_order()
        if ready_order is not None:
            self._rebuild_from_ready_order = False
            self.order = ready_order
            self.set_plan(self._build_plan(self.order))
        elif self._profiler is not None and self.step == self._profile_end:
            self.costs = self._settle(self.channels[0].submit(self._agree_costs), "cost-model agreement")
            self._profiler = None
            self.set_plan(self._build_plan(self.order, self.costs))
        elif density_changed:
            self.set_plan(self._build_plan(self.order, self.costs))
        elif elapsed is not None and self._trial_running():
            self._trial_step(elapsed)
        else:
            self._new_round()
        self._step_mark = time.perf_counter()

    # ---------------------------------------------------------------- DDP's reducer takes over
    @property
    def ddp_can_run(self) -> bool:
        """The next round is a plain all-reduce of the gradients as they are, which DDP's C++ reducer
        does with less CPU than these hooks (the engine's dense rounds: 1.015-1.036x its CPU,
        experiments/REPORT.md), and stays one until ``handed_off_step`` says otherwise.

        True between rounds when nothing but the plan trial can change the plan (profiling, the
        rebuild from the ready order, the dense warm-up and the density warm-up are over), the plan
        sparsifies nothing and has no sparse-gradient buffer, and the memory owes nothing and sends a
        dense gradient unchanged or has an optimizer that can take its state
        (``Memory.ddp_can_take_over``). The trial's sparse windows have sparse plans, and a trial that
        has not started cannot start on a plan with nothing sparse; its dense window (whose owed
        state it sets aside) qualifies, and then measures DDP's reducer, the dense step a hand-off
        would give. The same on every rank: each input is agreed or a function of the step."""
        return (
            self.plan.sparse_numel == 0  # first: a sparse run asks this every step
            and not self._coo
            and self.sync_enabled
            and not self._failed
            and not self._accumulated.pending
            and (self._profiler is None or self.step >= self._profile_end)
            and not self._rebuild_from_ready_order
            and self.step >= self.config.warmup_steps
            and self.sparsifier.density == self.target_density
            and self.config.density_warmup.density(self.step, self.target_density) == self.target_density
            and self.memory.ddp_can_take_over
            and not any(self.memory.owed_states())
        )

    def hand_off(self) -> None:
        """Stop synchronizing gradients (``ddp_can_run``: DDP's reducer takes over): the hooks go, and
        with them the round's buffers. The state stays, for ``handed_off_step``, checkpoints and a
        return (``attach``) where the plan trial's dense window ends on a sparse plan."""
        self.detach()
        self._dense_storage.clear()
        self._decode_storage.clear()
        total = sum(p.numel() * p.element_size() for p in self.params)
        self._handed_off_bytes = int(ring_allreduce_bytes(total, self.world_size))
        # this round's optimizer step still applies what the memory sent: its state moves to the
        # optimizer at the next round, before that round's step
        self._memory_to_optimizer = not self.memory.dense_as_is

    def take_back(self) -> None:
        """Synchronize the gradients again after ``hand_off``. What the memory handed to the
        optimizer comes back before the next backward, after this round's optimizer step used it."""
        self.attach()
        self._memory_from_optimizer = not self.memory.dense_as_is

    def take_memory_from_optimizer(self) -> bool:
        """Move the state ``Memory.hand_to_optimizer`` gave the optimizer back into the memory (also
        for a loaded checkpoint whose optimizer holds it). True where something moved."""
        self._memory_from_optimizer = False
        return self.memory.take_from_optimizer(dict(zip(self.names, self.params)))

    def _average_over_ranks_(self, tensors: list[Tensor]) -> None:
        """Average ``tensors`` in place over the ranks as a dense round does (scaled by 1/P, then
        summed), in one message on the first channel's group (idle between rounds)."""
        if not tensors:
            return
        flat = torch.cat([tensor.reshape(-1) for tensor in tensors]).mul_(1.0 / self.world_size)
        self._settle(self.channels[0].submit(lambda group: dist.all_reduce(flat, group=group)), "hand-off to DDP")
        torch._foreach_copy_(tensors, [piece.view_as(tensor) for piece, tensor in zip(flat.split([t.numel() for t in tensors]), tensors)])

    def handed_off_step(self) -> StepMetrics:
        """A step DDP's reducer synchronized after ``hand_off``: counted, with the traffic of its ring
        all-reduce of every gradient, its summed gradients checked as a dense round's are (a non-finite
        one raises or drops the step as ``nonfinite`` says; with a GradScaler the scaler skips it), and
        timed for the plan trial's dense window, which may end here on another plan (then
        ``ddp_can_run`` is False and the engine's hooks must come back). Its exposed communication is
        not measured: DDP waits for it inside the backward."""
        if self._memory_to_optimizer:
            self._memory_to_optimizer = False
            self.memory.hand_to_optimizer(dict(zip(self.names, self.params)), self._average_over_ranks_)
        self._accumulated.pending = False
        elapsed = None if self._step_mark is None else time.perf_counter() - self._step_mark
        ring = self._handed_off_bytes
        metrics = StepMetrics(
            bytes_sent=ring, bytes_received=ring, padded_bytes_sent=ring, padded_bytes_received=ring,
            dense_equivalent_bytes=ring, dense_tensors=len(self.params), requested_density=self.sparsifier.density,
        )
        if self.grad_scaler is None and not bool(all_finite(_local_gradients(self.params))):
            self._refuse_nonfinite(self.step, "in the all-reduced dense gradients")
            metrics.skipped_steps = 1
            self._step_mark = None  # the next step's time would span this one too
            return metrics
        self.step += 1
        if elapsed is not None and self._trial_running():
            self._trial_step(elapsed)
        self._step_mark = time.perf_counter()
        return metrics

    # ---------------------------------------------------------------- the plan trial
    @property
    def plan_trial(self) -> dict[str, Any] | None:
        """The plan trial's phase and agreed median steps (None without a trial)."""
        return None if self._trial is None else self._trial.state_dict()

    def _trial_running(self) -> bool:
        """The step that just ended ran on the plan of the agreed costs at the target density, and
        that plan sparsifies something (or is one the trial switched to)."""
        return (
            self._trial is not None and self._trial.active and self.costs is not None
            and self.step > self._profile_end and self.sparsifier.density == self.target_density
            and (self._trial.phase != SPARSE or any(buffer.sparse_slots for buffer in self.plan.buffers))
        )

    def _trial_step(self, seconds: float) -> None:
        trial = self._trial
        if not trial.record(seconds):
            self._new_round()
            return
        if trial.phase == SPARSE:
            entered = trial.end_sparse(self._agreed_mean, self._fusable(), self._dense_floor())
        elif trial.phase == FUSED:
            entered = trial.end_fused(self._agreed_mean)
        elif trial.phase == RECUT:
            entered = trial.end_recut(self._agreed_mean, self._dense_floor())
        elif trial.phase == DENSE_PHASE:
            entered = trial.end_dense(self._agreed_mean)
        else:
            entered = trial.end_confirm(self._agreed_mean)
        if not trial.active and dist.get_rank() == 0:  # a trial runs only between ranks
            log.info("ssfusion: plan trial: %s", trial.summary())
        self._hold_owed(entered == DENSE_PHASE)
        self._replan_for_trial(
            fused=entered == FUSED or trial.fused_kept, dense=entered == DENSE_PHASE or trial.dense_kept
        )

    def _hold_owed(self, hold: bool) -> None:
        """Set the memory's owed state aside through the dense window, and put it back after.

        The window's dense slots would otherwise send every tensor's owed error feedback at once:
        at P = 2, 300 Mbit/s and density 0.1%, the digits curve fell 6-12 points in the window in
        3 of 3 seeds, and not with the trial off; set aside, the median gap in the window was -0.7 and
        -3.2 points (experiments/REPORT.md, "The trial's dense window sets aside what the error
        feedback owes"). A window that ends sparse flushes nothing; one that keeps dense flushes at
        its first kept dense step, as any re-plan to dense does."""
        if hold and self._held_owed is None:
            self._held_owed = set_aside(self.memory)
        elif not hold and self._held_owed is not None:
            put_back(self.memory, self._held_owed)
            self._held_owed = None

    def _fusable(self) -> bool:
        """The costs' plan has more buffers than its one-buffer version (the auto cut made several)."""
        fused = self._build_plan(self.order, replace(self.costs, fused_measured_faster=True))
        return len(fused.buffers) < len(self._build_plan(self.order, self.costs).buffers)

    def _replan_for_trial(self, fused: bool, dense: bool) -> None:
        """Re-plan where the trial's next phase or its outcome asks for one buffer or for every
        buffer sent dense (comm=auto's fallback); else the round goes on with the current plan."""
        if (fused, dense) == (self.costs.fused_measured_faster, self.costs.dense_measured_faster):
            self._new_round()
            return
        self.costs = replace(self.costs, fused_measured_faster=fused, dense_measured_faster=dense)
        self.set_plan(self._build_plan(self.order, self.costs))

    def _dense_floor(self) -> float:
        """The modelled dense all-reduce of every parameter in one message: no dense step is shorter."""
        total_bytes = sum(p.numel() * p.element_size() for p in self.params)
        return self.costs.dense_seconds(total_bytes, 1)

    def _agreed_mean(self, value: float) -> float:
        """The mean of ``value`` over the ranks, on the first channel's group (it is idle between rounds)."""
        device = self.channels.device
        return self._settle(
            self.channels[0].submit(lambda group: mean_over_ranks(value, group, device)), "plan-trial agreement"
        )

    def _agree_costs(self, group: dist.ProcessGroup | None) -> CostProfile:
        """Measure the links on this group, then take every number's max over the ranks."""
        device = self.channels.device
        links = measure_links(("allreduce", "allgather"), group, device)
        hierarchy = self.channels[0].hierarchy  # this channel's own groups: measured on its thread
        if hierarchy is not None and hierarchy.nodes > 1 and hierarchy.ranks_per_node > 1:
            links["node"] = measure_link("allgather", hierarchy.local, device)
            links["cross"] = measure_link("allgather", hierarchy.cross, device)
        local = self._profiler.local_vector(self.channels.cpu_seconds_per_job())
        spread = self.communicator.selection_spread(self.world_size)
        spread = 1.0 if spread is None else spread
        serial_cpu = self._serial_cpu(group)
        return agree(local, self.names, links, self.world_size, group, device, spread, serial_cpu)

    def _serial_cpu(self, group: dist.ProcessGroup | None) -> float:
        """1 where no rank has a spare core (read from the ranks' hosts and affinities), else timed."""
        device = self.channels.device
        if every_rank_lacks_spare_core(gather_cores(group, device)):
            if dist.get_rank() == 0:
                log.info("ssfusion: serial CPU share 1: every rank's cores are held by ranks (not timed)")
            return 1.0
        return measure_serial_cpu(sync=barrier_of(group, device))

    def _drop_round(self, where: str, globally_used: list[int] | None) -> StepMetrics:
        """Every rank drops the round alike: error feedback and thresholds untouched, and either
        no gradient written or, with a GradScaler, inf in every gradient the round would have
        written, so that the scaler skips the step and lowers its scale."""
        if self._round.sparsifier_snapshot is not None:
            self.sparsifier.load_state_dict(self._round.sparsifier_snapshot)
        step = self.step
        self._step_mark = None  # the next step's time would span this one too
        self._new_round()
        if self._current_loss_scale() is not None:
            for position, param in enumerate(self.params):
                if globally_used is None or globally_used[position]:
                    if param.grad is None or param.grad.is_sparse:
                        param.grad = torch.full_like(param, math.inf)
                    else:
                        param.grad.fill_(math.inf)
            metrics, self.metrics = self.metrics, StepMetrics()
            metrics.skipped_steps = 1
            return metrics
        self._refuse_nonfinite(step, where)
        metrics, self.metrics = self.metrics, StepMetrics()
        metrics.skipped_steps = 1
        return metrics

    def _refuse_nonfinite(self, step: int, where: str) -> None:
        """``nonfinite``'s answer to a non-finite round without a GradScaler: raise on every rank, or
        drop every gradient, so that the optimizer skips the step."""
        if self.config.nonfinite == "raise":
            raise NonFiniteGradientError(
                f"ssfusion: non-finite (NaN/Inf) gradient at step {step} {where}; every rank stops here. "
                "Pass nonfinite='skip' to drop such steps instead"
            )
        for param in self.params:
            param.grad = None  # optimizers skip parameters without a gradient

    def _settle(self, item: Any, what: str) -> Any:
        """Wait for a worker job's value (a launched buffer, a control collective)."""
        if not isinstance(item, Future):
            return item
        value = self._guarded(what, item.result)
        return value.get(self.channels.device) if isinstance(value, Completed) else value

    def _wait(self, buffer: Buffer, pending: PendingReduction) -> Reduced:
        # under a per-buffer communicator the buffer's own scheme too: "auto: zen"
        scheme = f"{self.communicator.name}: {buffer.comm}" if buffer.comm else self.communicator.name
        what = f"buffer {buffer.index} ({scheme} on process group {buffer.channel % len(self.channels)})"
        with self.timeline.span("wait", buffer.index):
            return self._guarded(what, pending.wait)

    def _guarded(self, what: str, wait) -> Any:
        """A failure or a time-out becomes a CommunicationError naming the step and what failed."""
        try:
            return wait(timeout=self.config.timeout_seconds)
        except FutureTimeout:
            self._failed = True
            raise CommunicationError(
                f"ssfusion: step {self.step}: {what} did not complete within {self.config.timeout_seconds}s "
                "(a rank may have died or a link gone down)"
            ) from None
        except Exception as error:
            self._failed = True
            raise CommunicationError(f"ssfusion: step {self.step}: {what} failed: {error}") from error

    def _write_gradients(
        self, buffer: Buffer, reduced: Reduced, encoded: Encoded, globally_used: list[int] | None
    ) -> None:
        written = [slot for slot in buffer.slots if globally_used is None or globally_used[slot.param]]
        sparse, owned = reduced.sparse, isinstance(reduced.sparse, SparseSum)
        if owned:
            self._release_local_gradients(buffer, encoded, written)
            sparse = sparse.dense(self._decode_storage_for(buffer, sparse) if globally_used is None else None)
        targets, values = [], []
        for slot in written:
            param = self.params[slot.param]
            part = sparse if slot.sparse else reduced.dense
            value = part[slot.offset : slot.offset + slot.numel].view(slot.shape)
            if slot.param in self._coo:
                param.grad = _row_sparse(value)
            elif owned and slot.sparse and param.is_contiguous() and value.dtype == param.dtype:
                param.grad = value  # the decoded sum is this round's own: its views are the gradients
            elif param.grad is None or param.grad.is_sparse:
                # in the parameter's memory format (channels_last stays channels_last), as DDP's are
                param.grad = torch.empty_like(param).copy_(value)
            else:
                targets.append(param.grad)
                values.append(value)
        if targets:
            # one call for a CNN's dozens of small gradients, where each copy's dispatch outweighs its data
            torch._foreach_copy_(targets, values)

    def _decode_storage_for(self, buffer: Buffer, total: SparseSum) -> Tensor | None:
        """Host memory kept between rounds to decode a buffer's sparse sum into; None on a GPU.

        A new host tensor of a large buffer comes as fresh pages, faulted in as they are zeroed:
        on gpt2_10m (three buffers, 10.7M sparse elements, P = 2) the zeros took 4.6-5.8 ms a
        buffer where zeroing kept memory takes about 1 ms. The cost is memory: the kept total
        is alive through the next backward (mlp12m's peak RSS: +0.37 gradient sizes). A GPU's
        caching allocator reuses its blocks, so there the total is not kept. The gradients
        written from it are views of it until the next decode, as with DDP's
        ``gradient_as_bucket_view``; so it is used only where every slot of the buffer is
        written (no ``find_unused_parameters`` round), whose gradients are all released first."""
        if self.channels.device.type != "cpu":
            return None
        key = (buffer.index, total.numel)
        storage = self._decode_storage.get(key)
        if storage is None:
            storage = torch.empty(total.numel, dtype=accumulation_dtype(total.dtype), device=self.channels.device)
            self._decode_storage[key] = storage
        return storage

    def _release_local_gradients(self, buffer: Buffer, encoded: Encoded, written: list[Slot]) -> None:
        """The buffer's local sparse gradients are in the error feedback now (committed): drop every
        reference to them, so that the sum decoded next takes their memory instead of adding to it."""
        encoded.updates = []
        self._round.pieces[buffer.index] = [None] * len(buffer.slots)
        for slot in written:
            if slot.sparse and slot.param not in self._coo:
                self.params[slot.param].grad = None

    def _count_traffic(self, buffer: Buffer, reduced: Reduced) -> None:
        t = reduced.traffic
        self.metrics.bytes_sent += t.sent
        self.metrics.bytes_received += t.received
        self.metrics.padded_bytes_sent += t.padded_sent
        self.metrics.padded_bytes_received += t.padded_received
        element = self.params[buffer.slots[0].param].element_size()
        self.metrics.dense_equivalent_bytes += int(ring_allreduce_bytes(buffer.numel * element, self.world_size))

    # ---------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """This rank's state in checkpoint format: tensors and plain values only (see ``state.py``)."""
        return {
            "format": engine_state.FORMAT,
            "step": self.step,
            "plan": engine_state.encode_plan(self.plan),
            "order": list(self.order),
            "costs": engine_state.encode_costs(self.costs),
            "sparsifier": engine_state.plain(self.sparsifier.state_dict(), "sparsifier state"),
            "memory": engine_state.plain(self._memory_state(), "memory state"),
            "communicator": engine_state.plain(self.communicator.state_dict(), "communicator state"),
            "accumulated": self._accumulated.saved(self.names, self.params),
            "trial": self.plan_trial,
        }

    def _memory_state(self) -> dict[str, Any]:
        """The memory's state with what the dense window set aside put back: a checkpoint owes the
        same mass whichever step wrote it (a resumed dense window sets it aside again)."""
        if self._held_owed is None:
            return self.memory.state_dict()
        self._hold_owed(False)
        state = self.memory.state_dict()
        self._hold_owed(True)
        return state

    def check_state(self, state: Any) -> dict[str, Any]:
        """Refuse a state that is corrupted or belongs to another model, with a clear error; return
        it in the current format (an older format is migrated)."""
        planned = [(spec.name, spec.numel) for _, spec in self.specs(range(len(self.params)))]
        return engine_state.check(state, planned, len(self.params))

    def load_state_dict(
        self, state: dict[str, Any], per_rank: bool = True, replan: bool = False, fresh: Collection[str] = ()
    ) -> None:
        """Restore a rank's state. ``per_rank=False`` (another world size): keep the step counter
        and the plan, start error feedback and sparsifier state afresh. ``replan``: the
        configuration changed so that the saved plan no longer fits: plan anew from the saved
        gradient order and costs. ``fresh``: components ("sparsifier", "communicator") whose saved
        state belongs to another configuration, so they start afresh."""
        state = self.check_state(state)
        self.step = state["step"]
        self._rebuild_from_ready_order = False
        self.order = list(state["order"])
        self.costs = engine_state.decode_costs(state["costs"])
        if self._trial is not None and state.get("trial") is not None:
            self._trial.load_state_dict(state["trial"])
        if self._profiler is not None and self.costs is None and self.step >= self._profile_end:
            # this run plans from costs (or offloads by them) and the saved run never measured any
            # (another fusion policy or offload choice): measure them now, then re-plan as usual
            self._profile_start = max(self.step, self._profile_start)
            self._profile_end = self._profile_start + self.config.profile_steps
        elif self.step >= self._profile_end:
            self._profiler = None
        self._held_owed = None
        if not per_rank:
            self.memory.reset()
        else:
            device = self.channels.device
            # Put back right before the next backward: Lightning clears .grad while it restarts.
            self._accumulated.restore(state.get("accumulated"))
            if "sparsifier" not in fresh:
                self.sparsifier.load_state_dict(_to_device(state["sparsifier"], device))
            self.memory.load_state_dict(_to_device(state["memory"], device))
            if "communicator" not in fresh:
                self.communicator.load_state_dict(_to_device(state["communicator"], device))
        self._hold_owed(self._trial is not None and self._trial.phase == DENSE_PHASE)
        # the saved plan is the one of the saved step, made at that step's density
        replan = self._apply_density_schedule() or replan
        # after the memory, so the new plan is set against the restored residuals
        self.set_plan(self._build_plan(self.order, self.costs) if replan else engine_state.decode_plan(state["plan"]))

    def close(self) -> list[dist.ProcessGroup]:
        """Remove the hooks and stop the workers (without waiting on them after a failure). Returns
        the process groups a collective may still be running on: they must not be destroyed."""
        self.detach()
        wait = not self._failed
        if self.offloader is not None:
            self.offloader.shutdown(wait)
        return self.channels.shutdown(wait)


def _to_device(state: Any, device: torch.device) -> Any:
    if isinstance(state, Tensor):
        return state.to(device)
    if isinstance(state, dict):
        return {k: _to_device(v, device) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(_to_device(v, device) for v in state)
    return state


def _flat_rows(indices: Tensor, shape: Sequence[int]) -> Tensor:
    """Row-major positions of a COO tensor's index columns in its sparse dimensions ``shape``."""
    flat = indices[0]
    for dim in range(1, len(shape)):
        flat = flat * shape[dim] + indices[dim]
    return flat


def _row_sparse(summed: Tensor) -> Tensor:
    """A coalesced COO tensor with one sparse dimension (the layout of an embedding's gradient)
    holding the rows of ``summed`` that have a nonzero. (A row whose sum is exactly zero is left
    out, where DDP's sparse all-reduce would keep it as explicit zeros.)"""
    rows = summed.reshape(summed.shape[0], -1).ne(0).any(dim=1).nonzero().view(-1)
    return torch.sparse_coo_tensor(rows.unsqueeze(0), summed.index_select(0, rows), summed.shape, is_coalesced=True)


def _local_gradients(params: Sequence[Tensor]) -> list[Tensor]:
    """This rank's gradients as dense-layout tensors (a sparse one by its values)."""
    return [p.grad.coalesce().values() if p.grad.is_sparse else p.grad for p in params if p.grad is not None]

