"""Count what one Ok-Topk round really sends, round by round, against commcost's formula.

    PYTHONPATH=. python -m experiments.oktopk_rounds --world 4 --rounds 40 --source resnet18

Each of ``--world`` gloo ranks on loopback runs ``--rounds`` rounds of the oktopk preset's parts
(threshold_reuse selection, error feedback, ``oktopk_reduce``) on one buffer and prints, per
round: whether the global threshold was exact, the local selection count and the global kept
count C over k, the collectives issued (all_to_all, all_gather, all_reduce), the bytes a rank
received (mean over ranks) in each step of the round, and commcost's modelled bytes
(``oktopk_seconds`` on a byte-only link) for the local count (what experiments/simulate.py calls
k) and for the budget k. The summary gives the steps' bytes in units of (P-1)/P k (v+x) and the
balance's share of the kept entries' allgather (commcost's OKTOPK_KEPT and OKTOPK_BALANCE_SHARE).

``--source cnn`` / ``resnet18`` / ``gpt2``: a small CNN's or the e2e benchmark's models'
gradients through the fusion engine (behind, one buffer);
``--source random``: heavy-tailed random gradients (a shared part plus a rank's own part) with
residual error feedback, straight into ``oktopk_reduce``. A few ranks on one host: cheap.
"""

from __future__ import annotations

import argparse
import os
import socket
from collections import Counter
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import ssfusion_lightning.comm.oktopk as oktopk
from ssfusion_lightning import commcost
from ssfusion_lightning.comm.traffic import Traffic

COLLECTIVES = ("all_to_all_single", "all_gather", "all_reduce")


class CountingDist:
    """``torch.distributed`` as ``comm/oktopk.py`` sees it, recording the collectives it issues
    (each is followed by one ``Traffic.add``, which records its bytes)."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.received: list[int] = []

    def __getattr__(self, name: str) -> Any:
        target = getattr(dist, name)
        if name not in COLLECTIVES:
            return target

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls.append(name)
            return target(*args, **kwargs)

        return counted


def instrument() -> list[dict[str, Any]]:
    """Route oktopk's collectives through a counter and log every ``oktopk_reduce`` call."""
    counting, log = CountingDist(), []
    original, add = oktopk.oktopk_reduce, Traffic.add

    def recorded_add(self, sent, received, *args):
        counting.received.append(int(received))
        add(self, sent, received, *args)

    def logged(values, indices, numel, k, group, traffic, state, *args, **kwargs):
        counting.calls.clear()
        counting.received.clear()
        every = kwargs.get("threshold_every", args[1] if len(args) > 1 else commcost.OKTOPK_THRESHOLD_EVERY)
        exact = state.exact_next or state.k != k or state.rounds % every == 0
        result = original(values, indices, numel, k, group, traffic, state, *args, **kwargs)
        log.append({
            "local": values.numel(), "k": k, "numel": numel, "kept": state.last_count, "exact": exact,
            "calls": list(zip(counting.calls, counting.received)), "sent": traffic.sent,
            "received": traffic.received,
        })
        return result

    oktopk.dist = counting
    oktopk.oktopk_reduce = logged
    Traffic.add = recorded_add
    return log


def workload(source: str) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """(model, inputs, targets): the same model on every rank (seed 0), the rank's own random
    inputs and targets. ``cnn``: a small CNN; ``resnet18`` and ``gpt2``: the e2e benchmark's
    (701,466 and 1,408,704 parameters)."""
    from ssfusion_lightning.models.factory import build_model

    torch.manual_seed(0)
    if source == "gpt2":
        model = build_model("gpt2", "tiny", dim=192, depth=3, num_heads=4)
    elif source == "resnet18":
        model = build_model("resnet18", "tiny", width=16)
    else:
        model = nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(),
            nn.AdaptiveAvgPool2d(4), nn.Flatten(), nn.Linear(64 * 16, 128), nn.ReLU(), nn.Linear(128, 10),
        )
    torch.manual_seed(1 + dist.get_rank())
    if source == "gpt2":
        tokens = torch.randint(0, 256, (16, 33))
        return model, tokens[:, :-1], tokens[:, 1:]
    return model, torch.randn(32, 3, 16, 16), torch.randint(0, 10, (32,))


def engine_rounds(source: str, rounds: int, density: float) -> list[dict[str, Any]]:
    """The oktopk preset's engine on a model learning random targets (real gradient shapes)."""
    from ssfusion_lightning.comm import COMMUNICATORS, ChannelSet
    from ssfusion_lightning.engine.engine import EngineConfig, FusionEngine
    from ssfusion_lightning.fusion import FUSION_POLICIES
    from ssfusion_lightning.sparsifiers import build_memory, build_sparsifier

    log = instrument()
    model, x, y = workload(source)
    engine = FusionEngine(
        list(model.named_parameters()),
        build_sparsifier("threshold_reuse", density=density),
        build_memory("residual"),
        FUSION_POLICIES.build("behind"),
        COMMUNICATORS.build("oktopk"),
        ChannelSet([dist.new_group(backend="gloo") for _ in range(2)], torch.device("cpu")),
        EngineConfig(buffer_bytes=64 << 20, profile_steps=2),
    )
    engine.attach()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for _ in range(rounds):
        optimizer.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x).flatten(0, -2), y.flatten()).backward()
        engine.finish()
        optimizer.step()
    engine.close()
    return log


def random_rounds(rounds: int, density: float, numel: int = 500_000) -> list[dict[str, Any]]:
    """Heavy-tailed gradients (half shared, half the rank's own), residual error feedback."""
    from ssfusion_lightning.sparsifiers import build_sparsifier

    log = instrument()
    sparsifier = build_sparsifier("threshold_reuse", density=density)
    k = max(1, int(density * numel))
    state, residual = oktopk.OkTopkState(), torch.zeros(numel)
    scale = torch.distributions.Pareto(1.0, 2.5).sample((numel,))  # per-element scale, shared
    shared, own = torch.Generator().manual_seed(7), torch.Generator().manual_seed(100 + dist.get_rank())
    for _ in range(rounds):
        grad = scale * (torch.randn(numel, generator=shared) + torch.randn(numel, generator=own))
        compensated = grad + residual
        values, indices = sparsifier.select(compensated, key="buffer0", k=k)
        sparsifier.step += 1
        _, applied = oktopk.oktopk_reduce(values, indices, numel, k, None, Traffic(), state)
        residual = compensated
        residual[indices[torch.isin(indices, applied)]] = 0.0
    return log


def modelled_bytes(numel: int, k: float, world: int) -> float:
    """commcost's Ok-Topk formula on a byte-only link (alpha 0, one byte per second), independent
    selections."""
    links = commcost.Links.from_round_latency(world, 0.0, 1.0)
    return commcost.oktopk_seconds(commcost.BufferShape(0, numel, k), links, commcost.expected_nonzeros(numel, k, world))


def _rank(rank: int, world: int, port: int, source: str, rounds: int, density: float, out: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    log = random_rounds(rounds, density) if source == "random" else engine_rounds(source, rounds, density)
    out.put((rank, log))
    dist.barrier()
    dist.destroy_process_group()


def phases(calls: list[tuple[str, int]]) -> dict[str, int]:
    """Received bytes per step of a round: the last two collectives are the balance all_to_all
    and the kept entries' all_gather, the second all_to_all is split and reduce, the rest counts
    and thresholds."""
    a2a = [i for i, (name, _) in enumerate(calls) if name == "all_to_all_single"]
    named = {a2a[1]: "split", len(calls) - 2: "balance", len(calls) - 1: "final"}
    out = Counter()
    for i, (_, nbytes) in enumerate(calls):
        out[named.get(i, "control")] += nbytes
    return out


def report(logs: list[list[dict[str, Any]]], world: int) -> None:
    me = logs[0][0]
    pair = 8  # fp32 values, int32 positions
    print(f"P={world} numel={me['numel']} k={me['k']}; bytes: received per rank, mean over ranks; "
          f"model = commcost.oktopk_seconds on a byte-only link")
    print("round exact local/k  C/k  a2a ag ar   split control balance  final  total  model(local) model(k) total/model")
    totals: Counter = Counter()
    for i, entries in enumerate(zip(*logs)):
        me = entries[0]
        local = sum(e["local"] for e in entries) / world
        part: Counter = Counter()
        for e in entries:
            part.update(phases(e["calls"]))
        part = Counter({key: value / world for key, value in part.items()})
        recv = sum(e["received"] for e in entries) / world
        by_local, by_k = modelled_bytes(me["numel"], local, world), modelled_bytes(me["numel"], me["k"], world)
        names = Counter(name for name, _ in me["calls"])
        print(f"{i:5d} {'E' if me['exact'] else '-':>5} {local / me['k']:7.2f} {me['kept'] / me['k']:4.2f} "
              f"{names['all_to_all_single']:4d} {names['all_gather']:2d} {names['all_reduce']:2d} "
              f"{part['split']:7.0f} {part['control']:7.0f} {part['balance']:7.0f} {part['final']:6.0f} {recv:6.0f} "
              f"{by_local:13.0f} {by_k:8.0f} {recv / by_local:11.2f}")
        if i:  # round 0 (rebalance, exact) falls in the e2e runs' warm-up steps
            totals.update(part)
            totals.update(recv=recv, model=by_local, model_k=by_k, rounds=1, local=local / me["k"],
                          kept=me["kept"] / me["k"], collectives=len(me["calls"]), exact=me["exact"])
    n = totals["rounds"]
    moved = (world - 1) / world * me["k"] * pair
    print(f"rounds 1..{n}: {totals['exact']} exact; mean local/k {totals['local'] / n:.3f}, C/k {totals['kept'] / n:.3f}, "
          f"collectives {totals['collectives'] / n:.2f}; received {totals['recv'] / n:.0f} = split {totals['split'] / n:.0f} "
          f"+ control {totals['control'] / n:.0f} + balance {totals['balance'] / n:.0f} + final {totals['final'] / n:.0f}; "
          f"in units of (P-1)/P k (v+x) = {moved:.0f}: split {totals['split'] / n / moved:.3f}, "
          f"balance {totals['balance'] / n / moved:.3f}, final {totals['final'] / n / moved:.3f}; "
          f"balance / final {totals['balance'] / totals['final']:.3f}; "
          f"model(local) {totals['model'] / n:.0f} (received/model {totals['recv'] / totals['model']:.3f}), "
          f"model(k) {totals['model_k'] / n:.0f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument("--source", choices=("cnn", "resnet18", "gpt2", "random"), default="cnn")
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, args.world, port, args.source, args.rounds, args.density, out))
             for r in range(args.world)]
    for p in procs:
        p.start()
    logs = dict(out.get() for _ in procs)
    for p in procs:
        p.join()
    report([logs[r] for r in range(args.world)], args.world)


if __name__ == "__main__":
    main()
