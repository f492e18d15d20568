"""memory="auto": the memory picked for the run's optimizer (sparsifiers/memory_choice.py), and in
training exactly the run that names that memory."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

import ssfusion_lightning as ssf
from ssfusion_lightning.sparsifiers.memory_choice import AUTO_FEEDBACK, choose_memory
from tests.workloads import Regressor, make_trainer, regression_data


def optimizer(kind: str, **options) -> torch.optim.Optimizer:
    params = nn.Linear(3, 2).parameters()
    return {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW, "rmsprop": torch.optim.RMSprop}[kind](
        params, lr=0.1, **options
    )


@pytest.mark.parametrize(
    "kind, options, picked",
    [
        ("sgd", {"momentum": 0.9}, "dgc"),
        ("adamw", {}, "adam"),
        ("adam", {}, "adam"),
        ("sgd", {}, "residual"),
        ("rmsprop", {}, "residual"),
    ],
)
def test_the_pick_follows_the_optimizer(kind, options, picked):
    choice = choose_memory([optimizer(kind, **options)], {})
    assert choice.name == picked
    assert choice.options == ({} if picked == "residual" else {"feedback": AUTO_FEEDBACK})


@pytest.mark.parametrize(
    "kind, options, why",
    [
        ("sgd", {"momentum": 0.9, "nesterov": True}, "nesterov=True"),
        ("sgd", {"momentum": 0.9, "dampening": 0.5}, "dampening=0.5"),
        ("adam", {"amsgrad": True}, "amsgrad=True"),
        ("adam", {"weight_decay": 0.01}, "weight_decay=0.01 added to the gradient"),
    ],
)
def test_what_dgc_or_adam_cannot_compute_falls_back_to_residual_and_says_why(kind, options, why):
    choice = choose_memory([optimizer(kind, **options)], {})
    assert choice.name == "residual" and choice.options == {} and why in choice.reason


def test_sgd_beside_another_optimizer_takes_residual():
    """Momentum correction would apply SGD's momentum to the other optimizer's tensors too."""
    choice = choose_memory([optimizer("sgd", momentum=0.9), optimizer("adamw")], {})
    assert choice.name == "residual" and "would apply SGD's momentum to every tensor" in choice.reason


def test_a_run_adam_refuses_takes_residual_with_the_refusal_as_reason():
    choice = choose_memory([optimizer("adamw")], {}, adam_refused="the Trainer clips")
    assert choice.name == "residual" and "the Trainer clips" in choice.reason


def test_the_trainers_norm_clipping_becomes_adams_own():
    choice = choose_memory([optimizer("adamw")], {}, clip_norm=0.5)
    assert choice.name == "adam" and choice.options == {"feedback": AUTO_FEEDBACK, "clip_norm": 0.5}
    assert "gradient_clip_val=0.5 now clips each rank's gradient" in choice.reason
    # only adam takes it: momentum correction keeps the Trainer's clipping of the summed gradient
    assert choose_memory([optimizer("sgd", momentum=0.9)], {}, clip_norm=0.5).options == {"feedback": AUTO_FEEDBACK}
    refused = choose_memory([optimizer("adamw")], {}, adam_refused="a GradScaler", clip_norm=0.5)
    assert refused.name == "residual" and refused.options == {}


def test_a_given_feedback_is_used_as_given():
    assert choose_memory([optimizer("sgd", momentum=0.9)], {"feedback": 0.95}).options == {"feedback": 0.95}
    assert choose_memory([optimizer("sgd")], {"feedback": 0.95}).options == {"feedback": 0.95}


def test_an_option_some_pick_would_refuse_is_refused_up_front_naming_the_valid_one():
    with pytest.raises(TypeError, match=r"memory 'auto' has no option 'momentum'; its options: feedback"):
        ssf.SSFusionStrategy(memory="auto", memory_options={"momentum": 0.9})
    with pytest.raises(ValueError, match="feedback is the fraction"):
        ssf.SSFusionStrategy(memory="auto", memory_options={"feedback": 1.5})
    with pytest.raises(ValueError, match=r"unknown memory 'automatic'; valid choices: adam, auto, dgc, none, residual"):
        ssf.SSFusionStrategy(memory="automatic")


def auto_against_named(optimizer_kind: str) -> dict:
    """The same 6 steps with memory='auto' and with the memory it should pick named, on each rank."""

    def run(**memory) -> tuple[dict, str, str, float]:
        L.seed_everything(0, verbose=False)
        model = Regressor(optimizer=optimizer_kind, lr=0.01)
        strategy = ssf.SSFusionStrategy(sparsifier="topk", density=0.05, fusion="ahead", comm="allgather", offload="none", **memory)
        seen: dict = {}

        class Memory(L.Callback):
            def on_train_end(self, trainer, module):
                seen.update(memory=strategy.engine.memory, optimizer=trainer.optimizers[0])

        make_trainer(strategy, 6, callbacks=[Memory()]).fit(model, DataLoader(regression_data(), batch_size=16))
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
        return params, type(seen["memory"]).__name__, type(seen["optimizer"]).__name__, seen["memory"].feedback

    named = "dgc" if optimizer_kind == "sgd" else "adam"
    return {"auto": run(memory="auto"), "named": run(memory=named, memory_options={"feedback": AUTO_FEEDBACK})}


@pytest.mark.parametrize("optimizer_kind, memory_kind, optimizer_name", [("sgd", "DGCMemory", "SGD"), ("adamw", "AdamMemory", "AveragedUpdate")])
def test_auto_trains_exactly_as_the_memory_it_picks(pool2, optimizer_kind, memory_kind, optimizer_name):
    results = pool2.run(auto_against_named, optimizer_kind)
    first = results[0]["auto"][0]
    for result in results:
        auto, named = result["auto"], result["named"]
        assert auto[1:] == named[1:] == (memory_kind, optimizer_name, AUTO_FEEDBACK)
        for name in auto[0]:
            assert torch.equal(auto[0][name], named[0][name]), name
            assert torch.equal(auto[0][name], first[name]), f"{name} differs between ranks"


def auto_with_the_trainers_clipping(algorithm: str) -> dict:
    """6 steps of AdamW with the Trainer clipping at 0.5 by ``algorithm``, memory='auto'; for "norm"
    also the run that names what auto should make of it: memory='adam' clipping at 0.5 itself."""

    def run(clip: dict, **memory) -> dict:
        L.seed_everything(0, verbose=False)
        model = Regressor(optimizer="adamw", lr=0.01)
        strategy = ssf.SSFusionStrategy(sparsifier="topk", density=0.05, fusion="ahead", comm="allgather", offload="none", **memory)
        seen: dict = {}

        class During(L.Callback):
            def on_train_end(self, trainer, module):
                seen.update(memory=strategy.engine.memory, clip=trainer.gradient_clip_val)

        trainer = make_trainer(strategy, 6, callbacks=[During()], **clip)
        trainer.fit(model, DataLoader(regression_data(), batch_size=16))
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
        memory_state = seen["memory"]
        return {
            "params": params, "memory": type(memory_state).__name__, "clip_norm": getattr(memory_state, "clip_norm", None),
            "clip_during": seen["clip"], "clip_after": trainer.gradient_clip_val,
        }

    clipped = {"gradient_clip_val": 0.5, "gradient_clip_algorithm": algorithm}
    auto = run(clipped, memory="auto")
    if algorithm != "norm":
        return {"auto": auto}
    return {"auto": auto, "named": run({}, memory="adam", memory_options={"feedback": AUTO_FEEDBACK, "clip_norm": 0.5})}


def test_auto_makes_the_trainers_norm_clipping_adams_and_trains_as_that_run(pool2):
    for result in pool2.run(auto_with_the_trainers_clipping, "norm"):
        auto, named = result["auto"], result["named"]
        assert (auto["memory"], auto["clip_norm"]) == (named["memory"], named["clip_norm"]) == ("AdamMemory", 0.5)
        assert auto["clip_during"] is None and auto["clip_after"] == 0.5  # off for the run, the Trainer's again after
        for name in auto["params"]:
            assert torch.equal(auto["params"][name], named["params"][name]), name


def test_clipping_by_value_keeps_the_trainers_and_takes_residual(pool2):
    for result in pool2.run(auto_with_the_trainers_clipping, "value"):
        auto = result["auto"]
        assert auto["memory"] == "ResidualMemory" and auto["clip_during"] == auto["clip_after"] == 0.5


def clipping_per_step_with_the_hand_off() -> dict:
    """memory='auto' with AdamW, the Trainer clipping by norm at 0.5, nothing sparse: per step whether
    DDP's reducer ran it and the clipping the Trainer applied before the optimizer's step."""
    L.seed_everything(0, verbose=False)
    strategy = ssf.SSFusionStrategy(sparsifier="none", fusion="ahead", comm="allreduce", offload="none", memory="auto")
    steps: list[tuple[bool, float | None, bool]] = []

    class Clipping(L.Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            self.handed_off = strategy.handed_off

        def on_before_optimizer_step(self, trainer, module, optimizer):  # Lightning clips right after this
            steps.append((self.handed_off, trainer.gradient_clip_val, optimizer.steps_adam))

    trainer = make_trainer(strategy, 5, callbacks=[Clipping()], gradient_clip_val=0.5)
    trainer.fit(Regressor(optimizer="adamw", lr=0.01), DataLoader(regression_data(), batch_size=16))
    return {"steps": steps, "after": trainer.gradient_clip_val}


def test_the_trainer_clips_again_while_ddps_reducer_runs_the_rounds(pool2):
    """The engine's first round clips each rank's gradient before its moments (the Trainer's clipping
    off); from the next round DDP's reducer sums the gradients and the replaced AdamW steps on them,
    and the Trainer clips their average at 0.5 again, as it was asked to."""
    for result in pool2.run(clipping_per_step_with_the_hand_off):
        assert result["steps"] == [(False, None, False)] + [(True, 0.5, True)] * 4
        assert result["after"] == 0.5
