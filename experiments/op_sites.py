"""Where a rank's tensor ops come from: every aten op of some training steps counted and timed by
the call site in this repository that issued it.

    python -m experiments.op_sites --workload gpt2_10m --name op_sites_gpt2_10m
    python -m experiments.op_sites --workload resnet18 --scheme compute_sync     # the same for DDP

Two ranks on loopback gloo, one intra-op thread each, a fit of the workload with the scheme's strategy
(``e2e_worker``'s schemes and workloads). Over steps [--start, --stop) rank 1 runs under a
``TorchDispatchMode`` that times each op and files it under its innermost ``--depth`` frames of
``ssfusion_lightning`` or ``experiments`` code. On loopback the cost model sends a fast link dense,
so the default overrides force the preset's sparse plan (``comm="allgather"``, no DDP hand-off).

It found what a profile by function does not show: ops a round makes many times over for nothing
(a scratch that allocated three tensors per key every round, a sync per tensor), counted per step.
Timing each op in Python inflates small ops: compare sites and counts, not the totals with a step.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import tempfile
import time
import traceback
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from experiments.common import publish_md

#: the strategy overrides that keep the preset's plan sparse on loopback
SPARSE_ON_LOOPBACK = {"comm": "allgather", "ddp_handoff": False}
#: frames from these folders name a call site
OWN_CODE = ("ssfusion_lightning", "experiments")


def call_site(depth: int) -> str:
    """The innermost ``depth`` frames of this repository's code on the stack, innermost first."""
    frames = [
        f for f in traceback.extract_stack() if f.filename != __file__ and any(f"/{part}/" in f.filename for part in OWN_CODE)
    ]
    return " < ".join(f"{Path(f.filename).name}:{f.lineno}:{f.name}" for f in reversed(frames[-depth:])) or "(outside)"


def counting_mode(depth: int):
    """A dispatch mode that files every op's count and wall time under (op, call site)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Counting(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.counts: Counter = Counter()
            self.seconds: defaultdict = defaultdict(float)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            site = (func.overloadpacket.__name__, call_site(depth))
            started = time.perf_counter()
            out = func(*args, **(kwargs or {}))
            self.seconds[site] += time.perf_counter() - started
            self.counts[site] += 1
            return out

    return Counting()


def rank_main(rank: int, port: int, args: dict[str, Any], out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NODE_RANK=str(rank), LOCAL_RANK="0", WORLD_SIZE="2", RANK=str(rank))
    import lightning as L
    import torch

    from experiments.e2e_worker import build_workload, clipping, make_strategy

    torch.set_num_threads(1)
    start, stop = args["start"], args["stop"]

    class Window(L.Callback):
        def __init__(self) -> None:
            self.mode = None

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            if batch_idx == start and trainer.global_rank == 1:
                self.mode = counting_mode(args["depth"])
                self.mode.__enter__()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if batch_idx == stop - 1 and self.mode is not None:
                self.mode.__exit__(None, None, None)
                steps = stop - start
                rows = [
                    {"op": op, "site": site, "per_step": count / steps, "ms_per_step": 1e3 * self.mode.seconds[(op, site)] / steps}
                    for (op, site), count in self.mode.counts.items()
                ]
                Path(out).write_text(json.dumps(rows))
                self.mode = None

    L.seed_everything(0, verbose=False)
    spec, _, task, datamodule = build_workload(args["workload"], args["quick"], 0)
    overrides, clip = clipping(spec, args["overrides"])
    trainer = L.Trainer(
        accelerator="cpu", num_nodes=2, devices=1, strategy=make_strategy(args["scheme"], overrides), max_steps=stop + 1,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[Window()], gradient_clip_val=clip, num_sanity_val_steps=0, limit_val_batches=0,
    )
    trainer.fit(task, datamodule)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def measure(args: dict[str, Any]) -> list[dict[str, Any]]:
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory() as scratch:
        out = str(Path(scratch) / "rows.json")
        port = free_port()
        ranks = [context.Process(target=rank_main, args=(rank, port, args, out)) for rank in range(2)]
        for process in ranks:
            process.start()
        for process in ranks:
            process.join(args["timeout"])
        failed = {rank: process.exitcode for rank, process in enumerate(ranks) if process.exitcode != 0}
        for process in ranks:
            if process.is_alive():
                process.kill()
        if failed:
            raise RuntimeError(f"ranks failed or timed out (exit codes {failed})")
        return json.loads(Path(out).read_text())


def table(rows: list[dict[str, Any]], top: int) -> list[str]:
    rows = sorted(rows, key=lambda r: -r["ms_per_step"])
    lines = [
        f"All ops: {sum(r['per_step'] for r in rows):.0f} a step, {sum(r['ms_per_step'] for r in rows):.1f} ms a step timed one by one.",
        "",
        "| ms a step | ops a step | op | call site (innermost first) |",
        "|---:|---:|---|---|",
    ]
    lines += [f"| {r['ms_per_step']:.3f} | {r['per_step']:.1f} | {r['op']} | {r['site']} |" for r in rows[:top]]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default="gpt2")
    parser.add_argument("--scheme", default="ssfusion", help="an e2e_worker scheme (ssfusion, compute_sync, ddp, ...)")
    parser.add_argument("--overrides", default=json.dumps(SPARSE_ON_LOOPBACK), help="engine options of an engine scheme, as JSON")
    parser.add_argument("--start", type=int, default=40, help="first step counted (the plan is settled by then)")
    parser.add_argument("--stop", type=int, default=60)
    parser.add_argument("--depth", type=int, default=2, help="frames of this repository's code that name a call site")
    parser.add_argument("--top", type=int, default=60, help="rows in the table")
    parser.add_argument("--quick", action="store_true", help="the workload's tiny form (a smoke run)")
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--name", default="op_sites")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if not 0 <= args.start < args.stop:
        parser.error(f"--start and --stop must satisfy 0 <= start < stop, got {args.start} and {args.stop}")
    from experiments.e2e_worker import ENGINE_SCHEMES, SCHEMES, WORKLOADS

    if args.scheme not in SCHEMES:
        parser.error(f"unknown scheme {args.scheme!r}; valid choices: {', '.join(SCHEMES)}")
    if args.workload not in WORKLOADS:
        parser.error(f"unknown workload {args.workload!r}; valid choices: {', '.join(WORKLOADS)}")
    options = {
        "workload": args.workload, "scheme": args.scheme, "start": args.start, "stop": args.stop, "depth": args.depth,
        "quick": args.quick, "timeout": args.timeout,
        "overrides": json.loads(args.overrides) if args.scheme in ENGINE_SCHEMES else None,
    }
    rows = measure(options)
    command = (f"`python -m experiments.op_sites --workload {args.workload} --scheme {args.scheme} --overrides '{args.overrides}' "
               f"--start {args.start} --stop {args.stop}` (rank 1 of 2 on loopback, one thread a rank; per step over the steps counted)")
    publish_md("\n".join([command, "", *table(rows, args.top)]), args.name, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
