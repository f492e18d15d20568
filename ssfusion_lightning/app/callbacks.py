"""Lightning callbacks of the application: throughput, communication statistics, results.json."""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any, Mapping

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities.data import extract_batch_size
from typing_extensions import override

from ssfusion_lightning.app import RESULTS_FILE
from ssfusion_lightning.commcost import ring_allreduce_bytes


class SamplesPerSecond(Callback):
    """Training throughput: samples per second over all ranks, logged as ``perf/samples_per_sec``.

    A step's time runs from the previous training batch's end (or the start of the epoch, or the end
    of a validation run) to this batch's end, so it includes data loading, forward, backward,
    communication and the optimizer step, but not validation. The first ``skip_steps`` steps (warm-up:
    data loader start, allocations, cost profiling) are left out of the run's average when later steps exist.
    """

    def __init__(self, skip_steps: int = 1, log_to_loggers: bool = True) -> None:
        if skip_steps < 0:
            raise ValueError(f"skip_steps must be >= 0, got {skip_steps}")
        self.skip_steps = skip_steps
        self.log_to_loggers = log_to_loggers
        self.durations: list[float] = []
        self.samples: list[int] = []
        self._mark: float | None = None

    def _restart_clock(self) -> None:
        self._mark = time.perf_counter()

    @override
    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._restart_clock()

    @override
    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._restart_clock()

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        now = time.perf_counter()
        if self._mark is None:
            self._mark = now
            return
        duration, self._mark = now - self._mark, now
        samples = extract_batch_size(batch) * trainer.world_size
        self.durations.append(duration)
        self.samples.append(samples)
        if self.log_to_loggers and duration > 0 and trainer.loggers:
            pl_module.log("perf/samples_per_sec", samples / duration, on_step=True, on_epoch=False, prog_bar=True)

    def summary(self) -> dict[str, Any]:
        skip = self.skip_steps if len(self.durations) > self.skip_steps else 0
        durations, samples = self.durations[skip:], self.samples[skip:]
        total = sum(durations)
        return {
            "samples_per_sec": sum(samples) / total if total > 0 else None,
            "step_seconds_mean": total / len(durations) if durations else None,
            "measured_steps": len(durations),
            "skipped_steps": skip,
        }


class CommunicationStats(Callback):
    """Per-step communication of this rank, averaged over the run.

    Under SSFusionStrategy: every field of the engine's ``StepMetrics`` (``strategy.last_metrics``)
    of every synchronized step. Under plain DDP: the dense ring all-reduce of the trainable parameters
    (2(P-1)/P times their bytes), which is both the bytes sent and the dense equivalent.
    """

    FIELDS = (
        "bytes_sent",
        "bytes_received",
        "padded_bytes_sent",
        "padded_bytes_received",
        "dense_equivalent_bytes",
        "compress_seconds",
        "exposed_comm_seconds",
        "elements_sent",
    )

    def __init__(self) -> None:
        self.totals: dict[str, float] = dict.fromkeys(self.FIELDS, 0.0)
        self.steps = 0
        self.source = "none"
        self.parameter_bytes = 0
        self._last_seen: Any = None
        self._last_step = -1

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        from ssfusion_lightning.strategy import SSFusionStrategy

        self.parameter_bytes = sum(p.numel() * p.element_size() for p in pl_module.parameters() if p.requires_grad)
        strategy = trainer.strategy
        if isinstance(strategy, SSFusionStrategy):
            self.source = "ssfusion"
            self._last_seen = strategy.last_metrics
        elif isinstance(strategy, DDPStrategy):
            self.source = "ddp_ring_allreduce_estimate"
        self._last_step = trainer.global_step

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.source == "ssfusion":
            metrics = trainer.strategy.last_metrics
            if metrics is self._last_seen:  # no synchronization in this micro-batch (gradient accumulation)
                return
            self._last_seen = metrics
            for key, value in metrics.as_dict().items():  # every StepMetrics field, averaged per step
                self.totals[key] = self.totals.get(key, 0.0) + float(value)
            self.steps += 1
        elif self.source == "ddp_ring_allreduce_estimate" and trainer.global_step > self._last_step:
            self._last_step = trainer.global_step
            dense = ring_allreduce_bytes(self.parameter_bytes, trainer.world_size)
            for key in self.FIELDS[:5]:  # sent, received, padded sent/received, dense equivalent
                self.totals[key] += dense
            self.steps += 1

    def summary(self) -> dict[str, Any]:
        per_step = {f"{key}_per_step": value / self.steps if self.steps else None for key, value in self.totals.items()}
        sent, dense = per_step["bytes_sent_per_step"], per_step["dense_equivalent_bytes_per_step"]
        return {
            "source": self.source,
            "steps": self.steps,
            "parameter_bytes": self.parameter_bytes,
            **per_step,
            "compression_ratio": dense / sent if sent and dense else None,
        }


def _number(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu()
        value = value.item() if value.numel() == 1 else value.tolist()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def write_json(path: Path, payload: Mapping[str, Any]) -> None:
    """Write atomically: a reader (the sweep summary) never sees a half-written file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(payload, indent=2, sort_keys=False, default=str) + "\n")
    os.replace(tmp, path)


class ResultsWriter(Callback):
    """Writes ``results.json`` into the job's output directory on global rank 0 at the end of fit
    (and merges test metrics after ``trainer.test``). Works under every launcher, since it runs
    inside the training processes: under the spawn launcher the launching process is no rank.
    """

    def __init__(
        self, output_dir: str | os.PathLike[str], config: Mapping[str, Any], job: Mapping[str, Any] | None = None
    ) -> None:
        self.path = Path(output_dir) / RESULTS_FILE
        self.config = dict(config)
        self.job = dict(job or {})
        self.results: dict[str, Any] = {}
        self._fit_start: float | None = None

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._fit_start = time.perf_counter()

    def _find(self, trainer: Trainer, kind: type) -> Any:
        return next((c for c in trainer.callbacks if isinstance(c, kind)), None)

    def collect(self, trainer: Trainer, pl_module: LightningModule) -> dict[str, Any]:
        throughput = self._find(trainer, SamplesPerSecond)
        comm = self._find(trainer, CommunicationStats)
        comm_summary = comm.summary() if comm is not None else {}
        speed = throughput.summary() if throughput is not None else {}
        return {
            "status": "interrupted" if trainer.interrupted else "completed",
            "name": self.config.get("name"),
            "job": self.job,
            "world_size": trainer.world_size,
            "global_step": trainer.global_step,
            "epochs": trainer.current_epoch,
            "fit_seconds": time.perf_counter() - self._fit_start if self._fit_start else None,
            "parameters": sum(p.numel() for p in pl_module.parameters()),
            # per-step throughput is summarized under "throughput" (the last step's value says little)
            "final_metrics": {
                key: _number(value)
                for key, value in sorted(trainer.callback_metrics.items())
                if not key.startswith("perf/")
            },
            "samples_per_sec": speed.get("samples_per_sec"),
            "bytes_sent_per_step": comm_summary.get("bytes_sent_per_step"),
            "bytes_received_per_step": comm_summary.get("bytes_received_per_step"),
            "dense_equivalent_bytes_per_step": comm_summary.get("dense_equivalent_bytes_per_step"),
            "throughput": speed,
            "communication": comm_summary,
            "config": self.config,
        }

    @override
    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.results = self.collect(trainer, pl_module)
        if trainer.is_global_zero:
            write_json(self.path, self.results)

    @override
    def on_test_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        metrics = {key: _number(value) for key, value in trainer.callback_metrics.items() if key.startswith("test/")}
        if not self.results and self.path.exists():  # fit ran in other (spawned) processes
            self.results = json.loads(self.path.read_text())
        self.results.setdefault("final_metrics", {}).update(metrics)
        if trainer.is_global_zero:
            write_json(self.path, self.results)
