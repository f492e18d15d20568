"""DDP's buffer broadcast, started as soon as it is due instead of in front of the next forward.

DDP (``broadcast_buffers=True``) sends rank 0's module buffers (BatchNorm statistics) to every
rank at the start of a forward that follows a synchronized one, and the forward waits for it: one
blocking collective per step, on the critical path, that also absorbs the ranks' skew. Rank 0's
buffers change only in a forward, so the bytes DDP sends at forward t are the ones rank 0 holds
right after forward t-1. ``BufferBroadcast`` sends them then, asynchronously, and the other ranks
write them just before forward t: every rank enters every forward with the buffers DDP gives it,
bit for bit, while the broadcast runs behind the backward and the optimizer step. A training
forward reads no running statistics (it normalizes with the batch's), and nothing between two
forwards writes them, so the wait in between changes nothing.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor


class BufferBroadcast:
    """Rank 0's ``buffers`` to every rank of ``group``, as one byte message: ``start`` packs and
    launches it, ``apply`` waits and writes it into the buffers (rank 0's are the source and stay
    untouched), ``cancel`` waits and writes nothing. Every rank must call ``start`` at the same
    point of its program, as for any collective."""

    def __init__(self, buffers: list[Tensor], group: dist.ProcessGroup | None = None) -> None:
        self.buffers = [b for b in buffers if b.numel() > 0]
        self.group = group
        self._pending: tuple[dist.Work, Tensor] | None = None

    @property
    def pending(self) -> bool:
        return self._pending is not None

    def start(self) -> None:
        if not self.buffers:
            return
        self.cancel()  # at most one in flight: a newer start supersedes an unapplied one
        # a copy (cat), so that a write to rank 0's buffers after this call is not what is sent
        packed = torch.cat([b.detach().reshape(-1).view(torch.uint8) for b in self.buffers])
        source = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        work = dist.broadcast(packed, src=source, group=self.group, async_op=True)
        self._pending = (work, packed)

    def apply(self) -> None:
        if self._pending is None:
            return
        work, packed = self._pending
        self._pending = None
        work.wait()
        if dist.get_rank(self.group) == 0:
            return
        offset = 0
        with torch.no_grad():
            for buffer in self.buffers:
                size = buffer.numel() * buffer.element_size()
                # a clone: a byte slice at an offset not aligned to the dtype cannot be viewed as it
                buffer.copy_(packed[offset : offset + size].clone().view(buffer.dtype).view_as(buffer))
                offset += size

    def cancel(self) -> None:
        if self._pending is not None:
            work, _ = self._pending
            self._pending = None
            work.wait()
