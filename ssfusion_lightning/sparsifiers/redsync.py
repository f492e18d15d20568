"""`redsync`: RedSync's threshold binary search between the mean and the maximum magnitude."""

from __future__ import annotations

import math
from typing import Any

from torch import Tensor

from ssfusion_lightning.sparsifiers.base import SPARSIFIERS, ThresholdSparsifier, keep_all, stable_hash
from ssfusion_lightning.sparsifiers.selection import Candidates, abs_mean_max, kth_largest, sample_magnitudes

SAMPLE = 1 << 16


@SPARSIFIERS.register("redsync")
class RedSyncSparsifier(ThresholdSparsifier):
    """threshold(r) = mean|x| + r * (max|x| - mean|x|); binary search r in [0, 1] (starting at
    0.5) until k <= count <= 2k, at most ``max_iters`` probes (extended below r = 0 when the
    mean magnitude already selects fewer than k, see ``_search``).

    The probes are exact counts over the whole tensor. To pay for (usually) a single pass, the
    search is first simulated on a sample; the lowest threshold the simulated search visits is
    selected once, and every probe at or above it is counted inside that set. If the real search
    goes lower than predicted, it simply makes another pass: the result is the plain binary
    search's either way.

    Count band: (1, 2) x k. A count above 2k after ``max_iters`` probes is trimmed to k by exact
    top-k among the selected; below k only when the probes are spent (ties, degenerate
    tensors); always at least one element.
    """

    name = "redsync"
    count_band = (1.0, 2.0)

    def __init__(self, density: float = 0.01, max_iters: int = 40, **options: Any) -> None:
        super().__init__(density=density, **options)
        if isinstance(max_iters, bool) or not isinstance(max_iters, int) or max_iters < 1:
            raise ValueError(f"max_iters must be a positive integer, got {max_iters!r}")
        self.max_iters = max_iters

    def _search(self, count, mean: float, top: float, k: int) -> tuple[float, float]:
        """Run the binary search with ``count(threshold)``; returns (final r, lowest threshold probed).

        When even r = 0 (threshold mean|x|) selects fewer than k -- heavy tails, where the mean
        magnitude lies above the k-th largest -- the search goes on below the mean, over
        r in [-mean / (max - mean), 0], i.e. thresholds down to 0. When the probes run out without
        landing in [k, 2k], the final r is the highest one that selected more than 2k (the
        caller trims it to k), else the last one probed.
        """
        low, high, r = 0.0, 1.0, 0.5
        floor = -mean / (top - mean) if top > mean else 0.0
        lowest = float("inf")
        too_many: float | None = None
        for probe in range(self.max_iters):
            threshold = max(mean + r * (top - mean), 0.0)
            lowest = min(lowest, threshold)
            c = count(threshold)
            if k <= c <= 2 * k:
                return r, lowest
            if c < k:
                high = r
                if too_many is None and r - low < 1e-3 and low == 0.0 and floor < 0.0:
                    low = floor  # r = 0 cannot reach k: extend the interval below the mean
            else:
                low = too_many = r
            if probe < self.max_iters - 1:
                r = 0.5 * (low + high)
        return (too_many if too_many is not None else r), lowest

    def select(self, tensor: Tensor, *, key: str = "", k: int | None = None) -> tuple[Tensor, Tensor]:
        flat = tensor.reshape(-1)
        n = flat.numel()
        k = self.resolve_k(n, k)
        if k >= n:
            return keep_all(flat)
        mean, top = abs_mean_max(flat)
        candidates = Candidates(flat)
        count = candidates.count
        if n > 4 * SAMPLE:
            sample = sample_magnitudes(flat, SAMPLE, offset=stable_hash(f"redsync:{self.step}:{key}"))
            scale = n / sample.numel()

            def estimate(threshold: float) -> float:
                return int((sample >= threshold).sum() if threshold > 0 else (sample > 0).sum()) * scale

            _, lowest = self._search(estimate, mean, top, k)
            # One pass at the lowest probe the simulated search makes -- but not below the sample's
            # estimate of the 3k-th magnitude: a probe under that threshold selects more than 2k
            # whenever the prepared set already does, and the search needs no more than that.
            floor = kth_largest(sample, math.ceil(3 * k / scale)) if 3 * k < n else 0.0
            prepared = max(lowest, floor)
            candidates.prepare(prepared)
            enough = candidates.count(prepared) > 2 * k

            def bounded_count(threshold: float) -> int:
                if threshold < prepared and enough:
                    return candidates.count(prepared)  # > 2k: all the search compares with
                return candidates.count(threshold)

            count = bounded_count

        r, _ = self._search(count, mean, top, k)
        return self.finish(flat, candidates.select(max(mean + r * (top - mean), 0.0)), k, 2 * k)
