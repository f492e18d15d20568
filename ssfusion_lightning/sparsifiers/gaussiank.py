"""`gaussiank`: threshold from a Gaussian fit of the gradient, then a few corrective rounds."""

from __future__ import annotations

from collections.abc import Sequence
from statistics import NormalDist
from typing import Any

from torch import Tensor

from ssfusion_lightning.sparsifiers import batched
from ssfusion_lightning.sparsifiers.base import SPARSIFIERS, ThresholdSparsifier, keep_all
from ssfusion_lightning.sparsifiers.selection import Candidates, mean_std, search_threshold


def two_sided_z(density: float) -> float:
    """|Phi^-1(density / 2)|: a N(0, 1) variable exceeds it in magnitude with probability ``density``."""
    return abs(NormalDist().inv_cdf(min(max(density, 1e-300), 1.0) / 2))


@SPARSIFIERS.register("gaussiank")
class GaussianKSparsifier(ThresholdSparsifier):
    """Fit mean and std of the tensor (one reduction pass, no temporaries) and select
    ``|x| >= |mean| + |Phi^-1(rho/2)| * std`` with rho = k / n.

    If the count leaves [2k/3, 4k/3] the threshold is multiplied by 0.5 (too few) or 1.5 (too
    many); once a too-low and a too-high threshold are known it interpolates between them
    instead (``selection.search_threshold``), so heavy-tailed inputs converge instead of
    oscillating between x0.5 and x1.5, and a fit thrown off by one outlier (a huge std) takes
    larger extrapolated steps down. At most ``max_adjust`` rounds; raising rounds are counted
    inside the already-selected set (no extra pass).

    Count band: (2/3, 4/3) x k. A count above 4k/3 after the rounds is trimmed to k by exact
    top-k among the selected; below 2k/3 only when the rounds are spent (ties, degenerate
    tensors); always at least one element.
    """

    name = "gaussiank"
    count_band = (2 / 3, 4 / 3)

    def __init__(self, density: float = 0.01, max_adjust: int = 8, **options: Any) -> None:
        super().__init__(density=density, **options)
        if isinstance(max_adjust, bool) or not isinstance(max_adjust, int) or max_adjust < 0:
            raise ValueError(f"max_adjust must be an integer >= 0, got {max_adjust!r}")
        self.max_adjust = max_adjust

    def first_threshold(self, flat: Tensor, k: int) -> float:
        mean, std = mean_std(flat)
        return abs(mean) + two_sided_z(k / flat.numel()) * std

    def band(self, k: int) -> tuple[float, float, float]:
        return 2 * k / 3, 4 * k / 3, 4 * k / 3

    def select(self, tensor: Tensor, *, key: str = "", k: int | None = None) -> tuple[Tensor, Tensor]:
        flat = tensor.reshape(-1)
        n = flat.numel()
        k = self.resolve_k(n, k)
        if k >= n:
            return keep_all(flat)
        threshold = self.first_threshold(flat, k)
        candidates = Candidates(flat)
        low, high, cap = self.band(k)
        threshold, _ = search_threshold(candidates, threshold, low, high, self.max_adjust)
        return self.finish(flat, candidates.select(threshold), k, cap)

    def select_many(
        self, tensors: Sequence[Tensor], keys: Sequence[str], ks: Sequence[int | None]
    ) -> list[tuple[Tensor, Tensor]]:
        """The fits stay per tensor (two reductions each); the first count and the selection of
        every tensor whose count lands in the band come from one batched pass."""
        return batched.select_many(self, tensors, keys, ks, self._select_batch)

    def _select_batch(
        self, batch: batched.FlatBatch, tensors: Sequence[Tensor], keys: Sequence[str], ks: Sequence[int]
    ) -> None:
        thresholds = [self.first_threshold(t.reshape(-1), k) for t, k in zip(tensors, ks)]
        batched.settle(self, batch, tensors, ks, thresholds, self.max_adjust)
