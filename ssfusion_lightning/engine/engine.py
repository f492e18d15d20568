"""The fusion engine: plan -> hook -> buffer -> sparsify -> communicate -> write gradients.

Free of Lightning: the strategy creates it with the model's parameters and its own channels,
calls ``finish`` after every backward and toggles ``sync_enabled`` for gradient accumulation.
"""

from __future__ import annotations

import copy
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, replace
from typing import Any, Collection, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ssfusion_lightning.comm import ChannelSet, Communicator, PendingReduction, Reduced
from ssfusion_lightning.comm.channels import Completed
from ssfusion_lightning.comm.traffic import ring_allreduce_bytes
from ssfusion_lightning.costmodel import CostProfile, Profiler, agree, measure_link
from ssfusion_lightning.engine import state as engine_state
from ssfusion_lightning.engine.errors import CommunicationError, NonFiniteGradientError
from ssfusion_lightning.engine.metrics import StepMetrics
from ssfusion_lightning.engine.offload import Offloader, to_device
from ssfusion_lightning.engine.plan import Buffer, ParamSpec, Plan
from ssfusion_lightning.fusion import CompressContext, Encoded, FusionPolicy, PlanContext
from ssfusion_lightning.sparsifiers import Memory, Sparsifier


@dataclass
class EngineConfig:
    buffer_bytes: float
    #: cap of the buffer that closes first in backward order (None: buffer_bytes)
    first_buffer_bytes: float | None = None
    warmup_steps: int = 0
    find_unused_parameters: bool = False
    offload: str = "none"
    #: rounds measured before cost-driven plans (and offload="auto") are frozen
    profile_steps: int = 3
    #: "raise": every rank raises at a step where some rank's gradient is non-finite;
    #: "skip": every rank drops that step (no gradient written, error feedback untouched)
    nonfinite: str = "raise"
    #: seconds to wait for one buffer's collectives before failing the step
    timeout_seconds: float | None = None


NONFINITE_POLICIES = ("raise", "skip")

def dense_version(plan: Plan) -> Plan:
    """The same buffers with every tensor sent dense (warm-up steps)."""
    buffers = []
    for buffer in plan.buffers:
        offset, slots = 0, []
        for slot in buffer.slots:
            slots.append(replace(slot, sparse=False, k=slot.numel, offset=offset))
            offset += slot.numel
        buffers.append(replace(buffer, slots=tuple(slots)))
    return Plan(tuple(buffers))


def offload_decisions(plan: Plan, costs: CostProfile) -> list[bool]:
    """SSFusion-O's greedy rule, walking buffers in backward order: offload a buffer when the
    worker is free by the time it is ready and its compression ends before the next buffer is
    ready (the last buffer never: nothing is left to overlap it with)."""
    ready, clock = [], 0.0
    for buffer in plan.buffers:
        clock += sum(costs.backward_seconds(slot.name) for slot in buffer.slots)
        ready.append(clock)
    flags, worker_free = [], 0.0
    for j, buffer in enumerate(plan.buffers):
        compress = sum(costs.compress_seconds(slot.numel) for slot in buffer.sparse_slots)
        offload = bool(buffer.sparse_slots) and j + 1 < len(ready) and worker_free <= ready[j] and ready[j] + compress <= ready[j + 1]
        if offload:
            worker_free = ready[j] + compress
        flags.append(offload)
    return flags


def reversed_buffers(plan: Plan, num_channels: int) -> Plan:
    """Launch order reversed (DDP's first-round guess: gradients of late layers are ready first).
    As in DDP's first round, buffers are cut in registration order (a small first buffer then holds
    the first layers) and only then reversed, so every buffer's layout is DDP's bucket's."""
    buffers = tuple(
        replace(buffer, index=i, channel=i % num_channels) for i, buffer in enumerate(reversed(plan.buffers))
    )
    return Plan(buffers, plan.notes)


class FusionEngine:
    def __init__(
        self,
        named_params: Sequence[tuple[str, nn.Parameter]],
        sparsifier: Sparsifier,
        memory: Memory,
        policy: FusionPolicy,
        communicator: Communicator,
        channels: ChannelSet,
        config: EngineConfig,
    ) -> None:
        self.params = [p for _, p in named_params]
        self.names = [n for n, _ in named_params]
        self.sparsifier = sparsifier
        self.memory = memory
        self.policy = policy
        self.communicator = communicator
        self.channels = channels
        self.config = config
        self.world_size = dist.get_world_size(channels[0].group) if dist.is_initialized() else 1
        self.step = 0
        self.sync_enabled = True
        self.metrics = StepMetrics()
        self._hooks: list[Any] = []
        self._failed = False
        self._accumulating = False
        self._restored_accumulation: dict[str, Tensor] | None = None
        self._dense_storage: dict[tuple[int, int], Tensor] = {}
        # Like DDP: the first round runs in registration order, then the plan is rebuilt once
        # from the gradient-ready order rank 0 observed (DDP skips this with find_unused_parameters).
        self._rebuild_from_ready_order = not config.find_unused_parameters
        self.order = list(reversed(range(len(self.params))))
        self.costs: CostProfile | None = None
        self.offloader = Offloader(config.offload, channels.device) if config.offload != "none" else None
        needs_profile = policy.needs_costs or config.offload == "auto"
        self._profile_start = max(1, config.warmup_steps)
        self._profile_end = self._profile_start + config.profile_steps if needs_profile else 0
        self._profiler = Profiler(self.names) if needs_profile else None
        self.set_plan(reversed_buffers(self._build_plan(list(range(len(self.params)))), len(channels)))

    # ---------------------------------------------------------------- plan
    def specs(self, order: Sequence[int]) -> list[tuple[int, ParamSpec]]:
        return [(i, ParamSpec(self.names[i], tuple(self.params[i].shape), self.params[i].dtype)) for i in order]

    def _build_plan(self, order: Sequence[int], costs: Any = None) -> Plan:
        ctx = PlanContext(
            self.sparsifier, self.config.buffer_bytes, len(self.channels), self.world_size, costs, self.config.first_buffer_bytes
        )
        return self.policy.plan(self.specs(order), ctx)

    def set_plan(self, plan: Plan) -> None:
        self.plan = plan
        self._dense_plan = dense_version(plan)
        self._dense_storage.clear()
        self._offload_flags = self._decide_offload(plan)
        self._reset_round()

    def _decide_offload(self, plan: Plan) -> list[bool]:
        """thread/stream: every buffer; auto: the greedy rule on agreed costs (none before them)."""
        if self.offloader is None:
            return [False] * len(plan.buffers)
        if self.config.offload != "auto":
            return [True] * len(plan.buffers)
        if self.costs is None:
            return [False] * len(plan.buffers)
        return offload_decisions(plan, self.costs)

    @property
    def profiling(self) -> bool:
        return self._profiler is not None and self._profile_start <= self.step < self._profile_end

    def begin_backward(self) -> None:
        if self._restored_accumulation is not None:
            for name, param in zip(self.names, self.params):
                grad = self._restored_accumulation.get(name)
                param.grad = None if grad is None else grad.to(param.device)
            self._restored_accumulation = None
            self._accumulating = True
        if not self.sync_enabled:
            self._accumulating = True  # local gradients pile up until the synchronized backward
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

        return hook

    def _reset_round(self) -> None:
        plan = self.active_plan
        # A sparse plan needs every rank to know whether any rank's gradients were non-finite.
        # When the last buffer has a dense part, compressed after every other buffer, the vote
        # rides at its end (one entry per rank) instead of taking a round of its own.
        self._vote_in_dense = (
            plan.sparse_numel > 0
            and plan.buffers[-1].dense_numel > 0
            and self.communicator.sums_dense
            and not any(self._offload_flags)  # an offloaded buffer may finish its check later
        )
        self._buffer_of = plan.buffer_of
        self._missing = [len(b.slots) for b in plan.buffers]
        self._used = [False] * len(self.params)
        self._ready_order: list[int] = []
        self._finite: list[Tensor] = []
        self._sparsifier_snapshot: dict[str, Any] | None = None  # taken at the round's first launch
        self._next = 0
        self._pending: list[tuple[Buffer, PendingReduction, Encoded]] = []

    def _mark_ready(self, position: int) -> None:
        if self._used[position]:
            return
        self._used[position] = True
        self._ready_order.append(position)
        if self.profiling:
            self._profiler.ready(self.names[position])
        self._missing[self._buffer_of[position]] -= 1
        self._launch_ready()

    def _launch_ready(self) -> None:
        buffers = self.active_plan.buffers
        while self._next < len(buffers) and self._missing[self._next] == 0:
            self._launch(buffers[self._next])
            self._next += 1

    # ---------------------------------------------------------------- buffer -> sparsify -> communicate
    def _carries_vote(self, buffer: Buffer) -> bool:
        return self._vote_in_dense and buffer.index == len(self.active_plan.buffers) - 1

    def _dense_out(self, buffer: Buffer) -> Tensor | None:
        if buffer.dense_numel == 0:
            return None
        numel = buffer.dense_numel + (self.world_size if self._carries_vote(buffer) else 0)
        key = (buffer.index, numel)
        out = self._dense_storage.get(key)
        if out is None:
            first = self.params[buffer.slots[0].param]
            out = torch.empty(numel, dtype=first.dtype, device=first.device)
            self._dense_storage[key] = out
        return out

    def _launch(self, buffer: Buffer) -> None:
        grads = []
        for slot in buffer.slots:
            param = self.params[slot.param]
            grads.append(param.grad if param.grad is not None else torch.zeros_like(param))
        if self._sparsifier_snapshot is None:
            # selection may move thresholds: restore them if this round is dropped as non-finite
            self._sparsifier_snapshot = copy.deepcopy(self.sparsifier.state_dict())
        if self.offloader is None:
            self._pending.append(self._launch_encoded(buffer, self._compress(buffer, grads)))
        elif self._offload_flags[buffer.index]:
            if self.offloader.stages_on_host:
                grads = [self.offloader.stage(slot.param, [g])[0] if slot.sparse else g for slot, g in zip(buffer.slots, grads)]
            self._pending.append(self.offloader.submit(self._compress_and_launch, buffer, grads))
        else:
            # Launches still go through the worker, so channels see buffers in plan order.
            self._pending.append(self.offloader.submit(self._launch_encoded, buffer, self._compress(buffer, grads)))

    def _compress(self, buffer: Buffer, grads: list[Tensor]) -> Encoded:
        started = time.perf_counter()
        sparse = [g for slot, g in zip(buffer.slots, grads) if slot.sparse]
        if sparse:
            self._finite.append(all_finite(sparse))
        on_selected = self._profiler.compressed if self.profiling else None
        ctx = CompressContext(self.sparsifier, self.memory, 1.0 / self.world_size, on_selected)
        encoded = self.policy.compress(buffer, grads, self._dense_out(buffer), ctx)
        if self._carries_vote(buffer):
            self._health_vector(out=encoded.dense[buffer.dense_numel :])
        self.metrics.compress_seconds += time.perf_counter() - started
        return encoded

    def _compress_and_launch(self, buffer: Buffer, grads: list[Tensor]):
        encoded = self._compress(buffer, grads)
        if encoded.values is not None and encoded.values.device != self.channels.device:
            encoded = to_device(encoded, self.channels.device)
        return self._launch_encoded(buffer, encoded)

    def _launch_encoded(self, buffer: Buffer, encoded: Encoded) -> tuple[Buffer, PendingReduction, Encoded]:
        pending = self.communicator.launch(encoded, buffer, self.channels)
        self.metrics.buffers += 1
        self.metrics.dense_tensors += len(buffer.dense_slots)
        self.metrics.sparse_tensors += len(buffer.sparse_slots)
        self.metrics.elements_sent += buffer.dense_numel + (encoded.values.numel() if encoded.values is not None else 0)
        return buffer, pending, encoded

    # ---------------------------------------------------------------- write gradients
    def finish(self) -> StepMetrics:
        """Launch what is left (missing gradients count as zeros), wait, decode, write ``.grad``."""
        if not self.sync_enabled:
            return self.metrics
        buffers = self.active_plan.buffers
        while self._next < len(buffers):
            self._launch(buffers[self._next])
            self._next += 1
        # Every buffer must be on its channels before the control collectives are queued behind
        # them, or ranks could queue them in different orders: drain the offload worker first.
        self._accumulating = False
        launched = [self._settle(item, "compress and launch") for item in self._pending]
        # Only sparse slots need a vote: a dense sum carries any rank's NaN/Inf to every rank, so
        # the reduced dense parts are checked instead, at no extra round.
        vote_round = self.active_plan.sparse_numel and not self._vote_in_dense
        health = self.channels[0].submit(_allreduce_max, self._health_vector()) if vote_round else None
        usage = self._agree_on_usage() if self.config.find_unused_parameters else None
        ready_order = self._agree_on_ready_order() if self._rebuild_from_ready_order else None
        started = time.perf_counter()
        results = [(buffer, self._wait(buffer, pending), encoded) for buffer, pending, encoded in launched]
        if self._vote_in_dense:
            last, reduced, _ = results[-1]
            votes = reduced.dense[last.dense_numel :]
        else:
            votes = self._settle(health, "non-finite check") if health is not None else None
        unhealthy = [rank for rank, flag in enumerate(votes.tolist()) if flag] if votes is not None else []
        globally_used = self._settle(usage, "unused-parameter agreement").tolist() if usage is not None else None
        self.metrics.exposed_comm_seconds += time.perf_counter() - started
        if unhealthy:
            return self._drop_round(f"on rank(s) {unhealthy}")
        if not bool(all_finite([reduced.dense for _, reduced, _ in results if reduced.dense is not None])):
            own = "finite" if bool(all_finite([p.grad for p in self.params if p.grad is not None])) else "non-finite"
            return self._drop_round(f"in the all-reduced dense gradients (this rank's own were {own})")
        for buffer, reduced, encoded in results:
            self._write_gradients(buffer, reduced, globally_used)
            self._update_memory(encoded, reduced)
            self._count_traffic(buffer, reduced)
        self.sparsifier.advance()
        self.step += 1
        metrics, self.metrics = self.metrics, StepMetrics()
        if ready_order is not None:
            self._rebuild_from_ready_order = False
            self.order = self._settle(ready_order, "ready-order agreement").tolist()
            self.set_plan(self._build_plan(self.order))
        elif self._profiler is not None and self.step == self._profile_end:
            self.costs = self._settle(self.channels[0].submit(self._agree_costs), "cost-model agreement")
            self._profiler = None
            self.set_plan(self._build_plan(self.order, self.costs))
        else:
            self._reset_round()
        return metrics

    def _agree_costs(self, group: dist.ProcessGroup | None) -> CostProfile:
        """Measure the links on this group, then take every number's max over the ranks."""
        device = self.channels.device
        links = {name: measure_link(name, group, device) for name in ("allreduce", "allgather")}
        return agree(self._profiler.local_vector(), self.names, links, self.world_size, group, device)

    def _health_vector(self, out: Tensor | None = None) -> Tensor:
        """One entry per rank, 1 at this rank when any of its gradients this round was non-finite
        (written without a host sync, so a vote riding in a dense part does not stall the launch)."""
        vector = torch.zeros(self.world_size, dtype=torch.uint8, device=self.channels.device) if out is None else out.zero_()
        if self._finite:
            rank = dist.get_rank(self.channels[0].group) if self.world_size > 1 else 0
            vector[rank] = torch.logical_not(torch.stack(self._finite).all()).to(vector.dtype)
        return vector

    def _drop_round(self, where: str) -> StepMetrics:
        """Every rank drops the round alike: no gradient written, error feedback and thresholds untouched."""
        if self._sparsifier_snapshot is not None:
            self.sparsifier.load_state_dict(self._sparsifier_snapshot)
        step = self.step
        self._reset_round()
        if self.config.nonfinite == "raise":
            raise NonFiniteGradientError(
                f"ssfusion: non-finite (NaN/Inf) gradient at step {step} {where}; every rank stops here. "
                "Pass nonfinite='skip' to drop such steps instead"
            )
        for param in self.params:
            param.grad = None  # optimizers skip parameters without a gradient
        metrics, self.metrics = self.metrics, StepMetrics()
        metrics.skipped_steps = 1
        return metrics

    def _settle(self, item: Any, what: str) -> Any:
        """Wait for a worker job's value (a launched buffer, a control collective)."""
        if not isinstance(item, Future):
            return item
        value = self._guarded(what, item.result)
        return value.get(self.channels.device) if isinstance(value, Completed) else value

    def _wait(self, buffer: Buffer, pending: PendingReduction) -> Reduced:
        what = f"buffer {buffer.index} ({self.communicator.name} on process group {buffer.channel % len(self.channels)})"
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

    def _agree_on_ready_order(self) -> Future:
        """Rank 0's gradient-ready order (parameters it never saw last, in backward order)."""
        seen = set(self._ready_order)
        order = self._ready_order + [i for i in reversed(range(len(self.params))) if i not in seen]
        return self.channels[0].submit(_broadcast_from_rank0, torch.tensor(order, dtype=torch.int64, device=self.channels.device))

    def _agree_on_usage(self) -> Future:
        """DDP's find_unused_parameters: a parameter no rank used keeps ``.grad`` untouched."""
        used = torch.tensor(self._used, dtype=torch.uint8, device=self.channels.device)
        return self.channels[0].submit(_allreduce_max, used)

    def _write_gradients(self, buffer: Buffer, reduced: Reduced, globally_used: list[int] | None) -> None:
        for slot in buffer.slots:
            param = self.params[slot.param]
            if globally_used is not None and not globally_used[slot.param]:
                continue
            part = reduced.sparse if slot.sparse else reduced.dense
            value = part[slot.offset : slot.offset + slot.numel].view(slot.shape)
            if param.grad is None:
                param.grad = value.clone()
            else:
                param.grad.copy_(value)

    def _update_memory(self, encoded: Encoded, reduced: Reduced) -> None:
        for update in encoded.updates:
            sent = update.sent
            if reduced.applied is not None:
                sent = sent[torch.isin(sent + update.offset, reduced.applied.to(sent.device))]
            self.memory.update(update.key, update.compensated, sent)

    def _count_traffic(self, buffer: Buffer, reduced: Reduced) -> None:
        t = reduced.traffic
        self.metrics.bytes_sent += t.sent
        self.metrics.bytes_received += t.received
        self.metrics.padded_bytes_sent += t.padded_sent
        self.metrics.padded_bytes_received += t.padded_received
        element = self.params[buffer.slots[0].param].element_size()
        self.metrics.dense_equivalent_bytes += ring_allreduce_bytes(buffer.numel, element, self.world_size)

    # ---------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """This rank's state in checkpoint format: tensors and plain values only (see ``state.py``)."""
        accumulated = (
            # saved in the middle of gradient accumulation: the local sum so far (Lightning saves no .grad)
            {n: p.grad.detach().cpu().clone() for n, p in zip(self.names, self.params) if p.grad is not None}
            if self._accumulating
            else None
        )
        return {
            "format": engine_state.FORMAT,
            "step": self.step,
            "plan": engine_state.encode_plan(self.plan),
            "order": list(self.order),
            "costs": engine_state.encode_costs(self.costs),
            "sparsifier": engine_state.plain(self.sparsifier.state_dict(), "sparsifier state"),
            "memory": engine_state.plain(self.memory.state_dict(), "memory state"),
            "communicator": engine_state.plain(self.communicator.state_dict(), "communicator state"),
            "accumulated": accumulated,
        }

    def check_state(self, state: Any) -> dict[str, Any]:
        """Refuse a state that is corrupted or belongs to another model, with a clear error; return
        it in the current format (an older format is migrated)."""
        state = engine_state.upgrade(state)
        if not isinstance(state["step"], int) or not isinstance(state["order"], list):
            raise ValueError("corrupted engine state: 'step' must be an int and 'order' a list")
        plan = engine_state.decode_plan(state["plan"])
        saved = sorted((s.name, s.numel) for b in plan.buffers for s in b.slots)
        ours = sorted((spec.name, spec.numel) for _, spec in self.specs(range(len(self.params))))
        if saved != ours:
            differing = sorted({n for n, _ in ours} ^ {n for n, _ in saved})[:5]
            raise ValueError(
                f"the checkpoint's engine state belongs to a different model (parameters differ, e.g. {differing})"
            )
        if sorted(state["order"]) != list(range(len(self.params))):
            raise ValueError(f"corrupted engine state: 'order' is not a permutation of the {len(self.params)} parameters")
        engine_state.decode_costs(state["costs"])
        return state

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
        if self._profiler is not None and self.costs is None and self.step >= self._profile_end:
            # this run plans from costs (or offloads by them) and the saved run never measured any
            # (another fusion policy or offload choice): measure them now, then re-plan as usual
            self._profile_start = max(self.step, self._profile_start)
            self._profile_end = self._profile_start + self.config.profile_steps
        elif self.step >= self._profile_end:
            self._profiler = None
        if not per_rank:
            self.memory.reset()
        else:
            device = self.channels.device
            # Put back right before the next backward: Lightning clears .grad while it restarts.
            self._restored_accumulation = state.get("accumulated") or None
            if "sparsifier" not in fresh:
                self.sparsifier.load_state_dict(_to_device(state["sparsifier"], device))
            self.memory.load_state_dict(_to_device(state["memory"], device))
            if "communicator" not in fresh:
                self.communicator.load_state_dict(_to_device(state["communicator"], device))
        # after the memory, so the new plan is set against the restored residuals
        self.set_plan(self._build_plan(self.order, self.costs) if replan else engine_state.decode_plan(state["plan"]))

    def close(self) -> None:
        """Remove the hooks and stop the workers (without waiting on them after a failure)."""
        self.detach()
        wait = not self._failed
        if self.offloader is not None:
            self.offloader.shutdown(wait)
        self.channels.shutdown(wait)


def _to_device(state: Any, device: torch.device) -> Any:
    if isinstance(state, Tensor):
        return state.to(device)
    if isinstance(state, dict):
        return {k: _to_device(v, device) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(_to_device(v, device) for v in state)
    return state


def _broadcast_from_rank0(tensor: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    dist.broadcast(tensor, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    return tensor


def all_finite(tensors: list[Tensor]) -> Tensor:
    """A 0-d bool tensor (no host sync): min and max propagate NaN and +-Inf, and one aminmax pass
    costs a tenth of ``isfinite(t).all()`` on CPU."""
    bounds = [bound for t in tensors if t.numel() for bound in torch.aminmax(t)]
    if not bounds:
        return torch.ones((), dtype=torch.bool, device=tensors[0].device if tensors else None)
    return torch.isfinite(torch.stack(bounds)).all()


def _allreduce_max(tensor: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return tensor
