"""Fusion policies, each one file behind the FUSION_POLICIES registry."""

from __future__ import annotations

import importlib
import pkgutil

from ssfusion_lightning.fusion.base import (
    FUSION_POLICIES,
    CompressContext,
    ErrorFeedback,
    FusionPolicy,
    PlanContext,
)

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")


def available_fusion_policies() -> list[str]:
    return FUSION_POLICIES.names()


__all__ = [
    "FUSION_POLICIES",
    "CompressContext",
    "ErrorFeedback",
    "FusionPolicy",
    "PlanContext",
    "available_fusion_policies",
]
