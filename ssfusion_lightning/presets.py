"""The reproduced systems as strategy presets; registered as Lightning strategy names."""

from __future__ import annotations

from typing import Any

#: name -> (description, SSFusionStrategy keyword arguments)
SYSTEM_PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    "ssfusion": (
        "SSFusion: selective sparsification, sparsification offloading, per-buffer collective from the cost model",
        {"sparsifier": "dgc", "fusion": "selective", "comm": "auto", "offload": "auto", "start_method": "popen"},
    ),
    "ssfusion_spawn": (
        "SSFusion with the spawn launcher",
        {"sparsifier": "dgc", "fusion": "selective", "comm": "auto", "offload": "auto", "start_method": "spawn"},
    ),
    "safusion": (
        "SAFusion: sparsification-ahead fusion, inter-worker alignment, adaptive buffer sizing",
        {"sparsifier": "dgc", "fusion": "adaptive", "comm": "allgather", "offload": "none", "start_method": "popen"},
    ),
    "adtopk": (
        "ADTopk: all-dimension top-k, interleaved and partial sparsification, hybrid collective",
        {"sparsifier": "adtopk_interleaved", "fusion": "partial", "comm": "hybrid", "offload": "none", "start_method": "popen"},
    ),
    "zen": (
        "ZEN: hash-balanced sparse synchronization (chooses between ZEN and SparCML)",
        {"sparsifier": "topk", "fusion": "ahead", "comm": "zen", "offload": "none", "start_method": "popen"},
    ),
    "oktopk": (
        "Ok-Topk: near-optimal sparse allreduce with threshold reuse",
        {"sparsifier": "threshold_reuse", "fusion": "behind", "comm": "oktopk", "offload": "none", "start_method": "popen"},
    ),
}
