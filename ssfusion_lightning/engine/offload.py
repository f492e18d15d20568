"""SSFusion-O: run sparsification off the critical path of backward.

One worker thread compresses the tensors (or buffers) the plan offloads; while a plan offloads
any, every buffer's launch also goes through it, in plan order (so channels still see the plan
order). A plan that offloads nothing launches from the main thread
(``FusionEngine._launches_on_worker``). On CUDA, ``stream`` compresses on a side stream ordered by
events; ``thread`` stages the gradients in pinned host memory with non-blocking copies and
compresses on the CPU, then ships the selection back to the device.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Sequence

import torch
from torch import Tensor

from ssfusion_lightning.vocabulary import Encoded


class Offloader:
    def __init__(self, mode: str, device: torch.device) -> None:
        if mode == "stream" and device.type != "cuda":
            raise ValueError(f"offload='stream' needs a CUDA device, got {device}; use 'thread', 'auto' or 'none'")
        self.mode = mode
        self.device = device
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ssfusion-offload")
        self._stream = torch.cuda.Stream(device=device) if device.type == "cuda" else None
        self._pinned: dict[tuple[int, int], Tensor] = {}

    @property
    def stages_on_host(self) -> bool:
        return self.mode == "thread" and self.device.type == "cuda"

    def stage(self, key: int, grads: Sequence[Tensor]) -> list[Tensor]:
        """Non-blocking copies of a buffer's gradients into reusable pinned host buffers."""
        staged = []
        for i, grad in enumerate(grads):
            host = self._pinned.get((key, i))
            if host is None or host.shape != grad.shape or host.dtype != grad.dtype:
                host = torch.empty(grad.shape, dtype=grad.dtype, pin_memory=True)
                self._pinned[(key, i)] = host
            host.copy_(grad, non_blocking=True)
            staged.append(host)
        return staged

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        ready = None
        if self._stream is not None:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
        return self._executor.submit(self._run, fn, args, ready)

    def _run(self, fn: Callable[..., Any], args: Sequence[Any], ready) -> Any:
        if self._stream is None:
            return fn(*args)
        with torch.cuda.stream(self._stream):
            if self.stages_on_host:
                ready.synchronize()  # the pinned copies must have landed before the CPU reads them
            else:
                self._stream.wait_event(ready)
            return fn(*args)

    def shutdown(self, wait: bool = True) -> None:
        self._executor.shutdown(wait=wait, cancel_futures=not wait)


def to_device(encoded: Encoded, device: torch.device) -> Encoded:
    move = lambda t: None if t is None else t.to(device, non_blocking=True)  # noqa: E731
    return Encoded(
        dense=move(encoded.dense),
        values=move(encoded.values),
        indices=move(encoded.indices),
        updates=encoded.updates,
        equal_counts=encoded.equal_counts,
        max_count=encoded.max_count,
        shared_indices=encoded.shared_indices,
    )
