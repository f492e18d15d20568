"""One training job from a composed config: ``run(cfg) -> results``.

``run`` is independent of the command line: ``ssfusion-train`` (ssfusion_lightning.cli) calls it
inside a Hydra job, and tests call it with a config from ``compose_config`` on ranks that already
share a process group (a Trainer with ``devices=<world size>`` then joins that group).
"""

from __future__ import annotations

import json
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import lightning as L
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig

import ssfusion_lightning  # noqa: F401 - registers the strategy names with Lightning
from ssfusion_lightning.app import RESULTS_FILE
from ssfusion_lightning.app.builders import (
    build_callbacks,
    build_datamodule,
    build_loggers,
    build_strategy,
    build_task,
    plain,
)
from ssfusion_lightning.app.callbacks import CommunicationStats, ResultsWriter, SamplesPerSecond, write_json
from ssfusion_lightning.app.validation import ConfigError, check_loggers, check_trainer


def build_trainer(
    config: Mapping[str, Any], strategy: Any, job: Mapping[str, Any] | None = None
) -> L.Trainer:
    """The Trainer of a resolved config, with the application's callbacks (throughput, communication, results)."""
    output_dir = Path(config["paths"]["output_dir"])
    check_trainer(config["trainer"])
    check_loggers(config.get("logger"))
    loggers = build_loggers(config.get("logger"))
    callbacks = build_callbacks(config.get("callbacks"), has_logger=bool(loggers))
    callbacks += [
        SamplesPerSecond(**(config.get("throughput") or {})),
        CommunicationStats(),
        ResultsWriter(output_dir, config, job),
    ]
    trainer_kwargs = dict(config["trainer"])
    trainer_kwargs.setdefault("default_root_dir", str(output_dir))
    return L.Trainer(
        **trainer_kwargs,
        strategy=strategy,
        logger=loggers or False,
        callbacks=callbacks,
    )


#: what building a job's objects raises for a config they cannot be built from
BUILD_ERRORS = (ValueError, TypeError, FileNotFoundError, MisconfigurationException)
T = TypeVar("T")


def _built(part: str, build: Callable[[], T]) -> T:
    """``build()``; a config it cannot build from is a ConfigError naming ``part`` of the config.

    Every part is built before any rank is launched, so a bad value stops the job with one message.
    """
    try:
        return build()
    except ConfigError:
        raise
    except BUILD_ERRORS as error:
        raise ConfigError(f"{part}: {error}") from error


def run(
    cfg: DictConfig | Mapping[str, Any], job: Mapping[str, Any] | None = None, multirun: bool = False
) -> dict[str, Any]:
    """Train (and optionally test) the configured job; returns its results (the content of results.json).

    ``job`` describes the Hydra job (name, overrides, directories) for results.json; ``multirun``
    makes ``strategy.start_method=auto`` spawn the ranks (see docs/cli.md). Global rank 0 writes
    ``<paths.output_dir>/results.json``; a failed job writes one with ``status: failed`` and re-raises.
    """
    config: dict[str, Any] = plain(cfg)
    output_dir = Path(config["paths"]["output_dir"])
    results_path = output_dir / RESULTS_FILE
    trainer: L.Trainer | None = None
    try:
        if config.get("seed") is not None:
            L.seed_everything(config["seed"], workers=True, verbose=False)
        datamodule = _built("data", lambda: build_datamodule(config["data"]))
        task = _built("model", lambda: build_task(config["model"], datamodule))
        strategy = _built("strategy", lambda: build_strategy(config, multirun=multirun))
        trainer = _built("trainer", lambda: build_trainer(config, strategy, job))
        trainer.fit(task, datamodule=datamodule, ckpt_path=config.get("ckpt_path"))
        if config.get("test_after_fit"):
            trainer.test(task, datamodule=datamodule)
    except BaseException as error:
        if rank_zero_only.rank == 0:
            write_json(
                results_path,
                {
                    "status": "failed",
                    "name": config.get("name"),
                    "job": dict(job or {}),
                    "error": "".join(traceback.format_exception(error)),
                    "config": config,
                },
            )
        raise
    writer = next(c for c in trainer.callbacks if isinstance(c, ResultsWriter))
    if writer.results:
        return writer.results
    # Under the spawn launcher this process is no rank: rank 0 wrote the results file.
    return json.loads(results_path.read_text()) if results_path.exists() else {}


def format_results(results: Mapping[str, Any]) -> str:
    """A short human-readable report of a job's results."""

    def number(value: Any, unit: str = "") -> str:
        if value is None:
            return "n/a"
        if isinstance(value, float):
            return f"{value:,.4g}{unit}"
        return f"{value}{unit}"

    status, steps, world = results.get("status"), results.get("global_step"), results.get("world_size")
    lines = [f"status: {status}  steps: {steps}  world size: {world}"]
    for key, value in (results.get("final_metrics") or {}).items():
        lines.append(f"  {key:<28} {number(value)}")
    comm = results.get("communication") or {}
    lines += [
        f"  {'samples/s':<28} {number(results.get('samples_per_sec'))}",
        f"  {'bytes sent/step (rank)':<28} {number(results.get('bytes_sent_per_step'))}",
        f"  {'dense-equivalent bytes/step':<28} {number(results.get('dense_equivalent_bytes_per_step'))}",
        f"  {'compression ratio':<28} {number(comm.get('compression_ratio'), 'x')}",
    ]
    return "\n".join(lines)
