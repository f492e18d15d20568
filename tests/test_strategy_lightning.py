"""SSFusionStrategy under Lightning's own DDP test patterns, checkpoints and lifecycle."""

from __future__ import annotations

import os
import pickle

import lightning as L
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.demos.boring_classes import BoringModel, ManualOptimBoringModel, RandomDataset
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.strategies import StrategyRegistry
from torch.utils.data import DataLoader

import ssfusion_lightning as ssf
from tests.workloads import Regressor, make_trainer, regression_data

SPARSE = dict(sparsifier="topk", density=0.05, fusion="ahead", comm="hybrid", offload="none", process_groups=2)


# ---------------------------------------------------------------- construction (no ranks needed)
def test_registry_holds_the_system_presets():
    for name in ("ssfusion", "ssfusion_spawn", "safusion", "adtopk", "zen", "oktopk"):
        assert name in StrategyRegistry
        assert StrategyRegistry[name]["strategy"] is ssf.SSFusionStrategy
    assert StrategyRegistry["ssfusion_spawn"]["init_params"]["start_method"] == "spawn"
    assert StrategyRegistry["zen"]["init_params"]["comm"] == "zen"


def test_registration_is_idempotent():
    import importlib

    importlib.reload(ssf)
    ssf.SSFusionStrategy.register_strategies(StrategyRegistry)
    assert "ssfusion" in StrategyRegistry


def test_strategy_string_reaches_the_trainer():
    trainer = L.Trainer(strategy="ssfusion", accelerator="cpu", devices=2, logger=False)
    strategy = trainer.strategy
    assert isinstance(strategy, ssf.SSFusionStrategy)
    assert (strategy.fusion_name, strategy.comm_name, strategy.offload) == ("selective", "auto", "auto")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"sparsifier": "bogus"}, "unknown sparsifier 'bogus'; valid choices:"),
        ({"fusion": "sideways"}, "unknown fusion policy 'sideways'; valid choices:"),
        ({"comm": "pigeon"}, "unknown comm 'pigeon'; valid choices:"),
        ({"memory": "goldfish"}, "unknown memory 'goldfish'; valid choices:"),
        ({"offload": "gpu"}, "unknown offload 'gpu'; valid choices: auto, none, stream, thread"),
        ({"density": 0.0}, "0 < density <= 1, got 0.0"),
        ({"density": 1.5}, "0 < density <= 1, got 1.5"),
        ({"buffer_mb": -1}, 'buffer_mb must be a positive number or "auto", got -1'),
        ({"first_buffer_mb": 0}, "first_buffer_mb must be a positive number or None (= buffer_mb), got 0"),
        ({"process_groups": 0}, "process_groups must be an integer >= 1, got 0"),
        ({"warmup_steps": -2}, "warmup_steps must be an integer >= 0, got -2"),
        ({"nonfinite": "ignore"}, "unknown nonfinite policy 'ignore'; valid choices: raise, skip"),
    ],
)
def test_bad_arguments_name_the_value_and_the_choices(kwargs, message):
    with pytest.raises(ValueError) as error:
        ssf.SSFusionStrategy(**{**SPARSE, **kwargs})
    assert message in str(error.value)


def test_component_options_reach_the_components_and_are_checked_early():
    strategy = ssf.SSFusionStrategy(**dict(SPARSE, comm="zen"), comm_options={"choice": "sparcml"})
    assert strategy.comm_options == {"choice": "sparcml"}
    with pytest.raises(TypeError, match="colour"):
        ssf.SSFusionStrategy(**SPARSE, comm_options={"colour": "blue"})


def test_unknown_keyword_is_an_error():
    with pytest.raises(TypeError, match="bucket_view"):
        ssf.SSFusionStrategy(gradient_as_bucket_view=True)


def test_strategy_pickles_before_setup():
    strategy = ssf.SSFusionStrategy(**SPARSE)
    clone = pickle.loads(pickle.dumps(strategy))
    assert clone.comm_name == "hybrid" and clone.engine is None


# ---------------------------------------------------------------- gradients in sync (Lightning's DDP test)
class GradRecordingModel(BoringModel):
    """Keeps, at every step, each parameter's local gradient (on_after_backward runs before the
    strategy's post_backward, so before the engine synchronizes) and the gradient the optimizer sees."""

    def __init__(self) -> None:
        super().__init__()
        self.local: list[dict[str, torch.Tensor]] = []
        self.synced: list[dict[str, torch.Tensor]] = []

    def on_after_backward(self):
        self.local.append({n: p.grad.detach().clone() for n, p in self.named_parameters()})

    def on_before_optimizer_step(self, optimizer):
        self.synced.append({n: p.grad.detach().clone() for n, p in self.named_parameters()})


def grads_in_sync_run(kwargs):
    L.seed_everything(1, verbose=False)
    model = GradRecordingModel()
    make_trainer(ssf.SSFusionStrategy(**kwargs), 4).fit(model)
    return model.local, model.synced, {n: p.detach().clone() for n, p in model.named_parameters()}


# ddp_handoff off: the local gradients are read before the engine's round (DDP's reducer syncs in the backward)
@pytest.mark.parametrize("kwargs", [dict(SPARSE, sparsifier="none", ddp_handoff=False), SPARSE], ids=["dense", "topk"])
def test_gradients_are_in_sync(pool2, kwargs):
    (local0, synced0, params0), (local1, synced1, params1) = pool2.run(grads_in_sync_run, kwargs)
    assert len(synced0) == len(synced1) == 4
    for step in range(4):
        assert synced0[step].keys() == synced1[step].keys() == {"layer.weight", "layer.bias"}
        for name in synced0[step]:
            # the ranks' own gradients differ (different batches), what the optimizer sees does not
            assert not torch.equal(local0[step][name], local1[step][name]), f"step {step}: {name} was equal before sync"
            assert torch.equal(synced0[step][name], synced1[step][name]), f"step {step}: {name} differs across ranks"
            if kwargs["sparsifier"] == "none":  # dense: DDP's mean of the ranks' gradients
                mean = (local0[step][name] + local1[step][name]) / 2
                torch.testing.assert_close(synced0[step][name], mean, rtol=1e-6, atol=1e-7)
    for name in params0:
        assert torch.equal(params0[name], params1[name]), f"{name} differs across ranks after training"


# ---------------------------------------------------------------- BoringModel: fit / validate / test / predict
class LoggingBoringModel(BoringModel):
    def validation_step(self, batch, batch_idx):
        loss = self.step(batch)
        self.log("val_loss", loss, sync_dist=True)
        return {"x": loss}

    def test_step(self, batch, batch_idx):
        loss = self.step(batch)
        self.log("test_loss", loss, sync_dist=True)
        return {"y": loss}


def boring_lifecycle_run():
    L.seed_everything(2, verbose=False)
    model = LoggingBoringModel()
    trainer = make_trainer(ssf.SSFusionStrategy(**SPARSE), 3, limit_val_batches=2, limit_test_batches=2, limit_predict_batches=2)
    trainer.fit(model)
    strategy = trainer.strategy
    torn_down = strategy.engine is None and not strategy._groups
    hooks_left = sum(len(getattr(p, "_post_accumulate_grad_hooks", None) or {}) for p in model.parameters())
    validated = trainer.validate(model, verbose=False)
    tested = trainer.test(model, verbose=False)
    predicted = trainer.predict(model, DataLoader(RandomDataset(32, 8), batch_size=2))
    return torn_down, hooks_left, validated, tested, len(predicted)


def test_boring_model_fit_validate_test_predict(pool2):
    for torn_down, hooks_left, validated, tested, predicted in pool2.run(boring_lifecycle_run):
        assert torn_down and hooks_left == 0
        assert "val_loss" in validated[0] and "test_loss" in tested[0]
        assert predicted == 2


# ---------------------------------------------------------------- manual optimization, bf16, clipping
def special_modes_run():
    results = {}
    L.seed_everything(3, verbose=False)
    model = ManualOptimBoringModel()
    before = [p.detach().clone() for p in model.parameters()]
    make_trainer(ssf.SSFusionStrategy(**SPARSE), 3).fit(model)
    results["manual_moved"] = any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    for mode, kwargs in {"bf16": {"precision": "bf16-mixed"}, "clip": {"gradient_clip_val": 1e-3}}.items():
        L.seed_everything(3, verbose=False)
        model = Regressor()
        make_trainer(ssf.SSFusionStrategy(**SPARSE), 3, **kwargs).fit(model, DataLoader(regression_data(), batch_size=16))
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        results[mode] = (torch.isfinite(flat).all().item(), flat)
    return results


def test_manual_optimization_bf16_and_clipping(pool2):
    per_rank = pool2.run(special_modes_run)
    for results in per_rank:
        assert results["manual_moved"]
        assert results["bf16"][0] and results["clip"][0]
    for mode in ("bf16", "clip"):
        assert torch.equal(per_rank[0][mode][1], per_rank[1][mode][1]), f"{mode}: ranks differ"


def world_size_one_run():
    L.seed_everything(4, verbose=False)
    model = Regressor()
    before = torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])
    make_trainer(ssf.SSFusionStrategy(**SPARSE), 3).fit(model, DataLoader(regression_data(), batch_size=16))
    after = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return not torch.equal(before, after)


def test_world_size_one(rank_pools):
    assert rank_pools(1).run(world_size_one_run) == [True]


# ---------------------------------------------------------------- checkpoints
class Scheduled(Regressor):
    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)]


class EngineStateAtEnd(L.Callback):
    def on_train_end(self, trainer, pl_module):
        self.state = trainer.strategy.engine.state_dict()


def checkpoint_run(directory: str, steps: int, checkpoint_every: int, kwargs: dict):
    """Train ``steps`` writing a checkpoint every ``checkpoint_every`` steps, then resume from the
    first checkpoint in a fresh Trainer and train to ``steps`` again. Returns both end states."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    def train(callbacks, ckpt_path=None):
        L.seed_everything(5, verbose=False)
        model = Scheduled()
        end = EngineStateAtEnd()
        # default_root_dir: the resumed run has no ModelCheckpoint of its own, so Lightning adds one
        # that writes under default_root_dir (the working directory when unset)
        trainer = make_trainer(
            ssf.SSFusionStrategy(**kwargs), steps, max_epochs=-1, callbacks=[end, *callbacks], enable_checkpointing=True,
            default_root_dir=directory,
        )
        trainer.fit(model, DataLoader(regression_data(), batch_size=16, shuffle=True), ckpt_path=ckpt_path)
        params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        return params, end.state, trainer.optimizers[0].param_groups[0]["lr"]

    saver = ModelCheckpoint(dirpath=directory, every_n_train_steps=checkpoint_every, save_top_k=-1, filename="{step}")
    straight = train([saver])
    resumed = train([], ckpt_path=os.path.join(directory, f"step={checkpoint_every}.ckpt"))
    return straight, resumed


RESUME_CASES = {
    "ahead-hybrid": SPARSE,
    "layerwise-allgather": dict(SPARSE, fusion="layerwise", comm="allgather"),
    # profiled, frozen plan + offload decisions must come back from the checkpoint
    "selective-auto-offload-dgc": dict(SPARSE, sparsifier="dgc", fusion="selective", offload="auto"),
    "adaptive-threshold-reuse": dict(SPARSE, sparsifier="threshold_reuse", fusion="adaptive", comm="allgather"),
    # resumed in the middle of the warm-up, whose length in epochs is only known once training starts
    "density-warmup-epochs": dict(SPARSE, density_warmup_epochs=2),
}


@pytest.mark.parametrize("kwargs", RESUME_CASES.values(), ids=RESUME_CASES.keys())
def test_resume_gives_the_same_trajectory(pool2, tmp_path, kwargs):
    # 8 batches per rank per epoch: resume at the epoch boundary (mid-epoch resume needs a
    # stateful sampler: Lightning's own ddp replays the epoch's first batches there too)
    for (p1, s1, lr1), (p2, s2, lr2) in pool2.run(checkpoint_run, str(tmp_path), 20, 8, kwargs):
        assert torch.equal(p1, p2)
        assert s1["format"] == s2["format"] == 1
        assert lr1 == lr2 == 0.05 * 0.5
        assert s1["step"] == s2["step"] == 20
        assert s1["plan"] == s2["plan"] and s1["costs"] == s2["costs"]
        assert s1["sparsifier"].keys() == s2["sparsifier"].keys()
        residuals1, residuals2 = s1["memory"]["residuals"], s2["memory"]["residuals"]
        assert residuals1.keys() == residuals2.keys() and residuals1
        for key in residuals1:
            assert torch.equal(residuals1[key], residuals2[key]), key
    # the mid-training checkpoint loads the usual ways, with torch's safe default (weights_only=True)
    path = tmp_path / "step=8.ckpt"
    checkpoint = torch.load(path)
    assert [state["step"] for state in checkpoint["ssfusion_engine"]["ranks"]] == [8, 8]
    model = Scheduled.load_from_checkpoint(path)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, checkpoint["state_dict"][name]), name


def resume_on_other_world_size(directory: str, kwargs: dict):
    import warnings

    L.seed_everything(5, verbose=False)
    end = EngineStateAtEnd()
    trainer = make_trainer(ssf.SSFusionStrategy(**kwargs), 5, max_epochs=-1, callbacks=[end])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(Scheduled(), DataLoader(regression_data(), batch_size=16), ckpt_path=os.path.join(directory, "step=3.ckpt"))
    warned = any("world size 2, now 3" in str(w.message) for w in caught)
    return end.state["step"], warned


def test_world_size_change_resets_residuals_with_a_warning(pool2, pool3, tmp_path):
    pool2.run(checkpoint_run, str(tmp_path), 4, 3, SPARSE)  # writes step=3.ckpt
    results = pool3.run(resume_on_other_world_size, str(tmp_path), SPARSE)
    assert [step for step, _ in results] == [5, 5, 5]
    assert results[0][1], "rank 0 must warn about the reset"



# ---------------------------------------------------------------- logging
def logged_metrics_run(directory: str):
    L.seed_everything(6, verbose=False)
    logger = CSVLogger(directory, name="run")
    trainer = make_trainer(ssf.SSFusionStrategy(**SPARSE), 4, logger=logger, log_every_n_steps=1)
    trainer.fit(Regressor(), DataLoader(regression_data(), batch_size=16))
    logger.finalize("success")
    return logger.log_dir if dist.get_rank() == 0 else None


def train_accuracy_run():
    from torch.utils.data import TensorDataset

    from ssfusion_lightning.models.tasks.image import ImageClassifier

    rank = dist.get_rank()
    L.seed_everything(3 + rank, verbose=False)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 10))
    hits, seen = [], []
    # the ranks' batches differ in size (12 and 24 samples, 3 batches each), so the mean of the ranks'
    # accuracies is not the accuracy of their samples
    size = 12 * (rank + 1)
    data = DataLoader(TensorDataset(torch.randn(size, 1, 8, 8), torch.randint(0, 10, (size,))), batch_size=size // 3)

    class Record(L.Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            with torch.no_grad():
                hits.append(int((model(batch[0]).argmax(1) == batch[1]).sum()))
            seen.append(len(batch[1]))

    task = ImageClassifier(model, num_classes=10, lr=0.1)
    trainer = make_trainer(
        ssf.SSFusionStrategy(**SPARSE), 3, use_distributed_sampler=False, callbacks=[Record()], limit_val_batches=1.0
    )
    trainer.fit(task, data)
    trained = sum(hits), sum(seen), trainer.callback_metrics["train/acc"].item()
    images, labels = data.dataset.tensors
    with torch.no_grad():
        val_hits = int((model(images).argmax(1) == labels).sum())
    trainer.validate(task, data, verbose=False)
    return trained, (val_hits, size, trainer.callback_metrics["val/acc"].item())


def test_accuracy_counts_every_ranks_samples(pool2):
    """train/acc and val/acc are the accuracy of all ranks' samples, where the ranks saw different numbers."""
    results = pool2.run(train_accuracy_run)
    for stage in range(2):
        (hits0, seen0, logged0), (hits1, seen1, logged1) = (result[stage] for result in results)
        expected = (hits0 + hits1) / (seen0 + seen1)
        assert expected != pytest.approx((hits0 / seen0 + hits1 / seen1) / 2, abs=1e-3)  # so a mean of means would fail
        assert logged0 == pytest.approx(expected, abs=1e-6), stage
        assert logged1 == pytest.approx(expected, abs=1e-6), stage


def test_communication_metrics_reach_the_logger(pool2, tmp_path):
    import csv

    log_dir = pool2.run(logged_metrics_run, str(tmp_path))[0]
    with open(os.path.join(log_dir, "metrics.csv")) as handle:
        rows = [r for r in csv.DictReader(handle) if r.get("ssfusion/bytes_sent")]
    assert len(rows) >= 3
    for row in rows:
        assert 0 < float(row["ssfusion/bytes_sent"]) < float(row["ssfusion/dense_equivalent_bytes"])
        assert float(row["ssfusion/sparse_tensors"]) > 0
