"""With sparsifier="none" the engine must reproduce Lightning's DDP bit for bit."""

from __future__ import annotations

import pytest
import torch

import ssfusion_lightning as ssf
from ssfusion_lightning.comm import COMMUNICATORS
from ssfusion_lightning.fusion import FUSION_POLICIES
from tests.workloads import fit_and_get_params


def run_pair(kind: str, ddp_name: str, engine_kwargs: dict, **trainer_kwargs):
    reference = fit_and_get_params(ddp_name, kind=kind, **trainer_kwargs)
    ours = fit_and_get_params(ssf.SSFusionStrategy(**engine_kwargs), kind=kind, **trainer_kwargs)
    return reference, ours


# ddp_handoff off: these tests are about the engine's own dense rounds (with it on, DDP's reducer
# would take every step after the first)
DENSE = dict(sparsifier="none", fusion="ahead", comm="allreduce", offload="none", process_groups=1, ddp_handoff=False)


def assert_bitwise_equal(results):
    for rank, (reference, ours) in enumerate(results):
        assert reference.keys() == ours.keys()
        for name in reference:
            assert torch.equal(reference[name], ours[name]), f"rank {rank}: {name} differs from DDP"
    for name in results[0][1]:
        for rank in range(1, len(results)):
            assert torch.equal(results[0][1][name], results[rank][1][name]), f"{name} differs across ranks"


@pytest.mark.parametrize(
    "kind, ddp_name, trainer_kwargs",
    [
        ("plain", "ddp", {}),
        ("plain", "ddp", {"accumulate_grad_batches": 2}),
        ("batchnorm", "ddp", {}),
        ("unused_on_one_rank", "ddp_find_unused_parameters_true", {}),
    ],
    ids=["plain", "accumulate2", "batchnorm", "unused_on_one_rank"],
)
def test_dense_engine_equals_ddp_on_2_ranks(pool2, kind, ddp_name, trainer_kwargs):
    assert_bitwise_equal(pool2.run(run_pair, kind, ddp_name, DENSE, **trainer_kwargs))


def test_dense_engine_equals_ddp_on_4_ranks(pool4):
    assert_bitwise_equal(pool4.run(run_pair, "plain", "ddp", DENSE))


def test_dense_engine_with_a_small_first_buffer_equals_ddp_on_2_ranks(pool2):
    """Three buffers (a 512-byte first one: the last layers' gradients launch during the backward).
    Two ranks: a + b has one rounding wherever the element sits in the buffer, so DDP's one bucket
    must still match bit for bit."""
    engine_kwargs = dict(DENSE, first_buffer_mb=512 / 2**20, buffer_mb=4096 / 2**20)
    assert_bitwise_equal(pool2.run(run_pair, "plain", "ddp", engine_kwargs))


def fit_with_handoff(kind: str, ddp_name: str, engine_kwargs: dict, **trainer_kwargs):
    """DDP's parameters, the engine's with the hand-off on, and per step whether DDP's reducer ran it."""
    import lightning as L

    from tests.workloads import Regressor, make_trainer, regression_data

    reference = fit_and_get_params(ddp_name, kind=kind, **trainer_kwargs)
    strategy = ssf.SSFusionStrategy(**engine_kwargs)
    handed: list[bool] = []

    class Watch(L.Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            handed.append(trainer.strategy.handed_off)

    L.seed_everything(0, verbose=False)
    model = Regressor(kind)
    make_trainer(strategy, 6, callbacks=[Watch()], **trainer_kwargs).fit(
        model, torch.utils.data.DataLoader(regression_data(), batch_size=16)
    )
    ours = {n: p.detach().clone() for n, p in model.named_parameters()}
    return (reference, ours), handed, strategy.handed_off, strategy.last_metrics


@pytest.mark.parametrize(
    "kind, ddp_name, trainer_kwargs",
    [("plain", "ddp", {}), ("plain", "ddp", {"accumulate_grad_batches": 2}), ("batchnorm", "ddp", {}),
     ("unused_on_one_rank", "ddp_find_unused_parameters_true", {})],
    ids=["plain", "accumulate2", "batchnorm", "unused_on_one_rank"],
)
def test_a_plan_dense_for_good_hands_the_gradients_to_ddps_reducer(pool2, kind, ddp_name, trainer_kwargs):
    """sparsifier none: once the first round has rebuilt the plan from the ready order nothing can change
    it, so from the next batch on DDP's reducer synchronizes (accumulation through its no_sync, unused
    parameters through its own search) and the run still ends on DDP's parameters, to the bit. With
    find_unused_parameters there is no ready order to rebuild the plan from, so DDP's reducer runs
    from the first batch. After fit the model is unwrapped again."""
    unused = ddp_name.endswith("true")
    engine_kwargs = dict(DENSE, ddp_handoff=True, find_unused_parameters=unused)
    out = pool2.run(fit_with_handoff, kind, ddp_name, engine_kwargs, **trainer_kwargs)
    assert_bitwise_equal([pair for pair, _, _, _ in out])
    engine_batches = 0 if unused else 2 if trainer_kwargs.get("accumulate_grad_batches") else 1
    for _, handed, after_fit, metrics in out:
        # the first synchronized round is the engine's; every later batch runs under DDP
        assert handed == [False] * engine_batches + [True] * (len(handed) - engine_batches)
        assert not after_fit
        assert metrics.dense_tensors > 0 and metrics.bytes_sent == metrics.dense_equivalent_bytes > 0


def fit_dgc_with_handoff(**trainer_kwargs):
    """DDP's parameters, and memory="dgc"'s with the hand-off on: per step whether DDP's reducer ran it,
    the SGD's momentum after the fit and the momenta the memory kept."""
    (reference, ours), handed, _, _ = fit_with_handoff("plain", "ddp", dict(DENSE, ddp_handoff=True, memory="dgc"), **trainer_kwargs)
    return (reference, ours), handed


def test_momentum_correction_hands_its_momentum_to_the_sgd_with_the_rounds(pool2):
    """memory="dgc" with nothing sparse: the engine's first round is momentum SGD on the ranks' averaged
    momentum correction (the SGD's own momentum 0). From the next round DDP's reducer sums the
    gradients, and the SGD has its momentum back with that average as its buffer: two ranks without
    weight decay end on DDP's parameters to the bit."""
    out = pool2.run(fit_dgc_with_handoff)
    assert_bitwise_equal([pair for pair, _ in out])
    for _, handed in out:
        assert handed == [False] + [True] * (len(handed) - 1)


def every_policy_and_communicator_at_full_density():
    """Top-k at density 1 keeps every element: each fusion policy x communicator must then add up
    exactly what DDP adds up (two ranks: a + b has one rounding whatever the order)."""
    reference = fit_and_get_params("ddp")
    differing = {}
    for fusion in FUSION_POLICIES.names():
        for comm in COMMUNICATORS.names():
            strategy = ssf.SSFusionStrategy(sparsifier="topk", density=1.0, fusion=fusion, comm=comm, offload="none")
            ours = fit_and_get_params(strategy)
            worst = max((reference[n] - ours[n]).abs().max().item() for n in reference)
            if worst != 0.0:
                differing[f"{fusion}+{comm}"] = worst
    return differing


def test_full_density_topk_equals_ddp_for_every_policy_and_communicator(pool2):
    for rank, differing in enumerate(pool2.run(every_policy_and_communicator_at_full_density)):
        assert not differing, f"rank {rank}: max |difference| from DDP per combination: {differing}"


def fit_and_get_state(strategy, **trainer_kwargs) -> dict[str, torch.Tensor]:
    """A BatchNorm regressor's parameters, buffers (running statistics, which a training forward
    updates from the rank's own batch) and, with validation, its last validation loss (an eval
    forward reads the running statistics)."""
    import lightning as L
    from torch.utils.data import DataLoader

    from tests.workloads import Regressor, make_trainer, regression_data

    L.seed_everything(0, verbose=False)
    model = Regressor("batchnorm")
    loader = DataLoader(regression_data(), batch_size=16)
    trainer = make_trainer(strategy, 6, **trainer_kwargs)
    trainer.fit(model, loader, loader if trainer_kwargs.get("limit_val_batches") else None)
    state = {n: t.detach().clone() for n, t in [*model.named_parameters(), *model.named_buffers()]}
    if "val_loss" in trainer.callback_metrics:
        state["val_loss"] = trainer.callback_metrics["val_loss"].detach().clone()
    return state


def buffers_pair(trainer_kwargs: dict):
    return fit_and_get_state("ddp", **trainer_kwargs), fit_and_get_state(ssf.SSFusionStrategy(**DENSE), **trainer_kwargs)


@pytest.mark.parametrize(
    "trainer_kwargs",
    [{}, {"accumulate_grad_batches": 2}, {"limit_val_batches": 2, "val_check_interval": 2}],
    ids=["plain", "accumulate2", "validation"],
)
def test_buffers_equal_ddps_on_every_rank(pool2, trainer_kwargs):
    """DDP broadcasts rank 0's buffers in front of each forward that follows a synchronized one, and
    so does the strategy. Every rank ends with DDP's buffers (its own last batch's update on rank 0's
    statistics)."""
    results = pool2.run(buffers_pair, trainer_kwargs)
    for rank, (reference, ours) in enumerate(results):
        assert reference.keys() == ours.keys()
        for name in reference:
            assert torch.equal(reference[name], ours[name]), f"rank {rank}: {name} differs from DDP"
    means = [ours["net.1.running_mean"] for _, ours in results]
    if "limit_val_batches" in trainer_kwargs:
        # the run ends with a validation, whose eval forward got rank 0's statistics on every rank
        assert "val_loss" in results[0][1] and torch.equal(means[0], means[1])
    else:
        # each rank's last batch updated rank 0's statistics: they differ, so DDP's are not trivial
        assert not torch.equal(means[0], means[1])
