"""``hierarchical``: reduce inside the node, exchange across nodes only, share back inside the node.

For ``num_nodes x ranks_per_node`` ranks (``topology.py``), one buffer part of n elements:

1. inside the node, over the fast link: every rank scatters its sparse selection into a dense
   n-element tensor (the dense part already is one) and the node reduce-scatters it, so local
   rank l holds the node's sum of stripe l (n / ranks_per_node elements);
2. across nodes, on the cross-node group of local rank l (its own NIC): the dense part's stripe
   is all-reduced, the sparse part's stripe goes through the ``cross`` scheme as the stripe's
   nonzeros: every local rank works on its own stripe at once, so every NIC carries a share;
3. inside the node: the summed stripes are all-gathered, so every rank holds the whole sum.

With an exact ``cross`` scheme (allreduce, allgather, zen, sparcml) the result is the exact sum
of every rank's part, as a flat scheme's (up to fp summation order; low-precision values are
summed in fp32 and cast once). Every node receives the same cross-node sums and shares them the
same way, so every rank ends bitwise identical. ``cross="oktopk"`` selects again: each stripe
keeps about k / ranks_per_node entries of its sum (Ok-Topk's top-k), and the positions kept are
reported as applied, so the engine's error feedback keeps, on every rank, what was not applied.

The bytes a rank moves (``Traffic``) count both links: the node-local reduce-scatter and
all-gather as well as the cross-node step.
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
from ssfusion_lightning.comm.schemes import SPARSE_SCHEMES, accumulation_dtype
from ssfusion_lightning.comm.topology import Hierarchy
from ssfusion_lightning.comm.traffic import Traffic
from ssfusion_lightning.commcost import SCHEMES, ring_allreduce_bytes
from ssfusion_lightning.vocabulary import Buffer, Encoded, Plan

#: every flat scheme can be the cross-node step
CROSS_SCHEMES = SCHEMES


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


def hierarchical_sparse_sum(
    values: Tensor,
    indices: Tensor,
    numel: int,
    hierarchy: Hierarchy,
    cross: str,
    traffic: Traffic,
    k: int = 0,
    state: OkTopkState | None = None,
) -> tuple[Tensor, Tensor | None]:
    """The sum over every rank of each rank's sparse (values, distinct indices) of a ``numel``
    tensor, with ``cross`` as the cross-node step on each node's stripe; returns (dense sum in
    values' dtype, applied positions or None when everything sent was applied). ``k`` and
    ``state``: Ok-Topk's per-rank count and per-buffer state (``cross="oktopk"`` only)."""
    size = hierarchy.ranks_per_node
    length = stripe_length(numel, size)
    acc = accumulation_dtype(values.dtype)
    full = torch.zeros(length * size, dtype=acc, device=values.device)
    full[indices] = values.to(acc)
    stripe = _node_reduce_scatter(full, hierarchy, traffic)
    applied = None
    if hierarchy.nodes > 1 and cross == "allreduce":
        dist.all_reduce(stripe, group=hierarchy.cross)
        nbytes = ring_allreduce_bytes(stripe.numel() * stripe.element_size(), hierarchy.nodes)
        traffic.add(nbytes, nbytes)
    elif cross == "oktopk":
        # each stripe keeps its share of the k entries a flat Ok-Topk would keep
        where = torch.nonzero(stripe).view(-1)
        share = max(1, -(-k // size))
        stripe, kept = oktopk_reduce(stripe[where], where, length, share, hierarchy.cross, traffic, state or OkTopkState())
        mask = torch.zeros(length, dtype=torch.uint8, device=values.device)
        mask[kept] = 1
        applied = torch.nonzero(_node_all_gather(mask, hierarchy, traffic)[:numel]).view(-1)
    elif hierarchy.nodes > 1:
        where = torch.nonzero(stripe).view(-1)
        stripe = SPARSE_SCHEMES.get(cross)(stripe[where], where, length, hierarchy.cross, traffic)
    total = _node_all_gather(stripe.to(acc), hierarchy, traffic)[:numel]
    return total.to(values.dtype), applied


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
    sparse part, one of allreduce, allgather, zen, sparcml, oktopk (default allgather)."""

    name = "hierarchical"
    sums_dense = True
    needs_hierarchy = True

    def __init__(self, cross: str = "allgather", **options: Any) -> None:
        super().__init__(**options)
        if cross not in CROSS_SCHEMES:
            raise ValueError(f"hierarchical communicator: unknown cross {cross!r}; valid choices: {', '.join(CROSS_SCHEMES)}")
        self.cross = cross
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

    def _submit_sparse(self, channel: Channel, encoded: Encoded, buffer: Buffer) -> Future:
        key = f"{buffer.index}:{buffer.sparse_numel}"
        k = sum(slot.k for slot in buffer.sparse_slots)
        return channel.submit(self._sparse_job, key, k, encoded.values, encoded.indices, buffer.sparse_numel, _hierarchy(channel))

    def _sparse_job(self, key: str, k: int, values: Tensor, indices: Tensor, numel: int, hierarchy: Hierarchy, group) -> tuple[Tensor, Traffic, Any]:
        traffic = Traffic()
        state = self.states.of(key) if self.cross == "oktopk" else None
        total, applied = hierarchical_sparse_sum(values, indices, numel, hierarchy, self.cross, traffic, k, state)
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
