"""``ssfusion-train``: the Hydra command line (config root ``train.yaml`` in ``ssfusion_lightning/conf``).

    ssfusion-train                                        # the default job: 2 CPU ranks, ssfusion, tiny ResNet
    ssfusion-train experiment=resnet152-imagenet-tiny     # a seed workload's tiny twin
    ssfusion-train -m sparsifier=topk,dgc fusion=ahead,selective   # a sweep, one summary table
    ssfusion-train --help                                 # the config groups and their options

Every job writes ``results.json`` into its Hydra output directory; a sweep also writes
``summary.csv`` and ``summary.md`` into its sweep directory. See docs/cli.md.

This module loads neither torch nor Lightning before the config is checked
(ssfusion_lightning.app.validation): ``--help`` and a bad value are answered at once. A bad value
exits with status 2 and one message naming the key, the value and what is valid; set
``HYDRA_FULL_ERROR=1`` for the traceback instead.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import warnings
from typing import Any, NoReturn

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException, MissingConfigException
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from ssfusion_lightning.app.config import CONFIG_NAME, config_dir
from ssfusion_lightning.app.validation import ConfigError, check_config

FULL_ERROR_ENV = "HYDRA_FULL_ERROR"
CONFIG_ERROR_STATUS = 2
# HYDRA_FULL_ERROR as the user set it: main() sets it for Hydra's sake (see there), and ranks that
# Lightning launches inherit that, which is harmless: a config error stops the job before any launch.
_USERS_FULL_ERROR = os.environ.get(FULL_ERROR_ENV)
_tracebacks = _USERS_FULL_ERROR == "1"


def _drop_tip(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith("💡 Tip:")


def quiet_third_party() -> None:
    """Hide Lightning's advertising tips and a deprecation inside Lightning that users cannot act on.

    Every other warning and Lightning's own information (devices, model summary) stays.
    """
    # Lightning 2.6 builds a LeafSpec on every rank, which torch 2.13 deprecates: nothing a user can change.
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated", category=FutureWarning)
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        logging.getLogger(name).addFilter(_drop_tip)


# At import, not in main(): ranks started by the spawn launcher import this module and never call main().
quiet_third_party()


def job_info() -> dict[str, Any]:
    """The running Hydra job, as recorded in results.json."""
    hc = HydraConfig.get()
    multirun = hc.mode == RunMode.MULTIRUN
    return {
        "name": hc.job.name,
        "mode": hc.mode.name.lower(),
        "num": hc.job.get("num") if multirun else None,
        "overrides": list(hc.overrides.task),
        "output_dir": hc.runtime.output_dir,
        "sweep_dir": hc.sweep.dir if multirun else None,
    }


@hydra.main(config_path=str(config_dir()), config_name=CONFIG_NAME, version_base="1.3")
def task(cfg: DictConfig) -> dict[str, Any]:
    """The Hydra task: check the config, then (only then) load torch and Lightning and run the job."""
    try:
        check_config(cfg)
        from lightning.pytorch.utilities import rank_zero_only

        from ssfusion_lightning.train import format_results, run

        # Lightning loads after Hydra has set up the job's logging, so its records reach Hydra's
        # handlers (the console and <job>.log) besides Lightning's own console handler: every
        # line would print twice. Hydra's handlers alone keep them, in the job's log too.
        logging.getLogger("lightning").handlers.clear()

        job = job_info()
        # Resolve here: ${hydra:...} interpolations only resolve in the process that runs the Hydra job,
        # and spawned ranks are other processes.
        OmegaConf.resolve(cfg)
        results = run(cfg, job=job, multirun=job["mode"] == "multirun")
    except ConfigError as error:
        if _tracebacks:
            raise
        # Not an exception Hydra catches: Hydra would add its own "Error executing job" line.
        exit_with_config_error(str(error))
    if rank_zero_only.rank == 0:
        print(f"\n== {cfg.get('name')}: results in {job['output_dir']}/results.json")
        print(format_results(results))
    return results


def _unknown_key(error: HydraException, cause: OmegaConfBaseException) -> str:
    """A misspelled key given without ``+``: the key, and the valid keys beside it."""
    key = cause.full_key
    parent = key.rpartition(".")[0]
    # not Hydra's own keys: its group (hydra) and what instantiate reads (_target_, ...)
    keys = [k for k in (cause.parent_node or {}) if k != "hydra" and not re.fullmatch(r"_\w+_", str(k))]
    override = re.search(r"use (\+\S+)", str(error))
    add = f"; a new key is added with a leading +: {override.group(1)}" if override else ""
    if not keys:
        return f"unknown key {key}: {parent} has no keys{add}"
    where = f"of {parent}" if parent else "at the top level"
    return f"unknown key {key}; valid keys {where}: {', '.join(map(str, keys))}{add}"


def explain(error: BaseException) -> str | None:
    """One message for an error of Hydra's or OmegaConf's in the command line; None for anything else."""
    if isinstance(error, MissingConfigException) and error.missing_cfg_file and error.options:
        group, _, option = error.missing_cfg_file.rpartition("/")
        return f"invalid value {group}={option}; valid: one of {', '.join(error.options)}"
    cause = error.__cause__
    if (
        isinstance(error, HydraException)
        and isinstance(cause, OmegaConfBaseException)
        and str(error).startswith("Could not override")
        and cause.full_key
    ):
        return _unknown_key(error, cause)
    if isinstance(error, (HydraException, OmegaConfBaseException)):
        # Hydra appends its config search path to some messages: noise for a user.
        message = str(error).split("\nConfig search path:")[0].strip()
        return f"{message}\n{cause}" if isinstance(cause, OmegaConfBaseException) else message
    return None


def exit_with_config_error(message: str) -> NoReturn:
    print(f"ssfusion-train: error: {message}", file=sys.stderr)
    raise SystemExit(CONFIG_ERROR_STATUS)


def main() -> None:
    """The ``ssfusion-train`` console script."""
    # Hydra raises its errors, instead of printing them itself, when HYDRA_FULL_ERROR=1: they reach
    # `explain`, which adds what Hydra's own text lacks (the valid keys beside a misspelled one).
    os.environ[FULL_ERROR_ENV] = "1"
    try:
        task()
    except Exception as error:
        message = None if _tracebacks else explain(error)
        if message is None:
            raise
        exit_with_config_error(message)
    finally:
        if _USERS_FULL_ERROR is None:
            del os.environ[FULL_ERROR_ENV]
        else:
            os.environ[FULL_ERROR_ENV] = _USERS_FULL_ERROR


if __name__ == "__main__":
    main()
