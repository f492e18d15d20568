"""Node-local and cross-node process groups for hierarchical communication.

Ranks are numbered node-major, as Lightning numbers them: global rank = node * ranks_per_node +
local rank. Each node's ranks form a node-local group (the fast intra-node link); the ranks with
the same local rank, one per node, form a cross-node group, so the cross-node traffic of local
rank l leaves through its own NIC.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist


@dataclass(frozen=True)
class Hierarchy:
    """This rank's two groups and its place in the layout."""

    local: dist.ProcessGroup | None
    cross: dist.ProcessGroup | None
    local_rank: int
    ranks_per_node: int
    nodes: int


def node_layout(world_size: int, ranks_per_node: int) -> tuple[list[list[int]], list[list[int]]]:
    """The global ranks of every node-local group, then of every cross-node group."""
    if isinstance(ranks_per_node, bool) or not isinstance(ranks_per_node, int) or ranks_per_node < 1:
        raise ValueError(f"ranks_per_node must be an integer >= 1, got {ranks_per_node!r}")
    if world_size % ranks_per_node:
        raise ValueError(
            f"ranks_per_node={ranks_per_node} does not divide the world size {world_size}: every node must hold "
            f"the same number of ranks (valid choices here: {', '.join(str(d) for d in range(1, world_size + 1) if world_size % d == 0)})"
        )
    nodes = world_size // ranks_per_node
    local = [list(range(node * ranks_per_node, (node + 1) * ranks_per_node)) for node in range(nodes)]
    cross = [list(range(local_rank, world_size, ranks_per_node)) for local_rank in range(ranks_per_node)]
    return local, cross


def create_hierarchy(rank: int, world_size: int, ranks_per_node: int, backend: str | None, timeout: timedelta | None) -> Hierarchy:
    """Create every node-local and every cross-node group, on every rank in the same order
    (``new_group`` is collective over the default group), and keep this rank's two."""
    local_groups, cross_groups = node_layout(world_size, ranks_per_node)
    local = cross = None
    for ranks in local_groups:
        group = dist.new_group(ranks, backend=backend, timeout=timeout)
        if rank in ranks:
            local = group
    for ranks in cross_groups:
        group = dist.new_group(ranks, backend=backend, timeout=timeout)
        if rank in ranks:
            cross = group
    return Hierarchy(local, cross, rank % ranks_per_node, ranks_per_node, world_size // ranks_per_node)
