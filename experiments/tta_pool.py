"""Pool the end-of-run accuracy of several bench_tta launches: per scheme label, its gap to DDP at
DDP's last evaluation and averaged over DDP's last three, every (launch, seed) run counted once.

    python -m experiments.tta_pool experiments/results/tta_warmup4_01_curve.csv \
        experiments/results/tta_warmup4_dgc_01_curve.csv --name tta_pool_01

Why: on the 360-digit validation split one evaluation moves by 2-3 points and a scheme's run ends
on whichever evaluation its oscillation gives (the same configuration and seed ended up to 7 points
apart in two launches), so a single launch's final value cannot decide a 1-point target. Each run
is compared with the DDP run of its own launch and seed.

Writes <name>.md and <name>.png (or --out DIR) and prints the table.
"""

from __future__ import annotations

import argparse
import csv
import statistics
from collections import defaultdict
from pathlib import Path

from experiments.common import RESULTS, pyplot, save_figure

#: how many of DDP's last evaluations the averaged gap spans
LAST = 3


def run_gaps(curve_csv: Path) -> list[dict]:
    """(label, seed, final gap, averaged gap) in points, for every non-DDP run of one launch."""
    curves: dict[tuple[str, str], dict[int, float]] = defaultdict(dict)
    with curve_csv.open() as f:
        for row in csv.DictReader(f):
            curves[(row["seed"], row["label"])][int(row["step"])] = 100 * float(row["val_acc"])
    out = []
    for (seed, label), curve in sorted(curves.items()):
        ddp = curves.get((seed, "ddp"))
        if label == "ddp" or not ddp:
            continue
        steps = sorted(ddp)[-LAST:]
        if any(step not in curve for step in steps):
            continue  # the run did not reach DDP's steps
        final = curve[steps[-1]] - ddp[steps[-1]]
        averaged = statistics.mean(curve[s] for s in steps) - statistics.mean(ddp[s] for s in steps)
        out.append({"launch": curve_csv.name.removesuffix("_curve.csv"), "seed": seed, "label": label,
                    "final": final, "averaged": averaged})
    return out


def table(gaps: list[dict], band: float) -> str:
    by_label: dict[str, list[dict]] = defaultdict(list)
    for gap in gaps:
        by_label[gap["label"]].append(gap)
    lines = [
        f"| scheme | runs | launches | final - DDP, median (mean) | mean of the last {LAST} evaluations - DDP's, "
        f"median (mean) | runs within {band:g} point at the end |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for label, runs in sorted(by_label.items()):
        final = [r["final"] for r in runs]
        averaged = [r["averaged"] for r in runs]
        lines.append(
            f"| {label} | {len(runs)} | {len({r['launch'] for r in runs})} "
            f"| {statistics.median(final):+.2f} ({statistics.mean(final):+.2f}) "
            f"| {statistics.median(averaged):+.2f} ({statistics.mean(averaged):+.2f}) "
            f"| {sum(f >= -band for f in final)} of {len(final)} |"
        )
    return "\n".join(lines) + "\n"


def plot(gaps: list[dict], band: float, path: Path) -> Path:
    plt = pyplot()
    labels = sorted({g["label"] for g in gaps})
    fig, ax = plt.subplots(figsize=(1.2 + 0.9 * len(labels), 4))
    for x, label in enumerate(labels):
        runs = [g for g in gaps if g["label"] == label]
        ax.scatter([x - 0.12] * len(runs), [g["final"] for g in runs], s=14, color="tab:blue",
                   label="final evaluation" if x == 0 else None)
        ax.scatter([x + 0.12] * len(runs), [g["averaged"] for g in runs], s=14, color="tab:orange",
                   label=f"mean of the last {LAST}" if x == 0 else None)
    ax.axhspan(-band, band, color="0.85", zorder=0, label=f"within {band:g} point")
    ax.axhline(0, color="0.4", lw=0.8)
    ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right")
    ax.set_ylabel("accuracy - DDP's (points)")
    ax.legend(fontsize=8)
    return save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("curves", nargs="+", type=Path, help="bench_tta <name>_curve.csv files")
    parser.add_argument("--band", type=float, default=1.0, help="the target's band in points (default 1)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--name", default="tta_pool")
    args = parser.parse_args(argv)
    gaps = [gap for path in args.curves for gap in run_gaps(path)]
    if not gaps:
        parser.error("no run reached its DDP's steps in these files")
    sources = ", ".join(p.name for p in args.curves)
    text = f"Pooled from {sources}.\n\n" + table(gaps, args.band)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.md").write_text(text)
    plot(gaps, args.band, args.out / f"{args.name}.png")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
