"""Resuming with a changed configuration: per field, re-plan (keeping residuals) and say so, or refuse.

Every case resumes the same mid-training checkpoint (step 4 of 8, written by ModelCheckpoint on 2
ranks) with one field changed, and checks the decision of ``RESUME_RULES`` for that field.
"""

from __future__ import annotations

import os
import warnings

import lightning as L
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint

import ssfusion_lightning as ssf
from ssfusion_lightning.data import ResumableDataLoader
from ssfusion_lightning.engine.state import RESUME_RULES, resume_changes
from ssfusion_lightning.fusion.budget import reduced_counts
from ssfusion_lightning.sparsifiers import k_for
from tests.workloads import Regressor, make_trainer, regression_data

STEPS, SAVED_AT = 8, 4
BASES = {
    # a fixed cap and a policy that plans without costs: this run never measures any
    "topk": dict(sparsifier="topk", density=0.05, memory="residual", fusion="ahead", comm="hybrid", offload="none", buffer_mb=25.0),
    "dgc-zen": dict(
        sparsifier="topk", density=0.05, memory="dgc", fusion="ahead", comm="zen", offload="none", comm_options={"choice": "zen"},
        buffer_mb=25.0,
    ),
}


# ---------------------------------------------------------------- the decisions (no ranks needed)
def test_every_configuration_field_has_a_decision():
    assert set(ssf.SSFusionStrategy().engine_config()) == set(RESUME_RULES)


def test_the_decisions_per_field():
    saved = ssf.SSFusionStrategy(**BASES["topk"]).engine_config()

    def changes(**change):
        return resume_changes(saved, ssf.SSFusionStrategy(**dict(BASES["topk"], **change)).engine_config())

    assert changes() == resume_changes(saved, saved) and not changes().changed
    for field, value in [("density", 0.5), ("buffer_mb", 1.0), ("first_buffer_mb", 1.0), ("process_groups", 1), ("fusion", "layerwise")]:
        decided = changes(**{field: value})
        assert (decided.replan, decided.fresh) == (True, {"communicator"}), field
    decided = changes(sparsifier="randomk")
    assert (decided.replan, decided.fresh) == (True, {"sparsifier", "communicator"})
    decided = changes(comm="allgather")
    assert (decided.replan, decided.fresh) == (False, {"communicator"})
    for field, value in [("offload", "thread"), ("warmup_steps", 2), ("nonfinite", "skip"), ("find_unused_parameters", True)]:
        decided = changes(**{field: value})
        assert (decided.replan, decided.fresh, decided.changed) == (False, frozenset(), ((field, saved[field], value),)), field
    # no fusion policy takes options today: a saved config that had some must re-plan
    decided = resume_changes(dict(saved, fusion_options={"window": 2}), saved)
    assert (decided.replan, decided.fresh) == (True, {"communicator"})
    with pytest.raises(ValueError, match=r"changed memory \(memory='residual' in the checkpoint, memory='dgc' now\)"):
        changes(memory="dgc")
    # fields only one side knows (another version of the package) are not compared
    assert not resume_changes(dict(saved, future_field=1), saved).changed


# ---------------------------------------------------------------- on 2 ranks
class Probe(L.Callback):
    """The engine state right after the checkpoint was restored, and at the end."""

    def on_train_start(self, trainer, pl_module):
        self.restored = trainer.strategy.engine.state_dict()
        self.offloaded = sorted(trainer.strategy.engine._offloaded)

    def on_train_end(self, trainer, pl_module):
        self.end = trainer.strategy.engine.state_dict()


def train(kwargs: dict, callbacks=(), ckpt_path=None):
    L.seed_everything(9, verbose=False)
    model = Regressor()
    probe = Probe()
    # only the runs that save get a checkpoint callback: Lightning's default one writes into the cwd
    saves = any(isinstance(callback, ModelCheckpoint) for callback in callbacks)
    trainer = make_trainer(
        ssf.SSFusionStrategy(**kwargs), STEPS, max_epochs=-1, callbacks=[probe, *callbacks], enable_checkpointing=saves
    )
    trainer.fit(model, ResumableDataLoader(regression_data(), batch_size=16, shuffle=True), ckpt_path=ckpt_path)
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]), probe


def base_run(directory: str, base: dict):
    saver = ModelCheckpoint(dirpath=directory, every_n_train_steps=SAVED_AT, save_top_k=-1, filename="{step}")
    params, _ = train(base, [saver])
    return params


def resume_run(directory: str, base: dict, change: dict):
    path = os.path.join(directory, f"step={SAVED_AT}.ckpt")
    saved = torch.load(path)["ssfusion_engine"]["ranks"][dist.get_rank()]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            params, probe = train(dict(base, **change), ckpt_path=path)
        except ValueError as error:
            return {"error": str(error)}
    messages = [str(w.message) for w in caught if "changed configuration" in str(w.message)]
    return {"params": params, "saved": saved, "restored": probe.restored, "end": probe.end, "offloaded": probe.offloaded, "warnings": messages}


@pytest.fixture(scope="module")
def checkpoints(rank_pools, tmp_path_factory):
    """One uninterrupted run per base configuration, writing the checkpoint every case resumes."""
    done: dict[str, tuple[str, list[torch.Tensor]]] = {}

    def get(base: str) -> tuple[str, list[torch.Tensor]]:
        if base not in done:
            directory = str(tmp_path_factory.mktemp(base))
            done[base] = directory, rank_pools(2).run(base_run, directory, BASES[base])
        return done[base]

    return get


def resumed(pool2, checkpoints, base: str, **change):
    directory, straight = checkpoints(base)
    results = pool2.run(resume_run, directory, BASES[base], change)
    for result in results:
        assert "error" not in result, result.get("error")
    return results, straight


def same_tensors(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def assert_residuals_kept(results):
    for result in results:
        saved, restored = result["saved"]["memory"], result["restored"]["memory"]
        assert saved.keys() == restored.keys() and any(saved[kind] for kind in saved)
        for kind in saved:
            assert same_tensors(saved[kind], restored[kind]), kind


def assert_warned(results, *words):
    (message,) = results[0]["warnings"]  # rank 0 says it once
    assert all(word in message for word in words), message


def sparse_ks(plan: dict) -> dict[str, tuple[int, int]]:
    return {s["name"]: (s["numel"], s["k"]) for b in plan["buffers"] for s in b["slots"] if s["sparse"]}


def planned_ks(numels: list[int], density: float) -> list[int]:
    """k_for's count per tensor, within the plan's budget (fusion/budget.py), in plan order."""
    return reduced_counts([k_for(numel, density) for numel in numels], sum(numels), density)


def test_a_changed_density_replans_keeps_residuals_and_says_so(pool2, checkpoints):
    results, straight = resumed(pool2, checkpoints, "topk", density=0.5)
    assert_warned(results, "density 0.05 -> 0.5", "re-planned", "residuals kept")
    assert_residuals_kept(results)
    for result, before in zip(results, straight):
        assert result["restored"]["step"] == SAVED_AT
        saved, now = sparse_ks(result["saved"]["plan"]), sparse_ks(result["restored"]["plan"])
        assert saved.keys() == now.keys() and saved
        assert [k for _, k in saved.values()] == planned_ks([numel for numel, _ in saved.values()], 0.05)
        assert [k for _, k in now.values()] == planned_ks([numel for numel, _ in now.values()], 0.5)
        assert not torch.equal(result["params"], before)  # the old plan would give exactly the density-0.05 run


@pytest.mark.parametrize(
    "field, value, buffers",
    [
        ("buffer_mb", 1e-6, lambda n: n),  # a buffer per tensor
        ("first_buffer_mb", 1e-6, lambda n: 2),  # the first tensor alone, then the rest
        ("process_groups", 1, lambda n: 1),
    ],
)
def test_a_changed_buffer_layout_replans_and_keeps_the_trajectory(pool2, checkpoints, field, value, buffers):
    results, straight = resumed(pool2, checkpoints, "topk", **{field: value})
    assert_warned(results, f"{field} ", "re-planned")
    assert_residuals_kept(results)
    for result, before in zip(results, straight):
        plan = result["restored"]["plan"]
        assert len(plan["buffers"]) == buffers(sum(len(b["slots"]) for b in plan["buffers"]))
        assert {b["channel"] for b in plan["buffers"]} <= set(range(2 if field != "process_groups" else 1))
        assert sparse_ks(plan) == sparse_ks(result["saved"]["plan"])
        # "ahead" selects per tensor, and a sum of 2 ranks is the same in any packing: only the
        # buffers differ, so the trajectory is the uninterrupted run's, bit for bit
        assert torch.equal(result["params"], before)


def test_a_cost_driven_fusion_replans_and_profiles_what_the_saved_run_never_measured(pool2, checkpoints):
    results, _ = resumed(pool2, checkpoints, "topk", fusion="selective")
    assert_warned(results, "fusion 'ahead' -> 'selective'", "re-planned")
    assert_residuals_kept(results)
    for result in results:
        assert result["saved"]["costs"] is None and result["restored"]["costs"] is None
        # profiled on steps 4-6, agreed at the end of step 6, then planned from them
        assert result["end"]["costs"]["measured"] is True
        assert result["end"]["plan"]["notes"]["measured_costs"] is True
    assert results[0]["end"]["costs"] == results[1]["end"]["costs"]


def test_a_changed_sparsifier_replans_with_its_state_started_afresh(pool2, checkpoints):
    results, _ = resumed(pool2, checkpoints, "topk", sparsifier="randomk")
    assert_warned(results, "sparsifier 'topk' -> 'randomk'", "state started afresh", "residuals kept")
    assert_residuals_kept(results)
    for result in results:
        assert result["saved"]["sparsifier"]["step"] == SAVED_AT and result["restored"]["sparsifier"]["step"] == 0


def test_a_changed_collective_keeps_the_plan_and_starts_its_state_afresh(pool2, checkpoints):
    results, _ = resumed(pool2, checkpoints, "topk", comm="allgather")
    assert_warned(results, "comm 'hybrid' -> 'allgather'", "state started afresh")
    assert_residuals_kept(results)
    for result in results:
        assert result["restored"]["plan"] == result["saved"]["plan"]


@pytest.mark.parametrize(
    "field, value", [("offload", "thread"), ("warmup_steps", 2), ("nonfinite", "skip"), ("find_unused_parameters", True)]
)
def test_fields_no_saved_state_depends_on_apply_and_keep_the_trajectory(pool2, checkpoints, field, value):
    results, straight = resumed(pool2, checkpoints, "topk", **{field: value})
    assert_warned(results, f"{field} ", "applies from the next step")
    assert_residuals_kept(results)
    for result, before in zip(results, straight):
        assert result["restored"]["plan"] == result["saved"]["plan"]
        assert result["restored"]["sparsifier"] == result["saved"]["sparsifier"]
        assert bool(result["offloaded"]) == (field == "offload")  # the new offload applies
        # none of them changes the math of a step past the warm-up: bit for bit the uninterrupted run
        assert torch.equal(result["params"], before)


def test_a_changed_memory_is_refused_naming_the_field(pool2, checkpoints):
    directory, _ = checkpoints("topk")
    for result in pool2.run(resume_run, directory, BASES["topk"], {"memory": "dgc"}):
        assert "cannot resume with a changed memory" in result.get("error", ""), result
        assert "memory='residual' in the checkpoint, memory='dgc' now" in result["error"]


def test_changed_comm_options_start_the_collective_state_afresh(pool2, checkpoints):
    results, _ = resumed(pool2, checkpoints, "dgc-zen", comm_options={"choice": "sparcml"})
    assert_warned(results, "comm_options {'choice': 'zen'} -> {'choice': 'sparcml'}", "state started afresh")
    assert_residuals_kept(results)  # dgc's momenta and velocities, as saved
    for result in results:
        assert result["saved"]["communicator"]["rounds"]  # kept, it would come back with its buffer keys
        assert result["restored"]["communicator"] == {"choices": {}, "rounds": {}}


def test_changed_memory_options_apply_to_the_kept_momenta(pool2, checkpoints):
    results, _ = resumed(pool2, checkpoints, "dgc-zen", memory_options={"momentum": 0.5})
    assert_warned(results, "memory_options {} -> {'momentum': 0.5}", "applies from the next step")
    assert_residuals_kept(results)  # dgc's momenta and velocities, as saved
    for result in results:
        assert result["restored"]["plan"] == result["saved"]["plan"]
        assert result["restored"]["communicator"]["rounds"].keys() == result["saved"]["communicator"]["rounds"].keys()
