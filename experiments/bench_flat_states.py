"""Micro-benchmark of momentum correction's many-tensor error feedback: DGC's forms as foreach calls
over a buffer's tensors against its flat states (``DGCMemory``: one flat tensor per state kind,
whose views are the stored states).

    python -m experiments.bench_flat_states                  # the digits CNN's slots
    python -m experiments.bench_flat_states --rounds 20      # smoke run

The digits CNN (resnet18 tiny on 8x8 grey images) sends its ``--dense`` smallest parameters dense
in the time-to-accuracy plan (43: 1410 elements) and selects from the other 19 (174,848
elements). Random gradients, one intra-op thread. Per round, interleaved, each with the flat form
switched off and on:

- the dense slots' compensation plus its scaled copy into the buffer (``compensate_dense_many``
  and a concatenation, as ``pack_dense_slots`` writes it without the flat form, against
  ``compensate_dense_flat`` and one scaled copy);
- the dense slots' commit (``settle_dense_many``);
- the sparse slots' commit (``update_many``, 1% of each tensor's positions sent).

Both memories end every run with the same state, checked.

Writes experiments/results/<name>.md (or --out DIR) and prints the table: medians in ms.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from experiments.common import publish_md
from ssfusion_lightning.models.factory import build_model
from ssfusion_lightning.sparsifiers.memory import DGCMemory

STEPS = ("dense slots: compensate and pack", "dense slots: settle", "sparse slots: commit")


def measure(dense: int, rounds: int, scale: float = 0.25) -> list[tuple[str, float, float]]:
    """(step, foreach ms, flat ms) medians over ``rounds`` interleaved rounds."""
    torch.manual_seed(0)
    model = build_model("resnet18", "tiny", num_classes=10, in_channels=1)  # the digits CNN
    params = sorted(model.named_parameters(), key=lambda item: item[1].numel())
    dense_keys, sparse_keys = [n for n, _ in params[:dense]], [n for n, _ in params[dense:]]
    dense_grads = [torch.randn_like(p) for _, p in params[:dense]]
    sparse_grads = [torch.randn_like(p) for _, p in params[dense:]]
    sent = [torch.randperm(g.numel())[: max(1, g.numel() // 100)] for g in sparse_grads]
    out = torch.empty(sum(g.numel() for g in dense_grads))
    flat, foreach = DGCMemory(momentum=0.9), DGCMemory(momentum=0.9)
    foreach._dense_group = foreach._sparse_group = lambda keys, grads, loss_scale: None  # the foreach forms only
    for memory in (flat, foreach):  # every state exists from here on, as after a plan's first steps
        memory.settle_dense_many(dense_keys, dense_grads)
        memory.update_many(sparse_keys, sparse_grads, sent, verified=True)

    def pack(memory: DGCMemory) -> None:
        compensated = memory.compensate_dense_flat(dense_keys, dense_grads)
        if compensated is None:
            torch.cat([c.reshape(-1) for c in memory.compensate_dense_many(dense_keys, dense_grads)], out=out)
            out.mul_(scale)
        else:
            torch.mul(compensated, scale, out=out)

    variants = {
        STEPS[0]: (lambda: pack(foreach), lambda: pack(flat)),
        STEPS[1]: (lambda: foreach.settle_dense_many(dense_keys, dense_grads), lambda: flat.settle_dense_many(dense_keys, dense_grads)),
        STEPS[2]: (
            lambda: foreach.update_many(sparse_keys, sparse_grads, sent, verified=True),
            lambda: flat.update_many(sparse_keys, sparse_grads, sent, verified=True),
        ),
    }
    times: dict[tuple[str, int], list[float]] = {(step, form): [] for step in STEPS for form in (0, 1)}
    for _ in range(rounds):
        for step, forms in variants.items():
            for form, run in enumerate(forms):
                started = time.perf_counter()
                run()
                times[(step, form)].append(time.perf_counter() - started)
    for key in dense_keys + sparse_keys:
        if not torch.equal(flat.momenta[key], foreach.momenta[key]):
            raise AssertionError(f"the flat and foreach forms left different momenta for {key}")
    if not all(torch.equal(flat.velocities[key], foreach.velocities[key]) for key in sparse_keys):
        raise AssertionError("the flat and foreach forms left different velocities")
    if foreach._flat._groups or len(flat._flat._groups) != 2:
        raise AssertionError("the forms compared are not foreach against flat")
    return [(step, statistics.median(times[(step, 0)]) * 1e3, statistics.median(times[(step, 1)]) * 1e3) for step in STEPS]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dense", type=int, default=43, help="the smallest parameters of the digits CNN taken as dense slots")
    parser.add_argument("--rounds", type=int, default=400)
    parser.add_argument("--name", default="flat_states")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = measure(args.dense, args.rounds)
    lines = [
        f"DGC error feedback of the digits CNN's {args.dense} dense and {62 - args.dense} sparse slots, one thread, "
        f"medians of {args.rounds} interleaved rounds",
        "",
        "| step | foreach ms | flat ms | flat / foreach |",
        "|---|---:|---:|---:|",
        *(f"| {step} | {a:.3f} | {b:.3f} | {b / a:.2f} |" for step, a, b in rows),
    ]
    publish_md("\n".join(lines), args.name, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
