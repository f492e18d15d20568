"""The engine's timeline: when each buffer was compressed, packed, launched, sent and written.

Every phase runs inside ``Timeline.span(name, buffer)``, which does two things:

- it opens a ``torch.profiler.record_function`` range named ``ssfusion.<name>[<buffer>]`` while a
  torch profiler runs (Lightning's ``PyTorchProfiler`` included), so the phases show in its
  tables and Chrome traces. Ranges on the engine's worker threads (offload, collectives) reach
  the trace only when the profiler profiles every thread: pass
  ``experimental_config=torch._C._profiler._ExperimentalConfig(profile_all_threads=True)``;
- when recording is enabled (off by default: nothing is kept), it appends an ``Event`` with the
  phase, buffer, step, rank, thread and monotonic start/end in nanoseconds.

Spans (where they are recorded, all in ``engine/engine.py`` unless noted):
``select`` compensation and selection of one tensor (``_timed_slot``; ``detail`` names the tensor)
or of a whole buffer (``_compress_buffer``); ``pack`` packing a buffer's pieces (``_pack_and_launch``);
``launch`` handing a buffer to the communicator (``_launch_encoded``); ``comm`` one of the buffer's
collectives, from its start to its completion on the channel's worker (``comm/channels.py``:
``Channel._run``); ``control`` the same for the round's control collectives (non-finite vote,
usage and ready-order agreement, cost agreement), which belong to no buffer; ``wait`` the main
thread waiting for a buffer in ``finish``; ``write`` writing a buffer's gradients and updating its
error feedback (``finish``). Marks (instants): ``backward.begin`` (``begin_backward``) and
``backward.end`` (``finish`` entered: the backward is over).

    strategy = SSFusionStrategy(..., timeline=True)       # or strategy.timeline.enable()
    trainer.fit(...)
    events = strategy.timeline.events(step=6)            # this rank's events of one step
    strategy.timeline.save_chrome_trace("rank0.json")    # open in chrome://tracing or Perfetto

The clock is ``time.perf_counter_ns`` (CLOCK_MONOTONIC on Linux): comparable across the ranks of
one host, not across hosts.
"""

from __future__ import annotations

import json
import threading
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, ContextManager, Iterable

import torch.autograd.profiler as autograd_profiler
from torch.profiler import record_function

#: the phases a span may have, in data-path order (marks are separate)
PHASES = ("select", "pack", "launch", "comm", "control", "wait", "write")
MARKS = ("backward.begin", "backward.end")


@dataclass(frozen=True)
class Event:
    """One span of one rank, or a mark (a name in ``MARKS``, ``end_ns == start_ns``)."""

    name: str
    buffer: int | None
    step: int
    rank: int
    thread: str
    start_ns: int
    end_ns: int
    #: what inside the buffer, where it matters (the tensor of a per-tensor ``select``)
    detail: str | None = None

    @property
    def is_mark(self) -> bool:
        return self.name in MARKS


def range_name(name: str, buffer: int | None) -> str:
    """The record_function name of a span: ``ssfusion.comm[0]``, ``ssfusion.control``."""
    return f"ssfusion.{name}" if buffer is None else f"ssfusion.{name}[{buffer}]"


def _profiler_running() -> bool:
    # torch's own process-wide flag, kept for cheap checks: a record_function costs about ten
    # microseconds even with no profiler, the flag a few tens of nanoseconds. Without the flag
    # (another torch version) the range is always opened.
    return getattr(autograd_profiler, "_is_profiler_enabled", True)


class Timeline:
    """Thread-safe recorder of the engine's spans and marks (see the module docstring)."""

    def __init__(self, enabled: bool = False, rank: int = 0) -> None:
        self.rank = rank
        #: the engine's step, set at each backward's start; events carry it
        self.step = 0
        self._enabled = enabled
        self._events: list[tuple] = []
        self._lock = threading.Lock()
        self._local = threading.local()

    # ------------------------------------------------------------ switching
    @property
    def enabled(self) -> bool:
        return self._enabled

    def enable(self) -> None:
        self._enabled = True

    def disable(self) -> None:
        """Stop recording; what was recorded stays until ``clear``."""
        self._enabled = False

    def clear(self) -> None:
        with self._lock:
            self._events.clear()

    # ------------------------------------------------------------ recording
    def span(self, name: str, buffer: int | None = None, detail: str | None = None) -> ContextManager[Any]:
        """Context manager around one phase of ``buffer`` (None: of no buffer)."""
        profiling = _profiler_running()
        if not self._enabled and not profiling:
            return _IDLE
        return _Span(self, name, buffer, detail, profiling)

    def mark(self, name: str) -> None:
        if self._enabled:
            now = time.perf_counter_ns()
            self._append((name, None, self.step, threading.current_thread().name, now, now, None))

    def current_buffer(self) -> int | None:
        """The buffer of the innermost span open on this thread: a collective submitted while a
        buffer is being launched belongs to that buffer."""
        return getattr(self._local, "buffer", None)

    def _append(self, event: tuple) -> None:
        # kept as a tuple, the fields of Event but the rank: building the dataclass costs
        # microseconds on the hot path, so ``events`` builds them when someone reads
        with self._lock:
            self._events.append(event)

    # ------------------------------------------------------------ reading
    def events(self, step: int | None = None) -> list[Event]:
        """A copy of the recorded events (of one step), in order of their start."""
        with self._lock:
            raw = list(self._events)
        if step is not None:
            raw = [e for e in raw if e[2] == step]
        events = [Event(name, buffer, s, self.rank, thread, start, end, detail) for name, buffer, s, thread, start, end, detail in raw]
        return sorted(events, key=lambda e: (e.start_ns, e.end_ns))

    def save_chrome_trace(self, path: str | Path, step: int | None = None) -> None:
        Path(path).write_text(json.dumps(chrome_trace(self.events(step))))

    # the spawn launcher pickles the strategy, and with it its timeline: locks do not pickle
    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        del state["_lock"], state["_local"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()
        self._local = threading.local()


#: the span while nothing listens: no profiler, no recording
_IDLE = nullcontext()


class _Span:
    __slots__ = ("_timeline", "_name", "_buffer", "_detail", "_outer", "_range", "_step", "_start")

    def __init__(self, timeline: Timeline, name: str, buffer: int | None, detail: str | None, profiling: bool) -> None:
        self._timeline = timeline
        self._name = name
        self._buffer = buffer
        self._detail = detail
        self._range = record_function(range_name(name, buffer)) if profiling else None

    def __enter__(self) -> "_Span":
        local = self._timeline._local
        self._outer = getattr(local, "buffer", None)
        if self._buffer is not None:
            local.buffer = self._buffer
        if self._range is not None:
            self._range.__enter__()
        self._step = self._timeline.step
        self._start = time.perf_counter_ns() if self._timeline._enabled else None
        return self

    def __exit__(self, *exc_info: object) -> None:
        timeline = self._timeline
        if self._start is not None:
            end = time.perf_counter_ns()
            thread = threading.current_thread().name
            timeline._append((self._name, self._buffer, self._step, thread, self._start, end, self._detail))
        if self._range is not None:
            self._range.__exit__(*exc_info)
        timeline._local.buffer = self._outer


def chrome_trace(events: Iterable[Event]) -> dict[str, Any]:
    """Events of any number of ranks in the Chrome trace event format: one process per rank, one
    track per thread, spans as complete events and marks as instants (times in microseconds)."""
    trace: list[dict[str, Any]] = []
    threads: dict[tuple[int, str], int] = {}
    for event in events:
        key = (event.rank, event.thread)
        if key not in threads:
            threads[key] = len(threads) + 1
            trace.append({"ph": "M", "name": "thread_name", "pid": event.rank, "tid": threads[key], "args": {"name": event.thread}})
        record = {
            "name": range_name(event.name, event.buffer) if not event.is_mark else f"ssfusion.{event.name}",
            "cat": "ssfusion",
            "pid": event.rank,
            "tid": threads[key],
            "ts": event.start_ns / 1000,
            "args": {k: v for k, v in asdict(event).items() if k in ("buffer", "step", "detail") and v is not None},
        }
        if event.is_mark:
            record.update(ph="i", s="p")
        else:
            record.update(ph="X", dur=(event.end_ns - event.start_ns) / 1000)
        trace.append(record)
    ranks = sorted({rank for rank, _ in threads})
    trace.extend({"ph": "M", "name": "process_name", "pid": r, "args": {"name": f"rank {r}"}} for r in ranks)
    return {"traceEvents": trace, "displayTimeUnit": "ms"}
