"""Model registry: every architecture registers named sizes, from ``tiny`` (CPU tests) to the paper size."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable, Mapping, cast

from torch import nn

from ssfusion_lightning.registry import Registry


@dataclass(frozen=True)
class ModelSpec:
    """An architecture constructor plus its named sizes (constructor keyword arguments per size)."""

    name: str
    constructor: Callable[..., nn.Module]
    sizes: Mapping[str, Mapping[str, Any]]

    def __call__(self, size: str = "tiny", **overrides: Any) -> nn.Module:
        if size not in self.sizes:
            raise ValueError(f"unknown size {size!r} for model {self.name!r}; valid choices: {', '.join(self.sizes)}")
        accepted = inspect.signature(self.constructor).parameters
        unknown = sorted(set(overrides) - set(accepted))
        if unknown:
            raise ValueError(
                f"unknown option(s) {', '.join(unknown)} for model {self.name!r}; valid choices: {', '.join(accepted)}"
            )
        return self.constructor(**{**self.sizes[size], **overrides})


MODELS: Registry[nn.Module] = Registry("model")


def register_model(name: str, constructor: Callable[..., nn.Module], sizes: Mapping[str, Mapping[str, Any]]) -> None:
    MODELS.register(name)(ModelSpec(name, constructor, sizes))


def build_model(name: str, size: str = "tiny", **overrides: Any) -> nn.Module:
    """Build ``name`` at a named ``size``; ``overrides`` replace that size's constructor arguments.

    Build under ``with torch.device("meta"):`` to inspect a paper-size model without allocating it.
    """
    return MODELS.build(name, size, **overrides)


def available_models() -> list[str]:
    return MODELS.names()


def available_sizes(name: str) -> list[str]:
    """The sizes of ``name``, smallest first."""
    spec = cast(ModelSpec, MODELS.get(name))
    return list(spec.sizes)
