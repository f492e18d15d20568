"""Resume in the middle of an epoch and of a gradient accumulation: the bitwise trajectory."""

from __future__ import annotations

import os

import lightning as L
import pytest
import torch
import torch.distributed as dist

import ssfusion_lightning as ssf
from ssfusion_lightning.data import ResumableDataLoader
from tests.workloads import Regressor, make_trainer, regression_data


class SaveAtBatch(L.Callback):
    """Writes a checkpoint after a given training batch (also between accumulation steps)."""

    def __init__(self, path: str, batch: int) -> None:
        self.path, self.batch, self.count = path, batch, 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.count += 1
        if self.count == self.batch:
            trainer.save_checkpoint(self.path)


class EndState(L.Callback):
    def on_train_end(self, trainer, pl_module):
        self.state = trainer.strategy.engine.state_dict()


def midway_run(directory: str, kwargs: dict, save_after: int, steps: int, accumulate: int):
    path = os.path.join(directory, "midway.ckpt")

    def train(callbacks, ckpt_path=None):
        L.seed_everything(11, verbose=False)
        model = Regressor(optimizer="adamw" if kwargs.get("memory") == "adam" else "sgd")
        end = EndState()
        loader = ResumableDataLoader(regression_data(), batch_size=16, shuffle=True)
        trainer = make_trainer(
            ssf.SSFusionStrategy(**kwargs), steps, max_epochs=-1, callbacks=[end, *callbacks], accumulate_grad_batches=accumulate
        )
        trainer.fit(model, loader, ckpt_path=ckpt_path)
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()]), end.state

    straight = train([SaveAtBatch(path, save_after)])
    dist.barrier()
    resumed = train([], ckpt_path=path)
    return straight, resumed


CASES = {
    # 8 batches per rank per epoch: batch 5 is mid-epoch; batch 7 with accumulation 2 is mid-accumulation
    "mid-epoch-topk-ahead-hybrid": (dict(sparsifier="topk", fusion="ahead", comm="hybrid"), 5, 12, 1),
    "mid-epoch-adam-memory-topk-selective-hybrid": (dict(sparsifier="topk", memory="adam", fusion="selective", comm="hybrid"), 5, 12, 1),
    "mid-epoch-dgc-memory-selective-zen": (dict(sparsifier="dgc", memory="dgc", fusion="selective", comm="zen"), 5, 12, 1),
    # memory="auto" picks its memory at setup again (dgc, for the SGD with momentum), then loads its state
    "mid-epoch-auto-memory-selective-allgather": (dict(sparsifier="dgc", memory="auto", fusion="selective", comm="allgather"), 5, 12, 1),
    # mid-epoch in a later epoch: the sampler's order depends on the epoch
    "mid-second-epoch-dgc-aligned-thread-offload": (dict(sparsifier="dgc", fusion="aligned", comm="hybrid", offload="thread"), 11, 16, 1),
    "mid-accumulation-randomk-behind-allreduce": (dict(sparsifier="randomk", fusion="behind", comm="allreduce"), 7, 8, 2),
    "mid-accumulation-threshold-reuse-aligned-oktopk": (dict(sparsifier="threshold_reuse", fusion="aligned", comm="oktopk"), 7, 8, 2),
    # saved while DDP's reducer runs the steps: the resumed run goes on under it from its first step
    # (mid-accumulation too: the saved local sums are put back into the gradients DDP's no_sync piles up)
    "mid-epoch-handed-off-to-ddp": (dict(sparsifier="none", fusion="ahead", comm="allreduce"), 5, 12, 1),
    "mid-accumulation-handed-off-to-ddp": (dict(sparsifier="none", fusion="ahead", comm="allreduce"), 7, 8, 2),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_resume_midway_is_bitwise(pool2, tmp_path, case):
    kwargs, save_after, steps, accumulate = case
    # a fixed cap: with buffer_mb="auto" a run saved before its costs are agreed (step 4) measures
    # them again after the resume, so its plan, and a randomk trajectory with it, would follow the
    # new timings (resumes after the agreement restore the saved plan and stay bitwise)
    kwargs = dict({"offload": "none", "buffer_mb": 25.0}, **kwargs, density=0.05)
    for (p1, s1), (p2, s2) in pool2.run(midway_run, str(tmp_path), kwargs, save_after, steps, accumulate):
        assert torch.equal(p1, p2)
        assert s1["step"] == s2["step"]
        for key, value in s1["memory"].items():
            for name, tensor in value.items():
                assert torch.equal(tensor, s2["memory"][key][name]), (key, name)
    # torch's safe default reads it, also the local gradient sums saved in the middle of an accumulation
    ranks = torch.load(os.path.join(tmp_path, "midway.ckpt"))["ssfusion_engine"]["ranks"]
    mid_accumulation = save_after % accumulate != 0
    assert all((state["accumulated"] is not None) == mid_accumulation for state in ranks)


@pytest.mark.parametrize("memory, state, optimizer_holds", [("dgc", "momenta", "momentum"), ("adam", "first_moments", "exp_avg")])
def test_a_memory_saved_while_handed_off_resumes_with_its_state_in_one_place(pool2, tmp_path, memory, state, optimizer_holds):
    """memory="dgc" or "adam" saved while DDP's reducer runs the steps: the checkpoint's optimizer holds
    the memory's momentum or moments, and its memory none. The resumed run goes on under DDP's reducer
    from its first step, the optimizer's state where it was: the straight run's trajectory, to the bit."""
    kwargs = dict(sparsifier="none", memory=memory, fusion="ahead", comm="allreduce", offload="none", buffer_mb=25.0)
    for (p1, s1), (p2, s2) in pool2.run(midway_run, str(tmp_path), kwargs, 5, 12, 1):
        assert torch.equal(p1, p2)
        assert s1["step"] == s2["step"] and s1["memory"][state] == {} == s2["memory"][state]
    saved = torch.load(os.path.join(tmp_path, "midway.ckpt"))
    assert all(rank["memory"][state] == {} for rank in saved["ssfusion_engine"]["ranks"])
    optimizer = saved["optimizer_states"][0]
    if memory == "dgc":
        assert optimizer["param_groups"][0]["momentum"] == 0.9
    else:
        assert optimizer["state"] and all(optimizer_holds in param_state for param_state in optimizer["state"].values())
