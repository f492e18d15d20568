"""How long the cost model's one-time probes take on the emulated cluster: the links' alpha-beta
(``costmodel.measure_links``), the ranks' cores table that stands in for the CPU probe where no rank
has a spare core (``host_cores``), and the timed serial CPU share (``costmodel.measure_serial_cpu``),
three times, printed by rank 0. The CPU probe's phase length and repeats come from the environment
(PHASE seconds, default 0.02; REPEATS, default 5), to see what a shorter probe would measure.

    python -m experiments.cluster run --nodes 4 --rate 40mbit -q -- env PHASE=0.02 REPEATS=5 python -m experiments.probe_cost
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

from ssfusion_lightning.costmodel import barrier_of, measure_links, measure_serial_cpu
from ssfusion_lightning.host_cores import every_rank_lacks_spare_core, gather_cores


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    group = dist.new_group()
    device = torch.device("cpu")
    phase, repeats = float(os.environ.get("PHASE", "0.02")), int(os.environ.get("REPEATS", "5"))
    for rep in range(3):
        dist.barrier(group)
        started = time.perf_counter()
        measure_links(("allreduce", "allgather"), group, device)
        linked = time.perf_counter()
        no_spare_core = every_rank_lacks_spare_core(gather_cores(group, device))
        tabled = time.perf_counter()
        share = measure_serial_cpu(sync=barrier_of(group, device), phase_seconds=phase, repeats=repeats)
        ended = time.perf_counter()
        if dist.get_rank() == 0:
            print(
                f"rep {rep}: links {1e3 * (linked - started):.0f} ms, cores table {1e3 * (tabled - linked):.1f} ms "
                f"(no spare core: {no_spare_core}), timed serial cpu {1e3 * (ended - tabled):.0f} ms (share {share:.2f})",
                flush=True,
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
