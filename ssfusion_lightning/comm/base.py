"""Communicators: how one encoded buffer is summed across ranks on the strategy's channels."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import torch
from torch import Tensor

from ssfusion_lightning.comm.channels import ChannelSet, result
from ssfusion_lightning.comm.schemes import SparseSum
from ssfusion_lightning.comm.traffic import Traffic
from ssfusion_lightning.costmodel import CostProfile
from ssfusion_lightning.registry import Registry
from ssfusion_lightning.vocabulary import Buffer, Encoded, Plan

#: the plan's note (``plan.notes["comm"]``) for a buffer sent dense in place of its selections
DENSE = "dense"


@dataclass
class Reduced:
    """A buffer's result: the summed dense part and the summed sparse part (dense, sparse-part
    sized, or a ``SparseSum`` the engine decodes once the local gradients are released)."""

    dense: Tensor | None
    sparse: Tensor | SparseSum | None
    traffic: Traffic
    #: sparse-part positions that were applied globally; None means everything sent was applied
    applied: Tensor | None = None


class PendingReduction:
    """Futures of one buffer's jobs; ``wait`` gathers them into a Reduced."""

    def __init__(self, dense: Future | None, sparse: Future | None, device: torch.device) -> None:
        self._dense = dense
        self._sparse = sparse
        self._device = device

    def wait(self, timeout: float | None = None) -> Reduced:
        traffic = Traffic()
        dense = sparse = applied = None
        if self._dense is not None:
            dense, part = result(self._dense, self._device, timeout)
            traffic += part
        if self._sparse is not None:
            sparse, part, applied = result(self._sparse, self._device, timeout)
            traffic += part
        return Reduced(dense, sparse, traffic, applied)


@dataclass(frozen=True)
class CommContext:
    """What a communicator may decide a plan's per-buffer schemes from; identical on every rank."""

    world_size: int
    #: the agreed cost profile; None before the costs are measured
    costs: CostProfile | None
    #: bytes per value of each buffer (by buffer index)
    value_bytes: dict[int, int]
    #: (ranks per node, nodes) when the channels have node-local and cross-node groups
    layout: tuple[int, int] | None = None


class Communicator(ABC):
    name: ClassVar[str] = ""
    #: the communicator decides from measured costs: the engine profiles the first rounds for it
    needs_costs: ClassVar[bool] = False
    #: the communicator runs on node-local and cross-node groups (``Channel.hierarchy``)
    needs_hierarchy: ClassVar[bool] = False
    #: the communicator can use those groups when nodes hold several ranks each
    may_use_hierarchy: ClassVar[bool] = False
    #: the dense part is summed element-wise by one all-reduce, whatever its length: the engine
    #: may append control entries to it (the non-finite vote) instead of a round of their own
    sums_dense: ClassVar[bool] = False
    #: the sparse part is summed exactly (Ok-Topk keeps about k entries of the sum instead)
    exact: ClassVar[bool] = True
    #: steps per phase of the engine's measured plan trial (``engine/trial.py``); 0: none
    dense_trial_steps: int = 0
    #: how many times faster a step the trial's sparse plan must measure than dense to stay
    min_sparse_speedup: float = 1.0

    def __init__(self, dense_trial_steps: int = 0, min_sparse_speedup: float = 1.0, **options: Any) -> None:
        """``dense_trial_steps``: time this many steps of the plan, and where the link leaves dense
        a chance as many sent dense (DDP's buckets, this communicator's dense path), and keep the
        faster (``engine/trial.py``): a fixed scheme's guard against running slower than DDP on a
        link fast enough that sparsifying does not pay. 0 (the default): every planned selection is
        kept.

        ``min_sparse_speedup``: the trial keeps the sparse plan only where dense's step measured at
        least this many times its step (1.0, the default: the faster step wins). A selection
        costs steps to accuracy as well as saving time a step, which the trial does not see. At
        1.2 on a 300 Mbit/s link (three seeds) the byte-level LM with residual error feedback
        reached DDP's loss in 2 of 3 seeds at P = 2 instead of 0, but the digits CNN's time to
        accuracy did not improve and with ``memory="auto"`` it fell from 1.42x DDP's to 0.81x at
        P = 4 (experiments/REPORT.md, "Asking the sparse plan for a speed-up"): so not the default."""
        if options:
            raise TypeError(f"communicator {self.name!r} got unknown options {sorted(options)}")
        if isinstance(dense_trial_steps, bool) or not isinstance(dense_trial_steps, int) or dense_trial_steps < 0:
            raise ValueError(f"communicator {self.name!r}: dense_trial_steps must be an integer >= 0, got {dense_trial_steps!r}")
        if (
            isinstance(min_sparse_speedup, bool) or not isinstance(min_sparse_speedup, (int, float))
            or not math.isfinite(min_sparse_speedup) or min_sparse_speedup < 1.0
        ):
            raise ValueError(
                f"communicator {self.name!r}: min_sparse_speedup must be a finite number >= 1.0 (1.0: the faster step "
                f"wins), got {min_sparse_speedup!r}"
            )
        self.dense_trial_steps = dense_trial_steps
        self.min_sparse_speedup = float(min_sparse_speedup)

    @abstractmethod
    def launch(self, encoded: Encoded, buffer: Buffer, channels: ChannelSet) -> PendingReduction:
        """Submit the buffer's collectives (in a fixed order) and return without waiting."""

    def assign(self, plan: Plan, context: CommContext) -> Plan:
        """The plan with each buffer's scheme recorded (``Buffer.comm``), for communicators that
        choose per buffer; a pure function of the plan and ``context``, so every rank agrees.
        This one sends every buffer alike: a choice left by another communicator (a plan resumed
        from a checkpoint of ``auto``) is cleared, so the plan says what is sent. Where the plan
        trial measured dense faster, every buffer that sparsifies is sent dense instead (noted
        ``DENSE``, so that the engine re-cuts those runs as DDP's buckets)."""
        costs = context.costs
        if self.dense_trial_steps and costs is not None and costs.dense_measured_faster:
            notes = [DENSE if buffer.sparse_slots else "" for buffer in plan.buffers]
            buffers = tuple(buffer.densified("") if buffer.sparse_slots else replace(buffer, comm="") for buffer in plan.buffers)
            return Plan(buffers, {**plan.notes, "comm": notes})
        if not any(buffer.comm for buffer in plan.buffers):
            return plan
        notes = {key: value for key, value in plan.notes.items() if key != "comm"}
        return Plan(tuple(replace(buffer, comm="") for buffer in plan.buffers), notes)

    def set_plan(self, plan: Plan) -> None:
        """The engine's plan changed: drop what was kept for buffers the new plan no longer has."""
        return None

    def selection_spread(self, world_size: int) -> float | None:
        """How far the ranks' selections spread, as measured on the sums so far (see
        ``CostProfile.selection_spread``); None when this communicator measures nothing."""
        return None

    def carries_votes(self, buffer: Buffer) -> bool:
        """Whether the buffer's sparse exchange delivers ``Encoded.votes`` (one flag per rank, the
        engine's non-finite vote) from every rank to every rank, filled in place by the time the
        reduction is waited for, so that the vote needs no round of its own. Asked between rounds;
        the answer must be the same on every rank."""
        return False

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        return None


COMMUNICATORS: Registry[Communicator] = Registry("communicator")
