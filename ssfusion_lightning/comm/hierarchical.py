"""``hierarchical``: reduce inside the node, exchange across nodes only, share back inside the node.

For ``num_nodes x ranks_per_node`` ranks (``topology.py``), one buffer part of n elements, cut into
ranks_per_node stripes:

1. inside the node, over the fast link, local rank l gets the node's sum of stripe l
   (n / ranks_per_node elements). The dense part is reduce-scattered. The sparse part has two node
   steps: ``dense`` scatters every rank's k selected pairs into an n-element tensor and
   reduce-scatters it; ``sparse`` all-gathers the k pairs (``schemes.allgather_sum``) and sums
   them, in fp32 at least so low-precision partial sums cross nodes unrounded;
2. across nodes, on the cross-node group of local rank l (its own NIC): the dense part's stripe
   is all-reduced, the sparse part's stripe goes through the ``cross`` scheme as the stripe's
   nonzeros: every local rank works on its own stripe at once, so every NIC carries a share;
3. inside the node, every rank gets the whole sum: the dense step all-gathers the summed stripes
   (n elements), the sparse step all-gathers each stripe's nonzeros (positions offset to the
   stripe's place; the stripes are disjoint, so their sum is their concatenation).

The sparse node step moves O(k) bytes per rank instead of O(n): fewer wherever the sum is sparse.
``node="auto"`` (the default) picks, per buffer, the step with fewer modelled bytes on the node
link (``commcost.choose_node_step``) from the plan's n and k and the layout only, never from what
a rank selected, so every rank issues the same collectives.

With ``cross="allgather"`` a third node step, ``relay``, forms no partial sum at all: each rank
all-gathers its own k pairs on its cross-node group (the ranks of its local index, one per node),
then the node all-gathers what each local rank received. Every rank ends with every rank's pairs,
as a flat allgather gives them, in two collectives (no count round where the plan bounds the
counts) and O(P k) work: no pass over the part's n elements, which the striped steps make
several of. The slow link carries each rank's pairs once per other node, against a flat ring
allgather's P - 1 times through some node link.

With an exact ``cross`` scheme (allreduce, allgather, zen, sparcml) the result is the exact sum
of every rank's part, as a flat scheme's (up to fp summation order; low-precision values are
summed in fp32 and cast once), under either node step. Every node receives the same cross-node
sums and shares them the same way, so every rank ends bitwise identical. ``cross="oktopk"``
selects again: each stripe keeps about k / ranks_per_node entries of its sum (Ok-Topk's top-k),
and the positions kept are reported as applied (shared back in the node as the sums are: a byte
mask of n, or the kept positions), so the engine's error feedback keeps, on every rank, what was
not applied.

The bytes a rank moves (``Traffic``) count both links: the node-local steps as well as the
cross-node step.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ssfusion_lightning.comm.base import COMMUNICATORS, Communicator, PendingReduction
from ssfusion_lightning.comm.channels import Channel, ChannelSet
from ssfusion_lightning.comm.oktopk import OkTopkState, OkTopkStates, oktopk_reduce
from ssfusion_lightning.comm.schemes import (
    SPARSE_SCHEMES,
    SparseSum,
    accumulation_dtype,
    allgather_pairs,
    allgather_sum,
    exchange_counts,
    index_bytes,
    wire_index_dtype,
)
from ssfusion_lightning.comm.topology import Hierarchy
from ssfusion_lightning.comm.traffic import Traffic
from ssfusion_lightning.commcost import NODE_STEPS, RELAY, SCHEMES, BufferShape, choose_node_step, ring_allreduce_bytes
from ssfusion_lightning.vocabulary import Buffer, Encoded, Plan

#: every flat scheme can be the cross-node step
CROSS_SCHEMES = SCHEMES
#: the node step of the sparse part: either one, or per buffer the one that moves fewer bytes
NODE_OPTIONS = ("auto", *NODE_STEPS)


def stripe_length(numel: int, ranks_per_node: int) -> int:
    return -(-numel // ranks_per_node)


def _node_reduce_scatter(full: Tensor, hierarchy: Hierarchy, traffic: Traffic) -> Tensor:
    """This local rank's stripe of the node's sum (``full`` holds ranks_per_node stripes)."""
    size = hierarchy.ranks_per_node
    if size == 1:
        return full
    stripe = full.new_empty(full.numel() // size)
    dist.reduce_scatter_tensor(stripe, full, group=hierarchy.local)
    nbytes = (size - 1) * stripe.numel() * stripe.element_size()
    traffic.add(nbytes, nbytes)
    return stripe


def _node_all_gather(stripe: Tensor, hierarchy: Hierarchy, traffic: Traffic) -> Tensor:
    size = hierarchy.ranks_per_node
    if size == 1:
        return stripe
    full = stripe.new_empty(stripe.numel() * size)
    dist.all_gather_into_tensor(full, stripe, group=hierarchy.local)
    nbytes = (size - 1) * stripe.numel() * stripe.element_size()
    traffic.add(nbytes, nbytes)
    return full


def _padded(tensor: Tensor, length: int) -> Tensor:
    return tensor if tensor.numel() == length else torch.cat([tensor, tensor.new_zeros(length - tensor.numel())])


def hierarchical_dense_sum(tensor: Tensor, hierarchy: Hierarchy, traffic: Traffic) -> Tensor:
    """The sum over every rank of ``tensor``: reduce-scatter in the node, all-reduce of the stripe
    across nodes, all-gather in the node."""
    numel = tensor.numel()
    padded = _padded(tensor, stripe_length(numel, hierarchy.ranks_per_node) * hierarchy.ranks_per_node)
    stripe = _node_reduce_scatter(padded, hierarchy, traffic)
    if hierarchy.nodes > 1:
        dist.all_reduce(stripe, group=hierarchy.cross)
        nbytes = ring_allreduce_bytes(stripe.numel() * stripe.element_size(), hierarchy.nodes)
        traffic.add(nbytes, nbytes)
    return _node_all_gather(stripe, hierarchy, traffic)[:numel]


def _node_sparse_sum(
    values: Tensor, indices: Tensor, length: int, hierarchy: Hierarchy, traffic: Traffic, max_count: int | None
) -> Tensor:
    """This local rank's stripe of the node's sum, from every local rank's k pairs all-gathered."""
    full = allgather_sum(values, indices, length * hierarchy.ranks_per_node, hierarchy.local, traffic, max_count=max_count)
    start = hierarchy.local_rank * length
    return full[start : start + length]


def _node_share_sparse(stripe: Tensor, hierarchy: Hierarchy, traffic: Traffic) -> Tensor:
    """Every local rank's stripe, each sent as its nonzeros: the stripes are disjoint, so their
    sum is their concatenation, exact and alike on every rank."""
    where = torch.nonzero(stripe).view(-1)
    offset = hierarchy.local_rank * stripe.numel()
    return allgather_sum(stripe[where], where + offset, stripe.numel() * hierarchy.ranks_per_node, hierarchy.local, traffic)


def _cross_step(
    stripe: Tensor, hierarchy: Hierarchy, cross: str, traffic: Traffic, k: int, state: OkTopkState | None
) -> tuple[Tensor, Tensor | None]:
    """The stripe summed over the nodes by ``cross``; (its sum, Ok-Topk's kept positions or None)."""
    if cross == "oktopk":
        # each stripe keeps its share of the k entries a flat Ok-Topk would keep
        where = torch.nonzero(stripe).view(-1)
        share = max(1, -(-k // hierarchy.ranks_per_node))
        return oktopk_reduce(stripe[where], where, stripe.numel(), share, hierarchy.cross, traffic, state or OkTopkState())
    if hierarchy.nodes == 1:
        return stripe, None
    if cross == "allreduce":
        dist.all_reduce(stripe, group=hierarchy.cross)
        nbytes = ring_allreduce_bytes(stripe.numel() * stripe.element_size(), hierarchy.nodes)
        traffic.add(nbytes, nbytes)
        return stripe, None
    where = torch.nonzero(stripe).view(-1)
    return SPARSE_SCHEMES.get(cross)(stripe[where], where, stripe.numel(), hierarchy.cross, traffic), None


def _relay(values: Tensor, indices: Tensor, numel: int, hierarchy: Hierarchy, traffic: Traffic, max_count: int | None) -> SparseSum:
    """Every rank's pairs: across nodes on this rank's cross-node group, then inside the node,
    each rank's pairs kept as a piece of its own (one piece never holds a position twice, so the
    decode adds in the same order on every rank, on any device)."""
    across = allgather_pairs(values, indices, numel, hierarchy.cross, traffic, max_count=max_count)
    if hierarchy.ranks_per_node == 1:
        return across
    return _node_gather_pieces(across, hierarchy, traffic, None if max_count is None else max_count * hierarchy.nodes)


def _node_gather_pieces(mine: SparseSum, hierarchy: Hierarchy, traffic: Traffic, max_count: int | None) -> SparseSum:
    """Every local rank's pieces, in local-rank order: one allgather whose header carries each
    piece's count, padded to ``max_count`` pairs (or to the largest total, after a count round)."""
    group, me, size = hierarchy.local, hierarchy.local_rank, hierarchy.ranks_per_node
    counts = [positions.numel() for positions, _ in mine.pieces]
    total = sum(counts)
    values = torch.cat(mine.values())
    device = values.device
    slots = max_count if max_count is not None else max(exchange_counts(total, group, device, traffic))
    index_dtype = wire_index_dtype(mine.numel)
    index_size = torch.tensor([], dtype=index_dtype).element_size()
    header = len(counts)
    # header (the pieces' counts), then positions, padded so the values start 8-byte aligned
    position_slots = -(-(slots + header) * index_size // 8) * 8 // index_size
    positions = torch.cat(
        [
            torch.tensor(counts, dtype=index_dtype, device=device),
            torch.cat([p for p, _ in mine.pieces]).to(index_dtype),
            torch.zeros(position_slots - header - total, dtype=index_dtype, device=device),
        ]
    )
    padded_values = torch.cat([values, values.new_zeros(slots - total)])
    message = torch.cat([positions.view(torch.uint8), padded_values.view(torch.uint8)])
    gathered = [torch.empty_like(message) for _ in range(size)]
    dist.all_gather(gathered, message, group=group)
    split = position_slots * index_size
    pieces, received = [], 0
    for rank, part in enumerate(gathered):
        if rank == me:
            pieces.extend(mine.pieces)
            continue
        part_positions = part[:split].view(index_dtype)
        part_values = part[split:].view(values.dtype)
        start = header
        for n in part_positions[:header].tolist():
            pieces.append((part_positions[start : start + n].to(torch.int64), part_values[start - header : start - header + n]))
            start += n
        received += start - header
    pair = index_size + values.element_size()
    padded = (size - 1) * (split + slots * values.element_size())
    traffic.add(sent=(size - 1) * total * pair, received=received * pair, padded_sent=padded, padded_received=padded)
    return SparseSum(mine.numel, mine.dtype, pieces)


def hierarchical_sparse_sum(
    values: Tensor,
    indices: Tensor,
    numel: int,
    hierarchy: Hierarchy,
    cross: str,
    traffic: Traffic,
    k: int = 0,
    state: OkTopkState | None = None,
    node: str = "dense",
    max_count: int | None = None,
) -> tuple[Tensor, Tensor | None]:
    """The sum over every rank of each rank's sparse (values, distinct indices) of a ``numel``
    tensor, with ``cross`` as the cross-node step on each node's stripe and ``node`` ("dense" or
    "sparse", see the module doc) as the node step; returns (dense sum in values' dtype, applied
    positions or None when everything sent was applied). ``k`` and ``state``: Ok-Topk's per-rank
    count and per-buffer state (``cross="oktopk"`` only). ``max_count``: a bound on every rank's
    count known to all (the sparse node step then skips its count round)."""
    if node not in NODE_STEPS:
        raise ValueError(f"hierarchical_sparse_sum: unknown node step {node!r}; valid choices: {', '.join(NODE_STEPS)}")
    if node == RELAY:
        if cross != "allgather":
            raise ValueError(f"hierarchical_sparse_sum: node step 'relay' needs cross='allgather', got cross={cross!r}")
        return _relay(values, indices, numel, hierarchy, traffic, max_count).dense(), None
    size = hierarchy.ranks_per_node
    length = stripe_length(numel, size)
    acc = accumulation_dtype(values.dtype)
    if node == "sparse":
        stripe = _node_sparse_sum(values.to(acc), indices, length, hierarchy, traffic, max_count)
        share = _node_share_sparse
    else:
        full = torch.zeros(length * size, dtype=acc, device=values.device)
        full[indices] = values.to(acc)
        stripe = _node_reduce_scatter(full, hierarchy, traffic)
        share = _node_all_gather
    stripe, kept = _cross_step(stripe, hierarchy, cross, traffic, k, state)
    applied = None
    if kept is not None:
        mask = torch.zeros(length, dtype=torch.uint8, device=values.device)
        mask[kept] = 1
        applied = torch.nonzero(share(mask, hierarchy, traffic)[:numel]).view(-1)
    return share(stripe, hierarchy, traffic)[:numel].to(values.dtype), applied


def _hierarchy(channel: Channel) -> Hierarchy:
    if channel.hierarchy is None:
        raise RuntimeError(
            "comm='hierarchical' runs on node-local and cross-node process groups, and this channel has none: "
            "SSFusionStrategy creates them (ranks_per_node=...); a ChannelSet built by hand needs hierarchies=[...]"
        )
    return channel.hierarchy


@COMMUNICATORS.register("hierarchical")
class HierarchicalCommunicator(Communicator):
    """Dense and sparse parts summed in the node, across nodes and back (see the module doc),
    on different channels so the two run concurrently. ``cross``: the cross-node step of the
    sparse part, one of allreduce, allgather, zen, sparcml, oktopk (default allgather). ``node``:
    the sparse part's node step, dense, sparse, relay (cross allgather only), or auto (default):
    per buffer, the one ``commcost.choose_node_step`` picks."""

    name = "hierarchical"
    sums_dense = True
    needs_hierarchy = True

    def __init__(self, cross: str = "allgather", node: str = "auto", **options: Any) -> None:
        super().__init__(**options)
        if cross not in CROSS_SCHEMES:
            raise ValueError(f"hierarchical communicator: unknown cross {cross!r}; valid choices: {', '.join(CROSS_SCHEMES)}")
        if node not in NODE_OPTIONS:
            raise ValueError(f"hierarchical communicator: unknown node {node!r}; valid choices: {', '.join(NODE_OPTIONS)}")
        if node == RELAY and cross != "allgather":
            raise ValueError(
                f"hierarchical communicator: node='relay' forms no sums, so it needs cross='allgather', got cross={cross!r}"
            )
        self.cross = cross
        self.node = node
        self.exact = cross != "oktopk"
        self.states = OkTopkStates()

    def launch(self, encoded: Encoded, buffer: Buffer, channels: ChannelSet) -> PendingReduction:
        dense = sparse = None
        if encoded.dense is not None:
            channel = channels[buffer.channel]
            dense = channel.submit(_dense_job, encoded.dense, _hierarchy(channel))
        if encoded.values is not None:
            channel = channels[buffer.channel + (1 if dense is not None else 0)]
            sparse = self._submit_sparse(channel, encoded, buffer)
        return PendingReduction(dense, sparse, channels.device)

    def node_step(self, buffer: Buffer, hierarchy: Hierarchy, value_bytes: int) -> str:
        """The buffer's node step: ``node``, or under "auto" the one ``choose_node_step`` picks
        from the plan's N and k and the layout, never from what a rank selected, so that every
        rank of every node issues the same collectives."""
        if self.node != "auto":
            return self.node
        k = sum(slot.k for slot in buffer.sparse_slots)
        shape = BufferShape(0, buffer.sparse_numel, k, value_bytes, index_bytes(buffer.sparse_numel))
        return choose_node_step(self.cross, shape, hierarchy.ranks_per_node, hierarchy.nodes)

    def _submit_sparse(self, channel: Channel, encoded: Encoded, buffer: Buffer) -> Future:
        key = f"{buffer.index}:{buffer.sparse_numel}"
        k = sum(slot.k for slot in buffer.sparse_slots)
        hierarchy = _hierarchy(channel)
        step = self.node_step(buffer, hierarchy, encoded.values.element_size())
        # equal counts are a bound every rank knows too
        bound = encoded.values.numel() if encoded.equal_counts else encoded.max_count
        return channel.submit(
            self._sparse_job, key, k, step, bound, encoded.values, encoded.indices, buffer.sparse_numel, hierarchy
        )

    def _sparse_job(
        self, key: str, k: int, step: str, bound: int | None,
        values: Tensor, indices: Tensor, numel: int, hierarchy: Hierarchy, group,
    ) -> tuple[Tensor, Traffic, Any]:
        traffic = Traffic()
        if step == RELAY:  # left as pairs: the engine decodes once the local gradients are released
            return _relay(values, indices, numel, hierarchy, traffic, bound), traffic, None
        state = self.states.of(key) if self.cross == "oktopk" else None
        total, applied = hierarchical_sparse_sum(
            values, indices, numel, hierarchy, self.cross, traffic, k, state, node=step, max_count=bound
        )
        return total, traffic, applied

    def set_plan(self, plan: Plan) -> None:
        self.states.keep(plan)

    def state_dict(self) -> dict[str, Any]:
        return self.states.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.states.load_state_dict(state)


def _dense_job(tensor: Tensor, hierarchy: Hierarchy, group) -> tuple[Tensor, Traffic]:
    traffic = Traffic()
    return hierarchical_dense_sum(tensor, hierarchy, traffic), traffic
