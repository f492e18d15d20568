"""The strategy presets: the reproduced systems, their ablations and two baselines.

This table is the one definition of each preset. From it come:

- ``ssfusion-train strategy=<name>``: conf/strategy/<name>.yaml, generated from it (each inherits
  conf/ssfusion_strategy.yaml, the options' defaults, and lists only what differs);
- the Lightning strategy names of the systems (``Trainer(strategy="safusion")``), registered by
  ``import ssfusion_lightning`` from ``SYSTEM_PRESETS``;
- the preset tables in README.md and docs/cli.md, generated from it.

After changing it, ``python -m ssfusion_lightning.app.options`` rewrites the generated files;
tests/test_options.py fails, naming that command, until they match.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Preset:
    """A named choice of SSFusionStrategy arguments."""

    description: str
    sparsifier: str
    fusion: str
    comm: str
    offload: str
    #: any other SSFusionStrategy options that differ from their defaults
    options: dict[str, Any] = field(default_factory=dict)
    #: constructor options of the communicator beyond its group's defaults (conf/comm/<comm>.yaml)
    comm_options: dict[str, Any] = field(default_factory=dict)

    @property
    def kwargs(self) -> dict[str, Any]:
        """The SSFusionStrategy keyword arguments."""
        groups = {"sparsifier": self.sparsifier, "fusion": self.fusion, "comm": self.comm, "offload": self.offload}
        return {**groups, **self.options, **({"comm_options": dict(self.comm_options)} if self.comm_options else {})}

    @property
    def comm_label(self) -> str:
        """The communicator as the documentation's tables name it."""
        trial = self.comm_options.get("dense_trial_steps")
        return f"{self.comm} + dense trial" if trial else self.comm


_ONE_GROUP = {"process_groups": 1}
#: a fixed scheme's guard against running slower than DDP where the link is fast enough that
#: sparsifying does not pay (engine/trial.py; comm=auto has it on by default): the systems' presets
#: with a fixed scheme time their plan against the model sent dense, as ssfusion's auto does
_DENSE_TRIAL = {"dense_trial_steps": 16}


#: the flagship's error feedback follows the optimizer (momentum correction for SGD with momentum,
#: the Adam update for Adam/AdamW, sparsifiers/memory_choice.py): on real data it reached dense
#: accuracy sooner than the papers' residual memory, and a run sent dense still hands off to DDP's
#: reducer (experiments/REPORT.md). Its ablations share it, so that each differs from the system in
#: its mechanism alone; the other systems' presets keep their papers' residual memory
_MEMORY_BY_OPTIMIZER = {"memory": "auto"}

#: name -> preset, in the order of the documentation's table
PRESETS: dict[str, Preset] = {
    "ssfusion": Preset(
        "SSFusion (system): selective sparsification, sparsification offloading, per-buffer collective from the cost model, "
        "error feedback picked for the optimizer (memory auto)",
        "dgc", "selective", "auto", "auto", _MEMORY_BY_OPTIMIZER,
    ),
    "ssfusion_naive": Preset(
        "SSFusion(Naive) ablation: selective sparsification only (no offload, allgather, one group); memory auto, as SSFusion",
        "dgc", "selective", "allgather", "none", {**_ONE_GROUP, **_MEMORY_BY_OPTIMIZER},
    ),
    "ssfusion_o": Preset(
        "SSFusion-O ablation: selective sparsification + sparsification offloading (allgather, one group); memory auto, as SSFusion",
        "dgc", "selective", "allgather", "auto", {**_ONE_GROUP, **_MEMORY_BY_OPTIMIZER},
    ),
    "ssfusion_i": Preset(
        "SSFusion-I ablation: selective sparsification + interleaved hybrid communication (no offload); memory auto, as SSFusion",
        "dgc", "selective", "hybrid", "none", _MEMORY_BY_OPTIMIZER,
    ),
    "safusion": Preset(
        "SAFusion (system): sparsification-ahead fusion, inter-worker alignment, adaptive buffer sizing",
        "dgc", "adaptive", "allgather", "none", comm_options=_DENSE_TRIAL,
    ),
    "safusion_saf": Preset("SAFusion SAF(Naive) ablation: sparsification-ahead fusion", "dgc", "ahead", "allgather", "none"),
    "safusion_inter": Preset(
        "SAFusion-Inter ablation: ahead + inter-worker aligned fusion", "dgc", "aligned", "allgather", "none"
    ),
    "safusion_inter_intra": Preset(
        "SAFusion-(Inter+Intra) ablation: aligned + adaptive intra-worker buffer sizing", "dgc", "adaptive", "allgather", "none"
    ),
    "adtopk": Preset(
        "ADTopk (system): all-dimension top-k, interleaved and partial sparsification, hybrid collective",
        "adtopk_interleaved", "partial", "hybrid", "none", comm_options=_DENSE_TRIAL,
    ),
    "adtopk_only": Preset(
        "ADTopk ablation: all-dimension top-k alone (ahead fusion, allgather)", "adtopk", "ahead", "allgather", "none"
    ),
    "adtopk_interleaved": Preset(
        "ADTopk ablation: + interleaved sparsification (ADTopk and top-k alternate)",
        "adtopk_interleaved", "ahead", "allgather", "none",
    ),
    "adtopk_partial": Preset(
        "ADTopk ablation: + partial sparsification", "adtopk_interleaved", "partial", "allgather", "none"
    ),
    "adtopk_hybrid": Preset(
        "ADTopk ablation: + hybrid collective (all-reduce + all-gather) = the full ADTopk",
        "adtopk_interleaved", "partial", "hybrid", "none",
    ),
    "zen": Preset(
        "ZEN (system): hash-balanced sparse synchronization (chooses between ZEN and SparCML)", "topk", "ahead", "zen", "none",
        comm_options=_DENSE_TRIAL,
    ),
    "oktopk": Preset(
        "Ok-Topk (system): near-optimal sparse allreduce with threshold reuse", "threshold_reuse", "behind", "oktopk", "none",
        comm_options=_DENSE_TRIAL,
    ),
    "layerwise": Preset("Baseline: layer-wise sparsification, no fusion", "dgc", "layerwise", "allgather", "none"),
    "behind": Preset(
        "Baseline: sparsification behind fusion (fuse, then one top-k per buffer)", "dgc", "behind", "allgather", "none"
    ),
}

#: the reproduced systems: their presets are also Lightning strategy names
SYSTEMS = ("ssfusion", "safusion", "adtopk", "zen", "oktopk")


def _registered(name: str, start_method: str = "popen", description: str | None = None) -> tuple[str, dict[str, Any]]:
    preset = PRESETS[name]
    return description or preset.description, {**preset.kwargs, "start_method": start_method}


#: Lightning strategy name -> (description, SSFusionStrategy keyword arguments)
SYSTEM_PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    "ssfusion": _registered("ssfusion"),
    "ssfusion_spawn": _registered("ssfusion", "spawn", "SSFusion with the spawn launcher"),
    **{name: _registered(name) for name in SYSTEMS if name != "ssfusion"},
}
