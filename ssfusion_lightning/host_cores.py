"""Which ranks share a host's cores, from the kernel and the CPU affinity instead of a clock.

A rank whose host runs at least as many ranks as the cores they may run on has no spare core:
during the backward every core runs some rank's main thread, so work on a second thread of the
rank (an offloaded selection, a channel's collective) is taken from the backward, a serial CPU
share of 1. Timed, that took 0.6-0.7 s of a 4-rank run's first steps on 2 cores and measured
0.96-1.00 (experiments/REPORT.md, "Start-up and epoch ends"). Where the
table cannot tell (a spare core may exist, or the platform has no boot id or affinity), the
engine times it (``costmodel.measure_serial_cpu``).

Ranks count as one host's when they run on one kernel (the same boot id): network namespaces and
containers do not hide that they share cores, and CPU ids are the kernel's on every one of them.
A CPU quota only lowers the cores a rank may use, so leaving it out errs to the timed side.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist

BOOT_ID = Path("/proc/sys/kernel/random/boot_id")
#: bits of a CPU mask word: 62, so that no word reaches int64's sign bit
MASK_BITS = 62
#: mask words a rank sends: CPU ids up to 16 x 62 - 1 = 991; a rank on a higher one is not known
MASK_WORDS = 16


class RankCores(NamedTuple):
    #: the rank's kernel (a hash of its boot id), None where unknown
    host: int | None
    #: the CPU ids the rank may run on
    cores: frozenset[int]


def local_cores() -> RankCores:
    """This process's kernel and CPU affinity (host None where either is not known here)."""
    try:
        boot_id = BOOT_ID.read_bytes().strip()
        cores = frozenset(os.sched_getaffinity(0))
    except (OSError, AttributeError):  # no procfs, or no sched_getaffinity (macOS, Windows)
        return RankCores(None, frozenset())
    if not cores or max(cores) >= MASK_BITS * MASK_WORDS:
        return RankCores(None, frozenset())
    return RankCores(int(hashlib.sha256(boot_id).hexdigest()[:15], 16), cores)


def encode(rank: RankCores) -> list[int]:
    """[known, host, mask words...]: a fixed length, so that one allgather carries every rank's."""
    words = [0] * MASK_WORDS
    for core in rank.cores:
        words[core // MASK_BITS] |= 1 << (core % MASK_BITS)
    return [int(rank.host is not None), rank.host or 0, *words]


def decode(values: list[int]) -> RankCores:
    known, host, *words = values
    if not known:
        return RankCores(None, frozenset())
    cores = frozenset(w * MASK_BITS + bit for w, word in enumerate(words) for bit in range(MASK_BITS) if word >> bit & 1)
    return RankCores(host, cores)


def gather_cores(group: dist.ProcessGroup | None, device: torch.device) -> list[RankCores]:
    """Every rank's ``local_cores``, in rank order of ``group``, identical on every rank."""
    mine = torch.tensor(encode(local_cores()), dtype=torch.int64, device=device)
    table = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(table, mine, group=group)
    return [decode(row.tolist()) for row in table]


def lacks_spare_core(table: list[RankCores], rank: int) -> bool:
    """Whether ``rank``'s cores are all held by ranks: the ranks on its host whose affinity meets
    its own number at least the cores they may run on together."""
    host, cores = table[rank]
    if host is None:
        return False
    sharing = [other.cores for other in table if other.host == host and other.cores & cores]
    return len(sharing) >= len(frozenset().union(*sharing))


def every_rank_lacks_spare_core(table: list[RankCores]) -> bool:
    """True where no rank has a spare core. The table is the same on every rank, so is the answer:
    every rank skips the timed probe, or none does (it runs barriers)."""
    return all(lacks_spare_core(table, rank) for rank in range(len(table)))
