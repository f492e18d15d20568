"""Communication channels: one FIFO worker thread per strategy-owned process group.

Every collective on a group is issued by that group's single worker, in the order the engine
submitted it. The engine submits in plan order from one thread, so all ranks issue the same
collectives in the same order on every group, whatever order their backward hooks fire in.
Different groups run concurrently (dense and sparse parts, successive buffers).
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from ssfusion_lightning.comm.topology import Hierarchy
from ssfusion_lightning.timeline import Timeline


@dataclass
class Completed:
    """A channel job's value, with the CUDA event that marks it done on the channel's stream."""

    value: Any
    event: torch.cuda.Event | None

    def get(self, device: torch.device) -> Any:
        if self.event is not None:
            torch.cuda.current_stream(device).wait_event(self.event)
        return self.value


class Channel:
    """Runs blocking collectives on one process group, in submission order, off the calling thread."""

    def __init__(
        self, group: dist.ProcessGroup | None, index: int, device: torch.device, hierarchy: Hierarchy | None = None
    ) -> None:
        self.group = group
        #: this channel's own node-local and cross-node groups (hierarchical communication): a
        #: channel's collectives never share a group with another channel's
        self.hierarchy = hierarchy
        self.index = index
        self.device = device
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"ssfusion-comm{index}")
        self._stream = torch.cuda.Stream(device=device) if device.type == "cuda" else None
        self.timeline = Timeline()
        #: CPU seconds this channel's thread spent in buffer jobs, and their number: what each
        #: buffer's collective takes from the cores the backward runs on (the cost model's overhead)
        self.job_cpu_seconds = 0.0
        self.jobs = 0
        self._running = False

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        """Run ``fn(*args, group)`` on this channel; on CUDA it waits for the submitting stream first."""
        ready = None
        if self._stream is not None:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
        # a job submitted while a buffer is being launched is that buffer's communication
        buffer = self.timeline.current_buffer()
        return self._executor.submit(self._run, fn, args, ready, buffer)

    def _run(self, fn: Callable[..., Any], args: Sequence[Any], ready: torch.cuda.Event | None, buffer: int | None) -> Completed:
        started = time.thread_time()
        self._running = True
        try:
            return self._run_job(fn, args, ready, buffer)
        finally:
            self._running = False
            if buffer is not None:
                self.job_cpu_seconds += time.thread_time() - started
                self.jobs += 1

    def _run_job(self, fn: Callable[..., Any], args: Sequence[Any], ready: torch.cuda.Event | None, buffer: int | None) -> Completed:
        with self.timeline.span("comm" if buffer is not None else "control", buffer):
            if self._stream is None:
                return Completed(fn(*args, self.group), None)
            with torch.cuda.stream(self._stream):
                self._stream.wait_event(ready)
                value = fn(*args, self.group)
                done = torch.cuda.Event()
                done.record(self._stream)
            if self.timeline.enabled:
                done.synchronize()  # the span ends when the collective has, not when it was queued
            return Completed(value, done)

    @property
    def busy(self) -> bool:
        """A job is running on this channel's thread (after a failure, it may be blocked in a collective)."""
        return self._running

    def groups(self) -> list[dist.ProcessGroup]:
        """Every process group this channel's collectives use."""
        hierarchy = () if self.hierarchy is None else (self.hierarchy.local, self.hierarchy.cross)
        return [group for group in (self.group, *hierarchy) if group is not None]

    def shutdown(self, wait: bool = True) -> None:
        self._executor.shutdown(wait=wait, cancel_futures=not wait)


def result(future: Future, device: torch.device, timeout: float | None = None) -> Any:
    """Wait for a channel job; on CUDA, order the current stream after the job's stream."""
    completed: Completed = future.result(timeout=timeout)
    return completed.get(device)


class ChannelSet:
    """The strategy's K process groups, each with its channel; buffers rotate over them."""

    def __init__(
        self,
        groups: Sequence[dist.ProcessGroup | None],
        device: torch.device,
        hierarchies: Sequence[Hierarchy] | None = None,
    ) -> None:
        if not groups:
            raise ValueError("a ChannelSet needs at least one process group")
        if hierarchies is not None and len(hierarchies) != len(groups):
            raise ValueError(f"a ChannelSet needs one hierarchy per process group: {len(hierarchies)} for {len(groups)} groups")
        self.channels = [
            Channel(group, i, device, hierarchies[i] if hierarchies is not None else None) for i, group in enumerate(groups)
        ]
        self.device = device

    def __len__(self) -> int:
        return len(self.channels)

    def cpu_seconds_per_job(self) -> float:
        """Mean CPU seconds of one buffer job over every channel so far (0 before any)."""
        jobs = sum(channel.jobs for channel in self.channels)
        return sum(channel.job_cpu_seconds for channel in self.channels) / jobs if jobs else 0.0

    def set_timeline(self, timeline: Timeline) -> None:
        """Record every channel's collectives on ``timeline``."""
        for channel in self.channels:
            channel.timeline = timeline

    def __getitem__(self, index: int) -> Channel:
        return self.channels[index % len(self.channels)]

    def shutdown(self, wait: bool = True) -> list[dist.ProcessGroup]:
        """Stop every channel's thread. Returns the process groups of the channels whose thread is
        still inside a job (only without ``wait``, after a failure): destroying such a group would
        free it under a collective that may still be blocked in it."""
        for channel in self.channels:
            channel.shutdown(wait)
        return [group for channel in self.channels if channel.busy for group in channel.groups()]
