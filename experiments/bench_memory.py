"""Peak memory per scheme against Lightning DDP, as multiples of the gradient size (issue 19).

    python -m experiments.bench_memory                # full run (~22 min on 2 cores): 3 workloads x 10 schemes x 2
    python -m experiments.bench_memory --quick        # smoke run (~1 min): mlp12m; ddp, ssfusion_dense, ssfusion
    python -m experiments.bench_memory --from-csv     # table, plot and REPORT.md block from memory_runs.csv
    # allocator diagnostic (~11 min): large blocks unmapped when freed, so RSS shows what is held at once
    python -m experiments.bench_memory --workloads mlp12m --malloc-mmap-threshold 131072 --name memory_mmap

Workloads: ``resnet18`` and ``gpt2`` of experiments/e2e_worker.py (the end-to-end benchmark's
models, data and optimizers, reused as they are) and ``mlp12m``, a 12.6M-parameter MLP
(768 -> 2320 -> 2320 -> 2320 -> 10, 50 MB of fp32 gradients; SGD with momentum) on the same
synthetic images; ``mlp_tiny`` (a 64-wide MLP) only serves the smoke test.

Schemes: ``ddp`` (Lightning's DDPStrategy), ``ddp_powersgd_r1`` / ``_r4`` (PowerSGD hook with error
feedback, rank 1 / 4, e2e_worker's HookedDDP), ``ssfusion_dense`` (the ssfusion preset with
sparsifier "none"), the five presets (ssfusion, safusion, adtopk, zen, oktopk, density 0.01 as in
the e2e benchmark; ssfusion with memory="residual") and ``ssfusion_dgc`` (the ssfusion preset with
memory="dgc", which its memory="auto" picks for these SGD runs).

Every run is a fresh pair of rank processes (peak RSS is per process): P = 2 on CPU, gloo over
loopback (MASTER_ADDR=127.0.0.1, a free port, ``Trainer(num_nodes=2, devices=1)`` with NODE_RANK /
WORLD_SIZE / LOCAL_RANK set by this script), one intra-op thread per rank, ``--steps`` optimizer
steps (default 20). Each rank reports its peak RSS (``getrusage(RUSAGE_SELF).ru_maxrss``), its RSS
right before ``fit`` (baseline), after the strategy's setup (train start) and after the last step,
the gradient bytes (sum of numel x element size of the parameters), the persistent error-feedback
state (the engine memory's residuals / momenta / velocities, or PowerSGD's error, P and Q
tensors), and on CUDA ``torch.cuda.max_memory_allocated``. Runs are repeated ``--repeats`` times
(default 2; all schemes once, then again) and the medians reported, for rank 0 (as in the issue).

Targets (issue 19): an engine scheme's extra peak over DDP's peak <= 1.15 x its nominal residual
state, i.e. 1 x the gradient size with memory="residual" and 2 x with memory="dgc";
``ssfusion_dense``'s peak <= 1.05 x DDP's peak. The PowerSGD rows are references (no target).

Outputs under --out (default experiments/results): memory_runs.csv (one row per run and rank),
memory.csv (the summary), memory.md (the table), memory.png (extra over DDP per scheme and workload,
in gradient sizes, target marks), and the block between the memory markers in experiments/REPORT.md.
``--from-csv`` rebuilds all but the first from the first; ``--quick`` writes to $TMPDIR/ssf_memory_quick
and leaves REPORT.md alone. ``--device cuda`` (not measured yet) runs
the ranks on GPUs and reports ``torch.cuda.max_memory_allocated`` as the peak.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from experiments.common import (
    COLORS,
    REPO,
    REPORT,
    free_port,
    median,
    num,
    pyplot,
    read_csv,
    results_dir,
    save_figure,
    update_report,
    write_csv,
)

STEM = "memory"
MiB = 1 << 20

#: the e2e benchmark's workloads (e2e_worker.WORKLOADS) plus MLPs built here
E2E_WORKLOADS = ("resnet18", "gpt2")
MLP_WORKLOADS: dict[str, dict[str, Any]] = {
    # 768*2320 + 2*2320^2 + 2320*10 weights + biases = 12,576,730 parameters (50.3 MB of fp32 gradients)
    "mlp12m": {"hidden": 2320, "depth": 3},
    "mlp_tiny": {"hidden": 64, "depth": 2},
}
MLP_DATA = {"image_size": 16, "batch_size": 32, "noise_std": 2.5}
MLP_TASK = {"optimizer": "sgd", "lr": 0.05, "momentum": 0.9, "weight_decay": 5e-4}
WORKLOADS = ("mlp12m", *E2E_WORKLOADS)  # the default set; mlp_tiny is for the smoke test

#: scheme -> (e2e_worker scheme, options: "powersgd_rank" for the hook, else SSFusionStrategy overrides)
SCHEMES: dict[str, tuple[str, dict[str, Any]]] = {
    "ddp": ("ddp", {}),
    "ddp_powersgd_r1": ("ddp_powersgd", {"powersgd_rank": 1}),
    "ddp_powersgd_r4": ("ddp_powersgd", {"powersgd_rank": 4}),
    "ssfusion_dense": ("ssfusion_dense", {}),
    # the preset's comm="auto" sends a buffer dense where sparsifying does not pay, which on this
    # benchmark's unshaped loopback link is every buffer once the costs are measured: pinned sparse,
    # so that the sparse path's memory is what is measured; the residual memory, each scheme measuring
    # one memory kind (the preset's memory="auto" picks dgc for these SGD runs: ssfusion_dgc)
    "ssfusion": ("ssfusion", {"memory": "residual", "comm_options": {"dense_fallback": False}}),
    "safusion": ("safusion", {}),
    "adtopk": ("adtopk", {}),
    "zen": ("zen", {}),
    "oktopk": ("oktopk", {}),
    "ssfusion_dgc": ("ssfusion", {"memory": "dgc", "comm_options": {"dense_fallback": False}}),
}
QUICK_SCHEMES = ("ddp", "ssfusion_dense", "ssfusion")
#: nominal persistent error-feedback state in gradient sizes, per memory kind
STATE_MULTIPLE = {"residual": 1.0, "dgc": 2.0}
EXTRA_FACTOR = 1.15  # extra peak over DDP <= 1.15 x the residual state
DENSE_FACTOR = 1.05  # the dense engine's peak <= 1.05 x DDP's peak
SCHEME_COLORS = {**COLORS, "ddp_powersgd_r1": "tab:orange", "ddp_powersgd_r4": "gold", "ssfusion_dgc": "navy"}

RUN_FIELDS = [
    "workload", "scheme", "rep", "rank", "device", "steps", "params", "grad_bytes", "state_bytes", "state_kind",
    "peak_rss_bytes", "hwm_rss_bytes", "baseline_rss_bytes", "train_start_rss_bytes", "end_rss_bytes",
    "cuda_max_allocated_bytes", "cuda_baseline_allocated_bytes", "malloc_mmap_threshold", "fit_seconds", "error",
    "end_anon_bytes", "end_file_bytes",
]
SUMMARY_FIELDS = [
    "workload", "scheme", "device", "reps", "params", "grad_mb", "peak_mb", "peak_mb_max_rank", "baseline_mb",
    "setup_growth_mb", "end_mb", "extra_mb", "extra_x_grad", "end_extra_x_grad", "state_x_grad", "target",
    "target_value", "met", "end_anon_extra_x_grad", "end_file_extra_mb",
]


# =========================================================================== one rank (in a fresh process)
def _proc_status_bytes(field: str) -> int:
    """A size field of /proc/self/status (VmRSS, VmHWM, RssAnon, RssFile) in bytes (0 where /proc is missing)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _peak_rss_bytes() -> int:
    import resource

    scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: KiB on Linux, bytes on macOS
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def _nbytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if hasattr(t, "element_size"))


def state_bytes(strategy: Any) -> tuple[int, str]:
    """Persistent error-feedback state of the strategy (bytes, kind), 0 where it keeps none."""
    engine = getattr(strategy, "engine", None)
    memory = getattr(engine, "memory", None)
    if memory is not None:
        total = sum(_nbytes(getattr(memory, name, {}).values()) for name in ("residuals", "momenta", "velocities"))
        return total, getattr(strategy, "memory_name", type(memory).__name__)
    model = getattr(strategy, "model", None)  # DDP: a PowerSGD hook's state
    for _, hook_state in getattr(model, "_comm_hooks", None) or []:
        dicts = [getattr(hook_state, name, None) for name in ("error_dict", "p_memory_dict", "q_memory_dict")]
        if any(d is not None for d in dicts):
            return sum(_nbytes(d.values()) for d in dicts if d), "powersgd"
    return 0, ""


def _mlp(inputs: int, hidden: int, depth: int, classes: int):
    from torch import nn

    layers: list[nn.Module] = [nn.Flatten()]
    width = inputs
    for _ in range(depth):
        layers += [nn.Linear(width, hidden), nn.ReLU()]
        width = hidden
    layers.append(nn.Linear(width, classes))
    return nn.Sequential(*layers)


def build_workload(name: str, seed: int):
    """(model, LightningModule, datamodule, gradient clip) of a workload; e2e ones via e2e_worker."""
    from experiments import e2e_worker

    if name in E2E_WORKLOADS:
        spec, model, task, datamodule = e2e_worker.build_workload(name, quick=False, seed=seed)
        return model, task, datamodule, 1.0 if spec["kind"] == "lm" else None
    from ssfusion_lightning.data import build_datamodule
    from ssfusion_lightning.models import ImageClassifier

    datamodule = build_datamodule("synthetic_images", **MLP_DATA, train_samples=e2e_worker.TRAIN_SAMPLES,
                                  val_samples=32, test_samples=32, seed=seed)
    channels_h_w = 3 * MLP_DATA["image_size"] ** 2
    model = _mlp(channels_h_w, MLP_WORKLOADS[name]["hidden"], MLP_WORKLOADS[name]["depth"], datamodule.num_classes)
    task = ImageClassifier(model, num_classes=datamodule.num_classes, lr_schedule="constant", **MLP_TASK)
    return model, task, datamodule, None


def make_strategy(scheme: str, device: str):
    from experiments import e2e_worker

    base, options = SCHEMES[scheme]
    options = dict(options)
    backend = {} if device == "cpu" else {"process_group_backend": os.environ.get("BENCH_MEMORY_BACKEND", "nccl")}
    if base == "ddp_powersgd":
        e2e_worker.POWERSGD_RANK = options.pop("powersgd_rank")  # read by HookedDDP.configure_ddp; one scheme per process
    if base.startswith("ddp"):
        strategy = e2e_worker.make_strategy(base)
        if backend:
            strategy._process_group_backend = backend["process_group_backend"]
        return strategy
    return e2e_worker.make_strategy(base, {**options, **backend})


def rank_main(spec: dict[str, Any]) -> int:
    """One rank of one run; writes its measurements as JSON to ``spec["out"]``."""
    import torch

    torch.set_num_threads(1)
    import lightning as L
    from lightning.pytorch.callbacks import Callback

    rank = int(os.environ["NODE_RANK"])
    device = spec["device"]
    result: dict[str, Any] = {k: spec[k] for k in ("workload", "scheme", "rep", "steps", "device")}
    result["rank"] = rank
    result["malloc_mmap_threshold"] = os.environ.get("MALLOC_MMAP_THRESHOLD_", "")
    try:
        L.seed_everything(spec.get("seed", 0), verbose=False)
        model, task, datamodule, clip = build_workload(spec["workload"], spec.get("seed", 0))
        strategy = make_strategy(spec["scheme"], device)
        marks: dict[str, int] = {}

        class Marks(Callback):
            def on_train_start(self, trainer, pl_module) -> None:
                marks["train_start"] = _proc_status_bytes("VmRSS")

            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
                marks["end"] = _proc_status_bytes("VmRSS")
                marks["end_anon"] = _proc_status_bytes("RssAnon")
                marks["end_file"] = _proc_status_bytes("RssFile")
                state, kind = state_bytes(trainer.strategy)
                if state >= marks.get("state", 0):
                    marks["state"], marks["state_kind"] = state, kind  # type: ignore[assignment]

        trainer = L.Trainer(
            accelerator="cpu" if device == "cpu" else "gpu",
            devices=1,
            num_nodes=int(os.environ["WORLD_SIZE"]),
            strategy=strategy,
            max_steps=spec["steps"],
            limit_val_batches=0,
            num_sanity_val_steps=0,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[Marks()],
            gradient_clip_val=clip,
            default_root_dir=spec["workdir"],
        )
        if device != "cpu":
            torch.cuda.reset_peak_memory_stats()
            result["cuda_baseline_allocated_bytes"] = torch.cuda.memory_allocated()
        result["baseline_rss_bytes"] = _proc_status_bytes("VmRSS")
        started = time.perf_counter()
        trainer.fit(task, datamodule=datamodule)
        result["fit_seconds"] = time.perf_counter() - started
        result["peak_rss_bytes"] = _peak_rss_bytes()
        result["hwm_rss_bytes"] = _proc_status_bytes("VmHWM")
        if device != "cpu":
            result["cuda_max_allocated_bytes"] = torch.cuda.max_memory_allocated()
        result["params"] = sum(p.numel() for p in model.parameters())
        result["grad_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
        result["train_start_rss_bytes"] = marks.get("train_start", 0)
        result["end_rss_bytes"] = marks.get("end", 0)
        result["end_anon_bytes"] = marks.get("end_anon", 0)
        result["end_file_bytes"] = marks.get("end_file", 0)
        result["state_bytes"] = marks.get("state", 0)
        result["state_kind"] = marks.get("state_kind", "")
        status = 0
    except Exception:  # noqa: BLE001 - recorded, the host reports it
        import traceback

        result["error"] = traceback.format_exc()
        status = 1
    Path(spec["out"]).write_text(json.dumps(result))
    return status


# =========================================================================== the host: one run = 2 fresh ranks
def _gpu_count() -> int:
    try:
        done = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
        return sum(1 for line in done.stdout.splitlines() if line.startswith("GPU"))
    except (OSError, subprocess.SubprocessError):
        return 0


def launch(workload: str, scheme: str, rep: int, args: argparse.Namespace, workdir: Path) -> list[dict[str, Any]]:
    """One run: ``args.world`` fresh rank processes; their records (an ``error`` key where one failed)."""
    run_dir = workdir / f"{workload}_{scheme}_{rep}"
    run_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    gpus = _gpu_count() if args.device == "cuda" else 0
    procs, outs, logs = [], [], []
    for rank in range(args.world):
        out = run_dir / f"rank{rank}.json"
        spec = {"workload": workload, "scheme": scheme, "rep": rep, "steps": args.steps, "device": args.device,
                "seed": args.seed, "out": str(out), "workdir": str(run_dir)}
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(args.world),
            "NODE_RANK": str(rank), "LOCAL_RANK": "0", "GROUP_RANK": str(rank),
            "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
        }
        env.pop("RANK", None)
        if args.malloc_mmap_threshold is not None:
            env["MALLOC_MMAP_THRESHOLD_"] = str(args.malloc_mmap_threshold)
        if args.device == "cuda" and gpus > 1:
            env["CUDA_VISIBLE_DEVICES"] = str(rank % gpus)
        elif args.device == "cuda":  # one GPU: both ranks on it, so not NCCL (it refuses a GPU twice)
            env.setdefault("BENCH_MEMORY_BACKEND", "gloo")
        log = (run_dir / f"rank{rank}.log").open("w")
        procs.append(subprocess.Popen([sys.executable, "-m", "experiments.bench_memory", "--rank-spec", json.dumps(spec)],
                                      cwd=run_dir, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        outs.append(out)
        logs.append(log)
    deadline = time.monotonic() + args.timeout
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        if any(p.poll() not in (None, 0) for p in procs):  # one rank died: the other would wait for it
            time.sleep(5)
            break
        time.sleep(0.2)
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, 9)
            p.wait()
    for log in logs:
        log.close()
    records = []
    for rank, (p, out) in enumerate(zip(procs, outs)):
        record = json.loads(out.read_text()) if out.exists() else {}
        if not record or p.returncode != 0:
            tail = (run_dir / f"rank{rank}.log").read_text()[-2000:]
            record = {"workload": workload, "scheme": scheme, "rep": rep, "rank": rank, "device": args.device,
                      "steps": args.steps, "malloc_mmap_threshold": args.malloc_mmap_threshold or "", **record, "error": record.get("error") or f"exit status {p.returncode}\n{tail}"}
        records.append(record)
    return records


def run_all(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    total = args.repeats * len(args.workloads) * len(args.schemes)
    started, done = time.monotonic(), 0
    with tempfile.TemporaryDirectory(prefix="ssf_mem_") as tmp:
        for rep in range(args.repeats):  # every scheme once, then again: drift hits all alike
            for workload in args.workloads:
                for scheme in args.schemes:
                    records = launch(workload, scheme, rep, args, Path(tmp))
                    if any("error" in r for r in records) and not args.no_retry:  # e.g. the port was taken
                        records = launch(workload, scheme, rep, args, Path(tmp))
                    rows += [run_row(r) for r in records]
                    done += 1
                    r0 = records[0]
                    what = (f"FAILED\n{next(r['error'] for r in records if 'error' in r)[-1500:]}"
                            if any("error" in r for r in records)
                            else f"peak {r0['peak_rss_bytes'] / MiB:7.1f} MB, state {r0['state_bytes'] / MiB:6.1f} MB")
                    print(f"[{time.monotonic() - started:6.0f}s {done}/{total}] {workload:<9} {scheme:<16} rep {rep}: {what}",
                          flush=True)
    return rows


def run_row(record: dict[str, Any]) -> dict[str, Any]:
    row = {f: record.get(f, "") for f in RUN_FIELDS}
    if isinstance(row["fit_seconds"], float):
        row["fit_seconds"] = f"{row['fit_seconds']:.3f}"
    if row["error"]:
        row["error"] = row["error"].strip().splitlines()[-1][:300]
    return row


# =========================================================================== summary, table, plot
def _peak(row: dict[str, str]) -> float | None:
    """The peak of one rank's run: CUDA's max allocated on a GPU, peak RSS on the CPU."""
    return num(row["cuda_max_allocated_bytes"]) if row.get("device") == "cuda" else num(row["peak_rss_bytes"])


def target_of(scheme: str) -> tuple[str, float | None]:
    """(kind, factor): ("dense", 1.05) peak / DDP peak; ("extra", x) extra over DDP / gradient size; ("", None)."""
    if scheme == "ssfusion_dense":
        return "dense", DENSE_FACTOR
    base, options = SCHEMES.get(scheme, (scheme, {}))
    if base.startswith("ddp"):
        return "", None
    return "extra", EXTRA_FACTOR * STATE_MULTIPLE[options.get("memory", "residual")]


def summarize(runs: list[dict[str, str]]) -> list[dict[str, Any]]:
    """One row per (workload, scheme): medians over the repeats of rank 0, against DDP's of the workload."""
    ok = [r for r in runs if not r.get("error")]
    keys = list(dict.fromkeys((r["workload"], r["scheme"]) for r in ok))
    order = {name: i for i, name in enumerate(SCHEMES)}
    keys.sort(key=lambda k: (_workload_order(k[0]), order.get(k[1], 99)))
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    for key in keys:
        mine = [r for r in ok if (r["workload"], r["scheme"]) == key]
        rank0 = [r for r in mine if int(r["rank"]) == 0]
        reps = sorted({r["rep"] for r in mine})
        max_rank = [max(p for r in mine if r["rep"] == rep and (p := _peak(r)) is not None) for rep in reps]
        grad = median([num(r["grad_bytes"]) for r in rank0])
        rows[key] = {
            "workload": key[0], "scheme": key[1], "device": mine[0].get("device", "cpu"), "reps": len(rank0),
            "params": int(num(rank0[0]["params"])) if rank0 else None, "grad_bytes": grad,
            "peak": median([p for r in rank0 if (p := _peak(r)) is not None]),
            "peak_max_rank": median(max_rank),
            "baseline": median([num(r["baseline_rss_bytes"]) for r in rank0]),
            "train_start": median([num(r["train_start_rss_bytes"]) for r in rank0]),
            "end": median([num(r["end_rss_bytes"]) for r in rank0]),
            "end_anon": median([v for r in rank0 if (v := num(r.get("end_anon_bytes"))) is not None]),
            "end_file": median([v for r in rank0 if (v := num(r.get("end_file_bytes"))) is not None]),
            "state": median([num(r["state_bytes"]) or 0.0 for r in rank0]),
        }
    for (workload, scheme), row in rows.items():
        ddp = rows.get((workload, "ddp"))
        grad, peak = row["grad_bytes"], row["peak"]
        row["extra"] = peak - ddp["peak"] if ddp and peak is not None and ddp["peak"] is not None else None
        row["extra_x_grad"] = row["extra"] / grad if row["extra"] is not None and grad else None
        ends = (row["end"], ddp["end"] if ddp else None)
        row["end_extra_x_grad"] = (ends[0] - ends[1]) / grad if None not in ends and all(ends) and grad else None
        row["state_x_grad"] = row["state"] / grad if grad else None
        # the RSS after the last step split: anonymous memory (tensors, heaps, stacks) against
        # file-backed pages (the code of the libraries' kernels a scheme runs, shared by the node's ranks)
        anon, file = (row["end_anon"], ddp["end_anon"] if ddp else None), (row["end_file"], ddp["end_file"] if ddp else None)
        row["end_anon_extra_x_grad"] = (anon[0] - anon[1]) / grad if None not in anon and all(anon) and grad else None
        row["end_file_extra"] = file[0] - file[1] if None not in file and all(file) else None
        kind, factor = target_of(scheme)
        row["target"], row["target_value"], row["met"] = "", None, None
        if kind == "dense" and ddp and peak is not None:
            row["target"] = f"peak <= {factor:g} x DDP"
            row["target_value"] = peak / ddp["peak"]
            row["met"] = row["target_value"] <= factor
        elif kind == "extra" and row["extra_x_grad"] is not None:
            row["target"] = f"extra <= {factor:g} x grad"
            row["target_value"] = row["extra_x_grad"]
            row["met"] = row["extra_x_grad"] <= factor
    return list(rows.values())


def _mb(value: float | None, fmt: str = "{:.1f}") -> str:
    return "" if value is None else fmt.format(value / MiB)


def _g(value: float | None, fmt: str = "{:.3g}") -> str:
    return "" if value is None else fmt.format(value)


def summary_csv_rows(summary: list[dict[str, Any]]) -> list[dict[str, str]]:
    return [{
        "workload": r["workload"], "scheme": r["scheme"], "device": r["device"], "reps": str(r["reps"]),
        "params": str(r["params"]), "grad_mb": _mb(r["grad_bytes"], "{:.3f}"), "peak_mb": _mb(r["peak"]),
        "peak_mb_max_rank": _mb(r["peak_max_rank"]), "baseline_mb": _mb(r["baseline"]),
        "setup_growth_mb": _mb(r["train_start"] - r["baseline"] if r["train_start"] and r["baseline"] else None),
        "end_mb": _mb(r["end"]), "extra_mb": _mb(r["extra"]), "extra_x_grad": _g(r["extra_x_grad"], "{:.3f}"),
        "end_extra_x_grad": _g(r["end_extra_x_grad"], "{:.3f}"),
        "state_x_grad": _g(r["state_x_grad"], "{:.3f}"), "target": r["target"],
        "target_value": _g(r["target_value"], "{:.3f}"), "met": "" if r["met"] is None else ("yes" if r["met"] else "no"),
        "end_anon_extra_x_grad": _g(r["end_anon_extra_x_grad"], "{:.3f}"), "end_file_extra_mb": _mb(r["end_file_extra"]),
    } for r in summary]


def markdown(summary: list[dict[str, Any]], runs: list[dict[str, str]]) -> str:
    """The table (memory.md and the REPORT.md block)."""
    if not summary:
        return "_no successful runs_\n"
    device = summary[0]["device"]
    peak_what = "torch.cuda.max_memory_allocated" if device == "cuda" else "peak RSS (ru_maxrss)"
    steps = sorted({r["steps"] for r in runs})
    reps = max(r["reps"] for r in summary)
    lines = [
        f"P = 2 ranks on {device.upper()}, {', '.join(steps)} steps per run, {peak_what} of rank 0, median of {reps} "
        "runs (fresh processes each). \"extra\" = peak - DDP's peak (same workload); \"after last step\": the same for "
        "the RSS after the last optimizer step (what stays resident between steps), split into anonymous memory "
        "(RssAnon: tensors, heaps, stacks) and file-backed pages (RssFile: the code of the library kernels a scheme runs, "
        "shared by the ranks of a node); gradient size = parameter bytes; "
        "residual state = the engine memory's residuals (+ momenta for dgc) after the last step (PowerSGD: its error, "
        f"P and Q tensors). Targets (issue 19): extra <= {EXTRA_FACTOR:g} x the nominal residual state "
        f"({STATE_MULTIPLE['residual']:g} x gradient with memory=\"residual\", {STATE_MULTIPLE['dgc']:g} x with \"dgc\"); "
        f"the dense engine's peak <= {DENSE_FACTOR:g} x DDP's. Allocator: {_malloc_note(runs)}.",
        "",
        "| workload | params | gradient MB |",
        "|---|---|---|",
    ]
    seen = []
    for r in summary:
        if r["workload"] not in seen:
            seen.append(r["workload"])
            lines.append(f"| {r['workload']} | {r['params'] / 1e6:.2f}M | {_mb(r['grad_bytes'])} |")
    lines += [
        "",
        "| workload | scheme | peak MB | extra over DDP MB | extra / gradient size | after last step: extra / gradient size "
        "| of which anonymous / gradient size | of which file-backed MB | residual state / gradient size | target | met |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in summary:
        target = r["target"] + (f" ({r['target_value']:.3f})" if r["target"] == f"peak <= {DENSE_FACTOR:g} x DDP" else "")
        met = "-" if r["met"] is None else ("yes" if r["met"] else "**no**")
        lines.append(
            f"| {r['workload']} | {r['scheme']} | {_mb(r['peak'])} | {_mb(r['extra'], '{:+.1f}') or '-'} | "
            f"{_g(r['extra_x_grad'], '{:+.2f}') or '-'} | {_g(r['end_extra_x_grad'], '{:+.2f}') or '-'} | "
            f"{_g(r['end_anon_extra_x_grad'], '{:+.2f}') or '-'} | {_mb(r['end_file_extra'], '{:+.1f}') or '-'} | "
            f"{_g(r['state_x_grad'], '{:.2f}') or '-'} | {target or '-'} | {met} |"
        )
    failed = [r for r in runs if r.get("error")]
    if failed:
        names = sorted({f"{r['workload']}/{r['scheme']}" for r in failed})
        lines += ["", f"Failed runs (left out): {', '.join(names)}."]
    return "\n".join(lines) + "\n"


def _malloc_note(runs: list[dict[str, str]]) -> str:
    thresholds = sorted({r.get("malloc_mmap_threshold") or "" for r in runs})
    if thresholds == [""]:
        return "glibc's default (its mmap threshold rises as large blocks are freed, so freed memory can stay resident)"
    return "MALLOC_MMAP_THRESHOLD_=" + "/".join(t or "default" for t in thresholds) + " (large blocks unmapped when freed)"


def _workload_order(name: str) -> int:
    order = [*WORKLOADS, "mlp_tiny"]
    return order.index(name) if name in order else len(order)


def plot(summary: list[dict[str, Any]], path: Path) -> Path | None:
    """Grouped bars: extra over DDP in gradient sizes, per scheme (groups) and workload (bars); target marks."""
    rows = [r for r in summary if r["scheme"] != "ddp" and r["extra_x_grad"] is not None]
    if not rows:
        return None
    plt = pyplot()
    schemes = [s for s in SCHEMES if any(r["scheme"] == s for r in rows)]
    workloads = sorted({r["workload"] for r in rows}, key=_workload_order)
    width = 0.8 / len(workloads)
    hatches = ["", "//", ".."]
    fig, ax = plt.subplots(figsize=(max(7.0, 1.1 * len(schemes) + 2), 4.8))
    for j, workload in enumerate(workloads):
        for i, scheme in enumerate(schemes):
            r = next((r for r in rows if (r["workload"], r["scheme"]) == (workload, scheme)), None)
            if r is None:
                continue
            x = i - 0.4 + width * (j + 0.5)
            ax.bar(x, r["extra_x_grad"], width, color=SCHEME_COLORS.get(scheme, "gray"), edgecolor="black",
                   linewidth=0.5, hatch=hatches[j % len(hatches)])
            kind, factor = target_of(scheme)
            if kind == "extra":
                limit = factor
            elif kind == "dense":
                ddp = next(d for d in summary if (d["workload"], d["scheme"]) == (workload, "ddp"))
                limit = (factor - 1) * ddp["peak"] / r["grad_bytes"]
            else:
                continue
            ax.hlines(limit, x - width / 2, x + width / 2, colors="red", linewidth=2)
    ax.axhline(0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(schemes)))
    ax.set_xticklabels(schemes, rotation=35, ha="right")
    ax.set_ylabel("peak - DDP's peak, in gradient sizes")
    device = rows[0]["device"]
    ax.set_title(f"Extra peak memory over DDP (P = 2, {device}, rank 0; hatch = workload, red = target)")
    from matplotlib.patches import Patch

    handles = [Patch(facecolor="white", edgecolor="black", hatch=hatches[j % len(hatches)], label=w)
               for j, w in enumerate(workloads)]
    handles.append(plt.Line2D([], [], color="red", linewidth=2, label="target"))
    ax.legend(handles=handles, fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    return save_figure(fig, path)


def analyze(out: Path, update: bool, stem: str = STEM) -> str:
    runs = read_csv(out / f"{stem}_runs.csv")
    summary = summarize(runs)
    write_csv(out / f"{stem}.csv", SUMMARY_FIELDS, summary_csv_rows(summary))
    table = markdown(summary, runs)
    (out / f"{stem}.md").write_text("# Peak memory per scheme against DDP (experiments/bench_memory.py)\n\n" + table)
    plot(summary, out / f"{stem}.png")
    if update and update_report(table, marker=stem.replace("_", "-")):
        print(f"updated the {stem.replace('_', '-')} block of {REPORT}")
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rank-spec", help=argparse.SUPPRESS)  # internal: run one rank
    parser.add_argument("--quick", action="store_true", help="smoke run: mlp12m; ddp, ssfusion_dense, ssfusion; 8 steps; 1 repeat")
    parser.add_argument("--from-csv", action="store_true", help="only rebuild memory.csv/md/png and the REPORT block")
    parser.add_argument("--workloads", nargs="+", default=None, choices=[*WORKLOADS, "mlp_tiny"])
    parser.add_argument("--schemes", nargs="+", default=None, choices=list(SCHEMES))
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per run (default 20, quick 8)")
    parser.add_argument("--repeats", type=int, default=None, help="runs per (workload, scheme) (default 2, quick 1)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--world", type=int, default=2, help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=600, help="seconds per run")
    parser.add_argument("--no-retry", action="store_true", help="do not run a failed run a second time")
    parser.add_argument("--out", type=Path, default=None, help="results directory (default experiments/results; "
                        "quick: $TMPDIR/ssf_memory_quick)")
    parser.add_argument("--malloc-mmap-threshold", type=int, default=None, metavar="BYTES",
                        help="set MALLOC_MMAP_THRESHOLD_ in the ranks: glibc then serves every allocation above BYTES "
                        "with its own mmap and unmaps it when freed, instead of raising the threshold as large "
                        "blocks are freed and keeping them in the heap (the default); a diagnostic of allocator "
                        "retention, with its own --name")
    parser.add_argument("--name", default=STEM, help=f"file stem and REPORT.md marker (default {STEM})")
    parser.add_argument("--no-report", action="store_true", help="do not update experiments/REPORT.md")
    args = parser.parse_args(argv)
    if args.rank_spec:
        return rank_main(json.loads(args.rank_spec))

    out, update = results_dir(args, "ssf_memory_quick")
    if args.from_csv:
        print(analyze(out, update, args.name))
        return 0
    args.workloads = args.workloads or (["mlp12m"] if args.quick else list(WORKLOADS))
    args.schemes = args.schemes or list(QUICK_SCHEMES if args.quick else SCHEMES)
    args.steps = args.steps or (8 if args.quick else 20)
    args.repeats = args.repeats or (1 if args.quick else 2)
    started = time.monotonic()
    rows = run_all(args)
    write_csv(out / f"{args.name}_runs.csv", RUN_FIELDS, rows)
    print(analyze(out, update, args.name))
    print(f"wrote {out}/{args.name}*.{{csv,md,png}} in {time.monotonic() - started:.0f} s")
    return 1 if any(r["error"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
