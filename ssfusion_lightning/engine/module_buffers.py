"""Module buffers (BatchNorm statistics) from rank 0, sent during the backward.

DDP broadcasts rank 0's buffers before every forward that follows a synchronized one: a blocking
collective at the start of each step, bound by the link's latency (3-6 ms a step at P = 4, 40
Mbit/s: experiments/REPORT.md). A forward is where a module changes its buffers, and the backward
and the optimizer between two forwards leave them alone. So rank 0's buffers at the end of a forward
are, as a rule, the values DDP would send before the next one. ``BufferBroadcast`` sends them from
then on, behind the backward, on one of the strategy's channels (in order with the step's other
collectives on it), and copies them in before the next forward.

Where buffers do change between a backward and the next forward (a callback, a second forward in
manual optimization), rank 0's change is not sent: the other ranks get rank 0's values from before
it. No rank can tell without another collective whether rank 0 changed its buffers, so every rank
reports its own change (``apply`` returns it) and the strategy warns; DDP's blocking broadcast
(``broadcast_buffers=True``) is exact under any change.
"""

from __future__ import annotations

from concurrent.futures import TimeoutError as FutureTimeout
from typing import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from ssfusion_lightning.comm.channels import Channel, result
from ssfusion_lightning.engine.errors import CommunicationError

#: the broadcast_buffers values: DDP's blocking broadcast before the forward, none, or this module's
BROADCAST_BUFFERS_CHOICES = (True, False, "overlap")


class BufferBroadcast:
    """One broadcast of rank 0's module buffers, as bytes in one collective, launched on ``channel``."""

    def __init__(self, buffers: Sequence[Tensor], rank: int, channel: Channel) -> None:
        self.buffers = list(buffers)
        self.rank = rank
        self.device = channel.device
        self.versions = [buffer._version for buffer in self.buffers]
        self.sizes = [buffer.numel() * buffer.element_size() for buffer in self.buffers]
        if rank == 0:
            payload = torch.cat([_as_bytes(buffer) for buffer in self.buffers])
        else:
            payload = torch.empty(sum(self.sizes), dtype=torch.uint8, device=self.buffers[0].device)
        self.future = channel.submit(_broadcast_from_rank0, payload)

    def apply(self, timeout: float | None) -> bool:
        """Wait for the broadcast and copy rank 0's values into this rank's buffers. Returns whether
        this rank's buffers changed since the launch (then rank 0's change, if any, is not in them)."""
        try:
            payload = result(self.future, self.device, timeout)
        except FutureTimeout:
            raise CommunicationError(
                f"ssfusion: the broadcast of module buffers from rank 0 did not complete within {timeout}s "
                "(a rank may have died or a link gone down)"
            ) from None
        except Exception as error:
            raise CommunicationError(f"ssfusion: the broadcast of module buffers from rank 0 failed: {error}") from error
        changed = any(buffer._version != version for buffer, version in zip(self.buffers, self.versions))
        if self.rank != 0:
            with torch.no_grad():
                for buffer, part in zip(self.buffers, payload.split(self.sizes)):
                    buffer.copy_(part.view(buffer.dtype).view(buffer.shape))
        return changed


def _as_bytes(buffer: Tensor) -> Tensor:
    return buffer.detach().contiguous().reshape(-1).view(torch.uint8)


def _broadcast_from_rank0(payload: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    dist.broadcast(payload, src=0, group=group)
    return payload
