"""ssfusion-lightning: sparse, fused gradient communication for PyTorch Lightning.

Importing the package registers the strategy names (``ssfusion``, ``ssfusion_spawn`` and one per
reproduced system) with Lightning's StrategyRegistry: at once if Lightning is loaded already, else
the moment Lightning finishes loading. The import itself loads neither torch nor Lightning (the
public names below load on first use), so ``ssfusion-train`` can check its config and answer
``--help`` before paying for them.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ssfusion_lightning.comm import available_communicators, sparse_allreduce
    from ssfusion_lightning.engine.state import strip_engine_state
    from ssfusion_lightning.fusion import available_fusion_policies
    from ssfusion_lightning.sparsifiers import available_sparsifiers, build_memory, build_sparsifier
    from ssfusion_lightning.strategy import SSFusionStrategy

#: public name -> the module that defines it
_EXPORTS = {
    "SSFusionStrategy": "ssfusion_lightning.strategy",
    "available_communicators": "ssfusion_lightning.comm",
    "available_fusion_policies": "ssfusion_lightning.fusion",
    "available_sparsifiers": "ssfusion_lightning.sparsifiers",
    "build_memory": "ssfusion_lightning.sparsifiers",
    "build_sparsifier": "ssfusion_lightning.sparsifiers",
    "sparse_allreduce": "ssfusion_lightning.comm",
    "strip_engine_state": "ssfusion_lightning.engine.state",
}
#: importing it registers the strategy names (the last lines of ssfusion_lightning/strategy.py)
_REGISTERING_MODULE = "ssfusion_lightning.strategy"

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


def __getattr__(name: str) -> Any:
    """The public names and the subpackages, imported on first use (PEP 562)."""
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    try:
        return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as error:
        if error.name != f"{__name__}.{name}":  # a submodule exists but fails to import: show that
            raise
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


class _RegisterWhenLightningLoads(importlib.abc.MetaPathFinder):
    """Imports the strategy module, which registers the strategy names, right after ``lightning`` has loaded.

    Lightning has no entry points for strategies, so the registration must ride on an import; this
    finder lets it ride on Lightning's own import instead of loading Lightning with this package.
    """

    def find_spec(self, fullname: str, path: Any = None, target: ModuleType | None = None) -> ModuleSpec | None:
        if fullname != "lightning":
            return None
        sys.meta_path.remove(self)  # once, and so that the lookup below finds the real spec
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        load = spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            load(module)
            # When the strategy module is what imports Lightning, this returns it half-imported and
            # the module registers the names itself when it finishes.
            importlib.import_module(_REGISTERING_MODULE)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


if "lightning" in sys.modules:
    importlib.import_module(_REGISTERING_MODULE)
else:
    sys.meta_path.insert(0, _RegisterWhenLightningLoads())
