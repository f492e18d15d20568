"""The words every layer speaks: the plan of fusion buffers, and the message one buffer becomes.

The engine, the fusion policies and the communicators all import these types, and this module
imports nothing of the package's, so the imports run one way (``tests/test_import_layers.py``):

- the plan (``ParamSpec``, ``Slot``, ``Buffer``, ``Plan``): parameters in backward order, cut into
  fusion buffers. A plan is a pure function of the model, the configuration and (for cost-driven
  policies) costs that all ranks agreed on, so every rank computes the same plan and issues the
  same collectives;
- the message (``Encoded``, with its ``PendingUpdate`` records): one buffer compressed by a fusion
  policy, ready for a communicator to send.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from functools import cached_property
from typing import Collection, Sequence

import torch
from torch import Tensor


# ---------------------------------------------------------------- the plan
@dataclass(frozen=True)
class ParamSpec:
    """What the planner knows about one trainable parameter."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * torch.tensor([], dtype=self.dtype).element_size()


@dataclass(frozen=True)
class Slot:
    """One parameter's place in a buffer: its flat range and how it is sent."""

    name: str
    param: int  # position of the parameter in the engine's parameter list
    shape: tuple[int, ...]
    offset: int  # first element in its part: the buffer's dense part or its sparse part
    numel: int
    sparse: bool
    k: int  # elements to select when sparse; numel when dense


@dataclass(frozen=True)
class Buffer:
    """A fusion buffer: slots in backward order, sent together starting on ``channel``.

    The buffer has two flat index spaces: the dense part (its dense slots, concatenated) and the
    sparse part (its sparse slots, concatenated); sparse indices are positions in the sparse part.
    ``comm`` names the scheme a per-buffer communicator (``auto``) chose for it; "" for the others.
    """

    index: int
    slots: tuple[Slot, ...]
    channel: int
    comm: str = ""

    # cached (the buffer is frozen): the engine reads these for every tensor of every step
    @cached_property
    def numel(self) -> int:
        return sum(s.numel for s in self.slots)

    @cached_property
    def dense_slots(self) -> tuple[Slot, ...]:
        return tuple(s for s in self.slots if not s.sparse)

    @cached_property
    def sparse_slots(self) -> tuple[Slot, ...]:
        return tuple(s for s in self.slots if s.sparse)

    @cached_property
    def dense_numel(self) -> int:
        return sum(s.numel for s in self.dense_slots)

    @cached_property
    def sparse_numel(self) -> int:
        return sum(s.numel for s in self.sparse_slots)

    def densified(self, comm: str | None = None) -> Buffer:
        """The same tensors, every one sent dense (its dense part is the whole buffer); ``comm``:
        the scheme that runs it (default: this buffer's)."""
        return self.sending_dense({slot.param for slot in self.slots}, comm)

    def sending_dense(self, params: Collection[int], comm: str | None = None) -> Buffer:
        """The same tensors with those of the parameter positions ``params`` sent dense; both
        parts' offsets follow (``comm``: as in ``densified``)."""
        offsets, slots = {False: 0, True: 0}, []
        for slot in self.slots:
            sparse = slot.sparse and slot.param not in params
            k = slot.k if sparse else slot.numel
            slots.append(Slot(slot.name, slot.param, slot.shape, offsets[sparse], slot.numel, sparse, k))
            offsets[sparse] += slot.numel
        return Buffer(self.index, tuple(slots), self.channel, self.comm if comm is None else comm)


@dataclass(frozen=True)
class Plan:
    buffers: tuple[Buffer, ...]
    #: policy-specific facts worth reporting (e.g. the thresholds ``selective`` chose)
    notes: dict = field(default_factory=dict, compare=False, hash=False)

    def sending_dense(self, params: Collection[int]) -> Plan:
        """The same buffers with the tensors of the parameter positions ``params`` sent dense."""
        if not params:
            return self
        return Plan(tuple(buffer.sending_dense(params) for buffer in self.buffers), self.notes)

    def fingerprint(self) -> str:
        # a buffer's scheme counts only when chosen, so plans without one keep their fingerprints
        text = repr(
            [
                (b.index, b.channel, [(s.name, s.offset, s.numel, s.sparse, s.k) for s in b.slots]) + ((b.comm,) if b.comm else ())
                for b in self.buffers
            ]
        )
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    @cached_property
    def sparse_numel(self) -> int:
        return sum(b.sparse_numel for b in self.buffers)

    @cached_property
    def buffer_of(self) -> dict[int, int]:
        """Parameter position -> index of the buffer that holds it."""
        return {slot.param: buffer.index for buffer in self.buffers for slot in buffer.slots}

    @cached_property
    def slot_of(self) -> dict[int, tuple[int, int]]:
        """Parameter position -> (buffer index, slot index in that buffer)."""
        return {slot.param: (buffer.index, j) for buffer in self.buffers for j, slot in enumerate(buffer.slots)}


def cut_by_bytes(
    params: Sequence[tuple[int, ParamSpec]], cap_bytes: float, first_cap_bytes: float | None = None
) -> list[list[tuple[int, ParamSpec]]]:
    """Greedy byte-capped grouping in the given order; a tensor larger than the cap gets its own
    buffer, and a buffer never mixes dtypes (it is one flat tensor). ``first_cap_bytes`` caps the
    first group instead (DDP's small first bucket: its communication starts while the rest of the
    backward runs)."""
    groups: list[list[tuple[int, ParamSpec]]] = []
    current: list[tuple[int, ParamSpec]] = []
    size = 0
    for item in params:
        nbytes = item[1].nbytes
        cap = cap_bytes if groups or first_cap_bytes is None else first_cap_bytes
        if current and (size + nbytes > cap or item[1].dtype != current[0][1].dtype):
            groups.append(current)
            current, size = [], 0
        current.append(item)
        size += nbytes
    if current:
        groups.append(current)
    return groups


# ---------------------------------------------------------------- the message of one buffer
@dataclass
class PendingUpdate:
    """An error-feedback update that waits for the communication result (Ok-Topk filters it). It
    holds the round's gradient, not the compensated tensor: the memory recomputes that in place
    when the round commits, so no copy the size of the gradients outlives its selection."""

    key: str
    grad: Tensor
    sent: Tensor | None  # flat positions in the compensated tensor; None: a dense slot sent it whole
    offset: int  # where the tensor starts in the buffer's part (sparse or dense)


@dataclass
class Encoded:
    """One buffer, ready to send: the dense part and the sparse part, both already scaled by 1/P."""

    dense: Tensor | None
    values: Tensor | None
    indices: Tensor | None  # int64 positions in the buffer's sparse part
    updates: list[PendingUpdate] = field(default_factory=list)
    #: every rank sends the same count (no size exchange needed)
    equal_counts: bool = False
    #: no rank sends more elements than this (the plan's k, for sparsifiers that never exceed k)
    max_count: int | None = None
    #: every rank selected the same positions (randomk): the values can be all-reduced
    shared_indices: bool = False
    #: the engine's non-finite vote riding in this buffer's sparse exchange: a uint8 vector, one
    #: entry per rank, this rank's flag set; the communicator fills in every rank's flag in place
    votes: Tensor | None = None
