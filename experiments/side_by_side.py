"""Schemes side by side in the same ranks: each rank holds one copy of the model per scheme and trains
them in alternating blocks of steps, so every ratio compares steps taken seconds apart in the same
processes.

    # the dense engine against DDP's reducer, on loopback (issue 14's dense-path target)
    python -m experiments.side_by_side --schemes ddp ssfusion_dense --workloads resnet18 gpt2 gpt2_10m
    # issue 14's overlap cells: P = 2 on the emulated cluster (root), one shaped link per rank
    python -m experiments.side_by_side --schemes compute_only ddp_powersgd ssfusion --rates 150mbit 40mbit \\
        --workloads resnet18 gpt2 gpt2_10m --name overlap_side

Launches of one code through Lightning moved the step ratios between schemes by 0.1-0.3 on this host
(experiments/REPORT.md, "The serial CPU probe times every rank at once"): each scheme ran in its own
processes, minutes apart. Here the schemes share the processes and the minute.

A scheme is a DDP baseline (``compute_only``: DDP with a no-op comm hook, the step without
communication; ``compute_sync``: the same plus one 1-element all-reduce a step, the lockstep floor; ``ddp``;
``ddp_bucket_view``: DDP with ``gradient_as_bucket_view``, as the strategy's hand-off builds it; ``ddp_powersgd`` /
``ddp_powersgd4``: PyTorch's PowerSGD hook at rank 1 / 4)
or an engine scheme of experiments/e2e_worker.py (``ssfusion``, ``ssfusion_dense`` = sparsifier none,
``safusion``, ...) built as ``SSFusionStrategy`` builds its engine and binds its memory to the optimizer,
outside Lightning: ``memory="auto"`` (the ssfusion presets') picks momentum correction for SGD with momentum
(which takes the SGD's momentum) and the Adam memory for AdamW (which replaces the AdamW by the step that
applies the ranks' averaged update), and both hand their state to the optimizer where DDP's reducer takes
the rounds, as in ``SSFusionStrategy.setup_optimizers``; nothing here clips gradients. A step is what
Lightning's loop does for each: the module buffers' broadcast before the forward (where the scheme
broadcasts them), zero_grad, forward, backward, the engine's ``finish``, the optimizer's step. Each
rank trains every copy on one fixed batch of its own (the workload's first, shuffled by rank), so the
schemes' steps differ only in how they exchange gradients.

Per step it records the wall time, the main thread's CPU and the process's CPU (gloo's and the
engine's threads included), and for engine schemes the engine's compression and exposed
communication. Ratios are medians over block pairs of each pair's medians, then the median over ranks.
Where ``ddp`` and ``ssfusion_dense`` both run, the harness checks after the timed blocks that one more
step of each from the same state writes the same gradients (the engine's dense path is DDP's, bitwise).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from queue import Empty
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from experiments.common import RESULTS, free_port, publish_md, pyplot, save_figure
from experiments.e2e_worker import ENGINE_SCHEMES, POWERSGD_RANKS, WORKLOADS, build_workload, register_ddp_hook
from ssfusion_lightning.data.sequences import IGNORE_INDEX
from ssfusion_lightning.engine.trial import PlanTrial

REPO = Path(__file__).resolve().parents[1]
DDP_HOOKS = {"compute_only": "noop", "compute_sync": "lockstep", "ddp": None, "ddp_bucket_view": None, **{name: "powersgd" for name in POWERSGD_RANKS}}
SCHEMES = (*DDP_HOOKS, *ENGINE_SCHEMES)
#: seconds the harness waits, once a rank has failed, for the others to exit on their own before it stops them
FAILURE_GRACE_S = 10.0


def _loss(kind: str, model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    inputs, targets = batch
    out = model(inputs)
    if kind == "lm":
        return F.cross_entropy(out.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX)
    return F.cross_entropy(out, targets)


def memory_choice(options: dict[str, Any], optimizer: torch.optim.Optimizer) -> tuple[str, dict[str, Any]]:
    """The memory ``options`` name and its options; ``auto`` picks them for ``optimizer`` as
    SSFusionStrategy does."""
    from ssfusion_lightning.sparsifiers.memory_choice import choose_memory

    name, memory_options = options.get("memory", "residual"), options.get("memory_options", {})
    if name != "auto":
        return name, memory_options
    choice = choose_memory([optimizer], memory_options)
    return choice.name, choice.options


def _engine_for(model: torch.nn.Module, options: dict[str, Any], memory: tuple[str, dict[str, Any]]) -> Any:
    """The engine as SSFusionStrategy builds it for ``options`` (an ENGINE_SCHEMES entry)."""
    from ssfusion_lightning.comm import COMMUNICATORS, ChannelSet
    from ssfusion_lightning.engine.engine import EngineConfig, FusionEngine
    from ssfusion_lightning.fusion import FUSION_POLICIES
    from ssfusion_lightning.sparsifiers import MEMORIES, SPARSIFIERS

    groups = [dist.new_group(backend="gloo") for _ in range(options.get("process_groups", 2))]
    engine = FusionEngine(
        [(n, p) for n, p in model.named_parameters() if p.requires_grad],
        SPARSIFIERS.build(options["sparsifier"], density=options.get("density", 0.01)),
        MEMORIES.build(memory[0], **memory[1]),
        FUSION_POLICIES.build(options["fusion"]),
        COMMUNICATORS.build(options["comm"], **options.get("comm_options", {})),
        ChannelSet(groups, torch.device("cpu")),
        EngineConfig(buffer_bytes=None, offload=options["offload"]),
    )
    engine.attach()
    return engine


def _bind_memory(engine: Any, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer to step once the engine's memory is bound to it, as SSFusionStrategy.setup_optimizers
    binds it: momentum correction takes the SGD's momentum; the Adam memory replaces the AdamW."""
    from ssfusion_lightning.sparsifiers.adam_memory import AdamMemory
    from ssfusion_lightning.sparsifiers.memory import DGCMemory

    if isinstance(engine.memory, DGCMemory):
        engine.memory.take_momentum_from([optimizer], engine.params)
    elif isinstance(engine.memory, AdamMemory):
        (optimizer,) = engine.memory.take_over([optimizer], engine.params)
    return optimizer


class Runner:
    """One scheme's copy of the model, its optimizer and its step."""

    def __init__(self, scheme: str, model: torch.nn.Module, spec: dict[str, Any], batch, density: float) -> None:
        from ssfusion_lightning.models.tasks.optim import build_optimizer

        self.scheme, self.kind, self.batch = scheme, spec["kind"], batch
        self.engine, self.hook, self.memory = None, None, None
        module = copy.deepcopy(model)
        task = dict(spec["task"])
        self.optimizer = build_optimizer(module, task.pop("optimizer"), **task)
        if scheme in DDP_HOOKS:
            hook = DDP_HOOKS[scheme]
            # compute_only and compute_sync keep each rank's buffers as e2e_worker's HookedDDP does (the
            # argument's deprecation warning names a replacement that would still sync them at construction)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                self.model = DistributedDataParallel(module, broadcast_buffers=hook not in ("noop", "lockstep"),
                                                     gradient_as_bucket_view=scheme == "ddp_bucket_view")
            self.hook = register_ddp_hook(self.model, hook, POWERSGD_RANKS.get(scheme, 1)) if hook else None
            self.buffers: list[torch.Tensor] = []
        else:
            options = {"density": density, **ENGINE_SCHEMES[scheme]}
            self.model = module
            memory = memory_choice(options, self.optimizer)
            self.memory = memory[0]
            self.engine = _engine_for(module, options, memory)
            self.optimizer = _bind_memory(self.engine, self.optimizer)
            self.handoff = options.get("ddp_handoff", True)
            self.buffers = [b for b in module.buffers() if b.numel() > 0]

    def step(self) -> Any:
        """One training step; an engine scheme's metrics of it (None for DDP's)."""
        if self.buffers:  # what the strategy broadcasts before a training forward, as DDP does
            dist._broadcast_coalesced(dist.group.WORLD, self.buffers, 250 * 1024 * 1024, 0)
        metrics = self.exchange()
        self.optimizer.step()
        return metrics

    def exchange(self) -> Any:
        """Forward, backward and the gradient exchange: the synchronized gradients in ``.grad``."""
        self.optimizer.zero_grad(set_to_none=True)
        loss = _loss(self.kind, self.model, self.batch)
        if self.engine is None:
            loss.backward()
            return None
        self.engine.begin_backward()
        loss.backward()
        # as SSFusionStrategy hands its rounds to DDP's reducer (on the engine's first group) and back
        if isinstance(self.model, DistributedDataParallel):
            metrics = self.engine.handed_off_step()
            if not self.engine.ddp_can_run:
                self.model = self.model.module
                self.engine.attach()
                self.buffers = [b for b in self.model.buffers() if b.numel() > 0]
            return metrics
        metrics = self.engine.finish()
        if self.handoff and self.engine.ddp_can_run:
            self.engine.hand_off()
            self.model = DistributedDataParallel(self.model, process_group=self.engine.channels[0].group,
                                                 gradient_as_bucket_view=True)
            self.buffers = []  # DDP's forward broadcasts them
        return metrics

    def grads(self) -> list[torch.Tensor]:
        module = self.model.module if isinstance(self.model, DistributedDataParallel) else self.model
        return [p.grad for p in module.parameters()]

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
        if self.hook is not None:
            self.hook.executor.shutdown(wait=True)


def _block(runner: Runner, steps: int) -> list[dict[str, float]]:
    out = []
    for _ in range(steps):
        t0, c0, p0 = time.perf_counter(), time.thread_time(), time.process_time()
        metrics = runner.step()
        row = {"wall": time.perf_counter() - t0, "cpu": time.thread_time() - c0, "proc": time.process_time() - p0}
        if metrics is not None:
            row.update(compress=metrics.compress_seconds, exposed=metrics.exposed_comm_seconds,
                       sparse=metrics.sparse_tensors, buffers=metrics.buffers)
        out.append(row)
    return out


def _same_gradients(runners: dict[str, Runner], rank: int) -> bool | None:
    """One step of ddp and of ssfusion_dense from the same weights and random state: equal gradients."""
    if "ddp" not in runners or "ssfusion_dense" not in runners:
        return None
    ddp, dense = runners["ddp"], runners["ssfusion_dense"]
    with torch.no_grad():
        for a, b in zip(ddp.model.module.parameters(), dense.model.parameters()):
            b.copy_(a)
        for a, b in zip(ddp.model.module.buffers(), dense.model.buffers()):
            b.copy_(a)
    grads = []
    for runner in (ddp, dense):
        torch.manual_seed(1000 + rank)
        runner.exchange()
        grads.append(runner.grads())
    return all(torch.equal(a, b) for a, b in zip(*grads))


def run_rank(rank: int, options: dict[str, Any]) -> dict[str, Any]:
    """Every workload's blocks on this rank (the process group is initialized)."""
    results = {}
    for name in options["workloads"]:
        torch.manual_seed(0)
        spec, model, _task, datamodule = build_workload(name, options["quick"], 0)
        datamodule.setup("fit")
        inputs, targets = next(iter(datamodule.train_dataloader()))
        torch.manual_seed(rank)  # each rank its own batch, as a sampler would give it
        order = torch.randperm(len(inputs))
        batch = (inputs[order], targets[order])
        runners = {s: Runner(s, model, spec, batch, options["density"]) for s in options["schemes"]}
        for runner in runners.values():
            _block(runner, options["warmup"])
        samples: dict[str, list] = {s: [] for s in runners}
        for index in range(options["blocks"]):
            # alternate the order too: no scheme always runs right after the same one
            for scheme in runners if index % 2 == 0 else reversed(runners):
                samples[scheme].append(_block(runners[scheme], options["steps"]))
        equal = _same_gradients(runners, rank)
        for runner in runners.values():
            runner.close()
        memories = {scheme: runner.memory for scheme, runner in runners.items() if runner.memory}
        # what each engine's plan trial measured, so a launch says why it kept the buffers it ran
        trials = {scheme: runner.engine.plan_trial for scheme, runner in runners.items() if runner.engine is not None}
        results[name] = {"samples": samples, "equal": equal, "memories": memories, "trials": trials}
    return results


def _spawned(rank: int, world: int, port: int, options: dict[str, Any], queue) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    queue.put((rank, run_rank(rank, options)))
    dist.barrier()
    dist.destroy_process_group()


def _loopback(world: int, options: dict[str, Any]) -> dict[int, Any]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_spawned, args=(r, world, port, options, queue)) for r in range(world)]
    for p in procs:
        p.start()
    by_rank: dict[int, Any] = {}
    deadline = time.monotonic() + options["timeout"]
    while len(by_rank) < world:
        try:
            rank, result = queue.get(timeout=1.0)
        except Empty:
            # a rank that raised leaves the others blocked in a collective: stop them all, naming it
            failed = {r: p.exitcode for r, p in enumerate(procs) if p.exitcode not in (None, 0)}
            if failed or time.monotonic() > deadline:
                if failed:  # the others may be failing too, a moment behind: name every rank that does
                    grace = time.monotonic() + FAILURE_GRACE_S
                    for p in procs:
                        p.join(timeout=max(0.0, grace - time.monotonic()))
                    failed = {r: p.exitcode for r, p in enumerate(procs) if p.exitcode not in (None, 0)}
                for p in procs:
                    p.kill()
                why = f"exit codes {failed}" if failed else f"no result within {options['timeout']} s"
                raise RuntimeError(f"the ranks failed ({why}); the failing rank printed its error above") from None
            continue
        by_rank[rank] = result
    for p in procs:
        p.join()
    return by_rank


def _cluster(world: int, rate: str, options: dict[str, Any], workdir: Path) -> dict[int, Any]:
    """One rank per emulated node (experiments/cluster), each writing its results to ``workdir``."""
    from experiments.cluster import EmulatedCluster

    workdir.mkdir(parents=True, exist_ok=True)
    spec = workdir / "spec.json"
    spec.write_text(json.dumps({**options, "out": str(workdir)}))
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
           "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "experiments.side_by_side", "--as-rank", str(spec)]
    with EmulatedCluster(nodes=world, rate=rate) as cluster:
        result = cluster.run(cmd, env=env, timeout=options["timeout"], log_dir=workdir / "logs", stream=False)
    if result.returncode != 0:
        raise RuntimeError(f"the ranks failed (code {result.returncode}); logs in {workdir / 'logs'}")
    return {r: json.loads((workdir / f"rank{r}.json").read_text()) for r in range(world)}


def _as_rank(spec_path: str) -> int:
    options = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    result = run_rank(rank, options)
    Path(options["out"], f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()
    return 0


def _pair_ratio(samples: dict[str, list], field: str, num: str, den: str) -> float:
    """The median over block pairs of (num's block median) / (den's block median)."""
    def medians(scheme: str) -> list[float]:
        return [statistics.median(s[field] for s in block) for block in samples[scheme]]

    return statistics.median(a / b for a, b in zip(medians(num), medians(den)))


def _over_ranks(by_rank: dict[int, Any], name: str, fn: Callable[[dict[str, list]], float]) -> float:
    return statistics.median(fn(by_rank[r][name]["samples"]) for r in by_rank)


def summarize(by_rank: dict[int, Any], name: str, schemes: list[str]) -> dict[str, Any]:
    """Per scheme: median step wall, main-thread CPU, process CPU (ms); engine schemes also their
    compression and exposed communication (ms) and share of the step. Ratios against the first scheme."""
    first = schemes[0]
    out: dict[str, Any] = {}
    for scheme in schemes:
        def median(field: str, s: str = scheme) -> float:
            return _over_ranks(by_rank, name, lambda x: statistics.median(r[field] for b in x[s] for r in b))

        row = {"wall_ms": median("wall") * 1e3, "cpu_ms": median("cpu") * 1e3, "proc_ms": median("proc") * 1e3}
        for field in ("wall", "cpu", "proc"):
            row[f"{field}_x_{first}"] = _over_ranks(by_rank, name, lambda x, f=field, s=scheme: _pair_ratio(x, f, s, first))
        if scheme in ENGINE_SCHEMES and "ddp_powersgd" in schemes:
            # PowerSGD rank 1's step over this scheme's, per block pair (above 1: this scheme is faster)
            row["wall_x_powersgd"] = _over_ranks(by_rank, name, lambda x, s=scheme: _pair_ratio(x, "wall", "ddp_powersgd", s))
        if scheme in ENGINE_SCHEMES:
            row.update(compress_ms=median("compress") * 1e3, exposed_ms=median("exposed") * 1e3,
                       sparse=median("sparse"), buffers=median("buffers"),
                       memory=next(iter(by_rank.values()))[name].get("memories", {}).get(scheme, "-"))
            row["exposed_share"] = (row["compress_ms"] + row["exposed_ms"]) / row["wall_ms"]
            row["trial"] = by_rank[min(by_rank)][name].get("trials", {}).get(scheme)
        out[scheme] = row
    return out


def table(results: dict[str, Any], schemes: list[str]) -> list[str]:
    first = schemes[0]
    lines = [
        f"| link | workload | scheme | step ms | step / {first}'s | main-thread CPU / {first}'s | process CPU / {first}'s "
        "| compress ms | exposed comm ms | compress + exposed, share of the step | sparse tensors; buffers | memory |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for (rate, name), rows in results.items():
        for scheme in schemes:
            r = rows[scheme]
            engine = (f"{r['compress_ms']:.1f} | {r['exposed_ms']:.1f} | {r['exposed_share']:.2f} | "
                      f"{r['sparse']:.0f}; {r['buffers']:.0f} | {r['memory']}") if "compress_ms" in r else "- | - | - | - | -"
            lines.append(f"| {rate} | {name} | {scheme} | {r['wall_ms']:.1f} | {r[f'wall_x_{first}']:.3f} "
                         f"| {r[f'cpu_x_{first}']:.3f} | {r[f'proc_x_{first}']:.3f} | {engine} |")
    return lines


def overlap_targets(results: dict[str, Any], scheme: str = "ssfusion") -> list[str]:
    """Issue 14's overlap targets from one launch, where compute_only, ddp_powersgd and ``scheme`` ran:
    the step at least 0.90 of compute-only's speed, at least 1.0x PowerSGD rank 1's, compression plus
    exposed communication at most 10% of the step, CPU at most 1.15x compute-only's."""
    lines = [
        "| link | workload | of compute-only (>= 0.90) | x PowerSGD rank 1 (>= 1.0) | compress + exposed, share of the step "
        "(<= 0.10) | process CPU / compute-only's (<= 1.15) |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for (rate, name), rows in results.items():
        if not {"compute_only", "ddp_powersgd", scheme} <= set(rows):
            continue
        mine = rows[scheme]
        cells = [(1 / mine["wall_x_compute_only"], ">=", 0.90), (mine["wall_x_powersgd"], ">=", 1.0),
                 (mine["exposed_share"], "<=", 0.10), (mine["proc_x_compute_only"], "<=", 1.15)]
        shown = [f"**{v:.2f}**" if (v >= bound if op == ">=" else v <= bound) else f"{v:.2f}" for v, op, bound in cells]
        lines.append(f"| {rate} | {name} | {' | '.join(shown)} |")
    return lines if len(lines) > 2 else []


def trial_lines(results: dict[str, Any]) -> list[str]:
    """Each engine scheme's plan trial (the medians every rank agreed on), where one ran: why a cell
    ran the buffers it ran."""
    lines = []
    for (rate, name), rows in results.items():
        for scheme, row in rows.items():
            if row.get("trial"):
                trial = PlanTrial(steps=0)
                trial.load_state_dict(row["trial"])
                lines.append(f"| {rate} | {name} | {scheme} | {trial.summary()} | {row['buffers']:.0f} |")
    if not lines:
        return []
    return ["Plan trials (each window's median step, agreed over the ranks; the engine keeps the fastest plan):", "",
            "| link | workload | scheme | measured -> kept | buffers in the timed blocks |", "|---|---|---|---|---:|",
            *lines, ""]


def plot(results: dict[tuple[str, str], Any], schemes: list[str], path: Path) -> Path:
    """Bars per cell: each scheme's speed (steps a second) over the first scheme's, from the paired ratios."""
    plt = pyplot()
    cells = list(results)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.4 * len(cells) * len(schemes) / 3), 3.8))
    width = 0.8 / len(schemes)
    first = schemes[0]
    for i, scheme in enumerate(schemes):
        speeds = [1 / results[cell][scheme][f"wall_x_{first}"] for cell in cells]
        bars = ax.bar([c + (i - (len(schemes) - 1) / 2) * width for c in range(len(cells))], speeds, width, label=scheme)
        ax.bar_label(bars, fmt="%.2f", fontsize=6)
    ax.set_xticks(range(len(cells)), [f"{name}\n{rate}" for rate, name in cells], fontsize=8)
    ax.set_ylabel(f"speed / {first}'s")
    ax.set_title("schemes side by side in the same ranks (paired blocks)", fontsize=9)
    ax.legend(fontsize=7, ncol=len(schemes), loc="upper center", bbox_to_anchor=(0.5, -0.18))
    return save_figure(fig, path)


def publish(args: argparse.Namespace, results: dict[tuple[str, str], Any], equal: dict[str, bool | None]) -> Path:
    """The launch's tables (markdown) and summaries (json), named ``args.name``."""
    header = (f"`python -m experiments.side_by_side --schemes {' '.join(args.schemes)} --world {args.world} --rates "
              f"{' '.join(args.rates)} --workloads {' '.join(args.workloads)} --warmup {args.warmup} --steps {args.steps} "
              f"--blocks {args.blocks}` (the schemes' blocks alternated; one intra-op thread a rank; "
              "ratios: medians over block pairs, then over the ranks)")
    checked = [k for k, v in equal.items() if v is not None]
    verdicts = ", ".join(f"{key} {'yes' if equal[key] else 'NO'}" for key in checked)
    footer = [f"ddp and ssfusion_dense wrote the same gradients to the bit: {verdicts}"] if checked else []
    targets = overlap_targets(results) if args.schemes[0] == "compute_only" else []
    targets = ["Issue 14's overlap targets (bold: met):", "", *targets, ""] if targets else []
    folder = Path(args.out) if args.out else RESULTS
    figure = plot(results, args.schemes, folder / f"{args.name}.png")
    lines = [header, "", f"Plot: [{figure.name}]({figure.name})", "", *table(results, args.schemes), "", *targets,
             *trial_lines(results), *footer]
    path = publish_md("\n".join(lines), args.name, args.out)
    path.with_suffix(".json").write_text(json.dumps(
        {"schemes": args.schemes, "world": args.world, "equal": equal,
         "results": {f"{rate} {name}": rows for (rate, name), rows in results.items()}}, indent=1))
    return path


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["--as-rank"]:
        return _as_rank(argv[1])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--schemes", nargs="+", default=["ddp", "ssfusion_dense"], choices=SCHEMES,
                        help="the first is every ratio's reference")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--rates", nargs="+", default=["none"],
                        help="'none': loopback, no cluster; else one emulated-cluster launch per rate (root)")
    parser.add_argument("--workloads", nargs="+", default=["resnet18", "gpt2", "gpt2_10m"], choices=sorted(WORKLOADS))
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument("--warmup", type=int, default=30, help="steps of each scheme before measuring "
                        "(past an engine's profiling and plan trial: use 60 for comm=auto on a shaped link)")
    parser.add_argument("--steps", type=int, default=10, help="steps a block")
    parser.add_argument("--blocks", type=int, default=12, help="blocks of each scheme")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per cluster launch")
    parser.add_argument("--quick", action="store_true", help="the workloads' small twins (a smoke run)")
    parser.add_argument("--name", default="side_by_side")
    parser.add_argument("--out", default=None, help="folder of the tables (default: experiments/results)")
    parser.add_argument("--from-raw", action="store_true",
                        help="the tables again from <out>/<name>_raw.json (every rank's samples), no run")
    args = parser.parse_args(argv)
    if len(set(args.schemes)) != len(args.schemes) or len(args.schemes) < 2:
        parser.error(f"--schemes needs at least two different schemes, got {args.schemes}")
    options = {"schemes": args.schemes, "workloads": args.workloads, "density": args.density, "warmup": args.warmup,
               "steps": args.steps, "blocks": args.blocks, "quick": args.quick, "timeout": args.timeout}
    raw_path = Path(args.out) if args.out else RESULTS
    raw_path = raw_path / f"{args.name}_raw.json"
    raw = json.loads(raw_path.read_text()) if args.from_raw else {}
    results, equal = {}, {}
    for rate in args.rates:
        if args.from_raw:
            by_rank = {int(r): result for r, result in raw[rate].items()}
        elif rate == "none":
            by_rank = _loopback(args.world, options)
        else:
            workdir = Path(tempfile.gettempdir()) / f"side_by_side_{args.name}" / rate
            by_rank = _cluster(args.world, rate, options, workdir)
        raw[rate] = by_rank
        for name in args.workloads:
            results[(rate, name)] = summarize(by_rank, name, args.schemes)
            checks = [by_rank[r][name]["equal"] for r in by_rank]
            equal[f"{rate} {name}"] = None if None in checks else all(checks)
    if not args.from_raw:
        raw_path.parent.mkdir(parents=True, exist_ok=True)
        raw_path.write_text(json.dumps(raw))
    publish(args, results, equal)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
