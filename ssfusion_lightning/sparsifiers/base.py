"""The sparsifier interface: pick which elements of one (error-compensated) tensor to send."""

from __future__ import annotations

import hashlib
import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from functools import lru_cache
from typing import Any, ClassVar

import torch
from torch import Tensor

from ssfusion_lightning.registry import Registry
from ssfusion_lightning.sparsifiers.selection import trim_to_k


def k_for(numel: int, density: float) -> int:
    """Elements kept for a tensor of ``numel`` elements: max(1, floor(density * numel)), never above numel."""
    if numel <= 0:
        return 0
    return min(numel, max(1, math.floor(density * numel)))


def stable_hash(text: str) -> int:
    """A 63-bit hash of ``text`` that is the same in every process (unlike Python's salted ``hash``)."""
    return _stable_hash(str(text))


@lru_cache(maxsize=4096)
def _stable_hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "little") >> 1


def keep_all(flat: Tensor) -> tuple[Tensor, Tensor]:
    """The whole (flat) tensor as a selection: what every sparsifier returns when k >= numel."""
    indices = torch.arange(flat.numel(), device=flat.device)
    return flat.index_select(0, indices), indices


def check_many(tensors: Sequence[Tensor], keys: Sequence[str], ks: Sequence[int | None]) -> None:
    """``select_many``'s arguments: one key and one k per tensor."""
    if not len(tensors) == len(keys) == len(ks):
        raise ValueError(f"select_many needs one key and one k per tensor, got {len(tensors)}, {len(keys)}, {len(ks)}")


def validate_density(density: float) -> float:
    if isinstance(density, bool) or not isinstance(density, (int, float)) or not (0.0 < float(density) <= 1.0):
        raise ValueError(f"density must be a number with 0 < density <= 1, got {density!r}")
    return float(density)


class Sparsifier(ABC):
    """Selects elements of a tensor.

    ``select`` flattens its input and returns ``(values, indices)``: ``values`` in the input's dtype,
    ``indices`` int64 positions into the flattened tensor, with no duplicates.
    ``key`` names the tensor (stateful sparsifiers keep per-tensor state under it); ``k`` overrides
    the count derived from the density (fusion policies use it for per-tensor budgets).

    Contract of every implementation: works on any device (no ``.cuda()``), on fp32/bf16/fp16 (and
    fp64) input of any shape, 0-d included; ``values == tensor.reshape(-1)[indices]`` in the input's
    dtype; ``indices`` int64, distinct, in range. Fixed-k sparsifiers (``exact_k``) return exactly
    ``min(k, numel)`` elements. Threshold sparsifiers return a data-dependent count; ``count_band``
    documents it as factors of k (see each class), and they always return at least one element
    of a non-empty tensor.
    """

    name: ClassVar[str] = ""
    #: returns exactly k elements (threshold sparsifiers return a count near k)
    exact_k: ClassVar[bool] = True
    #: every rank selects the same positions, so the sum needs no index exchange
    shared_indices: ClassVar[bool] = False
    #: keeps everything: the tensor is sent dense
    is_dense: ClassVar[bool] = False
    #: for threshold sparsifiers: (low, high) factors of k the returned count lands in (see the class docs)
    count_band: ClassVar[tuple[float, float] | None] = None
    #: selects by the tensor's shape (rows), so a fused 1-D buffer is no valid input
    needs_shape: ClassVar[bool] = False

    def __init__(self, density: float = 0.01, **options: Any) -> None:
        if options:
            raise TypeError(f"{type(self).__name__} got unknown options {sorted(options)}")
        self.density = validate_density(density)
        self.step = 0

    def k_for(self, numel: int) -> int:
        return k_for(numel, self.density)

    def set_density(self, density: float) -> None:
        """A new target for the counts of the next selections (a density warm-up's stage). Per-key
        state made for another k (reused thresholds) renews itself at the next selection."""
        self.density = validate_density(density)

    def resolve_k(self, numel: int, k: int | None) -> int:
        """The budget for one tensor: ``k`` when given (clamped to [1, numel]), else ``k_for(numel)``."""
        if numel <= 0:
            return 0
        if k is None:
            return self.k_for(numel)
        return max(1, min(int(k), numel))

    def output_count(self, shape: torch.Size, k: int) -> int | None:
        """The exact number of elements ``select`` returns for this shape and k, or None if data-dependent."""
        return self.resolve_k(math.prod(shape), k) if self.exact_k else None

    def count_bound(self, shape: torch.Size, k: int) -> int | None:
        """The most elements ``select`` can return for this shape and k; None if only numel bounds it."""
        exact = self.output_count(shape, k)
        if exact is not None:
            return exact
        if self.count_band is not None and self.count_band[1] <= 1.0:
            return self.resolve_k(math.prod(shape), k)
        return None

    @abstractmethod
    def select(self, tensor: Tensor, *, key: str = "", k: int | None = None) -> tuple[Tensor, Tensor]:
        """Return (values, int64 flat indices) of the selected elements."""

    def select_many(
        self, tensors: Sequence[Tensor], keys: Sequence[str], ks: Sequence[int | None]
    ) -> list[tuple[Tensor, Tensor]]:
        """``[self.select(t, key=key, k=k) for t, key, k in zip(tensors, keys, ks)]``: the same
        values and the same index sets (the order of indices within a tensor may differ).

        Meant for the tensors of one fusion buffer, selected in one go. This default is that
        loop, in order, so a stateful sparsifier sees the same calls; sparsifiers whose
        selection batches (``topk``, ``dgc``, ``gaussiank``, ``sidco``) override it with a few
        whole-buffer passes (see ``batched``).
        """
        check_many(tensors, keys, ks)
        return [self.select(tensor, key=key, k=k) for tensor, key, k in zip(tensors, keys, ks)]

    def advance(self) -> None:
        """Called once per communication round, after every tensor of the round was selected."""
        self.step += 1

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])


class ThresholdSparsifier(Sparsifier):
    """Base of the sparsifiers that select ``|x| >= threshold`` and so return a count near k.

    ``finish`` enforces the common guarantees: at most ``cap`` elements (more are trimmed to k
    by exact top-k among the selected ones) and at least one element of a non-empty tensor.
    """

    exact_k = False

    def band(self, k: int) -> tuple[float, float, float]:
        """(low, high, cap) for budget k: the threshold search stops at a count in [low, high],
        and a selection above cap is trimmed to k."""
        raise NotImplementedError(f"{type(self).__name__} has no threshold search band")

    def finish(self, flat: Tensor, indices: Tensor, k: int, cap: float) -> tuple[Tensor, Tensor]:
        if indices.numel() > cap:
            indices = trim_to_k(flat, indices, k)
        if indices.numel() == 0 and flat.numel() > 0:
            indices = flat.abs().argmax().view(1)
        return flat.index_select(0, indices), indices


SPARSIFIERS: Registry[Sparsifier] = Registry("sparsifier")
