"""SparCML (ZEN's "hierarchical centralization"): recursive doubling over sparse sets.

Scheme ``sparcml`` (ALGORITHMS.md section 7): in each of log2 P rounds a rank swaps its current
sparse set with the partner whose rank differs in one bit, and both keep the union with summed
values, so after the last round every rank holds the whole sum. Works for ANY world size: with
P = 2^q + r, the first 2r ranks pair up, each odd one folds its set into its even neighbour and
sits out; the 2^q remaining ranks run the doubling; at the end every folded rank gets the result
back from its neighbour.

Every set travels as an 8-byte header (2 * count + summed flag), then ``count`` positions
(int32 when the tensor has fewer than 2^31 elements) and values: two messages, since the receiver
sizes the second from the header. Where every rank's count is bounded (``max_count``), a rank's
own selection (the fold, the first doubling round) travels in one message instead, the header in
front and the set padded to the bound: at P = 2^q the first round then takes one message. Votes
(see schemes.py), when carried, follow the header word, one byte per rank: each rank sends the
flags it knows so far and keeps the maximum of what it receives, so after the doubling every
rank knows every rank's flag (a folded rank from its neighbour's send-back). Raw (not yet summed)
values travel in their own dtype; partial sums of low-precision values travel in fp32 and are
cast once at the end. Both partners merge the same two sets in the same order (lower rank
first), so all ranks end bitwise identical.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from ssfusion_lightning.comm.base import COMMUNICATORS
from ssfusion_lightning.comm.collectives import SchemeCommunicator
from ssfusion_lightning.comm.schemes import (
    COUNT_BYTES,
    SPARSE_PAIRS,
    SPARSE_SCHEMES,
    SparseSum,
    accumulation_dtype,
    bytes_as,
    pack,
    unpack,
    wire_index_dtype,
)
from ssfusion_lightning.comm.traffic import Traffic


def _peer(group: dist.ProcessGroup | None, rank: int) -> int:
    return dist.get_global_rank(group, rank) if group is not None else rank


def _merge(lo: tuple[Tensor, Tensor], hi: tuple[Tensor, Tensor], acc: torch.dtype) -> tuple[Tensor, Tensor]:
    """Union of two coalesced sparse sets with summed values (in ``acc``), sorted by index."""
    idx = torch.cat([lo[0], hi[0]])
    unique, inverse = torch.unique(idx, sorted=True, return_inverse=True)
    out = torch.zeros(unique.numel(), dtype=acc, device=idx.device)
    out.index_add_(0, inverse, torch.cat([lo[1].to(acc), hi[1].to(acc)]))
    return unique, out


def _coalesce(indices: Tensor, values: Tensor, acc: torch.dtype) -> tuple[Tensor, Tensor, bool]:
    """Sorted, duplicate-free (indices, values); ``summed`` tells whether any value was summed."""
    unique, inverse = torch.unique(indices, sorted=True, return_inverse=True)
    if unique.numel() == indices.numel():
        order = torch.empty_like(inverse)
        order[inverse] = torch.arange(inverse.numel(), device=inverse.device)
        return unique, values[order], False
    out = torch.zeros(unique.numel(), dtype=acc, device=values.device)
    out.index_add_(0, inverse, values.to(acc))
    return unique, out, True


def _send_recv(
    partner: int,
    send: tuple[Tensor, Tensor, bool] | None,
    receive: bool,
    dtype: torch.dtype,
    acc: torch.dtype,
    index_dtype: torch.dtype,
    group: dist.ProcessGroup | None,
    traffic: Traffic,
    device: torch.device,
    votes: Tensor | None = None,
    bound_out: int | None = None,
    bound_in: int | None = None,
) -> tuple[Tensor, Tensor, bool] | None:
    """Send ``(indices, values, summed)`` to ``partner`` and/or receive its set, concurrently;
    ``votes`` travel in the header and the received ones are merged into it.

    ``bound_out`` / ``bound_in``: the most pairs the sent / received set can hold, where both
    partners know it (a rank's own selection under ``max_count``). Such a set travels in one
    message, its header in front and padded to the bound, instead of a header message first."""
    peer = _peer(group, partner)
    header_bytes = COUNT_BYTES + (0 if votes is None else votes.numel())
    position_bytes = torch.tensor([], dtype=index_dtype).element_size()
    bounded_pair = position_bytes + torch.tensor([], dtype=dtype).element_size()
    sent_bytes = received_bytes = padded_sent = padded_received = 0
    # 1. headers, and the sets that travel with theirs
    works, header_in = [], None
    if send is not None:
        idx, val, summed = send
        header_out = torch.tensor([2 * idx.numel() + int(summed)], dtype=torch.int64, device=device).view(torch.uint8)
        if votes is not None:
            header_out = torch.cat([header_out, votes])
        sent_bytes = header_bytes + idx.numel() * (position_bytes + val.element_size())
        if bound_out is None:
            works.append(dist.isend(header_out, peer, group=group))
            padded_sent = sent_bytes
        else:  # a raw selection (never summed): values in their own dtype
            gap = bound_out - idx.numel()
            message = torch.cat([
                header_out,
                torch.cat([idx.to(index_dtype), idx.new_zeros(gap, dtype=index_dtype)]).view(torch.uint8),
                torch.cat([val, val.new_zeros(gap)]).view(torch.uint8),
            ])  # fmt: skip
            works.append(dist.isend(message, peer, group=group))
            padded_sent = message.numel()
    if receive and bound_in is None:
        header_in = torch.empty(header_bytes, dtype=torch.uint8, device=device)
        works.append(dist.irecv(header_in, peer, group=group))
    elif receive:
        message_in = torch.empty(header_bytes + bound_in * bounded_pair, dtype=torch.uint8, device=device)
        works.append(dist.irecv(message_in, peer, group=group))
        header_in = message_in  # the header, then the set
    for work in works:
        work.wait()
    # 2. the sets whose size a header announced
    works, inbox, got = [], None, None
    if send is not None and bound_out is None and idx.numel():
        works.append(dist.isend(pack(val, idx, index_dtype), peer, group=group))
    if receive:
        if votes is not None:
            torch.maximum(votes, header_in[COUNT_BYTES:header_bytes], out=votes)
        word = int(header_in[:COUNT_BYTES].view(torch.int64).item())
        count, summed = word // 2, bool(word % 2)
        wire = acc if summed else dtype
        pair = position_bytes + torch.tensor([], dtype=wire).element_size()
        received_bytes = header_bytes + count * pair
        if bound_in is None:
            padded_received = received_bytes
            inbox = torch.empty(count * pair, dtype=torch.uint8, device=device)
            if count:
                works.append(dist.irecv(inbox, peer, group=group))
        else:
            padded_received = header_in.numel()
        got = (count, summed, wire)
    for work in works:
        work.wait()
    traffic.add(sent_bytes, received_bytes, padded_sent, padded_received)
    if got is None:
        return None
    count, summed, wire = got
    if bound_in is None:
        values, indices = unpack(inbox, count, wire, index_dtype)
    else:
        body = header_in[header_bytes:]
        split = bound_in * position_bytes
        indices = bytes_as(body[:split], index_dtype)[:count].to(torch.int64)
        values = bytes_as(body[split:], wire)[:count]
    return indices, values, summed


@SPARSE_SCHEMES.register("sparcml")
def sparcml_sum(
    values: Tensor,
    indices: Tensor,
    numel: int,
    group: dist.ProcessGroup | None,
    traffic: Traffic,
    equal_counts: bool = False,
    max_count: int | None = None,
    votes: Tensor | None = None,
) -> Tensor:
    """SparCML (``sparcml_pairs``), decoded."""
    return sparcml_pairs(values, indices, numel, group, traffic, equal_counts, max_count, votes).dense()


@SPARSE_PAIRS.register("sparcml")
def sparcml_pairs(
    values: Tensor,
    indices: Tensor,
    numel: int,
    group: dist.ProcessGroup | None,
    traffic: Traffic,
    equal_counts: bool = False,
    max_count: int | None = None,
    votes: Tensor | None = None,
) -> SparseSum:
    """Recursive-doubling sparse allreduce; returns the sum as its distinct positions and their
    values (values' dtype). Counts travel
    in each message's header. With ``max_count``, a rank's own selection (the fold, the first
    doubling round) travels with its header in one message padded to the bound, so only the sets
    merged since need a header message first; the indices must then be distinct."""
    me, world = dist.get_rank(group), dist.get_world_size(group)
    dtype, acc, device = values.dtype, accumulation_dtype(values.dtype), values.device
    wire = wire_index_dtype(numel)
    idx, val, summed = _coalesce(indices.to(torch.int64), values, acc)
    if max_count is not None and (summed or idx.numel() > max_count):
        raise ValueError(
            f"sparcml: with max_count={max_count}, {values.numel()} selected elements must be at most "
            "that many and at distinct positions"
        )
    core = 1 << (world.bit_length() - 1)
    extra = world - core

    def exchange(partner: int, send, receive: bool, bound_out: int | None = None, bound_in: int | None = None):
        return _send_recv(partner, send, receive, dtype, acc, wire, group, traffic, device, votes, bound_out, bound_in)

    # fold: among the first 2*extra ranks, odd ranks hand their set to their even neighbour
    if me < 2 * extra and me % 2 == 1:
        exchange(me - 1, (idx, val, summed), False, bound_out=max_count)
        idx, val, _ = exchange(me - 1, None, True)
    else:
        fresh = True  # this rank's set is still its own selection
        if me < 2 * extra:
            other = exchange(me + 1, None, True, bound_in=max_count)
            idx, val = _merge((idx, val), other[:2], acc)
            summed, fresh = True, False
        my_core = me // 2 if me < 2 * extra else me - extra
        mask = 1
        while mask < core:
            partner_core = my_core ^ mask
            partner = 2 * partner_core if partner_core < extra else partner_core + extra
            partner_fresh = mask == 1 and partner >= 2 * extra  # it folded nothing in
            other = exchange(
                partner,
                (idx, val, summed),
                True,
                bound_out=max_count if fresh else None,
                bound_in=max_count if partner_fresh else None,
            )
            mine = (idx, val)
            idx, val = _merge(mine, other[:2], acc) if me < partner else _merge(other[:2], mine, acc)
            summed, fresh = True, False
            mask <<= 1
        val = val.to(dtype)  # the one cast
        if me < 2 * extra:
            exchange(me + 1, (idx, val, False), False)
    return SparseSum(numel, dtype, [(idx, val.to(dtype))])


def sparcml_expected_bytes(
    rank_indices: list[Tensor], value_bytes: int, acc_bytes: int | None = None, position_bytes: int = 4
) -> list[tuple[int, int]]:
    """Exact (sent, received) bytes of ``sparcml_sum`` per rank from the ranks' index sets.

    Section 7's "sum over rounds of the union sizes * (v+x)" made exact: every message carries an
    8-byte header and the sender's current set; raw sets travel at ``value_bytes`` per value,
    partial sums at ``acc_bytes`` (fp32 for low-precision values); the fold's send-back carries
    the final set at ``value_bytes``.
    """
    acc_bytes = value_bytes if acc_bytes is None else acc_bytes
    world = len(rank_indices)
    sets = [torch.unique(i.to(torch.int64)) for i in rank_indices]
    summed = [s.numel() != i.numel() for s, i in zip(sets, rank_indices)]
    sent, received = [0] * world, [0] * world

    def message(src: int, dst: int, count: int, vbytes: int) -> None:
        nbytes = COUNT_BYTES + count * (position_bytes + vbytes)
        sent[src] += nbytes
        received[dst] += nbytes

    core = 1 << (world.bit_length() - 1)
    extra = world - core
    for odd in range(1, 2 * extra, 2):
        message(odd, odd - 1, sets[odd].numel(), acc_bytes if summed[odd] else value_bytes)
        sets[odd - 1] = torch.unique(torch.cat([sets[odd - 1], sets[odd]]))
        summed[odd - 1] = True
    members = [2 * c if c < extra else c + extra for c in range(core)]
    mask = 1
    while mask < core:
        new = {}
        for c, rank in enumerate(members):
            partner = members[c ^ mask]
            message(rank, partner, sets[rank].numel(), acc_bytes if summed[rank] else value_bytes)
            new[rank] = torch.unique(torch.cat([sets[rank], sets[partner]]))
        for rank, s in new.items():
            sets[rank] = s
            summed[rank] = True
        mask <<= 1
    for odd in range(1, 2 * extra, 2):
        message(odd - 1, odd, sets[odd - 1].numel(), value_bytes)
    return list(zip(sent, received))


@COMMUNICATORS.register("sparcml")
class SparcmlCommunicator(SchemeCommunicator):
    """Dense part: ring allreduce; sparse part: SparCML recursive doubling."""

    name = "sparcml"
    scheme = "sparcml"
    split = True
