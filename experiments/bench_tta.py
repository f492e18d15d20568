"""Time to accuracy on real data, on the emulated cluster: DDP, DDP + fp16, DDP + PowerSGD (ranks 1
and 4) and every preset at density 1% and 0.1% (0.1% with DGC's density warm-up), per P and link.

    python -m experiments.bench_tta                     # the full run (see --help for its size)
    python -m experiments.bench_tta --quick             # smoke run: P = 2, one link, few steps
    python -m experiments.bench_tta --from-raw          # tables, plots and REPORT block from tta_raw.jsonl

Every run trains the workload's model from the seed and evaluates every rank's model on the whole
validation split every ``--eval-every`` steps (that time is left out of the clock). Per (P, link,
workload, seed) the target is dense DDP's final validation accuracy (or loss, for the language
model) after the workload's steps, or with ``--target-last N`` the mean of its last N evaluations
(one evaluation of a few hundred images moves by an image or two). Every other scheme may run
``--budget-factor`` (default 2) times as many steps: a time to accuracy must not stop a scheme with
faster steps at DDP's step count. Per scheme the table gives the wall-clock time and the steps to reach the target (the first
evaluation point at or past it, clock = the sum of the step times before it), the speed-up over
DDP and over the better PowerSGD, and the accuracy after DDP's steps. With ``--seeds`` the runs
repeat per seed and a table of medians over the seeds comes first; the targets are checked on the
medians. The real data sets ship inside packages (``pip install .[realdata]``); nothing is
downloaded.

Outputs under --out (default experiments/results): tta_raw.jsonl (every run), tta_curve.csv (every
evaluation point with its clock), tta.csv / tta.md (time to accuracy), tta_targets.md, one
tta_<workload>.png per workload (accuracy against wall-clock time per scheme), and the block
between the tta markers in experiments/REPORT.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from experiments.bench_e2e import run_world
from experiments.common import (
    cell,
    fmt,
    pyplot,
    rate_label,
    rate_mbit,
    read_jsonl,
    results_dir,
    save_figure,
    update_report,
    write_csv,
    write_jsonl,
)

DDP_BASELINES = ("ddp", "ddp_fp16", "ddp_powersgd", "ddp_powersgd4")
POWERSGD = ("ddp_powersgd", "ddp_powersgd4")
#: the step-time floor (``--floor``): the same training with no gradient exchange but one 1-element
#: all-reduce per step; it only times steps (its ranks' models drift apart, so it is not evaluated)
FLOOR = "compute_sync"
PRESETS = ("ssfusion", "safusion", "adtopk", "zen", "oktopk")
DENSITIES = (0.01, 0.001)
#: what "accuracy" means per workload kind: the metric, and whether larger is better
TARGET_METRIC = {"digits": ("val_acc", True), "text": ("val_loss", False), "text_wide": ("val_loss", False)}

CURVE_FIELDS = ["world", "rate", "workload", "seed", "label", "scheme", "density", "step", "seconds", "val_loss", "val_acc"]
TTA_FIELDS = [
    "world", "rate", "workload", "seed", "label", "metric", "target", "steps_to_target", "seconds_to_target", "x_ddp",
    "x_best_powersgd", "final", "final_minus_ddp", "final_acc", "acc_minus_ddp", "worst_gap_from_quarter", "step_ms",
    "of_floor", "steps_run", "total_seconds", "at_density_from", "equal_steps",
]


def label_of(scheme: str, density: float | None) -> str:
    return scheme if density is None else f"{scheme}@{density * 100:g}%"


def build_runs(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every (seed, workload, scheme, density) run of one phase; presets get their density as
    overrides. DDP runs the workload's steps, which set the target; every other scheme may run up to
    ``--budget-factor`` times as many, so that a scheme with faster steps can still reach it."""
    runs = []
    for seed in args.seeds:
        for workload in args.workloads:
            runs += _workload_runs(args, seed, workload)
    return runs


def _workload_runs(args: argparse.Namespace, seed: int, workload: str) -> list[dict[str, Any]]:
    steps = args.steps[workload]
    longer = max(steps, round(steps * args.budget_factor))

    def base(total: int) -> dict[str, Any]:
        eval_at = sorted({*range(args.eval_every, total, args.eval_every), steps, total})
        return {"workload": workload, "rep": 0, "seed": seed, "steps": total, "equal_steps": steps, "warmup": 0,
                "eval": True, "eval_at": eval_at}

    runs = []
    if args.floor:
        runs.append({**base(steps), "scheme": FLOOR, "label": FLOOR, "density": None, "eval": False, "eval_at": []})
    for scheme in args.baselines:
        runs.append({**base(steps if scheme == "ddp" else longer), "scheme": scheme, "label": label_of(scheme, None),
                     "density": None})
    for scheme in args.presets:
        for density in args.densities:
            overrides: dict[str, Any] = {"density": density}
            if density < 0.01 and args.warmup_epochs > 0:
                overrides["density_warmup_epochs"] = args.warmup_epochs
            runs.append({**base(longer), "scheme": scheme, "label": label_of(scheme, density), "density": density,
                         "overrides": overrides})
            for name, options in args.variants.items():
                variant = f"{scheme}+{name}"
                runs.append({**base(longer), "scheme": scheme, "label": label_of(variant, density), "density": density,
                             "overrides": {**overrides, **options}})
    return runs


# =========================================================================== analysis
def curve_rows(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every evaluation point with its clock: the wall time of the steps before it."""
    rows = []
    for run in runs:
        if run.get("error"):
            continue
        seconds = run.get("step_seconds") or []
        for point in run.get("eval_curve") or []:
            rows.append({
                "world": run["world"], "rate": run["phase"], "workload": run["workload"], "seed": run.get("seed", 0),
                "label": run["label"], "scheme": run["scheme"], "density": run.get("density") or "",
                "step": point["step"], "seconds": sum(seconds[: point["step"]]), "val_loss": point["val_loss"],
                "val_acc": point["val_acc"], "equal_steps": run.get("equal_steps", run["steps"]),
            })
    return rows


def _reached(value: float, target: float, larger_is_better: bool) -> bool:
    return value >= target if larger_is_better else value <= target


def target_density_from(run: dict[str, Any]) -> int | None:
    """The first step that ran at the run's target density (after any density warm-up), from the
    engine's per-step metrics: the number of steps run if it never got there, None where the run
    has no such metrics (not an engine run, or one recorded before they existed)."""
    density, metrics = run.get("density"), run.get("engine") or []
    if not density or not metrics or "requested_density" not in metrics[0]:
        return None
    return next((step for step, m in enumerate(metrics) if m["requested_density"] <= density * (1 + 1e-9)), len(metrics))


def ddp_target(points: list[dict[str, Any]], metric: str, last: int = 1) -> float:
    """DDP's final value, or with ``last`` > 1 the mean of its last evaluations: one evaluation on a
    few hundred samples moves by a sample or two between neighbouring steps, and a target set by a
    lucky one decides the steps to reach it more than the scheme does."""
    tail = sorted(points, key=lambda r: int(r["step"]))[-last:]
    return statistics.fmean(float(r[metric]) for r in tail)


def time_to_accuracy(curve: list[dict[str, Any]], runs: list[dict[str, Any]], target_last: int = 1) -> list[dict[str, Any]]:
    """Per (P, link, workload, seed) and scheme: time and steps to DDP's final value (the mean of its
    last ``target_last`` evaluations) over the whole curve, and the comparisons with DDP at equal
    steps (DDP's steps)."""
    groups: dict[tuple, dict[str, list[dict[str, Any]]]] = defaultdict(lambda: defaultdict(list))
    for row in curve:
        groups[(int(row["world"]), row["rate"], row["workload"], int(row["seed"]))][row["label"]].append(row)
    step_ms = {
        (r["world"], r["phase"], r["workload"], r.get("seed", 0), r["label"]):
            1e3 * sorted(r["step_seconds"])[len(r["step_seconds"]) // 2]
        for r in runs if not r.get("error") and r.get("step_seconds")
    }
    at_density_from = {
        (r["world"], r["phase"], r["workload"], r.get("seed", 0), r["label"]): target_density_from(r)
        for r in runs if not r.get("error")
    }
    table = []
    for key, by_label in sorted(groups.items(), key=lambda kv: (kv[0][0], -rate_mbit(kv[0][1]), kv[0][2], kv[0][3])):
        world, rate, workload, seed = key
        metric, larger = TARGET_METRIC.get(workload, ("val_acc", True))
        ddp = sorted(by_label.get("ddp", []), key=lambda r: int(r["step"]))
        if not ddp:
            continue
        target = ddp_target(ddp, metric, target_last)
        equal_steps = int(ddp[-1]["step"])
        reached: dict[str, tuple[int, float] | None] = {}
        for label, points in by_label.items():
            points.sort(key=lambda r: int(r["step"]))
            hit = next((p for p in points if _reached(float(p[metric]), target, larger)), None)
            reached[label] = (int(hit["step"]), float(hit["seconds"])) if hit else None
        floor_ms = step_ms.get((world, rate, workload, seed, FLOOR))
        ddp_time = reached["ddp"][1] if reached.get("ddp") else None
        powersgd = [reached[s][1] for s in POWERSGD if reached.get(s)]
        best_powersgd = min(powersgd) if powersgd else None
        for label, points in sorted(by_label.items(), key=lambda kv: _label_order(kv[0])):
            equal = [p for p in points if int(p["step"]) <= equal_steps]
            last = equal[-1]
            final = float(last[metric])
            # accuracy (next-token accuracy for the LM) in points against DDP's at the same step
            at_ddp = {int(d["step"]): float(d["val_acc"]) for d in ddp}
            gaps = [
                100 * (float(p["val_acc"]) - at_ddp[int(p["step"])])
                for p in equal if int(p["step"]) >= equal_steps / 4 and int(p["step"]) in at_ddp
            ]
            hit = reached[label]
            table.append({
                "world": world, "rate": rate, "workload": workload, "seed": seed, "label": label, "metric": metric,
                "target": target, "steps_to_target": hit[0] if hit else None,
                "seconds_to_target": hit[1] if hit else None,
                "x_ddp": ddp_time / hit[1] if hit and ddp_time and hit[1] > 0 else None,
                "x_best_powersgd": best_powersgd / hit[1] if hit and best_powersgd and hit[1] > 0 else None,
                "final": final, "final_minus_ddp": (final - float(ddp[-1][metric])) * (1 if larger else -1),
                "final_acc": float(last["val_acc"]),
                "acc_minus_ddp": 100 * (float(last["val_acc"]) - float(ddp[-1]["val_acc"])),
                "worst_gap_from_quarter": min(gaps) if gaps else None,
                "step_ms": step_ms.get((world, rate, workload, seed, label)),
                "of_floor": step_ms[(world, rate, workload, seed, label)] / floor_ms
                if floor_ms and (world, rate, workload, seed, label) in step_ms else None,
                "steps_run": int(points[-1]["step"]),
                "at_density_from": at_density_from.get((world, rate, workload, seed, label)),
                "equal_steps": equal_steps,
                "total_seconds": float(points[-1]["seconds"]),
            })
    return table


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _latest(steps: list[int | None]) -> int | None:
    """The latest of the seeds' first steps at the target density (None where none is known)."""
    known = [step for step in steps if step is not None]
    return max(known) if known else None


def across_seeds(table: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (P, link, workload) and scheme, the medians over seeds. A seed whose run did not reach
    the target counts as a speed-up of 0, so a median speed-up exists only where most seeds reached it."""
    groups: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for row in table:
        groups[(row["world"], row["rate"], row["workload"], row["label"])].append(row)
    rows = []
    for (world, rate, workload, label), seeds in groups.items():
        speedups = {field: [row[field] or 0.0 for row in seeds] for field in ("x_ddp", "x_best_powersgd")}
        reached = [row for row in seeds if row["steps_to_target"] is not None]
        gaps = [row["worst_gap_from_quarter"] for row in seeds if row["worst_gap_from_quarter"] is not None]
        rows.append({
            "world": world, "rate": rate, "workload": workload, "label": label, "metric": seeds[0]["metric"],
            "seeds": len(seeds), "reached": len(reached),
            "steps_to_target": _median([row["steps_to_target"] for row in reached]),
            **{field: _median(values) or None for field, values in speedups.items()},
            **{f"{field}_per_seed": values for field, values in speedups.items()},
            "acc_minus_ddp": _median([row["acc_minus_ddp"] for row in seeds]),
            "final_minus_ddp": _median([row["final_minus_ddp"] for row in seeds]),
            "worst_gap_from_quarter": _median(gaps),
            "step_ms": _median([row["step_ms"] for row in seeds if row["step_ms"] is not None]),
            "of_floor": _median([row["of_floor"] for row in seeds if row["of_floor"] is not None]),
            "at_density_from": _latest([row.get("at_density_from") for row in seeds]),
            "equal_steps": seeds[0].get("equal_steps"),
        })
    return rows


def _label_order(label: str) -> tuple[int, str]:
    scheme = label.split("@")[0].split("+")[0]
    order = (*DDP_BASELINES, *PRESETS)
    return (order.index(scheme) if scheme in order else len(order), label)


def targets(table: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's targets, checked on every (P, link, workload) of ``across_seeds``'s medians."""
    rows = []
    for row in table:
        scheme, _, density = row["label"].partition("@")
        scheme = scheme.split("+")[0]  # a variant counts as its preset
        if scheme not in PRESETS:
            continue
        seeds = f", median of {row['seeds']} seeds" if row["seeds"] > 1 else ""
        key = f"P={row['world']} {rate_label(row['rate'])} {row['workload']} {row['label']}{seeds}"
        if density == "1%" and row["worst_gap_from_quarter"] is not None:
            gap = row["worst_gap_from_quarter"]
            rows.append({"check": "within 0.3 points of DDP at every evaluation from a quarter on", "case": key,
                         "value": f"{gap:+.2f}", "met": gap >= -0.3})
        if density == "0.1%":
            gap = row["acc_minus_ddp"]
            start, end = row.get("at_density_from"), row.get("equal_steps")
            # an end still inside the warm-up compares the warm-up's densities, not this one
            tested = start is None or end is None or start < end
            note = "" if tested else f" (at {density} only from step {start}, past DDP's {end} steps)"
            rows.append({"check": "within 1 point of DDP at the end (density warm-up)", "case": key,
                         "value": f"{gap:+.2f}{note}", "met": tested and gap >= -1.0})
        if scheme == "ssfusion" and row["world"] == 4 and rate_mbit(row["rate"]) <= 40:
            for field, need in (("x_ddp", 3.0), ("x_best_powersgd", 1.2)):
                value = row[field]
                rows.append({"check": f"time to DDP's accuracy: {field} >= {need}", "case": key,
                             "value": "not reached" if value is None else f"{value:.2f}",
                             "met": value is not None and value >= need})
    return rows


def _dash(value: Any, spec: str) -> str:
    return cell(value, spec, empty="-")


def _cases(rows: list[dict[str, Any]], *fields: str) -> list[tuple]:
    return sorted({tuple(r[f] for f in fields) for r in rows}, key=lambda k: (k[2], k[0], -rate_mbit(k[1]), *k[3:]))


def _speedups(values: list[float]) -> str:
    return ", ".join(f"{v:.2f}" if v else "-" for v in values)


def _target_name(target_last: int) -> str:
    return "DDP's final" if target_last == 1 else f"the mean of DDP's last {target_last} evaluations of"


def markdown(table: list[dict[str, Any]], summary: list[dict[str, Any]], checks: list[dict[str, Any]],
             target_last: int = 1) -> str:
    lines = []
    own = "its own DDP's final value" if target_last == 1 else f"the mean of its own DDP's last {target_last} evaluations"
    if any(r["seeds"] > 1 for r in summary):
        for key in _cases(summary, "world", "rate", "workload"):
            rows = sorted((r for r in summary if (r["world"], r["rate"], r["workload"]) == key),
                          key=lambda r: _label_order(r["label"]))
            lines += [
                f"#### {key[2]}, P = {key[0]}, link {rate_label(key[1])}: medians over {rows[0]['seeds']} seeds "
                f"(each seed's target is {own})",
                "",
                "| scheme | seeds at target | steps to target | x DDP | x DDP per seed | x best PowerSGD | "
                "x best PowerSGD per seed | accuracy - DDP's at equal steps (points) | worst accuracy gap from 1/4 on "
                "(points) | step (ms) | step / compute-only's |",
                "|---|---|---|---|---|---|---|---|---|---|---|",
            ]
            for r in rows:
                lines.append(
                    f"| {r['label']} | {r['reached']} of {r['seeds']} | {_dash(r['steps_to_target'], '{:.0f}')} | "
                    f"{_dash(r['x_ddp'], '{:.2f}')} | {_speedups(r['x_ddp_per_seed'])} | "
                    f"{_dash(r['x_best_powersgd'], '{:.2f}')} | {_speedups(r['x_best_powersgd_per_seed'])} | "
                    f"{r['acc_minus_ddp']:+.2f} | {_dash(r['worst_gap_from_quarter'], '{:+.2f}')} | "
                    f"{_dash(r['step_ms'], '{:.0f}')} | {_dash(r['of_floor'], '{:.2f}')} |"
                )
            lines.append("")
    for key in _cases(table, "world", "rate", "workload", "seed"):
        rows = [r for r in table if (r["world"], r["rate"], r["workload"], r["seed"]) == key]
        metric = rows[0]["metric"]
        scale, unit = (100.0, "%") if metric == "val_acc" else (1.0, "")
        lines += [
            f"#### {key[2]}, P = {key[0]}, link {rate_label(key[1])}, seed {key[3]}: target = {_target_name(target_last)} {metric} "
            f"{rows[0]['target'] * scale:.2f}{unit}",
            "",
            "| scheme | steps to target | time to target (s) | x DDP | x best PowerSGD | final at DDP's steps | "
            "final - DDP | accuracy - DDP's at equal steps (points) | worst accuracy gap from 1/4 on (points) | "
            "step (ms) | step / compute-only's | steps run | at its density from step |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in rows:
            lines.append(
                f"| {r['label']} | {_dash(r['steps_to_target'], '{}')} | {_dash(r['seconds_to_target'], '{:.1f}')} | "
                f"{_dash(r['x_ddp'], '{:.2f}')} | {_dash(r['x_best_powersgd'], '{:.2f}')} | "
                f"{r['final'] * scale:.2f}{unit} | {r['final_minus_ddp'] * scale:+.2f} | {r['acc_minus_ddp']:+.2f} | "
                f"{_dash(r['worst_gap_from_quarter'], '{:+.2f}')} | "
                f"{_dash(r['step_ms'], '{:.0f}')} | {_dash(r['of_floor'], '{:.2f}')} | {r['steps_run']} | "
                f"{_dash(r.get('at_density_from'), '{}')} |"
            )
        lines.append("")
    if checks:
        met = sum(c["met"] for c in checks)
        lines += [f"#### Targets: {met} of {len(checks)} met", "", "| check | case | value | met |", "|---|---|---|---|"]
        lines += [f"| {c['check']} | {c['case']} | {c['value']} | {'yes' if c['met'] else 'NO'} |" for c in checks]
        lines.append("")
    return "\n".join(lines)


def plot(curve: list[dict[str, Any]], out: Path, stem: str, target_last: int = 1) -> list[Path]:
    """Per workload: validation accuracy (loss for the LM) against wall-clock time, one panel per
    (P, link, seed), with the target (DDP's final value, or the mean of its last evaluations) as a
    dotted line."""
    plt = pyplot()
    paths = []
    for workload in sorted({r["workload"] for r in curve}):
        rows = [r for r in curve if r["workload"] == workload]
        metric, _ = TARGET_METRIC.get(workload, ("val_acc", True))
        panels = sorted({(int(r["world"]), r["rate"], int(r["seed"])) for r in rows},
                        key=lambda k: (k[0], -rate_mbit(k[1]), k[2]))
        fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.4), squeeze=False)
        for ax, (world, rate, seed) in zip(axes[0], panels):
            scale = 100 if metric == "val_acc" else 1
            panel = [r for r in rows if (int(r["world"]), r["rate"], int(r["seed"])) == (world, rate, seed)]
            series: dict[str, list[tuple[float, float]]] = defaultdict(list)
            for r in panel:
                series[r["label"]].append((float(r["seconds"]), float(r[metric]) * scale))
            for label, points in sorted(series.items(), key=lambda kv: _label_order(kv[0])):
                points.sort()
                scheme = label.split("@")[0].split("+")[0]
                style = "-" if scheme in DDP_BASELINES or label.endswith("@1%") else "--"
                width = 2.6 if scheme in ("ddp", "ssfusion") else 1.2
                ax.plot([x for x, _ in points], [y for _, y in points], style, marker="o", markersize=2.5, linewidth=width,
                        label=label)
            ddp = [r for r in panel if r["label"] == "ddp"]
            if ddp:
                ax.axhline(scale * ddp_target(ddp, metric, target_last), color="black", linestyle=":", linewidth=1,
                           label="target (DDP's final)" if target_last == 1 else f"target (mean of DDP's last {target_last})")
            ax.set_xlabel("wall-clock seconds (evaluation excluded)")
            ax.set_ylabel("validation accuracy, %" if metric == "val_acc" else "validation loss")
            ax.set_title(f"{workload}, P = {world}, link {rate_label(rate)}, seed {seed}")
            ax.grid(alpha=0.3)
        axes[0][-1].legend(fontsize=6.5, ncol=2)
        paths.append(save_figure(fig, out / f"{stem}_{workload}.png"))
    return paths


def analyze(runs: list[dict[str, Any]], out: Path, stem: str, update: bool, meta: dict[str, Any],
            target_last: int = 1) -> str:
    curve = curve_rows(runs)
    write_csv(out / f"{stem}_curve.csv", CURVE_FIELDS, curve, cell=fmt)
    table = time_to_accuracy(curve, runs, target_last)
    write_csv(out / f"{stem}.csv", TTA_FIELDS, table, cell=fmt)
    summary = across_seeds(table)
    checks = targets(summary)
    text = markdown(table, summary, checks, target_last)
    failed = [f"{r['workload']} {r['label']} P={r['world']} {r['phase']}" for r in runs if r.get("error")]
    if failed:
        text += "\nFailed runs: " + ", ".join(failed) + "\n"
    (out / f"{stem}.md").write_text(text)
    plots = plot(curve, out, stem, target_last) if curve else []
    if update:
        command = "python -m experiments.bench_tta " + " ".join(meta.get("argv") or [])
        block = (f"Command: `{command.strip()}` ({meta.get('cpus')} cores, {meta.get('wall_seconds', 0) / 60:.0f} min). "
                 f"Plots: {', '.join(f'[results/{p.name}](results/{p.name})' for p in plots)}.\n\n{text}")
        update_report(block, marker=stem)
    return text


# =========================================================================== main
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: P = 2, one link, few steps")
    parser.add_argument("--from-raw", action="store_true", help="only rebuild tables, plots and the REPORT block")
    parser.add_argument("--raw", default=None,
                        help="with --from-raw: read the runs of this stem (default --name's) and write under --name")
    parser.add_argument("--target-last", type=int, default=1,
                        help="the target is the mean of DDP's last N evaluations (default 1: its final one); one "
                             "evaluation of the digits split moves by a sample (0.28 points) or two")
    parser.add_argument("--worlds", type=int, nargs="+", default=None)
    parser.add_argument("--rates", nargs="+", default=None, help="tc rates of the links, e.g. 40mbit 300mbit")
    parser.add_argument("--workloads", nargs="+", default=None, choices=sorted(TARGET_METRIC))
    parser.add_argument("--baselines", nargs="+", default=list(DDP_BASELINES), choices=DDP_BASELINES)
    parser.add_argument("--presets", nargs="*", default=list(PRESETS), choices=PRESETS,
                        help="presets to run (none: the baselines alone)")
    parser.add_argument("--densities", type=float, nargs="+", default=list(DENSITIES))
    parser.add_argument("--warmup-epochs", type=float, default=4.0,
                        help="DGC density warm-up of the runs below 1%% density, in epochs (0: none); DGC's "
                             "4 by default (REPORT: at 1 epoch ssfusion@0.1%% ended 3.1 points below DDP, at 4 1.1)")
    parser.add_argument("--variants", type=json.loads, default={},
                        help='more runs of every preset and density with these options, JSON: '
                             '\'{"dgc": {"memory": "dgc"}}\' adds the label ssfusion+dgc@1%%, ...')
    parser.add_argument("--steps", type=json.loads, default=None, help='steps per workload, JSON (e.g. \'{"digits": 120}\')')
    parser.add_argument("--eval-every", type=int, default=None)
    parser.add_argument("--seeds", "--seed", type=int, nargs="+", default=[0],
                        help="one full set of runs per seed; the tables give each seed and the medians over them")
    parser.add_argument("--floor", action="store_true",
                        help="also time the compute-only step (no gradient exchange) per seed: the step-time floor")
    parser.add_argument("--budget-factor", type=float, default=2.0,
                        help="every scheme but DDP may run up to this many times DDP's steps to reach DDP's final "
                             "value (the equal-steps columns still compare at DDP's steps)")
    parser.add_argument("--delay", default=None, help="one-way delay per node (e.g. 0.1ms)")
    parser.add_argument("--nice", type=int, default=-5)
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per world size")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--name", default=None, help="file stem (default tta, quick: tta_quick)")
    parser.add_argument("--no-report", action="store_true")
    args = parser.parse_args(argv)
    if args.target_last < 1:
        parser.error(f"--target-last must be at least 1 (the final evaluation), got {args.target_last}")

    stem = args.name or ("tta_quick" if args.quick else "tta")
    out, update = results_dir(args, "ssf_tta_quick")
    if args.from_raw:
        source = args.raw or stem
        runs = read_jsonl(out / f"{source}_raw.jsonl")
        meta_path = out / f"{source}_meta.json"
        meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
        print(analyze(runs, out, stem, update, meta, args.target_last))
        return 0

    args.worlds = args.worlds or ([2] if args.quick else [2, 4])
    args.rates = args.rates or (["40mbit"] if args.quick else ["40mbit", "300mbit"])
    args.workloads = args.workloads or (["digits"] if args.quick else ["digits", "text"])
    args.steps = {"digits": 8 if args.quick else 240, "text": 8 if args.quick else 240, **(args.steps or {})}
    args.eval_every = args.eval_every or (4 if args.quick else 20)
    from experiments.cluster import probe_support

    support = probe_support()
    if not support.get("usable"):
        print(f"the emulated cluster cannot run here: {support.get('reason', support)}", file=sys.stderr)
        return 2
    started = time.monotonic()
    runs: list[dict[str, Any]] = []
    phases = [{"label": rate, "runs": build_runs(args)} for rate in args.rates]
    with tempfile.TemporaryDirectory(prefix="ssf_tta_") as tmp:
        for world in args.worlds:
            runs += run_world(world, phases, args, Path(tmp))
            write_jsonl(out / f"{stem}_raw.jsonl", runs)
    meta = {"argv": sys.argv[1:] if argv is None else argv, "cpus": os.cpu_count(), "wall_seconds": time.monotonic() - started,
            "worlds": args.worlds, "rates": args.rates, "steps": args.steps, "eval_every": args.eval_every}
    (out / f"{stem}_meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    print(analyze(runs, out, stem, update, meta, args.target_last))
    return 1 if any(r.get("error") for r in runs) or not runs else 0


if __name__ == "__main__":
    sys.exit(main())
