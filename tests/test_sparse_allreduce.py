"""Sparse allreduce schemes (allgather, zen, sparcml) and Ok-Topk on 2, 3 and 4 gloo ranks.

Inputs are generated here, in the test process, and shipped to the ranks; each rank returns its
result as (nonzero positions, values) so large outputs stay cheap to compare. The byte formulas
are written out here independently of the implementation (only the hash is shared).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ssfusion_lightning.comm import SPARSE_SCHEMES, Traffic, sparse_allreduce
from ssfusion_lightning.comm.oktopk import OkTopkCommunicator, OkTopkState, oktopk_reduce
from ssfusion_lightning.comm.schemes import SparseSum
from ssfusion_lightning.comm.zen import (
    ZEN_BLOCK,
    ZenCommunicator,
    bit_positions,
    bitmap_of,
    owner_sums,
    zen_owner,
    zen_partition,
)

SCHEMES = ("allgather", "zen", "sparcml")
PATTERNS = ("random", "identical", "disjoint", "skewed", "empty")
X = 4  # every scheme sends positions as int32 (numel < 2**31)


# ----------------------------------------------------------------------------- inputs
def make_inputs(world, pattern, numel, k, index_dtype, value_dtype, empty_ranks, seed, integer_values=True):
    """Per-rank (values, indices): distinct indices in [0, numel), ``k`` per rank (fewer if needed)."""
    g = torch.Generator().manual_seed(seed)
    k = min(k, numel)
    if pattern == "random":
        sets = [torch.randperm(numel, generator=g)[:k] for _ in range(world)]
    elif pattern == "identical":
        sets = [torch.randperm(numel, generator=g)[:k]] * world
    elif pattern == "disjoint":
        perm = torch.randperm(numel, generator=g)
        share = min(k, numel // world)
        sets = [perm[r * share : (r + 1) * share] for r in range(world)]
    elif pattern == "skewed":  # everything in the front 2% of the tensor (at least k wide)
        front = max(k, numel // 50)
        sets = [torch.randperm(front, generator=g)[:k] for _ in range(world)]
    elif pattern == "empty":
        sets = [torch.empty(0, dtype=torch.int64)] * world
    else:
        raise ValueError(pattern)
    out = []
    for r, idx in enumerate(sets):
        if r in empty_ranks:
            idx = idx[:0]
        if integer_values:
            vals = torch.randint(-4, 5, (idx.numel(),), generator=g).to(value_dtype)
        else:
            vals = torch.randn(idx.numel(), generator=g).to(value_dtype)
        out.append((vals, idx.to(index_dtype).clone()))
    return out


def dense_sum(inputs, numel):
    """Reference: scatter every rank's contribution densely and sum in float64."""
    total = torch.zeros(numel, dtype=torch.float64)
    for vals, idx in inputs:
        total.index_add_(0, idx.to(torch.int64), vals.to(torch.float64))
    return total


def sparse_view(dense):
    nz = torch.nonzero(dense != 0).view(-1)
    return nz, dense[nz]


# ----------------------------------------------------------------------------- byte formulas
def compact(numel, slots):
    """Whether positions travel as a 4-byte count per block of 2**16 elements and a 2-byte offset
    each: where that is fewer bytes than int32 positions for ``slots`` pairs."""
    return 4 * -(-numel // 2**16) + 2 * slots < X * slots


def allgather_bytes(inputs, rank, vbytes, numel, slots=None):
    """One 8-byte count per peer, then each rank's pairs (padding and the count header not counted),
    positions compact where ``compact`` says so for the slots (default: the largest count)."""
    world = len(inputs)
    counts = [v.numel() for v, _ in inputs]
    small = (world - 1) * 8
    blocks = -(-numel // 2**16)
    compact_ = compact(numel, max(counts) if slots is None else slots)

    def pairs(count):
        return count * vbytes + (4 * blocks + 2 * count if compact_ else X * count)

    return small + (world - 1) * pairs(counts[rank]), small + sum(pairs(c) for r, c in enumerate(counts) if r != rank)


def zen_bytes(inputs, rank, vbytes, total):
    """Push: pairs whose owner is another rank; pull: the owner's bitmap (|I_j|/8 bytes + K_j values)
    or COO (K_j (x+v)), whichever is smaller; two count exchanges of 8 bytes per peer."""
    world = len(inputs)
    numel = total.numel()
    part = zen_partition(numel, world)
    owners = [zen_owner(idx.to(torch.int64), world) for _, idx in inputs]
    nonzero_owner = zen_owner(torch.nonzero(total != 0).view(-1), world)
    msg = []
    for j in range(world):
        K = int((nonzero_owner == j).sum())
        bitmap, coo = math.ceil(part.sizes[j] / 8) + K * vbytes, K * (X + vbytes)
        msg.append(bitmap if bitmap < coo else coo)
    pair = X + vbytes
    leaving = int((owners[rank] != rank).sum())
    arriving = sum(int((o == rank).sum()) for r, o in enumerate(owners) if r != rank)
    small = 2 * (world - 1) * 8
    return small + leaving * pair + (world - 1) * msg[rank], small + arriving * pair + sum(msg) - msg[rank]


def sparcml_bytes(inputs, rank, vbytes, acc_bytes):
    """Recursive doubling over P' = 2^floor(log2 P) ranks after folding the extra ones; every message
    is an 8-byte header plus the sender's current union (raw values at v, partial sums at fp32)."""
    world = len(inputs)
    sets = [set(idx.tolist()) for _, idx in inputs]
    summed = [False] * world
    sent, recv = [0] * world, [0] * world

    def msg(a, b, n, v):
        sent[a] += 8 + n * (X + v)
        recv[b] += 8 + n * (X + v)

    core = 1 << int(math.log2(world))
    extra = world - core
    for odd in range(1, 2 * extra, 2):
        msg(odd, odd - 1, len(sets[odd]), acc_bytes if summed[odd] else vbytes)
        sets[odd - 1] |= sets[odd]
        summed[odd - 1] = True
    members = [r for r in range(world) if not (r < 2 * extra and r % 2)]
    step = 1
    while step < core:
        new = {}
        for c, r in enumerate(members):
            p = members[c ^ step]
            msg(r, p, len(sets[r]), acc_bytes if summed[r] else vbytes)
            new[r] = sets[r] | sets[p]
        for r in new:
            sets[r], summed[r] = new[r], True
        step *= 2
    for odd in range(1, 2 * extra, 2):
        msg(odd - 1, odd, len(sets[odd - 1]), vbytes)
    return sent[rank], recv[rank]


# ----------------------------------------------------------------------------- rank functions
def run_schemes(inputs, numel):
    rank = dist.get_rank()
    values, indices = inputs[rank]
    out = {}
    for scheme in SCHEMES:
        total = sparse_allreduce(values, indices, numel, scheme=scheme)
        traffic = Traffic()
        again = SPARSE_SCHEMES.get(scheme)(values, indices.to(torch.int64), numel, None, traffic)
        assert torch.equal(total, again)
        assert total.dtype == values.dtype and total.shape == (numel,)
        nz, vals = sparse_view(total)
        out[scheme] = (nz, vals, traffic)
    return out


def check_schemes(world, inputs, numel, exact=True):
    results = POOLS[world].run(run_schemes, inputs, numel)
    reference = dense_sum(inputs, numel)
    vdtype = inputs[0][0].dtype
    vbytes = torch.tensor([], dtype=vdtype).element_size()
    expected_nz, expected_vals = sparse_view(reference.to(vdtype) if exact else reference)
    for scheme in SCHEMES:
        nz0, vals0, _ = results[0][scheme]
        for rank, res in enumerate(results):
            nz, vals, traffic = res[scheme]
            # bitwise identical on every rank
            assert torch.equal(nz, nz0) and torch.equal(vals, vals0), f"{scheme}: rank {rank} differs from rank 0"
            if scheme == "allgather":
                formula = allgather_bytes(inputs, rank, vbytes, numel)
            elif scheme == "zen":
                formula = zen_bytes(inputs, rank, vbytes, reference)
            else:
                formula = sparcml_bytes(inputs, rank, vbytes, 4)
            assert (traffic.sent, traffic.received) == formula, f"{scheme}: rank {rank} bytes != formula"
            if scheme != "allgather":  # no padding in zen and sparcml
                assert (traffic.padded_sent, traffic.padded_received) == formula
        if exact:
            assert torch.equal(nz0, expected_nz), f"{scheme}: wrong support"
            assert torch.equal(vals0, expected_vals), f"{scheme}: wrong sums"
        else:
            dense = torch.zeros(numel, dtype=torch.float64)
            dense[nz0] = vals0.to(torch.float64)
            torch.testing.assert_close(dense, reference, rtol=1e-5, atol=1e-5)


POOLS: dict[int, object] = {}


@pytest.fixture
def pools(pool2, pool3, pool4):
    POOLS.update({2: pool2, 3: pool3, 4: pool4})
    return POOLS


@st.composite
def cases(draw):
    world = draw(st.sampled_from([2, 3, 4]))
    pattern = draw(st.sampled_from(PATTERNS))
    exponent = draw(st.integers(0, 19))
    numel = draw(st.integers(2**exponent, min(2 ** (exponent + 1) - 1, 1_000_000)))
    density = draw(st.sampled_from([0.001, 0.01, 0.1, 0.5, 1.0]))
    k = max(1, min(4000, int(density * numel)))
    index_dtype = draw(st.sampled_from([torch.int32, torch.int64]))
    value_dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    empty_ranks = draw(st.sets(st.integers(0, world - 1), max_size=world - 1))
    seed = draw(st.integers(0, 2**31 - 1))
    return world, pattern, numel, k, index_dtype, value_dtype, empty_ranks, seed


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=cases())
def test_sparse_allreduce_equals_dense_sum(pools, case):
    world, pattern, numel, k, index_dtype, value_dtype, empty_ranks, seed = case
    inputs = make_inputs(world, pattern, numel, k, index_dtype, value_dtype, empty_ranks, seed)
    check_schemes(world, inputs, numel)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    world=st.sampled_from([2, 3, 4]),
    pattern=st.sampled_from(PATTERNS[:4]),
    numel=st.integers(1, 200_000),
    seed=st.integers(0, 2**31 - 1),
)
def test_sparse_allreduce_random_fp32_values(pools, world, pattern, numel, seed):
    """Non-integer values: close to the exact sum, still bitwise identical on every rank."""
    inputs = make_inputs(world, pattern, numel, max(1, numel // 100), torch.int64, torch.float32, set(), seed, False)
    check_schemes(world, inputs, numel, exact=False)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_edge_cases(pools, world):
    for pattern, numel, k in [("empty", 0, 0), ("identical", 1, 1), ("empty", 1, 1), ("empty", 1000, 10), ("disjoint", 5, 5), ("random", 2, 2)]:
        check_schemes(world, make_inputs(world, pattern, numel, k, torch.int32, torch.float32, set(), 7), numel)


def test_large_tensor_bitmap_pull(pools):
    """numel in the millions with density 1%: the pull is a bitmap (cheaper than COO)."""
    numel = 3_000_000
    inputs = make_inputs(4, "random", numel, 30_000, torch.int64, torch.float32, set(), 11)
    part = zen_partition(numel, 4)
    nonzero = torch.nonzero(dense_sum(inputs, numel) != 0).view(-1)
    for j in range(4):
        K = int((zen_owner(nonzero, 4) == j).sum())
        assert math.ceil(part.sizes[j] / 8) + 4 * K < (X + 4) * K  # the bitmap branch is taken
    check_schemes(4, inputs, numel)


def test_bf16_sums_in_fp32_then_casts_once(pools):
    """256 + 1 + 1 + 1 in bf16 steps stays 256; summed in fp32 it is 259 -> bf16(259) = 260."""
    numel = 10
    inputs = [
        (torch.tensor([256.0, 1.0], dtype=torch.bfloat16), torch.tensor([0, 3])),
        (torch.tensor([1.0], dtype=torch.bfloat16), torch.tensor([0])),
        (torch.tensor([1.0], dtype=torch.bfloat16), torch.tensor([0])),
        (torch.tensor([1.0], dtype=torch.bfloat16), torch.tensor([0])),
    ]
    expected = torch.tensor(259.0).to(torch.bfloat16)
    assert float(expected) == 260.0
    for res in pools[4].run(run_schemes, inputs, numel):
        for scheme in SCHEMES:
            nz, vals, _ = res[scheme]
            assert nz.tolist() == [0, 3]
            assert vals[0] == expected, f"{scheme}: {float(vals[0])}"


# ----------------------------------------------------------------------------- ZEN parts
def test_zen_load_balance_on_skewed_indices():
    """All indices in the front 5% of a 2^22 tensor: a contiguous split puts everything on rank 0;
    the hash keeps max/mean partition load within 1.1."""
    numel = 1 << 22
    g = torch.Generator().manual_seed(3)
    for world in (2, 3, 4, 8):
        idx = torch.cat([torch.randperm(numel // 20, generator=g)[:40_000] for _ in range(world)])
        load = torch.bincount(zen_owner(idx, world), minlength=world).double()
        assert float(load.max() / load.mean()) <= 1.1
        contiguous = torch.bincount(idx * world // numel, minlength=world).double()
        assert float(contiguous.max() / contiguous.mean()) == pytest.approx(world)
        part = zen_partition(numel, world)
        assert max(part.sizes) / (numel / world) <= 1.01  # the index sets I_i are balanced too


def test_zen_partition_and_bitmap_codec():
    numel, world = 100_003, 3
    part = zen_partition(numel, world)
    sets = [part.index_set(j) for j in range(world)]
    everything = torch.sort(torch.cat(sets)).values
    assert torch.equal(everything, torch.arange(numel))
    for j, s in enumerate(sets):
        assert s.numel() == part.sizes[j]
        assert torch.all(s[1:] > s[:-1])
        assert torch.all(zen_owner(s, world) == j)
        assert torch.equal(part.local_slots(j, s), torch.arange(s.numel()))
        assert torch.equal(part.global_indices(j, torch.arange(s.numel())), s)
    # owners come in blocks: 16 consecutive indices share one, and the last block is cut at numel
    owner = zen_owner(torch.arange(numel), world)
    assert torch.all(owner.view(-1)[: numel // ZEN_BLOCK * ZEN_BLOCK].view(-1, ZEN_BLOCK).diff(dim=1) == 0)
    assert len(set(owner[: 64 * ZEN_BLOCK : ZEN_BLOCK].tolist())) == world
    # the kept state is one block id per 16 elements
    assert sum(b.numel() for b in part.blocks) == math.ceil(numel / ZEN_BLOCK)
    assert zen_partition(numel, world) is part  # cached
    g = torch.Generator().manual_seed(0)
    for n in (0, 1, 7, 8, 9, 1000):
        bits = torch.rand(n, generator=g) < 0.3
        packed = bitmap_of(bits.nonzero().view(-1), n)
        assert packed.numel() == math.ceil(n / 8)
        assert torch.equal(bit_positions(packed), bits.nonzero().view(-1))
    assert bitmap_of(torch.tensor([0, 9, 15]), 16).tolist() == [1, 2 + 128]  # least significant bit first
    assert bit_positions(torch.tensor([1, 2 + 128], dtype=torch.uint8)).tolist() == [0, 9, 15]
    # the hash is the same function of the index everywhere, including past 2^32
    big = torch.tensor([0, 1, 2**31, 2**32 + 5, 2**40 + 123], dtype=torch.int64)
    assert torch.equal(zen_owner(big, 5), zen_owner(big.clone(), 5))
    assert zen_owner(torch.arange(10), 4).tolist() == zen_owner(torch.arange(10, dtype=torch.int32), 4).tolist()


def run_zen_communicator(numel, k, rounds, choice):
    from ssfusion_lightning.comm import ChannelSet
    from ssfusion_lightning.vocabulary import Buffer, Encoded, Slot

    rank, world = dist.get_rank(), dist.get_world_size()
    comm = ZenCommunicator(choice=choice, profile_rounds=2)
    channels = ChannelSet([None], torch.device("cpu"))
    buffer = Buffer(0, (Slot("w", 0, (numel,), 0, numel, True, k),), channel=0)
    ok = []
    try:
        for step in range(rounds):
            g = torch.Generator().manual_seed(100 * step)
            sets = [torch.randperm(numel, generator=g)[:k] for _ in range(world)]
            vals = [torch.randint(-3, 4, (k,), generator=g).float() for _ in range(world)]
            reference = torch.zeros(numel)
            for i, v in zip(sets, vals):
                reference.index_add_(0, i, v)
            reduced = comm.launch(Encoded(None, vals[rank], sets[rank]), buffer, channels).wait()
            total = reduced.sparse.dense() if isinstance(reduced.sparse, SparseSum) else reduced.sparse
            ok.append(torch.equal(total, reference) and reduced.applied is None)
    finally:
        channels.shutdown()
    return ok, comm.scheme_for(f"0:{numel}"), comm.state_dict()


@pytest.mark.parametrize("choice", ["auto", "zen", "sparcml"])
def test_zen_communicator_chooses_and_agrees(pool3, choice):
    results = pool3.run(run_zen_communicator, 5000, 100, 4, choice)
    for ok, chosen, state in results:
        assert all(ok)
        assert chosen in ("zen", "sparcml")
        if choice != "auto":
            assert chosen == choice
    assert len({chosen for _, chosen, _ in results}) == 1  # every rank picked the same scheme
    if choice == "auto":  # the agreed choice survives a checkpoint
        fresh = ZenCommunicator()
        fresh.load_state_dict(results[0][2])
        assert fresh.scheme_for("0:5000") == results[0][1]


# ----------------------------------------------------------------------------- Ok-Topk
def topk_of_sum(inputs, numel, k):
    total = dense_sum(inputs, numel).to(torch.float32)
    threshold = torch.topk(total.abs(), k).values.min()
    support = torch.nonzero(total.abs() >= threshold).view(-1)
    return support, total[support]


def run_oktopk(inputs, numel, k, rounds, threshold_every):
    rank = dist.get_rank()
    state = OkTopkState()
    out = []
    for step in range(rounds):
        values, indices = inputs[step][rank]
        traffic = Traffic()
        total, applied = oktopk_reduce(values, indices, numel, k, None, traffic, state, threshold_every=threshold_every)
        nz, vals = sparse_view(total)
        out.append((nz, vals, applied, traffic, state.threshold))
    return out


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("pattern", ["random", "identical", "skewed"])
def test_oktopk_exact_threshold_gives_topk_of_sum(pools, world, pattern):
    numel, k = 20_000, 200
    inputs = [make_inputs(world, pattern, numel, k, torch.int64, torch.float32, set(), s, False) for s in range(3)]
    results = pools[world].run(run_oktopk, inputs, numel, k, 3, 1)
    for step in range(3):
        support, sums = topk_of_sum(inputs[step], numel, k)
        nz0, vals0, applied0, _, thr0 = results[0][step]
        for nz, vals, applied, traffic, thr in (r[step] for r in results):
            assert torch.equal(nz, nz0) and torch.equal(vals, vals0) and torch.equal(applied, applied0) and thr == thr0
        assert torch.equal(applied0, support)  # exactly the top-k of the sum ...
        assert torch.equal(nz0, support[sums != 0])
        torch.testing.assert_close(vals0, sums, rtol=1e-5, atol=1e-6)  # ... with the summed values


@pytest.mark.parametrize("world", [2, 4])
def test_oktopk_threshold_reuse_stays_consistent_and_cheap(pools, world):
    numel, k, rounds = 50_000, 500, 6
    inputs = [make_inputs(world, "random", numel, k, torch.int64, torch.float32, set(), 50 + s, False) for s in range(rounds)]
    results = pools[world].run(run_oktopk, inputs, numel, k, rounds, 3)
    pair = X + 4
    for step in range(rounds):
        nz0, vals0, applied0, _, thr0 = results[0][step]
        for nz, vals, applied, traffic, thr in (r[step] for r in results):
            assert torch.equal(nz, nz0) and torch.equal(vals, vals0) and torch.equal(applied, applied0) and thr == thr0
        count = applied0.numel()
        assert k / 2 <= count <= 2 * k, f"round {step}: {count} entries for k={k}"
        if step % 3:  # a reuse round: within Ok-Topk's 3(P-1)/P * k(v+x) bound (plus counters)
            mean_received = sum(r[step][3].received for r in results) / world
            assert mean_received <= 3 * (world - 1) / world * max(k, count) * pair + 64 * world
        # applied entries carry the exact sums of what the ranks sent there
        reference = dense_sum(inputs[step], numel).to(torch.float32)
        torch.testing.assert_close(vals0, reference[nz0], rtol=1e-5, atol=1e-6)


def run_oktopk_residual(numel, k, seed):
    """One Ok-Topk round through the communicator, then the engine's error-feedback filter."""
    from ssfusion_lightning.comm import ChannelSet
    from ssfusion_lightning.fusion import ErrorFeedback
    from ssfusion_lightning.sparsifiers.memory import ResidualMemory
    from ssfusion_lightning.vocabulary import Buffer, Encoded, PendingUpdate, Slot

    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(seed + rank)
    compensated = torch.randn(numel, generator=g)
    sent = torch.topk(compensated.abs(), k).indices
    comm = OkTopkCommunicator(threshold_every=1)
    channels = ChannelSet([None], torch.device("cpu"))
    buffer = Buffer(0, (Slot("w", 0, (numel,), 0, numel, True, k),), channel=0)
    encoded = Encoded(None, compensated[sent] / world, sent, [PendingUpdate("w", compensated, sent, 0)])
    try:
        reduced = comm.launch(encoded, buffer, channels).wait()
    finally:
        channels.shutdown()
    memory = ResidualMemory()
    ErrorFeedback(memory).commit(encoded.updates, reduced.applied)
    return compensated, sent, reduced.applied, reduced.sparse.dense(), memory.residual("w").clone(), comm.state_dict()


@pytest.mark.parametrize("world", [2, 3])
def test_oktopk_residual_keeps_everything_not_applied(pools, world):
    numel, k = 4000, 40
    results = pools[world].run(run_oktopk_residual, numel, k, 5)
    applied0, update0 = results[0][2], results[0][3]
    inputs = [(c[s] / world, s) for c, s, *_ in results]
    support, _ = topk_of_sum(inputs, numel, k)
    assert torch.equal(applied0, support)
    for compensated, sent, applied, update, residual, state in results:
        assert torch.equal(applied, applied0) and torch.equal(update, update0)
        zeroed = sent[torch.isin(sent, applied)]
        kept = torch.ones(numel, dtype=torch.bool)
        kept[zeroed] = False
        assert torch.equal(residual[kept], compensated[kept])  # sent but not applied: still owed
        assert torch.all(residual[zeroed] == 0)
        assert 0 < zeroed.numel() < sent.numel()  # the test covers both cases
        assert state["buffers"]["0:4000"]["rounds"] == 1
    restored = OkTopkCommunicator()
    restored.load_state_dict(results[0][5])
    again = restored.state_for("0:4000")
    assert again.rounds == 1 and again.threshold == results[0][5]["buffers"]["0:4000"]["threshold"]
    assert torch.equal(again.boundaries, results[0][5]["buffers"]["0:4000"]["boundaries"])


# ----------------------------------------------------------------------------- allgather with a known bound
def run_bounded_allgather(inputs, numel, max_count, equal_counts):
    values, indices = inputs[dist.get_rank()]
    traffic = Traffic()
    total = SPARSE_SCHEMES.get("allgather")(values, indices, numel, None, traffic, equal_counts, max_count)
    return sparse_view(total), traffic


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    world=st.sampled_from([2, 3, 4]),
    numel=st.integers(1, 50_000),
    k=st.integers(1, 300),
    slack=st.integers(0, 50),
    seed=st.integers(0, 2**31 - 1),
)
def test_allgather_with_count_bound_skips_the_count_exchange(pools, world, numel, k, slack, seed):
    """max_count bounds every rank's count: exact sums with no count round (no 8-byte messages),
    payload bytes as without the bound, the wire padded to the bound plus one count header (the
    positions padded to 8 bytes so the values stay aligned)."""
    inputs = make_inputs(world, "random", numel, k, torch.int64, torch.float32, {world - 1}, seed)
    bound = max(v.numel() for v, _ in inputs) + slack
    expected_nz, expected_vals = sparse_view(dense_sum(inputs, numel).to(torch.float32))
    counts = [v.numel() for v, _ in inputs]
    for rank, ((nz, vals), traffic) in enumerate(pools[world].run(run_bounded_allgather, inputs, numel, bound, False)):
        assert torch.equal(nz, expected_nz) and torch.equal(vals, expected_vals)
        small = (world - 1) * 8
        sent, received = allgather_bytes(inputs, rank, 4, numel, bound)
        assert (traffic.sent, traffic.received) == (sent - small, received - small)
        if compact(numel, bound):  # the count and the block counts, then 2-byte offsets
            positions = math.ceil((4 * (1 + -(-numel // 2**16)) + 2 * bound) / 8) * 8
        else:
            positions = math.ceil((bound + 1) * X / 8) * 8
        wire = (world - 1) * (positions + bound * 4)
        assert (traffic.padded_sent, traffic.padded_received) == (wire, wire)
    assert counts[world - 1] == 0  # an empty rank still takes part


def test_allgather_equal_counts_and_a_violated_bound(pools):
    inputs = make_inputs(3, "random", 1000, 10, torch.int64, torch.float32, set(), 5)
    expected = sparse_view(dense_sum(inputs, 1000).to(torch.float32))
    for (nz, vals), traffic in pools[3].run(run_bounded_allgather, inputs, 1000, None, True):
        assert torch.equal(nz, expected[0]) and torch.equal(vals, expected[1])
        assert traffic.sent == 2 * (10 * 4 + 4 + 10 * 2)  # compact: one block count, 2-byte offsets
    with pytest.raises(Exception, match="exceed the announced bound max_count=9"):
        pools[3].run(run_bounded_allgather, inputs, 1000, 9, False)


def run_block_edges(numel, positions_of_rank):
    rank = dist.get_rank()
    indices = torch.tensor(positions_of_rank[rank], dtype=torch.int64)
    values = indices.to(torch.float32) + 1 + rank
    traffic = Traffic()
    total = SPARSE_SCHEMES.get("allgather")(values, indices, numel, None, traffic)
    return sparse_view(total), traffic.sent


def test_compact_positions_at_block_edges(pools):
    """Offsets at both ends of the int16 range, empty blocks, the last element, unsorted input and
    a rank with nothing selected: the sums are exact, and the bytes are one block count per block
    and 2 bytes per position."""
    numel = 3 * 2**16 + 5
    edges = [0, 32767, 32768, 65535, 65536, 3 * 2**16 + 4]
    positions_of_rank = [edges[::-1] + list(range(200, 100, -5)), [65535, 65536, 131071, 9], []]
    assert compact(numel, len(positions_of_rank[0]))
    expected = torch.zeros(numel, dtype=torch.float64)
    for rank, positions in enumerate(positions_of_rank):
        for position in positions:
            expected[position] += position + 1 + rank
    expected_nz, expected_vals = sparse_view(expected.to(torch.float32))
    for rank, ((nz, vals), sent) in enumerate(pools[3].run(run_block_edges, numel, positions_of_rank)):
        assert torch.equal(nz, expected_nz) and torch.equal(vals, expected_vals)
        count = len(positions_of_rank[rank])
        assert sent == 2 * 8 + 2 * (count * 4 + 4 * 4 + 2 * count)  # count round, then 4 blocks


def test_compact_positions_where_the_block_counts_cost_less():
    from ssfusion_lightning.commcost import compact_positions, gathered_position_bytes

    # one block: 4 B of count against 2 B saved per pair
    assert not compact_positions(2**16, 2) and compact_positions(2**16, 3)
    # 160 blocks (10.5M elements) pay 640 B: compact from 321 pairs (0.003% density) on
    assert not compact_positions(160 * 2**16, 320) and compact_positions(160 * 2**16, 321)
    assert gathered_position_bytes(160 * 2**16, 1000) == 640 + 2000
    assert gathered_position_bytes(160 * 2**16, 100) == 400
    # a message padded to more slots than its count is laid out for the slots
    assert gathered_position_bytes(2**16, 1, slots=100) == 4 + 2


# ----------------------------------------------------------------------------- rounds (issue 14, item 4)
CALLS = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_to_all_single", "broadcast", "isend", "irecv", "send", "recv")


class CountedCalls:
    """Records, on this rank, every torch.distributed call in CALLS made inside the ``with``."""

    def __enter__(self):
        self.names, self._originals = [], {name: getattr(dist, name) for name in CALLS}
        for name, original in self._originals.items():
            setattr(dist, name, self._wrap(name, original))
        return self

    def _wrap(self, name, original):
        def counted(*args, **kwargs):
            self.names.append(name)
            return original(*args, **kwargs)

        return counted

    def __exit__(self, *exc):
        for name, original in self._originals.items():
            setattr(dist, name, original)


def run_votes(inputs, numel, flags, scheme, max_count):
    """The scheme without and with votes: (sum, calls, votes) of each."""
    from ssfusion_lightning.comm.collectives import AllreduceCommunicator, allreduce_shared_positions

    rank, world = dist.get_rank(), dist.get_world_size()
    values, indices = inputs[rank]
    out = []
    for carry in (False, True):
        votes = torch.zeros(world, dtype=torch.uint8)
        votes[rank] = flags[rank]
        with CountedCalls() as calls:
            if scheme == "shared_positions":
                total = allreduce_shared_positions(values, indices, numel, votes if carry else None, None)[0]
            elif scheme == "allreduce":
                job = AllreduceCommunicator()._sparse_job
                total = job(values, indices, numel, False, max_count, votes if carry else None, None)[0]
            else:
                scheme_fn = SPARSE_SCHEMES.get(scheme)
                total = scheme_fn(values, indices, numel, None, Traffic(), False, max_count, votes if carry else None)
        out.append((total, calls.names, votes))
    return out


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize(
    "scheme, bounded",
    [("allgather", False), ("allgather", True), ("zen", False), ("sparcml", False), ("sparcml", True),
     ("shared_positions", False), ("allreduce", False)],
)  # fmt: skip
def test_votes_ride_in_every_scheme_without_a_round(pools, world, scheme, bounded):
    """The non-finite vote rides in a message the scheme sends anyway: every rank gets every
    rank's flag, the sums are bitwise those without votes, and not one call is added."""
    numel, k = 5000, 60
    if scheme == "shared_positions":  # every rank selected the same positions
        inputs = make_inputs(world, "identical", numel, k, torch.int64, torch.float32, set(), 3)
    else:
        inputs = make_inputs(world, "random", numel, k, torch.int64, torch.float32, {world - 1}, 3)
    for flags in ([0] * world, [1] + [0] * (world - 1), [r % 2 for r in range(world)], [1] * world):
        results = pools[world].run(run_votes, inputs, numel, flags, scheme, k if bounded else None)
        expected = dense_sum(inputs, numel).to(torch.float32)
        for (plain, plain_calls, own), (voted, voted_calls, votes) in results:
            assert torch.equal(voted, plain) and torch.equal(plain, expected)
            assert voted_calls == plain_calls, (plain_calls, voted_calls)
            assert votes.tolist() == flags
            assert int(own.sum()) <= 1  # without votes, the vector is left as it was


def run_oktopk_votes(inputs, numel, k, rounds, flags):
    rank, world = dist.get_rank(), dist.get_world_size()
    out = []
    for carry in (False, True):
        state, rows = OkTopkState(), []
        for step in range(rounds):
            values, indices = inputs[step][rank]
            votes = torch.zeros(world, dtype=torch.uint8)
            votes[rank] = flags[rank]
            with CountedCalls() as calls:
                total, applied = oktopk_reduce(
                    values, indices, numel, k, None, Traffic(), state, threshold_every=3, votes=votes if carry else None
                )
            rows.append((total, applied, calls.names, votes.tolist()))
        out.append(rows)
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_votes_ride_in_oktopk_counts(pools, world):
    numel, k, rounds = 20_000, 200, 4
    inputs = [make_inputs(world, "random", numel, k, torch.int64, torch.float32, set(), 70 + s, False) for s in range(rounds)]
    flags = [0] * (world - 1) + [1]
    for plain, voted in pools[world].run(run_oktopk_votes, inputs, numel, k, rounds, flags):
        for (t0, a0, c0, _), (t1, a1, c1, v1) in zip(plain, voted):
            assert torch.equal(t0, t1) and torch.equal(a0, a1) and c0 == c1
            assert v1 == flags


def run_sparcml_bounded(inputs, numel, bound):
    rank = dist.get_rank()
    values, indices = inputs[rank]
    out = []
    for max_count in (None, bound):
        traffic = Traffic()
        with CountedCalls() as calls:
            total = SPARSE_SCHEMES.get("sparcml")(values, indices, numel, None, traffic, False, max_count)
        out.append((total, len(calls.names), traffic))
    return out


@pytest.mark.parametrize("world, saved", [(2, [2, 2]), (3, [2, 1, 1]), (4, [2, 2, 2, 2])])
@pytest.mark.parametrize("value_dtype", [torch.float32, torch.bfloat16])
def test_sparcml_sends_a_bounded_selection_with_its_header(pools, world, saved, value_dtype):
    """With max_count, a rank's own selection (the fold, the first doubling round) goes in one
    message padded to the bound, its header in front: bitwise the same sums and payload bytes,
    one isend or irecv fewer per such message (P=3: rank 1 folds into rank 0, rank 2 sends its own
    selection to rank 0 in the first round, rank 0's merged set needs its header)."""
    numel, k = 3000, 50
    inputs = make_inputs(world, "random", numel, k, torch.int64, value_dtype, set(), 9)
    inputs[0] = (inputs[0][0][:-7], inputs[0][1][:-7])  # a count below the bound: padded
    reference = dense_sum(inputs, numel).to(value_dtype)
    vbytes = torch.tensor([], dtype=value_dtype).element_size()
    for rank, ((plain, plain_calls, plain_traffic), (bounded, calls, traffic)) in enumerate(
        pools[world].run(run_sparcml_bounded, inputs, numel, k)
    ):
        assert torch.equal(bounded, plain) and torch.equal(sparse_view(plain)[0], sparse_view(reference)[0])
        assert plain_calls - calls == saved[rank]
        assert (traffic.sent, traffic.received) == (plain_traffic.sent, plain_traffic.received)
        assert (traffic.sent, traffic.received) == sparcml_bytes(inputs, rank, vbytes, 4)
        assert traffic.padded_sent >= traffic.sent


def test_sparcml_refuses_a_violated_bound(pools):
    inputs = make_inputs(2, "random", 1000, 10, torch.int64, torch.float32, set(), 5)
    with pytest.raises(Exception, match="with max_count=9, 10 selected elements"):
        pools[2].run(run_sparcml_bounded, inputs, 1000, 9)


def run_oktopk_kept_counts(inputs, numel, k, rounds, merged):
    """Ok-Topk rounds; ``merged=False`` drops the grid's per-rank counts, so the kept counts take
    their own all-gather (the code before the merge)."""
    import ssfusion_lightning.comm.oktopk as oktopk

    original = oktopk.reuse_threshold
    if not merged:
        oktopk.reuse_threshold = lambda *args: original(*args)[:2] + (None,)
    rank, state, rows = dist.get_rank(), OkTopkState(), []
    try:
        for step in range(rounds):
            values, indices = inputs[step][rank]
            reused = not (state.exact_next or state.rounds % 4 == 0)
            with CountedCalls() as calls:
                total, applied = oktopk_reduce(values, indices, numel, k, None, Traffic(), state, threshold_every=4)
            rows.append((total, applied, state.threshold, calls.names, reused))
    finally:
        oktopk.reuse_threshold = original
    return rows


@pytest.mark.parametrize("world", [2, 3, 4])
def test_oktopk_reused_threshold_round_carries_the_kept_counts(pools, world):
    """A reused threshold is a grid edge, so the grid's counts, all-gathered per rank, are the
    owners' kept counts: the same outputs on every rank as with their own all-gather, one
    all-gather fewer per reuse round, and what is applied is exactly |sum| >= threshold."""
    numel, k, rounds = 30_000, 300, 6
    inputs = [make_inputs(world, "random", numel, k, torch.int64, torch.float32, set(), 90 + s) for s in range(rounds)]
    before = pools[world].run(run_oktopk_kept_counts, inputs, numel, k, rounds, False)
    after = pools[world].run(run_oktopk_kept_counts, inputs, numel, k, rounds, True)
    for step in range(rounds):
        total0, applied0, thr0, _, _ = after[0][step]
        reference = dense_sum(inputs[step], numel).to(torch.float32)  # integer values: exact
        assert thr0 > 0 and torch.equal(applied0, torch.nonzero(reference.abs() >= thr0).view(-1))
        for (t_old, a_old, thr_old, calls_old, _), (t_new, a_new, thr_new, calls_new, reused) in zip(
            (r[step] for r in before), (r[step] for r in after)
        ):
            assert torch.equal(t_new, total0) and torch.equal(a_new, applied0) and thr_new == thr0
            assert torch.equal(t_new, t_old) and torch.equal(a_new, a_old) and thr_new == thr_old
            assert len(calls_old) - len(calls_new) == (1 if reused else 0)
            assert calls_old.count("all_gather") - calls_new.count("all_gather") == (1 if reused else 0)
    assert sum(row[4] for row in after[0]) >= rounds // 2  # most rounds reuse the threshold


@settings(max_examples=40, deadline=None)
@given(
    magnitudes=st.lists(st.sampled_from([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, math.inf, math.nan]), max_size=40),
    edges=st.lists(st.sampled_from([0.0, 0.25, 1.0, 1.5, 2.5, math.inf, math.nan]), min_size=1, max_size=8),
    dtype=st.sampled_from([torch.float32, torch.float64]),
)
def test_count_at_least_is_the_kept_count(magnitudes, edges, dtype):
    """What the balance step trusts: the grid counts equal ``(magnitude >= edge).sum()``, NaN and
    infinities included (a NaN is never kept, a NaN edge keeps nothing)."""
    from ssfusion_lightning.comm.oktopk import count_at_least

    m, e = torch.tensor(magnitudes, dtype=dtype), torch.tensor(edges, dtype=dtype)
    expected = [int((m >= float(edge)).sum()) for edge in e]
    assert count_at_least(m, e).tolist() == expected


@settings(max_examples=60, deadline=None)
@given(
    size=st.integers(1, 300),
    pairs=st.integers(0, 400),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    seed=st.integers(0, 2**16),
)
def test_owner_sums_are_the_dense_accumulators_bits(size, pairs, dtype, seed):
    """ZEN's owner sums only the slots it received, yet gets the same bits a partition-sized
    accumulator gets, exact zeros (cancellations) dropped as ``nonzero`` drops them."""
    g = torch.Generator().manual_seed(seed)
    slots = torch.randint(0, size, (pairs,), generator=g)
    # small integers cancel to exact zeros; normals make the order of the additions matter
    small = torch.randint(-2, 3, (pairs,), generator=g).to(dtype)
    values = torch.where(torch.rand(pairs, generator=g) < 0.5, small, torch.randn(pairs, generator=g).to(dtype))
    acc = torch.float32
    dense = torch.zeros(size, dtype=acc).index_add_(0, slots, values.to(acc))
    where, sums = owner_sums(slots, values, acc)
    expected = torch.nonzero(dense).view(-1)
    assert torch.equal(where, expected)
    assert torch.equal(sums, dense[expected])


@settings(max_examples=60, deadline=None)
@given(numel=st.integers(1, 200), ranks=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_a_sparse_sum_decodes_in_order_and_counts_its_support(numel, ranks, seed):
    """A SparseSum adds its pieces in order in the accumulation dtype and casts once (bf16 pieces
    summed in fp32); its nonzero count, taken without decoding, is the dense sum's wherever no
    position cancels to exactly zero."""
    g = torch.Generator().manual_seed(seed)
    pieces = []
    for _ in range(ranks):
        where = torch.randperm(numel, generator=g)[: int(torch.randint(0, numel + 1, (1,), generator=g))]
        pieces.append((where, torch.randn(where.numel(), generator=g).to(torch.bfloat16)))
    expected = torch.zeros(numel)
    for where, values in pieces:
        expected.index_add_(0, where, values.float())
    total = SparseSum(numel, torch.bfloat16, pieces).dense()
    assert total.dtype == torch.bfloat16 and torch.equal(total, expected.to(torch.bfloat16))
    touched = torch.zeros(numel, dtype=torch.bool)
    for where, values in pieces:
        touched[where[values != 0]] = True
    assert SparseSum(numel, torch.bfloat16, pieces).count_nonzero() == int(touched.sum())
    if not bool(((expected == 0) & touched).any()):
        assert SparseSum(numel, torch.bfloat16, pieces).count_nonzero() == int(torch.count_nonzero(expected))


# --------------------------------------------------------------------------- a small dense part riding in the allgather
def run_riding(inputs, numel, dense_numel, max_count):
    """One buffer's parts through a 2-channel hybrid communicator: (dense sum, sparse sum, calls,
    whether it rode) for the plan's k = max_count."""
    from ssfusion_lightning.comm import COMMUNICATORS, ChannelSet
    from ssfusion_lightning.vocabulary import Buffer, Encoded, Slot

    rank = dist.get_rank()
    values, indices = inputs[rank]
    dense = torch.arange(dense_numel, dtype=torch.float32) * (rank + 1)
    slots = (Slot("d", 0, (dense_numel,), 0, dense_numel, False, dense_numel), Slot("s", 1, (numel,), 0, numel, True, max_count))
    buffer = Buffer(0, slots, 0)
    groups = [dist.new_group(backend="gloo") for _ in range(2)]
    channels = ChannelSet(groups, torch.device("cpu"))
    communicator = COMMUNICATORS.build("hybrid")
    encoded = Encoded(dense.clone(), values, indices.to(torch.int64), max_count=max_count)
    rides = communicator._dense_rides(encoded, buffer)
    with CountedCalls() as calls:
        reduced = communicator.launch(encoded, buffer, channels).wait()
    channels.shutdown()
    for group in groups:
        dist.destroy_process_group(group)
    sparse = reduced.sparse.dense() if isinstance(reduced.sparse, SparseSum) else reduced.sparse
    return reduced.dense, sparse, sorted(calls.names), rides


@pytest.mark.parametrize("world", [2, 3])
def test_a_small_dense_part_rides_in_the_allgather_and_sums_exactly(pools, world):
    numel, k = 5000, 60
    inputs = make_inputs(world, "random", numel, k, torch.int64, torch.float32, set(), 5)
    expected_sparse = dense_sum(inputs, numel).to(torch.float32)
    # F v <= k v + X: 91 dense values (364 B) ride with 60 pairs (240 B of values, positions
    # compact: 4 B of block count and 120 B of offsets); 92 do not
    for dense_numel, rides in ((91, True), (92, False)):
        expected_dense = torch.arange(dense_numel, dtype=torch.float32) * sum(range(1, world + 1))
        results = pools[world].run(run_riding, inputs, numel, dense_numel, k)
        for dense, sparse, calls, rode in results:
            assert rode == rides
            assert torch.equal(dense, expected_dense) and torch.equal(sparse, expected_sparse)
            # one collective for the whole buffer, or the all-reduce beside it
            assert calls == (["all_gather"] if rides else ["all_gather", "all_reduce"]), calls
        assert all(torch.equal(r[0], results[0][0]) for r in results)


def test_dense_rides_at_hand_computed_points():
    from ssfusion_lightning.commcost import (
        BufferShape,
        Link,
        Links,
        buffer_seconds,
        dense_rides,
        dense_seconds,
        sparse_seconds,
    )

    # 60 pairs of 5,000 elements gather 60 * 4 + 4 + 60 * 2 = 364 B (compact positions)
    assert dense_rides(BufferShape(91, 5000, 60)) and not dense_rides(BufferShape(92, 5000, 60))
    assert not dense_rides(BufferShape(0, 5000, 60))
    # 4 ranks, alpha 3 ms / 10 ms, 0.2 us/B: riding gathers 3 (364 + 91 * 4) = 2,184 B in one
    # allgather: 3 ms + 0.437 ms; apart, the all-reduce of 368 B adds 10 ms + 0.110 ms
    links = Links(4, Link(10e-3, 0.2e-6), Link(3e-3, 0.2e-6), Link(3e-3, 0.2e-6), Link(1e-3, 0.2e-6))
    assert buffer_seconds("allgather", BufferShape(91, 5000, 60), links) == pytest.approx(3e-3 + 2184 * 0.2e-6)
    apart = BufferShape(92, 5000, 60)
    assert buffer_seconds("allgather", apart, links) == pytest.approx(
        dense_seconds(92, 4, links) + sparse_seconds("allgather", apart, links)
    )
