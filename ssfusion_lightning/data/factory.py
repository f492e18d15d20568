"""Dataset registry: ``build_datamodule(name, **kwargs)`` for every DataModule of this package."""

from __future__ import annotations

import inspect
from typing import Any

from ssfusion_lightning.data.base import BaseDataModule
from ssfusion_lightning.registry import Registry

DATASETS: Registry[BaseDataModule] = Registry("dataset")


def build_datamodule(name: str, **kwargs: Any) -> BaseDataModule:
    factory = DATASETS.get(name)
    accepted = inspect.signature(factory).parameters
    unknown = sorted(set(kwargs) - set(accepted))
    if unknown:
        raise ValueError(
            f"unknown option(s) {', '.join(unknown)} for dataset {name!r}; valid choices: {', '.join(accepted)}"
        )
    return factory(**kwargs)


def available_datasets() -> list[str]:
    return DATASETS.names()
