"""Ok-Topk's sparse allreduce (ALGORITHMS.md section 7): about k global entries, the top-k of the sum.

One round for a buffer's sparse part (``numel`` elements, each rank holding its own selection):

0. regions: the index space is cut into P contiguous regions. The boundaries are re-balanced on
   the first round and every ``rebalance_every`` rounds from the ranks' selected-index quantiles
   (allreduce SUM of every rank's P-1 quantiles, integer-divided by P: identical everywhere).
1. split and reduce: each rank sends region j's entries to rank j (all_to_all of counts, then of
   (index, value) pairs with uneven splits); the owner sums its region (fp32 for low precision).
2. global threshold: every ``threshold_every`` rounds (and whenever the last global count left
   [k/2, 2k] or the reused threshold fell off its grid) the exact k-th largest |sum| over all
   regions (each owner contributes its local top-k magnitudes, all-gathered); in between the
   stored threshold is reused and nudged within the round: the owners count their entries at
   24 geometric steps (x1.2) around it, one all-gather of those counts, and every rank takes the
   largest step whose summed count still keeps k entries; a second all-gather of counts at 24
   linear steps inside that step refines it. A nudge after the fact let the count drift to 2k and
   the bytes past the 3(P-1)/P k(v+x) bound; the counts cost 2 x 24 integers per rank. Owners keep
   |sum| >= threshold.
3. balance and allgather: the kept entries, in global index order, are re-cut into P slices of
   ceil(C/P) (all_to_all moves only what crosses a slice boundary), then one equal-sized
   all_gather gives every rank all C entries. The cut needs every owner's kept count: a reused
   threshold is one of the grid's edges, so the grid's counts are all-gathered per rank rather
   than all-reduced and already hold them; an exact threshold takes an all-gather of the counts.

The engine's non-finite vote (``votes``, see schemes.py) rides in the low bit of step 1's counts.

The result is the dense tensor holding those C entries (the top-k of the sum when the threshold
is exact) and ``applied``, their positions; the engine then zeros a rank's residual only where an
element was both sent by the rank and applied globally.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ssfusion_lightning.comm.base import COMMUNICATORS
from ssfusion_lightning.comm.channels import Channel
from ssfusion_lightning.comm.collectives import SchemeCommunicator
from ssfusion_lightning.comm.schemes import COUNT_BYTES, SparseSum, accumulation_dtype, bytes_as, wire_index_dtype
from ssfusion_lightning.comm.traffic import Traffic
from ssfusion_lightning.commcost import (
    OKTOPK_GRID,
    OKTOPK_REBALANCE_EVERY,
    OKTOPK_THRESHOLD_EVERY,
    ring_allreduce_bytes,
)
from ssfusion_lightning.vocabulary import Buffer, Encoded, Plan

#: the reused threshold's grid: REUSE_RATIO ** j for j in [-REUSE_STEPS/2, REUSE_STEPS/2) (commcost
#: charges its counts)
REUSE_STEPS = OKTOPK_GRID
REUSE_RATIO = 1.2


@dataclass
class OkTopkState:
    """Per-buffer state carried across rounds (identical on every rank)."""

    rounds: int = 0
    boundaries: Tensor | None = None  # int64, P + 1 region edges: 0 = b_0 <= ... <= b_P = numel
    threshold: float = 0.0
    exact_next: bool = True
    last_count: int = 0  # global number of entries kept in the last round
    k: int = 0  # the k the threshold was found for: a new k (a density warm-up's stage) needs an exact one

    def as_dict(self) -> dict[str, Any]:
        return {
            "rounds": self.rounds,
            "boundaries": None if self.boundaries is None else self.boundaries.detach().cpu().clone(),
            "threshold": self.threshold,
            "exact_next": self.exact_next,
            "last_count": self.last_count,
            "k": self.k,
        }

    @classmethod
    def from_dict(cls, state: dict[str, Any]) -> OkTopkState:
        boundaries = state.get("boundaries")
        return cls(
            rounds=int(state.get("rounds", 0)),
            boundaries=None if boundaries is None else torch.as_tensor(boundaries, dtype=torch.int64),
            threshold=float(state.get("threshold", 0.0)),
            exact_next=bool(state.get("exact_next", True)),
            last_count=int(state.get("last_count", 0)),
            k=int(state.get("k", 0)),
        )


def _pairs(indices: Tensor, values: Tensor, wire: torch.dtype) -> Tensor:
    return torch.cat([indices.to(wire).contiguous().view(torch.uint8), values.contiguous().view(torch.uint8)])


def _exchange_pairs(
    parts: list[tuple[Tensor, Tensor]],
    recv_counts: list[int],
    dtype: torch.dtype,
    wire: torch.dtype,
    group,
    traffic: Traffic,
) -> list[tuple[Tensor, Tensor]]:
    """all_to_all_single of (position, value) pairs, positions as ``wire``: ``parts[j]`` goes to
    rank j; own part stays."""
    me, world = dist.get_rank(group), dist.get_world_size(group)
    device = parts[me][0].device
    xbytes = torch.tensor([], dtype=wire).element_size()
    pair = xbytes + torch.tensor([], dtype=dtype).element_size()
    in_splits = [0 if j == me else parts[j][0].numel() * pair for j in range(world)]
    out_splits = [0 if j == me else recv_counts[j] * pair for j in range(world)]
    segments = [_pairs(*parts[j], wire) for j in range(world) if j != me and parts[j][0].numel()]
    inbox = torch.empty(sum(out_splits), dtype=torch.uint8, device=device)
    outbox = torch.cat(segments) if segments else inbox.new_empty(0)
    dist.all_to_all_single(inbox, outbox, out_splits, in_splits, group=group)
    traffic.add(sum(in_splits), sum(out_splits))
    got = []
    for j, chunk in enumerate(torch.split(inbox, out_splits)):
        if j == me:
            got.append(parts[me])
            continue
        cut = recv_counts[j] * xbytes
        got.append((bytes_as(chunk[:cut], wire).to(torch.int64), bytes_as(chunk[cut:], dtype)))
    return got


def _all_gather_counts(count: int, group, device: torch.device, traffic: Traffic) -> list[int]:
    world = dist.get_world_size(group)
    mine = torch.tensor([count], dtype=torch.int64, device=device)
    out = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(out, mine, group=group)
    traffic.add((world - 1) * COUNT_BYTES, (world - 1) * COUNT_BYTES)
    return [int(c.item()) for c in out]


def rebalance_boundaries(indices: Tensor, numel: int, group, traffic: Traffic) -> Tensor:
    """Region edges from the mean over ranks of each rank's selected-index P-quantiles."""
    world = dist.get_world_size(group)
    j = torch.arange(1, world, dtype=torch.int64, device=indices.device)
    m = indices.numel()
    if m:
        quantiles = torch.sort(indices).values[(j * m) // world]
    else:
        quantiles = (j * numel) // world
    dist.all_reduce(quantiles, group=group)
    nbytes = ring_allreduce_bytes((world - 1) * COUNT_BYTES, world)
    traffic.add(nbytes, nbytes)
    edges = torch.cat([quantiles.new_zeros(1), quantiles // world, quantiles.new_full((1,), numel)])
    return torch.cummax(edges.clamp(0, numel), 0).values


def count_at_least(magnitude: Tensor, edges: Tensor) -> Tensor:
    """How many entries of ``magnitude`` are >= each edge (edges in magnitude's dtype): exactly
    ``(magnitude >= edge).sum()``, NaN included (never counted, as a NaN edge counts nothing),
    since the balance step trusts these counts to be the owners' kept counts."""
    ordered = torch.sort(magnitude[~torch.isnan(magnitude)]).values
    counts = ordered.numel() - torch.searchsorted(ordered, edges, right=False)
    return counts.masked_fill(torch.isnan(edges), 0)


def reuse_threshold(magnitude: Tensor, threshold: float, k: int, group, traffic: Traffic) -> tuple[float, bool, list[int]]:
    """The stored threshold nudged within the round: the largest step of a geometric grid around
    it whose global count still reaches k, refined once on a linear grid up to the next step
    (error feedback piles magnitudes up just below past thresholds, so one coarse step can
    double the count); also whether the grid missed (then the next round computes it exactly),
    and every rank's count of entries >= the threshold."""
    exponents = torch.arange(REUSE_STEPS, dtype=torch.float64) - REUSE_STEPS // 2
    coarse = threshold * REUSE_RATIO**exponents
    step, reaching, kept = _largest_reaching(magnitude, coarse, k, group, traffic)
    if not 0 < reaching < REUSE_STEPS:
        return step, True, kept
    fine = torch.linspace(step, step * REUSE_RATIO, REUSE_STEPS + 1, dtype=torch.float64)[:-1]
    step, _, kept = _largest_reaching(magnitude, fine, k, group, traffic)
    return step, False, kept


def _largest_reaching(magnitude: Tensor, grid: Tensor, k: int, group, traffic: Traffic) -> tuple[float, int, list[int]]:
    """(the largest grid value whose global count of |sum| >= it reaches k, how many reach k,
    every rank's own count at that value). The counts are all-gathered rather than all-reduced:
    a few more bytes, and the balance step needs no exchange of kept counts of its own."""
    # rounded to the magnitudes' dtype first, so counting here and keeping later compare alike
    edges = grid.to(device=magnitude.device, dtype=magnitude.dtype)
    counts = count_at_least(magnitude, edges)
    world = dist.get_world_size(group)
    if world > 1:
        gathered = [torch.empty_like(counts) for _ in range(world)]
        dist.all_gather(gathered, counts, group=group)
        per_rank = torch.stack(gathered)
        nbytes = (world - 1) * edges.numel() * COUNT_BYTES
        traffic.add(nbytes, nbytes)
    else:
        per_rank = counts.unsqueeze(0)
    # summed in int64: the same global counts as an all-reduce, on every rank
    reaching = int((per_rank.sum(dim=0) >= k).sum())  # counts fall as the edge grows: a prefix reaches k
    chosen = min(max(reaching - 1, 0), edges.numel() - 1)
    return float(edges[chosen]), reaching, per_rank[:, chosen].tolist()


def oktopk_reduce(
    values: Tensor,
    indices: Tensor,
    numel: int,
    k: int,
    group: dist.ProcessGroup | None,
    traffic: Traffic,
    state: OkTopkState,
    rebalance_every: int = OKTOPK_REBALANCE_EVERY,
    threshold_every: int = OKTOPK_THRESHOLD_EVERY,
    votes: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """One Ok-Topk round (``oktopk_pairs``), decoded: (dense result in values' dtype, applied positions)."""
    total, applied = oktopk_pairs(values, indices, numel, k, group, traffic, state, rebalance_every, threshold_every, votes)
    return total.dense(), applied


def oktopk_pairs(
    values: Tensor,
    indices: Tensor,
    numel: int,
    k: int,
    group: dist.ProcessGroup | None,
    traffic: Traffic,
    state: OkTopkState,
    rebalance_every: int = OKTOPK_REBALANCE_EVERY,
    threshold_every: int = OKTOPK_THRESHOLD_EVERY,
    votes: Tensor | None = None,
) -> tuple[SparseSum, Tensor]:
    """One Ok-Topk round; returns (the result as its kept pairs, applied positions int64 sorted)."""
    me, world = dist.get_rank(group), dist.get_world_size(group)
    device, dtype = values.device, values.dtype
    acc = accumulation_dtype(dtype)
    wire = wire_index_dtype(numel)
    indices = indices.to(torch.int64)
    k = max(1, min(int(k), numel))

    # 0. region boundaries
    if state.boundaries is None or state.boundaries.numel() != world + 1 or state.rounds % rebalance_every == 0:
        state.boundaries = rebalance_boundaries(indices, numel, group, traffic) if world > 1 else torch.tensor([0, numel])
    edges = state.boundaries.to(device)

    # 1. split and reduce
    region = torch.searchsorted(edges[1:-1].contiguous(), indices, right=True)
    order = torch.argsort(region, stable=True)
    indices, values, region = indices[order], values[order], region[order]
    send = torch.bincount(region, minlength=world)
    if world > 1:
        words = send if votes is None else send * 2 + votes[me].to(torch.int64)
        recv = torch.empty_like(words)
        dist.all_to_all_single(recv, words, group=group)
        traffic.add((world - 1) * COUNT_BYTES, (world - 1) * COUNT_BYTES)
        if votes is not None:
            votes.copy_(recv & 1)
            recv = recv >> 1
    else:
        recv = send
    counts = send.tolist()
    parts = list(zip(torch.split(indices, counts), torch.split(values, counts)))
    got = _exchange_pairs(parts, recv.tolist(), dtype, wire, group, traffic) if world > 1 else parts
    all_idx = torch.cat([g[0] for g in got])
    region_idx, inverse = torch.unique(all_idx, sorted=True, return_inverse=True)
    region_sum = torch.zeros(region_idx.numel(), dtype=acc, device=device)
    region_sum.index_add_(0, inverse, torch.cat([g[1] for g in got]).to(acc))

    # 2. global threshold
    magnitude = region_sum.abs()
    exact = state.exact_next or state.rounds % threshold_every == 0 or state.k != k
    state.k = k
    if exact:
        local_top = torch.topk(magnitude, min(k, magnitude.numel()), sorted=False).values
        sizes = _all_gather_counts(local_top.numel(), group, device, traffic) if world > 1 else [local_top.numel()]
        if world > 1 and max(sizes) > 0:
            largest = max(sizes)
            padded = torch.zeros(largest, dtype=acc, device=device)
            padded[: local_top.numel()] = local_top
            gathered = [torch.empty_like(padded) for _ in range(world)]
            dist.all_gather(gathered, padded, group=group)
            elem = padded.element_size()
            traffic.add(
                (world - 1) * local_top.numel() * elem,
                (sum(sizes) - local_top.numel()) * elem,
                (world - 1) * largest * elem,
                (world - 1) * largest * elem,
            )
            candidates = torch.cat([g[:n] for g, n in zip(gathered, sizes)])
        else:
            candidates = local_top
        state.threshold = float(torch.topk(candidates, k).values.min()) if candidates.numel() > k else 0.0
    missed, sizes = False, None
    if not exact:
        state.threshold, missed, sizes = reuse_threshold(magnitude, state.threshold, k, group, traffic)
    keep = magnitude >= state.threshold
    kept_idx, kept_val = region_idx[keep], region_sum[keep].to(dtype)  # the one cast, by the owner

    # 3. balance into ceil(C/P) slices in global index order, then allgather
    if sizes is None:  # an exact threshold: the owners' kept counts are not known yet
        sizes = _all_gather_counts(kept_idx.numel(), group, device, traffic) if world > 1 else [kept_idx.numel()]
    total_count = sum(sizes)
    chunk = -(-total_count // world)
    starts = [sum(sizes[:j]) for j in range(world)]

    def overlap(a0: int, a1: int, t: int) -> int:
        return max(0, min(a1, min(total_count, (t + 1) * chunk)) - max(a0, t * chunk))

    if world > 1 and total_count > 0:
        out_counts = [overlap(starts[me], starts[me] + sizes[me], t) for t in range(world)]
        in_counts = [overlap(starts[j], starts[j] + sizes[j], me) for j in range(world)]
        pieces = list(zip(torch.split(kept_idx, out_counts), torch.split(kept_val, out_counts)))
        held = _exchange_pairs(pieces, in_counts, dtype, wire, group, traffic)
        slice_idx = torch.cat([h[0] for h in held])
        slice_val = torch.cat([h[1] for h in held])
        xbytes = torch.tensor([], dtype=wire).element_size()
        pair = xbytes + values.element_size()
        n_mine = slice_idx.numel()
        # positions then values, each region padded to a multiple of 8 bytes so any dtype can view it
        split = -(-chunk * xbytes // 8) * 8
        message = torch.zeros(split + chunk * values.element_size(), dtype=torch.uint8, device=device)
        message[:split].view(wire)[:n_mine] = slice_idx.to(wire)
        message[split:].view(dtype)[:n_mine] = slice_val
        gathered = [torch.empty_like(message) for _ in range(world)]
        dist.all_gather(gathered, message, group=group)
        traffic.add(
            (world - 1) * n_mine * pair,
            (total_count - n_mine) * pair,
            (world - 1) * message.numel(),
            (world - 1) * message.numel(),
        )
        held_counts = [overlap(0, total_count, t) for t in range(world)]
        out_idx = torch.cat([g[:split].view(wire)[:n].to(torch.int64) for g, n in zip(gathered, held_counts)])
        out_val = torch.cat([g[split:].view(dtype)[:n] for g, n in zip(gathered, held_counts)])
    else:  # one rank, or nothing kept anywhere
        out_idx, out_val = kept_idx, kept_val
    total = SparseSum(numel, dtype, [(out_idx, out_val)])

    # threshold bookkeeping, from the global count (identical on every rank)
    state.rounds += 1
    state.last_count = total_count
    state.exact_next = state.rounds % threshold_every == 0 or missed or not (k / 2 <= total_count <= 2 * k)
    return total, out_idx


class OkTopkStates:
    """Ok-Topk's state per buffer (keyed ``index:sparse numel``), read by the channels' threads."""

    def __init__(self) -> None:
        self._states: dict[str, OkTopkState] = {}
        self._lock = threading.Lock()

    def of(self, key: str) -> OkTopkState:
        with self._lock:
            return self._states.setdefault(key, OkTopkState())

    def values(self) -> list[OkTopkState]:
        with self._lock:
            return list(self._states.values())

    def keep(self, plan: Plan) -> None:
        """Drop the states of buffers the plan no longer has."""
        live = {f"{b.index}:{b.sparse_numel}" for b in plan.buffers}
        with self._lock:
            self._states = {key: state for key, state in self._states.items() if key in live}

    def state_dict(self) -> dict[str, Any]:
        with self._lock:
            return {"buffers": {key: s.as_dict() for key, s in self._states.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with self._lock:
            self._states = {key: OkTopkState.from_dict(s) for key, s in state.get("buffers", {}).items()}


@COMMUNICATORS.register("oktopk")
class OkTopkCommunicator(SchemeCommunicator):
    """Ok-Topk: the dense part is all-reduced, the sparse part goes through ``oktopk_reduce``
    (approximate: about k entries, the top-k of the sum) and reports the applied positions."""

    name = "oktopk"
    split = True
    exact = False

    def __init__(
        self, rebalance_every: int = OKTOPK_REBALANCE_EVERY, threshold_every: int = OKTOPK_THRESHOLD_EVERY, **options: Any
    ) -> None:
        super().__init__(**options)
        for label, value in (("rebalance_every", rebalance_every), ("threshold_every", threshold_every)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"oktopk communicator: {label} must be an integer >= 1, got {value!r}")
        self.rebalance_every = rebalance_every
        self.threshold_every = threshold_every
        self.states = OkTopkStates()

    def submit_sparse(self, channel: Channel, encoded: Encoded, buffer: Buffer) -> Future:
        key = f"{buffer.index}:{buffer.sparse_numel}"
        k = sum(slot.k for slot in buffer.sparse_slots)
        return channel.submit(self._oktopk_job, key, k, encoded.values, encoded.indices, buffer.sparse_numel, encoded.votes)

    def state_for(self, key: str) -> OkTopkState:
        return self.states.of(key)

    def _oktopk_job(self, key: str, k: int, values: Tensor, indices: Tensor, numel: int, votes: Tensor | None, group):
        traffic = Traffic()
        total, applied = oktopk_pairs(
            values, indices, numel, k, group, traffic, self.state_for(key), self.rebalance_every, self.threshold_every, votes
        )
        return total, traffic, applied

    def set_plan(self, plan: Plan) -> None:
        self.states.keep(plan)

    def state_dict(self) -> dict[str, Any]:
        return self.states.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.states.load_state_dict(state)
