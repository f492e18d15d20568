"""SparCML (ZEN's "hierarchical centralization"): recursive doubling over sparse sets.

Scheme ``sparcml`` (ALGORITHMS.md section 7): in each of log2 P rounds a rank swaps its current
sparse set with the partner whose rank differs in one bit, and both keep the union with summed
values, so after the last round every rank holds the whole sum. Works for ANY world size: with
P = 2^q + r, the first 2r ranks pair up, each odd one folds its set into its even neighbour and
sits out; the 2^q remaining ranks run the doubling; at the end every folded rank gets the result
back from its neighbour.

Every message is an 8-byte header (2 * count + summed flag) then ``count`` positions (int32
when the tensor has fewer than 2^31 elements) and values. Raw (not yet summed) values travel in their own dtype; partial sums of low-precision
values travel in fp32 and are cast once at the end. Both partners merge the same two sets in the
same order (lower rank first), so all ranks end bitwise identical.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from ssfusion_lightning.comm.base import COMMUNICATORS
from ssfusion_lightning.comm.collectives import SchemeCommunicator
from ssfusion_lightning.comm.schemes import (
    COUNT_BYTES,
    SPARSE_SCHEMES,
    accumulation_dtype,
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
) -> tuple[Tensor, Tensor, bool] | None:
    """Send ``(indices, values, summed)`` to ``partner`` and/or receive its set, concurrently."""
    peer = _peer(group, partner)
    works, header_in = [], None
    if send is not None:
        header_out = torch.tensor([2 * send[0].numel() + int(send[2])], dtype=torch.int64, device=device)
        works.append(dist.isend(header_out, peer, group=group))
    if receive:
        header_in = torch.empty(1, dtype=torch.int64, device=device)
        works.append(dist.irecv(header_in, peer, group=group))
    for work in works:
        work.wait()
    sent_bytes = received_bytes = 0
    works, inbox, got = [], None, None
    if send is not None:
        position_bytes = torch.tensor([], dtype=index_dtype).element_size()
        sent_bytes = COUNT_BYTES + send[0].numel() * (position_bytes + send[1].element_size())
        if send[0].numel():
            works.append(dist.isend(pack(send[1], send[0], index_dtype), peer, group=group))
    if receive:
        word = int(header_in.item())
        count, summed = word // 2, bool(word % 2)
        wire = acc if summed else dtype
        size = count * (torch.tensor([], dtype=index_dtype).element_size() + torch.tensor([], dtype=wire).element_size())
        received_bytes = COUNT_BYTES + size
        inbox = torch.empty(size, dtype=torch.uint8, device=device)
        if size:
            works.append(dist.irecv(inbox, peer, group=group))
        got = (count, summed, wire)
    for work in works:
        work.wait()
    traffic.add(sent_bytes, received_bytes)
    if got is None:
        return None
    count, summed, wire = got
    values, indices = unpack(inbox, count, wire, index_dtype)
    return indices, values, summed


def sparcml_sum(
    values: Tensor,
    indices: Tensor,
    numel: int,
    group: dist.ProcessGroup | None,
    traffic: Traffic,
    equal_counts: bool = False,
    max_count: int | None = None,
) -> Tensor:
    """Recursive-doubling sparse allreduce; returns the dense sum in values' dtype. Counts travel
    in each message's header, so neither ``equal_counts`` nor ``max_count`` saves a round."""
    me, world = dist.get_rank(group), dist.get_world_size(group)
    dtype, acc, device = values.dtype, accumulation_dtype(values.dtype), values.device
    wire = wire_index_dtype(numel)
    idx, val, summed = _coalesce(indices.to(torch.int64), values, acc)
    core = 1 << (world.bit_length() - 1)
    extra = world - core
    # fold: among the first 2*extra ranks, odd ranks hand their set to their even neighbour
    if me < 2 * extra and me % 2 == 1:
        _send_recv(me - 1, (idx, val, summed), False, dtype, acc, wire, group, traffic, device)
        idx, val, _ = _send_recv(me - 1, None, True, dtype, acc, wire, group, traffic, device)
    else:
        if me < 2 * extra:
            other = _send_recv(me + 1, None, True, dtype, acc, wire, group, traffic, device)
            idx, val = _merge((idx, val), other[:2], acc)
            summed = True
        my_core = me // 2 if me < 2 * extra else me - extra
        mask = 1
        while mask < core:
            partner_core = my_core ^ mask
            partner = 2 * partner_core if partner_core < extra else partner_core + extra
            other = _send_recv(partner, (idx, val, summed), True, dtype, acc, wire, group, traffic, device)
            mine = (idx, val)
            idx, val = _merge(mine, other[:2], acc) if me < partner else _merge(other[:2], mine, acc)
            summed = True
            mask <<= 1
        val = val.to(dtype)  # the one cast
        if me < 2 * extra:
            _send_recv(me + 1, (idx, val, False), False, dtype, acc, wire, group, traffic, device)
    total = torch.zeros(numel, dtype=dtype, device=values.device)
    total[idx] = val.to(dtype)
    return total


SPARSE_SCHEMES.register("sparcml")(sparcml_sum)


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
