"""Error feedback: exact mass conservation with every sparsifier, no NaN/Inf in the state, DGC momentum."""

from __future__ import annotations

import io

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ssfusion_lightning as ssf
from ssfusion_lightning.sparsifiers import MEMORIES, build_memory, build_sparsifier
from ssfusion_lightning.sparsifiers.memory import put_back, set_aside

ALL = ssf.available_sparsifiers()


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def integer_grads(shape, steps: int, seed: int, dtype=torch.float64):
    """Integer-valued gradients: every sum below is exact in float64 (and in fp32 at these sizes)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(-1000, 1001, shape, generator=g).to(dtype) for _ in range(steps)]


def scatter(values: torch.Tensor, indices: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    dense = torch.zeros(like.numel(), dtype=like.dtype)
    dense[indices] = values
    return dense.view(like.shape)


# --------------------------------------------------------------------------- residual: conservation
@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_residual_conserves_gradient_mass_exactly(name, dtype):
    """sum over steps of what was sent + the final residual == sum of the gradients, bit for bit,
    and sent + residual == compensated at every single step."""
    memory = build_memory("residual")
    sparsifier = build_sparsifier(name, density=0.05)
    shapes = {"conv.weight": (8, 3, 3, 3), "fc.weight": (40, 50), "fc.bias": (40,), "scale": ()}
    grads = {key: integer_grads(shape, 25, seed) for seed, (key, shape) in enumerate(shapes.items())}
    sent_total = {key: torch.zeros(shape, dtype=dtype) for key, shape in shapes.items()}
    for step in range(25):
        for key in shapes:
            grad = grads[key][step].to(dtype)
            compensated = memory.compensate(key, grad)
            assert compensated.data_ptr() != grad.data_ptr()
            values, indices = sparsifier.select(compensated, key=key)
            sent = scatter(values, indices, compensated)
            memory.update(key, grad, indices)
            residual = memory.residual(key)
            assert torch.equal(sent + residual, compensated)
            assert not residual.reshape(-1)[indices].any()  # sent positions are cleared
            sent_total[key] += sent
        sparsifier.advance()
    for key in shapes:
        total = torch.stack([g.to(dtype) for g in grads[key]]).sum(0)
        assert torch.equal(sent_total[key] + memory.residual(key), total), key


@settings(max_examples=25, deadline=None)
@given(
    name=st.sampled_from(ALL),
    shape=st.sampled_from([(), (1,), (5,), (3, 7), (2, 3, 4), (100,)]),
    density=st.floats(0.01, 1.0),
    steps=st.integers(1, 12),
    seed=st.integers(0, 10_000),
)
def test_residual_conservation_property(name, shape, density, steps, seed):
    memory = build_memory("residual")
    sparsifier = build_sparsifier(name, density=density)
    grads = integer_grads(shape, steps, seed)
    sent_total = torch.zeros(shape, dtype=torch.float64)
    for grad in grads:
        compensated = memory.compensate("w", grad)
        values, indices = sparsifier.select(compensated, key="w")
        sent_total += scatter(values, indices, compensated)
        memory.update("w", grad, indices)
        sparsifier.advance()
    assert torch.equal(sent_total + memory.residual("w"), torch.stack(grads).sum(0))


def test_none_memory_forgets_and_never_aliases():
    memory = build_memory("none")
    grad = torch.ones(4)
    compensated = memory.compensate("w", grad)
    assert torch.equal(compensated, grad) and compensated.data_ptr() != grad.data_ptr()
    memory.update("w", grad, torch.tensor([0]))
    assert torch.equal(memory.compensate("w", grad), grad) and memory.residual("w") is None
    assert memory.state_dict() == {}


def test_memory_registry():
    assert {"none", "residual", "dgc", "adam"} <= set(MEMORIES.names())
    strategy = ssf.SSFusionStrategy(memory="dgc", sparsifier="topk", fusion="ahead", comm="allgather", offload="none")
    assert strategy.memory_name == "dgc"


# --------------------------------------------------------------------------- no NaN/Inf in the state
@pytest.mark.parametrize("memory_name", ["residual", "dgc", "adam"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_non_finite_never_enters_the_state(memory_name, bad, dtype):
    memory = build_memory(memory_name)
    grad = torch.arange(1.0, 9.0).to(dtype)
    memory.compensate("layer.w", grad)
    memory.update("layer.w", grad, torch.tensor([7]))
    before = memory.state_dict()
    poisoned = grad.clone()
    poisoned[3] = bad
    memory.compensate("layer.w", poisoned)
    with pytest.raises(FloatingPointError, match="layer.w"):
        memory.update("layer.w", poisoned, torch.tensor([0]))
    after = memory.state_dict()
    for part in before:
        for key in before[part]:
            assert torch.equal(before[part][key], after[part][key])
    for part in after.values():
        for value in part.values():
            assert torch.isfinite(value).all()
    # the memory keeps working with finite gradients afterwards
    memory.compensate("layer.w", grad)
    memory.update("layer.w", grad, torch.tensor([1]))
    assert torch.isfinite(memory.residual("layer.w")).all()


def test_huge_finite_values_are_not_mistaken_for_overflow():
    memory = build_memory("residual")
    big = torch.full((1000,), 6e4, dtype=torch.float16)  # the fp16 sum overflows, the values do not
    memory.update("w", big, torch.tensor([0]))
    assert torch.equal(memory.residual("w")[1:], big[1:])
    big32 = torch.full((4,), 3e38)
    memory.update("v", big32, torch.tensor([0]))
    assert torch.equal(memory.residual("v")[1:], big32[1:])


@pytest.mark.parametrize("memory_name", ["residual", "dgc"])
def test_a_verified_commit_skips_the_checks_and_keeps_the_same_state(memory_name, monkeypatch):
    """``verified`` (the engine's vote found the compensated tensor finite): the same state, bit for
    bit, with no finiteness pass of the commit's own."""
    import ssfusion_lightning.sparsifiers.memory as memory_module

    checked, verified = build_memory(memory_name), build_memory(memory_name)
    passes = []
    monkeypatch.setattr(memory_module, "is_all_finite", lambda t: passes.append(t.numel()) or True)
    torch.manual_seed(0)
    for step in range(4):
        grad = torch.randn(3, 5)
        sent = torch.randperm(15)[:4]
        for memory, flag in ((checked, False), (verified, True)):
            assert torch.isfinite(memory.compensate("w", grad)).all()
            before = len(passes)
            memory.update("w", grad, sent, verified=flag)
            assert (len(passes) == before) == flag, (step, flag, passes)
    for part, values in checked.state_dict().items():
        assert all(torch.equal(v, verified.state_dict()[part][k]) for k, v in values.items())


def test_a_verified_commit_still_checks_the_unscaling():
    """With a loss scale the commit divides by it, which can overflow what was finite when selected."""
    memory = build_memory("residual")
    grad = torch.full((4,), 6e4, dtype=torch.float16)
    scale = torch.tensor(0.5)  # a scale below 1: unscaling doubles 6e4 past fp16's 65504
    assert torch.isfinite(memory.compensate("w", grad, loss_scale=scale)).all()
    with pytest.raises(FloatingPointError, match="'w'"):
        memory.update("w", grad, torch.tensor([0]), loss_scale=scale, verified=True)
    assert memory.residual("w") is None


@pytest.mark.parametrize("memory_name", ["residual", "dgc", "adam"])
def test_non_finite_state_is_refused_on_load(memory_name):
    memory = build_memory(memory_name)
    memory.update("w", torch.ones(3), torch.tensor([0]))
    state = memory.state_dict()
    part = next(iter(state))
    state[part]["w"][1] = float("nan")
    fresh = build_memory(memory_name)
    with pytest.raises(FloatingPointError, match="'w'"):
        fresh.load_state_dict(state)
    assert fresh.residual("w") is None


@pytest.mark.parametrize("memory_name", ["residual", "dgc", "adam"])
def test_memory_state_round_trip(memory_name):
    memory = build_memory(memory_name)
    grads = integer_grads((6, 5), 4, 0, torch.float32)
    sparsifier = build_sparsifier("topk", density=0.2)
    for grad in grads[:3]:
        c = memory.compensate("w", grad)
        memory.update("w", grad, sparsifier.select(c, key="w")[1])
    buffer = io.BytesIO()
    torch.save(memory.state_dict(), buffer)
    buffer.seek(0)
    restored = build_memory(memory_name)
    restored.load_state_dict(torch.load(buffer, weights_only=True))
    a, b = memory.compensate("w", grads[3]), restored.compensate("w", grads[3])
    assert torch.equal(a, b)
    memory.reset()
    assert memory.residual("w") is None


# --------------------------------------------------------------------------- DGC momentum correction
def test_dgc_memory_momentum_semantics():
    """u = m*u + g; v = v + u; select from v; u and v are zeroed at the sent positions."""
    m = 0.5  # exact in binary: the reference below is bit-exact
    memory = build_memory("dgc", momentum=m)
    grads = integer_grads((10,), 6, 1)
    u = torch.zeros(10, dtype=torch.float64)
    v = torch.zeros(10, dtype=torch.float64)
    sends = [
        torch.tensor([0, 3]),
        torch.tensor([], dtype=torch.int64),
        torch.tensor([3, 9]),
        torch.arange(10),
        torch.tensor([5]),
        torch.tensor([2]),
    ]
    for grad, sent in zip(grads, sends):
        u = m * u + grad
        v = v + u
        compensated = memory.compensate("w", grad)
        assert torch.equal(compensated, v)
        memory.update("w", grad, sent)
        u[sent] = 0
        v[sent] = 0
        assert torch.equal(memory.momenta["w"], u)
        assert torch.equal(memory.velocities["w"], v)
        assert torch.equal(memory.residual("w"), v)


def test_dgc_memory_sent_plus_velocity_is_compensated():
    memory = build_memory("dgc")
    sparsifier = build_sparsifier("dgc", density=0.05)
    for grad in integer_grads((64, 64), 10, 2, torch.float32):
        c = memory.compensate("w", grad)
        values, indices = sparsifier.select(c, key="w")
        memory.update("w", grad, indices)
        assert torch.equal(scatter(values, indices, c) + memory.residual("w"), c)
        sparsifier.advance()


def test_dgc_memory_without_momentum_is_residual_feedback():
    dgc, residual = build_memory("dgc", momentum=0.0), build_memory("residual")
    sparsifier = build_sparsifier("topk", density=0.1)
    for grad in integer_grads((50,), 8, 3):
        a, b = dgc.compensate("w", grad), residual.compensate("w", grad)
        assert torch.equal(a, b)
        sent = sparsifier.select(a, key="w")[1]
        dgc.update("w", grad, sent)
        residual.update("w", grad, sent)


def test_dgc_memory_local_clipping():
    memory = build_memory("dgc", momentum=0.0, clip_norm=5.0)
    grad = torch.tensor([3.0, 4.0, 0.0, 0.0]) * 2  # norm 10 -> scaled to norm 5
    c = memory.compensate("w", grad)
    assert torch.allclose(c, torch.tensor([3.0, 4.0, 0.0, 0.0]))
    memory.update("w", grad, torch.tensor([0, 1]))
    small = torch.tensor([0.0, 0.0, 1.0, 0.0])  # below the cap: untouched
    assert torch.equal(memory.compensate("w", small), small)


def test_dgc_memory_rejects_bad_options():
    with pytest.raises(ValueError):
        build_memory("dgc", momentum=1.0)
    with pytest.raises(ValueError):
        build_memory("dgc", clip_norm=-1.0)


@pytest.mark.parametrize("memory_name", ["residual", "dgc", "adam"])
def test_a_commit_does_not_depend_on_the_selection_temporary(memory_name):
    """``update`` recomputes the compensation from the gradient: with or without the ``compensate``
    before it (whose result the caller may have freed), the state is the same, bit for bit."""
    options = {"clip_norm": 50.0} if memory_name == "dgc" else {}
    paired, unpaired = build_memory(memory_name, **options), build_memory(memory_name, **options)
    for grad in integer_grads((7, 9), 5, 4, torch.float32):
        sent = paired.compensate("w", grad).reshape(-1).abs().topk(6).indices
        paired.update("w", grad, sent)
        unpaired.update("w", grad, sent)
        for part, tensors in paired.state_dict().items():
            assert all(torch.equal(tensors[k], unpaired.state_dict()[part][k]) for k in tensors)


def test_dgc_memory_dense_and_sparse_rounds_by_hand():
    """A dense slot sends v + u with u = m*u + g and keeps u unmasked (every position was sent):
    momentum applied once, never twice, never lost; a later sparse round starts from that u."""
    m = 0.5
    memory = build_memory("dgc", momentum=m)
    grads = integer_grads((6,), 6, 4)
    u = torch.zeros(6, dtype=torch.float64)
    v = torch.zeros(6, dtype=torch.float64)
    # sparse, sparse, dense, dense, sparse, dense: a re-plan or a warm-up switches the slot's kind
    rounds = [torch.tensor([1]), torch.tensor([2, 4]), None, None, torch.tensor([0]), None]
    for grad, sent in zip(grads, rounds):
        u = m * u + grad
        v = v + u
        if sent is None:
            assert torch.equal(memory.compensate_dense("w", grad), v)  # what is owed goes out with it
            memory.settle_dense("w", grad)
            v = torch.zeros(6, dtype=torch.float64)
            assert torch.equal(memory.momenta["w"], u) and memory.residual("w") is None
        else:
            assert torch.equal(memory.compensate("w", grad), v)
            memory.update("w", grad, sent)
            u[sent] = 0
            v[sent] = 0
            assert torch.equal(memory.momenta["w"], u) and torch.equal(memory.residual("w"), v)


def test_dgc_memory_on_a_dense_slot_is_sgd_momentum():
    """Sent every round, the dgc memory's output is torch's SGD momentum buffer, bit for bit."""
    m = 0.9
    memory = build_memory("dgc", momentum=m)
    param = torch.zeros(5, requires_grad=True)
    sgd = torch.optim.SGD([param], lr=1.0, momentum=m)
    for grad in integer_grads((5,), 5, 5, torch.float32):
        sent = memory.compensate_dense("w", grad)
        memory.settle_dense("w", grad)
        param.grad = grad.clone()
        sgd.step()
        assert torch.equal(sent, sgd.state[param]["momentum_buffer"])


@pytest.mark.parametrize("memory_name, options", [("none", {}), ("residual", {}), ("dgc", {}), ("dgc", {"clip_norm": 1.0})])
@pytest.mark.parametrize("scaled", [False, True])
@pytest.mark.parametrize("channels_last", [False, True])
def test_compensating_into_a_buffer_gives_compensate_bits(memory_name, options, scaled, channels_last):
    """``compensate_into`` (behind's fused buffer) writes what ``compensate`` returns, bit for bit
    (the sign of a zero too), in logical order, on the first round and after commits, with a loss
    scale, with local clipping and for a gradient in another memory format."""
    memory = build_memory(memory_name, **options)
    scale = torch.tensor(1024.0) if scaled else None
    g = torch.Generator().manual_seed(3)
    for _ in range(4):
        grad = torch.randn(3, 4, 5, 6, generator=g)
        if channels_last:
            grad = grad.to(memory_format=torch.channels_last)
        expected = memory.compensate("w", grad, loss_scale=scale)
        fused = torch.full((grad.numel() + 8,), float("nan"))
        out = fused[4 : 4 + grad.numel()]
        assert memory.compensate_into("w", grad, out, loss_scale=scale) is out
        assert torch.equal(out.reshape(-1).view(torch.int32), expected.reshape(-1).contiguous().view(torch.int32))
        assert fused[:4].isnan().all() and fused[-4:].isnan().all()  # nothing written beside the slice
        memory.update("w", grad, expected.reshape(-1).abs().topk(10).indices, loss_scale=scale)


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    dtype=st.sampled_from([torch.float32, torch.float64, torch.float16]),
    sparse_first=st.lists(st.booleans(), min_size=2, max_size=6),
    rounds=st.lists(st.sampled_from(["dense", "dense", "some_sparse", "subset", "reload", "reshape"]), min_size=3, max_size=8),
)
def test_dgc_dense_slots_many_at_once_give_the_bits_of_one_at_a_time(seed, dtype, sparse_first, rounds):
    """A buffer's dense slots compensated and settled together (foreach calls, or one flat tensor
    once their momenta exist) give exactly what ``compensate_dense`` and ``settle_dense`` give one
    at a time: over rounds where some tensors are new, some still owe a velocity from a round they
    were sent sparse, a plan takes a subset of them, the state is saved and loaded, or a tensor
    changes shape."""
    generator = torch.Generator().manual_seed(seed)
    shapes = [(3, 2), (5,), (2, 2, 2), (7,), (1,), (4, 3)][: len(sparse_first)]
    keys = [f"p{i}" for i in range(len(shapes))]
    together, alone = build_memory("dgc", momentum=0.9), build_memory("dgc", momentum=0.9)
    flat_rounds = 0

    def sparse_round(which: list[bool]) -> None:
        for key, shape, sparse in zip(keys, shapes, which):
            if sparse:
                grad = torch.randn(shape, generator=generator).to(dtype)
                for memory in (together, alone):
                    memory.compensate(key, grad)
                    memory.update(key, grad, torch.tensor([0]))

    sparse_round(sparse_first)  # some owe a velocity when they go dense
    for kind in ["dense", *rounds]:
        if kind == "some_sparse":
            sparse_round([not s for s in sparse_first])
        elif kind == "reload":
            together.load_state_dict(together.state_dict())
        elif kind == "reshape":  # a re-planned tensor of another size starts afresh, and again when it changes back
            shapes[0] = (4, 2) if shapes[0] == (3, 2) else (3, 2)
        names = keys[: max(2, len(keys) - 1)] if kind == "subset" else keys
        grads = [torch.randn(shape, generator=generator).to(dtype) for shape in shapes[: len(names)]]
        flat = together.compensate_dense_flat(names, grads)
        many = together.compensate_dense_many(names, grads)
        one = [alone.compensate_dense(key, grad) for key, grad in zip(names, grads)]
        for a, b in zip(many, one):
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
        if flat is not None:
            flat_rounds += 1
            assert torch.equal(flat, torch.cat([b.reshape(-1) for b in one]))
        together.settle_dense_many(names, grads)
        for key, grad in zip(names, grads):
            alone.settle_dense(key, grad)
        for key in names:
            assert torch.equal(together.momenta[key], alone.momenta[key])
            assert key not in together.velocities and key not in alone.velocities
    if dtype != torch.float16 and rounds.count("dense") >= 2:
        assert flat_rounds > 0  # the flat form was exercised, not only the foreach one


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    kind=st.sampled_from(["residual", "dgc"]),
    dtype=st.sampled_from([torch.float32, torch.float64, torch.float16]),
    channels_last=st.booleans(),
    count=st.integers(2, 6),
    feedback=st.sampled_from([1.0, 0.9, 0.5]),
)
def test_sparse_slots_many_at_once_give_the_bits_of_one_at_a_time(seed, kind, dtype, channels_last, count, feedback):
    """A buffer's batched sparse slots compensated and committed together (foreach calls) give
    exactly what ``compensate`` and ``update`` give one at a time: the tensors selected from, the
    stored state, and the masking at the sent positions, over rounds where keys are new, where one
    changes shape, and where some were sent dense in between (DGC: no velocity owed)."""
    generator = torch.Generator().manual_seed(seed)
    shapes = [(2, 3, 2, 2), (5,), (3, 2), (7,), (1,), (4, 3)][:count]
    keys = [f"p{i}" for i in range(count)]
    options = {"momentum": 0.9, "feedback": feedback} if kind == "dgc" else {"feedback": feedback}
    together, alone = build_memory(kind, **options), build_memory(kind, **options)
    for step in range(7):
        if step in (2, 5):  # a re-planned tensor of another size starts afresh, and again when it changes back
            shapes[-1] = (shapes[-1][0] + 1,) if step == 2 else (shapes[-1][0] - 1,)
        grads = [torch.randn(shape, generator=generator).to(dtype) for shape in shapes]
        if channels_last:
            grads[0] = grads[0].to(memory_format=torch.channels_last)
        keys_now = keys[: count - 1] if step == 1 else keys  # the last one joins late
        grads_now = grads[: len(keys_now)]
        many = together.compensate_many(keys_now, grads_now)
        one = [alone.compensate(key, grad) for key, grad in zip(keys_now, grads_now)]
        for a, b in zip(many, one):
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
        sent = [torch.randperm(g.numel(), generator=generator)[: max(1, g.numel() // 3)] for g in grads_now]
        together.update_many(keys_now, grads_now, sent, verified=True)
        for key, grad, positions in zip(keys_now, grads_now, sent):
            alone.update(key, grad, positions, verified=True)
        for key in keys_now:
            assert torch.equal(together.residual(key), alone.residual(key))
            if kind == "dgc":
                assert torch.equal(together.momenta[key], alone.momenta[key])
        if kind == "dgc" and step == 0:  # the first key is sent dense once: its velocity is flushed
            together.settle_dense_many(keys[:2], grads[:2])
            for key, grad in zip(keys[:2], grads[:2]):
                alone.settle_dense(key, grad)
    if kind == "dgc" and dtype != torch.float16:  # the flat commit was exercised, not only the foreach one
        assert any(tag == "sparse" for tag, _ in together._flat._groups)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), dropped=st.integers(1, 5), feedback=st.sampled_from([1.0, 0.9]))
def test_dgc_flat_commit_adopts_compensates_round_with_the_bits_of_computing_it_again(seed, dropped, feedback):
    """Once the sparse slots' states are flat, the commit keeps the u' and v' compensate computed
    (no second pass over them); a commit of gradients that are not the ones compensated computes the
    round again in place. Both give the same bits every round, a dropped round (compensated, never
    committed) included, and compensate leaves the stored state as it was."""
    generator = torch.Generator().manual_seed(seed)
    shapes = [(4, 3, 2), (9,), (5, 2)]
    keys = [f"p{i}" for i in range(len(shapes))]
    kept, again = build_memory("dgc", momentum=0.9, feedback=feedback), build_memory("dgc", momentum=0.9, feedback=feedback)
    adopted = 0
    for step in range(7):
        grads = [torch.randn(shape, generator=generator) for shape in shapes]
        before = {key: (kept.momenta[key].clone(), kept.velocities[key].clone()) for key in kept.velocities}
        many = kept.compensate_many(keys, grads)
        for key, (momentum, velocity) in before.items():
            assert torch.equal(kept.momenta[key], momentum) and torch.equal(kept.velocities[key], velocity)
        for a, b in zip(many, again.compensate_many(keys, grads)):
            assert torch.equal(a, b)
        if step == dropped:
            continue
        sent = [torch.randperm(g.numel(), generator=generator)[:3] for g in grads]
        storage = kept.velocities[keys[0]].data_ptr() if kept.velocities else None
        kept.update_many(keys, grads, sent, verified=True)
        again.update_many(keys, [grad.clone() for grad in grads], sent, verified=True)  # not the gradients compensated
        adopted += storage is not None and kept.velocities[keys[0]].data_ptr() != storage
        for key in keys:
            assert torch.equal(kept.momenta[key], again.momenta[key]) and torch.equal(kept.velocities[key], again.velocities[key])
    assert adopted >= 3


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), dropped=st.integers(1, 5), feedback=st.sampled_from([1.0, 0.9]))
def test_dgc_commit_of_a_whole_buffer_keeps_each_compensated_batchs_group_and_round(seed, dropped, feedback):
    """The engine compensates a buffer's slots in batches (the small tensors, the larger ones, one
    in its hook) and commits the buffer at once. The commit keeps each batch's flat group and adopts
    its round, where a group of the whole buffer used to replace the batches' groups, and be
    replaced by them, every round. The bits are those of one key at a time, a dropped round included."""
    generator = torch.Generator().manual_seed(seed)
    shapes = [(4, 3, 2), (9,), (5, 2), (7,), (3, 3), (6,)]
    keys = [f"p{i}" for i in range(len(shapes))]
    batches, single = [[0, 1, 2], [3, 4]], 5
    batched, alone = build_memory("dgc", momentum=0.9, feedback=feedback), build_memory("dgc", momentum=0.9, feedback=feedback)
    groups, adopted = None, 0
    for step in range(7):
        grads = [torch.randn(shape, generator=generator) for shape in shapes]
        for batch in batches:
            batched.compensate_many([keys[i] for i in batch], [grads[i] for i in batch])
        batched.compensate(keys[single], grads[single])
        for key, grad in zip(keys, grads):
            alone.compensate(key, grad)
        if step == dropped:
            continue
        sent = [torch.randperm(g.numel(), generator=generator)[:3] for g in grads]
        order = torch.randperm(len(keys), generator=generator).tolist()  # the buffer's slot order, not the batches'
        storages = [batched.velocities[keys[batch[0]]].data_ptr() for batch in batches] if batched.velocities else None
        batched.update_many([keys[i] for i in order], [grads[i] for i in order], [sent[i] for i in order], verified=True)
        for key, grad, positions in zip(keys, grads, sent):
            alone.update(key, grad, positions, verified=True)
        for key in keys:
            assert torch.equal(batched.momenta[key], alone.momenta[key]) and torch.equal(batched.velocities[key], alone.velocities[key])
        if step == 0:  # the first round makes the states; the next compensations group them
            continue
        now = {names: group for (tag, names), group in batched._flat._groups.items() if tag == "sparse"}
        assert set(now) == {tuple(keys[i] for i in batch) for batch in batches}
        if groups is not None:
            assert all(now[names] is groups[names] for names in now)  # kept, not rebuilt
        groups = now
        if storages is not None:
            adopted += sum(batched.velocities[keys[batch[0]]].data_ptr() != ptr for batch, ptr in zip(batches, storages))
    assert adopted >= 2 * 3


def test_sparse_slots_committed_together_unverified_still_refuse_a_non_finite_gradient_by_name():
    """Without the engine's vote the many-tensor commit checks each gradient, as one at a time does."""
    for kind in ("residual", "dgc"):
        memory = build_memory(kind)
        keys, grads = ["a", "b"], [torch.ones(3), torch.ones(3)]
        memory.update_many(keys, grads, [torch.tensor([0]), torch.tensor([1])])
        before = memory.residual("b").clone()
        with pytest.raises(FloatingPointError, match="'b'"):
            memory.update_many(keys, [torch.ones(3), torch.tensor([1.0, float("nan"), 0.0])], [torch.tensor([0])] * 2)
        assert torch.equal(memory.residual("b"), before)  # the NaN never entered its state


@pytest.mark.parametrize("kind, state", [("dgc", "momenta"), ("adam", "first_moments")])
def test_dense_slots_settled_together_refuse_a_non_finite_gradient_by_name(kind, state):
    memory = build_memory(kind)
    keys, grads = ["a", "b"], [torch.ones(3), torch.tensor([1.0, float("nan")])]
    memory.compensate_dense_many(keys, grads)
    with pytest.raises(FloatingPointError, match="'b'"):
        memory.settle_dense_many(keys, grads)
    assert "b" not in getattr(memory, state)  # the NaN never entered its state


@settings(max_examples=20, deadline=None)
@given(
    name=st.sampled_from(["residual", "dgc", "adam"]),
    feedback=st.floats(0.05, 1.0),
    density=st.floats(0.05, 0.9),
    seed=st.integers(0, 10_000),
)
def test_feedback_keeps_that_fraction_of_what_was_not_sent(name, feedback, density, seed):
    """Every memory's state after a commit is exactly feedback x (the compensated tensor with the
    sent positions zeroed), round after round."""
    generator = torch.Generator().manual_seed(seed)
    memory, sparsifier = build_memory(name, feedback=feedback), build_sparsifier("topk", density=density)
    for _ in range(5):
        grad = torch.randn(4, 6, generator=generator)
        compensated = memory.compensate("w", grad).reshape(-1)
        _, indices = sparsifier.select(compensated, key="w")
        unsent = compensated.clone()
        unsent[indices] = 0
        memory.update("w", grad, indices)
        assert torch.equal(memory.residual("w").reshape(-1), unsent * feedback)


@pytest.mark.parametrize("name", ["residual", "dgc"])
def test_feedback_bounds_a_never_sent_entry(name):
    """A constant gradient never selected: error feedback owes one more round each step, feedback f
    at most f / (1 - f) rounds (DGC: of the stepped momentum)."""
    grad = torch.tensor([1.0, 1.0], dtype=torch.float64)
    options = {"momentum": 0.0} if name == "dgc" else {}
    leaky, exact = build_memory(name, feedback=0.9, **options), build_memory(name, **options)
    for _ in range(200):
        for memory in (leaky, exact):
            memory.compensate("w", grad)
            memory.update("w", grad, torch.tensor([0]))
    assert leaky.residual("w")[1] == pytest.approx(9.0, rel=1e-9)
    assert exact.residual("w")[1] == 200.0


def test_an_unknown_memory_option_names_the_memorys_options():
    with pytest.raises(TypeError, match=r"memory 'residual' has no option 'momentum'; its options: feedback"):
        build_memory("residual", momentum=0.9)
    with pytest.raises(TypeError, match=r"memory 'adam' has no option 'momentum'; its options: clip_norm, feedback"):
        build_memory("adam", momentum=0.9)


# --------------------------------------------------------------------------- owed state set aside
def sent_of(memory, key: str, grad: torch.Tensor, sent: torch.Tensor | None) -> torch.Tensor:
    """One round of ``key`` (``sent``: the sparse positions; None: a dense slot); returns what left the rank."""
    if sent is None:
        compensated = memory.compensate_dense(key, grad)
        memory.settle_dense(key, grad)
        return grad.clone() if compensated is None else compensated
    compensated = memory.compensate(key, grad)
    memory.update(key, grad, sent)
    return scatter(compensated.reshape(-1)[sent], sent, compensated)


@settings(max_examples=30, deadline=None)
@given(
    kind=st.sampled_from(["residual", "dgc"]),
    before=st.integers(1, 4),
    held=st.integers(1, 4),
    after=st.integers(0, 4),
    seed=st.integers(0, 10_000),
)
def test_owed_state_set_aside_is_neither_sent_nor_lost(kind, before, held, after, seed):
    """Through a window with the owed state set aside, dense slots send their fresh gradient (dgc:
    the stepped momentum u, no velocity); put back, it is owed exactly as before the window, and
    over the whole run what was sent plus what is owed is every round's gradient (dgc: every
    round's u), bit for bit on integer gradients."""
    m = 0.5
    memory = build_memory(kind, **({"momentum": m} if kind == "dgc" else {}))
    grads = integer_grads((12,), before + held + after, seed)
    # what is owed, sent or not, is every round's u (residual memory: u is the gradient)
    generator = torch.Generator().manual_seed(seed)
    u = torch.zeros(12, dtype=torch.float64)
    sent_total, owed_total = torch.zeros(12, dtype=torch.float64), torch.zeros(12, dtype=torch.float64)
    for step, grad in enumerate(grads):
        if step == before:
            owed_before = memory.residual("w").clone()
            aside = set_aside(memory)
            assert memory.residual("w") is None
        if step == before + held:
            put_back(memory, aside)
            assert torch.equal(memory.residual("w"), owed_before)
        u = m * u + grad if kind == "dgc" else grad
        owed_total += u
        dense = before <= step < before + held
        sent = None if dense else torch.randperm(12, generator=generator)[:3]
        out = sent_of(memory, "w", grad, sent)
        if dense:
            assert torch.equal(out, u)
        elif kind == "dgc":
            u[sent] = 0  # momentum factor masking
        sent_total += out
    if after == 0:
        put_back(memory, aside)
    assert torch.equal(sent_total + memory.residual("w"), owed_total)


@pytest.mark.parametrize("kind", ["residual", "dgc"])
def test_many_tensor_forms_through_a_window_set_aside_give_the_bits_of_one_at_a_time(kind):
    """A buffer's slots compensated and committed together (foreach calls, dgc's flat groups) before,
    during and after a window with the owed state set aside: the same bits as one at a time."""
    generator = torch.Generator().manual_seed(7)
    shapes = [(3, 2), (5,), (2, 2, 2), (7,)]
    keys = [f"p{i}" for i in range(len(shapes))]
    together, alone = build_memory(kind), build_memory(kind)
    for window in ["sparse", "sparse", "set aside", "dense", "put back", "sparse"]:
        if window == "set aside":
            held = [set_aside(together), set_aside(alone)]
            window = "dense"
        if window == "put back":
            put_back(together, held[0])
            put_back(alone, held[1])
            window = "sparse"
        grads = [torch.randn(shape, generator=generator) for shape in shapes]
        if window == "dense":
            many = together.compensate_dense_many(keys, grads)
            one = [alone.compensate_dense(key, grad) for key, grad in zip(keys, grads)]
            assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip(many, one))
            together.settle_dense_many(keys, grads)
            for key, grad in zip(keys, grads):
                alone.settle_dense(key, grad)
            continue
        sent = [torch.randperm(grad.numel(), generator=generator)[:2] for grad in grads]
        many = together.compensate_many(keys, grads)
        one = [alone.compensate(key, grad) for key, grad in zip(keys, grads)]
        assert all(torch.equal(a, b) for a, b in zip(many, one))
        together.update_many(keys, grads, sent, verified=True)
        for key, grad, positions in zip(keys, grads, sent):
            alone.update(key, grad, positions, verified=True)
    for key in keys:
        assert torch.equal(together.residual(key), alone.residual(key))


@pytest.mark.parametrize("kind", ["residual", "dgc"])
def test_put_back_adds_to_what_was_owed_since(kind):
    """A key that came to owe again while its state was set aside (a sparse round in between) owes
    both once it is put back: sent + owed is still every round's u, exactly."""
    memory = build_memory(kind, **({"momentum": 0.5} if kind == "dgc" else {}))
    grads = integer_grads((10,), 4, 3)
    sent_total = torch.zeros(10, dtype=torch.float64)
    owed_total = torch.zeros(10, dtype=torch.float64)
    u = torch.zeros(10, dtype=torch.float64)
    for step, grad in enumerate(grads):
        if step == 2:
            held = set_aside(memory)
        u = 0.5 * u + grad if kind == "dgc" else grad
        owed_total += u
        sent = torch.tensor([step, step + 5])
        sent_total += sent_of(memory, "w", grad, sent)
        if kind == "dgc":
            u[sent] = 0
    owed_since = memory.residual("w").clone()
    put_back(memory, held)
    assert torch.equal(memory.residual("w"), owed_since + held[0]["w"])
    assert torch.equal(sent_total + memory.residual("w"), owed_total)
