"""comm="auto" against every fixed collective it chooses among, on the emulated cluster (issue 16:
"auto within 5% of the best fixed scheme at P = 2 and 4").

The ssfusion preset runs with comm="auto" and with comm fixed to each scheme of
``commcost.SCHEMES``. Each repeat is ONE launch of the ranks on the emulated cluster (one per P,
every link a phase of it), and inside it every variant runs ``--pairs`` times, beside Lightning
ddp, in an order reversed every other time; DDP + PowerSGD ranks 1 and 4 run once per launch.
Why in one launch: on this 2-core host a launch's step times fall into one of two modes (a
compute slow-down of about 25% that holds for the whole launch, results/launch_modes_p2_150.md);
variants compared across launches compare modes, variants of one launch share theirs.

A step time is taken as its ratio to the ddp run of the same launch and pair. Per cell the table
gives every variant's median ratio, the best fixed scheme by that median, and auto over it twice:
by the medians, and paired -- the median over (launch, pair) of auto's step over the best fixed
scheme's step in the same launch and pair. The target is judged on the paired ratio where the
rows have pairs (older CSVs, one variant per launch, have none: judged on the medians).

    python -m experiments.bench_comm_choice                        # P = 2 and 4, 40 and 150 Mbit/s (root)
    python -m experiments.bench_comm_choice --from-csv             # tables and plot from the CSV

Writes <out>/<name>.csv (one row per variant run: launch, pair, P, workload, link), <name>.md
(medians, auto over the best fixed scheme, auto's per-buffer choices) and <name>.png.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from experiments.bench_e2e import DDP_WARMUP, run_world
from experiments.common import (
    RESULTS,
    cell,
    median,
    pyplot,
    read_csv,
    save_figure,
    update_report,
    write_csv,
)
from experiments.e2e_analyze import DDP_SCHEMES
from ssfusion_lightning.commcost import SCHEMES

FIELDS = ("variant", "repeat", "pair", "world", "workload", "rate", "scheme", "step_ms", "ddp_step_ms", "x_ddp_step",
          "buffers", "choices")
HOOKS = ("ddp_powersgd", "ddp_powersgd4")
#: auto may be this much slower than the best fixed scheme (issue 16)
TOLERANCE = 1.05
#: steps per engine run (bench_e2e's default; ``--steps``) and the first ones left out; DDP runs leave out fewer
STEPS, WARMUP = 14, 6


def variants(schemes: list[str], extra: dict[str, dict] | None = None) -> dict[str, dict]:
    """auto, every fixed scheme, and ``extra`` named engine options (shown, never the best fixed scheme)."""
    clash = set(extra or ()) & {"auto", *SCHEMES, *HOOKS}
    if clash:
        raise ValueError(f"extra variants may not be named {sorted(clash)}: those names are taken")
    return {"auto": {"comm": "auto"}, **{scheme: {"comm": scheme} for scheme in schemes}, **(extra or {})}


def choices_of(record: dict[str, Any]) -> str:
    """The collectives a run's final plan chose, counted over its buffers."""
    counts = Counter(c for c in (record.get("plan_comm") or "").split(";") if c)
    return " ".join(f"{c}:{n}" for c, n in sorted(counts.items()))


def run_spec(workload: str, scheme: str, pair: int, steps: int = STEPS) -> dict[str, Any]:
    warmup = min(WARMUP, DDP_WARMUP) if scheme in DDP_SCHEMES else WARMUP
    return {"workload": workload, "scheme": scheme, "rep": pair, "seed": 0, "steps": steps - (WARMUP - warmup),
            "warmup": warmup, "eval": False}


def launch_phases(args: argparse.Namespace, chosen: dict[str, dict], repeat: int) -> list[dict[str, Any]]:
    """One launch's phases (a link each): per workload and pair, ddp then every variant of the
    ssfusion preset (the order reversed every other pair); the hooks once, after the first pair."""
    phases = []
    for rate in args.rates:
        runs = []
        for workload in args.workloads:
            for pair in range(args.pairs):
                order = list(chosen) if (repeat + pair) % 2 == 0 else list(reversed(chosen))
                runs.append(run_spec(workload, "ddp", pair, args.steps))
                runs += [{**run_spec(workload, "ssfusion", pair, args.steps), "overrides": chosen[v], "variant": v} for v in order]
                if pair == 0:
                    runs += [run_spec(workload, hook, pair, args.steps) for hook in HOOKS]
        phases.append({"label": rate, "runs": runs})
    return phases


def step_ms(record: dict[str, Any]) -> float | None:
    """The median step time of a run's measured steps, in ms."""
    measured = (record.get("step_seconds") or [])[record["warmup"]:]
    return 1000 * median(measured) if measured and not record.get("error") else None


def rows_of(records: list[dict[str, Any]], repeat: int) -> list[dict]:
    """One row per variant run of a launch, its step also as a ratio to the ddp of the same pair."""
    ddp = {(r["world"], r["workload"], r["phase"], r["rep"]): step_ms(r) for r in records if r["scheme"] == "ddp"}
    rows = []
    for r in records:
        step = step_ms(r)
        reference = ddp.get((r["world"], r["workload"], r["phase"], r["rep"]))
        if r["scheme"] == "ddp" or step is None or not reference:
            continue
        rows.append({
            "variant": r.get("variant", r["scheme"]), "repeat": repeat, "pair": f"{repeat}.{r['rep']}", "world": r["world"],
            "workload": r["workload"], "rate": r["phase"], "scheme": r["scheme"], "step_ms": f"{step:.1f}",
            "ddp_step_ms": f"{reference:.1f}", "x_ddp_step": f"{step / reference:.3f}", "buffers": r.get("plan_buffers", ""),
            "choices": choices_of(r) if r.get("variant") == "auto" else "",
        })
    return rows


def run(args: argparse.Namespace) -> list[dict]:
    rows: list[dict] = []
    chosen = variants(args.comms, args.extra_variants)
    with tempfile.TemporaryDirectory() as scratch:
        for repeat in range(args.repeats):
            for world in args.worlds:
                phases = launch_phases(args, chosen, repeat)
                records = run_world(world, phases, args, Path(scratch) / f"launch_{repeat}")
                expected = sum(len(p["runs"]) for p in phases)
                if len(records) < expected or any(r.get("error") for r in records):
                    print(f"!! launch {repeat}, P={world}: {len(records)}/{expected} runs, some failed", flush=True)
                rows += rows_of(records, repeat)
            print(f"launch {repeat} done", flush=True)
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
        paired = paired_ratio([r for r in rows if (int(r["world"]), r["workload"], r["rate"]) == key], best)
        judged = paired if paired is not None else ratio
        out.append({
            "world": key[0], "workload": key[1], "rate": key[2], "medians": medians, "repeats": len(values.get("auto", [])),
            "best_fixed": best, "auto_over_best": ratio, "paired": paired, "met": judged is not None and judged <= TOLERANCE,
            "choices": choices.get(key, []),
        })
    return out


def paired_ratio(rows: list[dict], best: str | None) -> float | None:
    """The median over pairs (runs of one launch side by side) of auto's step over ``best``'s;
    None for rows without pairs."""
    steps: dict[str, dict[str, float]] = defaultdict(dict)
    for r in rows:
        if r.get("pair"):
            steps[r["pair"]][r["variant"]] = float(r["step_ms"])
    ratios = [s["auto"] / s[best] for s in steps.values() if "auto" in s and best in s]
    return median(ratios) if ratios else None


def markdown(summary: list[dict], comms: list[str], meta: dict, rows: list[dict] = ()) -> str:
    columns = ["auto", *comms, *HOOKS]
    paired = any(s.get("paired") is not None for s in summary)
    if paired:
        intro = (
            f"{meta.get('repeats')} launches, every variant {meta.get('pairs')} times in each, side by side. Each cell: the "
            "median over all runs of the scheme's median step time over the ddp run beside it (lower is faster); "
            "auto / best paired: the median over (launch, pair) of auto's step over the best fixed scheme's beside it, "
            "on which the target is judged."
        )
        extra_head, extra_rule, per = " auto / best, paired |", "---:|", "run"
    else:
        intro = (
            f"{meta.get('repeats')} repeats alternated variant by variant. Each cell: the median over repeats of the "
            "scheme's median step time over Lightning ddp's in the same run (lower is faster)."
        )
        extra_head = extra_rule = ""
        per = "repeat"
    lines = [
        f"The ssfusion preset (density {meta.get('density', '1%')}) with comm=auto and with each fixed scheme, "
        f"{intro} Target: auto at most {TOLERANCE:.2f}x the best fixed scheme.",
        "",
        "| P | workload | link | " + " | ".join(columns) + f" | best fixed | auto / best |{extra_head} met | auto's choices (buffers, per {per}) |",
        "|---|---|---|" + "---:|" * len(columns) + f"---|---:|{extra_rule}---|---|",
    ]
    for s in summary:
        cells = [cell(s["medians"].get(c), "{:.3f}") for c in columns]
        extra = f" {cell(s.get('paired'), '{:.3f}')} |" if paired else ""
        lines.append(
            f"| {s['world']} | {s['workload']} | {s['rate']} | " + " | ".join(cells)
            + f" | {s['best_fixed']} | {cell(s['auto_over_best'], '{:.3f}')} |{extra} {'yes' if s['met'] else 'no'} | "
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


def shown_variants(meta: dict) -> list[str]:
    """The variants of a run's table besides auto and the hooks: the fixed schemes, then the extra ones."""
    return list(meta["comms"]) + list(meta.get("extra_variants") or {})


def write_outputs(rows: list[dict], out: Path, name: str, meta: dict) -> str:
    summary = summarize(rows)
    shown = shown_variants(meta)
    text = markdown(summary, shown, meta, rows)
    (out / f"{name}.md").write_text(
        f"# comm=auto against the fixed collectives (emulated cluster)\n\nCommand: `python -m experiments.bench_comm_choice "
        f"{' '.join(meta.get('argv', []))}`\n\n{text}"
    )
    plot(summary, shown, out / f"{name}.png")
    if name == "comm_choice" and out.resolve() == RESULTS.resolve() and update_report(text, marker="comm-choice"):
        print("updated the comm-choice block of experiments/REPORT.md")
    return text


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--comms", nargs="+", default=list(SCHEMES), choices=SCHEMES, help="the fixed schemes")
    parser.add_argument("--extra-variants", type=json.loads, default=None,
                        help='more variants of the preset, shown beside the others, as JSON: {"name": {strategy options}}')
    parser.add_argument("--repeats", type=int, default=2, help="launches per P")
    parser.add_argument("--pairs", type=int, default=2, help="runs of every variant in each launch, side by side")
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--rates", nargs="+", default=["40mbit", "150mbit"])
    parser.add_argument("--workloads", nargs="+", default=["resnet18"])
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--name", default="comm_choice")
    parser.add_argument("--from-csv", action="store_true", help="only rebuild the tables and plot from <out>/<name>.csv")
    parser.add_argument("--steps", type=int, default=STEPS,
                        help=f"steps per engine run, the first {WARMUP} left out (DDP runs: as many measured steps)")
    parser.add_argument("--timeout", type=float, default=2400, help="seconds per launch")
    parser.add_argument("--nice", type=int, default=-5, help="niceness of the rank processes (as bench_e2e's)")
    args = parser.parse_args(argv)
    args.quick, args.delay = False, None  # what bench_e2e's run_world reads besides
    args.out.mkdir(parents=True, exist_ok=True)
    meta_path = args.out / f"{args.name}_meta.json"
    if args.from_csv:
        print(write_outputs(read_csv(args.out / f"{args.name}.csv"), args.out, args.name, json.loads(meta_path.read_text())))
        return
    rows = run(args)
    meta = {"argv": argv if argv is not None else sys.argv[1:], "comms": args.comms, "extra_variants": args.extra_variants, "repeats": args.repeats, "pairs": args.pairs, "steps": args.steps,
            "worlds": args.worlds, "rates": args.rates, "workloads": args.workloads}
    meta_path.write_text(json.dumps(meta, indent=1) + "\n")
    write_csv(args.out / f"{args.name}.csv", FIELDS, rows)
    print(write_outputs(rows, args.out, args.name, meta))


if __name__ == "__main__":
    main()
