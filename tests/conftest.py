from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.rank_pool import RankPool

REPO = Path(__file__).resolve().parents[1]
# What test tools keep in the working directory (all in .gitignore), and git's own.
TOOL_DIRS = {".git", ".pytest_cache", ".hypothesis", ".ruff_cache", "__pycache__"}
_TREE_BEFORE = pytest.StashKey[set]()


def _tree(root: Path) -> set[Path]:
    """Every file and folder under ``root``, test tools' caches aside."""
    found = set()
    for directory, folders, files in os.walk(root):
        folders[:] = [f for f in folders if f not in TOOL_DIRS and not f.endswith(".egg-info")]
        found.update(Path(directory, name) for name in (*folders, *files))
    return found


def pytest_sessionstart(session: pytest.Session) -> None:
    session.config.stash[_TREE_BEFORE] = _tree(REPO)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    # Tests write into temporary directories only: a Trainer without default_root_dir, for one,
    # would leave checkpoints/ or lightning_logs/ in the working directory.
    stray = sorted(str(p.relative_to(REPO)) for p in _tree(REPO) - session.config.stash[_TREE_BEFORE])
    if stray:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        reporter.write_line(f"tests wrote into the repository instead of a temporary directory: {', '.join(stray)}")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


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
