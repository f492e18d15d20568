"""Per-step communication metrics of the engine."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class StepMetrics:
    bytes_sent: int = 0
    bytes_received: int = 0
    padded_bytes_sent: int = 0
    padded_bytes_received: int = 0
    dense_equivalent_bytes: int = 0
    #: compression on the main thread (on the critical path of backward)
    compress_seconds: float = 0.0
    #: compression on the offload worker (SSFusion-O), overlapped with backward
    offloaded_compress_seconds: float = 0.0
    exposed_comm_seconds: float = 0.0
    buffers: int = 0
    dense_tensors: int = 0
    sparse_tensors: int = 0
    elements_sent: int = 0
    skipped_steps: int = 0
    #: elements this rank selected from the plan's sparse tensors (sparse-gradient parameters aside)
    selected_elements: int = 0
    #: elements of the plan's sparse tensors
    sparse_numel: int = 0
    #: the density the plan asked for at this step (the warm-up schedule's, when one is set)
    requested_density: float = 0.0

    @property
    def effective_density(self) -> float:
        """What the sparse tensors really sent: selected / their elements (0 with none sparse)."""
        return self.selected_elements / self.sparse_numel if self.sparse_numel else 0.0

    def as_dict(self) -> dict[str, float]:
        return {**{key: float(value) for key, value in asdict(self).items()}, "effective_density": self.effective_density}
