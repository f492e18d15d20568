"""One rank of the end-to-end benchmark (experiments/bench_e2e.py runs one copy per emulated node).

    python -m experiments.e2e_worker SPEC.json

The spec lists phases (one per link rate); each phase lists runs (workload x scheme x repeat).
Before a phase every rank waits for ``<ctl>/go_<i>`` (the host has set the link rate by then),
after it rank 0 writes ``<ctl>/done_<i>``, so one process launch covers every rate of a world size.
Each run is a fresh Lightning ``Trainer(num_nodes=P / L, devices=L)`` fit (L = ``LOCAL_WORLD_SIZE``,
the emulated cluster's ranks per node, 1 by default) of the workload's model with
the scheme's strategy; rank 0 appends one JSON line per run to ``spec["out"]``:

- ``step_seconds``: wall time of every optimizer step (start of one batch to the start of the next,
  so data loading, forward, backward, communication and the optimizer are all in it);
- ``step_cpu_seconds``: the CPU time the whole rank process (every thread: autograd, gloo, the
  engine's workers) spent in the same intervals. Unlike wall time it does not grow while a rank
  waits for the scheduler or the link, so it shows a scheme's own cost under outside load;
- ``rank_step_seconds``: every rank's ``step_seconds``, in rank order;
- ``engine``: per step ``strategy.last_metrics`` (bytes, compress/exposed seconds, buffers) for the
  fusion-engine schemes;
- ``hook_bytes``: per step the payload bytes of the ``torch.distributed.all_reduce`` calls made by
  a DDP comm hook (fp16, PowerSGD), counted by a wrapper, as ring bytes 2(P-1)/P * payload;
- ``eval``: rank 0's loss / accuracy on the fixed validation split after the fit (same split,
  same number of steps for every scheme); ``eval_curve``: the same after each step in
  ``run["eval_at"]`` (every rank evaluates its own model then; that time is not in ``step_seconds``).

Every rank runs one intra-op thread (``torch.set_num_threads(1)``): on the 2-core benchmark host
4 ranks already oversubscribe the cores.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

torch.set_num_threads(1)

import lightning as L  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from lightning.pytorch.callbacks import Callback  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy  # noqa: E402
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook  # noqa: E402

import ssfusion_lightning  # noqa: E402,F401 - registers the strategy names
from ssfusion_lightning import SSFusionStrategy  # noqa: E402
from ssfusion_lightning.app.builders import wire_model_kwargs  # noqa: E402
from ssfusion_lightning.data import build_datamodule  # noqa: E402
from ssfusion_lightning.models import ImageClassifier, LanguageModel, build_model  # noqa: E402
from ssfusion_lightning.presets import SYSTEM_PRESETS  # noqa: E402

# --------------------------------------------------------------------------- workloads
#: tiny twins of the paper workloads, sized so that one step is ~0.1-0.2 s of compute per rank
#: (1 thread) while dense DDP moves a few MB per step: communication-bound at ~100 Mbit/s.
WORKLOADS: dict[str, dict[str, Any]] = {
    "resnet18": {
        "kind": "image",
        "model": ("resnet18", "tiny", {"width": 16}),
        "data": ("synthetic_images", {"image_size": 16, "batch_size": 32, "noise_std": 2.5}),
        "task": {"optimizer": "sgd", "lr": 0.05, "momentum": 0.9, "weight_decay": 5e-4},
    },
    "gpt2": {
        "kind": "lm",
        "model": ("gpt2", "tiny", {"dim": 192, "depth": 3, "num_heads": 4}),
        "data": ("synthetic_tokens", {"seq_len": 32, "batch_size": 16, "branching": 4}),
        "task": {"optimizer": "adamw", "lr": 1e-3, "weight_decay": 0.01},
    },
    # the workload of at least 10M parameters (10.9M: 43 MB of fp32 gradients per step)
    "gpt2_10m": {
        "kind": "lm",
        "model": ("gpt2", "tiny", {"dim": 384, "depth": 6, "num_heads": 6}),
        "data": ("synthetic_tokens", {"seq_len": 32, "batch_size": 8, "branching": 4}),
        "task": {"optimizer": "adamw", "lr": 5e-4, "weight_decay": 0.01},
    },
    # real data (experiments/bench_tta.py; pip install .[realdata]): the UCI digits scikit-learn
    # ships, and a byte-level LM on gensim's Lee news corpus; epochs are real, so no sample counts
    "digits": {
        "kind": "image",
        "model": ("resnet18", "tiny", {}),
        "data": ("digits", {"batch_size": 32}),
        "task": {"optimizer": "sgd", "lr": 0.1, "momentum": 0.9, "weight_decay": 5e-4},
        "real": True,
    },
    "text": {
        "kind": "lm",
        "model": ("gpt2", "tiny", {}),
        "data": ("text", {"batch_size": 32, "seq_len": 64}),
        "task": {"optimizer": "adamw", "lr": 3e-3, "weight_decay": 0.01},
        "real": True,
    },
    # the same corpus and task with a wider model (964K parameters, 7.7x text's): whether 0.1% holds
    # on a larger LM (experiments/REPORT.md, "The LM at 0.1% over 300 equal steps")
    "text_wide": {
        "kind": "lm",
        "model": ("gpt2", "tiny", {"dim": 192, "depth": 2, "num_heads": 4}),
        "data": ("text", {"batch_size": 32, "seq_len": 64}),
        "task": {"optimizer": "adamw", "lr": 3e-3, "weight_decay": 0.01},
        "real": True,
    },
}
QUICK_WORKLOADS: dict[str, dict[str, Any]] = {
    "resnet18": {**WORKLOADS["resnet18"], "model": ("resnet18", "tiny", {"width": 8})},
    "gpt2": {**WORKLOADS["gpt2"], "model": ("gpt2", "tiny", {"dim": 64, "depth": 2, "num_heads": 2})},
    "gpt2_10m": {**WORKLOADS["gpt2"], "model": ("gpt2", "tiny", {"dim": 96, "depth": 2, "num_heads": 2})},
    "digits": WORKLOADS["digits"],
    "text": WORKLOADS["text"],
    "text_wide": WORKLOADS["text_wide"],
}
TRAIN_SAMPLES = 1 << 20  # never reach an epoch end
VAL_SAMPLES = 512

# --------------------------------------------------------------------------- schemes
DENSITY = 0.01
#: PowerSGD's matrix rank per scheme: 1 is PyTorch's default and the fastest (most demanding)
#: baseline, 4 the one that converges closer to dense
POWERSGD_RANKS = {"ddp_powersgd": 1, "ddp_powersgd4": 4}
#: DDP variants (Lightning's DDPStrategy, comm hook registered by this harness)
#: compute_only: communication removed (each rank keeps its local gradient, no collective at all:
#: the physical limit); compute_sync: the same plus one 1-element allreduce per step, i.e. the
#: lockstep floor (every step waits for the slowest rank, as any synchronous scheme must)
DDP_SCHEMES = ("compute_only", "compute_sync", "ddp", "ddp_fp16", "ddp_powersgd", "ddp_powersgd4")
#: fusion-engine schemes: keyword arguments of SSFusionStrategy
ENGINE_SCHEMES: dict[str, dict[str, Any]] = {
    **{name: dict(SYSTEM_PRESETS[name][1]) for name in ("ssfusion", "safusion", "adtopk", "zen", "oktopk")},
    # the engine with nothing sparsified (the ssfusion preset, sparsifier none): overhead vs DDP, so its
    # own rounds throughout (no hand-off to DDP's reducer), with the memory whose dense rounds are DDP's
    "ssfusion_dense": {**SYSTEM_PRESETS["ssfusion"][1], "sparsifier": "none", "ddp_handoff": False, "memory": "residual"},
    # the preset with its papers' residual error feedback instead of memory="auto": what auto's memory costs a step
    "ssfusion_residual": {**SYSTEM_PRESETS["ssfusion"][1], "memory": "residual"},
    # SSFusion's baselines, with SSFusion's sparsifier so that only the fusion differs
    "layerwise": {"sparsifier": "dgc", "fusion": "layerwise", "comm": "allgather", "offload": "none"},
    "behind": {"sparsifier": "dgc", "fusion": "behind", "comm": "allgather", "offload": "none"},
}
for _kwargs in ENGINE_SCHEMES.values():
    _kwargs.pop("start_method", None)
SCHEMES = (*DDP_SCHEMES, *ENGINE_SCHEMES)


def _noop_hook(state, bucket):  # no annotations: DDP checks them and they are strings here
    """Communication removed: every rank keeps its local gradient (the compute-only limit)."""
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def serialized(hook):
    """Run a comm hook (and the collectives its callbacks chain) to completion on one worker
    thread, bucket after bucket in DDP's launch order. PyTorch's PowerSGD hook issues its second
    allreduce from a future callback; with several DDP buckets on gloo the ranks then issue
    collectives in different orders and fail ("Received data size doesn't match"). Serializing
    keeps the hook overlapped with the rest of backward (the worker runs beside autograd)."""
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="e2e-hook")

    def wrapped(state, bucket):
        fut: torch.futures.Future = torch.futures.Future()

        def job() -> None:
            try:
                fut.set_result(hook(state, bucket).wait())
            except BaseException as error:  # noqa: BLE001 - hand it to DDP
                fut.set_exception(error)

        executor.submit(job)
        return fut

    wrapped.executor = executor  # type: ignore[attr-defined]
    return wrapped


def _lockstep_hook(state, bucket):
    """No gradient exchange, but one tiny blocking allreduce per step (after the last bucket)."""
    if bucket.is_last():
        dist.all_reduce(torch.zeros(1))
    return _noop_hook(state, bucket)


def register_ddp_hook(model: torch.nn.parallel.DistributedDataParallel, hook: str, powersgd_rank: int = 1):
    """Registers ``hook`` (fp16, powersgd, noop, lockstep) on a DDP model; returns the serialized
    PowerSGD hook, whose worker thread its owner shuts down, else None."""
    if hook == "fp16":
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif hook == "powersgd":
        state = powerSGD_hook.PowerSGDState(
            process_group=None,
            matrix_approximation_rank=powersgd_rank,
            start_powerSGD_iter=2,  # the minimum with error feedback (default 1000: plain allreduce)
            min_compression_rate=2,
            use_error_feedback=True,
            warm_start=True,
        )
        wrapped = serialized(powerSGD_hook.powerSGD_hook)
        model.register_comm_hook(state, wrapped)
        return wrapped
    elif hook == "noop":
        model.register_comm_hook(None, _noop_hook)
    elif hook == "lockstep":
        model.register_comm_hook(None, _lockstep_hook)
    else:
        raise ValueError(f"unknown DDP hook {hook!r}; valid choices: fp16, powersgd, noop, lockstep")
    return None


class HookedDDP(DDPStrategy):
    """Lightning's DDPStrategy with a DDP comm hook registered on CPU too (Lightning only does it on CUDA)."""

    def __init__(self, hook: str, powersgd_rank: int = 1, **kwargs: Any) -> None:
        if hook in ("noop", "lockstep"):
            kwargs.setdefault("broadcast_buffers", False)
        super().__init__(**kwargs)
        self.hook = hook
        self.powersgd_rank = powersgd_rank
        self._hook_fn = None

    def configure_ddp(self) -> None:
        super().configure_ddp()
        self._hook_fn = register_ddp_hook(self.model, self.hook, self.powersgd_rank)

    def teardown(self) -> None:
        if self._hook_fn is not None:
            self._hook_fn.executor.shutdown(wait=True)
        super().teardown()


def make_strategy(scheme: str, overrides: dict[str, Any] | None = None) -> Any:
    if scheme == "ddp":
        return DDPStrategy()
    if scheme == "compute_only":
        return HookedDDP("noop")
    if scheme == "compute_sync":
        return HookedDDP("lockstep")
    if scheme == "ddp_fp16":
        return HookedDDP("fp16")
    if scheme in POWERSGD_RANKS:
        return HookedDDP("powersgd", powersgd_rank=POWERSGD_RANKS[scheme])
    if scheme in ENGINE_SCHEMES:
        return SSFusionStrategy(**{"density": DENSITY, **ENGINE_SCHEMES[scheme], **(overrides or {})})
    raise ValueError(f"unknown scheme {scheme!r}; valid choices: {', '.join(SCHEMES)}")


# --------------------------------------------------------------------------- hook byte counter
class _AllreduceCounter:
    """Wraps torch.distributed.all_reduce to count the payload of the hooks' collectives."""

    def __init__(self) -> None:
        self.payload = 0
        self._original = dist.all_reduce

    def install(self) -> None:
        counter = self

        def all_reduce(tensor, *args, **kwargs):
            counter.payload += tensor.numel() * tensor.element_size()
            return counter._original(tensor, *args, **kwargs)

        dist.all_reduce = all_reduce

    def take(self) -> int:
        value, self.payload = self.payload, 0
        return value


COUNTER = _AllreduceCounter()


# --------------------------------------------------------------------------- per-step timing
class StepRecorder(Callback):
    """Per-step wall times, engine metrics and losses; evaluates every rank's model after the steps
    in ``eval_at`` (every rank at once, so no rank waits for rank 0) and leaves that time out of
    the step times."""

    def __init__(self, eval_at: tuple[int, ...] = (), evaluate_fn=None) -> None:
        self.eval_at = frozenset(eval_at)
        self.evaluate_fn = evaluate_fn
        self.curve: list[dict[str, float]] = []
        self.eval_seconds: dict[int, float] = {}
        self.plan: dict[str, int] = {}
        self.starts: list[float] = []
        self.end: float | None = None
        self.cpu_starts: list[float] = []
        self.cpu_end: float | None = None
        self.eval_cpu_seconds: dict[int, float] = {}
        self.engine: list[dict[str, float]] = []
        self.hook_payload: list[int] = []
        self.losses: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.starts.append(time.perf_counter())
        self.cpu_starts.append(time.process_time())
        COUNTER.take()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.end = time.perf_counter()
        self.cpu_end = time.process_time()
        self.hook_payload.append(COUNTER.take())
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        self.losses.append(float(loss) if loss is not None else float("nan"))
        metrics = getattr(trainer.strategy, "last_metrics", None)
        if metrics is not None:
            self.engine.append(metrics.as_dict())
        engine = getattr(trainer.strategy, "engine", None)
        if engine is not None:
            self.plan = plan_summary(engine)
        step = len(self.starts)
        if step in self.eval_at and self.evaluate_fn is not None:
            started, cpu_started = time.perf_counter(), time.process_time()
            self.curve.append({"step": step, **self.evaluate_fn()})
            self.eval_seconds[step - 1] = time.perf_counter() - started
            self.eval_cpu_seconds[step - 1] = time.process_time() - cpu_started


    def step_seconds(self) -> list[float]:
        return _intervals(self.starts, self.end, self.eval_seconds)

    def step_cpu_seconds(self) -> list[float]:
        return _intervals(self.cpu_starts, self.cpu_end, self.eval_cpu_seconds)


def _intervals(starts: list[float], end: float | None, excluded: dict[int, float]) -> list[float]:
    """Start of each step to the start of the next (the last: to its end), less evaluation time."""
    if not starts or end is None:
        return []
    marks = starts + [end]
    return [b - a - excluded.get(i, 0.0) for i, (a, b) in enumerate(zip(marks, marks[1:]))]


def plan_summary(engine: Any) -> dict[str, Any]:
    """Elements the engine's current plan sends dense, the planned k of its sparse tensors, the
    collective of each buffer, and the agreed costs the plan was made from."""
    try:
        plan = engine.plan
        buffers = plan.buffers
        # comm="auto" notes each buffer's choice, "dense" where its fallback sent it unsparsified
        choices = plan.notes.get("comm") or [getattr(b, "comm", "") or "" for b in buffers]
        costs = engine.costs
        return {
            "plan_buffers": len(buffers),
            "plan_dense_elements": sum(b.dense_numel for b in buffers),
            "plan_sparse_elements": sum(b.sparse_numel for b in buffers),
            "plan_sparse_k": sum(slot.k for b in buffers for slot in b.sparse_slots),
            "plan_comm": ";".join(str(c) for c in choices),
            "plan_offloaded": len(engine.offloaded_positions),
            "plan_costs": None if costs is None else {
                "allreduce": [costs.allreduce.alpha, costs.allreduce.beta],
                "allgather": [costs.allgather.alpha, costs.allgather.beta],
                "compress": [costs.compress_fixed, costs.compress_per_element],
                "buffer_overhead": costs.buffer_overhead,
                "serial_cpu": costs.serial_cpu,
                "selection_spread": costs.selection_spread,
                "dense_measured_faster": costs.dense_measured_faster,
                "fused_measured_faster": costs.fused_measured_faster,
            },
            # comm="auto"'s plan trial: its phase and the agreed median steps it measured (the key
            # is older than the trial's one-buffer phase: earlier records read alike)
            "dense_trial": engine.plan_trial,
        }
    except AttributeError:  # a changed engine API: the plan is only informative
        return {}


# --------------------------------------------------------------------------- one run
def build_workload(name: str, quick: bool, seed: int):
    spec = (QUICK_WORKLOADS if quick else WORKLOADS)[name]
    model_name, size, overrides = spec["model"]
    data_name, data_kwargs = spec["data"]
    sizes = {} if spec.get("real") else {"train_samples": TRAIN_SAMPLES, "val_samples": VAL_SAMPLES, "test_samples": 32, "seed": seed}
    datamodule = build_datamodule(data_name, **data_kwargs, **sizes)
    model = build_model(model_name, size, **wire_model_kwargs(model_name, size, overrides, datamodule))
    if spec["kind"] == "image":
        task = ImageClassifier(model, num_classes=datamodule.num_classes, lr_schedule="constant", **spec["task"])
    else:
        task = LanguageModel(model, lr_schedule="constant", **spec["task"])
    return spec, model, task, datamodule


@torch.no_grad()
def evaluate(spec: dict[str, Any], model: torch.nn.Module, datamodule) -> dict[str, float]:
    """Loss and accuracy (top-1 for images, next-token for LMs) on the whole validation split."""
    was_training = model.training
    model.eval()
    loss_sum, correct, count = 0.0, 0, 0
    for inputs, targets in datamodule.val_dataloader():
        logits = model(inputs)
        if logits.dim() > 2:
            logits, targets = logits.flatten(0, 1), targets.flatten()
        keep = targets >= 0
        logits, targets = logits[keep], targets[keep]
        loss_sum += float(F.cross_entropy(logits, targets, reduction="sum"))
        correct += int((logits.argmax(-1) == targets).sum())
        count += int(targets.numel())
    model.train(was_training)
    return {"val_loss": loss_sum / max(1, count), "val_acc": correct / max(1, count)}


#: the LMs clip the synchronized gradient's norm, as their recipes do
LM_CLIP_NORM = 1.0


def clipping(spec: dict[str, Any], overrides: dict[str, Any] | None) -> tuple[dict[str, Any] | None, float | None]:
    """The strategy overrides and the Trainer's ``gradient_clip_val`` for the workload. An LM clips
    the synchronized gradient; with memory="adam", which sends updates, the same norm clips each
    rank's gradient before its moments instead (the memory's local clipping)."""
    if spec["kind"] != "lm":
        return overrides, None
    if (overrides or {}).get("memory") != "adam":
        return overrides, LM_CLIP_NORM
    options = {"clip_norm": LM_CLIP_NORM, **overrides.get("memory_options", {})}
    return {**overrides, "memory_options": options}, None


def run_one(run: dict[str, Any], world: int, quick: bool) -> dict[str, Any]:
    L.seed_everything(run.get("seed", 0), verbose=False)
    spec, model, task, datamodule = build_workload(run["workload"], quick, run.get("seed", 0))
    eval_at = tuple(run.get("eval_at") or ())
    recorder = StepRecorder(eval_at, lambda: evaluate(spec, model, datamodule))
    # the emulated cluster's layout: LOCAL_WORLD_SIZE ranks share each node (its namespace)
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    overrides, clip = clipping(spec, run.get("overrides"))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=per_node,
        num_nodes=world // per_node,
        strategy=make_strategy(run["scheme"], overrides),
        max_steps=run["steps"],
        limit_val_batches=0,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[recorder],
        gradient_clip_val=clip,
    )
    started = time.perf_counter()
    trainer.fit(task, datamodule=datamodule)
    fit_seconds = time.perf_counter() - started
    result = {
        **run,
        "world": world,
        "ranks_per_node": per_node,
        "params": sum(p.numel() for p in model.parameters()),
        "param_tensors": sum(1 for _ in model.parameters()),
        "per_rank_batch": datamodule.batch_size,
        "step_seconds": recorder.step_seconds(),
        "step_cpu_seconds": recorder.step_cpu_seconds(),
        "engine": recorder.engine if run["scheme"] in ENGINE_SCHEMES else [],
        "hook_payload": recorder.hook_payload if run["scheme"] in ("ddp_fp16", *POWERSGD_RANKS) else [],
        "fit_seconds": fit_seconds,
        "train_loss": recorder.losses,
        **recorder.plan,
    }
    # every rank's steps: a decision agreed over the ranks (the plan trial's mean of their medians)
    # depends on ranks other than rank 0, whose steps are the ones above
    rank_steps: list[list[float] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(rank_steps, result["step_seconds"])
    result["rank_step_seconds"] = rank_steps
    if run.get("eval") and dist.get_rank() == 0:
        final = recorder.curve[-1] if recorder.curve else {}
        result["eval"] = final if final.get("step") == run["steps"] else evaluate(spec, model, datamodule)
        result["eval_curve"] = recorder.curve
    return result


# --------------------------------------------------------------------------- phases
def _wait_for(path: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {path} after {timeout:.0f} s")
        time.sleep(0.05)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    spec = json.loads(Path(argv[0]).read_text())
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", os.environ.get("NODE_RANK", "0")))
    if spec.get("nice"):
        try:
            os.setpriority(os.PRIO_PROCESS, 0, int(spec["nice"]))  # threads started later inherit it
        except OSError as error:  # not permitted: run at the default priority
            print(f"[e2e rank {rank}] cannot set niceness {spec['nice']}: {error}", flush=True)
    dist.init_process_group("gloo", timeout=timedelta(seconds=spec.get("collective_timeout", 600)))
    COUNTER.install()
    ctl = Path(spec["ctl"])
    out = Path(spec["out"])
    quick = bool(spec.get("quick"))
    status = 0
    for index, phase in enumerate(spec["phases"]):
        _wait_for(ctl / f"go_{index}", spec.get("phase_timeout", 900))
        dist.barrier()
        for run in phase["runs"]:
            run = {**run, "phase": phase["label"]}
            try:
                result = run_one(run, world, quick)
            except Exception:  # noqa: BLE001 - record it; the ranks are out of step now, so stop
                result = {**run, "world": world, "error": traceback.format_exc()}
                status = 1
            if rank == 0:
                with out.open("a") as f:
                    f.write(json.dumps(result) + "\n")
            print(f"[e2e rank {rank}] {phase['label']} {run['workload']} {run['scheme']} "
                  f"{'FAILED' if 'error' in result else 'ok'}", flush=True)
            if status:
                break
        if status:
            break
        dist.barrier()
        if rank == 0:
            (ctl / f"done_{index}").write_text("ok")
    if rank == 0 and status:
        (ctl / "failed").write_text("a run failed; see the worker logs")
    dist.destroy_process_group()
    return status


if __name__ == "__main__":
    sys.exit(main())
