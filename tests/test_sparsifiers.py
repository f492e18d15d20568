"""Properties of every sparsifier: the selection contract, exactness, count bands, state."""

from __future__ import annotations

import inspect
import io
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ssfusion_lightning as ssf
from ssfusion_lightning.sparsifiers import SPARSIFIERS, Sparsifier, build_sparsifier, selection
from ssfusion_lightning.sparsifiers.base import ThresholdSparsifier, stable_hash

ROOT = Path(__file__).resolve().parents[1]
ALL = ssf.available_sparsifiers()
EXPECTED = {
    "none",
    "nonzero",
    "topk",
    "randomk",
    "dgc",
    "gaussiank",
    "redsync",
    "sidco",
    "threshold_reuse",
    "adtopk",
    "adtopk_interleaved",
}
FIXED_K = ["topk", "randomk"]
THRESHOLD = ["dgc", "gaussiank", "redsync", "sidco", "threshold_reuse"]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
# a variety of sidco fits
# dgc selects tensors below exact_below elements by their exact top-k: exact_below=0 keeps its
# sampled threshold at every size the tests use
VARIANTS = (
    [(name, {}) for name in ALL]
    + [("sidco", {"distribution": d}) for d in ("gpareto", "gamma")]
    + [("dgc", {"exact_below": 0})]
)
VARIANT_IDS = [f"{n}-{o.get('distribution', '')}{'sampled' if 'exact_below' in o else ''}" for n, o in VARIANTS]



@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Small tensors: intra-op threads only add scheduling noise on a shared 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


PROPERTY = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])

shapes = st.lists(st.integers(0, 7), min_size=0, max_size=4).map(tuple) | st.sampled_from(
    [(), (1,), (1, 1), (2, 3), (64, 3, 3, 3), (300,), (17, 129), (2, 3, 4, 5)]
)
densities = st.sampled_from([0.001, 0.01, 0.05, 0.3, 1.0]) | st.floats(1e-4, 1.0)


def make_input(shape, dtype, seed: int, kind: str = "normal") -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == "normal":
        x = torch.randn(shape, generator=g)
    elif kind == "ties":  # few distinct magnitudes, many ties
        x = torch.randint(-3, 4, shape, generator=g).float()
    elif kind == "zeros":
        x = torch.zeros(shape)
    else:  # mostly zeros
        x = torch.randn(shape, generator=g) * (torch.rand(shape, generator=g) < 0.1)
    return x.to(dtype)


def check_contract(sparsifier: Sparsifier, x: torch.Tensor, k: int | None, key: str = "t"):
    values, indices = sparsifier.select(x, key=key, k=k)
    flat = x.reshape(-1)
    assert indices.dtype == torch.int64
    assert indices.dim() == 1 and values.dim() == 1 and values.numel() == indices.numel()
    assert values.dtype == x.dtype and values.device == x.device and indices.device == x.device
    if indices.numel():
        assert int(indices.min()) >= 0 and int(indices.max()) < flat.numel()
    assert torch.unique(indices).numel() == indices.numel(), "duplicate indices"
    assert torch.equal(values, flat[indices])
    return values, indices


# --------------------------------------------------------------------------- registry and configuration
def test_every_required_sparsifier_is_registered():
    assert EXPECTED <= set(ALL)
    for name in ALL:
        assert build_sparsifier(name, density=0.01).name == name


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_yaml_config_matches_constructor(name):
    path = ROOT / "conf" / "sparsifier" / f"{name}.yaml"
    config = yaml.safe_load(path.read_text())
    assert config.pop("name") == name
    parameters = inspect.signature(SPARSIFIERS.get(name).__init__).parameters
    assert set(config) <= set(parameters) - {"self", "density", "options"}, "yaml keys must be constructor kwargs"
    for key, value in config.items():
        assert parameters[key].default == value, f"{name}.yaml {key}={value!r} differs from the constructor default"
    sparsifier = build_sparsifier(name, density=0.02, **config)
    check_contract(sparsifier, torch.randn(40, 50), None)


def test_strategy_accepts_every_sparsifier_name():
    for name in ALL:
        strategy = ssf.SSFusionStrategy(sparsifier=name, density=0.05, fusion="ahead", comm="allgather", offload="none")
        assert strategy.sparsifier_spec == name


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_unknown_option_is_rejected(name):
    with pytest.raises(TypeError):
        build_sparsifier(name, density=0.01, no_such_option=1)
    with pytest.raises(ValueError):
        build_sparsifier(name, density=0.0)


@pytest.mark.parametrize(
    "name, options",
    [
        ("dgc", {"sample_ratio": 0.0}),
        ("dgc", {"min_sample": 0}),
        ("dgc", {"max_adjust": -1}),
        ("gaussiank", {"max_adjust": 1.5}),
        ("redsync", {"max_iters": 0}),
        ("sidco", {"distribution": "weibull"}),
        ("sidco", {"stages": 0}),
        ("threshold_reuse", {"tau": 0}),
        ("threshold_reuse", {"nudge": 0.9}),
        ("randomk", {"seed": "x"}),
        ("adtopk_interleaved", {"phase": 2}),
    ],
)
def test_bad_option_values_are_rejected(name, options):
    with pytest.raises(ValueError):
        build_sparsifier(name, density=0.01, **options)


def test_class_flags():
    flags = {name: SPARSIFIERS.get(name) for name in ALL}
    assert flags["none"].is_dense and not any(flags[n].is_dense for n in ALL if n != "none")
    assert flags["randomk"].shared_indices and not any(flags[n].shared_indices for n in ALL if n != "randomk")
    assert all(flags[n].exact_k for n in ("topk", "randomk"))
    for name in THRESHOLD:
        assert issubclass(flags[name], ThresholdSparsifier) and not flags[name].exact_k
        lo, hi = flags[name].count_band
        assert 0 < lo <= 1 <= hi
        assert build_sparsifier(name).output_count(torch.Size([100, 100]), 100) is None
    assert build_sparsifier("nonzero").output_count(torch.Size([10]), 3) is None


# --------------------------------------------------------------------------- the selection contract
@pytest.mark.parametrize("name, options", VARIANTS, ids=VARIANT_IDS)
@PROPERTY
@given(
    shape=shapes,
    dtype=st.sampled_from(DTYPES),
    density=densities,
    use_k=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
    kind=st.sampled_from(["normal", "ties", "zeros", "sparse"]),
)
def test_selection_contract(name, options, shape, dtype, density, use_k, seed, kind):
    sparsifier = build_sparsifier(name, density=density, **options)
    x = make_input(shape, dtype, seed, kind)
    n = x.numel()
    k = max(1, (seed % max(1, n)) + 1) if use_k and n else None
    budget = sparsifier.resolve_k(n, k)
    values, indices = check_contract(sparsifier, x, k)
    expected = sparsifier.output_count(x.shape, budget)
    if expected is not None:
        assert indices.numel() == expected
    if sparsifier.exact_k and not sparsifier.is_dense:
        assert indices.numel() == min(budget, n)
    if name == "none":
        assert indices.numel() == n
    if isinstance(sparsifier, ThresholdSparsifier):
        assert (indices.numel() >= 1) == (n >= 1)
        assert indices.numel() <= max(budget * sparsifier.count_band[1], budget)
    sparsifier.advance()
    check_contract(sparsifier, x, k)  # a second step (stateful sparsifiers take another path)


@pytest.mark.parametrize("name, options", VARIANTS, ids=VARIANT_IDS)
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(
    numel=st.sampled_from([1, 300, 4095, 4097, 20_000, (1 << 16) + 5, 150_001]),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.float64]),
    density=st.sampled_from([0.001, 0.01, 0.05, 0.3]),
    seed=st.integers(0, 2**31 - 1),
    kind=st.sampled_from(["normal", "ties", "sparse"]),
)
def test_host_steps_select_what_the_device_steps_select(monkeypatch, name, options, numel, dtype, density, seed, kind):
    """The numpy steps a CPU selection takes past its full pass (sample, ranking, counts inside
    the candidates, trim) choose exactly the elements of the torch ops other devices run, on
    two consecutive steps (stateful sparsifiers take another path on the second)."""
    x = make_input((numel,), dtype, seed, kind)
    chosen = {}
    for host in (True, False):
        monkeypatch.setattr(selection, "NUMPY_ON_CPU", host)
        sparsifier = build_sparsifier(name, density=density, **options)
        steps = []
        for _ in range(2):
            values, indices = sparsifier.select(x, key="w")
            order = torch.argsort(indices)
            steps.append((indices[order], values[order]))
            sparsifier.advance()
        chosen[host] = steps
    for (i_host, v_host), (i_device, v_device) in zip(chosen[True], chosen[False]):
        assert torch.equal(i_host, i_device) and torch.equal(v_host, v_device)


@pytest.mark.parametrize("name", sorted(EXPECTED))
@pytest.mark.parametrize("device", DEVICES)
def test_large_input_on_every_dtype_and_device(name, device):
    for dtype in DTYPES:
        x = make_input((256, 1024), dtype, 7).to(device)
        sparsifier = build_sparsifier(name, density=0.01)
        for _ in range(3):
            check_contract(sparsifier, x, None)
            sparsifier.advance()


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_non_contiguous_input(name):
    x = torch.randn(300, 200).t()
    assert not x.is_contiguous()
    values, indices = check_contract(build_sparsifier(name, density=0.02), x, None)
    assert torch.equal(values, x.reshape(-1)[indices])


def test_k_for_and_resolve_k():
    s = build_sparsifier("topk", density=0.01)
    assert s.k_for(0) == 0 and s.k_for(1) == 1 and s.k_for(99) == 1 and s.k_for(1000) == 10
    assert s.resolve_k(10, None) == 1 and s.resolve_k(10, 50) == 10
    assert s.resolve_k(10, 0) == 1 and s.resolve_k(0, 5) == 0


# --------------------------------------------------------------------------- topk exactness
def assert_same_as_torch_topk(x: torch.Tensor, k: int, values: torch.Tensor, indices: torch.Tensor):
    flat = x.reshape(-1)
    ref = torch.topk(flat.abs().float(), k).values
    ours = torch.sort(values.abs().float(), descending=True).values
    assert indices.numel() == k
    assert torch.equal(ours, ref), "multiset of selected magnitudes differs from torch.topk"
    # every element strictly larger than the k-th largest magnitude is selected
    kth = ref[-1]
    must = (flat.abs().float() > kth).nonzero().view(-1)
    assert torch.isin(must, indices).all()


@PROPERTY
@given(
    shape=shapes,
    dtype=st.sampled_from(DTYPES),
    density=densities,
    seed=st.integers(0, 2**31 - 1),
    kind=st.sampled_from(["normal", "ties", "sparse"]),
)
def test_topk_equals_torch_topk_small(shape, dtype, density, seed, kind):
    x = make_input(shape, dtype, seed, kind)
    if x.numel() == 0:
        return
    s = build_sparsifier("topk", density=density)
    values, indices = check_contract(s, x, None)
    assert_same_as_torch_topk(x, s.k_for(x.numel()), values, indices)


@pytest.mark.parametrize("numel", [1 << 16, (1 << 17) + 3, 1 << 19])
@pytest.mark.parametrize("density", [0.0005, 0.01, 0.1])
@pytest.mark.parametrize("kind", ["normal", "ties", "sparse", "heavy"])
def test_topk_prefilter_is_exact(numel, density, kind):
    """Sizes where the sampled pre-filter is active, including heavy ties and mostly-zero input."""
    g = torch.Generator().manual_seed(numel + int(density * 1e4))
    if kind == "heavy":
        x = torch.randn(numel, generator=g) / torch.rand(numel, generator=g).clamp_min(1e-3)
    else:
        x = make_input((numel,), torch.float32, numel, kind)
    s = build_sparsifier("topk", density=density)
    values, indices = check_contract(s, x, None)
    assert_same_as_torch_topk(x, s.k_for(numel), values, indices)


def test_topk_prefilter_falls_back_when_the_sample_misses():
    """The large values sit only where the deterministic sample never looks: the bound fails
    (fewer than k candidates) and the exact fallback must still give torch.topk's answer."""
    n, k = 1 << 18, 2000
    size = min(selection.PREFILTER_SAMPLE, n // 4)
    sampled = selection.sample_positions(n, size, torch.device("cpu"))
    x = torch.rand(n) * 0.01
    x[sampled] = 1.0 + torch.rand(size)  # the sample sees only big values...
    mask = torch.ones(n, dtype=torch.bool)
    mask[sampled] = False
    hidden = mask.nonzero().view(-1)[:k]
    x[hidden] = 5.0 + torch.rand(k)  # ...the true top-k is elsewhere
    indices = selection.topk_indices(x, k)
    assert torch.equal(torch.sort(indices).values, torch.sort(hidden).values)


@pytest.mark.parametrize("dtype", DTYPES)
def test_topk_low_precision_large(dtype):
    x = make_input((1 << 18,), dtype, 3)
    s = build_sparsifier("topk", density=0.01)
    values, indices = check_contract(s, x, None)
    assert_same_as_torch_topk(x, s.k_for(x.numel()), values, indices)


# --------------------------------------------------------------------------- selection primitives
@pytest.mark.parametrize("chunk", [None, 4096])
@pytest.mark.parametrize("numel", [0, 1, 7, 8, 1000, 4095, 4096, 3 * 4096 + 13, (1 << 16) + 5, 100_003])
@pytest.mark.parametrize("threshold", [-1.0, 0.0, 1e-3, 0.5, 2.0, 3.5, 1e9, float("inf"), float("nan")])
def test_indices_at_least_matches_naive(monkeypatch, chunk, numel, threshold):
    if chunk is not None:  # small chunks: many of them, ragged tails
        monkeypatch.setattr(selection, "CHUNK", chunk)
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel))
    if numel > 10:
        x[::5] = 0.0
        x[3] = float("inf")
        x[4] = float("nan")
        x[-1] = float("nan")
    got = selection.indices_at_least(x, threshold)
    mag = x.abs()
    if math.isnan(threshold):
        want = torch.empty(0, dtype=torch.int64)
    elif threshold > 0:
        want = (mag >= threshold).nonzero().view(-1)
    else:
        want = (mag > 0).nonzero().view(-1)
        want = want[~torch.isnan(mag[want])]
    assert got.dtype == torch.int64
    assert torch.equal(got, want)  # sorted, like nonzero


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_indices_at_least_low_precision(monkeypatch, dtype):
    monkeypatch.setattr(selection, "CHUNK", 1000)
    x = torch.randn(12_345, generator=torch.Generator().manual_seed(0)).to(dtype)
    # 0.2999 lies between two bfloat16 values: compared in the tensor's dtype, as torch compares
    for threshold in (0.0, 0.2999, 0.3, 2.5):
        want = ((x.abs() >= threshold) if threshold > 0 else (x.abs() > 0)).nonzero().view(-1)
        assert torch.equal(selection.indices_at_least(x, threshold), want)


def test_candidates_counts_are_exact_and_nested():
    x = torch.randn(1 << 17, generator=torch.Generator().manual_seed(1))
    c = selection.Candidates(x)
    for t in [2.0, 2.5, 3.0, 1.5, 1.7, 0.0, 0.3, 4.0]:
        assert c.count(t) == int(((x.abs() >= t) if t > 0 else (x.abs() > 0)).sum())
        want = ((x.abs() >= t) if t > 0 else (x.abs() > 0)).nonzero().view(-1)
        assert torch.equal(torch.sort(c.select(t)).values, want)
    assert c.full_passes == 3  # 2.0, then 1.5, then 0.0: higher thresholds are answered inside


def test_search_floor_brackets_a_low_first_count_without_another_pass():
    x = torch.randn(1 << 17, generator=torch.Generator().manual_seed(2))
    magnitudes = x.abs().sort(descending=True).values
    k = 1000
    first = float(magnitudes[int(0.5 * k)])  # counts 0.5k: under the band [0.9k, 1.25k]
    floor = float(magnitudes[3 * k])  # counts 3k: over it
    halving = selection.Candidates(x)
    selection.search_threshold(halving, first, 0.9 * k, 1.25 * k, 4)
    assert halving.full_passes == 2  # x0.5 lands below everything counted so far
    bracketed = selection.Candidates(x)
    bracketed.prepare(floor)
    threshold, count = selection.search_threshold(bracketed, first, 0.9 * k, 1.25 * k, 4, floor=floor)
    assert 0.9 * k <= count <= 1.25 * k and count == int((x.abs() >= threshold).sum())
    assert bracketed.full_passes == 1
    # the answer depends on the counts only: the same without the floor's pass made first
    late = selection.Candidates(x)
    assert selection.search_threshold(late, first, 0.9 * k, 1.25 * k, 4, floor=floor) == (threshold, count)


def test_dgc_selects_in_one_pass_over_the_tensor(monkeypatch):
    """The search floor (drawn from the same sample) makes the first pass a superset of what
    the count band needs: before it, a quarter of these selections took a second pass."""
    passes = []
    original = selection.indices_at_least
    monkeypatch.setattr(selection, "indices_at_least", lambda flat, t: passes.append(t) or original(flat, t))
    dgc = build_sparsifier("dgc", density=0.01, exact_below=0)
    generator = torch.Generator().manual_seed(3)
    calls = 0
    for step in range(8):
        for i, n in enumerate([1 << 16, 200_000, 590_000]):
            x = torch.randn(n, generator=generator) * torch.rand(n, generator=generator) ** 4  # heavy-tailed
            before = len(passes)
            values, indices = dgc.select(x, key=f"t{i}")
            calls += 1
            assert 0.9 * n // 100 <= indices.numel() <= n // 100
            assert len(passes) - before >= 1
        dgc.advance()
    assert len(passes) <= calls + 1


def test_weyl_sample_positions_are_distinct():
    for n in [1, 10, 4096, 1 << 20, 3 * 5 * 7 * 11 * 13 * 17]:
        for size in [1, 100, 5000]:
            p = selection.sample_positions(n, size, torch.device("cpu"), offset=12345)
            assert p.numel() == min(n, size) and torch.unique(p).numel() == p.numel()
            assert int(p.min()) >= 0 and int(p.max()) < n


# --------------------------------------------------------------------------- threshold sparsifiers: count bands
def heavy_inputs(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    u = torch.rand(n, generator=g).clamp_(1e-7, 1 - 1e-7)
    yield "gaussian", torch.randn(n, generator=g)
    yield "laplace", torch.where(u < 0.5, torch.log(2 * u), -torch.log(2 - 2 * u))
    z = torch.randn(n, generator=g)
    chi2 = (torch.randn(n, 3, generator=g) ** 2).sum(1)
    yield "student_t3", z / torch.sqrt(chi2 / 3)
    yield "cauchy", torch.tan(math.pi * (torch.rand(n, generator=g) - 0.5))
    yield "gradient_like", torch.randn(n, generator=g) * torch.rand(n, generator=g) ** 4


@pytest.mark.parametrize(
    "name, options",
    [(n, {}) for n in THRESHOLD] + [("sidco", {"distribution": "gpareto"}), ("sidco", {"distribution": "gamma"})],
    ids=lambda v: v if isinstance(v, str) else v.get("distribution", "-"),
)
@pytest.mark.parametrize("density", [0.001, 0.01, 0.05])
def test_threshold_sparsifier_count_band(name, options, density):
    n = 1 << 16
    for seed in range(3):
        for dist, x in heavy_inputs(n, seed):
            for dtype in (torch.float32, torch.bfloat16):
                sparsifier = build_sparsifier(name, density=density, **options)
                k = sparsifier.k_for(n)
                lo, hi = sparsifier.count_band
                for step in range(3):  # threshold_reuse: an exact step, then reuse steps
                    _, indices = check_contract(sparsifier, (x * (1 + 0.05 * step)).to(dtype), None, key=dist)
                    count = indices.numel()
                    assert lo * k - 1e-9 <= count <= hi * k + 1e-9, (dist, dtype, step, count / k)
                    sparsifier.advance()


def test_threshold_reuse_reuses_then_refreshes():
    s = build_sparsifier("threshold_reuse", density=0.01, tau=4)
    n = 1 << 16
    x = torch.randn(n, generator=torch.Generator().manual_seed(0))
    k = s.k_for(n)
    _, first = s.select(x, key="w")
    assert first.numel() == k  # exact step
    threshold, _, exact_step = s.thresholds["w"]
    assert exact_step == 0 and threshold == float(x[first].abs().min())
    for step in range(1, 4):
        s.advance()
        y = torch.randn(n, generator=torch.Generator().manual_seed(step))
        _, idx = s.select(y, key="w")
        # reuse step: exactly the elements above the stored threshold
        assert torch.equal(torch.sort(idx).values, (y.abs() >= threshold).nonzero().view(-1))
        assert 2 * k / 3 <= idx.numel() <= 4 * k / 3
        threshold = s.thresholds["w"][0]
    s.advance()
    _, idx = s.select(y, key="w")
    assert s.thresholds["w"][2] == 4 and idx.numel() == k  # tau steps later: exact again
    # a gradient whose scale jumped leaves the safety band: exact at once
    s.advance()
    _, idx = s.select(y * 100, key="w")
    assert idx.numel() == k and s.thresholds["w"][2] == 5


def test_dgc_honours_the_per_tensor_k():
    """The threshold comes from the budget k (a fusion policy's), not the configured density."""
    x = torch.randn(1 << 16, generator=torch.Generator().manual_seed(2))
    for exact_below in (0, 1 << 18):
        s = build_sparsifier("dgc", density=0.001, exact_below=exact_below)
        for k in (50, 700, 3000):
            _, idx = s.select(x, k=k)
            assert 0.9 * k <= idx.numel() <= k


@pytest.mark.parametrize("numel", [5000, 70_000, (1 << 18) - 1])
def test_dgc_below_exact_below_sends_the_exact_top_k(numel):
    """A tensor below exact_below is sampled whole: its threshold is the exact k-th magnitude, so
    dgc sends exactly the k largest magnitudes, alone and batched; at exact_below it samples
    (fewer than k elements, as its count band allows, on most of these steps)."""
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel))
    k = numel // 100
    expected = set(torch.topk(x.abs(), k).indices.tolist())
    exact = build_sparsifier("dgc", density=0.01)
    _, alone = exact.select(x, key="w")
    [(_, batched)] = exact.select_many([x], ["w"], [None])
    assert set(alone.tolist()) == set(batched.tolist()) == expected
    sampled = build_sparsifier("dgc", density=0.01, exact_below=numel)
    counts = []
    for _ in range(4):
        _, idx = sampled.select(x, key="w")
        counts.append(idx.numel())
        assert set(idx.tolist()) <= expected and 0.9 * k <= idx.numel() <= k
        sampled.advance()
    assert min(counts) < k


def test_gaussiank_threshold_on_gaussian_input_needs_no_correction():
    from ssfusion_lightning.sparsifiers.gaussiank import two_sided_z

    assert two_sided_z(0.05) == pytest.approx(1.959964, abs=1e-5)
    assert two_sided_z(0.01) == pytest.approx(2.575829, abs=1e-5)
    x = torch.randn(1 << 18, generator=torch.Generator().manual_seed(3))
    _, idx = build_sparsifier("gaussiank", density=0.01, max_adjust=0).select(x)
    assert abs(idx.numel() / 2621 - 1) < 0.1


def test_sidco_fits():
    from ssfusion_lightning.sparsifiers.sidco import exponential_quantile, gamma_quantile, gpareto_quantile

    assert exponential_quantile(2.0, 4.0, 0.01) == pytest.approx(2.0 * math.log(100))
    # exponential is gamma with shape 1 and GPD with xi 0
    assert gamma_quantile(2.0, 4.0, 0.01) == pytest.approx(2.0 * math.log(100), rel=1e-3)
    assert gpareto_quantile(2.0, 4.0, 0.01) == pytest.approx(2.0 * math.log(100), rel=1e-3)
    # a gamma(shape 4, scale 0.5) sample: the fitted quantile is close to the empirical one
    g = torch.Generator().manual_seed(0)
    sample = torch.distributions.Gamma(torch.tensor(4.0), torch.tensor(2.0)).sample((200000,))
    q = gamma_quantile(float(sample.mean()), float(sample.var()), 0.01)
    assert q == pytest.approx(float(torch.quantile(sample[:100000], 0.99)), rel=0.03)
    del g
    # with the adjustment off, an exponential input is fitted well by the exponential model
    x = torch.distributions.Exponential(torch.tensor(1.0)).sample((1 << 17,)) * torch.sign(torch.randn(1 << 17))
    _, idx = build_sparsifier("sidco", density=0.01, max_adjust=0, stages=1).select(x)
    assert abs(idx.numel() / 1310 - 1) < 0.15


def reference_redsync(x: torch.Tensor, k: int, iters: int = 40) -> torch.Tensor:
    """RedSync's plain binary search with naive full-tensor counts (no sampling, no candidate sets)."""
    mean, top = selection.abs_mean_max(x)  # the same rounding of mean and max as the sparsifier
    low, high, r = 0.0, 1.0, 0.5
    for _ in range(iters):
        count = int((x.abs() >= mean + r * (top - mean)).sum())
        if k <= count <= 2 * k:
            break
        low, high = (low, r) if count < k else (r, high)
        r = 0.5 * (low + high)
    return (x.abs() >= mean + r * (top - mean)).nonzero().view(-1)


@pytest.mark.parametrize("dist", ["gaussian", "laplace", "student_t3", "gradient_like"])
@pytest.mark.parametrize("density", [0.001, 0.01])
def test_redsync_with_sampled_search_plan_equals_the_plain_binary_search(dist, density):
    """Above 2^18 elements the probes are planned from a sample; the answer must not change."""
    x = dict(heavy_inputs(1 << 19, 11))[dist]
    s = build_sparsifier("redsync", density=density)
    _, indices = s.select(x)
    want = reference_redsync(x, s.k_for(x.numel()))
    assert torch.equal(torch.sort(indices).values, want)


def test_redsync_lands_in_k_to_2k_even_when_mean_is_above_the_kth():
    g = torch.Generator().manual_seed(4)
    x = torch.rand(1 << 16, generator=g)
    x[: 1 << 10] = 1e4 * (1 + torch.rand(1 << 10, generator=g))  # 1.6% huge outliers lift the mean
    s = build_sparsifier("redsync", density=0.05)
    k = s.k_for(x.numel())
    assert x.abs().mean() > torch.topk(x.abs(), k).values[-1]  # r in [0, 1] alone cannot reach k
    _, idx = s.select(x)
    assert k <= idx.numel() <= 2 * k


# --------------------------------------------------------------------------- adtopk
@PROPERTY
@given(
    rows=st.integers(1, 40),
    inner=st.lists(st.integers(1, 9), min_size=1, max_size=3),
    density=densities,
    seed=st.integers(0, 2**31 - 1),
    dtype=st.sampled_from(DTYPES),
)
def test_adtopk_keeps_every_row(rows, inner, density, seed, dtype):
    shape = (rows, *inner)
    x = make_input(shape, dtype, seed)
    for name in ("adtopk", "adtopk_interleaved"):
        s = build_sparsifier(name, density=density)
        n, cols = x.numel(), math.prod(inner)
        k = s.k_for(n)
        per_row = min(cols, max(1, math.ceil(k / rows)))
        values, indices = check_contract(s, x, None)
        assert indices.numel() == s.output_count(x.shape, k) == rows * per_row
        if name == "adtopk":
            counts = torch.bincount(indices // cols, minlength=rows)
            assert bool((counts == per_row).all())
            # inside each row the kept elements are that row's largest magnitudes
            mag = x.reshape(rows, cols).abs().float()
            kth = torch.topk(mag, per_row, dim=1).values[:, -1:]
            kept = torch.zeros(n, dtype=torch.bool)
            kept[indices] = True
            assert bool((mag[kept.view(rows, cols)] >= kth.expand(rows, cols)[kept.view(rows, cols)]).all())


@pytest.mark.parametrize(
    "rows, cols, per_row",
    [(48, 4096, 1), (48, 4096, 5), (48, 4096, 41), (48, 4096, 200), (48, 4100, 41), (48, 1000, 5), (600, 4096, 41)],
)
@pytest.mark.parametrize("kind", ["normal", "ties"])
def test_adtopk_row_fold_is_exact(monkeypatch, rows, cols, per_row, kind):
    """The folded per-row top-k of large rows, over several row blocks on CPU, takes the same
    magnitudes as torch.topk per row."""
    from ssfusion_lightning.sparsifiers import adtopk
    from ssfusion_lightning.sparsifiers.adtopk import row_topk

    monkeypatch.setattr(adtopk, "CHUNK", 20 * cols + 7)  # blocks of 20 rows, a ragged last block

    x = make_input((rows, cols), torch.float32, cols + per_row, kind)
    columns = row_topk(x, per_row)
    assert columns.shape == (rows, per_row) and columns.dtype == torch.int64
    assert all(torch.unique(row).numel() == per_row for row in columns)
    ours = torch.sort(torch.gather(x.abs(), 1, columns), dim=1).values
    ref = torch.sort(torch.topk(x.abs(), per_row, dim=1).values, dim=1).values
    assert torch.equal(ours, ref)


def test_adtopk_goes_dense_on_vectors_and_scalars():
    for shape in [(), (1,), (10,), (1000,)]:
        x = torch.randn(shape)
        for name in ("adtopk", "adtopk_interleaved"):
            s = build_sparsifier(name, density=0.01)
            _, idx = check_contract(s, x, None)
            assert idx.numel() == x.numel() == s.output_count(x.shape, 1)


def test_adtopk_interleaved_alternates_with_the_same_count():
    x = torch.randn(64, 100, generator=torch.Generator().manual_seed(0))
    x[:8] *= 100  # flat top-k stays inside rows 0-7 (800 > k values); adtopk takes ceil(k/rows) from every row
    s = build_sparsifier("adtopk_interleaved", density=0.05)
    k = s.k_for(x.numel())
    counts, rows_hit = [], []
    for _ in range(4):
        _, idx = s.select(x, k=k)
        counts.append(idx.numel())
        rows_hit.append(torch.unique(idx // 100).numel())
        s.advance()
    assert len(set(counts)) == 1 and counts[0] == s.output_count(x.shape, k) == 64 * math.ceil(k / 64)
    assert rows_hit[0] == rows_hit[2] == 64 and rows_hit[1] == rows_hit[3] == 8
    flat_top = torch.topk(x.reshape(-1).abs(), counts[0]).indices
    s.step = 1
    _, idx = s.select(x, k=k)
    assert torch.equal(torch.sort(idx).values, torch.sort(flat_top).values)


# --------------------------------------------------------------------------- nonzero and randomk
@PROPERTY
@given(
    shape=shapes,
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**31 - 1),
    kind=st.sampled_from(["normal", "sparse", "zeros", "ties"]),
)
def test_nonzero_is_lossless(shape, dtype, seed, kind):
    x = make_input(shape, dtype, seed, kind)
    values, indices = check_contract(build_sparsifier("nonzero", density=0.01), x, 1)
    dense = torch.zeros(x.numel(), dtype=dtype)
    dense[indices] = values
    assert torch.equal(dense.view(x.shape), x)
    assert indices.numel() == int((x != 0).sum())


def test_nonzero_lossless_large():
    x = make_input((1 << 19,), torch.float32, 5, "sparse")
    values, indices = check_contract(build_sparsifier("nonzero"), x, None)
    dense = torch.zeros_like(x)
    dense[indices] = values
    assert torch.equal(dense, x)


def test_randomk_is_shared_and_changes_with_step_and_key():
    a, b = build_sparsifier("randomk", density=0.01), build_sparsifier("randomk", density=0.01)
    x, y = torch.randn(100, 1000), torch.randn(100, 1000)  # different data on two "ranks"
    _, ia = a.select(x, key="layer.weight")
    _, ib = b.select(y, key="layer.weight")
    assert torch.equal(ia, ib) and ia.numel() == 1000
    _, other_key = a.select(x, key="layer.bias")
    assert not torch.equal(ia, other_key)
    a.advance()
    _, next_step = a.select(x, key="layer.weight")
    assert not torch.equal(torch.sort(ia).values, torch.sort(next_step).values)
    c = build_sparsifier("randomk", density=0.01, seed=1)
    assert not torch.equal(c.select(x, key="layer.weight")[1], ia)


def test_randomk_positions_are_uniform():
    s = build_sparsifier("randomk", density=0.1)
    hits = torch.zeros(200)
    for _ in range(500):
        _, idx = s.select(torch.randn(200), key="w")
        hits[idx] += 1
        s.advance()
    # each position is picked with probability 0.1: 50 +- 6.7 times in 500 steps
    assert hits.sum() == 500 * 20
    assert float(hits.min()) > 20 and float(hits.max()) < 80
    assert abs(float(hits.std()) - math.sqrt(500 * 0.1 * 0.9)) < 2.5


def test_randomk_does_not_depend_on_python_hash_seed():
    """Another process with another str-hash salt picks the same positions."""
    code = (
        "import torch; from ssfusion_lightning.sparsifiers import build_sparsifier as b;"
        "r=b('randomk', density=0.01); r.step=3;"
        "print(r.select(torch.zeros(100000), key='net.0.weight')[1].tolist())"
    )
    env = dict(os.environ, PYTHONHASHSEED="12345", PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    here = build_sparsifier("randomk", density=0.01)
    here.step = 3
    assert json.loads(out) == here.select(torch.zeros(100000), key="net.0.weight")[1].tolist()
    assert stable_hash("abc") == stable_hash("abc") != stable_hash("abd")


# --------------------------------------------------------------------------- state
@pytest.mark.parametrize("name, options", VARIANTS, ids=VARIANT_IDS)
def test_state_dict_round_trip(name, options):
    """A sparsifier restored from a (pickled) state_dict continues exactly like the original."""
    original = build_sparsifier(name, density=0.02, **options)
    g = torch.Generator().manual_seed(0)
    inputs = [torch.randn(50, 80, generator=g) for _ in range(12)]
    for x in inputs[:5]:
        for key in ("a", "b"):
            original.select(x, key=key)
        original.advance()
    buffer = io.BytesIO()
    torch.save(original.state_dict(), buffer)
    buffer.seek(0)
    restored = build_sparsifier(name, density=0.02, **options)
    restored.load_state_dict(torch.load(buffer, weights_only=True))
    assert restored.step == original.step == 5
    for x in inputs[5:]:
        for key in ("a", "b"):
            va, ia = original.select(x, key=key)
            vb, ib = restored.select(x, key=key)
            assert torch.equal(ia, ib) and torch.equal(va, vb)
        original.advance()
        restored.advance()
    assert original.state_dict() == restored.state_dict()


def test_threshold_reuse_state_holds_thresholds():
    s = build_sparsifier("threshold_reuse", density=0.01)
    s.select(torch.randn(1000), key="w")
    state = s.state_dict()
    assert set(state) == {"step", "thresholds"} and "w" in state["thresholds"]
    fresh = build_sparsifier("threshold_reuse", density=0.01)
    fresh.load_state_dict({"step": 3})  # an older state without thresholds still loads
    assert fresh.step == 3 and fresh.thresholds == {}


@settings(max_examples=25, deadline=None)
@given(name=st.sampled_from(sorted(SPARSIFIERS.names())), numel=st.integers(1, 30_000), seed=st.integers(0, 2**31 - 1))
def test_count_bound_is_never_exceeded(name, numel, seed):
    """count_bound lets the allgather skip its count round, so a selection above it would corrupt
    the exchange: exact-k, DGC (trims to k) and ADTopk bound their count; the others do not."""
    sparsifier = build_sparsifier(name, density=0.01)
    tensor = torch.randn(numel, generator=torch.Generator().manual_seed(seed))
    k = sparsifier.k_for(numel)
    bound = sparsifier.count_bound(tensor.shape, k)
    if name in ("gaussiank", "redsync", "sidco", "threshold_reuse", "nonzero"):
        assert bound is None
        return
    assert bound is not None
    values, _ = sparsifier.select(tensor, key="t", k=k)
    assert values.numel() <= bound
    if name != "dgc":
        assert values.numel() == bound
