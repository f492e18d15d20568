"""`sidco`: SIDCo's threshold from a sparsity-inducing distribution fitted to |g|, in stages."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from ssfusion_lightning.sparsifiers import batched
from ssfusion_lightning.sparsifiers.base import SPARSIFIERS, ThresholdSparsifier, keep_all, stable_hash
from ssfusion_lightning.sparsifiers.selection import Candidates, as_float, sample_magnitudes, search_threshold

DISTRIBUTIONS = ("exponential", "gpareto", "gamma")
#: with ``stages=None`` each stage keeps about this fraction of what it is given
STAGE_RATIO = 0.1


def exponential_quantile(mean: float, var: float, tail: float) -> float:
    """Exponential with the given mean (MLE): x with P(X > x) = tail."""
    return mean * math.log(1.0 / tail)


def gpareto_quantile(mean: float, var: float, tail: float) -> float:
    """Generalized Pareto (location 0) fitted by the method of moments: x with P(X > x) = tail.

    xi = (1 - mean^2 / var) / 2, sigma = mean (1 + mean^2 / var) / 2; xi is capped below 1/2
    (where the moments stop existing), so a Cauchy-like tail still gives a finite answer.
    """
    if not var > 0:
        return mean
    ratio = mean * mean / var
    xi = min(0.5 * (1.0 - ratio), 0.45)
    sigma = 0.5 * mean * (1.0 + ratio)
    if abs(xi) < 1e-6:
        return sigma * math.log(1.0 / tail)
    return sigma / xi * (tail ** (-xi) - 1.0)


def gamma_quantile(mean: float, var: float, tail: float) -> float:
    """Gamma fitted by the method of moments (shape mean^2/var, scale var/mean): x with P(X > x) = tail.

    The gamma quantile has no closed form: the regularized upper incomplete gamma is inverted
    numerically (two vectorized grid refinements with ``torch.special.gammaincc``, float64).
    """
    if not var > 0 or not mean > 0:
        return mean
    shape, scale = mean * mean / var, var / mean
    a = torch.tensor(shape, dtype=torch.float64)
    low, high = 0.0, max(1.0, shape)
    while float(torch.special.gammaincc(a, torch.tensor(high, dtype=torch.float64))) > tail and high < 1e12:
        high *= 2
    for _ in range(3):
        grid = torch.linspace(low, high, 257, dtype=torch.float64)
        above = torch.special.gammaincc(a, grid) > tail  # decreasing in x
        first_below = int(above.sum())
        low = float(grid[max(first_below - 1, 0)])
        high = float(grid[min(first_below, 256)])
    return 0.5 * (low + high) * scale


QUANTILES = {"exponential": exponential_quantile, "gpareto": gpareto_quantile, "gamma": gamma_quantile}


@SPARSIFIERS.register("sidco")
class SIDCoSparsifier(ThresholdSparsifier):
    """Fit ``distribution`` to |g| and take its closed-form tail quantile as the threshold.

    Multi-stage fitting (SIDCo's answer to small densities, where one fit of the bulk misjudges
    the far tail): the target density rho = k/n is split into ``stages`` equal factors
    delta = rho^(1/stages); stage 1 fits |g| and takes its (1 - delta) quantile t1; stage j fits
    the exceedances |g| - t_{j-1} of the elements above t_{j-1} and adds their (1 - delta)
    quantile. ``stages=None`` picks ceil(log(rho) / log(0.1)), i.e. every stage keeps about a
    tenth of its input.

    The fits use at most ``fit_sample`` magnitudes (well-spread positions that change with the
    step; None or 0: the whole tensor): a moment fit of 2^16 values is as good as one of
    millions, and it spares the full-size passes of the early stages, so the tensor itself is
    only read to select.

    Distributions (``distribution``): ``exponential`` (MLE), ``gpareto`` (generalized Pareto,
    method of moments) and ``gamma`` (method of moments, numerical quantile).

    A fit is only as good as the model, so the count is then corrected like gaussiank's (x0.5 /
    x1.5 steps, then interpolation, at most ``max_adjust`` rounds, 0 disables). Count band:
    (2/3, 4/3) x k; above 4k/3 after the rounds is trimmed to k by exact top-k among the selected;
    below 2k/3 only when the rounds are spent; always at least one element.
    """

    name = "sidco"
    count_band = (2 / 3, 4 / 3)

    def __init__(
        self,
        density: float = 0.01,
        distribution: str = "exponential",
        stages: int | None = None,
        max_adjust: int = 8,
        fit_sample: int | None = 1 << 16,
        **options: Any,
    ) -> None:
        super().__init__(density=density, **options)
        if distribution not in DISTRIBUTIONS:
            raise ValueError(f"unknown sidco distribution {distribution!r}; valid choices: {', '.join(DISTRIBUTIONS)}")
        if stages is not None and (isinstance(stages, bool) or not isinstance(stages, int) or stages < 1):
            raise ValueError(f"stages must be a positive integer or None, got {stages!r}")
        if isinstance(max_adjust, bool) or not isinstance(max_adjust, int) or max_adjust < 0:
            raise ValueError(f"max_adjust must be an integer >= 0, got {max_adjust!r}")
        self.distribution = distribution
        self.stages = stages
        self.max_adjust = max_adjust
        bad_sample = isinstance(fit_sample, bool) or not isinstance(fit_sample, int) or fit_sample < 0
        if fit_sample is not None and bad_sample:
            raise ValueError(f"fit_sample must be None or an integer >= 0, got {fit_sample!r}")
        self.fit_sample = fit_sample

    def stage_count(self, density: float) -> int:
        if self.stages is not None:
            return self.stages
        return max(1, math.ceil(math.log(density) / math.log(STAGE_RATIO) - 1e-9))

    def fit_threshold(self, flat: Tensor, density: float, key: str = "") -> float:
        """The multi-stage fitted threshold, from the whole tensor or from a sample of it."""
        quantile = QUANTILES[self.distribution]
        stages = self.stage_count(density)
        tail = density ** (1.0 / stages)
        n = flat.numel()
        size = n if not self.fit_sample else min(n, self.fit_sample)
        magnitudes = sample_magnitudes(flat, size, offset=stable_hash(f"sidco:{self.step}:{key}"))
        threshold = 0.0
        above = magnitudes
        for _ in range(stages):
            if above.numel() < 2:
                break
            mean = as_float(above.mean())
            var = as_float(above.var(correction=0))
            step = quantile(mean, var, tail)
            if not (step > 0 and math.isfinite(step)):
                break
            threshold += step
            above = magnitudes[magnitudes >= threshold] - threshold
        return threshold

    def select(self, tensor: Tensor, *, key: str = "", k: int | None = None) -> tuple[Tensor, Tensor]:
        flat = tensor.reshape(-1)
        n = flat.numel()
        k = self.resolve_k(n, k)
        if k >= n:
            return keep_all(flat)
        candidates = Candidates(flat)
        threshold = self.fit_threshold(flat, k / n, key)
        low, high, cap = self.band(k)
        threshold, _ = search_threshold(candidates, threshold, low, high, self.max_adjust)
        return self.finish(flat, candidates.select(threshold), k, cap)

    def band(self, k: int) -> tuple[float, float, float]:
        return 2 * k / 3, 4 * k / 3, 4 * k / 3

    def select_many(
        self, tensors: Sequence[Tensor], keys: Sequence[str], ks: Sequence[int | None]
    ) -> list[tuple[Tensor, Tensor]]:
        """The fits stay per tensor (on their samples); the first count and the selection of
        every tensor whose count lands in the band come from one batched pass."""
        return batched.select_many(self, tensors, keys, ks, self._select_batch)

    def _select_batch(
        self, batch: batched.FlatBatch, tensors: Sequence[Tensor], keys: Sequence[str], ks: Sequence[int]
    ) -> None:
        thresholds = [self.fit_threshold(t.reshape(-1), k / t.numel(), key) for t, key, k in zip(tensors, keys, ks)]
        batched.settle(self, batch, tensors, ks, thresholds, self.max_adjust)
