"""The measured plan check (engine/trial.py): the state machine on its own, then training on 2
ranks, where every rank must switch plans at the same step and decide alike."""

from __future__ import annotations

import math
from contextlib import contextmanager

import lightning as L
import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

import ssfusion_lightning as ssf
from ssfusion_lightning.comm import COMMUNICATORS
from ssfusion_lightning.commcost import Link
from ssfusion_lightning.engine import engine as engine_module
from ssfusion_lightning.engine import trial as trial_module
from ssfusion_lightning.engine.agreement import mean_over_ranks
from ssfusion_lightning.engine.engine import FusionEngine
from ssfusion_lightning.engine.trial import CONFIRM, DENSE, DONE, DRIFT_LIMIT, FUSED, RECUT, SPARSE, PlanTrial
from ssfusion_lightning.fusion import cut as cut_module
from tests.workloads import Regressor, checkpoint_and_resume, make_trainer, regression_data


def agreed(offset: float):
    """A stand-in for the mean over ranks: the other ranks were ``offset`` seconds slower on average."""
    return lambda local: local + offset


def measured(trial: PlanTrial, *seconds: float) -> PlanTrial:
    """``trial`` after one phase of step times (the first is left out of the median)."""
    for i, value in enumerate(seconds):
        assert trial.record(value) == (i == len(seconds) - 1)
    return trial


def test_dense_runs_only_where_its_all_reduce_leaves_it_a_chance():
    fast_link, slow_link = PlanTrial(3), PlanTrial(3)
    for trial in (fast_link, slow_link):  # the first step on the plan paid for the switch: left out
        measured(trial, 0.5, 0.05, 0.07, 0.06)
    # the agreed median is 0.06 + 0.01: a dense all-reduce of 0.02 s may beat it, one of 0.07 s cannot
    assert fast_link.end_sparse(agreed(0.01), fusable=False, dense_floor=0.02) == DENSE == fast_link.phase
    assert slow_link.end_sparse(agreed(0.01), fusable=False, dense_floor=0.07) == DONE == slow_link.phase
    assert fast_link.sparse_seconds == slow_link.sparse_seconds == pytest.approx(0.07)
    assert fast_link.samples == [] and slow_link.dense_seconds is None and slow_link.fused_seconds is None


@pytest.mark.parametrize("dense_median, confirm", [(0.06, True), (0.07, True), (0.08, False)])
def test_dense_no_slower_than_sparse_measures_sparse_again(dense_median, confirm):
    trial = measured(PlanTrial(1, phase=DENSE, sparse_seconds=0.07), 1.0, dense_median - 0.005)
    assert trial.end_dense(agreed(0.005)) == (CONFIRM if confirm else DONE) == trial.phase
    assert trial.dense_seconds == pytest.approx(dense_median) and not trial.dense_kept
    assert trial.active == confirm  # a slower dense phase ends the trial on sparse at once


@pytest.mark.parametrize(
    "dense_median, again, kept",
    # the sparse plan's step is the mean of its windows before (0.07) and after dense
    # (within DRIFT_LIMIT of each other: farther apart, both are measured again)
    [(0.06, 0.055, True), (0.065, 0.058, False), (0.065, 0.06, True), (0.07, 0.07, True), (0.07, 0.069, False)],
)
def test_dense_is_kept_where_its_median_is_at_most_the_mean_of_the_sparse_windows(dense_median, again, kept):
    trial = PlanTrial(1, phase=DENSE, sparse_seconds=0.07)
    assert measured(trial, 1.0, dense_median).end_dense(agreed(0.0)) == CONFIRM
    assert measured(trial, 1.0, again - 0.005).end_confirm(agreed(0.005)) == DONE
    assert trial.dense_kept == kept  # a tie keeps dense: it loses no accuracy
    assert trial.phase == DONE and not trial.active and trial.confirmed_seconds == pytest.approx(again)
    assert trial.sparse_estimate == pytest.approx((0.07 + again) / 2) and trial.dense_kept == kept


def test_a_fusable_plan_measures_one_buffer_before_dense():
    trial = measured(PlanTrial(2), 1.0, 0.07, 0.07)
    assert trial.end_sparse(agreed(0.0), fusable=True, dense_floor=0.0) == FUSED == trial.phase
    assert trial.fused_seconds is None and trial.samples == []


@pytest.mark.parametrize(
    "fused_median, recut, kept",
    # the cut's plan is measured before (0.07) and after one buffer; one buffer stays where it is no
    # slower than the mean of the two (a tie goes to one buffer)
    [(0.05, 0.07, True), (0.07, 0.07, True), (0.065, 0.06, True), (0.065, 0.059, False), (0.07, 0.06, False),
     (0.075, 0.08, True), (0.09, 0.07, False)],
)
def test_one_buffer_is_kept_where_it_is_no_slower_than_the_cut_measured_around_it(fused_median, recut, kept):
    trial = measured(PlanTrial(1, phase=FUSED, sparse_seconds=0.07), 1.0, fused_median)
    assert trial.end_fused(agreed(0.0)) == RECUT == trial.phase
    assert not trial.fused_kept  # the cut's plan runs the second window
    assert measured(trial, 1.0, recut - 0.005).end_recut(agreed(0.005), dense_floor=1.0) == DONE
    assert trial.recut_seconds == pytest.approx(recut) and trial.cut_seconds == pytest.approx((0.07 + recut) / 2)
    assert trial.fused_kept == kept
    assert trial.best_sparse_seconds == pytest.approx(fused_median if kept else (0.07 + recut) / 2)


def test_dense_competes_with_the_better_sparse_plan():
    """The floor and the dense median are held against one buffer's 0.05 s, not the cut's 0.09 s."""
    ruled_out = measured(PlanTrial(1, phase=FUSED, sparse_seconds=0.09), 1.0, 0.05)
    assert ruled_out.end_fused(agreed(0.0)) == RECUT
    assert measured(ruled_out, 1.0, 0.09).end_recut(agreed(0.0), dense_floor=0.06) == DONE and not ruled_out.dense_kept
    trial = measured(PlanTrial(1, phase=FUSED, sparse_seconds=0.09), 1.0, 0.05)
    assert trial.end_fused(agreed(0.0)) == RECUT
    assert measured(trial, 1.0, 0.09).end_recut(agreed(0.0), dense_floor=0.01) == DENSE
    assert measured(trial, 1.0, 0.06).end_dense(agreed(0.0)) == DONE and not trial.dense_kept and trial.fused_kept
    assert trial.summary() == "sparse 90 ms, one buffer 50 ms, sparse after one buffer 90 ms, dense 60 ms a step -> one buffer"
    again = measured(PlanTrial(1, phase=DENSE, sparse_seconds=0.09, fused_seconds=0.05, recut_seconds=0.09), 1.0, 0.045)
    assert again.end_dense(agreed(0.0)) == CONFIRM
    assert measured(again, 1.0, 0.06).end_confirm(agreed(0.0)) == DONE and again.dense_kept
    assert again.sparse_estimate == pytest.approx(0.055)
    assert again.summary() == (
        "sparse 90 ms, one buffer 50 ms, sparse after one buffer 90 ms, dense 45 ms, sparse again 60 ms a step -> dense"
    )


@pytest.mark.parametrize("comm, fusion", [("allgather", "ahead"), ("zen", "ahead"), ("oktopk", "behind")])
@pytest.mark.parametrize("again, kept", [(0.06, True), (0.058, False)])
def test_a_fixed_scheme_with_the_trial_sends_dense_where_dense_measured_faster(pool2, comm, fusion, again, kept):
    """The same trial on a fixed scheme's plan (no modelled fallback of its own): its dense
    window sends every tensor dense, and dense stays where it measured no slower, on every rank."""
    medians = {SPARSE: 0.07, DENSE: 0.065, CONFIRM: again}
    results = pool2.run(train_with_trial, 15, 0.0, medians, comm, fusion)
    first = results[0]
    assert first["trial"]["phase"] == DONE and first["dense_measured_faster"] == kept
    assert [first["all_dense"][step] for step in range(4, 15)] == [False] * 3 + [True] * 3 + [False] * 3 + [kept] * 2
    for rank, result in enumerate(results):
        assert result["trial"] == first["trial"] and result["all_dense"] == first["all_dense"]
        for name, value in result["params"].items():
            assert torch.equal(value, first["params"][name]), f"rank {rank}: {name} differs from rank 0"


@pytest.mark.parametrize("speedup, floor_leaves_dense_a_chance", [(1.0, False), (1.2, True)])
def test_the_dense_floor_is_held_against_the_sparse_step_times_the_required_speedup(speedup, floor_leaves_dense_a_chance):
    """A dense all-reduce modelled at 0.08 s cannot beat a 0.07 s sparse step, but may come within
    1.2x of it: then the dense window runs."""
    trial = measured(PlanTrial(1, min_sparse_speedup=speedup), 1.0, 0.07)
    entered = trial.end_sparse(agreed(0.0), fusable=False, dense_floor=0.08)
    assert entered == (DENSE if floor_leaves_dense_a_chance else DONE) and not trial.dense_kept


@pytest.mark.parametrize(
    "speedup, dense_median, kept",
    # the sparse plan measures 0.07 s in both windows; with 1.2 it must be 1.2x faster than dense to stay
    [(1.0, 0.075, False), (1.2, 0.075, True), (1.2, 0.084, True), (1.2, 0.085, False), (1.5, 0.1, True)],
)
def test_the_sparse_plan_stays_only_where_it_is_the_required_speedup_faster(speedup, dense_median, kept):
    trial = PlanTrial(1, phase=DENSE, sparse_seconds=0.07, min_sparse_speedup=speedup)
    entered = measured(trial, 1.0, dense_median).end_dense(agreed(0.0))
    if entered == CONFIRM:
        assert measured(trial, 1.0, 0.07).end_confirm(agreed(0.0)) == DONE
    assert trial.phase == DONE and trial.dense_kept == kept
    assert (entered == CONFIRM) == kept  # a dense window beyond the bound ends the trial on sparse at once


@pytest.mark.parametrize("bad", [0.9, 0, -1.0, math.inf, math.nan, True, "1.2", None])
def test_min_sparse_speedup_must_be_a_finite_number_of_at_least_one(bad):
    for comm in ("allgather", "auto"):
        with pytest.raises(ValueError, match=r"min_sparse_speedup must be a finite number >= 1\.0.*got"):
            COMMUNICATORS.build(comm, min_sparse_speedup=bad)
    assert COMMUNICATORS.build("auto", min_sparse_speedup=1.25).min_sparse_speedup == 1.25
    assert COMMUNICATORS.build("zen").min_sparse_speedup == 1.0


@pytest.mark.parametrize("speedup, kept", [(1.0, False), (1.2, True)])
def test_the_engine_holds_the_trial_to_the_communicators_speedup(pool2, speedup, kept):
    """Sparse 0.07 s against dense 0.08 s on 2 ranks: the faster step keeps sparse; asked for 1.2x,
    both ranks keep dense, switch at the same step and end on the same parameters."""
    medians = {SPARSE: 0.07, DENSE: 0.08, CONFIRM: 0.07}
    results = pool2.run(train_with_trial, 15, 0.0, medians, "auto", "ahead", speedup)
    first = results[0]
    assert first["trial"]["phase"] == DONE and first["dense_measured_faster"] == kept
    expected = [False] * 3 + [True] * 3 + ([False] * 3 + [True] * 2 if kept else [False] * 5)
    assert [first["all_dense"][step] for step in range(4, 15)] == expected
    for rank, result in enumerate(results):
        assert result["trial"] == first["trial"] and result["all_dense"] == first["all_dense"]
        for name, value in result["params"].items():
            assert torch.equal(value, first["params"][name]), f"rank {rank}: {name} differs from rank 0"


def test_sparse_windows_that_drifted_apart_measure_dense_and_sparse_once_more():
    """The host slowed during the second sparse window (0.07 -> 0.095, beyond DRIFT_LIMIT): dense
    (0.068) is measured again beside it, the second sparse window is the one before the new dense
    one, and the decision is taken on the second comparison alone."""
    trial = PlanTrial(1, phase=DENSE, sparse_seconds=0.07)
    assert measured(trial, 1.0, 0.068).end_dense(agreed(0.0)) == CONFIRM
    assert measured(trial, 1.0, 0.095).end_confirm(agreed(0.0)) == DENSE == trial.phase
    assert trial.discarded == (pytest.approx(0.068), pytest.approx(0.095)) and trial.dense_seconds is None
    assert trial.before_dense_seconds == pytest.approx(0.095) and not trial.dense_kept
    # under the slower host dense takes 0.094 and sparse 0.09 again: sparse is kept (0.0925 a step),
    # where the first comparison's mean (0.0825 against 0.068) would have kept dense
    assert measured(trial, 1.0, 0.094).end_dense(agreed(0.0)) == CONFIRM
    assert measured(trial, 1.0, 0.09).end_confirm(agreed(0.0)) == DONE and not trial.dense_kept
    assert trial.sparse_estimate == pytest.approx((0.095 + 0.09) / 2)
    assert trial.summary() == (
        "sparse 70 ms, dense 68 ms, sparse again 95 ms, dense 94 ms, sparse again 90 ms a step -> sparse"
    )


def test_the_drift_check_measures_again_once_only():
    trial = PlanTrial(1, phase=DENSE, sparse_seconds=0.07)
    measured(trial, 1.0, 0.06).end_dense(agreed(0.0))
    assert measured(trial, 1.0, 0.05).end_confirm(agreed(0.0)) == DENSE  # 0.07 / 0.05 = 1.4
    measured(trial, 1.0, 0.04).end_dense(agreed(0.0))
    assert measured(trial, 1.0, 0.03).end_confirm(agreed(0.0)) == DONE  # 0.05 / 0.03 drifts too: no third time
    assert trial.dense_kept and trial.sparse_estimate == pytest.approx(0.04)  # (0.05 + 0.03) / 2: a tie keeps dense


@pytest.mark.parametrize("again", [0.0545, 0.09])
def test_windows_within_the_drift_limit_decide_at_once(again):
    trial = PlanTrial(1, phase=DENSE, sparse_seconds=0.07)
    measured(trial, 1.0, 0.05).end_dense(agreed(0.0))
    assert measured(trial, 1.0, again).end_confirm(agreed(0.0)) == DONE and trial.discarded is None


def test_a_resumed_trial_measures_its_phase_again():
    trial = PlanTrial(2, phase=CONFIRM, samples=[0.1], sparse_seconds=0.07, fused_seconds=0.06, recut_seconds=0.068,
                      dense_seconds=0.05)
    resumed = PlanTrial(2)
    resumed.load_state_dict(trial.state_dict())
    assert (resumed.phase, resumed.sparse_seconds, resumed.fused_seconds, resumed.recut_seconds, resumed.dense_seconds,
            resumed.samples) == (CONFIRM, 0.07, 0.06, 0.068, 0.05, [])
    # a checkpoint from before the recut phase keeps the one buffer its single window chose
    resumed.load_state_dict({"phase": DONE, "sparse_seconds": 0.07, "fused_seconds": 0.06, "dense_seconds": None})
    assert resumed.recut_seconds == 0.07 and resumed.fused_kept
    # checkpoints of older versions: no one-buffer phase, then no confirm phase (dense kept on the first comparison)
    resumed.load_state_dict({"phase": SPARSE, "sparse_seconds": None, "dense_seconds": None})
    assert resumed.fused_seconds is None and resumed.confirmed_seconds is None and resumed.phase == SPARSE
    resumed.load_state_dict({"phase": DONE, "sparse_seconds": 0.07, "fused_seconds": None, "dense_seconds": 0.06})
    assert resumed.confirmed_seconds is None and resumed.dense_kept


def test_dense_trial_steps_is_on_for_auto_and_opt_in_for_a_fixed_scheme():
    assert COMMUNICATORS.build("auto").dense_trial_steps == 16
    assert COMMUNICATORS.build("auto", dense_fallback=False, dense_trial_steps=5).dense_trial_steps == 0
    assert COMMUNICATORS.build("allgather").dense_trial_steps == 0
    assert COMMUNICATORS.build("zen", dense_trial_steps=4).dense_trial_steps == 4
    for name in ("auto", "allgather", "oktopk"):
        for bad in (-1, 2.5, True, "5"):
            with pytest.raises(ValueError, match=f"dense_trial_steps must be an integer >= 0, got {bad!r}"):
                COMMUNICATORS.build(name, dense_trial_steps=bad)
    with pytest.raises(ValueError, match="dense_trial_steps must be an integer >= 0, got -1"):
        COMMUNICATORS.build("auto", dense_fallback=False, dense_trial_steps=-1)


def agree_on_rank_dependent_medians() -> float:
    rank = dist.get_rank()
    return mean_over_ranks(0.05 + 0.02 * rank, None, torch.device("cpu"))


def test_the_ranks_agree_on_the_mean_of_their_medians(pool2):
    """One rank's noisy window moves the agreed median by its share alone (a max took it whole)."""
    assert pool2.run(agree_on_rank_dependent_medians) == [pytest.approx(0.06)] * 2


@contextmanager
def slow_allreduce_and_floor(floor: float):
    """The links measure a slow all-reduce, so that the model's own fallback keeps the plan sparse
    (on loopback it sends these small models dense), and ``floor`` replaces the modelled dense
    all-reduce that decides whether the dense phase runs."""
    links = {"allreduce": Link(0.05, 1e-6), "allgather": Link(1e-4, 1e-9)}
    original = FusionEngine._dense_floor, engine_module.measure_links
    FusionEngine._dense_floor = lambda self: floor
    engine_module.measure_links = lambda collectives, *args, **kwargs: {name: links[name] for name in collectives}
    try:
        yield
    finally:
        FusionEngine._dense_floor, engine_module.measure_links = original


def train_with_trial(
    steps: int, floor: float, medians: dict[str, float | list[float]] | None = None, comm: str = "auto",
    fusion: str = "ahead", min_sparse_speedup: float = 1.0, memory: str = "residual", ddp_handoff: bool = True,
    callbacks: tuple = (),
) -> dict:
    """``comm`` and ``fusion`` (auto and ahead by default) with a 2-step trial after the 3 profiled rounds (steps 1-3; costs
    from step 4 on): the sparse phase times steps 4 to 6 (4 left out), the dense phase (where it
    runs) 7 to 9, the sparse plan again (where dense measured no slower) 10 to 12. ``medians``: each
    phase's agreed median, scripted (a list: one per time the phase ends; None: measured, and then
    with no drift check, whose second comparison would outlast the run: the drift's own test
    scripts it)."""
    L.seed_everything(0, verbose=False)
    model = Regressor(width=256)
    comm_options = {"dense_trial_steps": 2, "min_sparse_speedup": min_sparse_speedup,
                    **({"schemes": ["allreduce", "allgather"]} if comm == "auto" else {})}
    strategy = ssf.SSFusionStrategy(
        sparsifier="topk", density=0.01, fusion=fusion, comm=comm, offload="none", comm_options=comm_options,
        memory=memory, ddp_handoff=ddp_handoff,
    )
    plans: list[tuple[int, bool]] = []
    handed: list[tuple[int, bool]] = []

    class PlanPerStep(L.Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            engine = strategy.engine
            plans.append((engine.step, all(not b.sparse_slots for b in engine.plan.buffers)))
            handed.append((engine.step, strategy.handed_off))

    with slow_allreduce_and_floor(floor), scripted_medians(medians), drift_limit(math.inf if medians is None else DRIFT_LIMIT):
        make_trainer(strategy, steps, callbacks=[PlanPerStep(), *callbacks]).fit(model, DataLoader(regression_data(), batch_size=16))
    state = strategy._final_engine_state
    return {
        "trial": state["trial"],
        "dense_measured_faster": state["costs"]["dense_measured_faster"],
        "all_dense": dict(plans),
        "handed_off": dict(handed),
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
    }


@contextmanager
def scripted_medians(medians: dict[str, float] | None):
    """The agreed median of each phase is ``medians[phase]`` (None: the engine's own agreement)."""
    original = FusionEngine._agreed_mean
    if medians is not None:
        queues = {phase: list(value) if isinstance(value, list) else None for phase, value in medians.items()}

        def scripted(self, value: float) -> float:
            phase = self._trial.phase
            return medians[phase] if queues[phase] is None else queues[phase].pop(0)

        FusionEngine._agreed_mean = scripted
    try:
        yield
    finally:
        FusionEngine._agreed_mean = original


@contextmanager
def drift_limit(limit: float):
    original = trial_module.DRIFT_LIMIT
    trial_module.DRIFT_LIMIT = limit
    try:
        yield
    finally:
        trial_module.DRIFT_LIMIT = original


def kept_dense(trial_state: dict) -> bool:
    trial = PlanTrial(2)
    trial.load_state_dict(trial_state)
    return trial.dense_kept


def test_every_rank_runs_the_trial_at_the_same_steps_and_decides_alike(pool2):
    results = pool2.run(train_with_trial, 14, 0.0)
    first = results[0]
    trial = first["trial"]
    assert trial["phase"] == DONE and trial["dense_seconds"] is not None
    assert all(r["trial"] == trial and r["all_dense"] == first["all_dense"] for r in results)
    confirmed = trial["dense_seconds"] <= trial["sparse_seconds"]
    assert (trial["confirmed_seconds"] is not None) == confirmed
    kept = kept_dense(trial)
    assert first["dense_measured_faster"] == kept and (confirmed or not kept)
    dense_at = first["all_dense"]
    # the model's plan before and in the sparse phase, dense in the dense phase, then the sparse plan
    # again where dense measured no slower, then the decision
    assert not any(dense_at[step] for step in range(7)) and all(dense_at[step] for step in (7, 8, 9))
    decided_at = 13 if confirmed else 10
    assert not any(dense_at[step] for step in range(10, decided_at))
    assert all(dense_at[step] == kept for step in range(decided_at, 14))
    for rank, result in enumerate(results):
        for name, value in result["params"].items():
            assert torch.equal(value, first["params"][name]), f"rank {rank}: {name} differs from rank 0"


@pytest.mark.parametrize("again, kept", [(0.06, True), (0.058, False)])
def test_a_dense_phase_no_slower_is_checked_against_the_sparse_plan_measured_again(pool2, again, kept):
    """Dense 0.065 s against sparse 0.07 s: the sparse plan runs again (steps 10-12), and dense is
    kept where it is no slower than the mean of the two sparse windows (0.065 s; 0.064 s)."""
    medians = {SPARSE: 0.07, DENSE: 0.065, CONFIRM: again}
    results = pool2.run(train_with_trial, 15, 0.0, medians)
    first = results[0]
    expected = {"phase": DONE, "sparse_seconds": 0.07, "fused_seconds": None, "recut_seconds": None, "dense_seconds": 0.065,
                "confirmed_seconds": again, "discarded": None}
    assert first["trial"] == expected and first["dense_measured_faster"] == kept
    assert [first["all_dense"][step] for step in range(4, 15)] == [False] * 3 + [True] * 3 + [False] * 3 + [kept] * 2
    # the dense window runs under DDP's reducer and the sparse plan on the engine again; a dense outcome
    # flushes what the error feedback owes in one engine round (step 13), then DDP takes over for good
    assert [first["handed_off"][step] for step in range(4, 15)] == [False] * 3 + [True] * 3 + [False] * 4 + [kept]
    for rank, result in enumerate(results):
        assert result["trial"] == expected and result["all_dense"] == first["all_dense"]
        for name, value in result["params"].items():
            assert torch.equal(value, first["params"][name]), f"rank {rank}: {name} differs from rank 0"


def trial_with_momentum_correction(ddp_handoff: bool) -> dict:
    """memory="dgc" through the dense window (steps 7-9) into the sparse plan: per step whether DDP
    ran it, and before the backward after step 10 (the engine's again) the parameters, the memory's
    momenta and the SGD's momentum and buffers."""
    before: dict = {}

    class AfterTheWindow(L.Callback):
        def on_before_backward(self, trainer, module, loss):
            strategy = trainer.strategy
            if strategy.engine.step == 10:
                optimizer = strategy.optimizers[0]
                before.update(
                    params={n: p.detach().clone() for n, p in module.named_parameters()},
                    momenta={k: v.clone() for k, v in strategy.engine.memory.momenta.items()},
                    sgd_momentum=optimizer.param_groups[0]["momentum"],
                    sgd_buffers=sum("momentum_buffer" in state for state in optimizer.state.values()),
                )

    medians = {SPARSE: 0.07, DENSE: 0.065, CONFIRM: 0.058}
    result = train_with_trial(11, 0.0, medians, memory="dgc", ddp_handoff=ddp_handoff, callbacks=(AfterTheWindow(),))
    return {"handed_off": result["handed_off"], **before}


def test_momentum_correction_goes_to_the_sgd_for_the_dense_window_and_comes_back(pool2):
    """Under DDP's reducer the SGD steps with the ranks' averaged momentum correction as its buffer, so
    the dense window ends where the engine's own dense rounds end, to rounding. When the engine's
    hooks are back, that buffer is every rank's momentum again and the SGD has none: the momentum the
    ranks hold adds up to what the engine's rounds leave them (each rank's own there), and is applied
    once, never lost."""
    handed = pool2.run(trial_with_momentum_correction, True)
    engine_only = pool2.run(trial_with_momentum_correction, False)
    assert [handed[0]["handed_off"][step] for step in range(4, 11)] == [False] * 3 + [True] * 3 + [False]
    assert not any(engine_only[0]["handed_off"].values())
    for ours, reference in zip(handed, engine_only):
        assert (ours["sgd_momentum"], ours["sgd_buffers"], reference["sgd_momentum"]) == (0.0, 0, 0.0)
        for name, value in ours["params"].items():
            torch.testing.assert_close(value, reference["params"][name], rtol=1e-5, atol=1e-7, msg=name)
    assert handed[0]["momenta"].keys() == engine_only[0]["momenta"].keys() and handed[0]["momenta"]
    for key, momentum in handed[0]["momenta"].items():
        assert torch.equal(momentum, handed[1]["momenta"][key]), f"{key}: the ranks took back different momenta"
        held = sum(result["momenta"][key] for result in engine_only)
        torch.testing.assert_close(2 * momentum, held, rtol=1e-5, atol=1e-7, msg=key)


def test_sparse_windows_that_drifted_apart_repeat_the_comparison_on_every_rank_alike(pool2):
    """The second sparse window (0.095 s) is 1.36x the first (0.07 s): dense runs again (steps
    13-15, 0.09 s) and the sparse plan after it (16-18, 0.088 s); dense is kept from step 19 on
    the second comparison (0.09 against the mean 0.0915), on every rank."""
    medians = {SPARSE: 0.07, DENSE: [0.065, 0.09], CONFIRM: [0.095, 0.088]}
    results = pool2.run(train_with_trial, 22, 0.0, medians)
    first = results[0]
    expected = {"phase": DONE, "sparse_seconds": 0.07, "fused_seconds": None, "recut_seconds": None, "dense_seconds": 0.09,
                "confirmed_seconds": 0.088, "discarded": [0.065, 0.095]}
    assert first["trial"] == expected and first["dense_measured_faster"]
    assert [first["all_dense"][step] for step in range(4, 22)] == ([False] * 3 + [True] * 3) * 3
    for result in results:
        assert result["trial"] == expected and result["all_dense"] == first["all_dense"]


def test_no_dense_step_is_taken_where_the_link_rules_dense_out(pool2):
    for result in pool2.run(train_with_trial, 10, 1e9):
        assert result["trial"]["phase"] == DONE and result["trial"]["dense_seconds"] is None
        assert not result["dense_measured_faster"] and not any(result["all_dense"].values())


def train_without_trial() -> dict:
    L.seed_everything(0, verbose=False)
    strategy = ssf.SSFusionStrategy(
        sparsifier="topk", density=0.01, fusion="ahead", comm="auto", offload="none", comm_options={"dense_trial_steps": 0}
    )
    make_trainer(strategy, 9).fit(Regressor(width=256), DataLoader(regression_data(), batch_size=16))
    return strategy._final_engine_state


def test_a_run_without_the_trial_saves_none(pool2):
    for state in pool2.run(train_without_trial):
        assert state["trial"] is None and not state["costs"]["dense_measured_faster"]


def resume_after_trial(path: str, floor: float) -> tuple[dict, dict, bool, bool]:
    """Train through the trial (13 steps) and checkpoint, then resume to step 15: the trial's
    outcome and the plan it kept come back as saved, and no phase runs again. Measured step times,
    so no drift check (its second comparison would outlast the 13 steps)."""
    L.seed_everything(0, verbose=False)
    options = dict(
        sparsifier="topk", density=0.01, fusion="ahead", comm="auto", offload="none",
        comm_options={"dense_trial_steps": 2, "schemes": ["allreduce", "allgather"]},
    )
    with slow_allreduce_and_floor(floor), drift_limit(math.inf):
        first, second, resumed = checkpoint_and_resume(
            lambda: ssf.SSFusionStrategy(**options), path, 13, 15,
            lambda engine: {"all_dense": all(not b.sparse_slots for b in engine.plan.buffers)}, width=256,
        )
    saved = first._final_engine_state
    saved_dense = saved["costs"]["dense_measured_faster"]
    return saved["trial"], second._final_engine_state["trial"], saved_dense, resumed["all_dense"]


@pytest.mark.parametrize("floor", [0.0, 1e9])
def test_a_resumed_run_keeps_the_trials_outcome(pool2, tmp_path, floor):
    for saved, final, dense, resumed_dense in pool2.run(resume_after_trial, str(tmp_path / "trial.ckpt"), floor):
        assert saved["phase"] == DONE and final == saved
        assert resumed_dense == dense == (floor == 0.0 and kept_dense(saved))


@contextmanager
def one_buffer_a_tensor_and_scripted_medians(medians: dict[str, float]):
    """The cost cut puts every tensor in a buffer of its own, so that one buffer is a different
    plan, and the agreed median of each phase is ``medians[phase]``: the decisions are the test's,
    the plans, switches and training are the engine's."""
    original = cut_module.cut_by_cost
    cut_module.cut_by_cost = lambda params, *args, **kwargs: [[item] for item in params]
    try:
        with scripted_medians(medians):
            yield
    finally:
        cut_module.cut_by_cost = original


def train_with_fused_phase(steps: int, fused_median: float, recut: float | None) -> dict:
    """As ``train_with_trial`` with no dense phase (the floor rules it out): the sparse phase times
    steps 4 to 6, the one-buffer phase 7 to 9, the cut's plan again 10 to 12."""
    L.seed_everything(0, verbose=False)
    model = Regressor(width=256)
    strategy = ssf.SSFusionStrategy(
        sparsifier="topk", density=0.01, fusion="ahead", comm="auto", offload="none",
        comm_options={"dense_trial_steps": 2, "schemes": ["allreduce", "allgather"]},
    )
    buffers: dict[int, int] = {}

    class BuffersPerStep(L.Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            buffers[strategy.engine.step] = len(strategy.engine.plan.buffers)

    medians = {SPARSE: 0.07, FUSED: fused_median, RECUT: recut}
    with slow_allreduce_and_floor(1e9), one_buffer_a_tensor_and_scripted_medians(medians):
        make_trainer(strategy, steps, callbacks=[BuffersPerStep()]).fit(model, DataLoader(regression_data(), batch_size=16))
    state = strategy._final_engine_state
    return {
        "trial": state["trial"],
        "fused_measured_faster": state["costs"]["fused_measured_faster"],
        "buffers": buffers,
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
    }


@pytest.mark.parametrize("fused_median, recut, kept", [(0.05, 0.07, True), (0.065, 0.058, False), (0.09, 0.07, False)])
def test_every_rank_measures_one_buffer_and_keeps_the_faster_plan(pool2, fused_median, recut, kept):
    """One buffer against the cut's plan measured before (0.07 s) and after it: kept at 0.05 s against
    the cut's 0.07 s, not at 0.065 s against 0.064 s nor at 0.09 s, on every rank."""
    results = pool2.run(train_with_fused_phase, 15, fused_median, recut)
    first = results[0]
    assert first["trial"] == {
        "phase": DONE, "sparse_seconds": 0.07, "fused_seconds": fused_median, "recut_seconds": recut, "dense_seconds": None,
        "confirmed_seconds": None, "discarded": None,
    }
    assert first["fused_measured_faster"] == kept
    buffers = first["buffers"]
    cut = buffers[4]
    assert cut > 1
    # the cut's plan through the sparse phase, one buffer in the fused phase, the cut's plan again, then the faster one
    assert [buffers[step] for step in range(4, 15)] == [cut] * 3 + [1] * 3 + [cut] * 3 + [1 if kept else cut] * 2
    for rank, result in enumerate(results):
        assert result["buffers"] == buffers and result["trial"] == first["trial"]
        for name, value in result["params"].items():
            assert torch.equal(value, first["params"][name]), f"rank {rank}: {name} differs from rank 0"


def owed_per_step(steps: int, medians: dict[str, float]) -> dict[str, dict]:
    """``train_with_trial``'s run (residual error feedback), recording at every step's start the
    residuals the memory holds and those the engine's checkpoint state holds."""
    L.seed_everything(0, verbose=False)
    strategy = ssf.SSFusionStrategy(
        sparsifier="topk", density=0.01, fusion="ahead", comm="auto", offload="none",
        comm_options={"dense_trial_steps": 2, "schemes": ["allreduce", "allgather"]},
    )
    held: dict[int, dict] = {}
    saved: dict[int, dict] = {}

    class Owed(L.Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            engine = strategy.engine
            held[engine.step] = {name: value.clone() for name, value in engine.memory.residuals.items()}
            saved[engine.step] = engine.state_dict()["memory"]["residuals"]

    with slow_allreduce_and_floor(0.0), scripted_medians(medians):
        make_trainer(strategy, steps, callbacks=[Owed()]).fit(Regressor(width=256), DataLoader(regression_data(), batch_size=16))
    return {"held": held, "saved": saved}


def same_tensors(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)


def test_the_dense_window_sends_no_owed_error_feedback_and_a_sparse_outcome_owes_it_still(pool2):
    """Dense slower (sparse kept): through the dense window (steps 7-9) the memory owes nothing, so
    the window's dense slots send fresh gradients, while a checkpoint still saves what is owed; from
    step 10 on the sparse plan owes exactly what it owed when the window began."""
    for result in pool2.run(owed_per_step, 11, {SPARSE: 0.07, DENSE: 0.09}):
        held, saved = result["held"], result["saved"]
        assert held[6] and all(held[step] == {} for step in (7, 8, 9))
        owed = saved[7]
        assert owed and not same_tensors(owed, held[6])  # step 6's round added to it
        assert all(same_tensors(saved[step], owed) for step in (8, 9, 10)) and same_tensors(held[10], owed)


def test_a_dense_outcome_flushes_what_is_owed_once(pool2):
    """Dense kept (no slower than the sparse windows around it): the window (7-9) owes nothing, the
    sparse plan again (10-12) owes from where it left off, and the dense plan kept from step 13 sends
    what is owed at its first step."""
    for result in pool2.run(owed_per_step, 15, {SPARSE: 0.07, DENSE: 0.065, CONFIRM: 0.07}):
        held, saved = result["held"], result["saved"]
        assert all(held[step] == {} for step in (7, 8, 9)) and same_tensors(held[10], saved[7])
        assert held[13] and held[14] == {} and saved[14] == {}


def resume_in_the_dense_window(path: str) -> dict:
    """Checkpoint in the dense window (after step 7), resume: the window is measured again (steps 8
    to 10, sparse kept), with what is owed set aside from the restore on."""
    medians = {SPARSE: 0.07, DENSE: 0.09}
    options = dict(
        sparsifier="topk", density=0.01, fusion="ahead", comm="auto", offload="none",
        comm_options={"dense_trial_steps": 2, "schemes": ["allreduce", "allgather"]},
    )
    with slow_allreduce_and_floor(0.0), scripted_medians(medians):
        first, second, resumed = checkpoint_and_resume(
            lambda: ssf.SSFusionStrategy(**options), path, 8, 12,
            lambda engine: {"held": dict(engine.memory.residuals), "saved": engine.state_dict()["memory"]["residuals"]},
            width=256,
        )
    return {
        "checkpoint": first._final_engine_state["memory"]["residuals"], "phase": first._final_engine_state["trial"]["phase"],
        "resumed": resumed, "final": second._final_engine_state,
    }


def test_a_checkpoint_in_the_dense_window_saves_what_is_owed_and_the_resumed_window_sets_it_aside(pool2, tmp_path):
    for result in pool2.run(resume_in_the_dense_window, str(tmp_path / "window.ckpt")):
        assert result["phase"] == DENSE and result["checkpoint"]
        assert result["resumed"]["held"] == {} and same_tensors(result["resumed"]["saved"], result["checkpoint"])
        assert result["final"]["trial"]["phase"] == DONE and result["final"]["memory"]["residuals"]
