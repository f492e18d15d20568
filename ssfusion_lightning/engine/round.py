"""The state of one synchronized round, in one object made afresh for every round."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ssfusion_lightning.engine.agreement import NonFiniteVote
from ssfusion_lightning.fusion import ErrorFeedback
from ssfusion_lightning.vocabulary import Buffer


@dataclass
class Round:
    """From the first backward after the last synchronized round to the next ``finish``: the
    engine makes a new one after every synchronized round and whenever its plan changes, so
    nothing of a round outlives it."""

    #: the round's buffers in launch order: the policy's plan, then one per sparse-gradient parameter
    buffers: tuple[Buffer, ...]
    num_params: int
    #: the round's error feedback (its loss scale is taken at the round's first selection)
    feedback: ErrorFeedback
    #: whether any rank's gradients this round were non-finite
    vote: NonFiniteVote
    #: per buffer: the slots whose gradient is not ready yet
    missing: list[int] = field(init=False)
    #: per buffer and slot: its compressed piece (a Future while offloaded), None until compressed
    pieces: list[list[Any]] = field(init=False)
    #: parameters whose gradient became ready in the synchronized backward
    used: list[bool] = field(init=False)
    #: the same parameters, in the order their gradients became ready
    ready_order: list[int] = field(default_factory=list)
    #: parameters a backward reached since the last synchronized round (gradient accumulation)
    used_unsynced: list[bool] = field(init=False)
    #: the sparsifier's state before the round's first selection: put back if the round is dropped
    sparsifier_snapshot: dict[str, Any] | None = None
    #: the first buffer not launched yet
    next: int = 0
    #: the launched buffers, (buffer, pending reduction, encoded), or the offload worker's futures of them
    launched: list[Any] = field(default_factory=list)
    #: while the engine profiles: the time of the launching buffer's batches that the cost profile
    #: charges per element, left out of the launch overhead
    launch_excluded_seconds: float = 0.0

    def __post_init__(self) -> None:
        self.missing = [len(buffer.slots) for buffer in self.buffers]
        self.pieces = [[None] * len(buffer.slots) for buffer in self.buffers]
        self.used = [False] * self.num_params
        self.used_unsynced = [False] * self.num_params

    def participates(self, position: int) -> bool:
        """Whether a backward since the last synchronized round reached the parameter. One that no
        backward reached (another optimizer's, in manual optimization) holds no gradient of this
        round, whatever its ``.grad`` says: it sends zeros and keeps its error feedback as it is."""
        return self.used[position] or self.used_unsynced[position]
