"""Micro-benchmark of momentum correction's dense slots: DGC error feedback of a buffer's small
tensors as foreach calls over the tensors against one flat state (``DGCMemory``'s flat momenta).

    python -m experiments.bench_dense_slots                  # the digits CNN's 43 dense slots
    python -m experiments.bench_dense_slots --rounds 20      # smoke run

The tensors are the ``--count`` smallest parameters of the digits CNN (resnet18 tiny on 8x8
grey images: the 43 its time-to-accuracy plan sends dense, 1410 elements), random gradients, one
intra-op thread. Per round, interleaved: the compensation plus its scaled copy into the buffer
(``compensate_dense_many`` and a concatenation, as ``pack_dense_slots`` did, against
``compensate_dense_flat`` and one scaled copy), and the commit (``settle_dense_many`` with the
flat form switched off, against it on). Both memories end every run with the same state, checked.

Writes experiments/results/<name>.md (or --out DIR) and prints the table: medians in ms.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from experiments.common import RESULTS
from ssfusion_lightning.models.factory import build_model
from ssfusion_lightning.sparsifiers.memory import DGCMemory


def measure(count: int, rounds: int, scale: float = 0.25) -> list[tuple[str, float, float]]:
    """(what, foreach ms, flat ms) medians over ``rounds`` interleaved rounds."""
    torch.manual_seed(0)
    model = build_model("resnet18", "tiny", num_classes=10, in_channels=1)  # the digits CNN: 10 classes of grey images
    smallest = sorted(model.named_parameters(), key=lambda item: item[1].numel())[:count]
    keys, grads = [name for name, _ in smallest], [torch.randn_like(p) for _, p in smallest]
    out = torch.empty(sum(g.numel() for g in grads))
    flat, foreach = DGCMemory(momentum=0.9), DGCMemory(momentum=0.9)
    foreach._dense_group = lambda keys, grads, loss_scale: None  # the foreach forms only
    for memory in (flat, foreach):
        memory.settle_dense_many(keys, grads)  # the momenta exist from here on, as after a plan's first step

    def pack_foreach() -> None:
        torch.cat([c.reshape(-1) for c in foreach.compensate_dense_many(keys, grads)], out=out)
        out.mul_(scale)

    def pack_flat() -> None:
        compensated = flat.compensate_dense_flat(keys, grads)
        assert compensated is not None, "the flat form did not apply"
        torch.mul(compensated, scale, out=out)

    variants = {
        ("compensate and pack", "foreach"): pack_foreach,
        ("compensate and pack", "flat"): pack_flat,
        ("settle", "foreach"): lambda: foreach.settle_dense_many(keys, grads),
        ("settle", "flat"): lambda: flat.settle_dense_many(keys, grads),
    }
    times: dict[tuple[str, str], list[float]] = {key: [] for key in variants}
    for _ in range(rounds):
        for key, run in variants.items():
            started = time.perf_counter()
            run()
            times[key].append(time.perf_counter() - started)
    if not all(torch.equal(flat.momenta[k], foreach.momenta[k]) for k in keys):
        raise AssertionError("the flat and foreach forms left different momenta")
    if foreach._flat._groups or not flat._flat._groups:
        raise AssertionError("the forms compared are not foreach against flat")
    return [
        (what, statistics.median(times[(what, "foreach")]) * 1e3, statistics.median(times[(what, "flat")]) * 1e3)
        for what in ("compensate and pack", "settle")
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=43, help="the smallest parameters of the digits CNN taken as dense slots")
    parser.add_argument("--rounds", type=int, default=400)
    parser.add_argument("--name", default="dense_slots")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = measure(args.count, args.rounds)
    lines = [
        f"DGC error feedback of the digits CNN's {args.count} smallest tensors, one thread, medians of {args.rounds} interleaved rounds",
        "",
        "| step | foreach ms | flat ms | flat / foreach |",
        "|---|---:|---:|---:|",
        *(f"| {what} | {a:.3f} | {b:.3f} | {b / a:.2f} |" for what, a, b in rows),
    ]
    text = "\n".join(lines)
    print(text)
    out = Path(args.out) if args.out else RESULTS
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
