"""One node of a 2-node job that trains until its link is cut (run by tests/test_cluster_faults.py)."""

from __future__ import annotations

import os
import sys
from datetime import timedelta

import lightning as L
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import ssfusion_lightning as ssf  # noqa: E402
from tests.workloads import Regressor, regression_data  # noqa: E402


class Quiet(Regressor):
    """No per-step sync_dist logging: the engine's own collectives are the first to notice."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        return ((self(x) - y) ** 2).mean()


class AnnounceSteps(L.Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        print(f"STEP {trainer.global_step}", flush=True)


if __name__ == "__main__":
    L.seed_everything(0, verbose=False)
    strategy = ssf.SSFusionStrategy(
        sparsifier="topk", density=0.05, fusion="ahead", comm="hybrid", offload="none", timeout=timedelta(seconds=15)
    )
    trainer = L.Trainer(
        accelerator="cpu", devices=1, num_nodes=2, strategy=strategy, max_steps=100_000, max_epochs=-1,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[AnnounceSteps()],
    )
    trainer.fit(Quiet(), DataLoader(regression_data(), batch_size=16))
