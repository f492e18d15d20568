"""Batched selection: the tensors of one fusion buffer selected with a few whole-buffer passes.

Why: a per-tensor selection is a few dozen small ops (sample, top-k of the sample, compare,
nonzero, top-k of the candidates, gathers). At the sizes of a real buffer, tens of tensors of
10^2 to 10^5 elements, its cost is dispatch and Python, not data: at 2^20 elements top-k costs
11x one ``abs()`` pass and dgc 7x, at 2^24 about 1x. A ``FlatBatch`` pays each step once for the
whole buffer:

1. one ``_foreach_copy_`` of the tensors into cached views of a reused flat scratch (logical
   row-major order, so non-contiguous and channels_last inputs are fine), one ``abs`` into a
   float32 (float64 for float64 input) magnitude scratch. Largest tensors first, so that the
   small ones form one contiguous tail;
2. per-tensor thresholds from one batch of samples: a row of sampled positions per tensor,
   rows of similar width padded into one matrix (pads point at a -inf sentinel), gathered at
   once and ranked with one sort (wide rows: ``ranked_rows``, a bound from the rows' group maxima
   and a sort of the few entries above it), each row read at its own rank;
3. one compare of the flat magnitudes with the per-tensor thresholds (one call per large
   tensor, one call against per-element thresholds for the tail) and ONE compaction for all
   tensors; the per-tensor counts come from a ``searchsorted`` of the tensors' bounds in the
   sorted positions;
4. the exact part -- the top k among a tensor's few candidates -- with one partition of the
   candidates' magnitudes per tensor that has more than k;
5. one gather of the values and one split into per-tensor results.

On CPU, steps 2-4 run in numpy on zero-copy views of the torch scratch: on the 2-core AVX2
machine of the benchmarks its compare into a bool mask is ~6x faster than torch's, its
``flatnonzero`` at ~1% density ~3.5x faster than ``nonzero``, its ``argpartition`` 2-3x faster
than ``topk`` (its vectorized row sort is about as fast as ``topk`` of the sample's ranks), and
a numpy call costs a third of a torch op's dispatch. Other devices (CUDA) run the equivalent
torch ops; index matrices are built on the host either way.

Every kernel keeps the per-tensor semantics of its sparsifier: the same thresholds (same
samples, same ranks), the same exact counts, the same band checks; whatever is not decided in
the batch (a bound that failed, a count outside the band) is finished by the per-tensor code.
The equality holds for finite input (non-finite gradients are refused by the memories anyway).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any, Union

import numpy as np
import torch
from torch import Tensor

from ssfusion_lightning.sparsifiers.base import check_many
from ssfusion_lightning.sparsifiers.selection import (
    Candidates,
    ThresholdSearch,
    in_dtype,
    lowest_ties_np,
    magnitude_dtype,
    on_host,
    search_threshold,
    thread_buffer,
    topk_positions,
    weyl_positions,
)

if TYPE_CHECKING:
    from ssfusion_lightning.sparsifiers.base import Sparsifier, ThresholdSparsifier

#: positions into the flat buffer: numpy on CPU, a torch tensor on the buffer's device elsewhere
Positions = Union[np.ndarray, Tensor]

#: tensors with at least this many elements are selected on their own: their per-tensor overhead
#: is amortized already, and a copy of them in the batch scratch would double their memory
OWN_MIN = 1 << 22
#: segments with at least this many elements are compared with one call each; the smaller ones
#: (the tail of the buffer) share one compare against per-element thresholds
LOOP_MIN = 1 << 14
#: sampled positions per segment for the top-k lower bounds; a segment at most this large is
#: taken whole, which makes its bound the exact k-th magnitude
TOPK_SAMPLE = 1024
#: sample rows at least this wide are ranked by ``ranked_rows`` (a bound from group maxima, a sort
#: of the entries above it), narrower ones with one sort of their whole matrix
PARTITION_MIN = 1024
#: ``ranked_rows`` folds each row this many times: the maxima of groups of 2 ** RANK_FOLDS
RANK_FOLDS = 3
#: z-score of the top-k bounds' safety margin (a failed bound costs one exact top-k of that
#: segment, so a smaller margin than the per-tensor pre-filter's pays off)
TOPK_Z = 3.0


# --------------------------------------------------------------------------- layout and scratch
@dataclass(frozen=True)
class Layout:
    """Where the tensors of a batch lie in the flat buffer (cached per tuple of numels).

    Indices ``i`` are batch positions (the caller's order). The buffer holds the tensors largest
    first (ties in batch order), so the ones below ``LOOP_MIN`` form a contiguous tail.
    """

    numels: tuple[int, ...]
    sizes: np.ndarray  # numels as an array
    starts: np.ndarray  # buffer start of each tensor
    order: np.ndarray  # batch index of each tensor in buffer order
    total: int
    #: batch indices compared one call each (the large ones), in buffer order
    looped: tuple[int, ...]
    #: start of the tail and the batch indices in it, in buffer order
    tail_start: int
    tail: np.ndarray


@lru_cache(maxsize=512)
def layout_of(numels: tuple[int, ...]) -> Layout:
    sizes = np.asarray(numels, dtype=np.int64)
    order = np.argsort(-sizes, kind="stable")
    starts = np.zeros(len(numels), dtype=np.int64)
    starts[order] = np.cumsum(sizes[order]) - sizes[order]
    total = int(sizes.sum())
    looped = tuple(int(i) for i in order if numels[i] >= LOOP_MIN)
    tail = order[sizes[order] < LOOP_MIN]
    tail_start = int(starts[tail[0]]) if tail.size else total
    return Layout(numels, sizes, starts, order, total, looped, tail_start, tail)


_SCRATCH = threading.local()


def _scratch(kind: str, dtype: torch.dtype, device: torch.device, numel: int) -> Tensor:
    """The batch's per-thread flat buffer of ``kind`` (``selection.thread_buffer``)."""
    return thread_buffer(kind, dtype, device, numel, on_grow=_forget_views)


def _forget_views() -> None:
    getattr(_SCRATCH, "views", {}).clear()  # views of the old buffer would keep it alive


def _views_of(flat: Tensor, shapes: tuple[torch.Size, ...], lay: Layout) -> list[Tensor]:
    """Views of ``flat`` in the tensors' shapes at their buffer positions, cached per buffer and
    shapes: one ``_foreach_copy_`` into them flattens all the tensors (logical row-major order,
    whatever their strides) with none of the 60-odd ``reshape`` calls and their dispatch."""
    cache = getattr(_SCRATCH, "views", None)
    if cache is None or len(cache) > 64:
        cache = _SCRATCH.views = {}
    key = (flat.data_ptr(), flat.dtype, flat.device, shapes)
    views = cache.get(key)
    if views is None:
        views = [flat[a : a + n].view(shape) for a, n, shape in zip(lay.starts.tolist(), lay.numels, shapes)]
        cache[key] = views
    return views


def ranked_rows(matrix: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """Row r of a magnitude matrix [R, W] (W a power of two, pads -inf) read at its ranks cols[r]
    (1-based, largest first; at most W / 4), as float64 [R, m].

    A row's t-th largest entry is at least the t-th largest of its group maxima (t groups each
    hold an entry that large), so the entries from that bound up hold the row's t largest. Three
    folds of each row onto its halves give the maxima of groups of 8; one partition of the
    maxima gives the bounds, one compare and one sort of the few survivors (by row, then
    magnitude) the ranks. On AVX2 this is a quarter of one partition of the rows (4.8 ns an
    element). A bound that is not finite (a row of pads) or a NaN takes that partition instead."""
    rows, width = matrix.shape
    top = int(cols.max())
    maxima = matrix
    for _ in range(RANK_FOLDS):
        half = maxima.shape[1] // 2
        maxima = np.maximum(maxima[:, :half], maxima[:, half:])
    groups = maxima.shape[1]
    if groups >= 2 * top and not np.isnan(maxima).any():  # NaN ranks above everything: not a bound
        bound = np.partition(maxima, groups - top, axis=1)[:, groups - top]
        if np.isfinite(bound).all():
            flat = np.flatnonzero(matrix >= bound[:, None])
            row_of = flat // width
            survivors = matrix.reshape(-1)[flat]
            if survivors.dtype == np.float32:  # non-negative floats sort as their bits: one key sort
                keys = np.sort((row_of.astype(np.uint64) << np.uint64(32)) | survivors.view(np.uint32).astype(np.uint64))
                ordered = (keys & np.uint64(0xFFFFFFFF)).astype(np.uint32).view(np.float32)
            else:
                ordered = survivors[np.lexsort((survivors, row_of))]
            ends = np.cumsum(np.bincount(row_of, minlength=rows))
            return ordered[ends[:, None] - cols].astype(np.float64)
    tail = np.partition(matrix, width - top, axis=1)[:, width - top :]
    tail.sort(axis=1)
    return tail[np.arange(rows)[:, None], top - cols].astype(np.float64)


# --------------------------------------------------------------------------- the batch
class FlatBatch:
    """Same-dtype, same-device, non-empty tensors flattened into one buffer, with magnitudes.

    A kernel sets the candidates of every tensor with one ``at_least`` pass, keeps the top k of
    some (``trim``), replaces others by a result found elsewhere (``replace``); ``results`` then
    gathers everything at once. The buffers are per-thread scratch: a batch is valid until the
    thread builds the next one.
    """

    def __init__(self, tensors: Sequence[Tensor], numels: tuple[int, ...]) -> None:
        self.dtype = tensors[0].dtype
        self.device = tensors[0].device
        self.cpu = on_host(tensors[0])  # the numpy path
        self.layout = lay = layout_of(numels)
        n = lay.total
        self.signed = _scratch("signed", self.dtype, self.device, n)[:n]
        torch._foreach_copy_(_views_of(self.signed, tuple(t.shape for t in tensors), lay), tensors)
        mag_dtype = magnitude_dtype(self.dtype)
        self.mag = _scratch("mag", mag_dtype, self.device, n + 1)[: n + 1]
        if mag_dtype == self.dtype:
            torch.abs(self.signed, out=self.mag[:n])
        else:  # abs() cannot write another dtype
            self.mag[:n].copy_(self.signed).abs_()
        #: what the pads of a row matrix point at: never selected, never ranked
        self.sentinel = n
        if self.cpu:
            self.mag_np = self.mag.numpy()
            self.mag_np[n] = -np.inf
            self.mask_np = _scratch("mask", torch.bool, self.device, n)[:n].numpy()
        else:
            self.mag[n] = -math.inf
        self.found: Positions | None = None
        self.found_magnitudes: np.ndarray | None = None  # of ``found``, gathered once per pass
        self.first = self.last = np.zeros(0, dtype=np.int64)
        self.keep: np.ndarray | Tensor | None = None
        self.finished: dict[int, tuple[Tensor, Tensor]] = {}

    def bounds(self, i: int) -> tuple[int, int]:
        start = int(self.layout.starts[i])
        return start, start + self.layout.numels[i]

    # ----------------------------------------------------------------------- thresholds
    def kth_largest(self, rows: Sequence[tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
        """For every (index matrix [R, W], ranks [R] or [R, m]) group: the ranks[r]-th largest
        magnitude of row r (pads hold the sentinel; with m ranks per row, m values from one
        ranking of the row), as float64, the rows of all groups concatenated."""
        out = []
        for index, ranks in rows:
            width = index.shape[1]
            cols = ranks.reshape(len(ranks), -1)
            if self.cpu:
                matrix = self.mag_np.take(index)
                top = int(cols.max())
                if width < PARTITION_MIN or 4 * top > width:
                    matrix.sort(axis=1)
                    out.append(matrix[np.arange(len(cols))[:, None], width - cols].astype(np.float64))
                    continue
                out.append(ranked_rows(matrix, cols))
                continue
            else:
                index_t = torch.from_numpy(index).to(self.device)
                matrix = self.mag.index_select(0, index_t.view(-1)).view(index.shape)
                top = torch.topk(matrix, int(cols.max()), dim=1).values
                rank_t = torch.from_numpy(cols - 1).to(self.device)
                out.append(top.gather(1, rank_t).double().cpu().numpy())
        if not out:
            return np.zeros(0)
        values = np.concatenate(out)
        return values[:, 0] if all(ranks.ndim == 1 for _, ranks in rows) else values

    # ----------------------------------------------------------------------- candidates
    def at_least(self, thresholds: Sequence[float]) -> np.ndarray:
        """Make the candidates of every tensor i its positions with ``|x| >= thresholds[i]``
        (NaN: none) and return their counts.

        Thresholds must be exact in the magnitude dtype (see ``in_dtype``)."""
        lay = self.layout
        n = lay.total
        if self.cpu:
            mag, mask = self.mag_np, self.mask_np
            per_tensor = np.asarray(thresholds, dtype=mag.dtype)
            for i in lay.looped:
                a, b = self.bounds(i)
                np.greater_equal(mag[a:b], per_tensor[i], out=mask[a:b])
            if lay.tail.size:
                tail = np.repeat(per_tensor[lay.tail], lay.sizes[lay.tail])
                np.greater_equal(mag[lay.tail_start : n], tail, out=mask[lay.tail_start : n])
            self.found = np.flatnonzero(mask)
            self.first = np.searchsorted(self.found, lay.starts)
            self.last = np.searchsorted(self.found, lay.starts + lay.sizes)
        else:  # the thresholds expanded per element, so the compare is one kernel
            per_tensor = np.asarray(thresholds)[lay.order]
            per_segment = torch.tensor(per_tensor, dtype=self.mag.dtype, device=self.device)
            sizes = torch.from_numpy(lay.sizes[lay.order]).to(self.device)
            expanded = torch.repeat_interleave(per_segment, sizes, output_size=n)
            self.found = (self.mag[:n] >= expanded).nonzero().view(-1)
            edges = torch.from_numpy(np.stack([lay.starts, lay.starts + lay.sizes])).to(self.device)
            self.first, self.last = torch.searchsorted(self.found, edges).cpu().numpy()
        self.found_magnitudes = None
        self.keep = None
        self.finished = {}
        return self.last - self.first

    def count_at(self, i: int, threshold: float) -> int:
        """How many of tensor i's candidates have ``|x| >= threshold`` (exact in the magnitude dtype,
        see ``in_dtype``; NaN: none): a search's count inside the set, on the host on CPU."""
        a, b = int(self.first[i]), int(self.last[i])
        if self.cpu:
            return int(np.count_nonzero(self._found_magnitudes()[a:b] >= self.mag_np.dtype.type(threshold)))
        return int((self.mag[self.found[a:b]] >= threshold).sum())

    def restrict(self, i: int, threshold: float) -> None:
        """Keep only tensor i's candidates with ``|x| >= threshold`` (exact, as in ``count_at``)."""
        a, b = int(self.first[i]), int(self.last[i])
        if self.cpu:
            self._keep()[a:b] = self._found_magnitudes()[a:b] >= self.mag_np.dtype.type(threshold)
        else:
            self._keep()[a:b] = self.mag[self.found[a:b]] >= threshold

    def _found_magnitudes(self) -> np.ndarray:
        if self.found_magnitudes is None:
            self.found_magnitudes = self.mag_np[self.found]
        return self.found_magnitudes

    def candidates(self, i: int) -> Positions:
        """Tensor i's candidates: sorted buffer positions."""
        return self.found[self.first[i] : self.last[i]]

    def local(self, i: int, positions: Positions) -> Tensor:
        """Buffer positions of tensor i as int64 indices into that tensor, on its device."""
        shifted = positions - int(self.layout.starts[i])
        return torch.from_numpy(shifted) if self.cpu else shifted

    def _keep(self) -> np.ndarray | Tensor:
        if self.keep is None:
            count = len(self.found)
            if self.cpu:
                self.keep = np.ones(count, dtype=bool)
            else:
                self.keep = torch.ones(count, dtype=torch.bool, device=self.device)
        return self.keep

    def trim(self, items: Sequence[int], ks: Sequence[int]) -> None:
        """Keep only the ks[j] candidates of tensor items[j] with the largest magnitudes; equal
        magnitudes at the cut go to the lowest positions (``selection.lowest_ties``).

        On the numpy path, per tensor: one ``partition`` of its candidates' magnitudes finds the
        k-th largest, one compare keeps everything from it up, and a tie at the cut (more than k
        kept) sends that tensor to the tie-breaking ``_trim_one``. On 29 tensors' 22K candidates
        this took a third of one sort of (tensor, magnitude) keys over all of them."""
        if not items:
            return  # no keep mask: ``results`` then gathers every candidate without a masked copy
        if not self.cpu:
            for i, k in zip(items, ks):
                self._trim_one(i, k)
            return
        keep, found_magnitudes = self._keep(), self._found_magnitudes()
        for i, k in zip(items, ks):
            a, b = int(self.first[i]), int(self.last[i])
            magnitudes = found_magnitudes[a:b]
            cut = np.partition(magnitudes, b - a - k)[b - a - k]
            chosen = magnitudes >= cut
            if np.count_nonzero(chosen) == k:
                keep[a:b] = chosen
            else:
                self._trim_one(i, k)

    def _trim_one(self, i: int, k: int) -> None:
        a, b = int(self.first[i]), int(self.last[i])
        if self.cpu:
            magnitudes = self._found_magnitudes()[a:b]
            chosen = lowest_ties_np(magnitudes, np.argpartition(magnitudes, b - a - k)[b - a - k :], k)
        else:
            chosen = topk_positions(self.mag[self.found[a:b]], k)
        keep = self._keep()
        keep[a:b] = False
        keep[chosen + a] = True

    def replace(self, i: int, result: tuple[Tensor, Tensor]) -> None:
        """Tensor i's (values, indices) were found elsewhere: drop its candidates."""
        self._keep()[int(self.first[i]) : int(self.last[i])] = False
        self.finished[i] = result

    def top_of_segment(self, i: int, k: int) -> tuple[Tensor, Tensor]:
        """Exact top-k of all of tensor i's elements (the fallback of a failed bound)."""
        a, b = self.bounds(i)
        if self.cpu:
            magnitudes = self.mag_np[a:b]
            chosen = torch.from_numpy(lowest_ties_np(magnitudes, np.argpartition(magnitudes, b - a - k)[b - a - k :], k))
        else:
            chosen = topk_positions(self.mag[a:b], k)
        return self.signed[a:b].index_select(0, chosen), chosen

    # ----------------------------------------------------------------------- output
    def results(self) -> list[tuple[Tensor, Tensor]]:
        """(values, indices) per tensor: one gather of every kept candidate and one split."""
        lay = self.layout
        found = self.found if self.keep is None else self.found[self.keep]
        starts = lay.starts[lay.order]
        ends = starts + lay.sizes[lay.order]
        if self.cpu:
            counts = np.diff(np.searchsorted(found, ends), prepend=0)
            indices = torch.from_numpy(found - np.repeat(starts, counts))
            found = torch.from_numpy(found)
        else:
            ends_t = torch.searchsorted(found, torch.from_numpy(ends).to(self.device))
            counts_t = torch.diff(ends_t, prepend=found.new_zeros(1))
            starts_t = torch.from_numpy(starts).to(self.device)
            indices = found - torch.repeat_interleave(starts_t, counts_t, output_size=len(found))
            counts = counts_t.cpu().numpy()
        values = self.signed.index_select(0, found)
        sizes = counts.tolist()
        out: list[Any] = [None] * len(lay.numels)
        for i, v, idx in zip(lay.order.tolist(), values.split(sizes), indices.split(sizes)):
            out[i] = (v, idx)
        for i, result in self.finished.items():
            out[i] = result
        return out


# --------------------------------------------------------------------------- driver
Kernel = Callable[[FlatBatch, Sequence[Tensor], Sequence[str], Sequence[int]], None]


def select_many(
    sparsifier: Sparsifier,
    tensors: Sequence[Tensor],
    keys: Sequence[str],
    ks: Sequence[int | None],
    kernel: Kernel,
) -> list[tuple[Tensor, Tensor]]:
    """Run ``kernel`` on batches of the tensors that need a real selection (one batch per dtype
    and device); empty tensors, budgets that keep everything and very large tensors go through
    the per-tensor ``select``."""
    check_many(tensors, keys, ks)
    out: list[Any] = [None] * len(tensors)
    groups: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    numels = [t.numel() for t in tensors]
    resolve = sparsifier.resolve_k
    budgets = [resolve(n, k) for n, k in zip(numels, ks)]
    for i, (tensor, n, k) in enumerate(zip(tensors, numels, budgets)):
        if n == 0 or k >= n or n >= OWN_MIN:
            out[i] = sparsifier.select(tensor, key=keys[i], k=ks[i])
        else:
            groups.setdefault((tensor.dtype, tensor.device), []).append(i)
    with torch.no_grad():
        for members in groups.values():
            batch_tensors = [tensors[i] for i in members]
            batch = FlatBatch(batch_tensors, tuple(numels[i] for i in members))
            kernel(batch, batch_tensors, [keys[i] for i in members], [budgets[i] for i in members])
            for i, result in zip(members, batch.results()):
                out[i] = result
    return out


# --------------------------------------------------------------------------- rows of sampled positions
def group_rows(rows: Sequence[np.ndarray], ranks: Sequence[int], sentinel: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Pack rows of positions into index matrices, one per width class (the next power of two of
    the row's length), padded with ``sentinel``. Returns (matrix, ranks) per class; the rows of
    the classes, concatenated, are ``rows`` in the order of ``class_order(rows)``."""
    classes: dict[int, list[int]] = {}
    for r, row in enumerate(rows):
        classes.setdefault(1 << max(0, (len(row) - 1).bit_length()), []).append(r)
    out = []
    for width in sorted(classes):
        members = classes[width]
        matrix = np.full((len(members), width), sentinel, dtype=np.int64)
        for slot, r in enumerate(members):
            matrix[slot, : len(rows[r])] = rows[r]
        out.append((matrix, np.asarray([ranks[r] for r in members], dtype=np.int64)))
    return out


def class_order(lengths: Sequence[int]) -> list[int]:
    """The row order ``group_rows`` produces (by width class, stable within a class)."""
    return sorted(range(len(lengths)), key=lambda r: (max(0, lengths[r] - 1).bit_length(), r))


# --------------------------------------------------------------------------- exact top-k
@dataclass(frozen=True)
class TopkPlan:
    """The static part of a batched top-k (cached per numels and ks): the lower-bound rows. A
    tensor with no row (a dense budget) takes the top k of all its elements."""

    rows: list[tuple[np.ndarray, np.ndarray]]
    #: batch index of every row, in the order ``kth_largest`` returns them
    row_of: tuple[int, ...]


@lru_cache(maxsize=256)
def topk_plan(numels: tuple[int, ...], ks: tuple[int, ...]) -> TopkPlan:
    lay = layout_of(numels)
    rows, ranks, owners = [], [], []
    for i, (n, k) in enumerate(zip(numels, ks)):
        start = int(lay.starts[i])
        size = min(TOPK_SAMPLE, n)
        if size == n:  # the whole tensor: the bound is its exact k-th magnitude
            rows.append(np.arange(start, start + n, dtype=np.int64))
            ranks.append(k)
            owners.append(i)
            continue
        expected = k * size / n
        rank = math.ceil(expected + TOPK_Z * math.sqrt(expected) + 2)
        if 4 * rank > size:
            continue  # a dense budget: a bound would filter little
        rows.append(weyl_positions(n, size) + start)
        ranks.append(rank)
        owners.append(i)
    order = class_order([len(r) for r in rows])
    return TopkPlan(group_rows(rows, ranks, lay.total), tuple(owners[r] for r in order))


def exact_topk(batch: FlatBatch, tensors: Sequence[Tensor], keys: Sequence[str], ks: Sequence[int]) -> None:
    """Exact top-k of every tensor (the selection of ``torch.topk(x.abs(), k)`` up to ties).

    Per tensor, a lower bound of its k-th magnitude: the exact k-th one for a tensor of at most
    ``TOPK_SAMPLE`` elements, else a rank of a spread sample chosen so that, with high
    probability, at least k elements reach it. One pass keeps the candidates above the bounds;
    a tensor with at least k candidates keeps the top k among them (exact: everything else is
    below every candidate); one with fewer (the bound failed) takes the top k of all its elements.
    """
    plan = topk_plan(batch.layout.numels, tuple(ks))
    thresholds = np.full(len(ks), math.nan)
    thresholds[list(plan.row_of)] = batch.kth_largest(plan.rows)
    # a bound of 0 keeps every zero too: filtering nothing, it is no bound
    thresholds[~(thresholds > 0) | np.isinf(thresholds)] = math.nan
    counts = batch.at_least(thresholds.tolist())
    budgets = np.asarray(ks)
    for i in np.flatnonzero(counts < budgets).tolist():  # no bound, or a failed one
        batch.replace(i, batch.top_of_segment(i, ks[i]))
    over = np.flatnonzero(counts > budgets).tolist()
    batch.trim(over, [ks[i] for i in over])


# --------------------------------------------------------------------------- threshold sparsifiers
def settle(
    sparsifier: ThresholdSparsifier,
    batch: FlatBatch,
    tensors: Sequence[Tensor],
    ks: Sequence[int],
    thresholds: Sequence[float],
    rounds: int,
    floors: Sequence[float] | None = None,
) -> None:
    """The rest of a threshold sparsifier's ``select`` after its first threshold per tensor:
    count, adjust while outside the band, select, trim (``sparsifier.band`` gives the band and
    the trim cap).

    One batched pass makes every tensor's candidates: its positions at ``floors[i]`` where that
    lies below its threshold (dgc's search floor, drawn from the same sample: the set its own
    ``select`` prepares first), else at the threshold. Each tensor's search (``ThresholdSearch``,
    as in ``select``) counts its probes inside that set (``count_at``: on the host on CPU, no
    tensor op); the chosen set stays in the batch, trimmed there when above the cap. Only a search
    whose probe falls below the set (it went lower than the floor), a first threshold that is no
    threshold (0, inf, NaN) or an empty choice is finished by the per-tensor code, which makes
    the extra pass as ``select`` would.
    """
    usable = [t > 0 and math.isfinite(t) for t in thresholds]
    lows = [
        f if floors is not None and ok and 0 < f < t else t
        for t, f, ok in zip(thresholds, floors if floors is not None else thresholds, usable)
    ]
    batch.at_least(in_dtype([low if ok else math.nan for low, ok in zip(lows, usable)], batch.dtype))
    over = []
    for i, k in enumerate(ks):
        low, high, cap = sparsifier.band(k)
        flat = tensors[i].reshape(-1)
        if not usable[i]:
            candidates = Candidates(flat)
            threshold, _ = search_threshold(candidates, thresholds[i], low, high, rounds)
            batch.replace(i, sparsifier.finish(flat, candidates.select(threshold), k, cap))
            continue
        search = ThresholdSearch(thresholds[i], low, high, rounds, floor=lows[i] if lows[i] < thresholds[i] else None)
        while search.probe is not None and not search.probe < lows[i]:  # NaN counts nothing, inside the set too
            search.feed(batch.count_at(i, in_dtype([search.probe], batch.dtype)[0]))
        if search.probe is not None:
            candidates = Candidates.known(flat, lows[i], batch.local(i, batch.candidates(i)))
            while search.probe is not None:
                search.feed(candidates.count(search.probe))
            batch.replace(i, sparsifier.finish(flat, candidates.select(search.threshold), k, cap))
        elif search.count > cap:
            over.append(i)  # the top k of the set are the top k of the choice: cap >= k
        elif search.count == 0:
            batch.replace(i, sparsifier.finish(flat, flat.new_empty(0, dtype=torch.int64), k, cap))
        elif search.threshold != lows[i]:
            batch.restrict(i, in_dtype([search.threshold], batch.dtype)[0])
    batch.trim(over, [ks[i] for i in over])
