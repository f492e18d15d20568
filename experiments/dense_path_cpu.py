"""The dense path's CPU against DDP's reducer, side by side in the same processes.

    python -m experiments.dense_path_cpu --world 2 --workloads resnet18 gpt2 gpt2_10m

Issue 14's dense-path target is the engine with ``sparsifier="none"`` at most 1.05x DDP's CPU time a
step. Measured through Lightning on the emulated cluster the ratio moved by 0.1-0.15 between launches
of the same code (experiments/REPORT.md, "The dense path on this code"): one scheme per process, so
each ran under a different minute of a shared host. Here every rank holds two copies of the same
model, one wrapped in torch's DistributedDataParallel (its C++ reducer, Lightning's defaults) and one
under the engine as ``SSFusionStrategy(sparsifier="none")`` builds it (the ssfusion preset's fusion,
comm and offload), and runs them in alternating blocks of steps on loopback gloo. A step is
zero_grad, forward, backward and the gradient exchange (DDP's inside backward, the engine's
``finish``); no optimizer, so both exchange the same gradients step after step. Per step it records
the main thread's CPU, the process's CPU (gloo's and the engine's threads included) and the wall
time; the ratios are per block pair, so both sides of a ratio ran within a second of each other.
It also checks that the two copies' gradients are equal to the bit at the end.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from experiments.common import free_port, publish_md
from experiments.e2e_worker import ENGINE_SCHEMES, build_workload


def _loss(kind: str, model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    inputs, targets = batch
    out = model(inputs)
    if kind == "lm":
        return F.cross_entropy(out.flatten(0, 1), targets.flatten(), ignore_index=-100)
    return F.cross_entropy(out, targets)


def _engine_for(model: torch.nn.Module) -> Any:
    """The engine as SSFusionStrategy(sparsifier="none") builds it, outside Lightning."""
    from ssfusion_lightning.comm import COMMUNICATORS, ChannelSet
    from ssfusion_lightning.engine.engine import EngineConfig, FusionEngine
    from ssfusion_lightning.fusion import FUSION_POLICIES
    from ssfusion_lightning.sparsifiers import MEMORIES, SPARSIFIERS

    options = ENGINE_SCHEMES["ssfusion_dense"]
    groups = [dist.new_group(backend="gloo") for _ in range(2)]
    engine = FusionEngine(
        [(n, p) for n, p in model.named_parameters() if p.requires_grad],
        SPARSIFIERS.build(options["sparsifier"], density=0.01),
        MEMORIES.build("residual"),
        FUSION_POLICIES.build(options["fusion"]),
        COMMUNICATORS.build(options["comm"]),
        ChannelSet(groups, torch.device("cpu")),
        EngineConfig(buffer_bytes=None, offload=options["offload"]),
    )
    engine.attach()
    return engine


def _block(step, steps: int) -> list[tuple[float, float, float]]:
    out = []
    for _ in range(steps):
        t0, c0, p0 = time.perf_counter(), time.thread_time(), time.process_time()
        step()
        out.append((time.perf_counter() - t0, time.thread_time() - c0, time.process_time() - p0))
    return out


def _rank(rank: int, world: int, port: int, args: dict[str, Any], queue) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    results = {}
    for name in args["workloads"]:
        torch.manual_seed(0)
        spec, model, _task, datamodule = build_workload(name, args["quick"], 0)
        datamodule.setup("fit")
        batch = next(iter(datamodule.train_dataloader()))
        torch.manual_seed(rank)
        batch = tuple(t[torch.randperm(len(t))] if t.dtype.is_floating_point else t for t in batch)
        ddp_model = DistributedDataParallel(copy.deepcopy(model))
        engine_model = copy.deepcopy(model)
        engine = _engine_for(engine_model)

        def ddp_step() -> None:
            ddp_model.zero_grad(set_to_none=True)
            _loss(spec["kind"], ddp_model, batch).backward()

        def engine_step() -> None:
            engine_model.zero_grad(set_to_none=True)
            _loss(spec["kind"], engine_model, batch).backward()
            engine.finish()

        _block(ddp_step, args["warmup"])
        _block(engine_step, args["warmup"])
        samples: dict[str, list] = {"ddp": [], "engine": []}
        for _ in range(args["blocks"]):
            samples["ddp"].append(_block(ddp_step, args["steps"]))
            samples["engine"].append(_block(engine_step, args["steps"]))
        # one more step each from the same random state (dropout), then the same gradients to the bit
        torch.manual_seed(1000 + rank)
        ddp_step()
        torch.manual_seed(1000 + rank)
        engine_step()
        equal = all(
            torch.equal(a.grad, b.grad) for a, b in zip(ddp_model.module.parameters(), engine_model.parameters())
        )
        engine.close()
        results[name] = {"samples": samples, "equal": equal, "buffers": len(engine.plan.buffers)}
    queue.put((rank, results))
    dist.barrier()
    dist.destroy_process_group()


def _median_of_pairs(samples: dict[str, list], field: int) -> tuple[float, float, float]:
    """(DDP's ms, the engine's ms, the median over block pairs of engine / DDP)."""
    ddp = [statistics.median(s[field] for s in block) for block in samples["ddp"]]
    engine = [statistics.median(s[field] for s in block) for block in samples["engine"]]
    return statistics.median(ddp) * 1e3, statistics.median(engine) * 1e3, statistics.median(
        e / d for d, e in zip(ddp, engine)
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--workloads", nargs="+", default=["resnet18", "gpt2", "gpt2_10m"])
    parser.add_argument("--warmup", type=int, default=30, help="steps of each before measuring")
    parser.add_argument("--steps", type=int, default=10, help="steps a block")
    parser.add_argument("--blocks", type=int, default=12, help="block pairs")
    parser.add_argument("--port", type=int, default=None, help="the ranks' rendezvous port (default: a free one)")
    parser.add_argument("--name", default="dense_path_cpu")
    parser.add_argument("--out", default=None, help="folder of the table (default: experiments/results)")
    parser.add_argument("--quick", action="store_true", help="the workloads' small twins (a smoke run)")
    args = parser.parse_args(argv)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    options = {
        "workloads": args.workloads, "warmup": args.warmup, "steps": args.steps, "blocks": args.blocks, "quick": args.quick,
    }
    port = args.port or free_port()
    procs = [ctx.Process(target=_rank, args=(r, args.world, port, options, queue)) for r in range(args.world)]
    for p in procs:
        p.start()
    by_rank = dict(queue.get() for _ in procs)
    for p in procs:
        p.join()
    lines = [
        f"`python -m experiments.dense_path_cpu --world {args.world} --workloads {' '.join(args.workloads)}` "
        f"({args.blocks} alternated block pairs of {args.steps} steps after {args.warmup} warm-up steps each; "
        "one intra-op thread a rank; loopback gloo; medians over the ranks of each rank's median over block pairs)",
        "",
        "| workload | buffers | main thread ms: DDP | engine | engine / DDP | process CPU ms: DDP | engine "
        "| engine / DDP | wall ms: DDP | engine | engine / DDP | gradients equal |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    raw = {}
    for name in args.workloads:
        cells = []
        for field in (1, 2, 0):
            per_rank = [_median_of_pairs(by_rank[r][name]["samples"], field) for r in sorted(by_rank)]
            cells.append(tuple(statistics.median(v[i] for v in per_rank) for i in range(3)))
        equal = all(by_rank[r][name]["equal"] for r in by_rank)
        buffers = by_rank[0][name]["buffers"]
        raw[name] = {"cells": cells, "equal": equal, "buffers": buffers}
        row = " | ".join(f"{d:.1f} | {e:.1f} | **{x:.3f}**" for d, e, x in cells)
        lines.append(f"| {name} | {buffers} | {row} | {'yes' if equal else 'NO'} |")
    path = publish_md("\n".join(lines), args.name, args.out)
    path.with_suffix(".json").write_text(json.dumps({"world": args.world, "results": raw}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
