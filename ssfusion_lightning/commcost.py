"""Modelled seconds of one buffer's communication under each collective scheme.

The one place these formulas live: the ``auto`` communicator decides per buffer from them, ZEN's
choice against SparCML compares two of them, and experiments/simulate.py projects step times to
large P with them. Pure Python (no torch), so every rank computes bit-identical numbers from
identical inputs, and the simulator imports it without starting torch.

Model (ALGORITHMS.md section 7), per rank: a collective costs ``alpha + beta * bytes`` with the
bytes one rank receives, and the alpha-beta pair of its kind (``Links``). A buffer has F dense
elements and N sparse ones, of which each rank selects k; v bytes per value, x per position. K,
the nonzeros of the sum, measures how much the ranks' selections overlap (``expected_nonzeros``).

    dense part (every scheme)  allreduce: 2(P-1)/P * F v
    allreduce                  the sparse part scattered and all-reduced with the dense part, in
                               one all-reduce: 2(P-1)/P * (F + N) v
    allgather                  allgather: (P-1) (k v + X), X the k positions: 4 ceil(N/2^16)
                               + 2k (a count per 2^16-element block, 16-bit offsets) where that
                               is less than k x, else k x; a dense part with F v <= k v + X rides
                               in the same message, (P-1) (k v + X + F v), with no all-reduce
    zen                        all_to_all of counts and of (P-1)/P k (v+x) pairs, allgather of
                               counts and of (P-1)/P min(N/8 + K v, K (v+x)) (bitmap or COO pull)
    sparcml                    recursive doubling: 2 point-to-point messages per round, the set
                               after r rounds the union of 2^r selections (as overlapping as K
                               says); a fold when P != 2^q
    oktopk                     as comm/oktopk.py runs a round: all_to_all of counts and of
                               (P-1)/P k (v+x) pairs, two allgathers of the threshold grid's
                               counts (coarse, then fine), the balance all_to_all (what crosses a
                               slice boundary: about a third of (P-1)/P C (v+x)) and the allgather
                               of the C kept entries (C about 1.1 k); every ``threshold_every``
                               rounds the exact threshold's three allgathers (sizes, local top
                               magnitudes, kept counts) replace the grid's two, every 64 an
                               all-reduce re-cuts the regions. About 2.47 (P-1)/P k (v+x) in all,
                               within the 3(P-1)/P k (v+x) bound of ALGORITHMS.md section 7
    hierarchical:<cross>       on nodes of L ranks, the sparse part's node step (values in v' =
                               fp32 at least) dense: 2(L-1)/L N v', or sparse: (L-1) k (v'+x) +
                               (L-1)/L K (v'+x), whichever moves fewer bytes; then <cross> on the
                               stripe's nonzeros across nodes (``hierarchical_seconds``); the
                               sparse step's positions travel as the allgather's (X above)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Sequence

#: every scheme ``auto`` chooses among, in tie-break order (the simpler scheme wins a tie)
SCHEMES = ("allreduce", "allgather", "zen", "sparcml", "oktopk")
#: schemes whose sum is exact (Ok-Topk keeps about k entries of the sum)
EXACT_SCHEMES = ("allreduce", "allgather", "zen", "sparcml")
#: "hierarchical:<scheme>": the hierarchical sync with <scheme> as its cross-node step
HIERARCHICAL = "hierarchical:"
#: how the hierarchical sync's sparse part meets inside the node: "dense" reduce-scatters and
#: all-gathers the whole part, "sparse" all-gathers the selections and the summed stripes' nonzeros,
#: "relay" all-gathers the pairs the cross-node step gathered
NODE_STEPS = ("dense", "sparse", "relay")
#: the node step that forms no sums (cross allgather only): each rank's pairs cross the nodes on its
#: cross-node group, then the node all-gathers what its ranks received
RELAY = "relay"
#: "hierarchical:relay": cross allgather under the relay node step (the others leave the node step
#: to ``choose_node_step``)
RELAY_SCHEME = HIERARCHICAL + RELAY
HIERARCHICAL_SCHEMES = (*(HIERARCHICAL + scheme for scheme in SCHEMES), RELAY_SCHEME)
#: counts and message headers travel as int64
COUNT_BYTES = 8
#: positions travel as int32 in any buffer of fewer than 2**31 elements (comm/schemes.py's
#: ``wire_index_dtype``; ``index_bytes`` there gives 8 for a larger tensor)
POSITION_BYTES = 4
#: an allgather message may send its positions compactly (``compact_positions``): one int32 count
#: per block of 2**16 elements of the part, then each position as its 16-bit offset in its block
BLOCK_ELEMENTS = 1 << 16
BLOCK_COUNT_BYTES = 4
BLOCK_OFFSET_BYTES = 2
#: Ok-Topk's reused-threshold grid (see comm/oktopk.py): one count per grid step and rank, all-gathered
#: once for the coarse grid and once more for the fine grid inside its chosen step
OKTOPK_GRID = 24
OKTOPK_GRID_GATHERS = 2
OKTOPK_THRESHOLD_EVERY = 32
OKTOPK_REBALANCE_EVERY = 64
#: Ok-Topk's global kept count C over k in a round with a reused threshold: the largest grid step that
#: still keeps k, so C >= k, and sums of one rank's entries pile up just above the ranks' local
#: thresholds. experiments/oktopk_rounds.py measured a mean of 1.09-1.10 over 40 rounds of the e2e
#: benchmark's resnet18 and gpt2 at P = 2 and 4 (an exact threshold keeps k)
OKTOPK_KEPT = 1.1
#: what Ok-Topk's balance all_to_all moves, as a share of the kept entries' (P-1)/P C (v+x): those
#: that cross a slice boundary. The regions are cut to balance the ranks' selections, not the kept
#: top-k of the sum, so it depends on the gradients: experiments/oktopk_rounds.py measured 0.37-0.46
#: at P = 2 and 0.24 at P = 4 on the e2e benchmark's resnet18 and gpt2, 0 for uniformly spread
#: positions; 1 is its bound
OKTOPK_BALANCE_SHARE = 1 / 3
#: below this fraction of N, a difference of expected nonzeros is float rounding, not overlap
ROUNDING = 1e-9


@dataclass(frozen=True)
class Link:
    """alpha-beta model of one collective: seconds = alpha + beta * bytes (bytes per rank)."""

    alpha: float
    beta: float

    def seconds(self, nbytes: float) -> float:
        return self.alpha + self.beta * nbytes if nbytes > 0 else 0.0

    def message(self, nbytes: float) -> float:
        """A message that is sent whatever its size (a count, a header): it always pays alpha."""
        return self.alpha + self.beta * max(nbytes, 0.0)


@dataclass(frozen=True)
class Links:
    """alpha-beta per collective kind on a group of ``world`` ranks."""

    world: int
    allreduce: Link
    allgather: Link
    alltoall: Link
    p2p: Link

    @classmethod
    def measured(cls, world: int, allreduce: Link, allgather: Link) -> Links:
        """From the two collectives the cost model times. all_to_all moves its bytes over the same
        P-1 peers as a ring allgather, so it gets the allgather's link; one point-to-point message
        pays the allgather's latency per peer, alpha / (P-1), and its beta."""
        peers = max(1, world - 1)
        return cls(world, allreduce, allgather, allgather, Link(allgather.alpha / peers, allgather.beta))

    @classmethod
    def uniform(cls, world: int, link: Link) -> Links:
        """Every collective and every message on one link (ZEN's own model of its choice)."""
        return cls(world, link, link, link, link)

    @classmethod
    def from_round_latency(cls, world: int, alpha: float, bytes_per_second: float) -> Links:
        """Ring collectives over one link with per-round latency ``alpha``: an all-reduce takes
        2(P-1) rounds, an allgather or all_to_all P-1, a message one (the simulator's model)."""
        beta = 1.0 / bytes_per_second
        peers = max(0, world - 1)
        return cls(world, Link(2 * peers * alpha, beta), Link(peers * alpha, beta), Link(peers * alpha, beta), Link(alpha, beta))


@dataclass(frozen=True)
class BufferShape:
    """What the model knows about one buffer: F dense elements, N sparse ones, k selected per rank."""

    dense: int
    sparse: int
    k: int
    value_bytes: int = 4
    index_bytes: int = POSITION_BYTES

    @property
    def pair(self) -> int:
        return self.value_bytes + self.index_bytes

    def gathered(self, k: float | None = None) -> float:
        """Bytes of one rank's ``k`` pairs (default: the plan's k) in an allgather message."""
        k = self.k if k is None else k
        return k * self.value_bytes + gathered_position_bytes(self.sparse, k, index_bytes=self.index_bytes)


def position_blocks(numel: float) -> int:
    """Blocks of ``BLOCK_ELEMENTS`` a part of ``numel`` elements spans."""
    return math.ceil(numel / BLOCK_ELEMENTS)


def compact_positions(numel: float, slots: float, index_bytes: int = POSITION_BYTES) -> bool:
    """Whether an allgather message of ``slots`` pairs from a part of ``numel`` elements sends its
    positions as block counts and 16-bit offsets: where those take fewer bytes than ``slots``
    positions of ``index_bytes`` each (int32: where k > 2 ceil(N / 2^16), above about 0.003%
    density; below it the block counts cost more than the offsets save). From the plan's numbers alone, so
    every rank decides alike."""
    return position_blocks(numel) * BLOCK_COUNT_BYTES + BLOCK_OFFSET_BYTES * slots < index_bytes * slots


def gathered_position_bytes(numel: float, count: float, slots: float | None = None, index_bytes: int = POSITION_BYTES) -> float:
    """Bytes of ``count`` positions in an allgather message planned for ``slots`` pairs (default:
    ``count``), in the form ``compact_positions`` picks for ``slots``."""
    if compact_positions(numel, count if slots is None else slots, index_bytes):
        return position_blocks(numel) * BLOCK_COUNT_BYTES + BLOCK_OFFSET_BYTES * count
    return index_bytes * count


def independent_nonzeros(numel: int, k: float, world: int) -> float:
    """Expected nonzeros of the sum of ``world`` independent uniform selections of k of ``numel``."""
    if numel <= 0:
        return 0.0
    k = min(max(k, 0.0), numel)
    return numel * (1.0 - (1.0 - k / numel) ** world)


def expected_nonzeros(numel: int, k: float, world: int, spread: float = 1.0) -> float:
    """K from the selections' spread: k when every rank selects the same positions (spread 0),
    independent selections' union at spread 1, linear in between."""
    k = min(max(k, 0.0), numel)
    return k + spread * (independent_nonzeros(numel, k, world) - k)


def measured_spread(samples: Sequence[tuple[int, int, float]], world: int) -> float | None:
    """The spread that explains the measured (numel, k, K) samples in total (clamped to [0, 1]);
    None when no sample can tell (a single rank, or k = numel everywhere)."""
    if world <= 1:
        return None
    gained = possible = 0.0
    for numel, k, nonzeros in samples:
        k = min(k, numel)
        gained += nonzeros - k
        possible += independent_nonzeros(numel, k, world) - k
    if possible <= ROUNDING * sum(numel for numel, _, _ in samples):
        return None
    return min(1.0, max(0.0, gained / possible))


def ring_allreduce_bytes(nbytes: float, world: int) -> float:
    """Bytes one rank sends (and receives) in a ring all-reduce of ``nbytes`` on ``world`` ranks:
    2(P-1)/P of them (a reduce-scatter, then an allgather). Exact for integer inputs up to 2**53."""
    return 2 * (world - 1) * nbytes / world if world > 1 else 0.0


def dense_rides(shape: BufferShape) -> bool:
    """Whether the allgather carries the buffer's dense part in its own message (summed by every
    rank in rank order) instead of an all-reduce of its own: where the dense part is no larger than
    the k pairs it would ride with, F v <= k v + X (``BufferShape.gathered``). Every rank then
    gathers at most twice the bytes and saves a collective's latency (on 4 ranks at 40 Mbit/s, an
    all-reduce's alpha measured 9.8 ms against 3.1 ms for the allgather's). From the plan alone,
    so every rank decides alike."""
    return 0 < shape.dense * shape.value_bytes <= shape.gathered()


def dense_seconds(numel: int, value_bytes: int, links: Links) -> float:
    """Ring all-reduce of ``numel`` elements."""
    return links.allreduce.seconds(ring_allreduce_bytes(numel * value_bytes, links.world))


def zen_seconds(shape: BufferShape, links: Links, nonzeros: float) -> float:
    p, n = links.world, shape.sparse
    share = (p - 1) / p
    pull = min(-(-n // 8) + nonzeros * shape.value_bytes, nonzeros * shape.pair)
    # the two count rounds carry almost nothing: their latency is what they cost
    latency = 2 * links.alltoall.alpha + 2 * links.allgather.alpha
    return latency + links.alltoall.beta * share * shape.k * shape.pair + links.allgather.beta * share * pull


def union_of(members: float, numel: int, k: float, world: int, nonzeros: float) -> float:
    """Expected union of ``members`` of the ranks' selections when all ``world`` of them sum to
    ``nonzeros`` entries: the spread that K implies, applied to ``members`` selections."""
    possible = independent_nonzeros(numel, k, world) - k
    spread = (nonzeros - k) / possible if possible > ROUNDING * numel else 1.0
    return min(float(numel), max(0.0, k + spread * (independent_nonzeros(numel, k, members) - k)))


def sparcml_seconds(shape: BufferShape, links: Links, nonzeros: float, bounded: bool = False) -> float:
    """Recursive doubling over P' = 2^floor(log2 P) ranks, each set the union of the selections it
    has absorbed (``union_of``); P > P' adds the fold and the send-back. ``bounded``: counts are
    bounded by k, so a rank's own selection travels with its header and the first doubling round
    (at P = P') and the fold take one message instead of two."""
    p, n, link = links.world, shape.sparse, links.p2p
    core = 1 << (p.bit_length() - 1)
    seconds, members = 0.0, p / core  # after the fold a core rank holds P/P' selections
    while members < p:
        first = members == p / core
        union = union_of(members, n, shape.k, p, nonzeros)
        seconds += (1 if bounded and first and core == p else 2) * link.alpha + link.beta * union * shape.pair
        members *= 2
    if core != p:
        seconds += (3 if bounded else 4) * link.alpha + link.beta * (shape.k + nonzeros) * shape.pair
    return seconds


def oktopk_collectives(
    shape: BufferShape,
    world: int,
    nonzeros: float,
    exact: bool = False,
    recut: bool = False,
    kept: float | None = None,
) -> list[tuple[str, float]]:
    """The collectives of one round of comm/oktopk.py's ``oktopk_reduce`` in the order it issues
    them, each as (the ``Links`` field whose link it pays, the bytes one rank receives): a round
    with an ``exact`` threshold or a reused one, with or without the regions' ``recut``, keeping
    ``kept`` entries of the sum (default: k on an exact round, else its expectation)."""
    p = world
    if kept is None:
        kept = shape.k if exact else OKTOPK_KEPT * shape.k
    share = (p - 1) / p
    counts = (p - 1) * COUNT_BYTES
    collectives = [("allreduce", ring_allreduce_bytes(counts, p))] if recut else []
    # region counts (the non-finite vote rides in them), then split and reduce
    collectives += [("alltoall", counts), ("alltoall", share * shape.k * shape.pair)]
    if exact:  # the owners' sizes, their local top magnitudes (about K / P each, summed in fp32 at
        # least), then their kept counts, which a reused threshold's grid already holds
        tops = (p - 1) * min(shape.k, nonzeros / p) * max(shape.value_bytes, 4)
        collectives += [("allgather", counts), ("allgather", tops), ("allgather", counts)]
    else:
        collectives += [("allgather", (p - 1) * OKTOPK_GRID * COUNT_BYTES)] * OKTOPK_GRID_GATHERS
    # the balance (what crosses a slice boundary), then the kept entries
    gathered = share * kept * shape.pair
    return collectives + [("alltoall", OKTOPK_BALANCE_SHARE * gathered), ("allgather", gathered)]


def oktopk_seconds(
    shape: BufferShape,
    links: Links,
    nonzeros: float,
    threshold_every: int = OKTOPK_THRESHOLD_EVERY,
    rebalance_every: int = OKTOPK_REBALANCE_EVERY,
) -> float:
    """A mean round of ``oktopk_collectives``: one in ``threshold_every`` has an exact threshold,
    one in ``rebalance_every`` re-cuts the regions."""

    def paid(exact: bool, recut: bool = False) -> float:
        collectives = oktopk_collectives(shape, links.world, nonzeros, exact, recut)
        return sum(getattr(links, kind).message(nbytes) for kind, nbytes in collectives)

    recut = paid(True, True) - paid(True)  # the regions' all-reduce
    return ((threshold_every - 1) * paid(False) + paid(True)) / threshold_every + recut / rebalance_every


def sparse_seconds(scheme: str, shape: BufferShape, links: Links, spread: float = 1.0, bounded: bool = False) -> float:
    """Modelled seconds of the buffer's sparse part under ``scheme`` (0 without a sparse part)."""
    p = links.world
    if shape.sparse <= 0 or p <= 1:
        return 0.0
    nonzeros = expected_nonzeros(shape.sparse, shape.k, p, spread)
    if scheme == "allreduce":
        return dense_seconds(shape.sparse, shape.value_bytes, links)
    if scheme == "allgather":
        return links.allgather.seconds((p - 1) * shape.gathered())
    if scheme == "zen":
        return zen_seconds(shape, links, nonzeros)
    if scheme == "sparcml":
        return sparcml_seconds(shape, links, nonzeros, bounded)
    if scheme == "oktopk":
        return oktopk_seconds(shape, links, nonzeros)
    raise ValueError(f"unknown scheme {scheme!r}; valid choices: {', '.join(SCHEMES)}")


def buffer_seconds(scheme: str, shape: BufferShape, links: Links, spread: float = 1.0) -> float:
    """The buffer's communication under ``scheme``: ``allreduce`` sends both parts in one
    all-reduce (as a DDP bucket); ``allgather`` carries a small dense part in its message
    (``dense_rides``); otherwise the dense part is all-reduced and the sparse part run through the
    scheme, one after the other (the two share the link even on different groups)."""
    if scheme == "allreduce":
        return dense_seconds(shape.dense + shape.sparse, shape.value_bytes, links)
    if scheme == "allgather" and shape.sparse > 0 and links.world > 1 and dense_rides(shape):
        return links.allgather.seconds((links.world - 1) * (shape.gathered() + shape.dense * shape.value_bytes))
    return dense_seconds(shape.dense, shape.value_bytes, links) + sparse_seconds(scheme, shape, links, spread)


def hierarchical_nonzeros(cross: str, shape: BufferShape, per_node: int, nodes: int, spread: float = 1.0) -> float:
    """Expected nonzeros of the sparse part's sum after the hierarchical sync's cross-node step:
    the union of every rank's selection for an exact ``cross``; for Ok-Topk, each of the
    ``per_node`` stripes keeps about its share of k (comm/hierarchical.py)."""
    union = expected_nonzeros(shape.sparse, shape.k, per_node * nodes, spread)
    if cross != "oktopk":
        return union
    return min(union, OKTOPK_KEPT * per_node * max(1, -(-shape.k // per_node)))


def node_step_collectives(
    step: str, cross: str, shape: BufferShape, per_node: int, nodes: int, spread: float = 1.0
) -> list[float]:
    """The node-link collectives of the hierarchical sync's sparse part under node ``step``, in
    the order comm/hierarchical.py issues them, each as the bytes one rank receives. Values travel
    in fp32 at least. ``dense``: reduce-scatter and all-gather of the whole part (and, for Ok-Topk,
    of a byte per element marking the applied positions). ``sparse``: allgather of every local
    rank's k pairs (the plan bounds the counts: no count round, as a flat allgather), then of the
    summed stripes' nonzeros, after a count round (for Ok-Topk, then of the applied positions).
    ``relay``: one allgather of the N pieces of k pairs each local rank received across nodes.
    The allgathers send positions as ``gathered_position_bytes`` says, the relay's as int32."""
    if step not in NODE_STEPS:
        raise ValueError(f"unknown node step {step!r}; valid choices: {', '.join(NODE_STEPS)}")
    if step == RELAY and cross != "allgather":
        raise ValueError(f"node step 'relay' needs cross 'allgather', got {cross!r}")
    if per_node <= 1 or shape.sparse <= 0:
        return []
    if step == RELAY:  # the N pieces of k pairs each local rank gathered across nodes, their counts ahead
        return [(per_node - 1) * (nodes * shape.k * shape.pair + nodes * shape.index_bytes)]
    acc = max(shape.value_bytes, 4)
    share = (per_node - 1) / per_node
    oktopk = cross == "oktopk"
    if step == "dense":
        return [share * shape.sparse * acc] * 2 + ([share * shape.sparse] if oktopk else [])
    counts = (per_node - 1) * COUNT_BYTES
    stripe = hierarchical_nonzeros(cross, shape, per_node, nodes, spread) / per_node

    summed = replace(shape, value_bytes=acc)  # allgathers over the whole part's positions
    collectives = [(per_node - 1) * summed.gathered(), counts, (per_node - 1) * summed.gathered(stripe)]
    return collectives + ([counts, (per_node - 1) * stripe * (shape.index_bytes + 1)] if oktopk else [])


def choose_node_step(cross: str, shape: BufferShape, per_node: int, nodes: int) -> str:
    """``sparse`` where its node-link bytes are fewer than the dense step's, else ``dense``. With
    fp32 values and int32 positions that is about where L k + K < N (K the sum's nonzeros): below
    about 20% density on 2 nodes of 2 ranks, nowhere once the P selections cover most of the part.
    Judged at independent selections, the most nonzeros a sum holds in expectation, so the choice
    depends on the plan (N, k, bytes per value) and the layout only: every rank of every node
    makes it alike, whatever it selected."""
    dense, sparse = (sum(node_step_collectives(step, cross, shape, per_node, nodes)) for step in ("dense", "sparse"))
    return "sparse" if sparse < dense else "dense"


def hierarchical_seconds(
    cross: str, shape: BufferShape, node: Links, across: Links, spread: float = 1.0, step: str | None = None
) -> float:
    """The hierarchical sync (comm/hierarchical.py) on ``across.world`` nodes of ``node.world``
    ranks: the dense part reduce-scattered and all-gathered inside the node (the allgather link's
    ring moves the same bytes) and its stripe all-reduced across nodes; the sparse part through the
    node step ``choose_node_step`` picks (as the code's default ``node="auto"`` does), every
    collective of it on the node's allgather link, and the sparse stripe's nonzeros (1/L of the
    node's union of L selections) through ``cross`` on the cross-node group. The L local ranks
    cross at once, each with its own stripe on its own NIC: one stripe's time. Sparse partial sums
    travel in fp32 at least. A stripe's nonzeros have no bound known in advance, so a cross-node
    allgather first agrees on the largest count (one more round). ``step``: a pinned node step
    (None: ``choose_node_step``'s); under ``relay`` every rank's k pairs cross on its own NIC,
    bounded by the plan, and the node gathers the N pieces each local rank received."""
    per_node, nodes = node.world, across.world
    acc = max(shape.value_bytes, 4)
    inside = 2 * node.allgather.seconds((per_node - 1) / per_node * shape.dense * shape.value_bytes)
    seconds = inside + dense_seconds(shape.dense / per_node, shape.value_bytes, across)
    if shape.sparse <= 0:
        return seconds
    step = step or choose_node_step(cross, shape, per_node, nodes)
    collectives = node_step_collectives(step, cross, shape, per_node, nodes, spread)
    if step == RELAY:
        seconds += sum(node.allgather.message(nbytes) for nbytes in collectives)
        return seconds + sparse_seconds("allgather", shape, across, spread)
    seconds += sum(node.allgather.message(nbytes) for nbytes in collectives)
    union = expected_nonzeros(shape.sparse, shape.k, per_node, spread)
    stripe = BufferShape(0, shape.sparse / per_node, union / per_node, acc, shape.index_bytes)
    seconds += buffer_seconds(cross, stripe, across, spread)
    if cross == "allgather" and nodes > 1:  # comm/schemes.py allgather_sum without max_count
        seconds += across.allgather.message((nodes - 1) * COUNT_BYTES)
    return seconds


def scheme_seconds(
    scheme: str, shape: BufferShape, links: Links, spread: float = 1.0, hierarchy: tuple[Links, Links] | None = None
) -> float:
    """``buffer_seconds`` for a flat scheme, ``hierarchical_seconds`` for "hierarchical:<cross>"
    and "hierarchical:relay" on ``hierarchy`` = (node-local links, cross-node links)."""
    if scheme.startswith(HIERARCHICAL):
        if hierarchy is None:
            raise ValueError(f"{scheme!r} needs the node-local and cross-node links")
        cross, step = hierarchical_parts(scheme)
        return hierarchical_seconds(cross, shape, *hierarchy, spread, step=step)
    return buffer_seconds(scheme, shape, links, spread)


def hierarchical_parts(scheme: str) -> tuple[str, str | None]:
    """(cross-node scheme, pinned node step or None) of a "hierarchical:..." scheme name."""
    name = scheme[len(HIERARCHICAL) :]
    if name == RELAY:
        return "allgather", RELAY
    if name not in SCHEMES:
        raise ValueError(f"unknown scheme {scheme!r}; valid choices: {', '.join(HIERARCHICAL_SCHEMES)}")
    return name, None


def choose_scheme(
    shape: BufferShape,
    links: Links,
    candidates: Sequence[str] = SCHEMES,
    spread: float = 1.0,
    hierarchy: tuple[Links, Links] | None = None,
) -> str:
    """The candidate with the least modelled time for the buffer; a tie goes to the earlier
    candidate. A pure function of its arguments: ranks holding the same agreed inputs agree.
    Hierarchical candidates need ``hierarchy`` (see ``scheme_seconds``)."""
    if not candidates:
        raise ValueError("choose_scheme needs at least one candidate scheme")
    best, best_seconds = candidates[0], math.inf
    for scheme in candidates:
        seconds = scheme_seconds(scheme, shape, links, spread, hierarchy)
        if seconds < best_seconds:
            best, best_seconds = scheme, seconds
    return best
