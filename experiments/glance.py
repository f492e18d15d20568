"""The REPORT's first table: the ssfusion preset against what a user would run instead, from
side-by-side launches (experiments/side_by_side.py), every ratio paired in the same ranks.

    python -m experiments.glance never_slower_p2 never_slower_p4 overlap_side_2

Each name is a launch's ``<name>_raw.json`` in experiments/results (every rank's samples). Per
launch, link and workload, and per baseline the launch ran (``ddp``, ``ddp_powersgd``,
``ddp_powersgd4``, ``compute_only``): ssfusion's speed over the baseline's, as the median over the
block pairs of the pair's speed ratio (each the median over the ranks), and in how many of the
pairs ssfusion was the faster. It writes results/glance.md, results/glance.png and the ``glance``
block of experiments/REPORT.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from experiments.common import COLORS, RESULTS, pyplot, rate_label, save_figure, update_report

SCHEME = "ssfusion"
#: the baselines a cell compares with, in the table's order, with their column names
BASELINES = {"ddp": "DDP", "ddp_powersgd": "PowerSGD rank 1", "ddp_powersgd4": "PowerSGD rank 4",
             "compute_only": "compute-only"}


def pair_speeds(by_rank: dict[str, Any], workload: str, baseline: str) -> list[float]:
    """Per block pair: the baseline's block median step over ssfusion's (above 1: ssfusion faster),
    the median over the ranks."""
    per_rank = []
    for result in by_rank.values():
        samples = result[workload]["samples"]
        medians = {s: [statistics.median(row["wall"] for row in block) for block in samples[s]] for s in (SCHEME, baseline)}
        per_rank.append([b / a for a, b in zip(medians[SCHEME], medians[baseline])])
    return [statistics.median(pair) for pair in zip(*per_rank)]


def cells(names: list[str], folder: Path = RESULTS) -> list[dict[str, Any]]:
    """One row per (launch, link, workload): ssfusion's speed over every baseline the launch ran."""
    rows = []
    for name in names:
        world = json.loads((folder / f"{name}.json").read_text())["world"]
        raw = json.loads((folder / f"{name}_raw.json").read_text())
        for rate, by_rank in raw.items():
            workloads = next(iter(by_rank.values()))
            for workload, result in workloads.items():
                if SCHEME not in result["samples"]:
                    continue
                # a launch that recorded no memory ran every engine scheme with the residual one
                memory = result.get("memories", {}).get(SCHEME, "residual")
                row = {"launch": name, "world": world, "link": rate_label(rate), "workload": workload, "memory": memory,
                       "speed": {}}
                for baseline in BASELINES:
                    if baseline in result["samples"]:
                        speeds = pair_speeds(by_rank, workload, baseline)
                        row["speed"][baseline] = (statistics.median(speeds), sum(s > 1 for s in speeds), len(speeds))
                rows.append(row)
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    header = " | ".join(f"x {label}" for label in BASELINES.values())
    lines = [f"| P | link | workload | memory | {header} | launch |", "|---|---|---|---|" + "---:|" * len(BASELINES) + "---|"]
    for row in rows:
        shown = []
        for baseline in BASELINES:
            if baseline not in row["speed"]:
                shown.append("-")
                continue
            speed, faster, pairs = row["speed"][baseline]
            shown.append(f"{speed:.2f} ({faster}/{pairs})")
        lines.append(f"| {row['world']} | {row['link']} | {row['workload']} | {row['memory']} | {' | '.join(shown)} "
                     f"| {row['launch']} |")
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: Path) -> Path:
    """Bars per cell: ssfusion's speed over each baseline, with the line where they are equal."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(min(16.0, max(6.0, 1.05 * len(rows))), 4.2))
    width = 0.8 / len(BASELINES)
    for i, (baseline, label) in enumerate(BASELINES.items()):
        at = [c for c, row in enumerate(rows) if baseline in row["speed"]]
        speeds = [rows[c]["speed"][baseline][0] for c in at]
        bars = ax.bar([c + (i - (len(BASELINES) - 1) / 2) * width for c in at], speeds, width,
                      label=f"over {label}", color=COLORS.get(baseline))
        ax.bar_label(bars, fmt="%.2f", fontsize=6)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(rows)), [f"{r['workload']}\nP={r['world']} {r['link']}" for r in rows], fontsize=7)
    ax.set_ylabel("ssfusion's speed / the baseline's")
    ax.set_title("the ssfusion preset against each baseline, paired blocks in the same ranks", fontsize=9)
    ax.legend(fontsize=7, ncol=len(BASELINES), loc="upper center", bbox_to_anchor=(0.5, -0.22))
    return save_figure(fig, path)


def block(names: list[str], rows: list[dict[str, Any]]) -> str:
    """The REPORT's glance block: the command, the table and the plot's link."""
    command = f"python -m experiments.glance {' '.join(names)}"
    return "\n".join([
        f"`{command}` (launches of `experiments/side_by_side.py`; their commands: results/<launch>.md). "
        "Each cell: ssfusion's speed over the baseline's, the median over block pairs; in brackets the pairs "
        "in which ssfusion was the faster. Above 1: ssfusion is faster. memory: the error feedback ssfusion ran "
        "(the preset's `auto` picks `dgc` for resnet18's SGD with momentum, `adam` for gpt2's AdamW).",
        "", markdown(rows), "", "Plot: [results/glance.png](results/glance.png)",
    ])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="+", help="side_by_side launches (<name>_raw.json in --out)")
    parser.add_argument("--out", default=None, help="folder of the launches and of glance.md/.png (default: experiments/results)")
    parser.add_argument("--no-report", action="store_true", help="leave experiments/REPORT.md alone")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    folder = Path(args.out) if args.out else RESULTS
    missing = [n for n in args.names if not (folder / f"{n}_raw.json").exists()]
    if missing:
        parser.error(f"no side_by_side launch named {', '.join(missing)} in {folder} (want <name>_raw.json and <name>.json)")
    rows = cells(args.names, folder)
    text = block(args.names, rows)
    (folder / "glance.md").write_text(text + "\n")
    plot(rows, folder / "glance.png")
    if not args.no_report and update_report(text, "glance"):
        print("updated the glance block of experiments/REPORT.md")
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
