"""What a new user meets first: the import, the packaged configs, a user's own configs, the README
snippet outside a process group, the hint for a dataset that is not there.

The wheel itself (installed without extras into a fresh venv, run from another directory) is
checked by .ci/run, not here: it needs a venv and a network-free pip install that takes minutes.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import ssfusion_lightning as ssf
from ssfusion_lightning.app.config import CONFIG_DIR_ENV, config_dir
from ssfusion_lightning.data import build_datamodule

REPO = Path(__file__).resolve().parents[1]
PRESETS = ["adtopk", "oktopk", "safusion", "ssfusion", "ssfusion_spawn", "zen"]


def python(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def test_import_is_light_and_still_registers_the_strategies_with_lightning(tmp_path):
    """`import ssfusion_lightning` loads neither torch nor Lightning, and Lightning, loaded after it,
    knows the strategy names; the public names load on first use."""
    code = f"""
import sys
import ssfusion_lightning as ssf
print(sorted(m for m in ("torch", "lightning") if m in sys.modules))
from lightning.pytorch.strategies import StrategyRegistry
print(sorted(name for name in {PRESETS!r} if name in StrategyRegistry))
print(ssf.SSFusionStrategy.__module__)
"""
    done = python("-c", code, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["[]", str(PRESETS), "ssfusion_lightning.strategy"]


def test_unknown_public_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="has no attribute 'SparseStrategy'"):
        ssf.SparseStrategy  # noqa: B018


def test_configs_are_package_data_and_the_top_level_conf_links_to_them(monkeypatch, tmp_path):
    monkeypatch.delenv(CONFIG_DIR_ENV, raising=False)
    packaged = Path(ssf.__file__).resolve().parent / "conf"
    assert config_dir() == packaged and (packaged / "train.yaml").is_file()
    assert (REPO / "conf").resolve() == packaged
    monkeypatch.setenv(CONFIG_DIR_ENV, str(tmp_path))
    assert config_dir() == tmp_path.resolve()


def test_a_users_config_dir_adds_options(tmp_path):
    """``--config-dir`` adds a directory of the user's to the search path (docs/cli.md): its files
    become group options beside the packaged ones."""
    mine = tmp_path / "mine" / "experiment"
    mine.mkdir(parents=True)
    (mine / "my-run.yaml").write_text("# @package _global_\nname: my-run\ntrainer:\n  max_steps: 7\n")
    done = python(
        "-m", "ssfusion_lightning.cli", "--config-dir", str(tmp_path / "mine"), "experiment=my-run", "--cfg", "job",
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert "name: my-run" in done.stdout and "max_steps: 7" in done.stdout


@pytest.mark.skipif(dist.is_available() and dist.is_initialized(), reason="needs a process without a process group")
def test_sparse_allreduce_outside_a_process_group_says_what_to_do():
    """The README snippet run as is, in a plain Python session."""
    values, indices = torch.ones(3), torch.tensor([0, 4, 7])
    with pytest.raises(RuntimeError, match=r"call torch\.distributed\.init_process_group\(\.\.\.\) on every rank"):
        ssf.sparse_allreduce(values, indices, 10, scheme="zen")


@pytest.mark.parametrize(
    "name, expected",
    [
        ("cifar10", "cifar-10-batches-py/data_batch_1"),
        ("cifar100", "cifar-100-python/train"),
        ("mnist", "train-images-idx3-ubyte"),
        ("wikitext2", "wikitext-2-raw/wiki.train.raw"),
        ("imagenet", "train/<class>/<image>"),
    ],
)
def test_a_missing_dataset_names_the_files_and_does_not_suggest_the_path_given(tmp_path, name, expected):
    root = tmp_path / "nonexistent"
    with pytest.raises(FileNotFoundError) as caught:
        build_datamodule(name, root=str(root))
    message = str(caught.value)
    assert f"{root}/{expected}" in message
    assert f"data.root={root}" not in message and f"paths.data_dir={root}" not in message
