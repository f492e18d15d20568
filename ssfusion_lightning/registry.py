"""A tiny name -> factory registry shared by sparsifiers, memories, fusion policies and collectives."""

from __future__ import annotations

import inspect
from typing import Callable, Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """Maps names to factories; unknown names and unknown options raise an error that lists the
    valid choices."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, Callable[..., T]] = {}

    def register(self, name: str) -> Callable[[Callable[..., T]], Callable[..., T]]:
        def decorator(factory: Callable[..., T]) -> Callable[..., T]:
            if name in self._entries and self._entries[name] is not factory:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            self._entries[name] = factory
            return factory

        return decorator

    def get(self, name: str) -> Callable[..., T]:
        if not isinstance(name, str) or name not in self._entries:
            raise ValueError(f"unknown {self.kind} {name!r}; valid choices: {', '.join(self.names())}")
        return self._entries[name]

    def build(self, name: str, *args, **kwargs) -> T:
        factory = self.get(name)
        options = _options_of(factory)
        unknown = sorted(set(kwargs) - set(options)) if options is not None else []
        if unknown:
            raise TypeError(
                f"{self.kind} {name!r} has no option {', '.join(map(repr, unknown))}; "
                f"its options: {', '.join(options) or 'none'}"
            )
        return factory(*args, **kwargs)

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries


def _options_of(factory: Callable[..., object]) -> list[str] | None:
    """The keyword options ``factory`` takes, in order; None when it takes any (``**kwargs``)."""
    parameters = inspect.signature(factory).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return None
    keyword = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [p.name for p in parameters if p.kind in keyword]
