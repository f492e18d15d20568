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


DENSE = dict(sparsifier="none", fusion="ahead", comm="allreduce", offload="none", process_groups=1)


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
