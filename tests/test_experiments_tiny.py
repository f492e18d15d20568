"""Every experiment preset composes, and every tiny twin trains end to end on 2 CPU ranks and visibly
learns in its default steps.

The tiny twins run inside the session's rank pool (no process start per experiment): the config is
composed here with Hydra's compose API, and ``ssfusion_lightning.train.run`` joins the pool's gloo
group. One test runs the real command line (2 ranks launched by Lightning's popen launcher).
"""

from __future__ import annotations

import csv
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

import ssfusion_lightning as ssf
from ssfusion_lightning.app.config import compose_config, config_dir

REPO = Path(__file__).resolve().parents[1]
EXPERIMENTS = config_dir() / "experiment"
TINY = sorted(p.stem for p in EXPERIMENTS.glob("*-tiny.yaml"))
PAPER = sorted(p.stem for p in EXPERIMENTS.glob("*.yaml") if not p.stem.endswith("-tiny"))
SEEDS_WORKLOADS = {
    "resnet152-imagenet",
    "vgg19-imagenet",
    "resnet50-cifar100",
    "bert-large",
    "gpt2-large",
    "vit-large",
    "lstm-wikitext2",
}
# one validation batch, no checkpoint, CSV logs only
QUIET = [
    "trainer.limit_val_batches=1",
    "trainer.enable_checkpointing=false",
    "trainer.enable_progress_bar=false",
    "trainer.enable_model_summary=false",
    "callbacks=none",
    "logger=csv",
]
# and 2 optimizer steps
FAST = ["trainer.max_steps=2", "trainer.limit_train_batches=2", *QUIET]
# A tiny twin is a demo: in its default steps its training loss falls by at least this fraction.
LEARNS = 0.12
COMPONENT_GROUPS = ("sparsifier", "fusion", "comm")


def _available(group: str) -> list[str]:
    return {
        "sparsifier": ssf.available_sparsifiers,
        "fusion": ssf.available_fusion_policies,
        "comm": ssf.available_communicators,
    }[group]()


def test_every_seed_workload_has_a_paper_size_preset_and_a_tiny_twin():
    assert set(PAPER) == SEEDS_WORKLOADS
    assert TINY == sorted(f"{name}-tiny" for name in PAPER)


@pytest.mark.parametrize("name", PAPER)
def test_paper_size_preset_composes_for_gpus(name):
    cfg = compose_config([f"experiment={name}", "paths.output_dir=/tmp/unused"])
    assert cfg.name == name
    assert cfg.trainer.accelerator == "gpu"
    assert cfg.model.size != "tiny"
    assert cfg.strategy.kind == "ssfusion"
    assert not cfg.data.name.startswith("synthetic")  # the real dataset
    OmegaConf.to_container(cfg, resolve=True)  # every interpolation resolves


def _run_in_rank(config: dict) -> dict:
    from ssfusion_lightning.train import run

    return run(config)


@pytest.mark.parametrize("name", [None, *PAPER, *TINY], ids=lambda name: name or "default")
def test_every_experiment_names_registered_components(name):
    """A component an experiment names must be registered: nothing stands in for a missing one."""
    cfg = compose_config([*([f"experiment={name}"] if name else []), "paths.output_dir=unused"])
    for group in COMPONENT_GROUPS:
        assert cfg[group].name in _available(group), f"{name or 'default'}: {group} {cfg[group].name!r} is not registered"


@pytest.mark.parametrize("name", TINY)
def test_tiny_twin_trains_and_learns_on_two_ranks(name, pool2, tmp_path):
    """Each tiny twin runs its default steps on 2 ranks, and its training loss (logged every step)
    falls visibly: the mean of the last 3 steps is at most (1 - LEARNS) times the first step's."""
    # a fixed buffer cap: under buffer_mb="auto" the plan (and selective's dense/sparse split with it)
    # follows the timings measured on this host, and a 30-step loss check must not depend on them
    overrides = [
        f"experiment={name}", f"paths.output_dir={tmp_path}", "trainer.log_every_n_steps=1", "strategy.buffer_mb=25", *QUIET
    ]
    cfg = compose_config(overrides)
    assert cfg.model.size == "tiny" and cfg.trainer.devices == 2
    steps = cfg.trainer.max_steps
    results = pool2.run(_run_in_rank, OmegaConf.to_container(cfg, resolve=True), timeout=600)

    rank0 = results[0]
    assert rank0["status"] == "completed"
    assert rank0["world_size"] == 2 and rank0["global_step"] == steps
    assert rank0["name"] == name
    written = json.loads((tmp_path / "results.json").read_text())
    assert written["global_step"] == steps and written["config"]["name"] == name
    metrics = written["final_metrics"]
    assert "train/loss" in metrics and "val/loss" in metrics
    assert all(isinstance(v, float) and v == v for v in (metrics["train/loss"], metrics["val/loss"]))
    comm = written["communication"]
    assert comm["source"] == "ssfusion" and comm["steps"] == steps
    assert 0 < written["bytes_sent_per_step"] < written["dense_equivalent_bytes_per_step"]
    assert written["samples_per_sec"] > 0

    with open(tmp_path / "csv" / "metrics.csv") as handle:
        losses = [float(row["train/loss"]) for row in csv.DictReader(handle) if row.get("train/loss")]
    assert len(losses) == steps
    # the median of the last 5: a deep twin at lr 0.1 has single-step spikes (resnet152's reached 3x
    # the loss around them, before and after issue 15's density changes), which a mean of the last 3
    # can land on
    last = statistics.median(losses[-5:])
    assert last <= (1 - LEARNS) * losses[0], f"{name}: loss {losses[0]:.3f} -> {last:.3f} in {steps} steps"


def test_dense_ddp_baseline_reports_ring_allreduce_bytes_and_test_metrics(pool2, tmp_path):
    overrides = ["experiment=gpt2-large-tiny", "strategy=ddp", "test_after_fit=true", "trainer.limit_test_batches=1"]
    cfg = compose_config([*overrides, f"paths.output_dir={tmp_path}", *FAST])
    rank0 = pool2.run(_run_in_rank, OmegaConf.to_container(cfg, resolve=True), timeout=240)[0]
    comm = rank0["communication"]
    assert comm["source"] == "ddp_ring_allreduce_estimate"
    # world size 2: a ring all-reduce sends 2(P-1)/P = 1 times the parameter bytes
    assert rank0["bytes_sent_per_step"] == rank0["dense_equivalent_bytes_per_step"] == comm["parameter_bytes"]
    written = json.loads((tmp_path / "results.json").read_text())
    assert {"test/loss", "test/ppl", "val/ppl"} <= set(written["final_metrics"])


def test_a_failed_job_writes_its_error(tmp_path):
    from ssfusion_lightning.train import run

    cfg = compose_config(["model=gpt2", "data=synthetic_images", f"paths.output_dir={tmp_path}"])
    with pytest.raises(ValueError, match="not a language model|does not classify images"):
        run(cfg)
    written = json.loads((tmp_path / "results.json").read_text())
    assert written["status"] == "failed" and "ValueError" in written["error"]
    assert written["config"]["model"]["name"] == "gpt2"


def test_command_line_single_job_on_two_ranks(tmp_path):
    """The real entry point: rank 1 is started by Lightning's popen launcher re-running the command."""
    run_dir = tmp_path / "run"
    command = [
        sys.executable,
        "-m",
        "ssfusion_lightning.cli",
        f"hydra.run.dir={run_dir}",
        *[o for o in FAST if o != "logger=csv"],
        "logger=many",
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]

    results = json.loads((run_dir / "results.json").read_text())
    assert results["status"] == "completed" and results["world_size"] == 2 and results["global_step"] == 2
    assert results["job"]["mode"] == "run" and results["job"]["output_dir"] == str(run_dir)
    assert results["config"]["strategy"]["name"] == "ssfusion"
    assert results["dense_equivalent_bytes_per_step"] > 0
    assert "samples/s" in done.stdout and "results.json" in done.stdout
    assert (run_dir / "csv" / "metrics.csv").exists()
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    # rank 1 re-ran the command into the same directory, not a sweep or a second run dir
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]
