"""`dgc`: Deep Gradient Compression's sampled-threshold selection."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np
import torch
from torch import Tensor

from ssfusion_lightning.sparsifiers import batched
from ssfusion_lightning.sparsifiers.base import SPARSIFIERS, ThresholdSparsifier, stable_hash
from ssfusion_lightning.sparsifiers.selection import (
    Candidates,
    kth_largests,
    sample_magnitudes,
    search_threshold,
    topk_indices,
)

#: z-score of the margin between the budget's sampled rank and the search floor's
FLOOR_Z = 3.0
#: default ``exact_below``: tensors below this many elements are sampled whole. DGC samples so as not
#: to pay for an exact selection, but the top-k kernels find the exact one sooner than a sampled
#: threshold and its search find an approximate one at every size the engine selects in a batch on
#: the host (below 2^18 elements), while a large tensor selected on its own is faster sampled. One
#: core, 4 tensors of n elements, batched dgc against batched top-k (ms): n = 2K 0.47 / 0.41, 32K
#: 1.17 / 0.73, 147K 3.11 / 2.25; one at a time, n = 590K: 1.58 / 3.20 (experiments/REPORT.md,
#: "dgc selects tensors below 2^18 elements exactly").
EXACT_BELOW = 1 << 18


@SPARSIFIERS.register("dgc")
class DGCSparsifier(ThresholdSparsifier):
    """Sample, threshold, select, trim.

    1. Sample ``sample_ratio`` of the elements (at least ``min_sample``; all of them for small
       tensors) at well-spread positions that change with the step and the tensor.
    2. Threshold = the ceil(k/n * sample)-th largest sampled magnitude (the budget's own density,
       so a fusion policy's per-tensor k is honoured; never the sample size as k).
    3. Select ``|x| >= threshold``. If the count is outside [0.9k, 1.25k], adjust the threshold
       at most ``max_adjust`` times (``selection.search_threshold``: x0.5 down / x1.5 up until
       the band is bracketed, then interpolation inside the bracket). The one pass over the
       tensor is made at a lower floor drawn from the same sample (``thresholds``), so every
       count the search makes above the floor, raising or lowering, is counted inside that set.
    4. Trim to at most k by exact top-k among the selected elements.

    Tensors below ``exact_below`` elements are sampled whole, as tensors of at most ``min_sample``
    elements are: their threshold is the exact k-th magnitude, so they send their exact top-k (k
    elements, inside the count band), which the top-k kernels find (``selection.topk_indices``,
    ``batched.exact_topk``). ``exact_below=0`` samples every tensor above ``min_sample``.

    Count band: (0.9, 1.0) x k -- never more than k; fewer than 0.9k only when ``max_adjust``
    rounds did not suffice (ties, e.g. mostly-zero tensors), and always at least one element.
    (A wider band saves adjust passes but sends less than asked: on random tensors of 2^14 to 2^20
    elements, 0.8 sent 95% of k at density 1%, 0.9 sends 98%.)

    ``select_many`` draws the samples of all the tensors of a buffer (the same positions as
    ``select``) into one batch, ranks them together and makes the first count of every tensor in
    one pass; only tensors whose count leaves the band search on their own.
    """

    name = "dgc"
    count_band = (0.9, 1.0)

    def __init__(
        self,
        density: float = 0.01,
        sample_ratio: float = 0.01,
        min_sample: int = 4096,
        max_adjust: int = 4,
        exact_below: int = EXACT_BELOW,
        **options: Any,
    ) -> None:
        super().__init__(density=density, **options)
        if not (isinstance(sample_ratio, (int, float)) and 0 < sample_ratio <= 1):
            raise ValueError(f"sample_ratio must be in (0, 1], got {sample_ratio!r}")
        if isinstance(min_sample, bool) or not isinstance(min_sample, int) or min_sample < 1:
            raise ValueError(f"min_sample must be a positive integer, got {min_sample!r}")
        if isinstance(max_adjust, bool) or not isinstance(max_adjust, int) or max_adjust < 0:
            raise ValueError(f"max_adjust must be an integer >= 0, got {max_adjust!r}")
        if isinstance(exact_below, bool) or not isinstance(exact_below, int) or exact_below < 0:
            raise ValueError(f"exact_below must be an integer >= 0, got {exact_below!r}")
        self.sample_ratio = float(sample_ratio)
        self.exact_below = exact_below
        self.min_sample = min_sample
        self.max_adjust = max_adjust

    def sample_size(self, n: int) -> int:
        return sample_size(n, self.min_sample, self.sample_ratio)

    def sample_offset(self, key: str) -> int:
        return stable_hash(f"dgc:{self.step}:{key}")

    def sample(self, flat: Tensor, key: str) -> Tensor:
        """This step's sampled magnitudes of a tensor (the same positions on every path)."""
        return sample_magnitudes(flat, self.sample_size(flat.numel()), offset=self.sample_offset(key))

    def thresholds(self, sample: Tensor, k: int, n: int) -> tuple[float, float]:
        """The budget's threshold, and the search floor: a threshold below it, from the same
        sample (one ranking for both), that selects more than the band's top (1.25k) with high
        probability. The floor is the threshold search's bracket from below, so a first count
        under the band costs no second pass (``selection.search_threshold``)."""
        size = sample.numel()
        threshold, floor = kth_largests(sample, [math.ceil(k * size / n), floor_rank(k, size, n)])
        return threshold, floor

    def band(self, k: int) -> tuple[float, float, float]:
        return 0.9 * k, 1.25 * k, k

    def select(self, tensor: Tensor, *, key: str = "", k: int | None = None) -> tuple[Tensor, Tensor]:
        flat = tensor.reshape(-1)
        k = self.resolve_k(flat.numel(), k)
        if k >= flat.numel():
            indices = torch.arange(flat.numel(), device=flat.device)
            return flat.index_select(0, indices), indices
        if flat.numel() < self.exact_below:
            indices = topk_indices(flat, k)
            return flat.index_select(0, indices), indices
        candidates = Candidates(flat)
        threshold, floor = self.thresholds(self.sample(flat, key), k, flat.numel())
        if 0 < floor < threshold:
            candidates.prepare(floor)  # one pass answers the counts of the whole search
        low, high, cap = self.band(k)
        threshold, _ = search_threshold(candidates, threshold, low, high, self.max_adjust, floor=floor)
        return self.finish(flat, candidates.select(threshold), k, cap)

    def select_many(
        self, tensors: Sequence[Tensor], keys: Sequence[str], ks: Sequence[int | None]
    ) -> list[tuple[Tensor, Tensor]]:
        is_exact = [t.numel() < self.exact_below for t in tensors]
        if not any(is_exact):
            return batched.select_many(self, tensors, keys, ks, self._select_batch)
        exact = [i for i, e in enumerate(is_exact) if e]
        sampled = [i for i, e in enumerate(is_exact) if not e]
        out: list[Any] = [None] * len(tensors)
        for members, kernel in ((exact, batched.exact_topk), (sampled, self._select_batch)):
            if members:
                picked = batched.select_many(
                    self, [tensors[i] for i in members], [keys[i] for i in members], [ks[i] for i in members], kernel
                )
                for i, result in zip(members, picked):
                    out[i] = result
        return out

    def _select_batch(
        self, batch: batched.FlatBatch, tensors: Sequence[Tensor], keys: Sequence[str], ks: Sequence[int]
    ) -> None:
        plan = _sample_plan(batch.layout.numels, tuple(ks), self.min_sample, self.sample_ratio)
        rows = list(plan.whole)
        for members, base, pad, ranks in plan.drawn:
            # this step's positions: (j * step + offset) mod n, as sample_positions draws them
            offsets = np.array([self.sample_offset(keys[i]) for i in members], dtype=np.int64)
            numels = batch.layout.sizes[members][:, None]
            index = (base + offsets[:, None] % numels) % numels + batch.layout.starts[members][:, None]
            index[pad] = batch.sentinel
            rows.append((index, ranks))
        # every row ranked once for both: the threshold and the search floor (``thresholds``)
        both = np.empty((len(ks), 2))
        both[list(plan.row_of)] = batch.kth_largest(rows)
        batched.settle(self, batch, tensors, ks, both[:, 0].tolist(), self.max_adjust, floors=both[:, 1].tolist())


def floor_rank(k: int, size: int, n: int) -> int:
    """The sample rank of the search floor: the budget's rank with room for 1.25 k and a margin
    of ``FLOOR_Z`` standard deviations."""
    rank = math.ceil(k * size / n)
    return math.ceil(1.25 * rank + FLOOR_Z * math.sqrt(1.25 * rank)) + 1


def sample_size(n: int, min_sample: int, ratio: float) -> int:
    return min(n, max(min_sample, math.ceil(ratio * n)))


@dataclass(frozen=True)
class SamplePlan:
    """Where ``DGCSparsifier.select_many`` samples a batch (cached per numels, ks and options).

    ``whole``: index rows of the tensors sampled whole, grouped by width. ``drawn``: for the
    others, per width class, (batch indices, offset-free positions (j * step) mod n, padding
    mask, ranks: one (threshold, search floor) pair per row); a call adds its step's offsets."""

    whole: list[tuple[np.ndarray, np.ndarray]]
    drawn: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]
    #: batch index of each threshold ``kth_largest`` returns (whole rows, then drawn rows)
    row_of: tuple[int, ...]


@lru_cache(maxsize=256)
def _sample_plan(numels: tuple[int, ...], ks: tuple[int, ...], min_sample: int, ratio: float) -> SamplePlan:
    layout = batched.layout_of(numels)
    whole, whole_ranks, whole_of, drawn, drawn_ranks, drawn_of = [], [], [], [], [], []
    for i, (n, k) in enumerate(zip(numels, ks)):
        size = sample_size(n, min_sample, ratio)
        # (threshold rank, floor rank), clamped as kth_largest clamps them
        rank = [max(1, min(math.ceil(k * size / n), size)), max(1, min(floor_rank(k, size, n), size))]
        if size >= n:
            # sampled whole, the threshold is the exact k-th magnitude: its count is at least k,
            # inside the band or above, so no floor is needed (a floor equal to it is none)
            start = int(layout.starts[i])
            whole.append(np.arange(start, start + n, dtype=np.int64))
            whole_ranks.append([rank[0], rank[0]])
            whole_of.append(i)
        else:
            drawn.append(batched.weyl_positions(n, size))
            drawn_ranks.append(rank)
            drawn_of.append(i)
    classes = []
    drawn_order = batched.class_order([len(r) for r in drawn])
    position = 0
    for base, ranks in batched.group_rows(drawn, drawn_ranks, -1):
        members = np.asarray([drawn_of[r] for r in drawn_order[position : position + len(ranks)]])
        position += len(ranks)
        classes.append((members, base, base < 0, ranks))
    whole_order = batched.class_order([len(r) for r in whole])
    return SamplePlan(
        batched.group_rows(whole, whole_ranks, layout.total),
        classes,
        tuple(whole_of[r] for r in whole_order) + tuple(drawn_of[r] for r in drawn_order),
    )
