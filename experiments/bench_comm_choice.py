"""comm="auto" against every fixed collective it chooses among, on the emulated cluster (issue 16:
"auto within 5% of the best fixed scheme at P = 2 and 4").

The ssfusion preset runs with comm="auto" and with comm fixed to each scheme of
``commcost.SCHEMES``, as bench_e2e runs alternated variant by variant (the order reversed every
other repeat). Every run has Lightning ddp beside it, and the first variant of each repeat also DDP
+ PowerSGD ranks 1 and 4. A step time is taken as its ratio to the ddp of the same run, which
cancels most of the outside load that run saw; the medians over repeats are compared.

    python -m experiments.bench_comm_choice                        # P = 2 and 4, 40 and 150 Mbit/s (root)
    python -m experiments.bench_comm_choice --from-csv             # tables and plot from the CSV

Writes <out>/<name>.csv (one row per variant, repeat, P, workload, link and scheme), <name>.md
(medians, auto over the best fixed scheme, auto's per-buffer choices) and <name>.png.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections import Counter, defaultdict
from pathlib import Path

from experiments.ab_engine_options import run_variant
from experiments.common import (
    REPO,
    RESULTS,
    cell,
    median,
    pyplot,
    read_csv,
    read_jsonl,
    save_figure,
    update_report,
    write_csv,
)
from ssfusion_lightning.commcost import SCHEMES

FIELDS = ("variant", "repeat", "world", "workload", "rate", "scheme", "step_ms", "ddp_step_ms", "x_ddp_step", "buffers", "choices")
HOOKS = ("ddp_powersgd", "ddp_powersgd4")
#: auto may be this much slower than the best fixed scheme (issue 16)
TOLERANCE = 1.05


def variants(schemes: list[str]) -> dict[str, dict]:
    return {"auto": {"comm": "auto"}, **{scheme: {"comm": scheme} for scheme in schemes}}


def auto_choices(raw: Path) -> dict[tuple[str, str, str], str]:
    """(P, workload, link) -> the collectives auto's final plan chose, counted over its buffers."""
    out = {}
    for record in read_jsonl(raw) if raw.exists() else []:
        if record.get("scheme") == "ssfusion" and record.get("plan_comm"):
            counts = Counter(c for c in record["plan_comm"].split(";") if c)
            key = (str(record["world"]), record["workload"], record["phase"])
            out[key] = " ".join(f"{c}:{n}" for c, n in sorted(counts.items()))
    return out


def run(args: argparse.Namespace) -> list[dict]:
    rows: list[dict] = []
    chosen = variants(args.comms)
    with tempfile.TemporaryDirectory() as scratch:
        for repeat in range(args.repeats):
            order = list(chosen) if repeat % 2 == 0 else list(reversed(chosen))
            for position, variant in enumerate(order):
                schemes = ["ssfusion", *(HOOKS if position == 0 else ())]
                got = run_variant(args, variant, json.dumps(chosen[variant]), REPO, "", repeat, Path(scratch), schemes)
                choices = auto_choices(Path(scratch) / f"{variant}_{repeat}_raw.jsonl") if variant == "auto" else {}
                for r in got:
                    if r["scheme"] in HOOKS:
                        r["variant"] = r["scheme"]
                    else:
                        r["choices"] = choices.get((str(r["world"]), r["workload"], r["rate"]), "")
                    rows.append(r)
                print(f"repeat {repeat}: {variant} done", flush=True)
    return rows


def summarize(rows: list[dict]) -> list[dict]:
    """Per P, workload and link: every variant's median step / ddp, the best fixed scheme, auto over it."""
    by: dict[tuple, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    choices: dict[tuple, list[str]] = defaultdict(list)
    for r in rows:
        key = (int(r["world"]), r["workload"], r["rate"])
        by[key][r["variant"]].append(float(r["x_ddp_step"]))
        if r["variant"] == "auto" and r.get("choices"):
            choices[key].append(r["choices"])
    out = []
    for key, values in sorted(by.items()):
        medians = {variant: median(v) for variant, v in values.items()}
        fixed = {v: m for v, m in medians.items() if v in SCHEMES}
        best = min(fixed, key=fixed.get) if fixed else None
        auto = medians.get("auto")
        ratio = auto / fixed[best] if auto is not None and best is not None else None
        out.append({
            "world": key[0], "workload": key[1], "rate": key[2], "medians": medians, "repeats": len(values.get("auto", [])),
            "best_fixed": best, "auto_over_best": ratio, "met": ratio is not None and ratio <= TOLERANCE,
            "choices": choices.get(key, []),
        })
    return out


def markdown(summary: list[dict], comms: list[str], meta: dict, rows: list[dict] = ()) -> str:
    columns = ["auto", *comms, *HOOKS]
    lines = [
        f"The ssfusion preset (density {meta.get('density', '1%')}) with comm=auto and with each fixed scheme, "
        f"{meta.get('repeats')} repeats alternated variant by variant. Each cell: the median over repeats of the "
        "scheme's median step time over Lightning ddp's in the same run (lower is faster). "
        f"Target: auto at most {TOLERANCE:.2f}x the best fixed scheme.",
        "",
        "| P | workload | link | " + " | ".join(columns) + " | best fixed | auto / best | met | auto's choices (buffers, per repeat) |",
        "|---|---|---|" + "---:|" * len(columns) + "---|---:|---|---|",
    ]
    for s in summary:
        cells = [cell(s["medians"].get(c), "{:.3f}") for c in columns]
        lines.append(
            f"| {s['world']} | {s['workload']} | {s['rate']} | " + " | ".join(cells)
            + f" | {s['best_fixed']} | {cell(s['auto_over_best'], '{:.3f}')} | {'yes' if s['met'] else 'no'} | "
            + "; ".join(s["choices"]) + " |"
        )
    met = sum(s["met"] for s in summary)
    lines += ["", f"auto within {TOLERANCE:.2f}x of the best fixed scheme in {met} of {len(summary)} cases."]
    return "\n".join(lines + by_buffers(rows)) + "\n"


def by_buffers(rows: list[dict]) -> list[str]:
    """Step / ddp by the number of buffers the run's cost cut made (the cut follows the costs each
    run measures, so repeats of one variant can differ): the share of a gap that is the cut's."""
    groups: dict[tuple, list[float]] = defaultdict(list)
    for r in rows:
        if r.get("buffers") and r["variant"] not in HOOKS:
            groups[(int(r["world"]), r["workload"], r["rate"], r["variant"], int(r["buffers"]))].append(float(r["x_ddp_step"]))
    if not groups:
        return []
    lines = [
        "", "Step / ddp by the buffers of the run's final plan (every run of a variant; median, and the number of runs):",
        "", "| P | workload | link | variant | buffers | step / ddp | runs |", "|---|---|---|---|---:|---:|---:|",
    ]
    for (world, workload, rate, variant, buffers), values in sorted(groups.items()):
        lines.append(f"| {world} | {workload} | {rate} | {variant} | {buffers} | {median(values):.3f} | {len(values)} |")
    return lines


def plot(summary: list[dict], comms: list[str], path: Path) -> None:
    plt = pyplot()
    columns = ["auto", *comms, *HOOKS]
    fig, ax = plt.subplots(figsize=(2 + 1.9 * len(summary), 4))
    width = 0.8 / len(columns)
    for j, column in enumerate(columns):
        values = [s["medians"].get(column) or 0.0 for s in summary]
        xs = [i + (j - (len(columns) - 1) / 2) * width for i in range(len(summary))]
        colour = "tab:blue" if column == "auto" else ("tab:orange" if column in HOOKS else None)
        ax.bar(xs, values, width=width, label=column, color=colour, alpha=0.8 if colour else 0.5)
    ax.set_xticks(range(len(summary)), [f"P={s['world']} {s['workload']}\n{s['rate']}" for s in summary], fontsize=8)
    ax.set_ylabel("step time / ddp's (same run)")
    ax.set_title("ssfusion with comm=auto and each fixed collective; lower is faster", fontsize=9)
    ax.legend(fontsize=7, ncol=2)
    save_figure(fig, path)


def write_outputs(rows: list[dict], out: Path, name: str, meta: dict) -> str:
    summary = summarize(rows)
    text = markdown(summary, meta["comms"], meta, rows)
    (out / f"{name}.md").write_text(
        f"# comm=auto against the fixed collectives (emulated cluster)\n\nCommand: `python -m experiments.bench_comm_choice "
        f"{' '.join(meta.get('argv', []))}`\n\n{text}"
    )
    plot(summary, meta["comms"], out / f"{name}.png")
    if name == "comm_choice" and out.resolve() == RESULTS.resolve() and update_report(text, marker="comm-choice"):
        print("updated the comm-choice block of experiments/REPORT.md")
    return text


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--comms", nargs="+", default=list(SCHEMES), choices=SCHEMES, help="the fixed schemes")
    parser.add_argument("--repeats", type=int, default=2, help="runs per variant, alternated")
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--rates", nargs="+", default=["40mbit", "150mbit"])
    parser.add_argument("--workloads", nargs="+", default=["resnet18"])
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--name", default="comm_choice")
    parser.add_argument("--from-csv", action="store_true", help="only rebuild the tables and plot from <out>/<name>.csv")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    meta_path = args.out / f"{args.name}_meta.json"
    if args.from_csv:
        print(write_outputs(read_csv(args.out / f"{args.name}.csv"), args.out, args.name, json.loads(meta_path.read_text())))
        return
    rows = run(args)
    meta = {"argv": argv if argv is not None else sys.argv[1:], "comms": args.comms, "repeats": args.repeats,
            "worlds": args.worlds, "rates": args.rates, "workloads": args.workloads}
    meta_path.write_text(json.dumps(meta, indent=1) + "\n")
    write_csv(args.out / f"{args.name}.csv", FIELDS, rows)
    print(write_outputs(rows, args.out, args.name, meta))


if __name__ == "__main__":
    main()
