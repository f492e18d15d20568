"""The ``ssfusion-train`` command line: groups, presets, strategy building, sweeps under multi-process DDP.

The subprocess tests run ``python -m ssfusion_lightning.cli`` (what the ``ssfusion-train`` console
script calls) in a temporary directory; the config-level tests compose in this process.
"""

from __future__ import annotations

import csv
import inspect
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

import ssfusion_lightning as ssf
from ssfusion_lightning.app import validation
from ssfusion_lightning.app.builders import build_strategy, resolve_start_method
from ssfusion_lightning.app.config import compose_config, config_dir
from ssfusion_lightning.app.sweep import write_summary
from ssfusion_lightning.app.validation import ConfigError, check_config
from ssfusion_lightning.presets import SYSTEM_PRESETS

REPO = Path(__file__).resolve().parents[1]
#: what an unknown key under strategy. lists
STRATEGY_KEYS = ", ".join(validation.STRATEGY_KEYS + validation.SSFUSION_OPTIONS)
GROUPS = ("model", "data", "sparsifier", "fusion", "comm", "strategy", "trainer", "logger", "callbacks")
GROUPS += ("experiment", "hparams_search")
FUSION_POLICIES = ("layerwise", "behind", "ahead", "aligned", "adaptive", "selective", "partial")
ABLATIONS = {
    # name: (sparsifier, fusion, comm, offload)
    "ssfusion_naive": ("dgc", "selective", "allgather", "none"),
    "ssfusion_o": ("dgc", "selective", "allgather", "auto"),
    "ssfusion_i": ("dgc", "selective", "hybrid", "none"),
    "safusion_saf": ("dgc", "ahead", "allgather", "none"),
    "safusion_inter": ("dgc", "aligned", "allgather", "none"),
    "safusion_inter_intra": ("dgc", "adaptive", "allgather", "none"),
    "adtopk_only": ("adtopk", "ahead", "allgather", "none"),
    "adtopk_interleaved": ("adtopk_interleaved", "ahead", "allgather", "none"),
    "adtopk_partial": ("adtopk_interleaved", "partial", "allgather", "none"),
    "adtopk_hybrid": ("adtopk_interleaved", "partial", "hybrid", "none"),
    "layerwise": ("dgc", "layerwise", "allgather", "none"),
    "behind": ("dgc", "behind", "allgather", "none"),
}


# Runs the command line like `python -m ssfusion_lightning.cli`, and at exit writes which of torch
# and Lightning it had imported into the file named by its first argument.
TRACED_CLI = """
import atexit, runpy, sys
report = sys.argv.pop(1)
loaded = lambda: " ".join(name for name in ("torch", "lightning") if name in sys.modules)
atexit.register(lambda: open(report, "w").write(loaded()))
runpy.run_module("ssfusion_lightning.cli", run_name="__main__", alter_sys=True)
"""


def cli(
    *args: str, cwd: Path, timeout: float = 120, env: dict[str, str] | None = None, trace: Path | None = None
) -> subprocess.CompletedProcess:
    """``python -m ssfusion_lightning.cli *args``; with ``trace``, that file gets the heavy modules it imported."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        **(env or {}),
    }
    command = [sys.executable, "-c", TRACED_CLI, str(trace)] if trace else [sys.executable, "-m", "ssfusion_lightning.cli"]
    return subprocess.run([*command, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def compose(*overrides: str):
    return compose_config([*overrides, "paths.output_dir=unused"])


# ---------------------------------------------------------------- the command line
def test_help_lists_every_group_and_its_options(tmp_path, tmp_path_factory):
    trace = tmp_path_factory.mktemp("trace") / "imported"
    done = cli("--help", cwd=tmp_path, trace=trace)
    assert done.returncode == 0, done.stderr
    assert trace.read_text() == ""  # answered before torch or Lightning loads
    lines = {line.split(":")[0]: line for line in done.stdout.splitlines() if ": " in line}
    for group in GROUPS:
        assert group in lines, f"--help does not list the {group} group"
    for policy in FUSION_POLICIES:
        assert policy in lines["fusion"]
    for preset in ("ddp", *SYSTEM_PRESETS.keys() - {"ssfusion_spawn"}, *ABLATIONS):
        assert preset in lines["strategy"].split(": ")[1].split(", ")
    assert "resnet152-imagenet-tiny" in lines["experiment"]
    assert "ddp_cpu" in lines["trainer"]
    assert lines["logger"].split(": ")[1].split(", ") == ["csv", "many", "none", "tensorboard"]
    assert "ssfusion-train -m" in done.stdout  # the examples
    assert list(tmp_path.iterdir()) == []  # --help runs no job


def test_misspelled_group_option_fails_listing_the_valid_choices(tmp_path):
    done = cli("sparsifier=topkk", cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr == (
        "ssfusion-train: error: invalid value sparsifier=topkk; valid: one of "
        f"{', '.join(sorted(ssf.available_sparsifiers()))}\n"
    )
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["strategy.density=0"], "invalid value strategy.density=0; valid: a number with 0 < density <= 1"),
        (["strategy.buffer_mb=-1"], "invalid value strategy.buffer_mb=-1; valid: auto, or a number of MiB > 0"),
        (["strategy.offload=bogus"], "invalid value strategy.offload=bogus; valid: one of none, thread, stream, auto"),
        (["trainer.devices=0"], "invalid value trainer.devices=0; valid: a number of processes >= 1, or auto"),
        (
            ["strategy.densty=0.1"],
            # the keys in the order of SSFusionStrategy's signature (validation reads them from the base config)
            f"unknown key strategy.densty; valid keys of strategy: {STRATEGY_KEYS}; a new key is added with a "
            "leading +: +strategy.densty=0.1",
        ),
    ],
)
def test_a_bad_value_gets_one_message_before_torch_loads(tmp_path, overrides, message):
    """Exit status 2 and one line naming the key, the value and what is valid: no traceback, no
    Hydra "Error executing job" line; answered before torch or Lightning is imported (the time it
    takes: experiments/bench_cli_latency.py)."""
    trace = tmp_path / "imported"
    done = cli(*overrides, cwd=tmp_path, trace=trace)
    assert done.returncode == 2, done.stderr
    assert done.stderr == f"ssfusion-train: error: {message}\n"
    assert trace.read_text() == ""


def test_hydra_full_error_shows_the_traceback(tmp_path):
    done = cli("strategy.density=0", cwd=tmp_path, env={"HYDRA_FULL_ERROR": "1"})
    assert done.returncode != 0
    assert "Traceback (most recent call last)" in done.stderr
    assert "ConfigError: invalid value strategy.density=0" in done.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_gpu_trainer_on_a_cpu_only_machine_is_refused_before_launch(tmp_path):
    done = cli("trainer=gpu", cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr.startswith("ssfusion-train: error: invalid value trainer.accelerator=gpu; valid: cpu on this")
    assert "torch.cuda.is_available() is False" in done.stderr and "trainer=ddp_cpu" in done.stderr
    assert done.stderr.count("\n") == 1


def test_a_missing_dataset_is_one_message_naming_the_expected_files(tmp_path):
    """Lightning loads for this one (the dataset is looked for when the job is built); still one message."""
    missing = tmp_path / "nonexistent"
    done = cli("data=cifar10", f"paths.data_dir={missing}", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path, timeout=600)
    assert done.returncode == 2
    assert done.stderr.startswith(f"ssfusion-train: error: data: CIFAR-10 not found: expected {missing}/cifar-10-batches-py/")
    assert done.stderr.count("\n") == 1
    assert f"data.root={missing}" not in done.stderr and f"paths.data_dir={missing}" not in done.stderr


def test_multirun_sweep_on_two_ranks_per_job(tmp_path):
    """Lightning's popen launcher would re-run ``-m ...`` in rank 1 and start a second sweep; under a
    multirun the ranks are spawned instead, so the sweep has exactly its 4 jobs and one summary."""
    sweep = tmp_path / "sweep"
    done = cli(
        "-m",
        "sparsifier=topk,none",
        "fusion=ahead,layerwise",
        "comm=allgather",
        f"hydra.sweep.dir={sweep}",
        "trainer.max_steps=2",
        "trainer.limit_train_batches=2",
        "trainer.limit_val_batches=1",
        "trainer.enable_checkpointing=false",
        "trainer.enable_progress_bar=false",
        "trainer.enable_model_summary=false",
        "callbacks=none",
        "logger=csv",
        cwd=tmp_path,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]

    assert sorted(p.name for p in tmp_path.iterdir()) == ["sweep"]  # no stray outputs/ or multirun dirs
    jobs = sorted(p for p in sweep.iterdir() if p.is_dir())
    assert [p.name for p in jobs] == ["0", "1", "2", "3"]
    assert sorted(p.name for p in sweep.iterdir() if p.is_file()) == ["multirun.yaml", "summary.csv", "summary.md"]
    assert len(list(tmp_path.rglob("results.json"))) == 4
    assert len(list(tmp_path.rglob("multirun.yaml"))) == 1  # no job started a sweep of its own
    assert sorted(p.name for p in tmp_path.rglob("summary.*")) == ["summary.csv", "summary.md"]

    combos = set()
    for job in jobs:
        results = json.loads((job / "results.json").read_text())
        assert results["status"] == "completed" and results["world_size"] == 2 and results["global_step"] == 2
        assert results["job"]["mode"] == "multirun" and results["job"]["output_dir"] == str(job)
        assert results["config"]["strategy"]["start_method"] == "auto"
        combos.add((results["config"]["sparsifier"]["name"], results["config"]["fusion"]["name"]))
        assert results["dense_equivalent_bytes_per_step"] > 0
    assert combos == {("topk", "ahead"), ("topk", "layerwise"), ("none", "ahead"), ("none", "layerwise")}

    with open(sweep / "summary.csv") as handle:
        rows = list(csv.DictReader(handle))
    assert [row["job"] for row in rows] == ["0", "1", "2", "3"]
    assert {(row["sparsifier"], row["fusion"]) for row in rows} == combos
    for row in rows:
        assert row["overrides"] == f"sparsifier={row['sparsifier']} fusion={row['fusion']}"
        assert float(row["samples_per_sec"]) > 0 and float(row["bytes_sent_per_step"]) > 0
        expected = 1.0 if row["sparsifier"] == "none" else 5.0
        assert float(row["compression_ratio"]) >= expected
    assert (sweep / "summary.md").read_text().count("\n| ") == 1 + 4  # header + one row per job


# ---------------------------------------------------------------- presets and groups (composed here)
def test_fusion_group_has_one_yaml_per_policy():
    for policy in FUSION_POLICIES:
        assert OmegaConf.load(config_dir() / "fusion" / f"{policy}.yaml") == {"name": policy}


@pytest.mark.parametrize("name", sorted(SYSTEM_PRESETS.keys() - {"ssfusion_spawn"}))
def test_system_preset_configs_match_the_registered_strategies(name):
    cfg = compose(f"strategy={name}")
    preset = SYSTEM_PRESETS[name][1]
    assert cfg.strategy.name == name and cfg.strategy.kind == "ssfusion"
    assert (cfg.sparsifier.name, cfg.fusion.name, cfg.comm.name, cfg.strategy.offload) == (
        preset["sparsifier"],
        preset["fusion"],
        preset["comm"],
        preset["offload"],
    )


@pytest.mark.parametrize("name", sorted(ABLATIONS))
def test_ablation_presets(name):
    cfg = compose(f"strategy={name}")
    assert (cfg.sparsifier.name, cfg.fusion.name, cfg.comm.name, cfg.strategy.offload) == ABLATIONS[name]


def test_command_line_groups_win_over_the_strategy_preset():
    cfg = compose("strategy=safusion", "sparsifier=topk", "comm=hybrid")
    assert (cfg.sparsifier.name, cfg.fusion.name, cfg.comm.name) == ("topk", "adaptive", "hybrid")
    cfg = compose("experiment=gpt2-large-tiny", "strategy=zen", "fusion=ahead")
    assert (cfg.model.name, cfg.strategy.name, cfg.comm.name) == ("gpt2", "zen", "zen")


def test_default_job_is_two_cpu_ranks_with_ssfusion_on_a_tiny_model():
    cfg = compose()
    assert cfg.trainer.accelerator == "cpu" and cfg.trainer.devices == 2
    assert cfg.strategy.name == "ssfusion" and cfg.model.size == "tiny"
    assert cfg.data.name.startswith("synthetic") and 0 < cfg.trainer.max_steps <= 300


def test_strategy_built_from_the_groups():
    cfg = compose("strategy=safusion_saf", "sparsifier=topk", "strategy.density=0.05", "strategy.process_groups=1")
    strategy = build_strategy(cfg)
    assert isinstance(strategy, ssf.SSFusionStrategy)
    assert (strategy.sparsifier_spec, strategy.fusion_name, strategy.comm_name) == ("topk", "ahead", "allgather")
    assert (strategy.density, strategy.process_groups, strategy.offload) == (0.05, 1, "none")
    assert strategy._start_method == "popen"
    assert build_strategy(cfg, multirun=True)._start_method == "spawn"


def test_sparsifier_options_build_an_instance_with_the_strategy_density():
    cfg = compose("strategy=safusion_saf", "sparsifier=dgc", "sparsifier.max_adjust=2", "strategy.density=0.02")
    spec = build_strategy(cfg).sparsifier_spec
    assert isinstance(spec, ssf.sparsifiers.Sparsifier)
    assert spec.density == 0.02 and spec.max_adjust == 2


def test_communicator_options_reach_the_strategy():
    strategy = build_strategy(compose("strategy=zen", "sparsifier=topk", "fusion=ahead", "comm.options.profile_rounds=9"))
    assert strategy.comm_name == "zen"
    assert strategy.comm_options["profile_rounds"] == 9
    assert strategy.comm_options["choice"] == "auto"


def test_reliability_and_memory_options_reach_the_strategy():
    cfg = compose("strategy=ssfusion", "strategy.nonfinite=skip", "strategy.timeout=90", "strategy.memory=dgc",
                  "+strategy.memory_options.momentum=0.5")
    strategy = build_strategy(cfg)
    assert strategy.nonfinite == "skip"
    assert strategy._timeout.total_seconds() == 90
    assert (strategy.memory_name, strategy.memory_options) == ("dgc", {"momentum": 0.5})
    assert build_strategy(compose("strategy=ssfusion"))._timeout == ssf.SSFusionStrategy()._timeout  # null: torch's default


def test_first_buffer_cap_reaches_the_strategy_and_null_means_buffer_mb():
    assert build_strategy(compose("strategy=ssfusion", "strategy.first_buffer_mb=1")).first_buffer_mb == 1.0
    assert build_strategy(compose("strategy=ssfusion")).first_buffer_mb is None


@pytest.mark.parametrize(
    "override, message",
    [
        ("+strategy.nonfinte=skip", f"unknown key strategy.nonfinte; valid keys of strategy: {STRATEGY_KEYS}"),
        ("strategy.timeout=0", "invalid value strategy.timeout=0; valid: a number of seconds > 0, or null"),
        ("strategy.nonfinite=ignore", "invalid value strategy.nonfinite=ignore; valid: one of raise, skip"),
        ("strategy.first_buffer_mb=-1", "invalid value strategy.first_buffer_mb=-1; valid: a number of MiB > 0, or null"),
        ("strategy.buffer_mb=nan", "invalid value strategy.buffer_mb=nan; valid: auto, or a number of MiB > 0"),
        ("strategy.density=1.5", "invalid value strategy.density=1.5; valid: a number with 0 < density <= 1"),
        ("strategy.process_groups=0", "invalid value strategy.process_groups=0; valid: an integer >= 1"),
        ("strategy.warmup_steps=-1", "invalid value strategy.warmup_steps=-1; valid: an integer >= 0"),
        ("strategy.memory=ef", "invalid value strategy.memory=ef; valid: one of adam, auto, dgc, none, residual"),
        ("strategy.start_method=threads", "invalid value strategy.start_method=threads; valid: one of auto, popen"),
        ("strategy.broadcast_buffers=maybe", "invalid value strategy.broadcast_buffers=maybe; valid: true or false"),
    ],
)
def test_bad_strategy_options_are_named(override, message):
    cfg = compose("strategy=ssfusion", override)
    with pytest.raises(ConfigError, match=re.escape(message)):
        check_config(cfg)
    with pytest.raises(ConfigError, match=re.escape(message)):  # a config composed in Python: the same message
        build_strategy(cfg)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["trainer=cpu", "trainer.devices=-1"], "invalid value trainer.devices=-1; valid: a number of processes >= 1"),
        (["trainer.devices=[0,1]"], "invalid value trainer.devices=[0,1]; valid: a number of processes >= 1, or auto"),
        (["trainer.num_nodes=0"], "invalid value trainer.num_nodes=0; valid: an integer >= 1"),
    ],
)
def test_bad_trainer_values_are_named(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        check_config(compose(*overrides))


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["strategy.memory=adam"], "strategy.memory=adam computes AdamW's step, but model.optimizer=sgd"),
        (
            ["model=gpt2", "data=synthetic_tokens", "strategy.memory=adam", "trainer.gradient_clip_val=0.5"],
            "set trainer.gradient_clip_val=null and +strategy.memory_options.clip_norm=0.5",
        ),
    ],
)
def test_what_adam_memory_cannot_take_is_refused_before_launch(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        check_config(compose(*overrides))


def test_adam_memory_trains_a_language_model_from_the_command_line(tmp_path):
    """The Hydra path: the task's fused AdamW and its schedule are handed to the memory. In a process
    of its own: a job run in this one would leave its process group and MASTER_PORT behind."""
    done = cli(
        "trainer=cpu", "model=gpt2", "data=synthetic_tokens", "strategy.memory=adam", "+strategy.memory_options.feedback=0.9",
        "trainer.max_steps=3", "logger=none", "callbacks=none", f"paths.output_dir={tmp_path}", cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["status"] == "completed", results


def test_lightning_misconfigurations_are_config_errors_before_launch(tmp_path):
    """What the light checks let through, Lightning refuses when the Trainer is built: still a
    ConfigError naming the part, raised before any rank is launched."""
    from ssfusion_lightning.train import run

    cfg = compose_config(["trainer=cpu", "trainer.precision=bogus", "logger=none", f"paths.output_dir={tmp_path}"])
    with pytest.raises(ConfigError, match=r"^trainer: .*Precision 'bogus' is invalid"):
        run(cfg)
    assert json.loads((tmp_path / "results.json").read_text())["status"] == "failed"


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["model=gpt2", "data=synthetic_tokens", "strategy.memory=adam", "+strategy.memory_options.feedback=2"],
            "strategy: feedback is the fraction of the unsent part kept for the next round, a number in (0, 1], got 2",
        ),
        # the default strategy is the ssfusion preset, whose memory="auto" picks its memory from the optimizer
        (
            ["+strategy.memory_options.momentum=0.9"],
            "strategy: memory 'auto' has no option 'momentum'; its options: feedback (the memory it picks depends on the "
            "optimizer: name the memory, e.g. memory='dgc', to set its other options)",
        ),
        (
            ["strategy.memory=residual", "+strategy.memory_options.momentum=0.9"],
            "strategy: memory 'residual' has no option 'momentum'; its options: feedback",
        ),
    ],
)
def test_bad_memory_options_are_config_errors_before_launch(tmp_path, overrides, message):
    from ssfusion_lightning.train import run

    cfg = compose_config(["trainer=cpu", "logger=none", "callbacks=none", f"paths.output_dir={tmp_path}", *overrides])
    with pytest.raises(ConfigError, match=re.escape(message)):
        run(cfg)


def test_the_light_checks_know_the_same_choices_as_the_strategy():
    """app.validation repeats a few choices so that checking them loads no torch; they must not drift."""
    from ssfusion_lightning.engine.engine import NONFINITE_POLICIES
    from ssfusion_lightning.sparsifiers import MEMORIES
    from ssfusion_lightning.sparsifiers.memory_choice import AUTO
    from ssfusion_lightning.strategy import OFFLOAD_CHOICES

    assert validation.OFFLOAD_CHOICES == OFFLOAD_CHOICES
    assert validation.NONFINITE_CHOICES == tuple(NONFINITE_POLICIES)
    assert list(validation.MEMORY_CHOICES) == sorted([*MEMORIES.names(), AUTO])
    assert set(validation.SSFUSION_OPTIONS) <= set(inspect.signature(ssf.SSFusionStrategy).parameters)


@pytest.mark.parametrize("group", ["sparsifier", "fusion", "comm"])
def test_every_registered_component_has_its_yaml(group):
    """The command line lists a group's options from its yaml files (without importing torch)."""
    listing = {
        "sparsifier": ssf.available_sparsifiers,
        "fusion": ssf.available_fusion_policies,
        "comm": ssf.available_communicators,
    }
    assert sorted(p.stem for p in (config_dir() / group).glob("*.yaml")) == sorted(listing[group]())


def test_dense_baseline_is_lightnings_ddp():
    cfg = compose("strategy=ddp")
    assert build_strategy(cfg) == "ddp"
    assert build_strategy(cfg, multirun=True) == "ddp_spawn"
    assert resolve_start_method("auto", multirun=False) == "popen"
    with pytest.raises(ConfigError, match="valid: one of auto, popen, spawn"):
        resolve_start_method("threads", multirun=False)


def test_grid_search_preset_is_a_basic_sweeper_multirun():
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        overrides = ["hparams_search=density_sparsifier", "paths.output_dir=x"]
        cfg = hydra_compose("train", overrides, return_hydra_config=True)
    assert str(cfg.hydra.mode) == "RunMode.MULTIRUN"
    assert set(cfg.hydra.sweeper.params) == {"strategy.density", "sparsifier"}
    assert cfg.hydra.callbacks.sweep_summary._target_ == "ssfusion_lightning.app.sweep.SweepSummary"


def test_summary_of_a_sweep_dir(tmp_path):
    for num, (sparsifier, status) in enumerate([("topk", "completed"), ("dgc", "failed")]):
        results = {
            "status": status,
            "job": {"overrides": [f"sparsifier={sparsifier}", "trainer.max_steps=2"]},
            "config": {
                "strategy": {"name": "ssfusion", "kind": "ssfusion", "density": 0.01},
                "sparsifier": {"name": sparsifier},
            },
            "final_metrics": {"val/loss": 1.5, "perf/samples_per_sec": 3.0} if status == "completed" else {},
            "bytes_sent_per_step": 10.0,
            "communication": {"compression_ratio": 50.0},
        }
        if status == "failed":
            results["error"] = "Traceback...\nValueError: boom"
        (tmp_path / str(num)).mkdir()
        (tmp_path / str(num) / "results.json").write_text(json.dumps(results))
    csv_path, md_path = write_summary(tmp_path)
    rows = list(csv.DictReader(open(csv_path)))
    assert [(r["job"], r["overrides"], r["status"]) for r in rows] == [
        ("0", "sparsifier=topk", "completed"),
        ("1", "sparsifier=dgc", "failed"),
    ]
    assert rows[0]["val/loss"] == "1.5" and "perf/samples_per_sec" not in rows[0]
    assert rows[1]["error"] == "ValueError: boom"
    assert write_summary(tmp_path / "0" / "nothing") is None
