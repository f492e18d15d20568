"""Density warm-up: Deep Gradient Compression's exponential ramp from dense to the target density.

Over the first ``steps`` optimizer steps the density goes through ``stages`` equal stages, stage s
sending target ** ((s + 1) / (stages + 1)) of the elements: a geometric path from 1 (dense) to the
target, each stage a constant factor sparser than the one before. DGC's 75%, 93.75%, 98.4%, 99.6%
sparsity before 99.9% is this path with 4 stages over 4 epochs (densities 25.1%, 6.3%, 1.6%, 0.40%,
then 0.1%). Sparse steps early in training, when gradients change fastest, are what cost accuracy
at high sparsity; the ramp keeps them denser.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DensityWarmup:
    """``steps`` = 0: no warm-up (the target from the first step)."""

    steps: int = 0
    stages: int = 4

    def __post_init__(self) -> None:
        if isinstance(self.steps, bool) or not isinstance(self.steps, int) or self.steps < 0:
            raise ValueError(f"density warm-up steps must be an integer >= 0, got {self.steps!r}")
        if isinstance(self.stages, bool) or not isinstance(self.stages, int) or self.stages < 1:
            raise ValueError(f"density warm-up stages must be an integer >= 1, got {self.stages!r}")

    def stage(self, step: int) -> int | None:
        """The warm-up stage of ``step`` (0-based), None once the warm-up is over."""
        return step * self.stages // self.steps if step < self.steps else None

    def density(self, step: int, target: float) -> float:
        stage = self.stage(step)
        return target if stage is None else target ** ((stage + 1) / (self.stages + 1))
