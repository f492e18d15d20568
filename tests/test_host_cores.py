"""The serial CPU share read from the ranks' hosts and affinities (ssfusion_lightning/host_cores.py)."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from ssfusion_lightning.host_cores import (
    MASK_BITS,
    MASK_WORDS,
    RankCores,
    decode,
    encode,
    every_rank_lacks_spare_core,
    lacks_spare_core,
    local_cores,
)

UNKNOWN = RankCores(None, frozenset())


@given(
    host=st.integers(1, (1 << 60) - 1),
    cores=st.frozensets(st.integers(0, MASK_BITS * MASK_WORDS - 1), min_size=1, max_size=64),
)
def test_a_rank_row_decodes_to_what_was_encoded(host, cores):
    row = encode(RankCores(host, cores))
    assert len(row) == 2 + MASK_WORDS and all(0 <= value < 1 << 63 for value in row)
    assert decode(row) == RankCores(host, cores)


def test_an_unknown_rank_decodes_as_unknown():
    assert decode(encode(UNKNOWN)) == UNKNOWN


def test_this_machine_is_known():
    mine = local_cores()
    if not hasattr(os, "sched_getaffinity"):
        pytest.skip("no CPU affinity on this platform")
    assert mine.host is not None and mine.cores == frozenset(os.sched_getaffinity(0))


def both(*cores):
    return frozenset(cores)


@pytest.mark.parametrize(
    ("table", "verdicts"),
    [
        # 4 ranks on a 2-core host, as the emulated cluster's: no spare core anywhere
        ([RankCores(1, both(0, 1))] * 4, [True] * 4),
        # 2 ranks on 2 cores: each backward holds one
        ([RankCores(1, both(0, 1))] * 2, [True, True]),
        # one rank on 2 cores: the second may be free
        ([RankCores(1, both(0, 1))], [False]),
        # two ranks each pinned to a core of its own
        ([RankCores(1, both(0)), RankCores(1, both(1))], [True, True]),
        # two hosts of 2 cores, a rank on each: the same CPU ids, other kernels
        ([RankCores(1, both(0, 1)), RankCores(2, both(0, 1))], [False, False]),
        # a chain of overlapping affinities: 2 ranks may use 3 cores around the first
        ([RankCores(1, both(0, 1)), RankCores(1, both(1, 2)), RankCores(1, both(2, 3))], [False, False, False]),
        # a rank the table cannot place is never taken as lacking a core
        ([RankCores(1, both(0)), UNKNOWN], [True, False]),
    ],
)
def test_a_rank_lacks_a_spare_core_where_ranks_hold_every_core_it_may_use(table, verdicts):
    assert [lacks_spare_core(table, rank) for rank in range(len(table))] == verdicts
    assert every_rank_lacks_spare_core(table) == all(verdicts)


def gathered_cores():
    import torch.distributed as dist

    from ssfusion_lightning.host_cores import gather_cores

    return gather_cores(None, torch.device("cpu")), local_cores(), dist.get_rank()


def test_every_rank_gathers_the_same_table_in_rank_order(pool2):
    results = pool2.run(gathered_cores)
    tables = [table for table, _, _ in results]
    assert tables[0] == tables[1]
    for table, mine, rank in results:
        assert table[rank] == mine


def agreed_serial_share(table_hosts: list[int]) -> tuple[float, int]:
    """The engine's agreed serial CPU share where the ranks' table is ``table_hosts`` (a host per
    rank, of two cores), and how often the timed probe ran."""
    import torch.distributed as dist

    from ssfusion_lightning.engine import engine as engine_module
    from tests.test_auto_cut import auto_plan_run

    timed = []

    def fake_probe(**_):
        timed.append(1)
        return 0.25

    def fake_table(group, device):
        return [RankCores(host, frozenset({0, 1})) for host in table_hosts]

    saved = engine_module.measure_serial_cpu, engine_module.gather_cores, engine_module.FusionEngine._agree_costs
    shares = []

    def recording(self, group):
        costs = saved[2](self, group)
        shares.append(costs.serial_cpu)
        return costs

    engine_module.measure_serial_cpu, engine_module.gather_cores = fake_probe, fake_table
    engine_module.FusionEngine._agree_costs = recording
    try:
        auto_plan_run(steps=4)
    finally:
        engine_module.measure_serial_cpu, engine_module.gather_cores, engine_module.FusionEngine._agree_costs = saved
    dist.barrier()
    return shares[0], len(timed)


def test_the_engine_times_the_share_only_where_a_rank_may_have_a_spare_core(pool2):
    # both ranks on one 2-core host: the share is 1, and no rank times it
    assert pool2.run(agreed_serial_share, [7, 7]) == [(1.0, 0), (1.0, 0)]
    # a rank per 2-core host: each may have a spare core, so every rank times it
    assert pool2.run(agreed_serial_share, [7, 8]) == [(0.25, 1), (0.25, 1)]
