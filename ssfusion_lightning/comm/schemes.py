"""Sparse allreduce schemes: each sums every rank's sparse (values, indices) into a dense tensor.

A scheme is a blocking function ``scheme(values, indices, numel, group, traffic, equal_counts,
max_count, votes)`` returning the dense SUM (``numel`` elements, values' dtype) over the group's
ranks; it adds the bytes this rank moved to ``traffic``. ``equal_counts`` promises every rank sends
the same count (SAFusion's alignment); ``max_count``, when not None, bounds every rank's count (the
plan's k of a sparsifier that never exceeds k). Schemes that exchange counts may skip that round on
either. ``votes``, when not None, is a uint8 vector with one entry per rank of the group, this
rank's flag at its own entry (the engine's non-finite vote); the scheme overwrites it in place with
every rank's flag, as an all-reduce MAX of the ranks' vectors would, carried in a header or count
message the scheme exchanges anyway, so the flags take no round of their own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from ssfusion_lightning.comm.traffic import Traffic
from ssfusion_lightning.commcost import (
    BLOCK_ELEMENTS,
    COUNT_BYTES,
    POSITION_BYTES,
    compact_positions,
    gathered_position_bytes,
    position_blocks,
)
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
        max_count: int | None = None,
        votes: Tensor | None = None,
    ) -> Tensor: ...


SPARSE_SCHEMES: Registry[SparseScheme] = Registry("sparse allreduce scheme")
#: the schemes that can leave their sum as pairs (same arguments, a ``SparseSum``): the engine
#: decodes it into the gradients' memory once the local gradients are released
SPARSE_PAIRS: Registry["SparseSum"] = Registry("sparse pairs scheme")


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a sum of ``dtype`` values is accumulated in: fp32 for fp16 and bf16 (cast back
    once at the end), ``dtype`` itself otherwise (integers stay exact)."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


@dataclass
class SparseSum:
    """A sparse part's sum left as the pairs that make it: ``pieces`` of (int64 positions,
    values), added at their positions in order (a position may recur across pieces). The engine
    decodes it once the round's local gradients are in the error feedback and released, so the
    decoded total takes their memory instead of sitting beside them."""

    numel: int
    dtype: torch.dtype
    pieces: list[tuple[Tensor, Tensor]]

    def dense(self, storage: Tensor | None = None) -> Tensor:
        """The ``numel``-element sum in ``dtype``, accumulated in ``accumulation_dtype`` and cast
        once: the same bits on every rank, whose pieces come in the same order. ``storage``: a
        tensor of ``numel`` elements in the accumulation dtype to accumulate in (zeroed first)
        instead of a new one."""
        if storage is not None:
            total = storage.zero_()
        else:
            device = self.pieces[0][0].device if self.pieces else None
            total = torch.zeros(self.numel, dtype=accumulation_dtype(self.dtype), device=device)
        for positions, values in self.pieces:
            total.index_add_(0, positions, values.to(total.dtype))
        return total.to(self.dtype)

    def values(self) -> list[Tensor]:
        return [values for _, values in self.pieces]

    def count_nonzero(self) -> int:
        """The positions some piece adds a nonzero value to, without decoding (a sum that cancels
        to exactly zero still counts)."""
        positions = [where[values != 0] for where, values in self.pieces]
        return int(torch.unique(torch.cat(positions)).numel()) if positions else 0


def wire_index_dtype(numel: int) -> torch.dtype:
    """Positions travel as int32 when they fit (any fusion buffer does): a third fewer bytes per
    fp32 pair. Every scheme uses it, so byte comparisons between schemes are fair."""
    return torch.int32 if numel <= torch.iinfo(torch.int32).max else torch.int64


def index_bytes(numel: int) -> int:
    """Bytes per position on the wire for a tensor of ``numel`` elements (``POSITION_BYTES``
    below 2**31 elements)."""
    return POSITION_BYTES if wire_index_dtype(numel) == torch.int32 else 8


def bytes_as(chunk: Tensor, dtype: torch.dtype) -> Tensor:
    """View a uint8 slice as ``dtype``, copying first when the slice is not aligned for it."""
    if chunk.storage_offset() % torch.tensor([], dtype=dtype).element_size():
        chunk = chunk.clone()
    return chunk.view(dtype)


def pack(values: Tensor, indices: Tensor, index_dtype: torch.dtype) -> Tensor:
    """One byte tensor holding the positions (``index_dtype``) then the values, so one collective moves both."""
    return torch.cat([indices.to(index_dtype).contiguous().view(torch.uint8), values.contiguous().view(torch.uint8)])


def unpack(message: Tensor, count: int, dtype: torch.dtype, index_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Inverse of ``pack``: (values, int64 positions)."""
    split = count * torch.tensor([], dtype=index_dtype).element_size()
    indices = bytes_as(message[:split], index_dtype).to(torch.int64)
    values = bytes_as(message[split : split + count * torch.tensor([], dtype=dtype).element_size()], dtype)
    return values, indices


def exchange_counts(count: int, group: dist.ProcessGroup | None, device: torch.device, traffic: Traffic) -> list[int]:
    world = dist.get_world_size(group)
    mine = torch.tensor([count], dtype=torch.int64, device=device)
    counts = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(counts, mine, group=group)
    traffic.add((world - 1) * COUNT_BYTES, (world - 1) * COUNT_BYTES)
    return [int(c.item()) for c in counts]


@SPARSE_SCHEMES.register("allgather")
def allgather_sum(
    values: Tensor,
    indices: Tensor,
    numel: int,
    group: dist.ProcessGroup | None,
    traffic: Traffic,
    equal_counts: bool = False,
    max_count: int | None = None,
    votes: Tensor | None = None,
) -> Tensor:
    """AGsparse (``allgather_pairs``), decoded."""
    return allgather_pairs(values, indices, numel, group, traffic, equal_counts, max_count, votes).dense()


@SPARSE_PAIRS.register("allgather")
def allgather_pairs(
    values: Tensor,
    indices: Tensor,
    numel: int,
    group: dist.ProcessGroup | None,
    traffic: Traffic,
    equal_counts: bool = False,
    max_count: int | None = None,
    votes: Tensor | None = None,
    dense: Tensor | None = None,
) -> SparseSum:
    """AGsparse: allgather every rank's (count, positions, values); the sum is every rank's pairs,
    in rank order.

    Every message has the same length, so ranks first agree on the largest count, except where
    the counts are known in advance: ``equal_counts``, or ``max_count`` (a bound every rank's
    count respects, known from the plan), which saves that round at the price of padding.
    Positions travel compactly where ``commcost.compact_positions`` says so for the agreed slot
    count (above about 0.003% density): a count per block of 2**16 elements in the header, then
    each position's 16-bit offset in its block, sorted by block; else as ``wire_index_dtype``.
    ``votes`` ride in the header, after the count: every rank receives every rank's header.
    ``dense`` (the buffer's dense part, in the values' dtype) rides after the values, and is
    replaced in place by the sum of every rank's, added in rank order in ``accumulation_dtype``:
    a small dense part then costs no all-reduce of its own (``commcost.dense_rides``).
    """
    world = dist.get_world_size(group)
    me = dist.get_rank(group)
    count = values.numel()
    if max_count is not None and count > max_count:
        raise ValueError(f"allgather: {count} selected elements exceed the announced bound max_count={max_count}")
    if equal_counts:
        slots = count
    elif max_count is not None:
        slots = max_count
    else:
        slots = max(exchange_counts(count, group, values.device, traffic))
    layout = _PositionLayout(numel, slots, 1 if votes is None else 2)
    header = [torch.tensor([count], dtype=torch.int64, device=values.device)]
    if votes is not None:
        header.append(votes[me : me + 1].to(torch.int64))
    positions, sent_values = layout.encode(torch.cat(header), indices, values)
    padded_values = torch.cat([sent_values, values.new_zeros(slots - count)] + ([] if dense is None else [dense.to(values.dtype)]))
    message = torch.cat([positions, padded_values.contiguous().view(torch.uint8)])
    gathered = [torch.empty_like(message) for _ in range(world)]
    dist.all_gather(gathered, message, group=group)
    split = layout.nbytes
    if dense is not None:
        dense_bytes = dense.numel() * values.element_size()
        total = torch.zeros(dense.numel(), dtype=accumulation_dtype(dense.dtype), device=dense.device)
        for part in gathered:
            total += part[part.numel() - dense_bytes :].view(values.dtype).to(total.dtype)
        dense.copy_(total)
        gathered = [part[: part.numel() - dense_bytes] for part in gathered]
        traffic.add((world - 1) * dense_bytes, (world - 1) * dense_bytes)
    pieces = []
    received = 0
    for rank, part in enumerate(gathered):
        if rank == me:
            pieces.append((indices.to(torch.int64), values))
            continue
        n, part_positions = layout.decode(part[:split])
        received += layout.payload(n, values.element_size())
        pieces.append((part_positions, part[split:].view(values.dtype)[:n]))
    if votes is not None:
        votes.copy_(torch.stack([layout.header(part)[1] for part in gathered]))
    padded = (world - 1) * (split + slots * values.element_size())
    traffic.add(
        sent=(world - 1) * layout.payload(count, values.element_size()),
        received=received,
        padded_sent=padded,
        padded_received=padded,
    )
    return SparseSum(numel, values.dtype, pieces)


class _PositionLayout:
    """The positions region of one allgather message: the header words (the count, the vote),
    then the positions of up to ``slots`` pairs, compact or not (``commcost.compact_positions``),
    padded so the values after it start 8-byte aligned (any dtype can view them)."""

    def __init__(self, numel: int, slots: int, header_words: int) -> None:
        self.numel, self.slots, self.header_words = numel, slots, header_words
        self.index_bytes = index_bytes(numel)
        self.compact = compact_positions(numel, slots, self.index_bytes)
        if self.compact:  # header words and block counts as int32: no count exceeds a buffer's elements
            self.blocks, self.word_dtype, self.position_dtype = position_blocks(numel), torch.int32, torch.int16
        else:
            self.blocks, self.word_dtype, self.position_dtype = 0, wire_index_dtype(numel), wire_index_dtype(numel)
        self.positions_at = (header_words + self.blocks) * self.word_dtype.itemsize
        self.position_bytes = self.position_dtype.itemsize
        self.nbytes = -(-(self.positions_at + slots * self.position_bytes) // 8) * 8

    def payload(self, count: int, value_bytes: int) -> int:
        """Bytes of ``count`` pairs in this layout: values and positions, block counts included."""
        return count * value_bytes + int(gathered_position_bytes(self.numel, count, self.slots, self.index_bytes))

    def encode(self, header: Tensor, indices: Tensor, values: Tensor) -> tuple[Tensor, Tensor]:
        """(the region's bytes, the values in the order of the positions sent)."""
        positions = indices.to(torch.int64)
        if self.compact:
            if positions.numel() > 1 and not bool((positions[1:] > positions[:-1]).all()):
                positions, order = torch.sort(positions)
                values = values[order]
            edges = torch.arange(self.blocks + 1, dtype=torch.int64, device=positions.device) * BLOCK_ELEMENTS
            header = torch.cat([header, torch.diff(torch.searchsorted(positions, edges))])
            # the offset in its block, shifted into int16's range so the cast is exact on any device
            positions = (positions & (BLOCK_ELEMENTS - 1)) - BLOCK_ELEMENTS // 2
        words = header.to(self.word_dtype).view(torch.uint8)
        stored = positions.to(self.position_dtype).view(torch.uint8)
        padding = stored.new_zeros(self.nbytes - words.numel() - stored.numel())
        return torch.cat([words, stored, padding]), values

    def header(self, region: Tensor) -> Tensor:
        """The header words of a received region: its count, then its vote if any."""
        return bytes_as(region[: self.header_words * self.word_dtype.itemsize], self.word_dtype)

    def decode(self, region: Tensor) -> tuple[int, Tensor]:
        """(the count, int64 positions) of a received region."""
        n = int(self.header(region)[0])
        stored = bytes_as(region[self.positions_at : self.positions_at + n * self.position_bytes], self.position_dtype)
        if not self.compact:
            return n, stored.to(torch.int64)
        counts = bytes_as(region[: self.positions_at], self.word_dtype)[self.header_words :].to(torch.int64)
        starts = torch.arange(self.blocks, dtype=torch.int64, device=region.device) * BLOCK_ELEMENTS
        offsets = stored.to(torch.int64) + BLOCK_ELEMENTS // 2
        return n, torch.repeat_interleave(starts, counts, output_size=n) + offsets


def sparse_allreduce(
    values: Tensor,
    indices: Tensor,
    numel: int,
    scheme: str = "zen",
    group: dist.ProcessGroup | None = None,
) -> Tensor:
    """Exact dense SUM over the group's ranks of each rank's sparse (values, indices).

    ``values`` and ``indices`` are 1-D and of equal length (counts may differ across ranks);
    ``indices`` are distinct flat positions in ``[0, numel)``, int32 or int64. A collective: every
    rank of ``group`` (default: the default process group) calls it.
    """
    if not dist.is_initialized():
        # torch's own error here ("Default process group has not been initialized") names no remedy.
        raise RuntimeError(
            "sparse_allreduce is a collective over the ranks of a process group, and there is none: "
            "call torch.distributed.init_process_group(...) on every rank first"
        )
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
