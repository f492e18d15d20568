"""A 2-rank job whose rank 1 dies in the middle of step 3 (run by tests/test_reliability.py)."""

from __future__ import annotations

import os
import sys
from datetime import timedelta

import lightning as L
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import ssfusion_lightning as ssf  # noqa: E402
from tests.workloads import Regressor, make_trainer, regression_data  # noqa: E402


class DiesAtStep3(Regressor):
    # before its backward, so it launches none of the step's exchanges: after it (the hook runs
    # before the engine's finish) the step's buffers may already be reduced, with no control
    # round left to fail in step 3 (the vote rides in the last buffer)
    def on_before_backward(self, loss):
        if self.global_step == 3 and self.global_rank == 1:
            os._exit(17)


if __name__ == "__main__":
    L.seed_everything(0, verbose=False)
    strategy = ssf.SSFusionStrategy(
        sparsifier="topk", density=0.05, fusion="ahead", comm="hybrid", offload="none", timeout=timedelta(seconds=15)
    )
    trainer = make_trainer(strategy, 20, devices=2, max_epochs=-1)
    trainer.fit(DiesAtStep3(), DataLoader(regression_data(), batch_size=16))
