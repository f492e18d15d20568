"""Sparse allreduce schemes: each sums every rank's sparse (values, indices) into a dense tensor.

A scheme is a blocking function ``scheme(values, indices, numel, group, traffic, equal_counts)``
returning the dense SUM (``numel`` elements, values' dtype) over the group's ranks; it adds the
bytes this rank moved to ``traffic``. ``equal_counts`` promises every rank sends the same count
(SAFusion's alignment), so schemes may skip the count exchange.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from ssfusion_lightning.comm.traffic import Traffic
from ssfusion_lightning.registry import Registry


class SparseScheme(Protocol):
    def __call__(
        self,
        values: Tensor,
        indices: Tensor,
        numel: int,
        group: dist.ProcessGroup | None,
        traffic: Traffic,
        equal_counts: bool = False,
    ) -> Tensor: ...


SPARSE_SCHEMES: Registry[SparseScheme] = Registry("sparse allreduce scheme")

INDEX_BYTES = 8


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """Sums of low-precision values are accumulated in fp32, then cast back once."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def pack(values: Tensor, indices: Tensor) -> Tensor:
    """One byte tensor holding indices (int64) then values, so one collective moves both."""
    return torch.cat([indices.to(torch.int64).contiguous().view(torch.uint8), values.contiguous().view(torch.uint8)])


def unpack(message: Tensor, count: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    split = count * INDEX_BYTES
    indices = message[:split].view(torch.int64)
    values = message[split : split + count * torch.tensor([], dtype=dtype).element_size()].view(dtype)
    return values, indices


def exchange_counts(count: int, group: dist.ProcessGroup | None, device: torch.device, traffic: Traffic) -> list[int]:
    world = dist.get_world_size(group)
    mine = torch.tensor([count], dtype=torch.int64, device=device)
    counts = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(counts, mine, group=group)
    traffic.add((world - 1) * INDEX_BYTES, (world - 1) * INDEX_BYTES)
    return [int(c.item()) for c in counts]


@SPARSE_SCHEMES.register("allgather")
def allgather_sum(
    values: Tensor,
    indices: Tensor,
    numel: int,
    group: dist.ProcessGroup | None,
    traffic: Traffic,
    equal_counts: bool = False,
) -> Tensor:
    """AGsparse: allgather every rank's (indices, values), padded to the largest count, then scatter-add."""
    world = dist.get_world_size(group)
    me = dist.get_rank(group)
    count = values.numel()
    counts = [count] * world if equal_counts else exchange_counts(count, group, values.device, traffic)
    largest = max(counts)
    pair_bytes = INDEX_BYTES + values.element_size()
    message = pack(values, indices)
    if count < largest:
        message = torch.cat([message, message.new_zeros((largest - count) * pair_bytes)])
    gathered = [torch.empty_like(message) for _ in range(world)]
    dist.all_gather(gathered, message, group=group)
    others = sum(counts) - count
    traffic.add(
        sent=(world - 1) * count * pair_bytes,
        received=others * pair_bytes,
        padded_sent=(world - 1) * largest * pair_bytes,
        padded_received=(world - 1) * largest * pair_bytes,
    )
    total = torch.zeros(numel, dtype=accumulation_dtype(values.dtype), device=values.device)
    for rank, (part, n) in enumerate(zip(gathered, counts)):
        part_values, part_indices = (values, indices.to(torch.int64)) if rank == me else unpack(part, n, values.dtype)
        total.index_add_(0, part_indices, part_values.to(total.dtype))
    return total.to(values.dtype)


def sparse_allreduce(
    values: Tensor,
    indices: Tensor,
    numel: int,
    scheme: str = "zen",
    group: dist.ProcessGroup | None = None,
) -> Tensor:
    """Exact dense SUM over the group's ranks of each rank's sparse (values, indices).

    ``values`` and ``indices`` are 1-D and of equal length (counts may differ across ranks);
    ``indices`` are distinct flat positions in ``[0, numel)``, int32 or int64.
    """
    if values.dim() != 1 or indices.dim() != 1 or values.numel() != indices.numel():
        raise ValueError(
            f"values and indices must be 1-D of equal length, got shapes {tuple(values.shape)} and {tuple(indices.shape)}"
        )
    if indices.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"indices must be int32 or int64, got {indices.dtype}")
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel}")
    fn = SPARSE_SCHEMES.get(scheme)
    return fn(values, indices.to(torch.int64), numel, group, Traffic())
