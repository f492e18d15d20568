"""``memory="auto"``: the error feedback the measurements favour for the optimizer a run uses,
picked once the optimizers exist (the strategy builds the engine before them).

- SGD with momentum: ``dgc`` (momentum correction) keeping 90% of the unsent velocity. On the
  digits cell (P = 4, 40 Mbit/s, six seeds) it kept ssfusion@1% within 2.5 points of DDP from a
  quarter of the run on, against 30.1 with all of it kept and 49.2 for residual error feedback, and
  ended 0.1% with the density warm-up 0.14 points under DDP, against 4.2 for residual
  (experiments/REPORT.md, "Keeping 90% of the unsent part on the digits cell", "0.1% with DGC's
  warm-up and feedback 0.9").
- Adam or AdamW: ``adam`` (error feedback on each rank's Adam update) keeping 90% of the unsent
  update: on the byte-level LM at 1% it left the early plateau with dense AdamW and reached 2.44-2.45
  after 300 steps, against 2.79-2.94 for all of it kept (REPORT, "What holds the LM on its plateau").
  The Trainer's gradient clipping by norm becomes the memory's own (DGC's local clipping of each
  rank's gradient before its moments, at the same norm over sqrt(P)), and the strategy turns the
  Trainer's off for the run: clipping the averaged update instead would not be the user's clipping,
  and residual error feedback held that LM on its plateau (3.14 and 3.11 after 300 steps at 0.1%,
  REPORT, "memory='auto' on the LM"). Where the run has what ``adam`` refuses otherwise (clipping
  by value, a GradScaler, sparse embedding gradients), ``residual`` instead.
- Anything else (another optimizer, or SGD beside another kind): ``residual``, all of the unsent
  part kept (nothing else was measured better).

A ``feedback`` in ``memory_options`` is used as given; it is the only option every memory auto may
pick accepts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from ssfusion_lightning.sparsifiers.adam_memory import adam_settings
from ssfusion_lightning.sparsifiers.memory import sgd_momentum

AUTO = "auto"
#: the fraction of the unsent part auto's dgc and adam keep
AUTO_FEEDBACK = 0.9
#: the options ``memory="auto"`` takes: every memory it may pick accepts them
AUTO_OPTIONS = ("feedback",)


@dataclass(frozen=True)
class MemoryChoice:
    """The memory ``memory="auto"`` picked, its options, and why (for the log)."""

    name: str
    options: dict[str, Any] = field(default_factory=dict)
    reason: str = ""


def check_auto_options(options: dict[str, Any]) -> None:
    """Refuse an option some memory auto may pick would not accept, naming the valid ones."""
    unknown = sorted(set(options) - set(AUTO_OPTIONS))
    if unknown:
        raise TypeError(
            f"memory 'auto' has no option {unknown[0]!r}; its options: {', '.join(AUTO_OPTIONS)} (the memory it picks "
            "depends on the optimizer: name the memory, e.g. memory='dgc', to set its other options)"
        )


def choose_memory(
    optimizers: Sequence[torch.optim.Optimizer], options: dict[str, Any], adam_refused: str | None = None,
    clip_norm: float | None = None,
) -> MemoryChoice:
    """``memory="auto"``'s pick for ``optimizers`` (see the module doc). ``adam_refused``: why the
    run cannot take ``memory="adam"`` whatever its optimizer (None where it can). ``clip_norm``: the
    Trainer's clipping by norm, which ``adam`` takes as its own (None: the Trainer does not clip so)."""
    check_auto_options(options)
    names = ", ".join(sorted({type(opt).__name__ for opt in optimizers})) or "none"
    kept = {"feedback": AUTO_FEEDBACK, **options}
    try:
        momentum, momentum_refused = sgd_momentum(optimizers), None
    except ValueError as error:
        momentum, momentum_refused = None, str(error)
    only_sgd = all(isinstance(opt, torch.optim.SGD) for opt in optimizers)
    if momentum and only_sgd:
        return MemoryChoice("dgc", kept, f"SGD with momentum {momentum}: momentum correction")
    if momentum:
        # momentum correction would apply the SGD's momentum to the other optimizers' gradients too
        momentum_refused = f"memory='dgc' would apply SGD's momentum to every tensor, but the optimizers are {names}"
    refused = adam_refused
    if refused is None:
        try:
            adam_settings(optimizers)
        except ValueError as error:
            refused = str(error)
        else:
            if not clip_norm:
                return MemoryChoice("adam", kept, f"{names}: error feedback on each rank's Adam update")
            return MemoryChoice(
                "adam", {**kept, "clip_norm": clip_norm},
                f"{names}: error feedback on each rank's Adam update; the Trainer's gradient_clip_val={clip_norm!r} now "
                "clips each rank's gradient before its moments (the Trainer's own clipping is off for the run)",
            )
    uses_adam = any(isinstance(opt, (torch.optim.Adam, torch.optim.AdamW)) for opt in optimizers)
    why = momentum_refused or (refused if uses_adam else None)
    return MemoryChoice("residual", dict(options), f"{names}: plain error feedback" + (f" ({why})" if why else ""))
