"""Nodes of several ranks on the emulated cluster: hierarchical sync against the flat schemes.

    python -m experiments.bench_layouts                       # 2x2 and 4x1 at 40 Mbit/s, 3 rounds
    python -m experiments.bench_layouts --from-csv            # tables and plot from the CSVs

A layout ``NxL`` is N emulated nodes of L ranks each (experiments/cluster ``ranks_per_node``):
the L ranks of a node share its network namespace, so they talk over its loopback (fast,
unshaped), and every node has one link shaped to ``--rate`` to the switch. ``4x1`` is the flat
P = 4 cluster of experiments/bench_e2e.py.

The runs use bench_e2e's machinery (one ``e2e_worker`` per rank, a fresh Lightning fit per run,
``run_world`` with ``ranks_per_node``). One launch per layout and round runs every workload x
variant once; the layouts alternate launch by launch, and the variants' order is reversed every
other round, so that drift of the shared host's load falls on every variant alike. Variants
(the ssfusion preset, density 1%, with the collective named):

- ``compute_only``: DDP with its communication removed (the compute of the layout);
- ``ddp``, ``ddp_powersgd`` (rank 1), ``ddp_powersgd4`` (rank 4): Lightning's DDP and its hooks;
- ``flat``: the ssfusion preset with ``comm="allgather"`` (its flat sparse collective);
- ``hier_<cross>``: the ssfusion preset with ``comm="hierarchical"`` and that cross-node step
  (layouts with L > 1 only); ``hier_allgather_dense`` / ``_sparse`` / ``_relay``: cross allgather
  with the sparse part's node step pinned;
- ``auto``: the ssfusion preset as shipped (``comm="auto"``; on L > 1 it may pick hierarchical).

Outputs under --out (default experiments/results), stem --name (default layouts):
``<stem>_runs.csv`` (one row per run: the medians of its measured steps), ``<stem>_steps.csv``
(every step), ``<stem>.csv`` (per layout, workload and variant: the median over rounds),
``<stem>.md`` (that table and the ratios), ``<stem>.png`` and ``<stem>_raw.jsonl`` (the workers' records).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from experiments import bench_e2e
from experiments.common import (
    REPORT,
    RESULTS,
    cell,
    fmt_rounded,
    median,
    num,
    pyplot,
    quantile,
    read_csv,
    read_jsonl,
    save_figure,
    update_report,
    write_csv,
    write_jsonl,
)
from experiments.e2e_analyze import WORKLOADS

DDP_WARMUP = bench_e2e.DDP_WARMUP
DDP_VARIANTS = ("compute_only", "ddp", "ddp_powersgd", "ddp_powersgd4")
#: variant -> (e2e_worker scheme, SSFusionStrategy overrides)
ENGINE_VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "flat": ("ssfusion", {"comm": "allgather"}),
    "auto": ("ssfusion", {}),
    **{f"hier_{cross}": ("ssfusion", {"comm": "hierarchical", "comm_options": {"cross": cross}})
       for cross in ("allgather", "zen", "sparcml", "allreduce", "oktopk")},
    # the sparse part's node step pinned (hier_<cross> leaves it to node="auto")
    **{f"hier_allgather_{node}": ("ssfusion", {"comm": "hierarchical", "comm_options": {"cross": "allgather", "node": node}})
       for node in ("dense", "sparse", "relay")},
}
DEFAULT_VARIANTS = ("compute_only", "ddp", "ddp_powersgd", "ddp_powersgd4", "flat", "hier_allgather", "auto")

RUN_FIELDS = [
    "layout", "nodes", "ranks_per_node", "world", "rate", "round", "launch", "order", "workload", "variant", "scheme",
    "steps", "warmup", "params", "per_rank_batch", "step_ms", "step_p25_ms", "step_p75_ms", "step_cpu_ms",
    "compress_ms", "exposed_ms", "bytes_sent", "elements_sent", "hook_payload_bytes", "plan_buffers", "plan_dense_elements",
    "plan_sparse_elements", "plan_sparse_k", "plan_comm", "error",
]
STEP_FIELDS = ["layout", "round", "workload", "variant", "step", "seconds", "cpu_seconds", "bytes_sent",
               "compress_seconds", "exposed_comm_seconds"]
SUMMARY_FIELDS = ["layout", "nodes", "ranks_per_node", "world", "rate", "workload", "variant", "rounds", "step_ms",
                  "step_ms_min", "step_ms_max", "compute_ms", "compress_ms", "exposed_ms", "bytes_sent", "x_ddp",
                  "x_flat_same_layout", "plan_comm"]


def parse_layout(text: str) -> tuple[int, int]:
    """``"2x2"`` -> (2 nodes, 2 ranks per node)."""
    try:
        nodes, per_node = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a layout is NODESxRANKS, e.g. 2x2; got {text!r}") from None
    if nodes < 1 or per_node < 1:
        raise argparse.ArgumentTypeError(f"a layout needs at least 1 node of 1 rank; got {text!r}")
    return nodes, per_node


def variants_for(layout: tuple[int, int], variants: list[str]) -> list[str]:
    """The variants that apply to the layout: the hierarchical ones need several ranks per node."""
    return [v for v in variants if not (v.startswith("hier_") and layout[1] == 1)]


def build_runs(layout: tuple[int, int], args: argparse.Namespace, round_: int) -> list[dict[str, Any]]:
    """One round on one layout: every workload x variant once, the order reversed every other round."""
    runs = []
    variants = variants_for(layout, args.variants)
    if round_ % 2:
        variants = variants[::-1]
    for workload in args.workloads:
        for order, variant in enumerate(variants):
            ddp_like = variant in DDP_VARIANTS
            warmup = min(args.warmup, DDP_WARMUP) if ddp_like else args.warmup
            run = {
                "workload": workload, "scheme": variant if ddp_like else ENGINE_VARIANTS[variant][0],
                "variant": variant, "rep": round_, "round": round_, "order": order, "seed": args.seed,
                "steps": args.steps - (args.warmup - warmup), "warmup": warmup, "eval": False,
            }
            if not ddp_like:
                run["overrides"] = ENGINE_VARIANTS[variant][1]
            runs.append(run)
    return runs


def label(layout: tuple[int, int]) -> str:
    return f"{layout[0]}x{layout[1]}"


# =========================================================================== rows




def run_rows(records: list[dict[str, Any]]) -> tuple[list[dict], list[dict]]:
    """Per-run rows (medians over the measured steps) and per-step rows of the worker records."""
    runs, steps = [], []
    for r in records:
        warmup = r["warmup"]
        seconds = r.get("step_seconds") or []
        cpu = r.get("step_cpu_seconds") or []
        engine = r.get("engine") or []
        measured = seconds[warmup:]
        m_engine = engine[warmup:]
        pick = lambda key: median([m[key] for m in m_engine if m.get(key) is not None])  # noqa: E731
        ms = lambda v: None if v is None else v * 1e3  # noqa: E731
        runs.append({
            "layout": r["layout"], "nodes": r["nodes"], "ranks_per_node": r.get("ranks_per_node", r["per_node"]),
            "world": r["world"], "rate": r["phase"], "round": r["round"], "launch": r["launch"], "order": r["order"],
            "workload": r["workload"], "variant": r["variant"], "scheme": r["scheme"], "steps": r["steps"],
            "warmup": warmup, "params": r.get("params"), "per_rank_batch": r.get("per_rank_batch"),
            "step_ms": ms(median(measured)), "step_p25_ms": ms(quantile(measured, 0.25)),
            "step_p75_ms": ms(quantile(measured, 0.75)), "step_cpu_ms": ms(median(cpu[warmup:])),
            "compress_ms": ms(pick("compress_seconds")), "exposed_ms": ms(pick("exposed_comm_seconds")),
            "bytes_sent": pick("bytes_sent"), "elements_sent": pick("elements_sent"),
            # bytes a DDP hook (fp16, PowerSGD) all-reduced per step
            "hook_payload_bytes": median((r.get("hook_payload") or [])[warmup:]),
            **{k: r.get(k) for k in ("plan_buffers", "plan_dense_elements", "plan_sparse_elements", "plan_sparse_k",
                                     "plan_comm")},
            "error": r["error"].strip().splitlines()[-1] if r.get("error") else "",
        })
        for step, value in enumerate(seconds):
            m = engine[step] if step < len(engine) else {}
            steps.append({
                "layout": r["layout"], "round": r["round"], "workload": r["workload"], "variant": r["variant"],
                "step": step, "seconds": value, "cpu_seconds": cpu[step] if step < len(cpu) else None,
                "bytes_sent": m.get("bytes_sent"), "compress_seconds": m.get("compress_seconds"),
                "exposed_comm_seconds": m.get("exposed_comm_seconds"),
            })
    return runs, steps




def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (layout, workload, variant): the median over rounds of the runs' median step times."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in runs:
        if not r.get("error") and num(r["step_ms"]) is not None:
            groups[(r["layout"], r["workload"], r["variant"])].append(r)
    out = []
    for (layout, workload, variant), items in groups.items():
        steps = [num(r["step_ms"]) for r in items]
        first = items[0]
        out.append({
            "layout": layout, "nodes": int(first["nodes"]), "ranks_per_node": int(first["ranks_per_node"]),
            "world": int(first["world"]), "rate": first["rate"], "workload": workload, "variant": variant,
            "rounds": len(items), "step_ms": statistics.median(steps), "step_ms_min": min(steps),
            "step_ms_max": max(steps),
            "compress_ms": median([v for r in items if (v := num(r["compress_ms"])) is not None]),
            "exposed_ms": median([v for r in items if (v := num(r["exposed_ms"])) is not None]),
            "bytes_sent": median([v for r in items if (v := num(r["bytes_sent"])) is not None]),
            "plan_comm": _comm_summary([r.get("plan_comm") or "" for r in items]),
        })
    index = {(r["layout"], r["workload"], r["variant"]): r for r in out}
    for r in out:
        compute = index.get((r["layout"], r["workload"], "compute_only"))
        ddp = index.get((r["layout"], r["workload"], "ddp"))
        flat = index.get((r["layout"], r["workload"], "flat"))
        r["compute_ms"] = compute["step_ms"] if compute else None
        r["x_ddp"] = ddp["step_ms"] / r["step_ms"] if ddp else None
        r["x_flat_same_layout"] = flat["step_ms"] / r["step_ms"] if flat else None
    order = {v: i for i, v in enumerate((*DDP_VARIANTS, "flat", *(v for v in ENGINE_VARIANTS if v != "flat")))}
    out.sort(key=lambda r: (r["workload"], r["layout"], order.get(r["variant"], 99)))
    return out


def _comm_summary(plans: list[str]) -> str:
    """How often each collective was chosen per buffer, over every run (auto's choices)."""
    counts: dict[str, int] = defaultdict(int)
    for plan in plans:
        for scheme in filter(None, plan.split(";")):
            counts[scheme] += 1
    return " ".join(f"{s}:{n}" for s, n in sorted(counts.items()))


def paired_ratios(runs: list[dict[str, Any]], pairs: list[tuple[tuple[str, str], tuple[str, str]]]) -> list[dict]:
    """For each pair ((layout A, variant A), (layout B, variant B)) and workload: the ratio
    step(B) / step(A) (> 1: A is faster) in every round, where both ran in the same round
    (the same launch, or the adjacent launch of the other layout)."""
    by = {(r["layout"], r["workload"], r["variant"], str(r["round"])): num(r["step_ms"]) for r in runs
          if not r.get("error") and num(r["step_ms"]) is not None}
    workloads = sorted({r["workload"] for r in runs})
    rounds = sorted({str(r["round"]) for r in runs}, key=int)
    out = []
    for (la, va), (lb, vb) in pairs:
        for workload in workloads:
            ratios = [by[(lb, workload, vb, k)] / by[(la, workload, va, k)] for k in rounds
                      if (la, workload, va, k) in by and (lb, workload, vb, k) in by]
            if ratios:
                out.append({"a": f"{va} @ {la}", "b": f"{vb} @ {lb}", "workload": workload, "rounds": len(ratios),
                            "median": statistics.median(ratios), "min": min(ratios), "max": max(ratios),
                            "faster_in": sum(x > 1 for x in ratios)})
    return out


def default_pairs(layouts: list[str], variants: list[str]) -> list[tuple[tuple[str, str], tuple[str, str]]]:
    """Every hierarchical variant (and auto) on each multi-rank layout against the flat
    collective, DDP and both PowerSGD settings on the same layout and on the flat layout of the
    same P."""
    pairs = []
    multi = [lay for lay in layouts if parse_layout(lay)[1] > 1]
    flat_of = {lay: next((o for o in layouts if parse_layout(o)[1] == 1
                          and math.prod(parse_layout(o)) == math.prod(parse_layout(lay))), None) for lay in multi}
    for lay in multi:
        mine = [v for v in variants if v.startswith("hier_")] + (["auto"] if "auto" in variants else [])
        for v in mine:
            for other in ("flat", "ddp", "ddp_powersgd", "ddp_powersgd4"):
                if other in variants:
                    pairs.append(((lay, v), (lay, other)))
                    if flat_of[lay]:
                        pairs.append(((lay, v), (flat_of[lay], other)))
        if flat_of[lay] and "flat" in variants:
            pairs.append(((lay, "flat"), (flat_of[lay], "flat")))
    return pairs


# =========================================================================== outputs


def markdown(summary: list[dict], ratios: list[dict], meta: dict[str, Any]) -> str:
    lines = [
        f"Layouts {', '.join(meta.get('layouts', []))} at {meta.get('rate')} per node link (the ranks of a node share "
        f"its namespace: loopback between them), {meta.get('rounds')} rounds, layouts alternated launch by launch, "
        f"variants' order reversed every other round. Step: median over a run's measured steps "
        f"({meta.get('steps')} steps, the first {meta.get('warmup')} dropped; DDP variants {DDP_WARMUP}), then "
        f"median over rounds (min-max in brackets). Host: {meta.get('cpus')} cores shared with other jobs.",
        "",
        "| workload | layout | variant | step ms (min-max) | x ddp | x flat (same layout) | compute ms | compress ms "
        "| exposed ms | KB sent/step | auto's choices (buffers, all rounds) |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in summary:
        lines.append(
            f"| {r['workload']} | {r['layout']} | {r['variant']} | {r['step_ms']:.0f} ({r['step_ms_min']:.0f}-"
            f"{r['step_ms_max']:.0f}) | {cell(r['x_ddp'], '{:.2f}')} | {cell(r['x_flat_same_layout'], '{:.2f}')} | "
            f"{cell(r['compute_ms'], '{:.0f}')} | {cell(r['compress_ms'], '{:.0f}')} | {cell(r['exposed_ms'], '{:.0f}')} | "
            f"{cell(None if r['bytes_sent'] is None else r['bytes_sent'] / 1e3, '{:.0f}')} | "
            f"{r['plan_comm'] if r['variant'] == 'auto' else ''} |")
    lines += ["", "Ratios step(B) / step(A), per round (> 1: A is faster), median and range over rounds:", "",
              "| workload | A | B | rounds | median | min | max | A faster in |", "|---|---|---|---:|---:|---:|---:|---:|"]
    for r in ratios:
        lines.append(f"| {r['workload']} | {r['a']} | {r['b']} | {r['rounds']} | {r['median']:.2f} | {r['min']:.2f} | "
                     f"{r['max']:.2f} | {r['faster_in']}/{r['rounds']} |")
    return "\n".join(lines) + "\n"


def plot(summary: list[dict], path: Path) -> None:
    plt = pyplot()
    workloads = sorted({r["workload"] for r in summary})
    fig, axes = plt.subplots(1, len(workloads), figsize=(7 * len(workloads), 4.5), squeeze=False)
    for j, workload in enumerate(workloads):
        ax = axes[0][j]
        rows = [r for r in summary if r["workload"] == workload]
        names = [f"{r['variant']}\n{r['layout']}" for r in rows]
        colors = ["tab:blue" if r["ranks_per_node"] > 1 else "tab:gray" for r in rows]
        ax.bar(names, [r["step_ms"] for r in rows], color=colors)
        ax.errorbar(names, [r["step_ms"] for r in rows],
                    yerr=[[r["step_ms"] - r["step_ms_min"] for r in rows], [r["step_ms_max"] - r["step_ms"] for r in rows]],
                    fmt="none", ecolor="black", capsize=3)
        ax.set_yscale("log")
        ax.set_ylabel("ms per step (median over rounds, min-max)")
        ax.set_title(f"{workload}: blue 2 ranks per node, gray 1")
        ax.tick_params(axis="x", rotation=70, labelsize=7)
        ax.grid(axis="y", alpha=0.3)
    save_figure(fig, path)


def write_outputs(runs: list[dict], out: Path, stem: str, meta: dict[str, Any]) -> str:
    summary = summarize(runs)
    ratios = paired_ratios(runs, default_pairs(meta["layouts"], meta["variants"]))
    write_csv(out / f"{stem}.csv", SUMMARY_FIELDS, [{k: fmt_rounded(r.get(k)) for k in SUMMARY_FIELDS} for r in summary])
    text = markdown(summary, ratios, meta)
    (out / f"{stem}.md").write_text(f"# Nodes of several ranks (emulated)\n\nCommand: `python -m experiments.bench_layouts "
                                     f"{' '.join(meta.get('argv', []))}`\n\n{text}")
    plot(summary, out / f"{stem}.png")
    if stem == "layouts" and out.resolve() == RESULTS.resolve() and update_report(text, marker="layouts"):
        print(f"updated the layouts block of {REPORT}")
    return text




def complete_launches(records: list[dict[str, Any]], layouts: list[tuple[int, int]],
                      args: argparse.Namespace) -> tuple[list[dict[str, Any]], set[tuple[int, str]]]:
    """The records of every (round, layout) whose launch recorded all its runs without an error."""
    by: dict[tuple[int, str], list[dict]] = defaultdict(list)
    for r in records:
        by[(r["round"], r["layout"])].append(r)
    kept, done = [], set()
    for layout in layouts:
        for round_ in range(args.rounds):
            items = by.get((round_, label(layout)), [])
            if items and len(items) == len(build_runs(layout, args, round_)) and not any("error" in r for r in items):
                kept += items
                done.add((round_, label(layout)))
    kept.sort(key=lambda r: r["launch"])
    return kept, done


def write_run_csvs(records: list[dict[str, Any]], out: Path, stem: str) -> None:
    rows, steps = run_rows(records)
    write_csv(out / f"{stem}_runs.csv", RUN_FIELDS, [{k: fmt_rounded(r.get(k)) for k in RUN_FIELDS} for r in rows])
    write_csv(out / f"{stem}_steps.csv", STEP_FIELDS, [{k: fmt_rounded(r.get(k)) for k in STEP_FIELDS} for r in steps])


# =========================================================================== main
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layouts", nargs="+", default=["2x2", "4x1"], help="NODESxRANKS, alternated launch by launch")
    parser.add_argument("--rate", default="40mbit", help="every node's link (tc syntax)")
    parser.add_argument("--workloads", nargs="+", default=["resnet18", "gpt2"], choices=WORKLOADS)
    parser.add_argument("--variants", nargs="+", default=list(DEFAULT_VARIANTS),
                        choices=(*DDP_VARIANTS, *ENGINE_VARIANTS))
    parser.add_argument("--rounds", type=int, default=3, help="launches per layout (alternated)")
    parser.add_argument("--steps", type=int, default=14)
    parser.add_argument("--warmup", type=int, default=6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--nice", type=int, default=-5)
    parser.add_argument("--delay", default=None)
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per launch")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--name", default="layouts")
    parser.add_argument("--from-csv", action="store_true", help="only rebuild the summary, tables and plot")
    parser.add_argument("--from-raw", action="store_true", help="rebuild the CSVs too, from <stem>_raw.jsonl")
    parser.add_argument("--resume", action="store_true",
                        help="keep the launches <stem>_raw.jsonl holds in full and run only the others")
    args = parser.parse_args(argv)
    out, stem = args.out, args.name
    out.mkdir(parents=True, exist_ok=True)
    meta_path = out / f"{stem}_meta.json"
    if args.from_raw:
        records = read_jsonl(out / f"{stem}_raw.jsonl")
        write_run_csvs(records, out, stem)
    if args.from_csv or args.from_raw:
        meta = json.loads(meta_path.read_text())
        print(write_outputs(read_csv(out / f"{stem}_runs.csv"), out, stem, meta))
        return 0
    layouts = [parse_layout(x) for x in args.layouts]
    started = time.monotonic()
    records: list[dict[str, Any]] = []
    done: set[tuple[int, str]] = set()
    if args.resume and (out / f"{stem}_raw.jsonl").exists():
        records, done = complete_launches(
            read_jsonl(out / f"{stem}_raw.jsonl"), layouts, args)
        print(f"resuming: {len(done)} launches kept ({', '.join(f'round {r} {lay}' for r, lay in sorted(done))})")
    launch = 1 + max((r["launch"] for r in records), default=-1)
    worker_args = argparse.Namespace(quick=False, timeout=args.timeout, nice=args.nice, delay=args.delay)
    with tempfile.TemporaryDirectory(prefix="ssf_layouts_") as tmp:
        for round_ in range(args.rounds):
            for layout in (layouts if round_ % 2 == 0 else layouts[::-1]):
                nodes, per_node = layout
                if (round_, label(layout)) in done:
                    continue
                runs = build_runs(layout, args, round_)
                phases = [{"label": args.rate, "runs": runs}]
                print(f"== round {round_}, layout {label(layout)}: {len(runs)} runs", flush=True)
                got = bench_e2e.run_world(nodes * per_node, phases, worker_args, Path(tmp) / f"launch{launch}",
                                          ranks_per_node=per_node)
                for r in got:
                    r.update({"layout": label(layout), "nodes": nodes, "per_node": per_node, "launch": launch})
                records += got
                launch += 1
                # every step's metrics, kept before anything else can fail (--from-raw rebuilds from it)
                write_jsonl(out / f"{stem}_raw.jsonl", records)
                write_run_csvs(records, out, stem)
    meta = {"argv": sys.argv[1:] if argv is None else argv, "layouts": args.layouts, "rate": args.rate,
            "workloads": args.workloads, "variants": args.variants, "rounds": args.rounds, "steps": args.steps,
            "warmup": args.warmup, "cpus": os.cpu_count(), "wall_seconds": time.monotonic() - started}
    meta_path.write_text(json.dumps(meta, indent=1) + "\n")
    rows = read_csv(out / f"{stem}_runs.csv")
    print(write_outputs(rows, out, stem, meta))
    failed = [r for r in rows if r["error"]]
    return 1 if failed or not rows else 0


if __name__ == "__main__":
    sys.exit(main())
