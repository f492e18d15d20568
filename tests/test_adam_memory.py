"""memory="adam": each rank selects from its own Adam update, and the user's Adam/AdamW becomes the
step that applies the averaged update (sparsifiers/adam_memory.py)."""

from __future__ import annotations

import math
import warnings

import lightning as L
import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import nn
from torch.utils.data import DataLoader

import ssfusion_lightning as ssf
from ssfusion_lightning.sparsifiers import build_memory, build_sparsifier
from ssfusion_lightning.sparsifiers.adam_memory import AveragedUpdate
from ssfusion_lightning.sparsifiers.memory import put_back, set_aside
from tests.workloads import Regressor, make_trainer, regression_data

BETAS, EPS = (0.9, 0.999), 1e-8


def adam_updates(grads: list[torch.Tensor], betas=BETAS, eps=EPS) -> list[torch.Tensor]:
    """Adam's bias-corrected update per step, by the formula, in float64."""
    m = v = torch.zeros_like(grads[0], dtype=torch.float64)
    updates = []
    for t, grad in enumerate(grads, start=1):
        g = grad.double()
        m = betas[0] * m + (1 - betas[0]) * g
        v = betas[1] * v + (1 - betas[1]) * g * g
        updates.append((m / (1 - betas[0] ** t)) / ((v / (1 - betas[1] ** t)).sqrt() + eps))
    return updates


# --------------------------------------------------------------------------- the memory alone
def test_the_update_is_adams_by_hand():
    """Step 1 of Adam is g / (|g| + eps); step 2 follows the bias-corrected moments."""
    memory = build_memory("adam")
    g1, g2 = torch.tensor([3.0, -0.5, 0.0, 2.0], dtype=torch.float64), torch.tensor([1.0, 1.0, -4.0, -2.0], dtype=torch.float64)
    first = memory.compensate_dense("w", g1)
    assert torch.allclose(first, g1 / (g1.abs() + EPS), rtol=1e-15, atol=0)
    memory.settle_dense("w", g1)
    m = 0.1 * (0.9 * g1 + g2) / (1 - 0.9**2)
    v = 0.001 * (0.999 * g1 * g1 + g2 * g2) / (1 - 0.999**2)
    assert torch.allclose(memory.compensate_dense("w", g2), m / (v.sqrt() + EPS), rtol=1e-12, atol=0)
    assert memory.residual("w") is None  # a dense slot owes nothing


@settings(max_examples=25, deadline=None)
@given(
    shape=st.sampled_from([(1,), (5,), (3, 7), (2, 3, 4)]),
    density=st.floats(0.05, 1.0),
    steps=st.integers(1, 10),
    seed=st.integers(0, 10_000),
)
def test_sent_plus_residual_is_the_compensated_update_and_nothing_is_lost(shape, density, steps, seed):
    """At every step sent + r == compensated exactly (sent positions zeroed), and over the run the
    sent values plus the final residual add up to the sum of Adam's updates."""
    generator = torch.Generator().manual_seed(seed)
    grads = [torch.randn(shape, generator=generator, dtype=torch.float64) for _ in range(steps)]
    memory, sparsifier = build_memory("adam"), build_sparsifier("topk", density=density)
    sent_total = torch.zeros(shape, dtype=torch.float64)
    for grad in grads:
        compensated = memory.compensate("w", grad).clone()  # the commit keeps compensate's own tensor as r
        values, indices = sparsifier.select(compensated, key="w")
        sent = torch.zeros(compensated.numel(), dtype=torch.float64)
        sent[indices] = values
        memory.update("w", grad, indices)
        assert torch.equal(sent.view(shape) + memory.residual("w"), compensated)
        assert not memory.residual("w").reshape(-1)[indices].any()
        sent_total += sent.view(shape)
    expected = torch.stack(adam_updates(grads)).sum(0)
    assert torch.allclose(sent_total + memory.residual("w"), expected, rtol=1e-12, atol=1e-12)


def _counting_updates(memory, counts: list[int]):
    """Count the Adam steps ``memory`` computes (compensate's and any commit's), a tensor each."""
    compute = memory._add_adam_steps_

    def counted(totals, *args, **kwargs):
        counts.extend([1] * len(totals))
        return compute(totals, *args, **kwargs)

    memory._add_adam_steps_ = counted


@settings(max_examples=25, deadline=None)
@given(
    shape=st.sampled_from([(1,), (6,), (3, 7)]),
    density=st.floats(0.05, 1.0),
    feedback=st.sampled_from([1.0, 0.9]),
    clip_norm=st.sampled_from([None, 0.5]),
    steps=st.integers(2, 8),
    seed=st.integers(0, 10_000),
)
def test_the_commit_adds_compensates_update_with_the_bits_of_computing_it_again(shape, density, feedback, clip_norm, steps, seed):
    """A commit of the gradient compensate saw keeps compensate's tensor as the residual; a commit of
    another gradient tensor computes the update again. Both leave the same bits in every state, and
    only the first computes one update a round."""
    generator = torch.Generator().manual_seed(seed)
    grads = [torch.randn(shape, generator=generator) for _ in range(steps)]
    memories = {"reused": build_memory("adam", clip_norm=clip_norm, feedback=feedback),
                "computed again": build_memory("adam", clip_norm=clip_norm, feedback=feedback)}
    counts: dict[str, list[int]] = {name: [] for name in memories}
    for name, memory in memories.items():
        memory.set_world_size(2)
        _counting_updates(memory, counts[name])
    sparsifier = build_sparsifier("topk", density=density)
    for grad in grads:
        sent = None
        for name, memory in memories.items():
            compensated = memory.compensate("w", grad)
            sent = sparsifier.select(compensated, key="w")[1] if sent is None else sent
            memory.update("w", grad if name == "reused" else grad.clone(), sent)
        for state in ("first_moments", "second_moments", "residuals"):
            assert torch.equal(getattr(memories["reused"], state)["w"], getattr(memories["computed again"], state)["w"])
    assert (len(counts["reused"]), len(counts["computed again"])) == (steps, 2 * steps)


@settings(max_examples=20, deadline=None)
@given(
    shapes=st.lists(st.sampled_from([(1,), (6,), (3, 7), (2, 3, 4)]), min_size=2, max_size=5),
    rounds=st.lists(st.sampled_from(["sparse", "sparse", "dense", "reshape"]), min_size=1, max_size=6),
    seed=st.integers(0, 10_000),
)
def test_a_buffers_tensors_together_give_the_bits_of_one_at_a_time(shapes, rounds, seed):
    """compensate_many, update_many, compensate_dense_many and settle_dense_many step every key in
    one fused call and check them together: the same bits as one key at a time, over sparse and
    dense rounds, fresh keys, keys owing a residual when they go dense, and a key changing shape."""
    generator = torch.Generator().manual_seed(seed)
    keys = [f"w{i}" for i in range(len(shapes))]
    together, alone = build_memory("adam", feedback=0.9), build_memory("adam", feedback=0.9)
    for kind in rounds:
        if kind == "reshape":  # a re-planned tensor of another size starts afresh
            shapes = [(shapes[0][0] + 1,), *shapes[1:]]
        grads = [torch.randn(shape, generator=generator) for shape in shapes]
        if kind == "dense":
            batched = together.compensate_dense_many(keys, grads)
            single = [alone.compensate_dense(key, grad) for key, grad in zip(keys, grads)]
        else:
            batched = together.compensate_many(keys, grads)
            single = [alone.compensate(key, grad) for key, grad in zip(keys, grads)]
        for a, b in zip(batched, single):
            assert torch.equal(a, b)
        if kind == "dense":
            together.settle_dense_many(keys, grads)
            for key, grad in zip(keys, grads):
                alone.settle_dense(key, grad)
        else:
            sent = [torch.randperm(g.numel(), generator=generator)[: max(1, g.numel() // 3)] for g in grads]
            together.update_many(keys, grads, sent, verified=True)
            for key, grad, positions in zip(keys, grads, sent):
                alone.update(key, grad, positions, verified=True)
        assert together.steps == alone.steps
        for state in ("first_moments", "second_moments", "residuals"):
            assert getattr(together, state).keys() == getattr(alone, state).keys()
            for key, tensor in getattr(together, state).items():
                assert torch.equal(tensor, getattr(alone, state)[key])


def test_a_batched_commit_drops_every_overflowed_key_and_names_the_first():
    """A second moment that overflows in a batched commit costs that key its state, as one at a
    time; every other key keeps its commit, and the error names the first key that overflowed."""
    for commit in ("update_many", "settle_dense_many"):
        memory = build_memory("adam")
        keys = ["a", "b", "c", "d"]
        grads = [torch.ones(3), torch.full((3,), 1e22), torch.ones(3), torch.full((3,), 1e22)]  # (1 - b2) g g overflows fp32
        if commit == "update_many":
            memory.compensate_many(keys, grads)
            call = lambda: memory.update_many(keys, grads, [torch.tensor([0])] * 4, verified=True)  # noqa: E731
        else:
            memory.compensate_dense_many(keys, grads)
            call = lambda: memory.settle_dense_many(keys, grads)  # noqa: E731
        with pytest.raises(FloatingPointError, match="'b'"):
            call()
        assert set(memory.second_moments) == set(memory.steps) == {"a", "c"}, commit
        assert memory.steps == {"a": 1, "c": 1}


def test_a_strided_gradient_is_read_in_its_logical_order():
    """The fused Adam step reads its tensors as contiguous memory: transposed gradients give the
    updates of their values, contiguous as the memory's contract says, round after round."""
    memory, reference = build_memory("adam"), build_memory("adam")
    generator = torch.Generator().manual_seed(2)
    for step in range(3):
        grad = torch.randn(7, 3, generator=generator, dtype=torch.float64).t()
        compensated = memory.compensate("w", grad)
        assert compensated.is_contiguous() and torch.equal(compensated, reference.compensate("w", grad.contiguous()))
        if step == 0:
            assert torch.allclose(compensated, grad / (grad.abs() + EPS), rtol=1e-15, atol=0)
        memory.update("w", grad.clone() if step == 1 else grad, torch.tensor([step]))  # a clone: the commit steps in place
        reference.update("w", grad.contiguous(), torch.tensor([step]))
        for state in ("first_moments", "second_moments", "residuals"):
            assert torch.equal(getattr(memory, state)["w"], getattr(reference, state)["w"])


def test_a_dense_round_keeps_the_moments_compensate_dense_stepped():
    """settle_dense after compensate_dense keeps the moments compensate_dense stepped, the same bits
    as stepping them in place, and owes nothing."""
    kept, stepped = build_memory("adam"), build_memory("adam")
    generator = torch.Generator().manual_seed(1)
    for _ in range(4):
        grad = torch.randn(5, 4, generator=generator)
        kept.compensate_dense("w", grad)
        kept.settle_dense("w", grad)
        stepped.settle_dense("w", grad)
    assert torch.equal(kept.first_moments["w"], stepped.first_moments["w"])
    assert torch.equal(kept.second_moments["w"], stepped.second_moments["w"])
    assert kept.steps == stepped.steps == {"w": 4} and kept.residual("w") is None


def test_a_gradient_changed_after_compensate_is_committed_as_it_is_now():
    """compensate's update belongs to the gradient it saw: a gradient changed in place since (the same
    tensor) is committed from its new values, as a memory that never compensated commits it."""
    memory, reference = build_memory("adam"), build_memory("adam")
    first, grad = torch.randn(10), torch.randn(10)
    for m in (memory, reference):
        m.update("w", first, torch.tensor([0, 1]))
    compensated = memory.compensate("w", grad)
    grad.mul_(3.0)
    memory.update("w", grad, torch.tensor([2]))
    reference.update("w", grad, torch.tensor([2]))
    for state in ("first_moments", "second_moments", "residuals"):
        assert torch.equal(getattr(memory, state)["w"], getattr(reference, state)["w"])
    assert memory.residuals["w"] is not compensated


def test_a_compensated_tensor_changed_before_the_commit_is_not_kept():
    """compensate's tensor becomes the residual only as compensate returned it: one a caller changed
    since is left alone, and the commit computes the residual as a memory that never compensated."""
    memory, reference = build_memory("adam"), build_memory("adam")
    first, grad = torch.randn(10), torch.randn(10)
    for m in (memory, reference):
        m.update("w", first, torch.tensor([0, 1]))
    compensated = memory.compensate("w", grad)
    compensated.zero_()
    memory.update("w", grad, torch.tensor([2]))
    reference.update("w", grad, torch.tensor([2]))
    assert torch.equal(memory.residuals["w"], reference.residuals["w"]) and memory.residuals["w"] is not compensated
    assert not compensated.any()


def test_a_window_with_the_residual_set_aside_sends_adams_update_and_owes_what_it_owed():
    """With the owed update set aside, dense slots send Adam's own update (the moments move on), and
    put back the residual is owed as before: over the run, sent + residual is the sum of the updates."""
    generator = torch.Generator().manual_seed(3)
    grads = [torch.randn(8, generator=generator, dtype=torch.float64) for _ in range(7)]
    updates = adam_updates(grads)
    memory = build_memory("adam")
    sent_total = torch.zeros(8, dtype=torch.float64)
    for step, grad in enumerate(grads):
        if step == 2:
            owed = memory.residual("w").clone()
            held = set_aside(memory)
        if step == 5:
            put_back(memory, held)
            assert torch.equal(memory.residual("w"), owed)
        if 2 <= step < 5:
            sent = memory.compensate_dense("w", grad)
            memory.settle_dense("w", grad)
            assert torch.allclose(sent, updates[step], rtol=1e-12, atol=0) and memory.residual("w") is None
        else:
            compensated = memory.compensate("w", grad)
            positions = torch.tensor([step % 8])
            sent = torch.zeros(8, dtype=torch.float64)
            sent[positions] = compensated[positions]  # before the commit, which keeps compensated as r
            memory.update("w", grad, positions)
        sent_total += sent
    assert torch.allclose(sent_total + memory.residual("w"), torch.stack(updates).sum(0), rtol=1e-12, atol=1e-12)


@settings(max_examples=25, deadline=None)
@given(
    feedback=st.floats(0.05, 1.0),
    density=st.floats(0.05, 0.9),
    steps=st.integers(1, 8),
    seed=st.integers(0, 10_000),
)
def test_feedback_keeps_that_fraction_of_the_unsent_update(feedback, density, steps, seed):
    """r == feedback * (compensated - sent) at every step, the moments are untouched by it, and
    what the run drops is exactly (1 - feedback) of each round's unsent part."""
    generator = torch.Generator().manual_seed(seed)
    grads = [torch.randn(3, 7, generator=generator, dtype=torch.float64) for _ in range(steps)]
    memory, exact = build_memory("adam", feedback=feedback), build_memory("adam")
    sparsifier = build_sparsifier("topk", density=density)
    sent_total, dropped = torch.zeros(21, dtype=torch.float64), torch.zeros(21, dtype=torch.float64)
    for grad in grads:
        compensated = memory.compensate("w", grad).reshape(-1)
        _, indices = sparsifier.select(compensated, key="w")
        unsent = compensated.clone()
        unsent[indices] = 0
        sent_total += compensated - unsent
        memory.update("w", grad, indices)
        exact.settle_dense("w", grad)
        assert torch.equal(memory.residual("w").reshape(-1), unsent * feedback)
        dropped += unsent - memory.residual("w").reshape(-1)
    assert torch.equal(memory.first_moments["w"], exact.first_moments["w"])
    expected = torch.stack(adam_updates(grads)).sum(0).reshape(-1)
    assert torch.allclose(sent_total + memory.residual("w").reshape(-1) + dropped, expected, rtol=1e-12, atol=1e-12)


@settings(max_examples=20, deadline=None)
@given(steps=st.integers(2, 6), dropped=st.integers(0, 5), seed=st.integers(0, 10_000))
def test_the_feedback_a_commit_defers_gives_the_bits_of_keeping_it_at_once(steps, dropped, seed):
    """The commit leaves the 90% kept to the next compensate's copy; a memory whose residuals are read
    after every commit (which applies it there and then) computes the same bits, a dropped round
    (compensated, never committed) and a dense window set aside in between included."""
    generator = torch.Generator().manual_seed(seed)
    keys = ["a", "b"]
    deferred, read = build_memory("adam", feedback=0.9), build_memory("adam", feedback=0.9)
    for step in range(steps):
        grads = [torch.randn(4, 6, generator=generator), torch.randn(30, generator=generator)]
        sent = [torch.randperm(24, generator=generator)[:3], torch.randperm(30, generator=generator)[:4]]
        outs = [memory.compensate_many(keys, grads) for memory in (deferred, read)]
        for one, other in zip(*outs):
            assert torch.equal(one, other)
        if step == dropped:
            continue  # the vote dropped the round: nothing commits
        for memory in (deferred, read):
            memory.update_many(keys, grads, sent, verified=True)
        if step == 1:
            put_back(deferred, set_aside(deferred))
        for key, flat_sent in zip(keys, sent):
            residual = read.residual(key).reshape(-1)
            assert torch.all(residual[flat_sent] == 0)
        assert read.state_dict()["residuals"].keys() == set(keys)
    for key in keys:
        assert torch.equal(deferred.residual(key), read.residual(key))
    assert all(torch.equal(a, b) for a, b in zip(deferred.state_dict()["residuals"].values(), read.state_dict()["residuals"].values()))


def test_feedback_bounds_an_entrys_backlog():
    """An entry never selected, with the same update every round, owes at most feedback / (1 - feedback)
    rounds of it (error feedback: one more round each step)."""
    grad = torch.tensor([1.0, 1.0], dtype=torch.float64)
    leaky, exact = build_memory("adam", feedback=0.9), build_memory("adam")
    for _ in range(200):
        for memory in (leaky, exact):
            memory.compensate("w", grad)
            memory.update("w", grad, torch.tensor([0]))
    assert leaky.residual("w")[1] == pytest.approx(9.0, rel=1e-6)  # Adam's update of a constant gradient is 1
    assert exact.residual("w")[1] == pytest.approx(200.0, rel=1e-6)


def test_the_moments_never_see_the_selection():
    """Adam's moments are the optimizer's: sparse and dense rounds step them alike (no masking)."""
    sparse, dense = build_memory("adam"), build_memory("adam")
    generator = torch.Generator().manual_seed(0)
    for _ in range(5):
        grad = torch.randn(4, 6, generator=generator)
        sparse.compensate("w", grad)
        sparse.update("w", grad, torch.tensor([0, 5, 7]))
        dense.settle_dense("w", grad)
    assert torch.equal(sparse.first_moments["w"], dense.first_moments["w"])
    assert torch.equal(sparse.second_moments["w"], dense.second_moments["w"])
    assert sparse.steps == dense.steps == {"w": 5}


def backward_both(model: nn.Module, twin: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    for module in (model, twin):
        module.zero_grad()
        nn.functional.mse_loss(module(x), y).backward()


def send_updates_dense(memory, model: nn.Module) -> None:
    """One rank's dense round: every gradient becomes the memory's Adam update, as the engine sends it."""
    for name, param in model.named_parameters():
        update = memory.compensate_dense(name, param.grad)
        memory.settle_dense(name, param.grad)
        param.grad = update


def test_dense_rounds_through_the_averaged_update_are_adamw():
    """One rank, every slot dense: the memory's update applied by AveragedUpdate is torch's AdamW
    (weight decay per group, a learning rate changed between steps)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 2)).double()
    twin = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 2)).double()
    twin.load_state_dict(model.state_dict())

    def groups(module):
        params = list(module.parameters())
        return [{"params": [p for p in params if p.ndim == 2], "weight_decay": 0.1}, {"params": [p for p in params if p.ndim == 1]}]

    reference = torch.optim.AdamW(groups(twin), lr=0.01, weight_decay=0.0, foreach=False)
    replaced = torch.optim.AdamW(groups(model), lr=0.01, weight_decay=0.0)
    memory = build_memory("adam")
    (ours,) = memory.take_over([replaced])
    x, y = torch.randn(16, 5, dtype=torch.float64), torch.randn(16, 2, dtype=torch.float64)
    for step in range(12):
        for group in replaced.param_groups + reference.param_groups:  # a schedule acting on the user's optimizer
            group["lr"] = 0.01 / (1 + step)
        backward_both(model, twin, x, y)
        send_updates_dense(memory, model)
        ours.step()
        reference.step()
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-12)


def test_take_over_moves_betas_and_eps_and_shares_the_groups():
    params = [nn.Parameter(torch.ones(3))]
    adam = torch.optim.Adam(params, lr=0.5, betas=(0.8, 0.99), eps=1e-6)
    memory = build_memory("adam")
    (replacement,) = memory.take_over([adam])
    assert isinstance(replacement, AveragedUpdate) and replacement.replaced_name == "Adam"
    assert memory.betas == (0.8, 0.99) and memory.eps == 1e-6
    assert replacement.param_groups[0] is adam.param_groups[0]
    assert replacement.param_groups[0]["momentum"] == 0.0


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda p: [torch.optim.SGD(p, lr=0.1)], "the optimizers are SGD"),
        (lambda p: [torch.optim.AdamW(p, amsgrad=True)], "amsgrad=True"),
        (lambda p: [torch.optim.Adam(p, weight_decay=0.1)], "Adam with weight_decay=0.1 added to the gradient"),
        (
            lambda p: [torch.optim.AdamW([{"params": p[:1]}, {"params": p[1:], "betas": (0.5, 0.9)}])],
            "different betas and eps",
        ),
    ],
    ids=["sgd", "amsgrad", "coupled-decay", "two-betas"],
)
def test_take_over_refuses_what_it_cannot_compute(make, message):
    params = [nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(3))]
    with pytest.raises(ValueError, match=message):
        build_memory("adam").take_over(make(params))


def test_a_lr_scheduler_moved_to_the_replacement_does_not_warn():
    params = [nn.Parameter(torch.ones(2))]
    adamw = torch.optim.AdamW(params, lr=1.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(adamw, lambda step: 0.5**step)
    (replacement,) = build_memory("adam").take_over([adamw])
    schedule.optimizer = replacement
    params[0].grad = torch.ones(2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        replacement.step()
        schedule.step()
    assert replacement.param_groups[0]["lr"] == 0.5


def test_the_averaged_update_is_decoupled_decay_on_every_layout(monkeypatch):
    """p <- p - lr (update + wd p) per group: through torch's fused step where every gradient is laid
    out as its parameter (channels_last too), and right for a gradient strided otherwise (which the
    fused kernel would read as its parameter's layout), a float64 group and a parameter without a
    gradient."""
    fused_calls = []
    fused_sgd = torch._fused_sgd_
    monkeypatch.setattr(torch, "_fused_sgd_", lambda *a, **kw: fused_calls.append(len(a[0])) or fused_sgd(*a, **kw))
    torch.manual_seed(0)
    flat, strided, wide, idle = (nn.Parameter(torch.randn(*shape)) for shape in [(5, 3), (4, 6), (3,), (2,)])
    kernel = nn.Parameter(torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last))
    double = nn.Parameter(torch.randn(7, dtype=torch.float64))
    adamw = torch.optim.AdamW(
        [{"params": [flat, wide, idle, kernel], "weight_decay": 0.1}, {"params": [strided], "weight_decay": 0.2},
         {"params": [double], "weight_decay": 0.0, "lr": 0.25}],
        lr=0.5,
    )
    (replacement,) = build_memory("adam").take_over([adamw])
    flat.grad, wide.grad, double.grad = torch.randn(5, 3), torch.randn(3), torch.randn(7, dtype=torch.float64)
    strided.grad = torch.randn(6, 4).t()
    kernel.grad = torch.randn_like(kernel)
    expected = {
        id(p): p.detach() - lr * (p.grad + wd * p.detach())
        for p, lr, wd in [(flat, 0.5, 0.1), (wide, 0.5, 0.1), (kernel, 0.5, 0.1), (strided, 0.5, 0.2), (double, 0.25, 0.0)]
    }
    before_idle = idle.detach().clone()
    replacement.step()
    for p in (flat, wide, kernel, strided, double):
        torch.testing.assert_close(p.detach(), expected[id(p)], rtol=1e-6, atol=1e-6)
    assert torch.equal(idle.detach(), before_idle)
    assert fused_calls == [3, 1]  # the groups laid out alike in one kernel call each; the strided one not


def test_a_scaled_gradient_is_refused():
    with pytest.raises(ValueError, match="GradScaler"):
        build_memory("adam").compensate("w", torch.ones(3), loss_scale=torch.tensor(1024.0))


def test_bad_options_are_refused():
    with pytest.raises(ValueError, match="clip_norm must be None or a number >= 0, got -1"):
        build_memory("adam", clip_norm=-1)


@pytest.mark.parametrize("feedback", [0, 0.0, -0.5, 1.5, True, "0.9", None])
def test_a_feedback_outside_0_to_1_is_refused(feedback):
    with pytest.raises(ValueError, match=rf"feedback is the fraction .* in \(0, 1\], got {feedback!r}"):
        build_memory("adam", feedback=feedback)


# --------------------------------------------------------------------------- in the strategy, 2 ranks
ADAM = dict(memory="adam", fusion="ahead", offload="none", process_groups=1)


class Batches(L.Callback):
    """The batches this rank trained on, in order."""

    def __init__(self) -> None:
        self.seen: list[tuple[torch.Tensor, torch.Tensor]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.seen.append((batch[0].clone(), batch[1].clone()))


def adam_run(kwargs: dict, steps: int = 8, **trainer_kwargs):
    L.seed_everything(0, verbose=False)
    model = Regressor(optimizer="adamw", lr=0.01)
    batches = Batches()
    trainer = make_trainer(ssf.SSFusionStrategy(**kwargs), steps, callbacks=[batches], **trainer_kwargs)
    trainer.fit(model, DataLoader(regression_data(), batch_size=16))
    optimizer = trainer.optimizers[0]
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return params, type(optimizer).__name__, optimizer.param_groups[0]["lr"], batches.seen


def averaged_adam_reference(
    batches: list[list[tuple[torch.Tensor, torch.Tensor]]], handed_from: int | None = None
) -> dict[str, torch.Tensor]:
    """By hand: every rank's Adam update from its own batches (``batches[rank][step]``), the updates
    averaged, applied with the schedule's rate and AdamW's decoupled decay. From step ``handed_from``
    on (DDP's reducer), AdamW on the averaged gradient, its moments starting from the ranks' averaged."""
    L.seed_everything(0, verbose=False)
    model = Regressor(optimizer="adamw", lr=0.01)
    world, steps = len(batches), len(batches[0])
    trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    moments = [{n: (0.0, 0.0) for n, _ in trained} for _ in range(world)]
    for step in range(steps):
        updates = []
        grads = []
        for rank in range(world):
            x, y = batches[rank][step]
            model.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            grads.append({name: param.grad.clone() for name, param in trained})
        if step == handed_from:
            averaged = {n: tuple(sum(moments[r][n][i] for r in range(world)) / world for i in (0, 1)) for n, _ in trained}
            moments = [averaged] * world
        if handed_from is not None and step >= handed_from:
            grads = [{n: sum(g[n] for g in grads) / world for n, _ in trained}] * world
        for rank in range(world):
            update, t = {}, step + 1
            for name, param in trained:
                grad = grads[rank][name]
                m, v = moments[rank][name]
                m, v = 0.9 * m + 0.1 * grad, 0.999 * v + 0.001 * grad**2
                moments[rank] = {**moments[rank], name: (m, v)}
                update[name] = (m / (1 - 0.9**t)) / ((v / (1 - 0.999**t)).sqrt() + EPS)
            updates.append(update)
        lr = 0.01 / (1 + step)
        with torch.no_grad():
            for name, param in trained:
                decay = 0.1 if param.ndim >= 2 else 0.0
                param -= lr * (sum(u[name] for u in updates) / world + decay * param)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def dense_adam_against_reference(ddp_handoff: bool):
    params, optimizer, lr, seen = adam_run(dict(ADAM, sparsifier="none", comm="allreduce", ddp_handoff=ddp_handoff))
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, seen)
    return params, optimizer, lr, averaged_adam_reference(everyone, handed_from=1 if ddp_handoff else None)


@pytest.mark.parametrize("ddp_handoff", [False, True], ids=["engine", "handed-to-ddp"])
def test_dense_slots_apply_the_ranks_averaged_adam_update(pool2, ddp_handoff):
    """The engine's dense rounds send each rank's Adam update. With the hand-off, DDP's reducer runs the
    rounds after the first, and the replaced AdamW steps on the averaged gradient from the ranks'
    averaged moments on: the schedule keeps acting on the same groups either way."""
    for params, optimizer, lr, reference in pool2.run(dense_adam_against_reference, ddp_handoff):
        assert optimizer == "AveragedUpdate"
        assert lr == pytest.approx(0.01 / 9)  # the schedule stepped 8 times on the replacement
        for name in reference:
            assert torch.allclose(params[name], reference[name], rtol=0, atol=1e-6), name


def sparse_adam_runs(feedback: float = 1.0):
    return adam_run(dict(ADAM, sparsifier="topk", density=0.1, comm="hybrid", memory_options={"feedback": feedback}), steps=12)


def test_sparse_adam_keeps_the_ranks_identical(pool2):
    (a, name_a, _, _), (b, name_b, _, _) = pool2.run(sparse_adam_runs)
    (c, _, _, _), (d, _, _, _) = pool2.run(sparse_adam_runs, 0.5)
    assert name_a == name_b == "AveragedUpdate"
    for name in a:
        assert torch.equal(a[name], b[name]), name
        assert torch.equal(c[name], d[name]), name
    assert any(not torch.equal(a[name], c[name]) for name in a)  # the option reached the memory


def refused_setup(what: str) -> str:
    trainer_kwargs = {"gradient_clip_val": 1.0} if what == "clip" else {
        "plugins": [MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu"))]
    }
    try:
        adam_run(dict(ADAM, sparsifier="topk", density=0.1, comm="allgather"), steps=1, **trainer_kwargs)
    except ValueError as error:
        return str(error)
    return "no error"


@pytest.mark.parametrize(
    "what, message",
    [
        ("clip", "gradient_clip_val=None and clip each rank's gradient before its moments with memory_options={'clip_norm': 1.0}"),
        ("fp16", "use precision='bf16-mixed' or '32-true'"),
    ],
)
def test_what_would_act_on_the_update_is_refused_at_setup(pool2, what, message):
    for error in pool2.run(refused_setup, what):
        assert message in error


def test_the_clip_suggested_is_dgcs_local_clipping():
    memory = build_memory("adam", clip_norm=1.0)
    memory.set_world_size(4)
    grad = torch.full((4,), 10.0)  # norm 20, clipped to 1 / sqrt(4) = 0.5
    clipped = grad * (0.5 / 20.0)
    assert torch.equal(memory.compensate_dense("w", grad), build_memory("adam").compensate_dense("w", clipped))
    assert math.isclose(float(torch.linalg.vector_norm(clipped)), 0.5)


def test_the_moments_move_to_the_replaced_adamw_and_back():
    """One rank: the memory's dense rounds (steps 0-3), then the replaced AdamW stepping on the raw
    gradients with the moments handed to it (4-7), then the memory's rounds with the moments taken
    back (8-11) are torch's AdamW all along; the replacement's state holds the moments in between."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 2)).double()
    twin = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 2)).double()
    twin.load_state_dict(model.state_dict())
    reference = torch.optim.AdamW(twin.parameters(), lr=0.01, weight_decay=0.1, foreach=False)
    memory = build_memory("adam")
    (ours,) = memory.take_over([torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)], list(model.parameters()))
    assert memory.ddp_can_take_over
    params = dict(model.named_parameters())
    x, y = torch.randn(16, 5, dtype=torch.float64), torch.randn(16, 2, dtype=torch.float64)
    for step in range(12):
        if step == 4:
            memory.hand_to_optimizer(params, lambda tensors: None)  # one rank: the average is the tensor
            assert ours.steps_adam and memory.first_moments == {} and memory.steps == {}
            assert {int(state["step"]) for state in ours.state.values()} == {4}
        if step == 8:
            assert memory.take_from_optimizer(params) and not ours.steps_adam and not ours.state
            assert set(memory.steps.values()) == {8} and not memory.take_from_optimizer(params)
        backward_both(model, twin, x, y)
        if not ours.steps_adam:
            send_updates_dense(memory, model)
        ours.step()
        reference.step()
    for a, b in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_a_loaded_replacement_steps_adam_where_its_state_holds_moments():
    """A checkpoint written while DDP's reducer ran the rounds: the loaded replacement holds the moments
    (so it steps Adam, until the memory takes them back) and shares its new state and groups with the
    optimizer it replaced."""
    param = nn.Parameter(torch.ones(3))
    saved = build_memory("adam")
    (first,) = saved.take_over([torch.optim.AdamW([param], lr=0.1)], [param])
    saved.settle_dense("w", torch.ones(3))
    saved.hand_to_optimizer({"w": param}, lambda tensors: None)
    memory = build_memory("adam")
    (second,) = memory.take_over([torch.optim.AdamW([param], lr=0.1)], [param])
    second.load_state_dict(first.state_dict())
    assert second.steps_adam and second.replaced.state is second.state and second.replaced.param_groups is second.param_groups
    assert memory.take_from_optimizer({"w": param}) and memory.steps == {"w": 1}
    assert torch.equal(memory.first_moments["w"], torch.full((3,), 0.1))
