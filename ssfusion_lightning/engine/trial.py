"""The measured dense fallback: time the sparse plan's steps, then the same model sent dense, and
keep the faster (``comm="auto"``'s ``dense_trial_steps``).

Why: comm=auto's modelled fallback compares, buffer by buffer, the selection's measured line plus
the sparse collective against a dense all-reduce of the buffer. It leaves out the rest of what a
sparse step costs (error feedback, packing, the hooks' work and threads on a rank's cores) and that
DDP-style dense buckets overlap the backward. On a fast link that model kept every plan sparse
while every sparse preset ran slower than DDP (P = 4 on 2 cores at 1 Gbit/s, digits CNN: 49-72 ms
a step against DDP's 46). The trial measures what the user pays, the step:

1. ``sparse``: ``steps`` step times on the plan the costs made (at the target density), after
   one step left out: the first step on a new plan also pays for the switch (new buffers, the
   error feedback a dense step flushes), which is not what the plan costs a step;
2. the ranks agree on their median (max over ranks). If the modelled dense all-reduce of the
   whole model already takes that long, dense cannot be faster: the trial ends there, with no
   dense step taken (slow links: no cost);
3. ``dense``: as many step times with every buffer sent dense (DDP's buckets), after one step left
   out likewise, agreed likewise;
4. ``done``: dense stays where its median is at most the sparse one, else the sparse plan returns.

Every decision is made from agreed numbers at step counts every rank shares, so every rank
switches plans at the same step.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any, Callable

SPARSE, DENSE, DONE = "sparse", "dense", "done"


@dataclass
class DenseTrial:
    """The trial's state machine; the engine feeds it step times and acts on what it returns."""

    steps: int
    phase: str = SPARSE
    #: this phase's step times on this rank, its first step's included (not saved: a resumed
    #: phase measures again)
    samples: list[float] = field(default_factory=list)
    #: the agreed median step of the sparse plan, once measured
    sparse_seconds: float | None = None
    dense_seconds: float | None = None

    @property
    def active(self) -> bool:
        return self.phase != DONE

    def record(self, seconds: float) -> bool:
        """One step's time in the current phase; True when the phase has all its steps."""
        self.samples.append(seconds)
        return len(self.samples) > self.steps

    def _median(self) -> float:
        return statistics.median(self.samples[1:])

    def end_sparse(self, agree: Callable[[float], float], dense_floor: float) -> bool:
        """Close the sparse phase on the agreed median; True when the dense phase should run
        (``dense_floor``: the modelled dense all-reduce of the whole model, a lower bound of a
        dense step)."""
        self.sparse_seconds = agree(self._median())
        self.samples = []
        self.phase = DENSE if dense_floor < self.sparse_seconds else DONE
        return self.phase == DENSE

    def end_dense(self, agree: Callable[[float], float]) -> bool:
        """Close the dense phase on the agreed median; True when dense is kept."""
        self.dense_seconds = agree(self._median())
        self.samples = []
        self.phase = DONE
        return self.dense_seconds <= self.sparse_seconds

    def state_dict(self) -> dict[str, Any]:
        return {"phase": self.phase, "sparse_seconds": self.sparse_seconds, "dense_seconds": self.dense_seconds}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.phase = state["phase"]
        self.sparse_seconds = state["sparse_seconds"]
        self.dense_seconds = state["dense_seconds"]
        self.samples = []
