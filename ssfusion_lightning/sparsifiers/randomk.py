"""`randomk`: k uniformly random positions, the same on every rank (no index exchange needed)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ssfusion_lightning.sparsifiers.base import SPARSIFIERS, Sparsifier, stable_hash


def random_positions(n: int, k: int, seed: int) -> Tensor:
    """A uniformly random k-subset of range(n) as int64 (CPU), determined by ``seed`` alone.

    Dense requests use a permutation; sparse ones draw with replacement, deduplicate, top up
    when short, and keep a uniformly random k-subset of the distinct draws (by symmetry a
    uniformly random set of any given size), so the cost is O(k log k) instead of O(n).
    """
    generator = torch.Generator(device="cpu")
    generator.manual_seed(seed)
    if k >= n:
        return torch.arange(n)
    if 4 * k >= n:
        return torch.randperm(n, generator=generator)[:k]
    draws = torch.empty(0, dtype=torch.int64)
    want = k + k * k // n + 16
    while True:
        fresh = torch.randint(0, n, (want,), generator=generator, dtype=torch.int64)
        draws = torch.unique(torch.cat([draws, fresh]))
        if draws.numel() >= k:
            break
        want = 2 * (k - draws.numel()) + 16
    if draws.numel() > k:
        draws = draws[torch.randperm(draws.numel(), generator=generator)[:k]]
    return draws


@SPARSIFIERS.register("randomk")
class RandomKSparsifier(Sparsifier):
    """Exactly k uniformly random positions.

    The positions depend only on (``seed``, ``self.step``, a stable hash of ``key``, numel, k):
    every rank that is at the same step picks the same positions, so the values can be summed
    with a dense all-reduce of k elements, and a step repeated after a checkpoint picks the same
    positions again. Options: ``seed`` (int, default 0; the same on all ranks).
    """

    name = "randomk"
    shared_indices = True

    def __init__(self, density: float = 0.01, seed: int = 0, **options: Any) -> None:
        super().__init__(density=density, **options)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed must be an integer, got {seed!r}")
        self.seed = seed

    def positions(self, numel: int, k: int, key: str = "") -> Tensor:
        seed = stable_hash(f"randomk:{self.seed}:{self.step}:{key}:{numel}:{k}")
        return random_positions(numel, k, seed)

    def select(self, tensor: Tensor, *, key: str = "", k: int | None = None) -> tuple[Tensor, Tensor]:
        flat = tensor.reshape(-1)
        k = self.resolve_k(flat.numel(), k)
        indices = self.positions(flat.numel(), k, key).to(flat.device)
        return flat.index_select(0, indices), indices
