"""End-to-end benchmark, analysis (experiments/bench_e2e.py runs it, e2e_report.py writes it up):
the schemes and the CSV columns, the raw records as CSV rows, the summary per (P, link, workload,
scheme) and the target checks.

Every function here reads and returns plain rows (dicts), so the committed CSVs can be analysed
again without running anything.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from typing import Any, Iterable

from experiments.common import fmt, median, num, quantile, rate_label, rate_mbit
from ssfusion_lightning.commcost import ring_allreduce_bytes

DDP_SCHEMES = ("compute_only", "compute_sync", "ddp", "ddp_fp16", "ddp_powersgd", "ddp_powersgd4")
ENGINE_SCHEMES = ("ssfusion", "ssfusion_dense", "safusion", "adtopk", "zen", "oktopk", "layerwise", "behind")
SCHEMES = DDP_SCHEMES + ENGINE_SCHEMES
#: schemes trained for --acc-steps in the accuracy phase (the others do not train a shared model)
ACCURACY_SCHEMES = tuple(s for s in SCHEMES if s not in ("compute_only", "compute_sync", "ssfusion_dense"))
HOOKS = ("ddp_fp16", "ddp_powersgd", "ddp_powersgd4")
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


# =========================================================================== raw CSV rows
def raw_rows(runs: Iterable[dict[str, Any]]) -> tuple[list[dict], list[dict]]:
    """The raw records of the runs (e2e_worker.py's, one per run) as rows of <stem>_steps.csv (one
    per step) and <stem>_runs.csv (one per run)."""
    steps, rows = [], []
    for run in runs:
        key = {k: run[k] for k in ("world", "workload", "scheme", "rep")}
        key["rate"] = run["phase"]
        ev = run.get("eval") or {}
        rows.append({
            **key, "steps": run["steps"], "warmup": run["warmup"], "params": run.get("params", ""),
            "param_tensors": run.get("param_tensors", ""), "per_rank_batch": run.get("per_rank_batch", ""),
            "fit_seconds": fmt(run.get("fit_seconds")), "val_loss": fmt(ev.get("val_loss")),
            "val_acc": fmt(ev.get("val_acc")),
            **{f: run.get(f, "") for f in ("plan_buffers", "plan_dense_elements", "plan_sparse_elements", "plan_sparse_k")},
            # elements this rank sent per step (dense part + selected), median over the measured steps
            "elements_sent": fmt(median([m["elements_sent"] for m in (run.get("engine") or [])[run["warmup"]:]
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
                **{f: fmt(m.get(f)) for f in ("bytes_sent", "bytes_received", "dense_equivalent_bytes",
                                             "compress_seconds", "exposed_comm_seconds", "buffers",
                                             "dense_tensors", "sparse_tensors")},
                "hook_payload_bytes": hook[step] if step < len(hook) else "",
                "train_loss": fmt(losses[step]) if step < len(losses) else "",
            })
    return steps, rows


def curve_rows(runs: Iterable[dict[str, Any]]) -> list[dict]:
    """Validation loss / accuracy at each evaluation point of the accuracy runs."""
    return [
        {"world": run["world"], "rate": run["phase"], "workload": run["workload"], "scheme": run["scheme"],
         "rep": run["rep"], "step": point["step"], "val_loss": fmt(point["val_loss"]), "val_acc": fmt(point["val_acc"])}
        for run in runs
        for point in run.get("eval_curve") or []
    ]


# =========================================================================== summary
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
        dense = ring_allreduce_bytes(params * 4, P)
        if scheme in ENGINE_SCHEMES:
            sent = median(_column(items, "bytes_sent"))
        elif scheme in HOOKS:
            sent = median([ring_allreduce_bytes(v, P) for v in _column(items, "hook_payload_bytes")])
        elif scheme == "ddp":
            sent = dense
        else:
            sent = 0.0
        rows[key] = {
            "world": P, "rate": rate, "rate_mbit": rate_mbit(rate), "workload": workload, "scheme": scheme,
            "steps_measured": len(seconds), "step_s": step,
            "step_p25_s": quantile(seconds, 0.25), "step_p75_s": quantile(seconds, 0.75),
            "step_cpu_s": median(_column(items, "cpu_seconds")),
            "samples_per_s": P * int(run["per_rank_batch"]) / step,
            "compress_s": median(_column(items, "compress_seconds")),
            "exposed_engine_s": median(_column(items, "exposed_comm_seconds")),
            "bytes_per_step": sent, "dense_bytes_per_step": dense,
            "val_acc": num(run["val_acc"]), "val_loss": num(run["val_loss"]),
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
    out.sort(key=lambda r: (r["world"], -r["rate_mbit"], r["workload"], scheme_order(r["scheme"])))
    return out


def _column(items: list[dict[str, str]], name: str) -> list[float]:
    """The non-empty cells of one column of step rows, as floats."""
    return [v for s in items if (v := num(s.get(name))) is not None]


def _train_loss_end(items: list[dict[str, str]]) -> float | None:
    """Mean training loss of the last 5 steps of rep 0 (the accuracy run)."""
    losses = sorted((int(s["step"]), float(s["train_loss"])) for s in items if s["rep"] == "0" and s.get("train_loss"))
    return statistics.mean(v for _, v in losses[-5:]) if losses else None


def summary_csv_rows(summary: list[dict[str, Any]]) -> list[dict[str, str]]:
    rows = []
    for r in summary:
        ms = lambda k: "" if r.get(k) is None else f"{r[k] * 1e3:.2f}"  # noqa: E731
        value = lambda k, f="{:.4g}": "" if r.get(k) is None else f.format(r[k])  # noqa: E731
        rows.append({
            "world": r["world"], "rate": rate_label(r["rate"]),
            "rate_mbit": "inf" if r["rate_mbit"] == math.inf else f"{r['rate_mbit']:g}",
            "workload": r["workload"], "scheme": r["scheme"], "steps_measured": r["steps_measured"],
            "step_ms": ms("step_s"), "step_p25_ms": ms("step_p25_s"), "step_p75_ms": ms("step_p75_s"),
            "step_cpu_ms": ms("step_cpu_s"), "samples_per_s": value("samples_per_s", "{:.1f}"), "compute_ms": ms("compute_s"),
            "lockstep_ms": ms("lockstep_s"), "compress_ms": ms("compress_s"), "exposed_comm_ms": ms("exposed_comm_s"),
            "other_ms": ms("other_s"), "comm_fraction": value("comm_fraction", "{:.3f}"),
            "bytes_per_step": value("bytes_per_step", "{:.0f}"), "dense_bytes_per_step": value("dense_bytes_per_step", "{:.0f}"),
            "x_ddp": value("x_ddp", "{:.3f}"), "x_best_hook": value("x_best_hook", "{:.3f}"),
            "of_compute": value("of_compute", "{:.3f}"), "val_acc": value("val_acc", "{:.4f}"),
            "val_loss": value("val_loss", "{:.4f}"), "train_loss_end": value("train_loss_end", "{:.4f}"),
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


def workload_order(name: str) -> int:
    """Sort key of the tables and plots: the workloads in WORKLOADS order, others after them."""
    return WORKLOADS.index(name) if name in WORKLOADS else len(WORKLOADS)


def scheme_order(name: str) -> int:
    """Sort key of the tables and plots: the schemes in SCHEMES order, others after them."""
    return SCHEMES.index(name) if name in SCHEMES else 99
