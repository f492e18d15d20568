from __future__ import annotations

import pytest
import torch

from tests.rank_pool import RankPool


def pytest_runtest_setup(item: pytest.Item) -> None:
    # Every test draws the same random tensors on every run, so a statistical assertion
    # either always holds or always fails; a hook rather than a fixture keeps hypothesis's
    # function-scoped-fixture health check quiet.
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def rank_pools():
    pools: dict[int, RankPool] = {}

    def get(world_size: int) -> RankPool:
        if world_size not in pools:
            pools[world_size] = RankPool(world_size)
        return pools[world_size]

    yield get
    for pool in pools.values():
        pool.close()


@pytest.fixture
def pool2(rank_pools) -> RankPool:
    return rank_pools(2)


@pytest.fixture
def pool3(rank_pools) -> RankPool:
    return rank_pools(3)


@pytest.fixture
def pool4(rank_pools) -> RankPool:
    return rank_pools(4)
