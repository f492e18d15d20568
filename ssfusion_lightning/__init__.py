"""ssfusion-lightning: sparse, fused gradient communication for PyTorch Lightning.

Importing the package registers the strategy names (``ssfusion``, ``ssfusion_spawn`` and one per
reproduced system) with Lightning's StrategyRegistry.
"""

from __future__ import annotations

from lightning.pytorch.strategies import StrategyRegistry

from ssfusion_lightning.comm import available_communicators, sparse_allreduce
from ssfusion_lightning.engine.state import strip_engine_state
from ssfusion_lightning.fusion import available_fusion_policies
from ssfusion_lightning.sparsifiers import available_sparsifiers, build_memory, build_sparsifier
from ssfusion_lightning.strategy import SSFusionStrategy

SSFusionStrategy.register_strategies(StrategyRegistry)

__all__ = [
    "SSFusionStrategy",
    "available_communicators",
    "available_fusion_policies",
    "available_sparsifiers",
    "build_memory",
    "build_sparsifier",
    "sparse_allreduce",
    "strip_engine_state",
]
