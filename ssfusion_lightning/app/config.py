"""Where the configs live, and composing a config without the command line."""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from importlib import resources
from pathlib import Path

from omegaconf import DictConfig

CONFIG_NAME = "train"
CONFIG_DIR_ENV = "SSFUSION_CONFIG_DIR"
#: conf/<this>.yaml: the base of every ssfusion strategy preset, generated from SSFusionStrategy's
#: signature (ssfusion_lightning/app/options.py); not a group, so ``--help`` does not offer it as a strategy
STRATEGY_BASE = "ssfusion_strategy"


def packaged_config_dir() -> Path:
    """The configs shipped inside the package (``ssfusion_lightning/conf``, package data)."""
    # pip installs the package as files on disk (never zipped), so the resource is a real directory
    # that Hydra can search.
    return Path(str(resources.files("ssfusion_lightning") / "conf"))


def config_dir() -> Path:
    """The root config directory: ``$SSFUSION_CONFIG_DIR`` if set, else the configs shipped inside the
    package (``ssfusion_lightning/conf``, package data; the repository's top-level ``conf`` links to it)."""
    override = os.environ.get(CONFIG_DIR_ENV)
    if override:
        return Path(override).expanduser().resolve()
    return packaged_config_dir()


def compose_config(overrides: Sequence[str] | Iterable[str] = (), directory: Path | str | None = None) -> DictConfig:
    """Compose ``train.yaml`` with command-line style ``overrides`` (no output directory, no Hydra run).

    For tests and notebooks: pass ``paths.output_dir=<dir>`` since ``${hydra:runtime.output_dir}``
    only exists inside a Hydra run.
    """
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    directory = Path(directory).resolve() if directory is not None else config_dir()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(directory), version_base="1.3"):
        return compose(config_name=CONFIG_NAME, overrides=list(overrides))
