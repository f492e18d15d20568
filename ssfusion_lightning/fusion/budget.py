"""The plan's sparse tensors send, in all, the elements their density asks for.

Each sparse tensor sends k = max(1, floor(density * n)) elements (``sparsifiers.k_for``): a tensor
smaller than 1 / density still sends one, or error feedback would hold its gradient forever. On a
model with many small tensors that floor adds up: at density 0.1% the digits CNN's 51 sparse tensors
sent 0.116% of their elements and the byte-level LM's 28 sent 0.111% (experiments/REPORT.md, "The
plan sends the density it asks for"). ``within_budget`` takes that excess back from the tensors
that send more than one element, in proportion to what each sends above one, so that the plan's sparse
tensors send round(density * their elements) in all, and every tensor still sends at least one. A plan
at or under that budget is left as it is (the floors leave it under by less than one element a tensor).
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from ssfusion_lightning.sparsifiers import Sparsifier
from ssfusion_lightning.vocabulary import Plan, Slot


def within_budget(plan: Plan, sparsifier: Sparsifier) -> Plan:
    """``plan`` with its sparse tensors' k summing to at most max(their count, round(density * their
    elements)), at the sparsifier's density. Only tensors whose selection can send any k down to one
    element take part (not ADTopk's per-row counts of a matrix); among them the excess over that budget is taken
    from the tensors with k > 1 in proportion to k - 1 (largest remainders first, then plan order)."""
    adjustable = [
        (b, j)
        for b, buffer in enumerate(plan.buffers)
        for j, slot in enumerate(buffer.slots)
        if slot.sparse and sparsifier.output_count(torch.Size(slot.shape), 1) in (None, 1)
    ]
    slots = [plan.buffers[b].slots[j] for b, j in adjustable]
    ks = reduced_counts([slot.k for slot in slots], sum(slot.numel for slot in slots), sparsifier.density)
    if ks == [slot.k for slot in slots]:
        return plan
    new: dict[tuple[int, int], Slot] = {key: replace(slot, k=k) for key, slot, k in zip(adjustable, slots, ks)}
    buffers = tuple(
        replace(buffer, slots=tuple(new.get((b, j), slot) for j, slot in enumerate(buffer.slots)))
        for b, buffer in enumerate(plan.buffers)
    )
    return replace(plan, buffers=buffers)


def reduced_counts(ks: list[int], numel: int, density: float) -> list[int]:
    """``ks`` brought down to a total of max(len(ks), round(density * numel)) where they exceed it,
    each at least 1: the excess is shared in proportion to k - 1, by largest remainder."""
    budget = max(len(ks), round(density * numel))
    excess = sum(ks) - budget
    if excess <= 0:
        return list(ks)
    spare = [k - 1 for k in ks]
    total = sum(spare)
    shares = [excess * s / total for s in spare]
    cut = [math.floor(share) for share in shares]
    # the rest of the excess, one element each, from the largest remainders (plan order on ties)
    for i in sorted(range(len(ks)), key=lambda i: (cut[i] - shares[i], i))[: excess - sum(cut)]:
        cut[i] += 1
    return [k - c for k, c in zip(ks, cut)]
