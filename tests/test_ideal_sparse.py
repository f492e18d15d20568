"""experiments/ideal_sparse.py: the schemes' rules, checked by hand on small gradients (no training)."""

from __future__ import annotations

import pytest
import torch

from experiments.ideal_sparse import Combiner

SHAPES = [(8, 12), (40,), (5, 3, 3)]


def gradients(steps: int, workers: int, seed: int = 0) -> list[list[list[torch.Tensor]]]:
    generator = torch.Generator().manual_seed(seed)
    return [[[torch.randn(shape, generator=generator, dtype=torch.float64) for shape in SHAPES]
             for _ in range(workers)] for _ in range(steps)]


@pytest.mark.parametrize("scheme", ["topk", "global"])
def test_error_feedback_conserves_the_gradient_mass(scheme):
    """What went out plus what every worker still owes is, at every step, all the gradient given."""
    combine = Combiner(scheme, density=0.1, dense_below=40, rank=1, momentum=0.9)
    steps = gradients(6, 3)
    sent = [torch.zeros(shape, dtype=torch.float64) for shape in SHAPES]
    given = [torch.zeros(shape, dtype=torch.float64) for shape in SHAPES]
    for step, per_worker in enumerate(steps):
        for index, out in enumerate(combine(per_worker, step)):
            sent[index] += out
            given[index] += torch.stack([grads[index] for grads in per_worker]).mean(0)
        for index, shape in enumerate(SHAPES):
            owed = sum(combine.state[(index, w)]["e"] for w in range(3)).view(shape) / 3
            torch.testing.assert_close(sent[index] + owed, given[index], rtol=0, atol=1e-12)
    assert 0 < combine.sent < combine.elements  # it did select


def test_per_tensor_top_k_sends_each_tensors_k_largest():
    combine = Combiner("topk", density=0.1, dense_below=0, rank=1, momentum=0.9)
    [per_worker] = gradients(1, 1)
    for grad, out in zip(per_worker[0], combine(per_worker, 0)):
        k = int(0.1 * grad.numel())
        kept = out.reshape(-1).nonzero().view(-1)
        assert set(kept.tolist()) == set(grad.reshape(-1).abs().topk(k).indices.tolist())


def test_momentum_correction_of_dense_tensors_is_momentum_sgd():
    """With every tensor whole, momentum correction sends u = m u + g: what SGD's momentum buffer holds."""
    combine = Combiner("topk_mc", density=0.1, dense_below=10**6, rank=1, momentum=0.9)
    buffers = [torch.zeros(shape, dtype=torch.float64) for shape in SHAPES]
    for step, per_worker in enumerate(gradients(4, 2)):
        outs = combine(per_worker, step)
        for index, out in enumerate(outs):
            buffers[index] = 0.9 * buffers[index] + torch.stack([g[index] for g in per_worker]).mean(0)
            torch.testing.assert_close(out, buffers[index], rtol=0, atol=1e-12)


def test_momentum_correction_masks_what_it_sent():
    """Factor masking: the sent positions' momentum and velocity are zero after the step."""
    combine = Combiner("topk_mc", density=0.1, dense_below=0, rank=1, momentum=0.9)
    [per_worker] = gradients(1, 1)
    outs = combine(per_worker, 0)
    for index, out in enumerate(outs):
        sent = out.reshape(-1).nonzero().view(-1)
        state = combine.state[(index, 0)]
        assert sent.numel() and not state["u"][sent].any() and not state["v"][sent].any()


def test_powersgd_reconstructs_a_rank_one_gradient():
    """One power iteration with a warm start spans a rank-1 matrix: the mean comes back exactly, and
    the workers' errors (each its own matrix less the shared approximation) cancel out."""
    generator = torch.Generator().manual_seed(1)
    a, b = torch.randn(16, 1, generator=generator, dtype=torch.float64), torch.randn(1, 24, generator=generator,
                                                                                       dtype=torch.float64)
    combine = Combiner("powersgd", density=0.1, dense_below=0, rank=1, momentum=0.9)
    per_worker = [[a @ b * scale] for scale in (1.0, 3.0)]
    [out] = combine(per_worker, 2)
    torch.testing.assert_close(out, 2.0 * a @ b, rtol=1e-10, atol=1e-10)
    owed = combine.state[(0, 0)]["e"] + combine.state[(0, 1)]["e"]
    torch.testing.assert_close(owed, torch.zeros_like(owed), rtol=0, atol=1e-10)
