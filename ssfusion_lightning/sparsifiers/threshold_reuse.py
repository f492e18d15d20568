"""`threshold_reuse`: Ok-Topk's local selection -- an exact threshold every tau steps, reused in between."""

from __future__ import annotations

from typing import Any

from torch import Tensor

from ssfusion_lightning.sparsifiers.base import SPARSIFIERS, ThresholdSparsifier, keep_all
from ssfusion_lightning.sparsifiers.selection import Candidates, topk_indices, trim_to_k


@SPARSIFIERS.register("threshold_reuse")
class ThresholdReuseSparsifier(ThresholdSparsifier):
    """Per tensor (``key``): every ``tau`` steps an exact step selects the exact top-k and stores
    the k-th largest magnitude as the threshold; the steps in between select ``|x| >= threshold``
    with the stored one (one selection pass, no top-k).

    After a reuse step whose count left [2k/3, 4k/3] the stored threshold is nudged for the next
    step: multiplied by ``nudge`` when too many were selected, divided by it when too few.
    Safety band: a reuse step whose count leaves [k/2, 2k] (the gradient's scale moved a lot)
    becomes an exact step at once -- trimmed from the selection when it was too large, a full
    exact top-k when too small -- so the payload never runs away. A changed k for a key also
    forces an exact step.

    A reuse step above 4k/3 is trimmed to exactly k among the selected (cheap: the selection is
    small), so the payload stays within Ok-Topk's bound.

    Count band: (1/2, 4/3) x k always (exactly k on exact steps and trimmed steps); (2/3, 4/3) x k
    is the target of the nudges for a stationary gradient distribution.

    State (``state_dict``): the step counter and, per key, (threshold, k, step of the last exact
    selection).
    """

    name = "threshold_reuse"
    count_band = (0.5, 4 / 3)
    target_band = (2 / 3, 4 / 3)

    def __init__(self, density: float = 0.01, tau: int = 32, nudge: float = 1.02, **options: Any) -> None:
        super().__init__(density=density, **options)
        if isinstance(tau, bool) or not isinstance(tau, int) or tau < 1:
            raise ValueError(f"tau must be a positive integer, got {tau!r}")
        if isinstance(nudge, bool) or not isinstance(nudge, (int, float)) or not nudge >= 1.0:
            raise ValueError(f"nudge must be a number >= 1, got {nudge!r}")
        self.tau = tau
        self.nudge = float(nudge)
        #: key -> (threshold, k, step of the last exact selection)
        self.thresholds: dict[str, tuple[float, int, int]] = {}

    def _exact(self, flat: Tensor, key: str, k: int, indices: Tensor) -> tuple[Tensor, Tensor]:
        values = flat.index_select(0, indices)
        threshold = float(values.abs().min()) if values.numel() else 0.0
        self.thresholds[key] = (threshold, k, self.step)
        return values, indices

    def select(self, tensor: Tensor, *, key: str = "", k: int | None = None) -> tuple[Tensor, Tensor]:
        flat = tensor.reshape(-1)
        n = flat.numel()
        k = self.resolve_k(n, k)
        if k >= n:
            return keep_all(flat)
        stored = self.thresholds.get(key)
        if stored is None or stored[1] != k or self.step - stored[2] >= self.tau or self.step < stored[2]:
            return self._exact(flat, key, k, topk_indices(flat, k))
        threshold = stored[0]
        selected = Candidates(flat).select(threshold)
        count = selected.numel()
        if count > 2 * k:
            return self._exact(flat, key, k, trim_to_k(flat, selected, k))
        if count < k / 2:
            return self._exact(flat, key, k, topk_indices(flat, k))
        if count > self.target_band[1] * k:
            threshold *= self.nudge
        elif count < self.target_band[0] * k:
            threshold /= self.nudge
        self.thresholds[key] = (threshold, k, stored[2])
        return self.finish(flat, selected, k, self.target_band[1] * k)

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "thresholds": {key: tuple(value) for key, value in self.thresholds.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.thresholds = {
            key: (float(t), int(k), int(s)) for key, (t, k, s) in state.get("thresholds", {}).items()
        }
