"""Accuracy gap to DDP at every evaluation, over seeds, for runs of ``bench_tta``.

Each run's accuracy at a step minus its own launch's DDP at the same seed and step (DDP is the
reference of its launch; the runs of several launches can be drawn together), then per label and
step the median and the range over seeds. A scheme that only rounds the gradient (DDP + fp16)
shows how far the trajectory alone moves that gap: the band a target in points can be resolved
against on that data.

    python -m experiments.gap_curves tta_noise_floor6:ddp_fp16 tta_dgc_feedback6:ssfusion+dgc_fb90@1% \\
        tta_dgc_feedback6_d01:ssfusion+dgc_fb90@0.1% --name gap_curves_digits

Each argument is ``<run stem>:<label>`` (the stem of its ``<stem>_curve.csv`` in experiments/results).
Writes <name>.md (per label: median and range at every evaluation) and <name>.png.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import defaultdict
from pathlib import Path

from experiments.common import RESULTS, pyplot, read_csv, save_figure

Gaps = dict[int, dict[str, float]]  # step -> seed -> points


def gaps_to_ddp(curve: list[dict[str, str]], label: str) -> Gaps:
    """Points of validation accuracy of ``label`` minus DDP's of the same (P, link, workload, seed)
    and step, at the steps both evaluated."""
    ddp = {(r["world"], r["rate"], r["workload"], r["seed"], int(r["step"])): float(r["val_acc"])
           for r in curve if r["label"] == "ddp"}
    gaps: Gaps = defaultdict(dict)
    for r in curve:
        key = (r["world"], r["rate"], r["workload"], r["seed"], int(r["step"]))
        if r["label"] == label and key in ddp:
            gaps[key[-1]][f"{key[0]}/{key[1]}/{key[2]}/{key[3]}"] = 100 * (float(r["val_acc"]) - ddp[key])
    if not gaps:
        labels = sorted({r["label"] for r in curve})
        raise SystemExit(f"no evaluations of {label!r} beside DDP's; the run's labels: {', '.join(labels)}")
    return dict(gaps)


def summary(gaps: Gaps) -> list[tuple[int, float, float, float, int]]:
    """(step, median, min, max, seeds) at every step."""
    return [(step, statistics.median(values), min(values), max(values), len(values))
            for step, values in ((step, list(gaps[step].values())) for step in sorted(gaps))]


def markdown(series: dict[str, Gaps], quarter_from: int) -> str:
    steps = sorted({step for gaps in series.values() for step in gaps})
    lines = [
        "Accuracy minus DDP's at the same seed and step (points): median over seeds, range in brackets.",
        "",
        "| run: label | " + " | ".join(str(s) for s in steps) + f" | worst median from step {quarter_from} on |",
        "|---|" + "---|" * (len(steps) + 1),
    ]
    for name, gaps in series.items():
        rows = {step: (median, low, high) for step, median, low, high, _ in summary(gaps)}
        cells = [f"{rows[s][0]:+.1f} [{rows[s][1]:+.1f}, {rows[s][2]:+.1f}]" if s in rows else "" for s in steps]
        worst = min((rows[s][0] for s in steps if s in rows and s >= quarter_from), default=float("nan"))
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {worst:+.1f} |")
    return "\n".join(lines) + "\n"


def plot(series: dict[str, Gaps], path: Path, quarter_from: int) -> Path:
    """Left: every evaluation; right: from a quarter of DDP's steps on, at the scale of the band."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(14, 4.8))
    for ax, start in zip(axes, (0, quarter_from)):
        for name, gaps in series.items():
            rows = [r for r in summary(gaps) if r[0] >= start]
            steps = [r[0] for r in rows]
            line, = ax.plot(steps, [r[1] for r in rows], marker="o", markersize=3, linewidth=1.8,
                            label=f"{name} (median)")
            ax.fill_between(steps, [r[2] for r in rows], [r[3] for r in rows], color=line.get_color(), alpha=0.12)
        ax.axhline(0.0, color="black", linewidth=0.8)
        ax.axhspan(-0.3, 0.3, color="grey", alpha=0.35, label="issue 15's 0.3-point band")
        ax.set_xlabel("step")
        ax.set_ylabel("accuracy - DDP's (points); shaded: range over seeds")
        ax.grid(alpha=0.3)
    axes[0].axvline(quarter_from, color="black", linestyle=":", linewidth=1, label="a quarter of DDP's steps")
    axes[0].set_title("Gap to DDP at equal steps, every evaluation")
    axes[1].set_ylim(-12, 12)
    axes[1].set_title(f"From a quarter of DDP's steps on (step {quarter_from})")
    axes[0].legend(fontsize=7)
    return save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", help="<run stem>:<label>, e.g. tta_noise_floor6:ddp_fp16")
    parser.add_argument("--ddp-steps", type=int, default=150, help="DDP's steps: the gaps are drawn up to them")
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--name", default="gap_curves")
    args = parser.parse_args(argv)
    series: dict[str, Gaps] = {}
    for spec in args.runs:
        stem, sep, label = spec.partition(":")
        if not sep or not label:
            parser.error(f"each run is <run stem>:<label>, got {spec!r}")
        path = args.results / f"{stem}_curve.csv"
        if not path.exists():
            parser.error(f"{path} does not exist (a bench_tta run writes <stem>_curve.csv)")
        gaps = gaps_to_ddp(read_csv(path), label)
        series[f"{stem}: {label}"] = {step: seeds for step, seeds in gaps.items() if step <= args.ddp_steps}
    quarter_from = args.ddp_steps // 4
    text = markdown(series, quarter_from)
    (args.results / f"{args.name}.md").write_text(text)
    plot(series, args.results / f"{args.name}.png", quarter_from)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
