"""Faults and bad input: errors on every rank instead of hangs, nothing absorbed, nothing lost."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import lightning as L
import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

import ssfusion_lightning as ssf
from ssfusion_lightning.engine.engine import all_finite
from ssfusion_lightning.engine.errors import NonFiniteGradientError
from tests.workloads import Regressor, make_trainer, regression_data

SPARSE = dict(sparsifier="topk", density=0.05, fusion="ahead", comm="hybrid", offload="none")
DENSE = dict(sparsifier="none", offload="none")


class NaNOnRankOne(Regressor):
    """Rank 1's loss is NaN at step 2 only."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if self.global_step == 2 and self.global_rank == 1:
            loss = loss * float("nan")
        return loss


class EngineProbe(L.Callback):
    def __init__(self) -> None:
        self.skipped = 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.skipped += int(trainer.strategy.last_metrics.skipped_steps)

    def on_train_end(self, trainer, pl_module):
        self.state = trainer.strategy.engine.state_dict()


def nonfinite_run(policy: str, options: dict = SPARSE, steps: int = 6):
    L.seed_everything(0, verbose=False)
    model = NaNOnRankOne()
    probe = EngineProbe()
    trainer = make_trainer(ssf.SSFusionStrategy(nonfinite=policy, **options), steps, callbacks=[probe])
    try:
        trainer.fit(model, DataLoader(regression_data(), batch_size=16))
    except NonFiniteGradientError as error:
        return "raised", str(error)
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    residuals = probe.state["memory"]["residuals"]
    finite = all(torch.isfinite(r).all() for r in residuals.values()) and bool(torch.isfinite(params).all())
    return "finished", (params, finite, probe.skipped, probe.state["step"])


def test_nan_on_one_rank_raises_on_every_rank(pool2):
    for outcome, message in pool2.run(nonfinite_run, "raise"):
        assert outcome == "raised"
        assert "step 2 on rank(s) [1]" in message


def test_nan_in_a_dense_only_step_raises_on_every_rank_without_a_vote(pool2):
    messages = [message for outcome, message in pool2.run(nonfinite_run, "raise", DENSE) if outcome == "raised"]
    assert len(messages) == 2, "a rank went on training past the NaN"
    assert all("step 2 in the all-reduced dense gradients" in m for m in messages), messages
    assert "this rank's own were finite" in messages[0] and "this rank's own were non-finite" in messages[1]


#: dense for good from the first round on: DDP's reducer runs step 2, the engine checks its sums
HANDED_OFF = dict(sparsifier="none", fusion="ahead", comm="allreduce", offload="none")


def test_nan_after_the_hand_off_to_ddp_raises_on_every_rank(pool2):
    messages = [message for outcome, message in pool2.run(nonfinite_run, "raise", HANDED_OFF) if outcome == "raised"]
    assert len(messages) == 2, "a rank went on training past the NaN"
    assert all("non-finite (NaN/Inf) gradient at step 2 in the all-reduced dense gradients" in m for m in messages), messages


@pytest.mark.parametrize("options", [SPARSE, DENSE, HANDED_OFF], ids=["sparse", "dense", "handed-off"])
def test_nan_on_one_rank_is_skipped_by_every_rank(pool2, options):
    results = pool2.run(nonfinite_run, "skip", options)
    (o0, (p0, finite0, skipped0, step0)), (o1, (p1, finite1, skipped1, step1)) = results
    assert o0 == o1 == "finished"
    assert finite0 and finite1, "a NaN reached the parameters or a residual"
    assert skipped0 == skipped1 == 1
    assert step0 == step1 == 5, "the dropped round is not counted as a communication round"
    assert torch.equal(p0, p1)


SELECTIVE = dict(sparsifier="topk", density=0.2, fusion="selective", comm="hybrid", offload="none")


def counted_vote_rounds(policy: str, options: dict, steps: int = 6):
    """nonfinite_run, plus how many separate non-finite vote collectives the engine issued."""
    import ssfusion_lightning.engine.agreement as agreement_module

    original, rounds = agreement_module._nonfinite_vote, []

    def counting(tensor, group):
        rounds.append(tensor.numel())
        return original(tensor, group)

    agreement_module._nonfinite_vote = counting
    try:
        return nonfinite_run(policy, options, steps), len(rounds)
    finally:
        agreement_module._nonfinite_vote = original


@pytest.mark.parametrize("policy", ["raise", "skip"])
def test_the_vote_rides_in_the_last_dense_part_when_there_is_one(pool2, policy):
    """selective keeps the small tensors dense: the vote is appended to that all-reduce (no round of
    its own) and still stops or drops step 2 on every rank; ahead (all sparse) needs the round.
    Four steps: the profiled plan of step 4 on may keep nothing dense."""
    results = pool2.run(counted_vote_rounds, policy, SELECTIVE, 4)
    assert [rounds for _, rounds in results] == [0, 0]
    if policy == "raise":
        assert all(outcome == "raised" and "step 2 on rank(s) [1]" in detail for (outcome, detail), _ in results)
    else:
        (o0, (p0, finite0, skipped0, _)), (o1, (p1, finite1, skipped1, _)) = [outcome for outcome, _ in results]
        assert o0 == o1 == "finished" and finite0 and finite1 and skipped0 == skipped1 == 1
        assert torch.equal(p0, p1)
    # ahead (all sparse): the vote rides in the last buffer's sparse exchange instead (see below);
    # behind with whole buffers offloaded keeps its round: an earlier buffer's check may finish
    # on the worker after the last buffer is packed on the main thread
    whole_offloaded = dict(sparsifier="topk", density=0.05, fusion="behind", comm="hybrid", offload="thread")
    rounds = [rounds for _, rounds in pool2.run(counted_vote_rounds, "skip", whole_offloaded)]
    assert rounds == [6, 6], rounds
    # per-tensor selections offloaded: the last buffer is packed on the worker behind all of them
    offloaded = pool2.run(counted_vote_rounds, "skip", dict(SELECTIVE, offload="thread"), 4)
    assert [rounds for _, rounds in offloaded] == [0, 0]
    assert all(outcome == "finished" and result[2] == 1 for (outcome, result), _ in offloaded)


#: configurations whose vote rides in the last buffer's sparse exchange, one per way it rides;
#: fixed buffers (2 KB: three of them), so that both runs compared below plan alike
RIDES_IN_SPARSE = {
    name: dict(options, buffer_mb=0.002)
    for name, options in {
        "allgather header": SPARSE,
        "aligned allgather header": dict(SPARSE, sparsifier="dgc", fusion="aligned", comm="allgather"),
        "shared-position values": dict(SPARSE, sparsifier="randomk"),
        "zen push counts": dict(SPARSE, comm="zen", comm_options={"choice": "zen"}),
        "sparcml header": dict(SPARSE, comm="zen", comm_options={"choice": "sparcml"}),
        "oktopk counts": dict(sparsifier="threshold_reuse", density=0.05, fusion="behind", comm="oktopk", offload="none"),
        "offloaded per tensor": dict(SPARSE, offload="thread"),
    }.items()
}


def vote_in_own_round(policy: str, options: dict):
    """counted_vote_rounds with no communicator carrying the vote: the round it takes otherwise."""
    from ssfusion_lightning.comm.collectives import SchemeCommunicator

    original = SchemeCommunicator.carries_votes
    SchemeCommunicator.carries_votes = lambda self, buffer: False
    try:
        return counted_vote_rounds(policy, options)
    finally:
        SchemeCommunicator.carries_votes = original


@pytest.mark.parametrize("name", list(RIDES_IN_SPARSE))
def test_the_vote_rides_in_the_last_sparse_exchange(pool2, name):
    """With no dense part to ride in, the vote rides in a message of the last buffer's sparse
    exchange that reaches every rank from every rank: no round of its own, step 2 still stopped
    or dropped on every rank, and the trained parameters bitwise those of the vote's own round."""
    options = RIDES_IN_SPARSE[name]
    raised = pool2.run(counted_vote_rounds, "raise", options)
    assert [rounds for _, rounds in raised] == [0, 0]
    assert all(outcome == "raised" and "step 2 on rank(s) [1]" in detail for (outcome, detail), _ in raised), raised
    riding = pool2.run(counted_vote_rounds, "skip", options)
    own_round = pool2.run(vote_in_own_round, "skip", options)
    assert [rounds for _, rounds in riding] == [0, 0] and [rounds for _, rounds in own_round] == [6, 6]
    for ((o0, (p0, finite0, skipped0, _)), _), ((o1, (p1, _, skipped1, _)), _) in zip(riding, own_round):
        assert o0 == o1 == "finished" and finite0 and skipped0 == skipped1 == 1
        assert torch.equal(p0, p1)
    assert torch.equal(riding[0][0][1][0], riding[1][0][1][0])


def mismatched_density_run():
    density = 0.05 if dist.get_rank() == 0 else 0.02
    trainer = make_trainer(ssf.SSFusionStrategy(**dict(SPARSE, density=density)), 2)
    try:
        trainer.fit(Regressor(), DataLoader(regression_data(), batch_size=16))
    except ValueError as error:
        return str(error)
    return "no error"


def test_mismatched_configuration_is_an_error_at_setup(pool2):
    for message in pool2.run(mismatched_density_run):
        assert "ranks disagree on their configuration" in message and "density" in message


class Wider(Regressor):
    def __init__(self) -> None:
        super().__init__(width=48)


def foreign_checkpoint_run(directory: str, corrupt: bool):
    path = os.path.join(directory, "regressor.ckpt")
    L.seed_everything(0, verbose=False)
    first = make_trainer(ssf.SSFusionStrategy(**SPARSE), 2)
    first.fit(Regressor(), DataLoader(regression_data(), batch_size=16))
    first.save_checkpoint(path)
    if corrupt and dist.get_rank() == 0:
        checkpoint = torch.load(path, weights_only=False)
        checkpoint["ssfusion_engine"]["ranks"][1] = {"step": "garbage"}
        torch.save(checkpoint, path)
    dist.barrier()
    model = Regressor() if corrupt else Wider()
    second = make_trainer(ssf.SSFusionStrategy(**SPARSE), 4)
    try:
        second.fit(model, DataLoader(regression_data(), batch_size=16), ckpt_path=path)
    except (ValueError, RuntimeError) as error:
        return str(error)
    return "no error"


@pytest.mark.parametrize("corrupt", [False, True], ids=["other-model", "corrupted-state"])
def test_foreign_or_corrupted_checkpoints_are_refused(pool2, tmp_path, corrupt):
    messages = pool2.run(foreign_checkpoint_run, str(tmp_path), corrupt, timeout=120)
    if corrupt:
        assert all("corrupted engine state" in m for m in messages), messages
    else:
        # Lightning refuses the model weights first; either way it never trains on them
        assert all(m != "no error" for m in messages)


def test_a_rank_that_dies_fails_the_survivor_with_the_step_named(tmp_path):
    # a fresh launch: an in-process job of an earlier test (Lightning sets MASTER_PORT, LOCAL_RANK,
    # WORLD_SIZE, ... in this process) would make Lightning treat the job as launched from outside
    launch_vars = {"MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "GROUP_RANK"}
    env = {k: v for k, v in os.environ.items() if k not in launch_vars}
    env.update(OMP_NUM_THREADS="1", PL_DISABLE_FORK="1")
    started = time.monotonic()
    job = subprocess.run(
        [sys.executable, os.path.join(os.path.dirname(__file__), "rank_death_job.py")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240,
    )
    elapsed = time.monotonic() - started
    assert job.returncode != 0
    assert "ssfusion: step 3" in job.stderr, job.stderr[-3000:]
    assert elapsed < 200


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 40), min_size=0, max_size=6),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.float64]),
    poison=st.lists(st.tuples(st.integers(0, 5), st.integers(0, 39), st.sampled_from([float("nan"), float("inf"), -float("inf")])), max_size=3),
    scale=st.sampled_from([1.0, 1e30, 1e38]),  # 1e38: fp32 sums overflow on finite values
    mixed=st.booleans(),  # every other tensor in fp64 (a buffer's states need not share a dtype)
)
def test_all_finite_agrees_with_isfinite(sizes, dtype, poison, scale, mixed):
    tensors = [(torch.randn(n, dtype=torch.float64) * scale).to(torch.float64 if mixed and i % 2 else dtype) for i, n in enumerate(sizes)]
    for which, position, value in poison:
        if which < len(tensors) and position < tensors[which].numel():
            tensors[which][position] = value
    expected = all(bool(torch.isfinite(t).all()) for t in tensors)
    assert bool(all_finite(tensors)) == expected
