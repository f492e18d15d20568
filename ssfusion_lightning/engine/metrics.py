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

    def as_dict(self) -> dict[str, float]:
        return {key: float(value) for key, value in asdict(self).items()}
