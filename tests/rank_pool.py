"""A pool of gloo ranks reused across tests: process start-up and torch import dominate test time.

``pool.run(fn, *args)`` runs the module-level function ``fn`` on every rank at once and returns
the per-rank results. Workers look like ranks launched externally (LOCAL_RANK etc. are set), so a
Lightning Trainer inside ``fn`` joins the existing process group instead of launching processes.
A task that hangs past its timeout kills the pool; the next ``run`` starts a fresh one.

Tasks and results cross the process boundary as ``torch.save`` bytes, made before ``put``. Handed
to a ``multiprocessing.Queue`` as objects, tensors would be pickled later, on the queue's feeder
thread, by torch's sharing reductions, which move a tensor's storage into shared memory in place and
free the old memory: a worker already running its next task (or reusing a cached buffer the result
is a view of) then writes to freed memory.
"""

from __future__ import annotations

import faulthandler
import io
import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
from typing import Any, Callable


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pack(value: Any) -> bytes:
    import torch

    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _unpack(data: bytes) -> Any:
    import torch

    return torch.load(io.BytesIO(data), weights_only=False)


def _worker(rank: int, world: int, port: int, inbox: mp.Queue, outbox: mp.Queue) -> None:
    # a crash in native code (a segfault, glibc's heap checks) then prints every thread's Python
    # stack to the test log, instead of only "rank died"
    faulthandler.enable(all_threads=True)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        WORLD_SIZE=str(world),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        NODE_RANK="0",
        OMP_NUM_THREADS="1",
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    while True:
        task = inbox.get()
        if task is None:
            break
        fn, args, kwargs = _unpack(task)
        # A task's random draws must not depend on which tasks this worker ran before (or a
        # statistical assertion passes or fails with the test order); ranks still differ.
        torch.manual_seed(rank)
        try:
            outbox.put((rank, True, _pack(fn(*args, **kwargs))))
        except BaseException:  # noqa: BLE001 - report every failure to the test process
            outbox.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()


class RankPool:
    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._procs: list[mp.Process] = []

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        port = _free_port()
        self._inboxes = [ctx.Queue() for _ in range(self.world_size)]
        self._outbox = ctx.Queue()
        self._procs = [
            ctx.Process(target=_worker, args=(r, self.world_size, port, self._inboxes[r], self._outbox), daemon=True)
            for r in range(self.world_size)
        ]
        for p in self._procs:
            p.start()

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = 300, **kwargs: Any) -> list[Any]:
        if not self._procs or not all(p.is_alive() for p in self._procs):
            self.close()
            self._start()
        task = _pack((fn, args, kwargs))
        for inbox in self._inboxes:
            inbox.put(task)
        results: dict[int, Any] = {}
        failures: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        while len(results) + len(failures) < self.world_size:
            try:
                rank, ok, value = self._outbox.get(timeout=1.0)
            except queue.Empty:
                dead = [r for r, p in enumerate(self._procs) if not p.is_alive()]
                if dead or time.monotonic() > deadline:
                    self.close()
                    why = f"ranks {dead} died" if dead else f"it did not finish within {timeout}s"
                    raise TimeoutError(f"{fn.__name__} failed on {self.world_size} ranks: {why}") from None
                continue
            if ok:
                results[rank] = _unpack(value)
            else:
                failures[rank] = value
        if failures:
            self.close()  # a failed collective may leave the ranks out of step: start afresh next time
            details = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(failures.items()))
            raise AssertionError(f"{fn.__name__} failed on ranks {sorted(failures)}:\n{details}")
        return [results[r] for r in range(self.world_size)]

    def close(self) -> None:
        for p in self._procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=10)
        self._procs = []
