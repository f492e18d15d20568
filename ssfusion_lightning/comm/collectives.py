"""The dense + sparse communicators: dense parts are all-reduced, sparse parts summed by a scheme
(an allgather carries a small dense part in its own message instead)."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ssfusion_lightning.comm.base import COMMUNICATORS, Communicator, PendingReduction, Reduced
from ssfusion_lightning.comm.channels import Channel, ChannelSet, result
from ssfusion_lightning.comm.schemes import (
    SPARSE_PAIRS,
    SPARSE_SCHEMES,
    SparseSum,
    accumulation_dtype,
    allgather_pairs,
    index_bytes,
)
from ssfusion_lightning.comm.traffic import Traffic
from ssfusion_lightning.commcost import BufferShape, dense_rides, ring_allreduce_bytes
from ssfusion_lightning.vocabulary import Buffer, Encoded


def allreduce_dense(tensor: Tensor, group: dist.ProcessGroup | None) -> tuple[Tensor, Traffic]:
    dist.all_reduce(tensor, group=group)
    nbytes = ring_allreduce_bytes(tensor.numel() * tensor.element_size(), dist.get_world_size(group))
    traffic = Traffic()
    traffic.add(nbytes, nbytes)
    return tensor, traffic


def allreduce_with_votes(dense: Tensor, votes: Tensor | None, group: dist.ProcessGroup | None) -> tuple[Tensor, Traffic]:
    """All-reduce ``dense`` with ``votes`` (see schemes.py) appended, one entry per rank: each
    entry is nonzero on one rank at most, so the sum is every rank's flag."""
    if votes is None:
        return allreduce_dense(dense, group)
    summed, traffic = allreduce_dense(torch.cat([dense, votes.to(dense.dtype)]), group)
    votes.copy_(summed[dense.numel() :] != 0)
    return summed[: dense.numel()], traffic


def allreduce_shared_positions(
    values: Tensor, indices: Tensor, numel: int, votes: Tensor | None, group: dist.ProcessGroup | None
):
    """Every rank picked the same positions (randomk): all-reduce the values alone, then scatter."""
    summed, traffic = allreduce_with_votes(values.clone(), votes, group)
    total = torch.zeros(numel, dtype=accumulation_dtype(values.dtype), device=values.device)
    total.index_add_(0, indices, summed.to(total.dtype))
    return total.to(values.dtype), traffic, None


class SchemeCommunicator(Communicator):
    """Dense part: ring allreduce. Sparse part: ``scheme``. With ``split`` the two parts go to
    different channels so they run concurrently (SSFusion-I / ADTopk-H)."""

    scheme: str = "allgather"
    split: bool = True
    sums_dense = True

    def launch(self, encoded: Encoded, buffer: Buffer, channels: ChannelSet) -> PendingReduction:
        if self._dense_rides(encoded, buffer):
            job = channels[buffer.channel].submit(
                allgather_with_dense, encoded.dense, encoded.values, encoded.indices, buffer.sparse_numel,
                encoded.equal_counts, encoded.max_count, encoded.votes,
            )
            return _JointReduction(job, channels.device)
        dense = sparse = None
        if encoded.dense is not None:
            dense = channels[buffer.channel].submit(allreduce_dense, encoded.dense)
        if encoded.values is not None:
            channel = channels[buffer.channel + (1 if self.split and dense is not None else 0)]
            if encoded.shared_indices:
                sparse = channel.submit(
                    allreduce_shared_positions, encoded.values, encoded.indices, buffer.sparse_numel, encoded.votes
                )
            else:
                sparse = self.submit_sparse(channel, encoded, buffer)
        return PendingReduction(dense, sparse, channels.device)

    def _dense_rides(self, encoded: Encoded, buffer: Buffer) -> bool:
        """An allgather buffer with a small dense part sends it in the same message (from the plan
        alone: every rank decides alike)."""
        if self.scheme != "allgather" or encoded.dense is None or encoded.values is None or encoded.shared_indices:
            return False
        k = sum(slot.k for slot in buffer.sparse_slots)
        value_bytes = encoded.values.element_size()
        return dense_rides(BufferShape(buffer.dense_numel, buffer.sparse_numel, k, value_bytes, index_bytes(buffer.sparse_numel)))

    def carries_votes(self, buffer: Buffer) -> bool:
        # every sparse scheme fills ``votes`` from an exchange it makes anyway (see schemes.py)
        return buffer.sparse_numel > 0

    def submit_sparse(self, channel: Channel, encoded: Encoded, buffer: Buffer) -> Future:
        """Queue the sparse part's job; stateful schemes override it to pass their per-buffer key."""
        return channel.submit(
            self._sparse_job,
            encoded.values,
            encoded.indices,
            buffer.sparse_numel,
            encoded.equal_counts,
            encoded.max_count,
            encoded.votes,
        )

    def _sparse_job(
        self,
        values: Tensor,
        indices: Tensor,
        numel: int,
        equal_counts: bool,
        max_count: int | None,
        votes: Tensor | None,
        group,
    ) -> tuple[Tensor, Traffic, Any]:
        traffic = Traffic()
        # a sum left as pairs is decoded by the engine, into the gradients' memory
        scheme = SPARSE_PAIRS.get(self.scheme) if self.scheme in SPARSE_PAIRS else SPARSE_SCHEMES.get(self.scheme)
        total = scheme(values, indices, numel, group, traffic, equal_counts, max_count, votes)
        return total, traffic, None


class _JointReduction(PendingReduction):
    """Both parts of a buffer from one job: (dense sum, sparse sum, traffic)."""

    def __init__(self, job: Future, device: torch.device) -> None:
        self._job = job
        self._device = device

    def wait(self, timeout: float | None = None) -> Reduced:
        dense, sparse, traffic = result(self._job, self._device, timeout)
        return Reduced(dense, sparse, traffic)


def allgather_with_dense(
    dense: Tensor,
    values: Tensor,
    indices: Tensor,
    numel: int,
    equal_counts: bool,
    max_count: int | None,
    votes: Tensor | None,
    group: dist.ProcessGroup | None,
) -> tuple[Tensor, SparseSum, Traffic]:
    """Both parts of a buffer in ONE allgather: the dense part rides after the pairs (see
    ``schemes.allgather_pairs``)."""
    traffic = Traffic()
    total = allgather_pairs(values, indices, numel, group, traffic, equal_counts, max_count, votes, dense=dense)
    return dense, total, traffic


def allreduce_joint(
    dense: Tensor, values: Tensor, indices: Tensor, numel: int, votes: Tensor | None, group: dist.ProcessGroup | None
) -> tuple[Tensor, Tensor, Traffic]:
    """The dense part and the scattered sparse part (and the votes) in ONE all-reduce: a buffer
    costs one ring's latency, as a DDP bucket does."""
    scattered = torch.zeros(numel, dtype=dense.dtype, device=dense.device)
    scattered[indices] = values
    summed, traffic = allreduce_with_votes(torch.cat([dense, scattered]), votes, group)
    return summed[: dense.numel()], summed[dense.numel() :], traffic


@COMMUNICATORS.register("allreduce")
class AllreduceCommunicator(SchemeCommunicator):
    """Everything as dense allreduce: sparse selections are scattered into a dense part first;
    a buffer with both parts sends them in one all-reduce."""

    name = "allreduce"
    split = False

    def launch(self, encoded: Encoded, buffer: Buffer, channels: ChannelSet) -> PendingReduction:
        if encoded.dense is None or encoded.values is None:
            return super().launch(encoded, buffer, channels)
        job = channels[buffer.channel].submit(
            allreduce_joint, encoded.dense, encoded.values, encoded.indices, buffer.sparse_numel, encoded.votes
        )
        return _JointReduction(job, channels.device)

    def _sparse_job(
        self,
        values: Tensor,
        indices: Tensor,
        numel: int,
        equal_counts: bool,
        max_count: int | None,
        votes: Tensor | None,
        group,
    ):
        dense = torch.zeros(numel, dtype=values.dtype, device=values.device)
        dense[indices] = values
        total, traffic = allreduce_with_votes(dense, votes, group)
        return total, traffic, None


@COMMUNICATORS.register("allgather")
class AllgatherCommunicator(SchemeCommunicator):
    name = "allgather"
    scheme = "allgather"
    split = False


@COMMUNICATORS.register("hybrid")
class HybridCommunicator(SchemeCommunicator):
    name = "hybrid"
    scheme = "allgather"
    split = True
