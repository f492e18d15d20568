"""The measured plan check: time the sparse plan's steps, then the same plan in one buffer, then
the same model sent dense, and keep the fastest (a communicator's ``dense_trial_steps``: on by
default for ``comm="auto"``, opt-in for a fixed scheme, whose plan has no modelled fallback).

Why a dense phase: comm=auto's modelled fallback compares, buffer by buffer, the selection's
measured line plus the sparse collective against a dense all-reduce of the buffer. It leaves out
the rest of what a sparse step costs (error feedback, packing, the hooks' work and threads on a
rank's cores) and that DDP-style dense buckets overlap the backward. On a fast link that model kept
every plan sparse while every sparse preset ran slower than DDP (P = 4 on 2 cores at 1 Gbit/s,
digits CNN: 49-72 ms a step against DDP's 46).

Why a one-buffer phase: the cost cut charges each buffer its measured launch overhead, but not what
one more collective round costs where ranks share cores: every round waits for a descheduled rank.
The digits CNN at P = 4 on 2 cores ran 64-82 ms a step on 2 buffers and 52-63 on 1 (experiments/
REPORT.md, "Selection at the buffer's launch on the host"); where its cut made 2, this phase measured
one buffer faster in 5 of 5 runs ("The plan trial times one buffer"). The trial measures what the
user pays, the step:

1. ``sparse``: ``steps`` step times on the plan the costs made (at the target density), after
   one step left out: the first step on a new plan also pays for the switch (new buffers), which
   is not what the plan costs a step; the ranks agree on the mean of their medians (``agreement.mean_over_ranks``): ranks in lockstep share one step
   time, and one window's medians on 4 ranks sharing 2 cores still differed by up to 16 ms, so a
   max over ranks took the noisiest;
2. ``fused``: where the auto cut made several buffers, as many step times with the cut's tensors
   in one buffer, agreed likewise; then ``recut``: the cut's plan again, as many steps, and one
   buffer stays where its median is at most the mean of the cut's two windows, which bracket its
   own (so a drift of the host's speed cancels, and the cut's step is the mean of two windows). One
   window each did not tell them apart: gpt2_10m at P = 2, 150 Mbit/s kept one buffer in one launch
   of eleven, whose timed blocks then exposed 42-60 ms of communication a step against 4.6-7.3 with
   the cut's 3 buffers; the cut measured 289-303 ms a step against one buffer's 329-500 in four
   probes of that cell (experiments/REPORT.md, "The one-buffer window bracketed by the cut's");
3. if the modelled dense all-reduce of the whole model already takes as long as the better sparse
   plan's step, dense cannot be faster: the trial ends there, with no dense step taken (slow
   links: no cost). Else ``dense``: as many step times with every buffer sent dense (DDP's
   buckets), agreed likewise. Through this window the engine sets aside what the error feedback
   owes, so the dense slots send their fresh gradients: sent at once, every tensor's owed mass made
   the window a dip in the accuracy curve (the engine's ``_hold_owed``);
4. ``confirm``: where dense measured no slower, the better sparse plan again, as many steps,
   agreed likewise. One window of a few steps on ranks that share cores cannot tell 5-15% apart
   (a digits run at P = 4 on 2 cores: single steps of 72-287 ms in one sparse window): the
   time-to-accuracy table kept dense, slower than sparse by 4-15%, in 2 of 7 trials. The two
   sparse windows bracket the dense one, so their mean also cancels a steady drift. Replayed on
   every rank's measured steps where dense is 8% slower (experiments/trial_replay.py), this rule
   keeps dense in 0.137 of trials with 8-step windows and a max over ranks, 0.075 with comm=auto's
   16 steps and the mean;
5. where the two sparse windows differ by more than ``DRIFT_LIMIT``, the host's speed changed
   between them (seen once: every step of either plan went from 55-67 ms to 72-100 ms during the
   second window, text LM at P = 2), and a mean of the two would weigh dense against a sparse plan
   half measured in other conditions: dense and the sparse plan are measured once more, the second
   sparse window now the one before dense. Once only, so the trial still ends;
6. ``done``: dense stays where its median is at most the sparse plan's (the mean of its two
   windows where both ran) times ``min_sparse_speedup``, else that sparse plan returns.

``min_sparse_speedup`` (1.0 by default, a communicator option): a sparse plan stays only where
dense's step measured at least that many times its own, at every comparison above (3, 4 and 6).
The trial times steps; a selection also costs steps to accuracy, which a run cannot measure as it
goes: with residual error feedback the byte-level LM ran sparse steps 5-10% shorter than dense and
stayed 10 points of next-token accuracy under DDP (experiments/REPORT.md, "Time to accuracy on the
300 Mbit/s link after the hand-off"). The option lets a user ask the selection to pay for that; at 1.2
it did not shorten the time to accuracy in the runs measured ("Asking the sparse plan for a speed-up").

Every decision is made from agreed numbers at step counts every rank shares, so every rank
switches plans at the same step.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any, Callable

SPARSE, FUSED, RECUT, DENSE, CONFIRM, DONE = "sparse", "fused", "recut", "dense", "confirm", "done"
#: the ratio of two agreed sparse windows beyond which they were measured in different conditions:
#: above the 95th percentile (1.29) of the ratios of 16-step window pairs on the same plan, every
#: rank's steps of the digits cell at P = 4 on 2 cores (experiments/trial_replay.py's runs)
DRIFT_LIMIT = 1.3


@dataclass
class PlanTrial:
    """The trial's state machine; the engine feeds it step times and acts on the phase it enters."""

    steps: int
    phase: str = SPARSE
    #: this phase's step times on this rank, its first step's included (not saved: a resumed
    #: phase measures again)
    samples: list[float] = field(default_factory=list)
    #: the agreed median step of the cost cut's sparse plan, once measured
    sparse_seconds: float | None = None
    #: the agreed median step of the same sparse plan in one buffer (None: not measured)
    fused_seconds: float | None = None
    #: the agreed median step of the cut's plan measured again after the one-buffer window (None: not measured)
    recut_seconds: float | None = None
    dense_seconds: float | None = None
    #: the agreed median step of the better sparse plan measured again after dense (None: not measured)
    confirmed_seconds: float | None = None
    #: the dense and sparse-again medians of a first comparison whose sparse windows differed by more
    #: than ``DRIFT_LIMIT``; that sparse-again window is the one before the second dense window
    discarded: tuple[float, float] | None = None
    #: how many times faster a step the sparse plan must be than dense to stay (1.0: the faster wins)
    min_sparse_speedup: float = 1.0

    @property
    def active(self) -> bool:
        return self.phase != DONE

    @property
    def cut_seconds(self) -> float | None:
        """The cut's plan's step: the mean of its windows around one buffer's where both ran."""
        if self.recut_seconds is None:
            return self.sparse_seconds
        return (self.sparse_seconds + self.recut_seconds) / 2

    @property
    def fused_kept(self) -> bool:
        """One buffer measured no slower than the cut's plan on both sides of its window (a tie goes
        to fewer buffers, as in the cut)."""
        return self.recut_seconds is not None and self.fused_seconds <= self.cut_seconds

    @property
    def best_sparse_seconds(self) -> float | None:
        return self.fused_seconds if self.fused_kept else self.cut_seconds

    @property
    def before_dense_seconds(self) -> float | None:
        """The better sparse plan's window just before the (latest) dense one."""
        return self.best_sparse_seconds if self.discarded is None else self.discarded[1]

    @property
    def sparse_estimate(self) -> float | None:
        """The better sparse plan's step: the mean of its windows before and after dense where both ran."""
        if self.confirmed_seconds is None:
            return self.before_dense_seconds
        return (self.before_dense_seconds + self.confirmed_seconds) / 2

    @property
    def dense_kept(self) -> bool:
        """The trial has ended on dense (a tie keeps dense: it loses no accuracy)."""
        return (
            self.phase == DONE and self.dense_seconds is not None
            and self.dense_seconds <= self.min_sparse_speedup * self.sparse_estimate
        )

    def record(self, seconds: float) -> bool:
        """One step's time in the current phase; True when the phase has all its steps."""
        self.samples.append(seconds)
        return len(self.samples) > self.steps

    def _agreed_median(self, agree: Callable[[float], float]) -> float:
        median = agree(statistics.median(self.samples[1:]))
        self.samples = []
        return median

    def _after_sparse(self, dense_floor: float) -> str:
        return DENSE if dense_floor < self.min_sparse_speedup * self.best_sparse_seconds else DONE

    def end_sparse(self, agree: Callable[[float], float], fusable: bool, dense_floor: float) -> str:
        """Close the sparse phase on the agreed median; returns the phase entered: ``fused`` where
        the plan has buffers to fuse (``fusable``), else as ``end_recut`` (``dense_floor``: the
        modelled dense all-reduce of the whole model, a lower bound of a dense step)."""
        self.sparse_seconds = self._agreed_median(agree)
        self.phase = FUSED if fusable else self._after_sparse(dense_floor)
        return self.phase

    def end_fused(self, agree: Callable[[float], float]) -> str:
        """Close the one-buffer phase on the agreed median; the cut's plan is measured again (``recut``)."""
        self.fused_seconds = self._agreed_median(agree)
        self.phase = RECUT
        return self.phase

    def end_recut(self, agree: Callable[[float], float], dense_floor: float) -> str:
        """Close the cut's second window on the agreed median; returns the phase entered (``dense``
        or ``done``; ``fused_kept`` says which sparse plan stays)."""
        self.recut_seconds = self._agreed_median(agree)
        self.phase = self._after_sparse(dense_floor)
        return self.phase

    def end_dense(self, agree: Callable[[float], float]) -> str:
        """Close the dense phase on the agreed median; returns the phase entered: ``confirm`` where
        dense measured no slower than the better sparse plan (times ``min_sparse_speedup``), else
        ``done`` (sparse kept)."""
        self.dense_seconds = self._agreed_median(agree)
        self.phase = CONFIRM if self.dense_seconds <= self.min_sparse_speedup * self.before_dense_seconds else DONE
        return self.phase

    def end_confirm(self, agree: Callable[[float], float]) -> str:
        """Close the second sparse window on the agreed median; returns the phase entered: ``dense``
        once, where the two sparse windows differ by more than ``DRIFT_LIMIT``, else ``done``
        (``dense_kept`` says which plan stays)."""
        confirmed = self._agreed_median(agree)
        before = self.before_dense_seconds
        if self.discarded is None and max(confirmed, before) > DRIFT_LIMIT * min(confirmed, before):
            self.discarded = (self.dense_seconds, confirmed)
            self.dense_seconds = None
            self.phase = DENSE
            return self.phase
        self.confirmed_seconds = confirmed
        self.phase = DONE
        return self.phase

    def summary(self) -> str:
        """The measured medians and the kept plan, for the log."""
        measured = [
            ("sparse", self.sparse_seconds), ("one buffer", self.fused_seconds), ("sparse after one buffer", self.recut_seconds),
            ("dense", self.dense_seconds), ("sparse again", self.confirmed_seconds),
        ]
        if self.discarded is not None:
            measured[3:3] = [("dense", self.discarded[0]), ("sparse again", self.discarded[1])]
        medians = ", ".join(f"{name} {1e3 * seconds:.3g} ms" for name, seconds in measured if seconds is not None)
        kept = "dense" if self.dense_kept else "one buffer" if self.fused_kept else "sparse"
        return f"{medians} a step -> {kept}"

    def state_dict(self) -> dict[str, Any]:
        return {
            "phase": self.phase, "sparse_seconds": self.sparse_seconds, "fused_seconds": self.fused_seconds,
            "recut_seconds": self.recut_seconds,
            "dense_seconds": self.dense_seconds, "confirmed_seconds": self.confirmed_seconds,
            "discarded": None if self.discarded is None else list(self.discarded),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.phase = state["phase"]
        self.sparse_seconds = state["sparse_seconds"]
        self.fused_seconds = state.get("fused_seconds")  # absent in checkpoints written before the fused phase
        self.recut_seconds = state.get("recut_seconds")
        if "recut_seconds" not in state and self.fused_seconds is not None and self.fused_seconds <= self.sparse_seconds:
            # a checkpoint from before the recut phase kept one buffer on one window of the cut: as if measured twice alike
            self.recut_seconds = self.sparse_seconds
        self.dense_seconds = state["dense_seconds"]
        self.confirmed_seconds = state.get("confirmed_seconds")  # absent in checkpoints written before the confirm phase
        discarded = state.get("discarded")  # absent in checkpoints written before the drift check
        self.discarded = None if discarded is None else (discarded[0], discarded[1])
        self.samples = []
