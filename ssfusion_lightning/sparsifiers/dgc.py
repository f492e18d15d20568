"""`dgc`: Deep Gradient Compression's sampled-threshold selection."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from ssfusion_lightning.sparsifiers.base import SPARSIFIERS, ThresholdSparsifier, stable_hash
from ssfusion_lightning.sparsifiers.selection import Candidates, kth_largest, sample_magnitudes, search_threshold


@SPARSIFIERS.register("dgc")
class DGCSparsifier(ThresholdSparsifier):
    """Sample, threshold, select, trim.

    1. Sample ``sample_ratio`` of the elements (at least ``min_sample``; all of them for small
       tensors) at well-spread positions that change with the step and the tensor.
    2. Threshold = the ceil(k/n * sample)-th largest sampled magnitude (the budget's own density,
       so a fusion policy's per-tensor k is honoured; never the sample size as k).
    3. Select ``|x| >= threshold``. If the count is outside [0.8k, 1.25k], adjust the threshold
       at most ``max_adjust`` times (``selection.search_threshold``: x0.5 down / x1.5 up until
       the band is bracketed, then interpolation inside the bracket); raising it is counted
       inside the already-selected set, only lowering it costs another pass.
    4. Trim to at most k by exact top-k among the selected elements.

    Count band: (0.8, 1.0) x k -- never more than k; fewer than 0.8k only when ``max_adjust``
    rounds did not suffice (ties, e.g. mostly-zero tensors), and always at least one element.
    """

    name = "dgc"
    count_band = (0.8, 1.0)

    def __init__(
        self,
        density: float = 0.01,
        sample_ratio: float = 0.01,
        min_sample: int = 4096,
        max_adjust: int = 4,
        **options: Any,
    ) -> None:
        super().__init__(density=density, **options)
        if not (isinstance(sample_ratio, (int, float)) and 0 < sample_ratio <= 1):
            raise ValueError(f"sample_ratio must be in (0, 1], got {sample_ratio!r}")
        if isinstance(min_sample, bool) or not isinstance(min_sample, int) or min_sample < 1:
            raise ValueError(f"min_sample must be a positive integer, got {min_sample!r}")
        if isinstance(max_adjust, bool) or not isinstance(max_adjust, int) or max_adjust < 0:
            raise ValueError(f"max_adjust must be an integer >= 0, got {max_adjust!r}")
        self.sample_ratio = float(sample_ratio)
        self.min_sample = min_sample
        self.max_adjust = max_adjust

    def sample_threshold(self, flat: Tensor, k: int, key: str) -> float:
        n = flat.numel()
        size = min(n, max(self.min_sample, math.ceil(self.sample_ratio * n)))
        sample = sample_magnitudes(flat, size, offset=stable_hash(f"dgc:{self.step}:{key}"))
        return kth_largest(sample, math.ceil(k * size / n))

    def select(self, tensor: Tensor, *, key: str = "", k: int | None = None) -> tuple[Tensor, Tensor]:
        flat = tensor.reshape(-1)
        k = self.resolve_k(flat.numel(), k)
        if k >= flat.numel():
            indices = torch.arange(flat.numel(), device=flat.device)
            return flat.index_select(0, indices), indices
        candidates = Candidates(flat)
        threshold = self.sample_threshold(flat, k, key)
        threshold, _ = search_threshold(candidates, threshold, 0.8 * k, 1.25 * k, self.max_adjust)
        return self.finish(flat, candidates.select(threshold), k, k)
