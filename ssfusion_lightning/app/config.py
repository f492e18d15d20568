"""Where the configs live, registry-backed fallback options, and composing a config without the CLI."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable, Sequence

from omegaconf import DictConfig

#: Config groups whose options mirror a registry of the package (one ``<name>.yaml`` per registered name).
REGISTRY_GROUPS = ("sparsifier", "fusion", "comm")
CONFIG_NAME = "train"
CONFIG_DIR_ENV = "SSFUSION_CONFIG_DIR"


def config_dir() -> Path:
    """The root config directory: ``$SSFUSION_CONFIG_DIR`` if set, else the repository's ``conf/``."""
    override = os.environ.get(CONFIG_DIR_ENV)
    if override:
        return Path(override).expanduser().resolve()
    return Path(__file__).resolve().parents[2] / "conf"


def _registry_names(group: str) -> list[str]:
    import ssfusion_lightning as ssf

    listing = {
        "sparsifier": ssf.available_sparsifiers,
        "fusion": ssf.available_fusion_policies,
        "comm": ssf.available_communicators,
    }[group]
    return listing()


def register_fallback_configs(directory: Path | None = None) -> list[str]:
    """Make every registered sparsifier, fusion policy and communicator selectable as a group option.

    A name with a ``conf/<group>/<name>.yaml`` uses that file (its keys are the documented options);
    a registered name without one gets a fallback option ``{name: <name>}`` (constructor defaults) in
    Hydra's ConfigStore, so a new registry entry is usable from the command line at once. Files and
    fallbacks never share a name: Hydra would merge the two. Returns the ``group/name`` fallbacks.
    """
    from hydra.core.config_store import ConfigStore

    directory = directory or config_dir()
    store = ConfigStore.instance()
    added = []
    for group in REGISTRY_GROUPS:
        for name in _registry_names(group):
            if (directory / group / f"{name}.yaml").exists():
                continue
            store.store(group=group, name=name, node={"name": name}, provider="ssfusion_lightning registry")
            added.append(f"{group}/{name}")
    return added


def compose_config(overrides: Sequence[str] | Iterable[str] = (), directory: Path | str | None = None) -> DictConfig:
    """Compose ``train.yaml`` with command-line style ``overrides`` (no output directory, no Hydra run).

    For tests and notebooks: pass ``paths.output_dir=<dir>`` since ``${hydra:runtime.output_dir}``
    only exists inside a Hydra run.
    """
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    directory = Path(directory).resolve() if directory is not None else config_dir()
    register_fallback_configs(directory)
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(directory), version_base="1.3"):
        return compose(config_name=CONFIG_NAME, overrides=list(overrides))
