"""A compiled exact top-k of a buffer's tensors (numba), to measure what a native kernel would give
before the library takes a dependency on one: experiments/bench_batched_selection.py times it beside
``select_many`` (the ``compiled_many`` column) and checks that it selects the same elements.

Per tensor, in one compiled call for the whole flat buffer: a lower bound of the k-th magnitude from
a strided sample (the exact k-th one for a tensor of at most ``SAMPLE`` elements), one loop that
lists the positions and magnitudes at or above it, and a quickselect among those candidates for the
k largest, equal magnitudes at the cut going to the lowest positions (the library's rule). A bound
that fails (fewer than k candidates) takes every element as a candidate.

numba is not a dependency of the project: ``pip install numba`` to run this.
"""

from __future__ import annotations

import math

import numba
import numpy as np
import torch
from torch import Tensor

#: sampled magnitudes per tensor for the lower bound
SAMPLE = 1024
#: z-score of the bound's margin, as the library's batched top-k
Z = 3.0


@numba.njit(nogil=True, cache=True)
def _kth_largest(values: np.ndarray, count: int, rank: int):
    """The rank-th largest (1-based) of values[:count], reordering values[:count] (Hoare quickselect,
    median-of-three pivot)."""
    lo, hi, target = 0, count - 1, rank - 1
    while hi > lo:
        a, b, c = values[lo], values[(lo + hi) >> 1], values[hi]
        if a < b:
            a, b = b, a
        if b < c:
            b = c
            if a < b:
                b = a
        pivot = b
        i, j = lo, hi
        while i <= j:
            while values[i] > pivot:
                i += 1
            while values[j] < pivot:
                j -= 1
            if i <= j:
                values[i], values[j] = values[j], values[i]
                i += 1
                j -= 1
        if target <= j:
            hi = j
        elif target >= i:
            lo = i
        else:
            return values[target]
    return values[lo]


@numba.njit(nogil=True, cache=True)
def _top_one(x, k, out_positions, out_values, magnitudes, positions, work, sample, z):
    n = x.size
    work[0] = -np.inf  # every threshold below has x's dtype
    bound = work[0]
    if n <= sample:
        for j in range(n):
            work[j] = abs(x[j])
        bound = _kth_largest(work, n, k)
    else:
        expected = k * sample / n
        rank = int(math.ceil(expected + z * math.sqrt(expected) + 2))
        if 4 * rank <= sample:
            stride = n // sample
            for j in range(sample):
                work[j] = abs(x[j * stride])
            bound = _kth_largest(work, sample, rank)
            if not (bound > 0) or bound == np.inf:
                work[0] = -np.inf
                bound = work[0]
    count = 0
    for j in range(n):
        magnitude = abs(x[j])
        if magnitude >= bound:
            positions[count] = j
            magnitudes[count] = magnitude
            count += 1
    if count < k:  # the bound failed: every element is a candidate
        for j in range(n):
            positions[j] = j
            magnitudes[j] = abs(x[j])
        count = n
    for j in range(count):
        work[j] = magnitudes[j]
    cut = _kth_largest(work, count, k)
    above = 0
    for j in range(count):
        if magnitudes[j] > cut:
            above += 1
    ties = k - above
    written = 0
    for j in range(count):
        magnitude = magnitudes[j]
        if magnitude > cut or (magnitude == cut and ties > 0):
            if magnitude == cut:
                ties -= 1
            out_positions[written] = positions[j]
            out_values[written] = x[positions[j]]
            written += 1


@numba.njit(nogil=True, cache=True)
def _top_segments(flat, starts, sizes, ks, offsets, out_positions, out_values, magnitudes, positions, work, sample, z):
    for i in range(starts.size):
        start, offset, k = starts[i], offsets[i], ks[i]
        _top_one(
            flat[start : start + sizes[i]],
            k,
            out_positions[offset : offset + k],
            out_values[offset : offset + k],
            magnitudes,
            positions,
            work,
            sample,
            z,
        )


class CompiledTopK:
    """Exact top-k of a fixed list of tensor shapes (0 < k < n each), scratch kept between calls."""

    def __init__(self, tensors: list[Tensor], ks: list[int]) -> None:
        sizes = np.asarray([t.numel() for t in tensors], dtype=np.int64)
        if any(not 0 < k < n for k, n in zip(ks, sizes.tolist())):
            raise ValueError("every k must satisfy 0 < k < numel")
        self.sizes, self.ks = sizes, np.asarray(ks, dtype=np.int64)
        self.starts = np.cumsum(sizes) - sizes
        self.offsets = np.cumsum(self.ks) - self.ks
        self.split = list(ks)
        dtype = tensors[0].dtype
        self.flat = torch.empty(int(sizes.sum()), dtype=dtype)
        self.views = [
            self.flat[a : a + n].view(t.shape) for a, n, t in zip(self.starts.tolist(), sizes.tolist(), tensors)
        ]
        largest = int(sizes.max())
        np_dtype = self.flat.numpy().dtype
        self.magnitudes = np.empty(largest, dtype=np_dtype)
        self.positions = np.empty(largest, dtype=np.int64)
        self.work = np.empty(max(largest, SAMPLE), dtype=np_dtype)

    def __call__(self, tensors: list[Tensor]) -> list[tuple[Tensor, Tensor]]:
        """(values, positions) per tensor, positions sorted."""
        torch._foreach_copy_(self.views, tensors)
        flat = self.flat.numpy()
        total = int(self.ks.sum())
        positions = np.empty(total, dtype=np.int64)
        values = np.empty(total, dtype=flat.dtype)
        _top_segments(
            flat,
            self.starts,
            self.sizes,
            self.ks,
            self.offsets,
            positions,
            values,
            self.magnitudes,
            self.positions,
            self.work,
            SAMPLE,
            Z,
        )
        return list(zip(torch.from_numpy(values).split(self.split), torch.from_numpy(positions).split(self.split)))
