"""End-to-end benchmark, report (experiments/bench_e2e.py runs it, e2e_analyze.py analyses it): the
Markdown tables, the generated blocks of REPORT.md and the plots, and ``write_all``, which rebuilds
every output of a results directory from its raw CSVs.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

from experiments.common import COLORS, REPORT, cell, pyplot, rate_label, read_csv, save_figure, update_report, write_csv
from experiments.e2e_analyze import (
    SCHEMES,
    SUMMARY_FIELDS,
    TARGET_FIELDS,
    headline_rate,
    qualifying_rates,
    scheme_order,
    summarize,
    summary_csv_rows,
    target_csv_rows,
    targets,
    workload_order,
)


def write_all(out: Path, stem: str, update: bool) -> tuple[list[dict], list[dict]]:
    """Every output of <out>/<stem> from its raw CSVs (<stem>_steps.csv, <stem>_runs.csv and, when there,
    <stem>_curve.csv): the summary and target CSVs and Markdown, the plots and, with ``update``, the
    e2e blocks of REPORT.md. Returns the summary and target rows."""
    steps = read_csv(out / f"{stem}_steps.csv")
    runs = read_csv(out / f"{stem}_runs.csv")
    summary = summarize(steps, runs)
    target_rows = targets(summary)
    write_csv(out / f"{stem}.csv", SUMMARY_FIELDS, summary_csv_rows(summary))
    (out / f"{stem}.md").write_text(summary_markdown(summary) + "\n## Targets\n\n" + targets_markdown(target_rows) + "\n")
    write_csv(out / f"{stem}_targets.csv", TARGET_FIELDS, target_csv_rows(target_rows))
    (out / f"{stem}_targets.md").write_text(targets_markdown(target_rows) + "\n")
    plot_throughput(summary, out / f"{stem}_throughput.png")
    plot_breakdown(summary, out / f"{stem}_breakdown.png")
    plot_loss(steps, runs, out / f"{stem}_loss.png")
    curve_path = out / f"{stem}_curve.csv"
    curve = read_csv(curve_path) if curve_path.exists() else []
    plot_accuracy(curve, out / f"{stem}_accuracy.png")
    if update:
        blocks = {"e2e-curve": curve_markdown(curve) if curve else None, "e2e": report_block(summary, target_rows),
                  "e2e-headline": headline_block(summary, target_rows)}
        for marker, block in blocks.items():
            if block is not None and update_report(block, marker):
                print(f"updated the {marker} block of {REPORT}")
    return summary, target_rows


# =========================================================================== Markdown
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
            ms = lambda k: cell(None if r.get(k) is None else r[k] * 1e3, "{:.1f}")  # noqa: E731
            lines.append(
                f"| {r['scheme']} | {ms('step_s')} | {cell(r['samples_per_s'], '{:.1f}')} | {ms('compute_s')} | "
                f"{ms('compress_s')} | {ms('exposed_comm_s')} | {ms('other_s')} | {cell(r['comm_fraction'], '{:.2f}')} | "
                f"{cell(None if r['bytes_per_step'] is None else r['bytes_per_step'] / 1e3, '{:.1f}')} | "
                f"{cell(r['x_ddp'], '{:.2f}')} | {cell(r['x_best_hook'], '{:.2f}')} | {cell(r['of_compute'], '{:.2f}')} | "
                f"{cell(r['val_acc'], '{:.4f}')} | {cell(r['val_loss'], '{:.3f}')} |")
        lines.append("")
    return "\n".join(lines)


def targets_markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| P | workload | check | link | value | target | met | note |", "|---|---|---|---|---:|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['world']} | {r['workload']} | {r['check']} | {r['rate']} | "
                     f"{cell(r['value'], '{:.3f}')} | {r['target']} | {'yes' if r['met'] else '**no**'} | {r['note']} |")
    return "\n".join(lines)


def report_block(summary: list[dict[str, Any]], target_rows: list[dict[str, Any]]) -> str:
    """The generated part of REPORT.md: targets, then the headline phase's breakdown per workload."""
    lines = ["### Targets, at every link where dense DDP is >= 2/3 communication", "",
             targets_markdown(target_rows), ""]
    worlds = sorted({r["world"] for r in summary})
    for world in worlds[-1:]:
        for workload in sorted({r["workload"] for r in summary if r["world"] == world}, key=workload_order):
            rate, _ = headline_rate(summary, world, workload)
            if rate is None:
                continue
            lines += [f"### P = {world}, {workload}, link {rate_label(rate)}: step time split", "",
                      "| scheme | step ms | samples/s | compute | compress | exposed comm | other | KB/step | x ddp | x hook | of compute |",
                      "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
            for r in summary:
                if (r["world"], r["rate"], r["workload"]) != (world, rate, workload):
                    continue
                ms = lambda k: cell(None if r.get(k) is None else r[k] * 1e3, "{:.0f}")  # noqa: E731
                lines.append(
                    f"| {r['scheme']} | {ms('step_s')} | {cell(r['samples_per_s'], '{:.0f}')} | {ms('compute_s')} | "
                    f"{ms('compress_s')} | {ms('exposed_comm_s')} | {ms('other_s')} | "
                    f"{cell(None if r['bytes_per_step'] is None else r['bytes_per_step'] / 1e3, '{:.1f}')} | "
                    f"{cell(r['x_ddp'], '{:.2f}')} | {cell(r['x_best_hook'], '{:.2f}')} | {cell(r['of_compute'], '{:.2f}')} |")
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
                         f"{cell(r['train_loss_end'], '{:.3f}')} | {cell(delta, '{:+.1f}')} |")
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
    for workload in sorted({w for w, _ in series}, key=workload_order):
        schemes = sorted({s for w, s in series if w == workload}, key=scheme_order)
        points = sorted({step for s in schemes for step in series[(workload, s)]})
        ddp = series.get((workload, "ddp"), {})
        lines += [f"#### {workload}, P = {worlds[workload]}: validation accuracy (%) after each number of steps", "",
                  "| scheme | " + " | ".join(str(p) for p in points) + " | within 1 point of ddp from step |",
                  "|---|" + "---:|" * (len(points) + 1)]
        for scheme in schemes:
            accs = series[(workload, scheme)]
            close = [p for p in points if p in accs and p in ddp and accs[p] >= ddp[p] - 1]
            since = next((p for p in points if all(q in close for q in points if q >= p)), None)
            cells = " | ".join(cell(accs.get(p), "{:.1f}") for p in points)
            lines.append(f"| {scheme} | {cells} | {since if since is not None else 'not within'} |")
        lines.append("")
    return "\n".join(lines)


def headline_block(summary: list[dict[str, Any]], target_rows: list[dict[str, Any]]) -> str:
    """The key ratios in a few bullets (REPORT.md's first numbers), one per world size and workload."""
    find = {(t["world"], t["workload"], t["check"], t["rate"]): t for t in target_rows}
    lines = []
    for world in sorted({t["world"] for t in target_rows}, reverse=True):
        for workload in sorted({t["workload"] for t in target_rows if t["world"] == world}, key=workload_order):
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


# =========================================================================== plots
def plot_throughput(summary: list[dict[str, Any]], path: Path) -> Path:
    """Samples/s against the link rate, one panel per (P, workload), one line per scheme."""
    plt = pyplot()
    worlds = sorted({r["world"] for r in summary})
    workloads = sorted({r["workload"] for r in summary}, key=workload_order)
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
    return save_figure(fig, path)


def plot_breakdown(summary: list[dict[str, Any]], path: Path) -> Path:
    """The step time split (compute, compression, exposed communication, other) per scheme, at the
    largest P on each workload's headline link."""
    plt = pyplot()
    world = max(r["world"] for r in summary)
    workloads = sorted({r["workload"] for r in summary}, key=workload_order)
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
    return save_figure(fig, path)


def plot_loss(steps: list[dict[str, str]], runs: list[dict[str, str]], path: Path) -> Path | None:
    """Training loss per step of the accuracy runs (rank 0's batch), smoothed over 5 steps."""
    evaluated = {(r["world"], r["rate"], r["workload"], r["scheme"], r["rep"]) for r in runs if r["val_acc"]}
    curves: dict[tuple, list[tuple[int, float]]] = defaultdict(list)
    for s in steps:
        key = (s["world"], s["rate"], s["workload"], s["scheme"], s["rep"])
        if key in evaluated and s.get("train_loss"):
            curves[key].append((int(s["step"]), float(s["train_loss"])))
    lines = []
    for (world, _rate, workload, scheme, _rep), points in curves.items():
        points.sort()
        ys = [y for _, y in points]
        smooth = [statistics.mean(ys[max(0, i - 4): i + 1]) for i in range(len(ys))]
        lines.append((world, workload, scheme, [(x, y) for (x, _), y in zip(points, smooth)]))
    return _per_workload(lines, "training loss (rank 0, mean of 5 steps)", path) if lines else None


def plot_accuracy(curve: list[dict[str, str]], path: Path) -> Path | None:
    """Validation accuracy of the accuracy runs against the step (rank 0's model, fixed split)."""
    series: dict[tuple, list[tuple[int, float]]] = defaultdict(list)
    for row in curve:
        series[(row["world"], row["workload"], row["scheme"])].append((int(row["step"]), 100 * float(row["val_acc"])))
    lines = [(world, workload, scheme, sorted(points)) for (world, workload, scheme), points in series.items()]
    return _per_workload(lines, "validation accuracy, % (top-1 / next token)", path, marker="o", markersize=3) if lines else None


def _per_workload(lines: list[tuple[str, str, str, list[tuple[float, float]]]], ylabel: str, path: Path, **style) -> Path:
    """One panel per workload against the step, one line per (world, workload, scheme, points)."""
    plt = pyplot()
    workloads = sorted({workload for _, workload, _, _ in lines}, key=workload_order)
    fig, axes = plt.subplots(1, len(workloads), figsize=(6.5 * len(workloads), 4.2), squeeze=False)
    for ax, workload in zip(axes[0], workloads):
        for _, of, scheme, points in sorted(lines, key=lambda line: scheme_order(line[2])):
            if of == workload:
                ax.plot([x for x, _ in points], [y for _, y in points], label=scheme, color=COLORS.get(scheme),
                        linewidth=2.5 if scheme in ("ddp", "ssfusion") else 1.2, **style)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        world = next(line[0] for line in lines if line[1] == workload)
        ax.set_title(f"{workload}, P = {world}")
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=7, ncol=2)
    return save_figure(fig, path)
