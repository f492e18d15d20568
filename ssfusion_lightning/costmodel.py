"""Online cost model: backward time per tensor, compression cost, alpha-beta links.

Measured during the first profiling rounds on every rank, agreed across ranks (elementwise max,
so every rank holds the same numbers) and then frozen: cost-driven fusion policies plan from it,
so every rank computes the same plan. No per-model tables, no model-name rules.
"""

from __future__ import annotations

import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from ssfusion_lightning.commcost import POSITION_BYTES, BufferShape, Link, Links, buffer_seconds, ring_allreduce_bytes


@dataclass(frozen=True)
class CostProfile:
    #: backward seconds attributed to each parameter (gap before its gradient became ready)
    backward: dict[str, float] = field(default_factory=dict)
    compress_fixed: float = 20e-6
    compress_per_element: float = 4e-9
    allreduce: Link = Link(50e-6, 1e-9)
    allgather: Link = Link(50e-6, 1e-9)
    world_size: int = 2
    measured: bool = False
    #: CPU seconds one more buffer costs (its pack and launch on the main thread, its collective's
    #: work on a channel thread): on a rank with few cores it is taken from the backward
    buffer_overhead: float = 0.0
    #: how far the ranks' selections spread (see ``commcost.expected_nonzeros``): 1 for independent
    #: selections (the assumption until measured), 0 when every rank selects the same positions
    selection_spread: float = 1.0
    #: allgather alpha-beta on the node-local and on the cross-node groups (hierarchical layouts;
    #: the defaults until measured)
    node_link: Link = Link(50e-6, 1e-9)
    cross_link: Link = Link(50e-6, 1e-9)
    #: the share of another thread's CPU work that delays the main thread (``measure_serial_cpu``):
    #: 0 with a free core beside the backward, 1 with one core per rank, where an offloaded
    #: selection or a channel thread's collective is taken from the backward
    serial_cpu: float = 0.0
    #: the plan trial measured whole dense steps at most as long as sparse ones (``engine/trial.py``):
    #: comm=auto's fallback then sends every buffer dense
    dense_measured_faster: bool = False
    #: the trial measured the cost cut's tensors in one buffer at most as slow as the cut's buffers
    #: (the mean of the cut's windows before and after it):
    #: the auto cut then makes one buffer (per dtype)
    fused_measured_faster: bool = False

    def compress_seconds(self, numel: int) -> float:
        return self.compress_fixed + self.compress_per_element * numel

    def dense_seconds(self, numel: int, element_size: int) -> float:
        """Ring allreduce of ``numel`` elements: the link moves 2(P-1)/P of the bytes."""
        return self.allreduce.seconds(ring_allreduce_bytes(numel * element_size, self.world_size))

    def sparse_seconds(self, count: int, element_size: int) -> float:
        """Allgather of ``count`` (value, position) pairs per rank: (P-1) * count pairs arrive."""
        p = self.world_size
        return self.allgather.seconds((p - 1) * count * (element_size + POSITION_BYTES)) if p > 1 else 0.0

    def allgather_buffer_seconds(self, dense: int, sparse: int, sent: int, element_size: int) -> float:
        """A buffer of ``dense`` + ``sparse`` elements, ``sent`` of them selected per rank, on the
        allgather collectives (``allgather``, ``hybrid``, auto's allgather): the dense part rides
        in the allgather's message while it is small (``commcost.dense_rides``), and pays an
        all-reduce of its own otherwise."""
        shape = BufferShape(dense, sparse, sent, element_size)
        return buffer_seconds("allgather", shape, Links.measured(self.world_size, self.allreduce, self.allgather))

    def backward_seconds(self, name: str) -> float:
        return self.backward.get(name, 0.0)


def fit_line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least-squares intercept and slope, both clamped at >= 0 (costs are never negative)."""
    n = len(xs)
    if n == 0:
        return 0.0, 0.0
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var > 0 else 0.0
    slope = max(slope, 0.0)
    return max(my - slope * mx, 0.0), slope


def fit_per_size_medians(samples: Sequence[tuple[int, float]]) -> tuple[float, float]:
    """``fit_line`` through the median time of each size among (size, seconds) samples.

    A rank that shares its core with other ranks is now and then descheduled for a whole time slice
    in the middle of a selection. Least squares through such raw samples took that wait for the
    cost (a 4-rank run on 2 cores: 5-9 ms per selection, with no growth in size), while the median
    of a size's repeats keeps the selection's own time as long as most repeats ran undisturbed."""
    by_size: dict[int, list[float]] = {}
    for numel, seconds in samples:
        by_size.setdefault(numel, []).append(seconds)
    sizes = sorted(by_size)
    return fit_line([float(n) for n in sizes], [statistics.median(by_size[n]) for n in sizes])


def line_through(small: tuple[float, float], large: tuple[float, float]) -> tuple[float, float]:
    """Intercept and slope of the line through two (bytes, seconds) points, clamped at >= 0."""
    (x0, y0), (x1, y1) = small, large
    slope = max((y1 - y0) / (x1 - x0), 0.0) if x1 > x0 else 0.0
    return max(y0 - slope * x0, 0.0), slope


class Profiler:
    """Collects one rank's raw timings across the profiling rounds."""

    def __init__(self, names: Sequence[str]) -> None:
        self.names = list(names)
        self.backward = {n: [] for n in self.names}
        self.compress: list[tuple[int, float]] = []
        self.launches: list[float] = []
        self._last_ready: float | None = None

    def begin_backward(self) -> None:
        self._last_ready = time.perf_counter()

    def ready(self, name: str) -> None:
        now = time.perf_counter()
        if self._last_ready is not None:
            self.backward[name].append(now - self._last_ready)
        self._last_ready = now

    def resume(self) -> None:
        """The backward goes on after work the engine did on its thread between two gradients."""
        self._last_ready = time.perf_counter()

    def compressed(self, numel: int, seconds: float) -> None:
        self.compress.append((numel, seconds))

    def compressed_together(self, numels: Sequence[int], seconds: float) -> None:
        """Tensors compressed in one batch whose cost is per element: each is reported its share of
        the batch's time by size, so the compression line charges each what it cost in the batch."""
        total = sum(numels)
        for numel in numels:
            self.compressed(numel, seconds * numel / max(1, total))

    def launched(self, seconds: float) -> None:
        """A buffer's pack and launch on the main thread."""
        self.launches.append(seconds)

    def local_vector(self, job_cpu_seconds: float = 0.0) -> list[float]:
        """Median backward time per tensor, the compression line's intercept and slope, then the
        buffer overhead: the median launch plus ``job_cpu_seconds`` (a collective's CPU time)."""
        medians = []
        for n in self.names:
            samples = sorted(self.backward[n])
            medians.append(samples[len(samples) // 2] if samples else 0.0)
        fixed, per_element = fit_per_size_medians(self.compress)
        launches = sorted(self.launches)
        launch = launches[len(launches) // 2] if launches else 0.0
        return medians + [fixed, per_element, launch + job_cpu_seconds]


#: a link whose warm-up (a quarter of the large message, agreed over the ranks) takes longer
#: than this is slow: each large message is timed once, at half its size, not ``repeats`` times.
#: On a slow link the repeats were most of a short run's start-up (six 1 MB messages, 1.2 s at
#: 40 Mbit/s and P = 4), and at that length a repeat removes less noise (a few ms of scheduling)
#: than it costs. 5 ms for 256 KB is about 50 MB/s (400 Mbit/s); a shaper's burst makes the
#: warm-up faster than the link, so links somewhat slower than that may still count as fast.
SLOW_WARM_UP_SECONDS = 0.005
#: the warm-up's share of the large message: enough to empty a shaper's burst (128 KiB on the
#: emulated links) and to open a TCP window after idle
WARM_UP_FRACTION = 4


def measure_links(
    collectives: Sequence[str], group: dist.ProcessGroup | None, device: torch.device,
    sizes=(1 << 10, 1 << 20), repeats: int = 3,
) -> dict[str, Link]:
    """Time each of ``collectives`` at a small and a large message and take alpha-beta as the line
    through the two medians: the latency from the small one, the rate from the large one. ``sizes``
    are the bytes each rank moves over the link (the first and last are used), so the probe costs
    the same at any P: an allgather's message per rank is size / (P - 1), an all-reduce's
    size P / 2(P - 1). (With 1 MB per rank, an allgather probe moved (P - 1) MB: 3 MB per repeat at
    P = 4, 1.7 s of a 4-rank 40 Mbit/s run's first steps, and 255 MB at P = 256.)

    The large messages follow one untimed warm-up of the first collective's, a quarter of their
    size: the first large message after an idle link is not the link's rate (on the emulated
    40 Mbit/s link it took 196 ms against 220 ms for every later one: the shaper's bucket passes
    its first 128 KiB at once; a TCP connection restarting after idle goes the other way). Its
    time, agreed over the ranks, also sets how the large messages are timed: above
    ``SLOW_WARM_UP_SECONDS`` (a slow link) once each at half the size, which still spans about
    0.1 s at 40 Mbit/s; below it ``repeats`` times at the full size.

    A least-squares line through several sizes is led by the largest and loses the latency (on the
    40 Mbit/s emulated link at P = 4: alpha 0-1.6 ms against 3.9 ms measured directly, changing run
    to run), and a token-bucket shaper or a switch's buffers pass mid-size messages faster than the
    link's rate, which no line fits."""
    world = dist.get_world_size(group)

    def probe_once(collective: str, size: int) -> float:
        tensor = torch.zeros(probe_elements(collective, size, world), dtype=torch.float32, device=device)
        gathered = [torch.empty_like(tensor) for _ in range(world)] if collective == "allgather" else []
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        if collective == "allreduce":
            dist.all_reduce(tensor, group=group)
        else:
            dist.all_gather(gathered, tensor, group=group)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - start

    def probe_median(collective: str, size: int, count: int) -> tuple[float, float]:
        samples = sorted(probe_once(collective, size) for _ in range(count))
        nbytes = 4 * probe_elements(collective, size, world)
        moved = ring_allreduce_bytes(nbytes, world) if collective == "allreduce" else (world - 1) * nbytes
        return moved, samples[len(samples) // 2]

    small, large = sizes[0], sizes[-1]
    smalls = {collective: probe_median(collective, small, repeats) for collective in collectives}
    warm_up = torch.tensor([probe_once(collectives[0], large // WARM_UP_FRACTION)], dtype=torch.float64, device=device)
    dist.all_reduce(warm_up, op=dist.ReduceOp.MAX, group=group)
    slow = float(warm_up) > SLOW_WARM_UP_SECONDS
    timed, count = (large // 2, 1) if slow else (large, repeats)
    return {
        collective: Link(*line_through(smalls[collective], probe_median(collective, timed, count)))
        for collective in collectives
    }


def measure_link(collective: str, group: dist.ProcessGroup | None, device: torch.device) -> Link:
    """``measure_links`` of one collective."""
    return measure_links((collective,), group, device)[collective]


def probe_elements(collective: str, moved: int, world: int) -> int:
    """float32 elements per rank of a ``collective`` probe in which every rank moves about
    ``moved`` bytes over the link (at least one element)."""
    peers = max(1, world - 1)
    per_rank = moved * world / (2 * peers) if collective == "allreduce" else moved / peers
    return max(1, round(per_rank / 4))


def measure_serial_cpu(
    work_elements: int = 1 << 18, repeats: int = 5, sync: Callable[[], None] | None = None, phase_seconds: float = 0.02
) -> float:
    """The share of a second thread's CPU work that delays this thread: the same torch work (which
    releases the GIL) timed alone and then on two threads at once. 0 when the second thread ran on
    a free core, 1 when the two took turns on one. Ranks that share a host's cores must time their
    phases at the same moment to see each other's load, as they do while training: ``sync`` (a
    barrier of the ranks, called the same number of times on each) runs before every timed phase,
    and each phase does enough work to last ``phase_seconds`` alone, longer than the ranks' skew
    after a barrier. Without both, a fast host's probe (under 1 ms a phase) ran on one rank while the
    other waited, every rank found a free core, and P = 2 on 2 cores offloaded in 4 of 6 overlap
    cells (experiments/REPORT.md, "The serial CPU probe times every rank at once")."""
    # not torch.randn: the probe runs beside training and must not draw from the global generator
    source = torch.linspace(-1.0, 1.0, work_elements)
    # one output per thread: writing one shared tensor from two cores would pass its cache lines
    # back and forth, and a free core would look busy
    outs = (torch.empty_like(source), torch.empty_like(source))
    barrier = sync if sync is not None else (lambda: None)

    def work(out: Tensor, passes: int) -> None:
        for _ in range(passes):
            torch.abs(source, out=out)

    def alone(passes: int) -> float:
        started = time.perf_counter()
        work(outs[0], passes)
        return time.perf_counter() - started

    passes = 8
    while alone(passes) < phase_seconds and passes < 1 << 16:  # local: no barrier, so every rank calls sync alike
        passes *= 2
    shares = []
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="ssfusion-cpu-probe") as pool:
        pool.submit(work, outs[1], 1).result()  # the thread exists before anything is timed
        for _ in range(repeats):
            barrier()
            by_itself = alone(passes)
            barrier()
            started = time.perf_counter()
            beside = pool.submit(work, outs[1], passes)
            work(outs[0], passes)
            beside.result()
            together = time.perf_counter() - started
            shares.append(min(1.0, max(0.0, together / max(by_itself, 1e-9) - 1.0)))
    return sorted(shares)[len(shares) // 2]


def barrier_of(group: dist.ProcessGroup | None, device: torch.device) -> Callable[[], None]:
    """A barrier of ``group``'s ranks that returns once every rank has entered it (a one-element
    all-reduce, read back so that a device collective has finished too)."""

    def barrier() -> None:
        token = torch.zeros(1, device=device)
        dist.all_reduce(token, group=group)
        token.item()

    return barrier


def agree(
    local: list[float],
    names: Sequence[str],
    links: dict[str, Link],
    world_size: int,
    group: dist.ProcessGroup | None,
    device: torch.device,
    selection_spread: float = 1.0,
    serial_cpu: float = 0.0,
) -> CostProfile:
    """Elementwise max over ranks of every measured number, so all ranks hold the same profile
    (for the selections' spread and the serial CPU share the max is the cautious side: more
    nonzeros in the sums, less work hidden on other threads).
    ``links`` holds "allreduce" and "allgather", and "node" and "cross" on hierarchical layouts."""
    defaults = CostProfile()
    node, cross = links.get("node", defaults.node_link), links.get("cross", defaults.cross_link)
    values = local + [links["allreduce"].alpha, links["allreduce"].beta, links["allgather"].alpha, links["allgather"].beta]
    values += [selection_spread, node.alpha, node.beta, cross.alpha, cross.beta, serial_cpu]
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_initialized() and world_size > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    agreed = tensor.tolist()
    n = len(names)
    return CostProfile(
        backward=dict(zip(names, agreed[:n])),
        compress_fixed=agreed[n],
        compress_per_element=agreed[n + 1],
        buffer_overhead=agreed[n + 2],
        allreduce=Link(agreed[n + 3], agreed[n + 4]),
        allgather=Link(agreed[n + 5], agreed[n + 6]),
        selection_spread=agreed[n + 7],
        node_link=Link(agreed[n + 8], agreed[n + 9]),
        cross_link=Link(agreed[n + 10], agreed[n + 11]),
        serial_cpu=agreed[n + 12],
        world_size=world_size,
        measured=True,
    )
