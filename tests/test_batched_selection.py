"""``select_many`` equals the loop of ``select`` for every sparsifier (property-tested)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ssfusion_lightning as ssf
from ssfusion_lightning.sparsifiers import batched, build_sparsifier, selection

ALL = ssf.available_sparsifiers()
BATCHED = ["topk", "dgc", "gaussiank", "sidco"]
# every registered sparsifier, plus options that take other batched paths: dgc samples of many
# widths (several width classes of drawn rows), another sidco fit
VARIANTS = [(name, {}) for name in ALL] + [
    ("dgc", {"min_sample": 64, "sample_ratio": 0.05, "exact_below": 0}),
    ("dgc", {"exact_below": 0}),
    ("sidco", {"distribution": "gpareto"}),
]
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Small tensors: intra-op threads only add scheduling noise on a shared 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(params=["numpy", "torch"])
def path(request, monkeypatch):
    """The CPU fast path (numpy) and the path other devices take (torch ops), both on CPU."""
    monkeypatch.setattr(selection, "NUMPY_ON_CPU", request.param == "numpy")
    return request.param


PROPERTY = settings(
    max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)

# sizes around the points where the batched code switches paths
EDGES = [
    1,
    2,
    batched.TOPK_SAMPLE - 1,
    batched.TOPK_SAMPLE,
    batched.TOPK_SAMPLE + 1,
    batched.PARTITION_MIN - 1,
    batched.PARTITION_MIN + 1,
    4095,  # dgc's min_sample: sampled whole up to 4096, drawn above
    4097,
    batched.LOOP_MIN - 1,
    batched.LOOP_MIN,
    batched.LOOP_MIN + 1,
]
shapes = st.one_of(
    st.sampled_from([(), (1,), (3,), (16,), (64, 3, 3, 3), (17, 129), (2, 3, 4, 5), (300,), (5000,)]),
    st.sampled_from(EDGES).map(lambda n: (n,)),
    st.lists(st.integers(1, 40), min_size=1, max_size=3).map(tuple),
)
layouts = st.sampled_from(["contiguous", "channels_last", "transposed"])


def make_tensor(shape: tuple[int, ...], dtype: torch.dtype, seed: int, kind: str, layout: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == "normal":
        x = torch.randn(shape, generator=g)
    elif kind == "ties":
        x = torch.randint(-3, 4, shape, generator=g).float()
    else:  # mostly zeros
        x = torch.randn(shape, generator=g) * (torch.rand(shape, generator=g) < 0.05)
    x = x.to(dtype)
    if layout == "channels_last" and x.dim() == 4:
        return x.contiguous(memory_format=torch.channels_last)
    if layout == "transposed" and x.dim() >= 2:
        return x.transpose(0, 1).contiguous().transpose(0, 1)  # same values, non-contiguous
    return x


@st.composite
def batches(draw):
    count = draw(st.integers(1, 6))
    tensors, keys, ks = [], [], []
    for j in range(count):
        shape = draw(shapes)
        dtype = draw(st.sampled_from(DTYPES)) if draw(st.integers(0, 4)) == 0 else None
        kind = draw(st.sampled_from(["normal", "normal", "ties", "sparse"]))
        tensors.append((shape, dtype, draw(st.integers(0, 2**31 - 1)), kind, draw(layouts)))
        keys.append(draw(st.sampled_from([f"t{j}", "shared", ""])))
        n = math.prod(shape)
        ks.append(draw(st.one_of(st.none(), st.integers(1, max(1, n + 2)))))
    return tensors, keys, ks, draw(st.sampled_from(DTYPES))


def materialize(specs, default):
    return [make_tensor(shape, dtype or default, seed, kind, layout) for shape, dtype, seed, kind, layout in specs]


def assert_same_selection(tensor: torch.Tensor, got, expected) -> None:
    """Same selection up to ties: the same count, the same multiset of magnitudes, and the same
    set of every index whose magnitude is above the smallest selected one (only elements tied
    with that one may be swapped)."""
    flat = tensor.reshape(-1)
    (v_got, i_got), (_, i_exp) = got, expected
    assert i_got.dtype == torch.int64 and v_got.dtype == flat.dtype
    assert i_got.numel() == i_exp.numel() == v_got.numel()
    assert torch.unique(i_got).numel() == i_got.numel()
    assert torch.equal(v_got, flat[i_got])
    if i_got.numel() == 0:
        return
    if torch.equal(torch.sort(i_got).values, torch.sort(i_exp).values):
        return
    m_got = torch.sort(flat[i_got].abs().double()).values
    m_exp = torch.sort(flat[i_exp].abs().double()).values
    assert torch.equal(m_got, m_exp), "different magnitudes selected"
    floor = m_got[0]
    above_got = set(i_got[flat[i_got].abs().double() > floor].tolist())
    above_exp = set(i_exp[flat[i_exp].abs().double() > floor].tolist())
    assert above_got == above_exp


def check_equal(name: str, options: dict, density: float, specs, keys, ks, default_dtype, steps: int = 2) -> None:
    batched_one = build_sparsifier(name, density=density, **options)
    looped_one = build_sparsifier(name, density=density, **options)
    tensors = materialize(specs, default_dtype)
    for _ in range(steps):
        got = batched_one.select_many(tensors, keys, ks)
        expected = [looped_one.select(t, key=key, k=k) for t, key, k in zip(tensors, keys, ks)]
        assert len(got) == len(tensors)
        for tensor, g, e in zip(tensors, got, expected):
            assert_same_selection(tensor, g, e)
        assert batched_one.state_dict() == looped_one.state_dict()
        batched_one.advance()
        looped_one.advance()


# the default loop (sparsifiers without a batched override) has no second path
CASES = [(n, o, p) for n, o in VARIANTS for p in (("numpy", "torch") if n in BATCHED else ("numpy",))]


@pytest.mark.parametrize("name, options, path", CASES, ids=[f"{p}-{n}{o or ''}" for n, o, p in CASES])
@PROPERTY
@given(batch=batches(), density=st.sampled_from([0.001, 0.01, 0.05, 0.3]))
def test_select_many_equals_the_loop(name, options, path, monkeypatch, batch, density):
    monkeypatch.setattr(selection, "NUMPY_ON_CPU", path == "numpy")
    specs, keys, ks, dtype = batch
    check_equal(name, options, density, specs, keys, ks, dtype)


@pytest.mark.parametrize("name", BATCHED)
@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**31 - 1), dtype=st.sampled_from(DTYPES))
def test_a_buffer_of_many_tensors(name, path, seed, dtype):
    """A buffer like a CNN's: a geometric spread of weights, plus biases."""
    rng = np.random.default_rng(seed)
    sizes = [int(300 * 1.6**i) for i in range(12)] + [int(s) for s in rng.integers(8, 300, 12)]
    specs = [((n,), None, int(rng.integers(2**31)), "normal", "contiguous") for n in sizes]
    keys = [f"p{i}" for i in range(len(specs))]
    check_equal(name, {}, 0.01, specs, keys, [None] * len(specs), dtype)


def test_failed_bound_falls_back_to_the_exact_top_k(path):
    """A sample that overestimates the k-th magnitude: exactly the sampled positions are large,
    so fewer than k elements reach the bound and the tensor takes the top-k of all its elements."""
    n, k = 10_000, 400
    expected_in_sample = k * batched.TOPK_SAMPLE / n
    rank = math.ceil(expected_in_sample + batched.TOPK_Z * math.sqrt(expected_in_sample) + 2)
    x = torch.rand(n)
    x[torch.from_numpy(batched.weyl_positions(n, batched.TOPK_SAMPLE)[:rank].copy())] = 10.0
    filler = torch.rand(300)
    sparsifier = build_sparsifier("topk", density=0.01)
    (values, indices), _ = sparsifier.select_many([x, filler], ["x", "f"], [k, None])
    assert indices.numel() == k
    assert torch.equal(torch.sort(values).values, torch.sort(torch.topk(x, k).values).values)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_ties_at_the_cut_go_to_the_lowest_positions(path, dtype):
    """k = 50 of 5,000: 30 magnitudes of 5, then 60 of 2 (either sign) for the last 20 places, the
    rest below 1. The sampled bound keeps more than k candidates, so the trim decides: all the 5s
    and the 20 lowest positions among the 2s, as ``torch.topk``-based ``select`` breaks ties."""
    generator = torch.Generator().manual_seed(3)
    x = torch.rand(5_000, generator=generator, dtype=dtype) * 0.9
    positions = torch.randperm(5_000, generator=generator)
    fives, twos = positions[:30], positions[30:90]
    x[fives] = 5.0
    x[twos] = torch.where(torch.arange(60) % 2 == 0, 2.0, -2.0).to(dtype)
    sparsifier = build_sparsifier("topk", density=0.01)
    (values, indices), (_, filler) = sparsifier.select_many([x, torch.rand(300, dtype=dtype)], ["x", "f"], [None, None])
    expected = torch.cat([fives, torch.sort(twos).values[:20]])
    assert torch.equal(torch.sort(indices).values, torch.sort(expected).values)
    assert torch.equal(values, x[indices]) and filler.numel() == 3
    looped, _ = sparsifier.select(x, key="x")
    assert torch.equal(torch.sort(looped).values, torch.sort(values).values)


def test_mixed_dtypes_and_trivial_tensors_keep_their_order(path):
    tensors = [torch.randn(500), torch.randn(()), torch.randn(300).half(), torch.zeros(0), torch.randn(40, 50).double()]
    keys = ["a", "b", "c", "d", "e"]
    ks = [5, None, 300, None, 17]
    got = build_sparsifier("topk", density=0.01).select_many(tensors, keys, ks)
    for tensor, (values, indices), k in zip(tensors, got, [5, 1, 300, 0, 17]):
        assert indices.numel() == k and values.dtype == tensor.dtype
        assert torch.equal(values, tensor.reshape(-1)[indices])


def test_select_many_checks_its_arguments():
    sparsifier = build_sparsifier("topk")
    with pytest.raises(ValueError):
        sparsifier.select_many([torch.randn(10)], ["a", "b"], [None])
    with pytest.raises(ValueError):
        build_sparsifier("randomk").select_many([torch.randn(10)], ["a"], [])
    assert sparsifier.select_many([], [], []) == []


def test_thresholds_are_compared_in_the_input_dtype():
    """A first threshold between two bf16 values selects what the bf16 compare selects."""
    x = torch.tensor([0.30078125, 0.298828125, -0.30078125, 0.1] * 100, dtype=torch.bfloat16)
    (rounded,) = selection.in_dtype([0.2999], torch.bfloat16)
    assert rounded == float(torch.tensor(0.2999).to(torch.bfloat16))
    assert int((x.abs() >= 0.2999).sum()) == int((x.float().abs() >= rounded).sum())


def test_dgc_searches_inside_the_batch_without_another_pass(monkeypatch):
    """dgc's batched pass is made at each tensor's search floor, as its ``select`` prepares it: on
    a CNN-like buffer the searches of the tensors whose first count leaves the band are counted
    inside that set, with no per-tensor pass over a tensor, while the loop of ``select`` makes one
    per tensor whose floor lies below its threshold. The selections stay the loop's."""

    passes = []
    original = selection.indices_at_least
    monkeypatch.setattr(selection, "indices_at_least", lambda flat, t: passes.append(flat.numel()) or original(flat, t))
    monkeypatch.setattr(selection, "NUMPY_ON_CPU", True)
    rng = np.random.default_rng(5)
    tensors = [torch.from_numpy(rng.standard_normal(int(5000 * 1.5**i)).astype(np.float32)) for i in range(10)]
    keys = [f"w{i}" for i in range(len(tensors))]
    searched = 0
    for step in range(3):
        looped, many = (build_sparsifier("dgc", density=0.01, exact_below=0) for _ in range(2))
        for sparsifier in (looped, many):
            sparsifier.step = step
        expected = [looped.select(t, key=key) for t, key in zip(tensors, keys)]
        searched += len(passes)
        passes.clear()
        got = many.select_many(tensors, keys, [None] * len(tensors))
        assert passes == []
        for tensor, g, e in zip(tensors, got, expected):
            assert_same_selection(tensor, g, e)
    assert searched > 0  # the loop did prepare floors: the batch saved those passes


@PROPERTY
@given(
    seed=st.integers(0, 2**31 - 1),
    rows=st.integers(1, 12),
    width=st.sampled_from([1024, 2048, 4096]),
    real=st.floats(0.2, 1.0),
    ranks=st.integers(1, 3),
    dtype=st.sampled_from([np.float32, np.float64]),
    special=st.sampled_from(["none", "nan", "inf", "ties", "zeros"]),
    deep=st.booleans(),
)
def test_ranked_rows_reads_every_row_at_its_ranks(seed, rows, width, real, ranks, dtype, special, deep):
    """The group-maxima bound never changes a rank: every row read at its ranks equals the row
    sorted, with -inf pads past each row's length, ties, zeros, +inf and NaN (NaN ranks first).
    The deepest rank is often a group maximum itself, so the bound must keep entries equal to it."""
    rng = np.random.default_rng(seed)
    matrix = np.abs(rng.standard_normal((rows, width))).astype(dtype)
    if special == "ties":
        matrix = np.round(matrix * 4) / 4
    elif special == "zeros":
        matrix[:, rng.random(width) < 0.9] = 0
    elif special in ("nan", "inf"):
        matrix[rng.integers(rows), rng.integers(width)] = np.nan if special == "nan" else np.inf
    # rows at least W / 8 long have an entry in every group (a group is 8 entries W / 8 apart)
    lengths = np.maximum(1 if deep else width // 8, (rng.random(rows) * real * width).astype(int))
    lengths[0] = width  # one full row
    for r, n in enumerate(lengths):
        matrix[r, n:] = -np.inf
    # shallow ranks take the group-maxima bound, deep ones (beyond half the groups) the partition
    deepest = width // 4 if deep else width // 2 ** (batched.RANK_FOLDS + 1)
    cols = np.stack([rng.integers(1, max(1, min(n, deepest)) + 1, ranks) for n in lengths])
    want = np.sort(matrix, axis=1)[np.arange(rows)[:, None], width - cols].astype(np.float64)
    got = batched.ranked_rows(matrix.copy(), cols)
    np.testing.assert_array_equal(got, want)
