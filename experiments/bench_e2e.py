"""End-to-end benchmark on the emulated cluster: DDP (dense, fp16 hook, PowerSGD hook) versus the
fusion-engine schemes (ssfusion, safusion, adtopk, zen, oktopk, layerwise, behind), per link rate.

    python -m experiments.bench_e2e                 # full run (~20-25 min on 2 cores): P = 2, 4
    python -m experiments.bench_e2e --quick         # smoke run (~2-3 min): P = 2, smaller models
    python -m experiments.bench_e2e --from-csv      # tables, plots and REPORT.md block from the CSVs

For each world size P one process per emulated node is started once (experiments/e2e_worker.py);
the link rate changes between phases (unshaped first, then slower and slower links) and every
phase runs every workload x scheme as a fresh Lightning fit, side by side under the same load.

Per (P, rate, workload, scheme) it reports the median step time over the measured steps (the
first ``--warmup`` steps are dropped: the engine rebuilds its plan after step 0 and profiles
steps 1-3), samples/s, the time split (compute = the ``compute_only`` run of the same phase;
compression and exposed communication from ``strategy.last_metrics``; for the DDP variants the
exposed communication is step - compute), bytes per step, and after the long runs of the first
(unshaped) phase of the largest P the validation loss / accuracy reached after the same steps.

Outputs under --out (default experiments/results): e2e_steps.csv (every step of every run),
e2e_runs.csv (one row per run), e2e.csv/e2e.md (summary), e2e_targets.csv/md (targets),
e2e_throughput.png, e2e_breakdown.png, and the block between the e2e markers in
experiments/REPORT.md. ``--from-csv`` rebuilds all but the first two from the first two.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import statistics
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterable

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
RESULTS = HERE / "results"
REPORT = HERE / "REPORT.md"

DDP_SCHEMES = ("compute_only", "compute_sync", "ddp", "ddp_fp16", "ddp_powersgd", "ddp_powersgd4")
ENGINE_SCHEMES = ("ssfusion", "ssfusion_dense", "safusion", "adtopk", "zen", "oktopk", "layerwise", "behind")
SCHEMES = DDP_SCHEMES + ENGINE_SCHEMES
#: schemes trained for --acc-steps in the accuracy phase (the others do not train a shared model)
ACCURACY_SCHEMES = tuple(s for s in SCHEMES if s not in ("compute_only", "compute_sync", "ssfusion_dense"))
HOOKS = ("ddp_fp16", "ddp_powersgd", "ddp_powersgd4")
DEFAULT_RATES = ["none", "150mbit", "40mbit"]
WORKLOADS = ("resnet18", "gpt2", "gpt2_10m")

STEP_FIELDS = [
    "world", "rate", "workload", "scheme", "rep", "step", "seconds", "cpu_seconds", "bytes_sent", "bytes_received",
    "dense_equivalent_bytes", "compress_seconds", "exposed_comm_seconds", "buffers", "dense_tensors",
    "sparse_tensors", "hook_payload_bytes", "train_loss",
]
RUN_FIELDS = [
    "world", "rate", "workload", "scheme", "rep", "steps", "warmup", "params", "param_tensors",
    "per_rank_batch", "fit_seconds", "val_loss", "val_acc", "plan_buffers", "plan_dense_elements",
    "plan_sparse_elements", "plan_sparse_k", "elements_sent", "error",
]
SUMMARY_FIELDS = [
    "world", "rate", "rate_mbit", "workload", "scheme", "steps_measured", "step_ms", "step_p25_ms", "step_p75_ms",
    "step_cpu_ms", "samples_per_s", "compute_ms", "lockstep_ms", "compress_ms", "exposed_comm_ms", "other_ms", "comm_fraction",
    "bytes_per_step", "dense_bytes_per_step", "x_ddp", "x_best_hook", "of_compute", "val_acc", "val_loss",
    "train_loss_end",
]
CURVE_FIELDS = ["world", "rate", "workload", "scheme", "rep", "step", "val_loss", "val_acc"]
TARGET_FIELDS = ["world", "workload", "check", "rate", "value", "target", "met", "note"]


# =========================================================================== running
def rate_mbit(rate: str) -> float:
    """Link rate in Mbit/s; inf for an unshaped link."""
    if rate in ("none", "", None):
        return math.inf
    from experiments.cluster.units import parse_rate

    return parse_rate(rate) / 1e6


def rate_label(rate: str) -> str:
    return "unshaped" if rate_mbit(rate) == math.inf else rate


#: warm-up steps of the DDP variants (DDP rebuilds its buckets after step 0; PowerSGD starts at step 2)
DDP_WARMUP = 3
#: schemes of the target checks: run --key-repeats times (interleaved) on the slowest link and,
#: for the engine-overhead check (ssfusion_dense vs ddp), on the unshaped one
KEY_SCHEMES = ("compute_only", "compute_sync", "ddp", "ddp_fp16", "ddp_powersgd", "ddp_powersgd4", "ssfusion", "ssfusion_dense")


def build_phases(world: int, args: argparse.Namespace, accuracy_world: int) -> list[dict[str, Any]]:
    rates = args.rates if world == accuracy_world else (args.small_rates or args.rates)
    slowest = min(rates, key=rate_mbit)
    phases = []
    for index, rate in enumerate(rates):
        accuracy = index == 0 and world == accuracy_world and args.acc_steps > 0
        runs = []
        for workload in args.workloads:
            keyed = rate == slowest or rate_mbit(rate) == math.inf
            repeats = max(args.repeats, args.key_repeats if keyed else 1)
            for rep in range(repeats):
                for scheme in args.schemes:
                    if rep >= args.repeats and scheme not in KEY_SCHEMES:
                        continue
                    if scheme == "ssfusion_dense" and rate_mbit(rate) != math.inf:
                        continue  # the engine-overhead check runs on the unshaped link only
                    long = accuracy and scheme in ACCURACY_SCHEMES and rep == 0
                    # DDP needs fewer warm-up steps than the engine (bucket rebuild after step 0,
                    # PowerSGD from step 2): the same number of measured steps, fewer slow steps
                    warmup = min(args.warmup, DDP_WARMUP) if scheme in DDP_SCHEMES else args.warmup
                    steps = args.acc_steps if long else args.steps - (args.warmup - warmup)
                    run = {
                        "workload": workload, "scheme": scheme, "rep": rep, "seed": args.seed,
                        "steps": steps, "warmup": warmup, "eval": long,
                    }
                    if long:
                        run["eval_at"] = eval_points(args.acc_steps, args.eval_every)
                    if scheme in ENGINE_SCHEMES and args.engine_options:
                        run["overrides"] = args.engine_options
                    runs.append(run)
        phases.append({"label": rate, "runs": runs})
    return phases


def eval_points(steps: int, every: int) -> list[int]:
    """Steps after which the accuracy runs evaluate: every ``every`` steps and the last one."""
    return sorted({*range(every, steps, every), steps}) if every > 0 else [steps]


def run_world(world: int, phases: list[dict[str, Any]], args: argparse.Namespace, workdir: Path,
              ranks_per_node: int = 1) -> list[dict[str, Any]]:
    """One launch of P ranks on the emulated cluster; the host sets each phase's rate.
    ``ranks_per_node``: P / that many emulated nodes, each hosting that many ranks (a fast
    unshaped path between them, one shaped link per node)."""
    from experiments.cluster import EmulatedCluster

    ctl = workdir / (f"P{world}" if ranks_per_node == 1 else f"P{world}x{ranks_per_node}")
    ctl.mkdir(parents=True, exist_ok=True)
    out = ctl / "runs.jsonl"
    spec = {"ctl": str(ctl), "out": str(out), "quick": args.quick, "phases": phases, "phase_timeout": args.timeout,
            "nice": args.nice}
    (ctl / "spec.json").write_text(json.dumps(spec, indent=1))
    env = {
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
    }
    cmd = [sys.executable, "-m", "experiments.e2e_worker", str(ctl / "spec.json")]
    total = sum(len(p["runs"]) for p in phases)
    print(f"== P={world}: {len(phases)} phases, {total} runs (logs: {ctl / 'logs'})", flush=True)
    started = time.monotonic()
    with EmulatedCluster(nodes=world // ranks_per_node, rate=phases[0]["label"], delay=args.delay,
                         ranks_per_node=ranks_per_node) as cluster:
        box: dict[str, Any] = {}
        thread = threading.Thread(
            target=lambda: box.setdefault(
                "result", cluster.run(cmd, env=env, timeout=args.timeout, log_dir=ctl / "logs", stream=False)
            ),
            daemon=True,
        )
        thread.start()
        seen = 0
        for index, phase in enumerate(phases):
            cluster.set_rate(phase["label"])
            (ctl / f"go_{index}").write_text("go")
            while not (ctl / f"done_{index}").exists():
                seen = _progress(out, seen, started)
                if not thread.is_alive() or (ctl / "failed").exists():
                    break
                time.sleep(0.25)
            else:
                continue
            break
        thread.join()
        _progress(out, seen, started)
    result = box.get("result")
    runs = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    if result is None or result.returncode != 0 or len(runs) < total:
        tail = result.log(0)[-3000:] if result is not None else ""
        print(f"!! P={world}: rc={getattr(result, 'returncode', None)}, {len(runs)}/{total} runs recorded\n{tail}", flush=True)
    return runs


def _progress(out: Path, seen: int, started: float) -> int:
    if not out.exists():
        return seen
    lines = out.read_text().splitlines()
    for line in lines[seen:]:
        run = json.loads(line)
        if "error" in run:
            print(f"  [{time.monotonic() - started:6.0f}s] {run['phase']:>9} {run['workload']:<9} {run['scheme']:<15} "
                  f"FAILED\n{run['error'][-1500:]}", flush=True)
            continue
        measured = run["step_seconds"][run["warmup"]:] or run["step_seconds"]
        print(f"  [{time.monotonic() - started:6.0f}s] {rate_label(run['phase']):>9} {run['workload']:<9} "
              f"{run['scheme']:<15} {statistics.median(measured) * 1e3:8.1f} ms/step", flush=True)
    return len(lines)


# =========================================================================== raw CSVs
def raw_rows(runs: Iterable[dict[str, Any]]) -> tuple[list[dict], list[dict]]:
    steps, rows = [], []
    for run in runs:
        key = {k: run[k] for k in ("world", "workload", "scheme", "rep")}
        key["rate"] = run["phase"]
        ev = run.get("eval") or {}
        rows.append({
            **key, "steps": run["steps"], "warmup": run["warmup"], "params": run.get("params", ""),
            "param_tensors": run.get("param_tensors", ""), "per_rank_batch": run.get("per_rank_batch", ""),
            "fit_seconds": _fmt(run.get("fit_seconds")), "val_loss": _fmt(ev.get("val_loss")),
            "val_acc": _fmt(ev.get("val_acc")),
            **{f: run.get(f, "") for f in ("plan_buffers", "plan_dense_elements", "plan_sparse_elements", "plan_sparse_k")},
            # elements this rank sent per step (dense part + selected), median over the measured steps
            "elements_sent": _fmt(_median([m["elements_sent"] for m in (run.get("engine") or [])[run["warmup"]:]
                                           if "elements_sent" in m])),
            "error": run["error"].strip().splitlines()[-1] if run.get("error") else "",
        })
        engine = run.get("engine") or []
        hook = run.get("hook_payload") or []
        losses = run.get("train_loss") or []
        cpu = run.get("step_cpu_seconds") or []
        for step, seconds in enumerate(run.get("step_seconds") or []):
            m = engine[step] if step < len(engine) else {}
            steps.append({
                **key, "step": step, "seconds": f"{seconds:.6f}",
                "cpu_seconds": f"{cpu[step]:.6f}" if step < len(cpu) else "",
                **{f: _fmt(m.get(f)) for f in ("bytes_sent", "bytes_received", "dense_equivalent_bytes",
                                              "compress_seconds", "exposed_comm_seconds", "buffers",
                                              "dense_tensors", "sparse_tensors")},
                "hook_payload_bytes": hook[step] if step < len(hook) else "",
                "train_loss": _fmt(losses[step]) if step < len(losses) else "",
            })
    return steps, rows


def curve_rows(runs: Iterable[dict[str, Any]]) -> list[dict]:
    """Validation loss / accuracy at each evaluation point of the accuracy runs."""
    return [
        {"world": run["world"], "rate": run["phase"], "workload": run["workload"], "scheme": run["scheme"],
         "rep": run["rep"], "step": point["step"], "val_loss": _fmt(point["val_loss"]), "val_acc": _fmt(point["val_acc"])}
        for run in runs
        for point in run.get("eval_curve") or []
    ]


def _fmt(value: Any) -> str:
    if value is None or value == "":
        return ""
    if isinstance(value, float):
        return f"{value:.6g}" if not value.is_integer() else str(int(value))
    return str(value)


def write_csv(path: Path, fields: list[str], rows: list[dict]) -> None:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


def read_csv(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


# =========================================================================== summary
def ring_bytes(payload: float, world: int) -> float:
    return 2 * (world - 1) / world * payload if world > 1 else 0.0


def _num(value: str) -> float | None:
    return float(value) if value not in ("", None) else None


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    pos = q * (len(values) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return values[lo] + (values[hi] - values[lo]) * (pos - lo)


def summarize(steps: list[dict[str, str]], runs: list[dict[str, str]]) -> list[dict[str, Any]]:
    """One row per (world, rate, workload, scheme), from the raw CSV rows."""
    warmup = {(r["world"], r["rate"], r["workload"], r["scheme"], r["rep"]): int(r["warmup"]) for r in runs}
    info: dict[tuple, dict[str, str]] = {}
    for r in runs:
        key = (r["world"], r["rate"], r["workload"], r["scheme"])
        if r["error"]:
            continue
        if key not in info or r["val_acc"]:
            info[key] = r
    measured: dict[tuple, list[dict[str, str]]] = defaultdict(list)
    for s in steps:
        key5 = (s["world"], s["rate"], s["workload"], s["scheme"], s["rep"])
        if int(s["step"]) >= warmup.get(key5, 0):
            measured[key5[:4]].append(s)

    rows: dict[tuple, dict[str, Any]] = {}
    for key, items in measured.items():
        world, rate, workload, scheme = key
        run = info.get(key)
        if run is None:
            continue
        P = int(world)
        seconds = [float(s["seconds"]) for s in items]
        step = statistics.median(seconds)
        params = int(run["params"])
        dense = ring_bytes(params * 4, P)
        if scheme in ENGINE_SCHEMES:
            sent = _median([v for s in items if (v := _num(s["bytes_sent"])) is not None])
        elif scheme in HOOKS:
            sent = _median([ring_bytes(v, P) for s in items if (v := _num(s["hook_payload_bytes"])) is not None])
        elif scheme == "ddp":
            sent = dense
        else:
            sent = 0.0
        rows[key] = {
            "world": P, "rate": rate, "rate_mbit": rate_mbit(rate), "workload": workload, "scheme": scheme,
            "steps_measured": len(seconds), "step_s": step,
            "step_p25_s": _quantile(seconds, 0.25), "step_p75_s": _quantile(seconds, 0.75),
            "step_cpu_s": _median([v for s in items if (v := _num(s.get("cpu_seconds"))) is not None]),
            "samples_per_s": P * int(run["per_rank_batch"]) / step,
            "compress_s": _median([v for s in items if (v := _num(s["compress_seconds"])) is not None]),
            "exposed_engine_s": _median([v for s in items if (v := _num(s["exposed_comm_seconds"])) is not None]),
            "bytes_per_step": sent, "dense_bytes_per_step": dense,
            "val_acc": _num(run["val_acc"]), "val_loss": _num(run["val_loss"]),
            "train_loss_end": _train_loss_end(items) if run["val_acc"] else None,
            "run_steps": int(run["steps"]),
        }
    # Without communication the link does not matter: the compute references pool every phase's
    # compute_only / compute_sync steps of a (P, workload), robust to one phase run under another
    # job's load.
    pooled: dict[tuple, dict[str, float]] = {}
    for scheme in ("compute_only", "compute_sync"):
        samples: dict[tuple, list[float]] = defaultdict(list)
        for (world, _rate, workload, s), items in measured.items():
            if s == scheme:
                samples[(world, workload)] += [float(i["seconds"]) for i in items]
        for key, values in samples.items():
            pooled.setdefault(key, {})[scheme] = statistics.median(values)
    out = []
    for key, row in rows.items():
        world, rate, workload, scheme = key
        group = lambda s: rows.get((world, rate, workload, s))  # noqa: E731
        ref = pooled.get((str(row["world"]), workload), {})
        compute = {"step_s": ref["compute_only"]} if "compute_only" in ref else None
        lockstep = {"step_s": ref["compute_sync"]} if "compute_sync" in ref else None
        ddp = group("ddp")
        hooks = [h for h in (group(s) for s in HOOKS) if h is not None]
        row["compute_s"] = compute["step_s"] if compute else None
        row["lockstep_s"] = lockstep["step_s"] if lockstep else None
        if scheme in ENGINE_SCHEMES:
            row["exposed_comm_s"] = row["exposed_engine_s"]
        elif scheme in ("ddp", *HOOKS) and compute:
            row["exposed_comm_s"] = max(0.0, row["step_s"] - compute["step_s"])
            row["compress_s"] = None
        else:
            row["exposed_comm_s"] = None
            row["compress_s"] = None
        if compute and row["exposed_comm_s"] is not None:
            row["other_s"] = row["step_s"] - compute["step_s"] - row["exposed_comm_s"] - (row["compress_s"] or 0.0)
        else:
            row["other_s"] = None
        row["comm_fraction"] = row["exposed_comm_s"] / row["step_s"] if row["exposed_comm_s"] is not None else None
        row["x_ddp"] = ddp["step_s"] / row["step_s"] if ddp else None
        row["x_best_hook"] = min(h["step_s"] for h in hooks) / row["step_s"] if hooks else None
        row["of_compute"] = compute["step_s"] / row["step_s"] if compute else None
        out.append(row)
    order = {s: i for i, s in enumerate(SCHEMES)}
    out.sort(key=lambda r: (r["world"], -r["rate_mbit"], r["workload"], order.get(r["scheme"], 99)))
    return out


def _train_loss_end(items: list[dict[str, str]]) -> float | None:
    """Mean training loss of the last 5 steps of rep 0 (the accuracy run)."""
    losses = sorted((int(s["step"]), float(s["train_loss"])) for s in items if s["rep"] == "0" and s.get("train_loss"))
    return statistics.mean(v for _, v in losses[-5:]) if losses else None


def summary_csv_rows(summary: list[dict[str, Any]]) -> list[dict[str, str]]:
    rows = []
    for r in summary:
        ms = lambda k: "" if r.get(k) is None else f"{r[k] * 1e3:.2f}"  # noqa: E731
        num = lambda k, f="{:.4g}": "" if r.get(k) is None else f.format(r[k])  # noqa: E731
        rows.append({
            "world": r["world"], "rate": rate_label(r["rate"]),
            "rate_mbit": "inf" if r["rate_mbit"] == math.inf else f"{r['rate_mbit']:g}",
            "workload": r["workload"], "scheme": r["scheme"], "steps_measured": r["steps_measured"],
            "step_ms": ms("step_s"), "step_p25_ms": ms("step_p25_s"), "step_p75_ms": ms("step_p75_s"),
            "step_cpu_ms": ms("step_cpu_s"), "samples_per_s": num("samples_per_s", "{:.1f}"), "compute_ms": ms("compute_s"),
            "lockstep_ms": ms("lockstep_s"), "compress_ms": ms("compress_s"), "exposed_comm_ms": ms("exposed_comm_s"),
            "other_ms": ms("other_s"), "comm_fraction": num("comm_fraction", "{:.3f}"),
            "bytes_per_step": num("bytes_per_step", "{:.0f}"), "dense_bytes_per_step": num("dense_bytes_per_step", "{:.0f}"),
            "x_ddp": num("x_ddp", "{:.3f}"), "x_best_hook": num("x_best_hook", "{:.3f}"),
            "of_compute": num("of_compute", "{:.3f}"), "val_acc": num("val_acc", "{:.4f}"),
            "val_loss": num("val_loss", "{:.4f}"), "train_loss_end": num("train_loss_end", "{:.4f}"),
        })
    return rows


# =========================================================================== targets
def qualifying_rates(summary: list[dict[str, Any]], world: int, workload: str) -> tuple[list[str], bool]:
    """Shaped links at which dense DDP spends >= 2/3 of its step communicating, fastest first
    (``False`` and only the slowest link when no measured rate qualifies)."""
    ddp = [r for r in summary if r["world"] == world and r["workload"] == workload and r["scheme"] == "ddp"
           and r["comm_fraction"] is not None and r["rate_mbit"] != math.inf]
    if not ddp:
        return [], False
    bound = sorted((r for r in ddp if r["comm_fraction"] >= 2 / 3), key=lambda r: -r["rate_mbit"])
    if bound:
        return [r["rate"] for r in bound], True
    return [min(ddp, key=lambda r: r["rate_mbit"])["rate"]], False


def headline_rate(summary: list[dict[str, Any]], world: int, workload: str) -> tuple[str | None, bool]:
    """The slowest qualifying link (the most communication-bound one, where the target schemes
    ran --key-repeats times); see ``qualifying_rates``."""
    rates, bound = qualifying_rates(summary, world, workload)
    return (rates[-1] if rates else None), bound


def targets(summary: list[dict[str, Any]]) -> list[dict[str, Any]]:
    find = {(r["world"], r["rate"], r["workload"], r["scheme"]): r for r in summary}
    worlds = sorted({r["world"] for r in summary})
    workloads = [w for w in WORKLOADS if any(r["workload"] == w for r in summary)] + sorted(
        {r["workload"] for r in summary} - set(WORKLOADS))
    out = []

    def add(world, workload, check, rate, value, target, met, note=""):
        out.append({"world": world, "workload": workload, "check": check, "rate": rate_label(rate) if rate else "",
                    "value": value, "target": target, "met": met, "note": note})

    for world in worlds:
        for workload in workloads:
            rates, bound = qualifying_rates(summary, world, workload)
            for rate in rates:
                ddp = find.get((world, rate, workload, "ddp"))
                ssf = find.get((world, rate, workload, "ssfusion"))
                note = f"DDP comm fraction {ddp['comm_fraction']:.2f}" + ("" if bound else " (< 2/3 at every measured rate)")
                add(world, workload, "ddp_comm_fraction", rate, ddp["comm_fraction"], ">= 0.667", bound, "")
                if ssf:
                    add(world, workload, "ssfusion_x_ddp", rate, ssf["x_ddp"], ">= 2.5", ssf["x_ddp"] >= 2.5, note)
                    hooks = [find.get((world, rate, workload, h)) for h in HOOKS]
                    best = min((h for h in hooks if h), key=lambda h: h["step_s"], default=None)
                    add(world, workload, "ssfusion_x_best_hook", rate, ssf["x_best_hook"], ">= 1.3",
                        ssf["x_best_hook"] is not None and ssf["x_best_hook"] >= 1.3,
                        f"best hook: {best['scheme']}" if best else "")
                    add(world, workload, "ssfusion_of_compute", rate, ssf["of_compute"], ">= 0.8",
                        ssf["of_compute"] >= 0.8,
                        f"compute {ssf['compute_s'] * 1e3:.0f} ms, lockstep floor "
                        f"{(ssf['lockstep_s'] or 0) * 1e3:.0f} ms, compress {(ssf['compress_s'] or 0) * 1e3:.0f} ms, "
                        f"exposed comm {(ssf['exposed_comm_s'] or 0) * 1e3:.0f} ms, other {(ssf['other_s'] or 0) * 1e3:.0f} ms "
                        f"of {ssf['step_s'] * 1e3:.0f} ms")
            acc = [r for r in summary if r["world"] == world and r["workload"] == workload and r["val_acc"] is not None]
            ddp_acc = next((r for r in acc if r["scheme"] == "ddp"), None)
            ssf_acc = next((r for r in acc if r["scheme"] == "ssfusion"), None)
            if ddp_acc and ssf_acc:
                delta = 100 * (ssf_acc["val_acc"] - ddp_acc["val_acc"])
                add(world, workload, "ssfusion_acc_minus_ddp_points", ssf_acc["rate"], delta, ">= -1", delta >= -1,
                    f"val acc {ssf_acc['val_acc']:.4f} vs {ddp_acc['val_acc']:.4f}; val loss "
                    f"{ssf_acc['val_loss']:.3f} vs {ddp_acc['val_loss']:.3f}")
            for r in summary:
                if (r["world"], r["workload"], r["scheme"]) == (world, workload, "ssfusion_dense") and r["rate_mbit"] == math.inf:
                    ddp = find.get((world, r["rate"], workload, "ddp"))
                    if ddp:
                        ratio = r["step_s"] / ddp["step_s"]
                        cpu = (
                            f"; CPU time per step {r['step_cpu_s'] / ddp['step_cpu_s']:.3f}x "
                            f"({r['step_cpu_s'] * 1e3:.1f} vs {ddp['step_cpu_s'] * 1e3:.1f} ms)"
                            if r.get("step_cpu_s") and ddp.get("step_cpu_s") else ""
                        )
                        add(world, workload, "dense_engine_step_over_ddp", r["rate"], ratio, "<= 1.1", ratio <= 1.1,
                            f"{r['step_s'] * 1e3:.1f} ms vs {ddp['step_s'] * 1e3:.1f} ms{cpu}")
    return out


def target_csv_rows(rows: list[dict[str, Any]]) -> list[dict[str, str]]:
    return [{**r, "value": f"{r['value']:.3f}" if r["value"] is not None else "", "met": "yes" if r["met"] else "no"}
            for r in rows]


# =========================================================================== Markdown
def _cell(value: Any, fmt: str = "{:.3g}") -> str:
    if value is None or value == "":
        return ""
    return fmt.format(value) if isinstance(value, (int, float)) else str(value)


def summary_markdown(summary: list[dict[str, Any]]) -> str:
    lines = ["# End-to-end benchmark (emulated cluster)", "",
             "Median step time over the measured steps; compute = the `compute_only` steps (communication "
             "removed) of every phase of this P, pooled; lockstep = `compute_sync` likewise (no payload, one tiny "
             "allreduce per step); the `compute_only` row itself shows its own phase's median; "
             "compress and exposed comm from `strategy.last_metrics` (engine schemes) or step - compute (DDP "
             "variants, hook compute included); other = step - compute - compress - exposed (negative: overlap). "
             "Bytes: sent per rank per step (DDP: ring 2(P-1)/P x payload). x ddp / x hook: throughput over "
             "Lightning `ddp` / over the faster of the fp16 and PowerSGD hooks in the same phase.", ""]
    key = lambda r: (r["world"], rate_label(r["rate"]), r["workload"])  # noqa: E731
    groups: dict[tuple, list] = defaultdict(list)
    for r in summary:
        groups[key(r)].append(r)
    for (world, rate, workload), items in groups.items():
        lines += [f"## P = {world}, link {rate}, {workload}", "",
                  "| scheme | step ms | samples/s | compute ms | compress ms | exposed comm ms | other ms | "
                  "comm frac | KB/step | x ddp | x hook | of compute | val acc | val loss |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in items:
            ms = lambda k: _cell(None if r.get(k) is None else r[k] * 1e3, "{:.1f}")  # noqa: E731
            lines.append(
                f"| {r['scheme']} | {ms('step_s')} | {_cell(r['samples_per_s'], '{:.1f}')} | {ms('compute_s')} | "
                f"{ms('compress_s')} | {ms('exposed_comm_s')} | {ms('other_s')} | {_cell(r['comm_fraction'], '{:.2f}')} | "
                f"{_cell(None if r['bytes_per_step'] is None else r['bytes_per_step'] / 1e3, '{:.1f}')} | "
                f"{_cell(r['x_ddp'], '{:.2f}')} | {_cell(r['x_best_hook'], '{:.2f}')} | {_cell(r['of_compute'], '{:.2f}')} | "
                f"{_cell(r['val_acc'], '{:.4f}')} | {_cell(r['val_loss'], '{:.3f}')} |")
        lines.append("")
    return "\n".join(lines)


def targets_markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| P | workload | check | link | value | target | met | note |", "|---|---|---|---|---:|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['world']} | {r['workload']} | {r['check']} | {r['rate']} | "
                     f"{_cell(r['value'], '{:.3f}')} | {r['target']} | {'yes' if r['met'] else '**no**'} | {r['note']} |")
    return "\n".join(lines)


def report_block(summary: list[dict[str, Any]], target_rows: list[dict[str, Any]]) -> str:
    """The generated part of REPORT.md: targets, then the headline phase's breakdown per workload."""
    lines = ["### Targets, at every link where dense DDP is >= 2/3 communication", "",
             targets_markdown(target_rows), ""]
    worlds = sorted({r["world"] for r in summary})
    for world in worlds[-1:]:
        for workload in sorted({r["workload"] for r in summary if r["world"] == world}, key=_workload_order):
            rate, _ = headline_rate(summary, world, workload)
            if rate is None:
                continue
            lines += [f"### P = {world}, {workload}, link {rate_label(rate)}: step time split", "",
                      "| scheme | step ms | samples/s | compute | compress | exposed comm | other | KB/step | x ddp | x hook | of compute |",
                      "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
            for r in summary:
                if (r["world"], r["rate"], r["workload"]) != (world, rate, workload):
                    continue
                ms = lambda k: _cell(None if r.get(k) is None else r[k] * 1e3, "{:.0f}")  # noqa: E731
                lines.append(
                    f"| {r['scheme']} | {ms('step_s')} | {_cell(r['samples_per_s'], '{:.0f}')} | {ms('compute_s')} | "
                    f"{ms('compress_s')} | {ms('exposed_comm_s')} | {ms('other_s')} | "
                    f"{_cell(None if r['bytes_per_step'] is None else r['bytes_per_step'] / 1e3, '{:.1f}')} | "
                    f"{_cell(r['x_ddp'], '{:.2f}')} | {_cell(r['x_best_hook'], '{:.2f}')} | {_cell(r['of_compute'], '{:.2f}')} |")
            lines.append("")
    acc = [r for r in summary if r["val_acc"] is not None]
    if acc:
        lines += [f"### Accuracy after the same {acc[0]['run_steps']} steps (P = {acc[0]['world']}, link "
                  f"{rate_label(acc[0]['rate'])}; rank 0's model on the 512-sample validation split)", "",
                  "| workload | scheme | val acc | val loss | train loss (last 5 steps) | acc - ddp (points) |",
                  "|---|---|---:|---:|---:|---:|"]
        for r in acc:
            ddp = next((d for d in acc if d["workload"] == r["workload"] and d["scheme"] == "ddp"), None)
            delta = 100 * (r["val_acc"] - ddp["val_acc"]) if ddp else None
            lines.append(f"| {r['workload']} | {r['scheme']} | {r['val_acc']:.4f} | {r['val_loss']:.3f} | "
                         f"{_cell(r['train_loss_end'], '{:.3f}')} | {_cell(delta, '{:+.1f}')} |")
        lines.append("")
    return "\n".join(lines)


def curve_markdown(curve: list[dict[str, str]]) -> str:
    """Validation accuracy (%) of the accuracy runs at every evaluation point, and the first step
    from which a scheme stays within 1 point of ddp."""
    series: dict[tuple[str, str], dict[int, float]] = defaultdict(dict)
    worlds = {}
    for row in curve:
        series[(row["workload"], row["scheme"])][int(row["step"])] = 100 * float(row["val_acc"])
        worlds[row["workload"]] = row["world"]
    lines = []
    for workload in sorted({w for w, _ in series}, key=_workload_order):
        schemes = sorted({s for w, s in series if w == workload}, key=lambda s: SCHEMES.index(s) if s in SCHEMES else 99)
        points = sorted({step for s in schemes for step in series[(workload, s)]})
        ddp = series.get((workload, "ddp"), {})
        lines += [f"#### {workload}, P = {worlds[workload]}: validation accuracy (%) after each number of steps", "",
                  "| scheme | " + " | ".join(str(p) for p in points) + " | within 1 point of ddp from step |",
                  "|---|" + "---:|" * (len(points) + 1)]
        for scheme in schemes:
            accs = series[(workload, scheme)]
            close = [p for p in points if p in accs and p in ddp and accs[p] >= ddp[p] - 1]
            since = next((p for p in points if all(q in close for q in points if q >= p)), None)
            cells = " | ".join(_cell(accs.get(p), "{:.1f}") for p in points)
            lines.append(f"| {scheme} | {cells} | {since if since is not None else 'not within'} |")
        lines.append("")
    return "\n".join(lines)


def headline_block(summary: list[dict[str, Any]], target_rows: list[dict[str, Any]]) -> str:
    """The key ratios in a few bullets (REPORT.md's first numbers), one per world size and workload."""
    find = {(t["world"], t["workload"], t["check"], t["rate"]): t for t in target_rows}
    lines = []
    for world in sorted({t["world"] for t in target_rows}, reverse=True):
        for workload in sorted({t["workload"] for t in target_rows if t["world"] == world}, key=_workload_order):
            get = lambda check, rate: find.get((world, workload, check, rate))  # noqa: E731
            by_check = lambda check: next((t for t in target_rows if (t["world"], t["workload"], t["check"])  # noqa: E731
                                           == (world, workload, check)), None)
            acc, dense = by_check("ssfusion_acc_minus_ddp_points"), by_check("dense_engine_step_over_ddp")
            parts = []
            for rate in qualifying_rates(summary, world, workload)[0]:
                label = rate_label(rate)
                frac, x_ddp, x_hook, of_compute = (get(c, label) for c in ("ddp_comm_fraction", "ssfusion_x_ddp",
                                                                             "ssfusion_x_best_hook", "ssfusion_of_compute"))
                if not (frac and x_ddp):
                    continue
                ssf = next(r for r in summary if (r["world"], r["rate"], r["workload"], r["scheme"])
                           == (world, rate, workload, "ssfusion"))
                lock = (f"; compute_sync, the no-payload lockstep, at {ssf['compute_s'] / ssf['lockstep_s']:.0%} of it"
                        if ssf["lockstep_s"] else "")
                parts.append(
                    f"at {label} (dense DDP {frac['value']:.0%} communication{'' if frac['met'] else ', below 2/3'}): "
                    f"ssfusion **{x_ddp['value']:.2f}x** Lightning ddp (target 2.5x, {_met(x_ddp)}), "
                    f"**{x_hook['value']:.2f}x** the better hook, {x_hook['note'].replace('best hook: ', '')} (target 1.3x, {_met(x_hook)}), "
                    f"**{of_compute['value']:.0%}** of compute-only (target 80%, {_met(of_compute)}{lock})")
            if acc:
                parts.append(f"accuracy after the same steps {acc['value']:+.1f} points vs ddp (target >= -1, {_met(acc)}; {acc['note']})")
            if dense:
                parts.append(f"sparsifier none on the unshaped link: **{dense['value']:.2f}x** ddp's step (target <= 1.1x, {_met(dense)})")
            if parts:
                lines.append(f"- **P = {world}, {workload}**: " + "; ".join(parts) + ".")
    return "\n".join(lines)


def _met(target: dict[str, Any]) -> str:
    return "met" if target["met"] else "**missed**"


def _workload_order(name: str) -> int:
    return WORKLOADS.index(name) if name in WORKLOADS else len(WORKLOADS)


def update_report(block: str, marker: str = "e2e", path: Path = REPORT) -> bool:
    """Replace the text between ``<!-- {marker}:begin -->`` and ``<!-- {marker}:end -->`` in REPORT.md."""
    if not path.exists():
        return False
    text = path.read_text()
    begin, end = f"<!-- {marker}:begin -->", f"<!-- {marker}:end -->"
    if begin not in text or end not in text:
        return False
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    path.write_text(f"{head}{begin}\n{block.rstrip()}\n{end}{tail}")
    return True


def report_section(marker: str = "e2e", path: Path = REPORT) -> str | None:
    text = path.read_text() if path.exists() else ""
    begin, end = f"<!-- {marker}:begin -->", f"<!-- {marker}:end -->"
    if begin not in text or end not in text:
        return None
    return text.split(begin, 1)[1].split(end, 1)[0].strip()


# =========================================================================== plots
#: one fixed colour per scheme in every plot
COLORS = {
    "compute_only": "black", "compute_sync": "dimgray", "ddp": "tab:red", "ddp_fp16": "tab:pink",
    "ddp_powersgd": "tab:orange", "ddp_powersgd4": "gold", "ssfusion": "tab:blue", "ssfusion_dense": "lightskyblue",
    "safusion": "tab:green",
    "adtopk": "tab:olive", "zen": "tab:purple", "oktopk": "tab:brown", "layerwise": "tab:gray", "behind": "tab:cyan",
}


def plot(summary: list[dict[str, Any]], out: Path, stem: str) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    worlds = sorted({r["world"] for r in summary})
    workloads = sorted({r["workload"] for r in summary}, key=_workload_order)
    shaped = sorted({r["rate_mbit"] for r in summary if r["rate_mbit"] != math.inf})
    unshaped_x = (max(shaped) * 4) if shaped else 1000.0
    xpos = lambda mbit: unshaped_x if mbit == math.inf else mbit  # noqa: E731
    fig, axes = plt.subplots(len(worlds), len(workloads), figsize=(6.5 * len(workloads), 4.2 * len(worlds)), squeeze=False)
    styles = {"compute_only": dict(linestyle="--", linewidth=2), "ddp": dict(linewidth=2), "ssfusion": dict(linewidth=3)}
    for i, world in enumerate(worlds):
        for j, workload in enumerate(workloads):
            ax = axes[i][j]
            for scheme in SCHEMES:
                rows = sorted((r for r in summary if (r["world"], r["workload"], r["scheme"]) == (world, workload, scheme)),
                              key=lambda r: xpos(r["rate_mbit"]))
                if not rows or scheme == "compute_sync":
                    continue
                ax.plot([xpos(r["rate_mbit"]) for r in rows], [r["samples_per_s"] for r in rows], marker="o",
                        markersize=4, label=scheme, color=COLORS.get(scheme), **styles.get(scheme, {"linewidth": 1.2}))
            ax.set_xscale("log")
            ax.minorticks_off()
            ticks = shaped + [unshaped_x]
            ax.set_xticks(ticks)
            ax.set_xticklabels([f"{t:g}" for t in shaped] + ["unshaped"])
            ax.set_xlabel("link rate per node (Mbit/s)")
            ax.set_ylabel("samples/s (all ranks)")
            ax.set_title(f"{workload}, P = {world}")
            ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=7, ncol=2)
    fig.tight_layout()
    path = out / f"{stem}_throughput.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)

    world = worlds[-1]
    fig, axes = plt.subplots(1, len(workloads), figsize=(7 * len(workloads), 4.5), squeeze=False)
    parts = [("compute_s", "compute", "tab:gray"), ("compress_s", "compression", "tab:orange"),
             ("exposed_comm_s", "exposed comm", "tab:red"), ("other_s", "other", "tab:purple")]
    for j, workload in enumerate(workloads):
        ax = axes[0][j]
        rate, _ = headline_rate(summary, world, workload)
        if rate is None:  # no link made DDP communication-bound (e.g. an unshaped-only run): the slowest one
            rate = min((r for r in summary if (r["world"], r["workload"]) == (world, workload)),
                       key=lambda r: r["rate_mbit"])["rate"]
        rows = [r for r in summary if (r["world"], r["rate"], r["workload"]) == (world, rate, workload)
                and r["scheme"] not in ("compute_sync",)]
        names = [r["scheme"] for r in rows]
        bottom = [0.0] * len(rows)
        for key, label, color in parts:
            heights = [max(0.0, r.get(key) or 0.0) * 1e3 if not (r["scheme"] == "compute_only" and key != "compute_s")
                       else 0.0 for r in rows]
            ax.bar(names, heights, bottom=bottom, label=label, color=color)
            bottom = [b + h for b, h in zip(bottom, heights)]
        ax.plot(names, [r["step_s"] * 1e3 for r in rows], "k_", markersize=18, label="measured step")
        ax.set_ylim(0, 1.08 * max([*bottom, *(r["step_s"] * 1e3 for r in rows)], default=1.0))
        ax.set_ylabel("ms per step")
        ax.set_title(f"{workload}, P = {world}, link {rate_label(rate)}")
        ax.tick_params(axis="x", rotation=60)
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    path = out / f"{stem}_breakdown.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)
    return written


def plot_loss(steps: list[dict[str, str]], runs: list[dict[str, str]], out: Path, stem: str) -> Path | None:
    """Training loss per step of the accuracy runs (rank 0's batch), smoothed over 5 steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    evaluated = {(r["world"], r["rate"], r["workload"], r["scheme"], r["rep"]) for r in runs if r["val_acc"]}
    curves: dict[tuple, list[tuple[int, float]]] = defaultdict(list)
    for s in steps:
        key = (s["world"], s["rate"], s["workload"], s["scheme"], s["rep"])
        if key in evaluated and s.get("train_loss"):
            curves[key].append((int(s["step"]), float(s["train_loss"])))
    if not curves:
        return None
    workloads = sorted({k[2] for k in curves}, key=_workload_order)
    fig, axes = plt.subplots(1, len(workloads), figsize=(6.5 * len(workloads), 4.2), squeeze=False)
    for j, workload in enumerate(workloads):
        ax = axes[0][j]
        for key, points in sorted(curves.items(), key=lambda kv: SCHEMES.index(kv[0][3]) if kv[0][3] in SCHEMES else 99):
            if key[2] != workload:
                continue
            points.sort()
            ys = [y for _, y in points]
            smooth = [statistics.mean(ys[max(0, i - 4): i + 1]) for i in range(len(ys))]
            width = 2.5 if key[3] in ("ddp", "ssfusion") else 1.2
            ax.plot([x for x, _ in points], smooth, label=key[3], color=COLORS.get(key[3]), linewidth=width)
        ax.set_xlabel("step")
        ax.set_ylabel("training loss (rank 0, mean of 5 steps)")
        world = next(k[0] for k in curves if k[2] == workload)
        ax.set_title(f"{workload}, P = {world}")
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=7, ncol=2)
    fig.tight_layout()
    path = out / f"{stem}_loss.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_accuracy(curve: list[dict[str, str]], out: Path, stem: str) -> Path | None:
    """Validation accuracy of the accuracy runs against the step (rank 0's model, fixed split)."""
    if not curve:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series: dict[tuple, list[tuple[int, float]]] = defaultdict(list)
    for row in curve:
        series[(row["world"], row["workload"], row["scheme"])].append((int(row["step"]), float(row["val_acc"])))
    workloads = sorted({k[1] for k in series}, key=_workload_order)
    fig, axes = plt.subplots(1, len(workloads), figsize=(6.5 * len(workloads), 4.2), squeeze=False)
    for j, workload in enumerate(workloads):
        ax = axes[0][j]
        for key, points in sorted(series.items(), key=lambda kv: SCHEMES.index(kv[0][2]) if kv[0][2] in SCHEMES else 99):
            if key[1] != workload:
                continue
            points.sort()
            width = 2.5 if key[2] in ("ddp", "ssfusion") else 1.2
            ax.plot([x for x, _ in points], [100 * y for _, y in points], marker="o", markersize=3, label=key[2],
                    color=COLORS.get(key[2]), linewidth=width)
        ax.set_xlabel("step")
        ax.set_ylabel("validation accuracy, % (top-1 / next token)")
        world = next(k[0] for k in series if k[1] == workload)
        ax.set_title(f"{workload}, P = {world}")
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=7, ncol=2)
    fig.tight_layout()
    path = out / f"{stem}_accuracy.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# =========================================================================== main
def analyze(out: Path, stem: str, update: bool) -> tuple[list[dict], list[dict]]:
    steps = read_csv(out / f"{stem}_steps.csv")
    runs = read_csv(out / f"{stem}_runs.csv")
    summary = summarize(steps, runs)
    target_rows = targets(summary)
    write_csv(out / f"{stem}.csv", SUMMARY_FIELDS, summary_csv_rows(summary))
    (out / f"{stem}.md").write_text(summary_markdown(summary) + "\n## Targets\n\n" + targets_markdown(target_rows) + "\n")
    write_csv(out / f"{stem}_targets.csv", TARGET_FIELDS, target_csv_rows(target_rows))
    (out / f"{stem}_targets.md").write_text(targets_markdown(target_rows) + "\n")
    plot(summary, out, stem)
    plot_loss(steps, runs, out, stem)
    curve_path = out / f"{stem}_curve.csv"
    curve = read_csv(curve_path) if curve_path.exists() else []
    plot_accuracy(curve, out, stem)
    if update and curve and update_report(curve_markdown(curve), marker="e2e-curve"):
        print(f"updated the e2e-curve block of {REPORT}")
    if update and update_report(report_block(summary, target_rows)):
        print(f"updated the e2e block of {REPORT}")
    if update and update_report(headline_block(summary, target_rows), marker="e2e-headline"):
        print(f"updated the e2e-headline block of {REPORT}")
    return summary, target_rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: P=2, small models, 2 rates, few steps")
    parser.add_argument("--from-csv", action="store_true", help="only rebuild summary, tables, plots, REPORT block")
    parser.add_argument("--from-raw", action="store_true", help="rebuild the CSVs too, from <stem>_raw.jsonl")
    parser.add_argument("--worlds", type=int, nargs="+", default=None)
    parser.add_argument("--rates", nargs="+", default=None, help="tc rates; 'none' = unshaped (put it first)")
    parser.add_argument("--workloads", nargs="+", default=["resnet18", "gpt2"], choices=WORKLOADS)
    parser.add_argument("--schemes", nargs="+", default=list(SCHEMES), choices=SCHEMES)
    parser.add_argument("--steps", type=int, default=None, help="steps per throughput run")
    parser.add_argument("--warmup", type=int, default=None, help="first steps of a run left out of the medians")
    parser.add_argument("--acc-steps", type=int, default=None, help="steps of the accuracy runs (first phase, largest P; default 240, quick 10)")
    parser.add_argument("--eval-every", type=int, default=None,
                        help="the accuracy runs also evaluate every this many steps (default 40; quick 5)")
    parser.add_argument("--repeats", type=int, default=1, help="runs per scheme and phase, interleaved")
    parser.add_argument("--key-repeats", type=int, default=None,
                        help="runs of the target schemes on the slowest link, interleaved (default 2; quick 1)")
    parser.add_argument("--small-rates", nargs="+", default=None,
                        help="rates for world sizes below the largest (default: --rates)")
    parser.add_argument("--delay", default=None, help="one-way delay per node (e.g. 0.1ms); default none")
    parser.add_argument("--engine-options", type=json.loads, default=None,
                        help='SSFusionStrategy keyword arguments for every engine scheme, as JSON (e.g. \'{"buffer_mb": 1}\')')
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--nice", type=int, default=-5,
                        help="niceness of the rank processes (default -5: ahead of other jobs on a shared host)")
    parser.add_argument("--timeout", type=float, default=2400, help="seconds per world size")
    parser.add_argument("--out", type=Path, default=None, help="results directory")
    parser.add_argument("--name", default=None, help="file stem (default e2e, quick: e2e_quick)")
    parser.add_argument("--no-report", action="store_true", help="do not update experiments/REPORT.md")
    args = parser.parse_args(argv)

    stem = args.name or ("e2e_quick" if args.quick else "e2e")
    out = args.out or (Path(tempfile.gettempdir()) / "ssf_e2e_quick" if args.quick else RESULTS)
    out.mkdir(parents=True, exist_ok=True)
    update = not args.no_report and not args.quick and out.resolve() == RESULTS.resolve()
    if args.from_csv:
        summary, target_rows = analyze(out, stem, update)
        print(targets_markdown(target_rows))
        return 0
    if args.from_raw:
        runs = [json.loads(line) for line in (out / f"{stem}_raw.jsonl").read_text().splitlines()]
        meta = json.loads((out / f"{stem}_meta.json").read_text()) if (out / f"{stem}_meta.json").exists() else {}
        for key, value in meta.items():
            if getattr(args, key, None) is None and key in vars(args):
                setattr(args, key, value)
        return finish(runs, out, stem, args, argv, time.monotonic(), update, write_meta=False)

    args.worlds = args.worlds or ([2] if args.quick else [2, 4])
    args.rates = args.rates or (["none", "50mbit"] if args.quick else DEFAULT_RATES)
    args.key_repeats = args.key_repeats if args.key_repeats is not None else (1 if args.quick else 2)
    args.steps = args.steps or (8 if args.quick else 14)
    args.warmup = args.warmup if args.warmup is not None else (5 if args.quick else 6)
    args.acc_steps = args.acc_steps if args.acc_steps is not None else (10 if args.quick else 240)
    args.eval_every = args.eval_every if args.eval_every is not None else (5 if args.quick else 40)
    if args.steps <= args.warmup:
        parser.error("--steps must exceed --warmup")

    from experiments.cluster import probe_support

    support = probe_support()
    if not support.get("usable"):
        print(f"the emulated cluster cannot run here: {support.get('reason', support)}", file=sys.stderr)
        return 2
    started = time.monotonic()
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="ssf_e2e_") as tmp:
        for world in args.worlds:
            runs += run_world(world, build_phases(world, args, max(args.worlds)), args, Path(tmp))
            # keep the raw records (every step's metrics) before anything else can fail
            (out / f"{stem}_raw.jsonl").write_text("".join(json.dumps(r) + "\n" for r in runs))
    return finish(runs, out, stem, args, argv, started, update)


def finish(runs: list[dict[str, Any]], out: Path, stem: str, args: argparse.Namespace, argv, started: float,
           update: bool, write_meta: bool = True) -> int:
    steps, rows = raw_rows(runs)
    write_csv(out / f"{stem}_steps.csv", STEP_FIELDS, steps)
    write_csv(out / f"{stem}_runs.csv", RUN_FIELDS, rows)
    write_csv(out / f"{stem}_curve.csv", CURVE_FIELDS, curve_rows(runs))
    meta = {"argv": sys.argv[1:] if argv is None else argv, "cpus": os.cpu_count(), "wall_seconds": time.monotonic() - started,
            "worlds": args.worlds, "rates": args.rates, "steps": args.steps, "warmup": args.warmup,
            "acc_steps": args.acc_steps, "eval_every": args.eval_every, "repeats": args.repeats, "key_repeats": args.key_repeats,
            "small_rates": args.small_rates, "delay": args.delay, "nice": args.nice,
            "engine_options": args.engine_options}
    if write_meta:
        (out / f"{stem}_meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    summary, target_rows = analyze(out, stem, update)
    print(targets_markdown(target_rows))
    print(f"wrote {out}/{stem}*.{{csv,md,png}} in {time.monotonic() - started:.0f} s")
    failed = [r for r in rows if r["error"]]
    return 1 if failed or not runs else 0


if __name__ == "__main__":
    sys.exit(main())
