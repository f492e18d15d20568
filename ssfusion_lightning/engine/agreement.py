"""Control agreements: the small collectives that make every rank take the same decision at the
end of a round. They run on the control channel (channel 0), queued right behind the round's
buffers, in the same order on every rank:

- the non-finite vote (``NonFiniteVote``): whether any rank's gradients this round were
  non-finite. It rides in the round's last buffer where it can, else takes a collective of its own;
- DDP's unused-parameter agreement (``find_unused_parameters``): which parameters some rank used;
- rank 0's gradient-ready order, which the plan is rebuilt from after the first round.

(The cost model, agreed once the profiled rounds are over, is the engine's ``_agree_costs``; the
plan trial's medians are agreed with ``mean_over_ranks``.)
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from ssfusion_lightning.comm import Communicator, Reduced
from ssfusion_lightning.comm.channels import Channel
from ssfusion_lightning.vocabulary import Buffer, Encoded, Plan

#: where a round's non-finite vote travels
IN_DENSE, IN_SPARSE, OWN_COLLECTIVE = "dense", "sparse", "own"


def vote_route(plan: Plan, communicator: Communicator, per_tensor: bool, offloads: bool) -> str | None:
    """Where the non-finite vote of a round on ``plan`` travels; None: no vote (a plan with no sparse
    tensor has its sums checked instead).

    When the last buffer has a dense part, packed after every other tensor was compressed, the
    vote rides at its end (one entry per rank) instead of taking a collective of its own;
    otherwise in its sparse exchange, where the communicator carries one flag per rank to every
    rank (in a count header it sends anyway). Per-tensor policies pack the last buffer on the
    offload worker behind every offloaded selection; a whole buffer offloaded (``offloads``) ahead
    of the last may finish its check after the last one is packed, so the vote cannot ride."""
    if plan.sparse_numel == 0:
        return None
    last = plan.buffers[-1]
    if per_tensor or not offloads:
        if last.dense_numel > 0 and communicator.sums_dense:
            return IN_DENSE
        if communicator.carries_votes(last):
            return IN_SPARSE
    return OWN_COLLECTIVE


class NonFiniteVote:
    """Whether any rank's sparse gradients this round were non-finite: one uint8 entry per rank,
    this rank's set when one of its checks failed, combined by a max over the ranks. Dense
    gradients need no vote: a dense sum carries any rank's NaN/Inf to every rank, so the engine
    checks the sums instead."""

    def __init__(self, route: str | None, buffer: int, world_size: int, channel: Channel) -> None:
        self.route = route
        #: the index of the buffer the vote rides in (the plan's last)
        self.buffer = buffer
        self.world_size = world_size
        self.channel = channel
        self._finite: list[Tensor] = []

    @property
    def own_collective(self) -> bool:
        return self.route == OWN_COLLECTIVE

    def rides_in_dense(self, buffer: Buffer) -> bool:
        """Whether the vote takes ``world_size`` entries at the end of the buffer's dense part."""
        return self.route == IN_DENSE and buffer.index == self.buffer

    def rides_in_sparse(self, buffer: Buffer) -> bool:
        """Whether the vote travels in the buffer's sparse exchange (``Encoded.votes``)."""
        return self.route == IN_SPARSE and buffer.index == self.buffer

    def note(self, finite: Tensor) -> None:
        """One check of this rank's gradients: a 0-d bool tensor, True when all were finite."""
        self._finite.append(finite)

    def vector(self, out: Tensor | None = None) -> Tensor:
        """One entry per rank, 1 at this rank when any of its gradients this round was non-finite
        (written without a host sync, so a vote riding in a dense part does not stall the launch)."""
        vector = torch.zeros(self.world_size, dtype=torch.uint8, device=self.channel.device) if out is None else out.zero_()
        if self._finite:
            rank = dist.get_rank(self.channel.group) if self.world_size > 1 else 0
            vector[rank] = torch.logical_not(torch.stack(self._finite).all()).to(vector.dtype)
        return vector


class Agreement:
    """The control agreements that end one round, queued when it is created (right behind the
    round's buffers) and read as the engine needs them. ``settle(future, what)`` waits for a
    control collective's value (the engine turns a failure into a CommunicationError)."""

    def __init__(
        self,
        channel: Channel,
        settle: Callable[[Any, str], Any],
        vote: NonFiniteVote,
        num_params: int,
        used: Sequence[bool] | None = None,
        ready_order: Sequence[int] | None = None,
    ) -> None:
        """``used``: per parameter, whether a backward on this rank reached it (given when unused
        parameters are agreed on); ``ready_order``: the parameters in the order their gradients
        became ready on this rank (given when the plan is to be rebuilt from rank 0's)."""
        self._settle = settle
        self._vote = vote
        device = channel.device
        self._health = channel.submit(_nonfinite_vote, vote.vector()) if vote.own_collective else None
        self._usage = None
        if used is not None:
            self._usage = channel.submit(_usage_vote, torch.tensor(list(used), dtype=torch.uint8, device=device))
        self._order = None
        if ready_order is not None:
            # parameters rank 0 never saw last, in backward order
            seen = set(ready_order)
            order = list(ready_order) + [i for i in reversed(range(num_params)) if i not in seen]
            self._order = channel.submit(_broadcast_from_rank0, torch.tensor(order, dtype=torch.int64, device=device))

    def unhealthy(self, results: Sequence[tuple[Buffer, Reduced, Encoded]]) -> list[int]:
        """The ranks whose gradients were non-finite this round, from the round's reduced buffers."""
        if self._vote.route == IN_DENSE:
            last, reduced, _ = results[self._vote.buffer]
            votes = reduced.dense[last.dense_numel :]
        elif self._vote.route == IN_SPARSE:
            votes = results[self._vote.buffer][2].votes
        else:
            votes = self._settle(self._health, "non-finite check") if self._health is not None else None
        return [rank for rank, flag in enumerate(votes.tolist()) if flag] if votes is not None else []

    def used(self) -> list[int] | None:
        """DDP's find_unused_parameters: per parameter, 1 when some rank used it (in any micro-batch
        since the last synchronized round); a parameter no rank used keeps ``.grad`` untouched.
        None when not agreed on."""
        return self._settle(self._usage, "unused-parameter agreement").tolist() if self._usage is not None else None

    def ready_order(self) -> list[int] | None:
        """Rank 0's gradient-ready order; None when not agreed on this round."""
        return self._settle(self._order, "ready-order agreement").tolist() if self._order is not None else None


def _broadcast_from_rank0(tensor: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    dist.broadcast(tensor, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    return tensor


# the votes: a max over the ranks (two names, so that a count of collectives tells them apart)
def _nonfinite_vote(flags: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    return flags


def _usage_vote(used: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    dist.all_reduce(used, op=dist.ReduceOp.MAX, group=group)
    return used


def mean_over_ranks(value: float, group: dist.ProcessGroup | None, device: torch.device) -> float:
    """The mean of ``value`` over the ranks of ``group``: the plan trial's agreed median step.
    Synchronous ranks share one step time, so their medians of a window differ by sampling noise
    alone (up to 16 ms in one digits window at P = 4): the mean averages it, where a max would
    take the noisiest rank's."""
    total = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    return float(total.item()) / dist.get_world_size(group)
