"""Training through the sparse collectives (zen, sparcml, oktopk): the loss falls, ranks agree."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

import ssfusion_lightning as ssf
from tests.workloads import Regressor, make_trainer, regression_data

STEPS = 40


def full_loss(model: Regressor) -> float:
    x, y = regression_data().tensors
    with torch.no_grad():
        return float(torch.nn.functional.mse_loss(model(x), y))


def train_with(comm: str, steps: int = STEPS) -> dict:
    L.seed_everything(0, verbose=False)
    model = Regressor()
    before = full_loss(model)
    strategy = ssf.SSFusionStrategy(sparsifier="topk", density=0.05, fusion="ahead", comm=comm, offload="none")
    trainer = make_trainer(strategy, steps)
    trainer.fit(model, DataLoader(regression_data(), batch_size=16))
    return {
        "before": before,
        "after": full_loss(model),
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "bytes_received": strategy.last_metrics.bytes_received,
        "dense_equivalent": strategy.last_metrics.dense_equivalent_bytes,
    }


def check(results: list[dict]) -> None:
    first = results[0]
    for rank, res in enumerate(results):
        assert res["after"] < 0.6 * res["before"], f"rank {rank}: loss {res['before']:.4f} -> {res['after']:.4f}"
        assert res["params"].keys() == first["params"].keys()
        for name, value in res["params"].items():
            assert torch.equal(value, first["params"][name]), f"rank {rank}: {name} differs from rank 0"
        assert 0 < res["bytes_received"] < res["dense_equivalent"]


@pytest.mark.parametrize("comm", ["zen", "sparcml", "oktopk"])
def test_sparse_comm_training_2_ranks(pool2, comm):
    check(pool2.run(train_with, comm))


@pytest.mark.parametrize("comm", ["zen", "sparcml", "oktopk"])
def test_sparse_comm_training_3_ranks(pool3, comm):
    check(pool3.run(train_with, comm))
