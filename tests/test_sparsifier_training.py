"""Every sparsifier trains on 2 gloo ranks, keeps the ranks identical, and resumes bit for bit.

One ``pool2.run`` call per group of sparsifiers (process start-up and Trainer set-up dominate):
for each sparsifier a straight run of 2N steps that writes a checkpoint after N steps, and a
second run that resumes from that checkpoint for the remaining N steps. The straight run's
loss (on the whole training set, before vs after) must drop, its parameters must be identical
on both ranks, and the resumed run must end with exactly the straight run's parameters -- which
needs every rank's error-feedback residuals and sparsifier state (thresholds, step counters,
interleaving phase, randomk's step) restored to the same rank.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.utils.data import DataLoader

import ssfusion_lightning as ssf
from tests.workloads import Regressor, make_trainer, regression_data

STEPS = 8  # N: checkpoint after N steps, 2N steps in all
SAMPLES = 32  # 16 per rank: one batch per epoch, so every step sees the same data on resume
GROUPS = [
    ["none", "nonzero", "topk", "randomk"],
    ["dgc", "gaussiank", "redsync", "sidco"],
    ["threshold_reuse", "adtopk", "adtopk_interleaved"],
]


class SaveAt(Callback):
    def __init__(self, step: int, path: str) -> None:
        self.step, self.path = step, path

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)  # every rank: the strategy gathers each rank's engine state


class PlainSGDRegressor(Regressor):
    """DGC's memory carries the momentum itself: the optimizer must not add its own."""

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.0)


def _model(memory: str) -> Regressor:
    return PlainSGDRegressor(lr=0.05) if memory == "dgc" else Regressor(lr=0.05)


def _strategy(name: str, memory: str, options: dict) -> ssf.SSFusionStrategy:
    # an instance carries its density; a name takes the strategy's
    by_name = {} if options else {"density": 0.05}
    sparsifier = ssf.build_sparsifier(name, density=0.05, **options) if options else name
    return ssf.SSFusionStrategy(
        sparsifier=sparsifier,
        **by_name,
        memory=memory,
        fusion="ahead",
        comm="allgather",
        offload="none",
        process_groups=1,
    )


def _full_loss(model: nn.Module, data) -> float:
    x, y = data.tensors
    with torch.no_grad():
        return float(nn.functional.mse_loss(model(x), y))


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def train_and_resume(runs: list[tuple[str, str, dict]], directory: str) -> dict:
    """Runs inside every pool rank; returns {label: (loss before, loss after, straight params, resumed params)}."""
    data = regression_data(n=SAMPLES)
    results = {}
    for name, memory, options in runs:
        label = f"{name}/{memory}"
        path = f"{directory}/{name}-{memory}.ckpt"

        L.seed_everything(0, verbose=False)
        model = _model(memory)
        before = _full_loss(model, data)
        trainer = make_trainer(_strategy(name, memory, options), 2 * STEPS, callbacks=[SaveAt(STEPS, path)])
        trainer.fit(model, DataLoader(data, batch_size=16))
        assert trainer.global_step == 2 * STEPS
        straight = _params(model)
        after = _full_loss(model, data)

        L.seed_everything(0, verbose=False)
        resumed_model = _model(memory)
        trainer = make_trainer(_strategy(name, memory, options), 2 * STEPS)
        trainer.fit(resumed_model, DataLoader(data, batch_size=16), ckpt_path=path)
        assert trainer.global_step == 2 * STEPS
        results[label] = (before, after, straight, _params(resumed_model))
    return results


def check(results_per_rank: list[dict]) -> None:
    rank0 = results_per_rank[0]
    for label, (before, after, straight, resumed) in rank0.items():
        assert after < 0.7 * before, f"{label}: loss {before:.4f} -> {after:.4f} did not decrease"
        for name in straight:
            for rank, other in enumerate(results_per_rank[1:], start=1):
                assert torch.equal(straight[name], other[label][2][name]), f"{label}: {name} differs on rank {rank}"
            assert torch.equal(straight[name], resumed[name]), f"{label}: resumed {name} differs from the straight run"
        for rank, other in enumerate(results_per_rank):
            for name in straight:
                assert torch.equal(other[label][2][name], other[label][3][name]), f"{label}: rank {rank} resume {name}"


@pytest.mark.parametrize("group", GROUPS, ids=["+".join(g) for g in GROUPS])
def test_every_sparsifier_trains_and_resumes_on_2_ranks(pool2, tmp_path, group):
    check(pool2.run(train_and_resume, [(name, "residual", {}) for name in group], str(tmp_path)))


def test_dgc_memory_and_sparsifier_options_resume_on_2_ranks(pool2, tmp_path):
    runs = [
        ("dgc", "dgc", {}),  # DGC's momentum-corrected memory: momenta and velocities are per rank
        ("sidco", "residual", {"distribution": "gpareto"}),
        ("threshold_reuse", "residual", {"tau": 3}),  # exact steps before and after the checkpoint
    ]
    check(pool2.run(train_and_resume, runs, str(tmp_path)))


def test_all_sparsifiers_are_covered():
    covered = {name for group in GROUPS for name in group}
    assert covered == set(ssf.available_sparsifiers())
