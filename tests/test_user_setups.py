"""The setups users run, each next to Lightning's ddp on the same script (issue 21): fp16 with a
GradScaler, sparse embeddings, channels_last, two optimizers in manual optimization; and the
construction checks and error notes."""

from __future__ import annotations

from datetime import timedelta

import lightning as L
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ssfusion_lightning as ssf
from ssfusion_lightning.engine.errors import CommunicationError, NonFiniteGradientError
from ssfusion_lightning.sparsifiers import build_memory, build_sparsifier
from tests.rank_pool import RankPool
from tests.workloads import Regressor, make_trainer, regression_data

SPARSE = dict(sparsifier="topk", density=0.1, fusion="ahead", comm="hybrid", offload="none")
DENSE = dict(sparsifier="none", fusion="ahead", comm="allreduce", offload="none", process_groups=1)
STEP_NOTE = "(communication round of this rank) failed"


def strategy_for(kwargs: dict | str):
    return kwargs if isinstance(kwargs, str) else ssf.SSFusionStrategy(**kwargs)


def named_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def assert_same_params(reference: dict, ours: dict, what: str) -> None:
    assert reference.keys() == ours.keys()
    for name in reference:
        assert torch.equal(reference[name], ours[name]), f"{what}: {name} differs from DDP"


def memory_snapshot(trainer: L.Trainer) -> dict[str, torch.Tensor]:
    """Every tensor of the error-feedback state (residuals; DGC's momenta and velocities)."""
    state = trainer.strategy.engine.memory.state_dict()
    return {f"{part}/{key}": value.clone() for part, tensors in state.items() for key, value in tensors.items()}


# ---------------------------------------------------------------- 1. fp16 mixed precision with a GradScaler
class ScalerTrace(L.Callback):
    """Per step: the scale the scaler holds after it, whether the engine skipped it, and the
    error-feedback residuals and sparsifier state the engine holds after it."""

    def __init__(self) -> None:
        self.scales: list[float] = []
        self.skipped: list[int] = []
        self.residuals: list[dict[str, torch.Tensor]] = []

    def on_train_batch_end(self, trainer, *args) -> None:
        self.scales.append(trainer.precision_plugin.scaler.get_scale())
        if isinstance(trainer.strategy, ssf.SSFusionStrategy):
            self.skipped.append(int(trainer.strategy.last_metrics.skipped_steps))
            self.residuals.append(memory_snapshot(trainer))


def fp16_run(kwargs: dict | str, steps: int = 12):
    L.seed_everything(0, verbose=False)
    model = Regressor()
    trace = ScalerTrace()
    # 2^24 overflows the first steps (the point of the test); DDP lowers it and trains on
    plugin = MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu", init_scale=2.0**24))
    trainer = make_trainer(strategy_for(kwargs), steps, plugins=[plugin], callbacks=[trace])
    trainer.fit(model, DataLoader(regression_data(), batch_size=16))
    return trace, named_params(model)


def fp16_against_ddp():
    reference, reference_params = fp16_run("ddp")
    ours = {
        name: fp16_run(kwargs)
        for name, kwargs in {
            "dense": DENSE,
            "topk-residual": SPARSE,
            "dgc-memory": dict(SPARSE, memory="dgc"),
            "default": dict(sparsifier="dgc", density=0.1, offload="none"),
        }.items()
    }
    return reference.scales, reference_params, {name: (t.scales, t.skipped, t.residuals, p) for name, (t, p) in ours.items()}


def test_fp16_with_a_grad_scaler_skips_overflowing_steps_like_ddp(pool2):
    for ddp_scales, ddp_params, ours in pool2.run(fp16_against_ddp, timeout=600):
        assert ddp_scales[0] < 2.0**24 and min(ddp_scales) < ddp_scales[0], "the script must overflow under DDP too"
        for name, (scales, skipped, residuals, params) in ours.items():
            assert scales == ddp_scales, f"{name}: scale trajectory {scales} != DDP's {ddp_scales}"
            lowered = [before > after for before, after in zip([2.0**24] + scales, scales)]
            assert [bool(s) for s in skipped] == lowered, f"{name}: the engine skipped {skipped}"
            assert all(torch.isfinite(p).all() for p in params.values()), name
            for step, was_skipped in enumerate(skipped):
                if was_skipped:  # error feedback untouched by a step handed to the scaler
                    before = residuals[step - 1] if step else {}
                    assert residuals[step].keys() == before.keys(), f"{name}: step {step}"
                    assert all(torch.equal(residuals[step][k], before[k]) for k in before), f"{name}: step {step}"
            if name != "dense":
                assert residuals[-1], f"{name}: no residual after the finite steps"
        assert_same_params(ddp_params, ours["dense"][3], "fp16 dense")


@pytest.mark.parametrize("memory", ["residual", "dgc"])
def test_error_feedback_is_kept_in_unscaled_units(memory):
    """A scale that changes between steps (the scaler halves it after an overflow, doubles it after a
    run of finite steps) must not change what is selected or owed: with power-of-two scales, the
    scaled run selects exactly the scaled values of the unscaled run, and owes the same residual."""
    torch.manual_seed(0)
    grads = [torch.randn(6, 5) for _ in range(5)]
    scales = [2.0**16, 2.0**15, 2.0**15, 2.0**17, 2.0**3]
    plain, scaled = build_memory(memory), build_memory(memory)
    topk = build_sparsifier("topk", density=0.2)
    for grad, factor in zip(grads, scales):
        loss_scale = torch.tensor(factor)
        expected = plain.compensate("w", grad)
        got = scaled.compensate("w", grad * factor, loss_scale=loss_scale)
        assert torch.equal(got, expected * factor)
        _, sent = topk.select(expected, key="w")
        plain.update("w", expected, sent)
        scaled.update("w", got, sent, loss_scale=loss_scale)
        assert torch.equal(scaled.residual("w"), plain.residual("w"))


# ---------------------------------------------------------------- 2. nn.Embedding(sparse=True)
class SparseEmbeddingModel(L.LightningModule):
    """Bag-of-words regression on a sparse embedding table; records this rank's own embedding
    gradient (before any sync) and the synchronized one the optimizer sees, per step."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(60, 6, sparse=True)
        self.head = nn.Linear(6, 1)
        self.local: list[torch.Tensor] = []
        self.synced: list[torch.Tensor] = []
        self.layouts: list[tuple[torch.layout, bool]] = []
        self.embedding.weight.register_hook(lambda grad: self.local.append(grad.coalesce().to_dense()))

    def training_step(self, batch, batch_idx):
        tokens, target = batch
        return nn.functional.mse_loss(self.head(self.embedding(tokens).mean(1)), target)

    def on_before_optimizer_step(self, optimizer) -> None:
        grad = self.embedding.weight.grad
        self.layouts.append((grad.layout, grad.is_coalesced() if grad.is_sparse else False))
        self.synced.append(grad.to_dense().clone())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)  # SGD takes sparse gradients


def embedding_run(kwargs: dict | str):
    L.seed_everything(0, verbose=False)
    model = SparseEmbeddingModel()
    g = torch.Generator().manual_seed(3)
    data = TensorDataset(torch.randint(0, 60, (96, 3), generator=g), torch.randn(96, 1, generator=g))
    make_trainer(strategy_for(kwargs), 4).fit(model, DataLoader(data, batch_size=8))
    return named_params(model), model.layouts, model.local, model.synced


def embedding_against_ddp():
    reference = embedding_run("ddp")
    ours = {
        "none": embedding_run(DENSE),
        "default": embedding_run(dict(density=0.1, offload="none")),
        "zen": embedding_run(dict(SPARSE, comm="zen")),
        "oktopk": embedding_run(dict(sparsifier="threshold_reuse", density=0.1, fusion="behind", comm="oktopk", offload="none")),
    }
    return reference, ours


def test_sparse_embedding_gradients_are_synced_losslessly_like_ddp(pool2):
    per_rank = pool2.run(embedding_against_ddp, timeout=600)
    for (ddp_params, ddp_layouts, _, _), ours in per_rank:
        assert ddp_layouts[0] == (torch.sparse_coo, True)
        assert_same_params(ddp_params, ours["none"][0], "sparse embedding, sparsifier='none'")
        for name, (_, layouts, _, _) in ours.items():
            assert layouts == ddp_layouts, f"{name}: .grad layouts {layouts}, DDP leaves {ddp_layouts}"
    # whatever the sparsifier and communicator: the synchronized gradient is the exact mean of the
    # ranks' own (two ranks: a/2 + b/2 has one rounding, as (a + b)/2 has)
    for name in per_rank[0][1]:
        (_, _, local0, synced0), (_, _, local1, synced1) = per_rank[0][1][name], per_rank[1][1][name]
        for step, (a, b) in enumerate(zip(local0, local1)):
            assert torch.equal(synced0[step], (a + b) / 2), f"{name}: step {step} is not the exact mean"
            assert torch.equal(synced0[step], synced1[step]), f"{name}: ranks differ at step {step}"


# ---------------------------------------------------------------- 3. channels_last
class ChannelsLastNet(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU())
        self.head = nn.Linear(8, 1)
        self.to(memory_format=torch.channels_last)

    def training_step(self, batch, batch_idx):
        images, target = batch
        features = self.body(images.contiguous(memory_format=torch.channels_last)).mean((2, 3))
        return nn.functional.mse_loss(self.head(features), target)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def channels_last_run(kwargs: dict | str):
    L.seed_everything(0, verbose=False)
    model = ChannelsLastNet()
    g = torch.Generator().manual_seed(4)
    data = TensorDataset(torch.randn(64, 3, 6, 6, generator=g), torch.randn(64, 1, generator=g))
    make_trainer(strategy_for(kwargs), 4).fit(model, DataLoader(data, batch_size=8))
    layouts = {
        n: (p.is_contiguous(memory_format=torch.channels_last), p.grad is None or p.grad.stride() == p.stride())
        for n, p in model.named_parameters()
        if p.dim() == 4
    }
    return named_params(model), layouts


def channels_last_against_ddp():
    reference = channels_last_run("ddp")
    # top-k at density 1 sends everything, so it must equal DDP while running every view of
    # error feedback; lower densities must run and keep the layout
    ours = {
        f"{memory}-{density}": channels_last_run(dict(SPARSE, density=density, memory=memory))
        for memory in ("residual", "dgc")
        for density in (1.0, 0.1)
    }
    ours["none"] = channels_last_run(DENSE)
    return reference, ours


def test_channels_last_models_train_like_ddp(pool2):
    for (ddp_params, ddp_layouts), ours in pool2.run(channels_last_against_ddp, timeout=600):
        assert all(channels_last and same for channels_last, same in ddp_layouts.values())
        for name, (params, layouts) in ours.items():
            assert layouts == ddp_layouts, f"{name}: (channels_last parameter, gradient in its layout) {layouts}"
            if name.endswith("-1.0") or name == "none":
                assert_same_params(ddp_params, params, f"channels_last {name}")


# ---------------------------------------------------------------- 5. two optimizers, manual optimization
GAN_LR = 0.1


def gan_batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(8, 4, generator=g), torch.randn(8, 6, generator=g) + 1.0


def gan_losses(gen: nn.Module, disc: nn.Module, noise: torch.Tensor, real: torch.Tensor, which: str) -> torch.Tensor:
    if which == "gen":
        return -disc(gen(noise)).mean()
    return disc(gen(noise).detach()).mean() - disc(real).mean()


class TwoOptimizers(L.LightningModule):
    """GAN-style: the generator's and the discriminator's steps, each with its own optimizer and
    backward, the other model toggled off (Lightning's recipe). Records every rank's residuals
    right before and after each backward."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        torch.manual_seed(7)
        self.gen = nn.Sequential(nn.Linear(4, 12), nn.Tanh(), nn.Linear(12, 6))
        self.disc = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 1))
        self.snapshots: list[tuple[str, dict, dict]] = []

    def _residuals(self) -> dict[str, torch.Tensor]:
        engine = getattr(self.trainer.strategy, "engine", None)
        return {} if engine is None else {k: v.clone() for k, v in engine.memory.state_dict().get("residuals", {}).items()}

    def training_step(self, batch, batch_idx):
        noise, real = gan_batch(self.global_rank, batch_idx)
        for which, optimizer in zip(("gen", "disc"), self.optimizers()):
            with self.toggled_optimizer(optimizer):
                before = self._residuals()
                self.manual_backward(gan_losses(self.gen, self.disc, noise, real, which))
                self.snapshots.append((which, before, self._residuals()))
                optimizer.step()
                optimizer.zero_grad()

    def configure_optimizers(self):
        return torch.optim.SGD(self.gen.parameters(), lr=GAN_LR), torch.optim.SGD(self.disc.parameters(), lr=GAN_LR)


def gan_run(kwargs: dict | str, steps: int):
    L.seed_everything(0, verbose=False)
    model = TwoOptimizers()
    make_trainer(strategy_for(kwargs), steps).fit(model, DataLoader(range(64), batch_size=1))
    return named_params(model), model.snapshots


def gan_reference(steps: int, density: float) -> dict[str, torch.Tensor]:
    """The same loop by hand: per backward, only the stepped model's parameters are compensated,
    top-k selected (k = max(1, floor(density * n))) and summed, each rank sending selected/P."""
    L.seed_everything(0, verbose=False)
    model = TwoOptimizers()
    residuals: dict[str, torch.Tensor] = {}
    world = dist.get_world_size()
    for step in range(steps):
        noise, real = gan_batch(dist.get_rank(), step)
        for which in ("gen", "disc"):
            active, idle = (model.gen, model.disc) if which == "gen" else (model.disc, model.gen)
            idle.requires_grad_(False)
            gan_losses(model.gen, model.disc, noise, real, which).backward()
            idle.requires_grad_(True)
            for name, param in active.named_parameters():
                key = f"{which}.{name}"
                compensated = param.grad + residuals.get(key, torch.zeros_like(param))
                flat = compensated.reshape(-1)
                k = max(1, int(density * flat.numel()))
                chosen = torch.topk(flat.abs(), k).indices
                sent = torch.zeros_like(flat)
                sent[chosen] = flat[chosen] / world
                dist.all_reduce(sent)
                residuals[key] = compensated.clone().reshape(-1).index_fill_(0, chosen, 0).view_as(param)
                with torch.no_grad():
                    param -= GAN_LR * sent.view_as(param)
                param.grad = None
    return named_params(model)


def gan_against_references(steps: int = 8):
    dense_ddp = gan_run("ddp_find_unused_parameters_true", steps)[0]
    ours = {
        "dense": gan_run(dict(DENSE, find_unused_parameters=True), steps),
        "sparse": gan_run(dict(SPARSE, density=0.25), steps),
        "sparse-find-unused": gan_run(dict(SPARSE, density=0.25, find_unused_parameters=True), steps),
    }
    batches = len(ours["sparse"][1]) // 2  # Lightning counts each optimizer's step in max_steps
    return dense_ddp, gan_reference(batches, 0.25), ours


def test_two_optimizers_touch_only_the_stepped_models_error_feedback(pool2):
    for dense_ddp, reference, ours in pool2.run(gan_against_references, timeout=600):
        assert_same_params(dense_ddp, ours["dense"][0], "two optimizers, dense")
        for name in ("sparse", "sparse-find-unused"):
            params, snapshots = ours[name]
            for which, before, after in snapshots:
                idle = "disc." if which == "gen" else "gen."
                for key in before:
                    if key.startswith(idle):
                        assert torch.equal(before[key], after[key]), f"{name}: {which} backward changed {key}'s residual"
                assert any(k.startswith(which + ".") for k in after), f"{name}: {which} has no residual"
            for key in reference:
                assert torch.allclose(params[key], reference[key], rtol=0, atol=1e-6), f"{name}: {key} differs from the hand reference"


# ---------------------------------------------------------------- 6, 8. construction checks
@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"buffer_mb": float("nan")}, 'buffer_mb must be a positive number or "auto", got nan (a finite size in MiB)'),
        ({"buffer_mb": float("inf")}, 'buffer_mb must be a positive number or "auto", got inf (a finite size in MiB)'),
        ({"first_buffer_mb": float("nan")}, "first_buffer_mb must be a positive number or None (= buffer_mb), got nan"),
        ({"first_buffer_mb": float("inf")}, "first_buffer_mb must be a positive number or None (= buffer_mb), got inf"),
        (
            {"sparsifier": build_sparsifier("topk", density=0.1), "density": 0.2},
            "density=0.2 was passed together with a Sparsifier instance (TopKSparsifier with density 0.1)",
        ),
    ],
    ids=["buffer-nan", "buffer-inf", "first-buffer-nan", "first-buffer-inf", "instance-and-density"],
)
def test_bad_values_are_refused_at_construction(kwargs, message):
    with pytest.raises(ValueError) as error:
        ssf.SSFusionStrategy(**{**SPARSE, **kwargs})
    assert message in str(error.value)


def test_a_sparsifier_instance_brings_its_own_density():
    strategy = ssf.SSFusionStrategy(sparsifier=build_sparsifier("topk", density=0.3))
    assert strategy.density == 0.3
    assert ssf.SSFusionStrategy(sparsifier="topk").density == 0.01


def test_stream_offload_on_cpu_is_refused_before_any_rank_starts():
    with pytest.raises(ValueError, match="offload='stream' compresses on a CUDA side stream, but the devices are cpu"):
        L.Trainer(strategy=ssf.SSFusionStrategy(**dict(SPARSE, offload="stream")), accelerator="cpu", devices=2, logger=False)


# ---------------------------------------------------------------- 7. the step note, on communication failures only
class FailsAtStep2(Regressor):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how

    def setup(self, stage: str) -> None:
        if self.how == "collective":
            self.short = dist.new_group(backend="gloo", timeout=timedelta(seconds=2))

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if self.global_step == 2:
            if self.how == "user":
                raise ValueError("the user's own bug")
            if self.how == "nonfinite":
                loss = loss * float("nan")
            if self.how == "collective" and self.global_rank == 1:
                dist.all_reduce(torch.ones(1), group=self.short)  # rank 0 never joins: times out
        return loss


def failing_run(how: str):
    L.seed_everything(0, verbose=False)
    strategy = ssf.SSFusionStrategy(**SPARSE, timeout=timedelta(seconds=3))
    try:
        make_trainer(strategy, 5).fit(FailsAtStep2(how), DataLoader(regression_data(), batch_size=16))
    except Exception as error:  # noqa: BLE001 - the test looks at what reached the user
        return type(error).__name__, str(error), list(getattr(error, "__notes__", []))
    return "no error", "", []


@pytest.mark.parametrize("how, expected", [("user", ValueError), ("nonfinite", NonFiniteGradientError)])
def test_errors_that_are_not_about_communication_get_no_step_note(pool2, how, expected):
    for kind, message, notes in pool2.run(failing_run, how):
        assert kind == expected.__name__, message
        assert not any(STEP_NOTE in note for note in notes), notes


def test_a_failed_collective_outside_the_engine_gets_the_step_note():
    pool = RankPool(2)  # the run leaves a timed-out group behind: not for the shared pool
    try:
        (kind0, message0, notes0), (kind1, message1, notes1) = pool.run(failing_run, "collective", timeout=120)
    finally:
        pool.close()
    assert kind1 == "RuntimeError" and any(f"step 2 {STEP_NOTE}" in note for note in notes1), (message1, notes1)
    # the peer's engine fails with its own CommunicationError, which names the step already
    assert kind0 == CommunicationError.__name__ and "ssfusion: step 2" in message0 and not notes0, (message0, notes0)
