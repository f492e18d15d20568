"""ZEN balanced parallelism: hash-partitioned sparse allreduce, and ZEN's choice against SparCML.

Scheme ``zen`` (ALGORITHMS.md section 7):

1. push: every index goes to the owner rank of a seeded integer hash h0 that is the same on every
   rank, hashed per block of ``ZEN_BLOCK`` consecutive indices (``h0(index // ZEN_BLOCK)``); an
   all_to_all of per-owner counts, then an all_to_all of the (index, value) pairs with uneven
   splits (gloo supports that for all_to_all_single).
2. the owner sums what it received into a partition-local buffer of ``|I_i|`` elements, where
   ``I_i`` is the fixed, sorted set of global indices that hash to rank ``i`` (precomputed once per
   ``(numel, P, seed)`` and cached as its sorted block ids); a global index maps to its local slot
   by binary search of its block.
3. pull: each owner sends its aggregated partition to every other rank either as a hash bitmap
   (one bit per element of ``I_i`` plus the nonzero values in ``I_i`` order) or as COO
   (position + value per nonzero), whichever is smaller. The nonzero counts are all-gathered
   first (equal-sized), so every receiver knows each owner's message size and format.

Only the owner sums a position, and everybody receives the owner's (already cast) values, so
every rank ends with bitwise-identical outputs.

Why blocks: a partition kept as one index per element was the largest state ZEN kept, as large as
the gradient itself (int32 per fp32 element). Per block of 16 it is 1/16 of that, and a block of 16
consecutive elements still spreads a selected row of any real layer over many owners (the load
balance test holds at 1.1x).
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ssfusion_lightning.comm import sparcml as _sparcml  # noqa: F401  (registers the sparcml scheme)
from ssfusion_lightning.comm.base import COMMUNICATORS
from ssfusion_lightning.comm.channels import Channel
from ssfusion_lightning.comm.collectives import SchemeCommunicator
from ssfusion_lightning.comm.schemes import (
    COUNT_BYTES,
    SPARSE_PAIRS,
    SPARSE_SCHEMES,
    SparseSum,
    accumulation_dtype,
    bytes_as,
    index_bytes,
    wire_index_dtype,
)
from ssfusion_lightning.comm.traffic import Traffic
from ssfusion_lightning.commcost import BufferShape, Links, sparcml_seconds, zen_seconds
from ssfusion_lightning.costmodel import Link, measure_link
from ssfusion_lightning.vocabulary import Buffer, Encoded, Plan

#: the hash seed every rank uses unless a communicator agrees on another one
DEFAULT_SEED = 0x5EED2E4

_M32 = 0xFFFFFFFF
_HASH_CHUNK = 1 << 22  # blocks hashed at a time when building partitions (bounds temporary memory)
#: consecutive indices that share an owner (a power of two)
ZEN_BLOCK = 16
_BLOCK_SHIFT = ZEN_BLOCK.bit_length() - 1


# --------------------------------------------------------------------------- hashing
def _mix32(h: Tensor) -> Tensor:
    """In place: a 32-bit xorshift-multiply finalizer on int64 holding values in [0, 2^32).

    Both multipliers are odd and below 2^31, so every product stays below 2^63: no int64
    overflow, hence the same bits on every rank and device.
    """
    h ^= h >> 16
    h *= 0x7FEB352D
    h &= _M32
    h ^= h >> 15
    h *= 0x5BD1E995
    h &= _M32
    h ^= h >> 16
    return h


def zen_hash(indices: Tensor, seed: int = DEFAULT_SEED) -> Tensor:
    """h0: a seeded 32-bit integer hash of non-negative int64 indices (values in [0, 2^32))."""
    x = indices.to(torch.int64)
    s = seed & _M32
    h = _mix32((x & _M32) ^ s)
    high = x >> 32
    if bool((high != 0).any()):
        h ^= _mix32((high & _M32) ^ ((s * 0x9E3779B1) & _M32))
        h = _mix32(h)
    return h


def block_owner(blocks: Tensor, world: int, seed: int = DEFAULT_SEED) -> Tensor:
    """The owner rank (int64) of every block id: floor(h0 * P / 2^32) (uniform, no division)."""
    h = zen_hash(blocks, seed)
    h *= world
    return h >> 32


def zen_owner(indices: Tensor, world: int, seed: int = DEFAULT_SEED) -> Tensor:
    """The owner rank (int64) of every index: its block's owner."""
    return block_owner(indices.to(torch.int64) >> _BLOCK_SHIFT, world, seed)


class ZenPartition:
    """The fixed index sets I_0 .. I_{P-1} (sorted global indices that hash to each rank), kept as
    the sorted ids of the blocks each rank owns: every block is whole but the last one."""

    def __init__(self, numel: int, world: int, seed: int, device: torch.device) -> None:
        self.numel, self.world, self.seed = numel, world, seed
        count = -(-numel // ZEN_BLOCK)
        self.dtype = torch.int32 if count <= 2**31 - 1 else torch.int64
        pieces: list[list[Tensor]] = [[] for _ in range(world)]
        for start in range(0, count, _HASH_CHUNK):
            chunk = torch.arange(start, min(count, start + _HASH_CHUNK), dtype=torch.int64, device=device)
            owner = block_owner(chunk, world, seed)
            if world <= 32:
                for j in range(world):
                    pieces[j].append(chunk[owner == j].to(self.dtype))
            else:
                order = torch.argsort(owner, stable=True)
                counts = torch.bincount(owner, minlength=world).tolist()
                for j, part in enumerate(torch.split(chunk[order], counts)):
                    pieces[j].append(part.to(self.dtype))
        empty = torch.empty(0, dtype=self.dtype, device=device)
        self.blocks = [torch.cat(p) if p else empty for p in pieces]
        short = count * ZEN_BLOCK - numel  # the last block's missing tail
        self.sizes = [
            int(b.numel()) * ZEN_BLOCK - (short if b.numel() and int(b[-1]) == count - 1 else 0) for b in self.blocks
        ]

    def local_slots(self, rank: int, indices: Tensor) -> Tensor:
        """Positions in I_rank of global indices that hash to ``rank``."""
        indices = indices.to(torch.int64)
        block = torch.searchsorted(self.blocks[rank], (indices >> _BLOCK_SHIFT).to(self.dtype))
        return block * ZEN_BLOCK + (indices & (ZEN_BLOCK - 1))

    def global_indices(self, rank: int, slots: Tensor) -> Tensor:
        """The global indices (int64) at positions ``slots`` of I_rank."""
        slots = slots.to(torch.int64)
        return self.blocks[rank][slots >> _BLOCK_SHIFT].to(torch.int64) * ZEN_BLOCK + (slots & (ZEN_BLOCK - 1))

    def index_set(self, rank: int) -> Tensor:
        """I_rank itself (int64), built on demand."""
        return self.global_indices(rank, torch.arange(self.sizes[rank], device=self.blocks[rank].device))


_BIT_SHIFTS = torch.arange(8, dtype=torch.int64)

_PARTITIONS: dict[tuple[int, int, int, str], ZenPartition] = {}
_PARTITIONS_LOCK = threading.Lock()
_MAX_CACHED_ELEMENTS = 1 << 28


def zen_partition(numel: int, world: int, seed: int = DEFAULT_SEED, device: torch.device | str = "cpu") -> ZenPartition:
    """The cached partition for ``(numel, world, seed)`` on ``device`` (built once, thread-safe)."""
    device = torch.device(device)
    key = (numel, world, seed, str(device))
    with _PARTITIONS_LOCK:
        cached = _PARTITIONS.get(key)
        if cached is None:
            cached = ZenPartition(numel, world, seed, device)
            total = sum(p.numel for p in _PARTITIONS.values())
            while _PARTITIONS and total + numel > _MAX_CACHED_ELEMENTS:  # evict the oldest
                oldest = next(iter(_PARTITIONS))
                total -= _PARTITIONS.pop(oldest).numel
            _PARTITIONS[key] = cached
        return cached


def release_partitions_except(numels: set[int]) -> None:
    """Drop the cached partitions of every buffer size not in ``numels``."""
    with _PARTITIONS_LOCK:
        for key in [key for key in _PARTITIONS if key[0] not in numels]:
            del _PARTITIONS[key]


# --------------------------------------------------------------------------- bitmap codec
def bitmap_of(positions: Tensor, n: int) -> Tensor:
    """uint8 bitmap of ``n`` bits with the bits at ``positions`` (distinct) set, least significant
    bit first. O(len(positions)): no n-sized mask is built, only the n/8-byte bitmap."""
    bitmap = torch.zeros((n + 7) // 8, dtype=torch.uint8, device=positions.device)
    positions = positions.to(torch.int64)
    # distinct bits of one byte: their sum is their OR
    return bitmap.index_add_(0, positions >> 3, (1 << (positions & 7)).to(torch.uint8))


def bit_positions(bitmap: Tensor) -> Tensor:
    """The positions (int64, ascending) of the set bits of a ``bitmap_of`` bitmap. Only its
    nonzero bytes are expanded, so the cost follows the set bits, not the bitmap's length."""
    where = torch.nonzero(bitmap).view(-1)
    bits = (bitmap[where].to(torch.int64).unsqueeze(1) >> _BIT_SHIFTS.to(bitmap.device)) & 1
    return ((where.unsqueeze(1) << 3) + _BIT_SHIFTS.to(bitmap.device))[bits.bool()]


def owner_sums(slots: Tensor, values: Tensor, acc: torch.dtype) -> tuple[Tensor, Tensor]:
    """An owner's sums of received (partition slot, value) pairs: the distinct slots in ascending
    order with their sums in ``acc``, exact zeros dropped (they need not travel). Sized by the
    pairs, not the partition; each slot adds its values in the order received, as a dense
    partition-sized accumulator would, so the sums are the same bits."""
    distinct, inverse = torch.unique(slots, sorted=True, return_inverse=True)
    sums = torch.zeros(distinct.numel(), dtype=acc, device=values.device)
    sums.index_add_(0, inverse, values.to(acc))
    kept = sums != 0
    return distinct[kept], sums[kept]


def pull_message_bytes(size: int, nonzeros: int, value_bytes: int, position_bytes: int) -> tuple[int, bool]:
    """(bytes, as_bitmap) of an owner's pull message: the smaller of bitmap and COO (COO on a tie)."""
    bitmap = (size + 7) // 8 + nonzeros * value_bytes
    coo = nonzeros * (position_bytes + value_bytes)
    return (bitmap, True) if bitmap < coo else (coo, False)


# --------------------------------------------------------------------------- the scheme
def _group_rank_world(group: dist.ProcessGroup | None) -> tuple[int, int]:
    return dist.get_rank(group), dist.get_world_size(group)


def zen_pairs(
    values: Tensor,
    indices: Tensor,
    numel: int,
    group: dist.ProcessGroup | None,
    traffic: Traffic,
    equal_counts: bool = False,
    seed: int = DEFAULT_SEED,
    votes: Tensor | None = None,
) -> SparseSum:
    """ZEN balanced parallelism (see the module docstring); returns the sum as every owner's
    (positions, values), disjoint, this rank's own first. ``votes`` (see schemes.py) ride in the
    low bit of the push counts, which every rank sends to every rank."""
    me, world = _group_rank_world(group)
    device, dtype = values.device, values.dtype
    acc = accumulation_dtype(dtype)
    vbytes = values.element_size()
    wire, xbytes = wire_index_dtype(numel), index_bytes(numel)
    indices = indices.to(torch.int64)
    if world == 1:
        return SparseSum(numel, dtype, [(indices, values)])
    part = zen_partition(numel, world, seed, device)

    # push: counts, then (index, value) pairs grouped by owner (own pairs stay local)
    owner = zen_owner(indices, world, seed)
    order = torch.argsort(owner, stable=True)
    indices, values, owner = indices[order], values[order], owner[order]
    send_counts = torch.bincount(owner, minlength=world)
    words = send_counts if votes is None else send_counts * 2 + votes[me].to(torch.int64)
    recv_counts = torch.empty_like(words)
    dist.all_to_all_single(recv_counts, words, group=group)
    traffic.add((world - 1) * COUNT_BYTES, (world - 1) * COUNT_BYTES)
    if votes is not None:
        votes.copy_(recv_counts & 1)
        recv_counts = recv_counts >> 1
    sends, recvs = send_counts.tolist(), recv_counts.tolist()
    pair = xbytes + vbytes
    idx_parts, val_parts = torch.split(indices, sends), torch.split(values, sends)
    segments, in_splits = [], []
    for j in range(world):
        if j == me:
            in_splits.append(0)
            continue
        segments += [idx_parts[j].to(wire).contiguous().view(torch.uint8), val_parts[j].contiguous().view(torch.uint8)]
        in_splits.append(sends[j] * pair)
    out_splits = [0 if j == me else recvs[j] * pair for j in range(world)]
    inbox = torch.empty(sum(out_splits), dtype=torch.uint8, device=device)
    outbox = torch.cat(segments) if segments else inbox.new_empty(0)
    dist.all_to_all_single(inbox, outbox, out_splits, in_splits, group=group)
    traffic.add(sum(in_splits), sum(out_splits))

    # the owner sums the pairs it received, over the distinct slots of its partition
    got_idx, got_val = [idx_parts[me]], [val_parts[me]]
    for j, chunk in enumerate(torch.split(inbox, out_splits)):
        if j == me or recvs[j] == 0:
            continue
        cut = recvs[j] * xbytes
        got_idx.append(bytes_as(chunk[:cut], wire).to(torch.int64))
        got_val.append(bytes_as(chunk[cut:], dtype))
    nz, sums = owner_sums(part.local_slots(me, torch.cat(got_idx)), torch.cat(got_val), acc)
    mine_values = sums.to(dtype)  # cast once, by the owner

    # pull: nonzero counts (equal-sized all_gather), then each owner's bitmap or COO to all
    count = torch.tensor([nz.numel()], dtype=torch.int64, device=device)
    counts = [torch.empty_like(count) for _ in range(world)]
    dist.all_gather(counts, count, group=group)
    traffic.add((world - 1) * COUNT_BYTES, (world - 1) * COUNT_BYTES)
    nonzeros = [int(c.item()) for c in counts]
    formats = [pull_message_bytes(part.sizes[j], nonzeros[j], vbytes, xbytes) for j in range(world)]
    size, as_bitmap = formats[me]
    if as_bitmap:
        message = torch.cat([bitmap_of(nz, part.sizes[me]), mine_values.view(torch.uint8)])
    else:
        message = torch.cat([part.global_indices(me, nz).to(wire).view(torch.uint8), mine_values.view(torch.uint8)])
    assert message.numel() == size
    in_splits = [0 if j == me else size for j in range(world)]
    out_splits = [0 if j == me else formats[j][0] for j in range(world)]
    inbox = torch.empty(sum(out_splits), dtype=torch.uint8, device=device)
    outbox = message.repeat(world - 1) if size else message
    dist.all_to_all_single(inbox, outbox, out_splits, in_splits, group=group)
    traffic.add(sum(in_splits), sum(out_splits))

    # decode: every position comes from exactly one owner
    pieces = [(part.global_indices(me, nz), mine_values)]
    for j, chunk in enumerate(torch.split(inbox, out_splits)):
        if j == me or nonzeros[j] == 0:
            continue
        if formats[j][1]:
            cut = (part.sizes[j] + 7) // 8
            where = part.global_indices(j, bit_positions(chunk[:cut]))
        else:
            cut = nonzeros[j] * xbytes
            where = bytes_as(chunk[:cut], wire).to(torch.int64)
        pieces.append((where, bytes_as(chunk[cut:], dtype)))
    return SparseSum(numel, dtype, pieces)


def zen_sum(
    values: Tensor,
    indices: Tensor,
    numel: int,
    group: dist.ProcessGroup | None,
    traffic: Traffic,
    equal_counts: bool = False,
    seed: int = DEFAULT_SEED,
    votes: Tensor | None = None,
) -> Tensor:
    """``zen_pairs``, decoded: the dense sum in values' dtype."""
    return zen_pairs(values, indices, numel, group, traffic, equal_counts, seed, votes).dense()


@SPARSE_SCHEMES.register("zen")
def zen_scheme(
    values: Tensor,
    indices: Tensor,
    numel: int,
    group: dist.ProcessGroup | None,
    traffic: Traffic,
    equal_counts: bool = False,
    max_count: int | None = None,
    votes: Tensor | None = None,
) -> Tensor:
    """ZEN balanced parallelism with the default seed (every rank uses the same one); its count
    exchange is per destination partition, which a bound on the total does not replace."""
    return zen_sum(values, indices, numel, group, traffic, equal_counts, DEFAULT_SEED, votes)


# --------------------------------------------------------------------------- the communicator
def _agree_seed(seed: int, group: dist.ProcessGroup | None, device: torch.device, traffic: Traffic) -> int:
    """Rank 0's seed, broadcast on the group."""
    tensor = torch.tensor([seed], dtype=torch.int64, device=device)
    src = dist.get_global_rank(group, 0) if group is not None else 0
    dist.broadcast(tensor, src=src, group=group)
    root = dist.get_rank(group) == 0
    traffic.add((dist.get_world_size(group) - 1) * COUNT_BYTES if root else 0, 0 if root else COUNT_BYTES)
    return int(tensor.item())


def zen_or_sparcml(
    world: int, numel: int, k: int, nonzeros: float, value_bytes: int, link: Link, bounded: bool = False
) -> str:
    """ZEN's choice between balanced parallelism and SparCML from the alpha-beta model (ZEN on a tie).

    ``k``: entries each rank sends; ``nonzeros``: K, entries of the summed result (its size
    measures how much the ranks' selections overlap). ZEN's model puts every round on one link
    (``Links.uniform``): zen takes 4 rounds, sparcml 2 messages per recursive-doubling round (see
    ``commcost.zen_seconds`` and ``commcost.sparcml_seconds``). ``bounded`` (the selections'
    counts are bounded by k): a rank's own selection travels with its header.
    """
    if world <= 1:
        return "zen"
    shape = BufferShape(0, numel, k, value_bytes, index_bytes(numel))
    links = Links.uniform(world, link)
    zen = zen_seconds(shape, links, nonzeros)
    return "zen" if zen <= sparcml_seconds(shape, links, nonzeros, bounded) else "sparcml"


class _BufferState:
    __slots__ = ("rounds", "nonzeros", "choice")

    def __init__(self) -> None:
        self.rounds = 0
        self.nonzeros: list[int] = []  # K of every profiled round (identical on every rank)
        self.choice: str | None = None


@COMMUNICATORS.register("zen")
class ZenCommunicator(SchemeCommunicator):
    """ZEN: per buffer, run the ``zen`` scheme for the first ``profile_rounds`` rounds, measuring
    K (nonzeros of the sum, identical on every rank), then choose between it and SparCML with
    ``zen_or_sparcml`` on the group's alpha-beta link, measured on the buffer's group and agreed
    (max over ranks), so every rank chooses alike. ``choice="zen"`` or ``"sparcml"`` forces a scheme.

    ``seed`` is the hash seed; rank 0's value is broadcast once per process group.
    """

    name = "zen"
    scheme = "zen"
    split = True
    CHOICES = ("auto", "zen", "sparcml")

    def __init__(self, choice: str = "auto", profile_rounds: int = 4, seed: int = DEFAULT_SEED, **options: Any) -> None:
        super().__init__(**options)
        if choice not in self.CHOICES:
            raise ValueError(f"zen communicator: choice must be one of {self.CHOICES}, got {choice!r}")
        if isinstance(profile_rounds, bool) or not isinstance(profile_rounds, int) or profile_rounds < 1:
            raise ValueError(f"zen communicator: profile_rounds must be an integer >= 1, got {profile_rounds!r}")
        self.choice = choice
        self.profile_rounds = profile_rounds
        self.seed = int(seed)
        self._states: dict[str, _BufferState] = {}
        self._seeds: dict[int, int] = {}
        self._links: dict[int, Link] = {}
        self._lock = threading.Lock()

    def submit_sparse(self, channel: Channel, encoded: Encoded, buffer: Buffer) -> Future:
        key = f"{buffer.index}:{buffer.sparse_numel}"
        k = sum(slot.k for slot in buffer.sparse_slots)
        return channel.submit(
            self._zen_job, key, k, encoded.values, encoded.indices, buffer.sparse_numel, encoded.max_count, encoded.votes
        )

    def _state(self, key: str) -> _BufferState:
        with self._lock:
            return self._states.setdefault(key, _BufferState())

    def _seed_for(self, group, device: torch.device, traffic: Traffic) -> int:
        # one broadcast per group, issued by the group's own channel thread: same place on every rank
        gid = id(group)
        if gid not in self._seeds:
            self._seeds[gid] = _agree_seed(self.seed, group, device, traffic)
        return self._seeds[gid]

    def _link_for(self, group, device: torch.device) -> Link:
        """The group's alpha-beta link, measured once and agreed (max over ranks)."""
        gid = id(group)
        if gid not in self._links:
            link = measure_link("allgather", group, device)
            agreed = torch.tensor([link.alpha, link.beta], dtype=torch.float64, device=device)
            dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=group)
            self._links[gid] = Link(float(agreed[0]), float(agreed[1]))
        return self._links[gid]

    def set_plan(self, plan: Plan) -> None:
        """Buffers of an earlier plan are gone: so are their choices and hash partitions (one
        block id per ZEN_BLOCK elements of a buffer's sparse part, the largest state ZEN keeps)."""
        live = {f"{b.index}:{b.sparse_numel}" for b in plan.buffers}
        with self._lock:
            self._states = {key: state for key, state in self._states.items() if key in live}
        release_partitions_except({b.sparse_numel for b in plan.buffers})

    def scheme_for(self, key: str) -> str | None:
        """The scheme chosen for a buffer (None while still profiling)."""
        if self.choice != "auto":
            return self.choice
        state = self._states.get(key)
        return None if state is None else state.choice

    def _zen_job(
        self,
        key: str,
        k: int,
        values: Tensor,
        indices: Tensor,
        numel: int,
        max_count: int | None,
        votes: Tensor | None,
        group,
    ) -> tuple[Tensor, Traffic, Any]:
        traffic = Traffic()
        seed = self._seed_for(group, values.device, traffic)
        state = self._state(key)
        scheme = self.choice if self.choice != "auto" else state.choice
        if scheme == "sparcml":
            total = SPARSE_PAIRS.get("sparcml")(values, indices, numel, group, traffic, False, max_count, votes)
        else:
            total = zen_pairs(values, indices, numel, group, traffic, False, seed, votes)
        state.rounds += 1
        if scheme is None:  # profiling: K is the same on every rank (the same sum)
            state.nonzeros.append(sum(int(torch.count_nonzero(v)) for v in total.values()))
            if len(state.nonzeros) >= self.profile_rounds:
                nonzeros = sum(state.nonzeros) / len(state.nonzeros)
                link = self._link_for(group, values.device)
                state.choice = zen_or_sparcml(
                    dist.get_world_size(group), numel, k, nonzeros, values.element_size(), link, max_count is not None
                )
        return total, traffic, None

    def state_dict(self) -> dict[str, Any]:
        return {
            "choices": {k: s.choice for k, s in self._states.items() if s.choice is not None},
            "rounds": {k: s.rounds for k, s in self._states.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._states = {}
        for key, rounds in state.get("rounds", {}).items():
            s = self._state(key)
            s.rounds = int(rounds)
        for key, choice in state.get("choices", {}).items():
            self._state(key).choice = choice
        # buffers restored mid-profiling start profiling afresh (their K samples were not saved)
        for s in self._states.values():
            if s.choice is None:
                s.rounds = 0
