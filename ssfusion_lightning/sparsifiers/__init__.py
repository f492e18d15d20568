"""Sparsifiers (which elements to send) and error-feedback memories, each behind a registry."""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any

from ssfusion_lightning.sparsifiers.base import SPARSIFIERS, Sparsifier, k_for, validate_density
from ssfusion_lightning.sparsifiers.memory import MEMORIES, Memory

# Every module in this package registers itself on import: a new sparsifier is one new file.
for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")


def available_sparsifiers() -> list[str]:
    return SPARSIFIERS.names()


def build_sparsifier(name: str, density: float = 0.01, **kwargs: Any) -> Sparsifier:
    return SPARSIFIERS.build(name, density=density, **kwargs)


def build_memory(name: str, **kwargs: Any) -> Memory:
    return MEMORIES.build(name, **kwargs)


__all__ = [
    "MEMORIES",
    "SPARSIFIERS",
    "Memory",
    "Sparsifier",
    "available_sparsifiers",
    "build_memory",
    "build_sparsifier",
    "k_for",
    "validate_density",
]
