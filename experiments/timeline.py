"""Timelines of the fusion engine: per rank, when each buffer is compressed, launched and sent,
against the backward, for one steady-state step. Shows how much communication overlaps backward.

    python -m experiments.timeline                          # P=2, gloo over loopback (~2-4 min on 2 cores)
    python -m experiments.timeline --schemes ssfusion --workloads gpt2 --step 6
    python -m experiments.timeline --from-json              # charts and table from the committed JSONs

Each (workload, scheme) is a fresh Lightning fit of experiments/e2e_worker.py's workload with
``SSFusionStrategy(timeline=True)`` for ``--step + 2`` steps; every rank hands back the events of
engine step ``--step`` (after the plan rebuild at step 1 and the cost profiling of steps 1-3, which
re-plans at step 4). Schemes: the ``ssfusion`` preset as it is, and with a small first buffer or
small buffers, so that the first buffers can launch while the backward runs.

Outputs under --out (default experiments/results):

- ``timeline_<scheme>.png``: a Gantt chart per workload, one row group per rank on one time axis
  (ms from the earliest rank's backward begin): the backward (begin_backward() to finish()),
  compression (select, pack, launch) on the main thread and on the offload worker, each process
  group's collectives, and the main thread's waits and gradient writes; colour = buffer;
- ``timeline_<scheme>.json``: the events (fields of ``ssfusion_lightning.timeline.Event``);
  ``chrome_trace([Event(**e) for e in run["events"]])`` turns a run's into a Chrome trace;
- ``timeline.md``: per run and rank, per buffer the launch and the collectives' start and end
  relative to the backward's end (negative: before it), the communication overlapped with the
  backward and the exposed communication (backward end to the last collective's end).

The link is loopback (no shaping): communication is fast here, so the charts show the order of
events more than a slow network's exposed time; experiments/cluster/ shapes links for that.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from experiments.common import RESULTS, free_port, pyplot, save_figure

#: SSFusionStrategy overrides of the ssfusion preset per scheme
SCHEMES: dict[str, dict[str, Any]] = {
    "ssfusion": {},  # buffer_mb="auto": the cost model's cut
    "ssfusion_25mb": {"buffer_mb": 25.0},  # the default before "auto": one buffer for these models
    "ssfusion_first1mb": {"buffer_mb": 25.0, "first_buffer_mb": 1.0},
    "ssfusion_1mb": {"buffer_mb": 1.0},
}
WORKLOADS = ("resnet18", "gpt2")


# =========================================================================== the ranks
def _rank_main(rank: int, world: int, port: int, runs: list[dict[str, Any]], out: mp.Queue) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), RANK=str(rank),
        NODE_RANK=str(rank), LOCAL_RANK="0", OMP_NUM_THREADS="1",
    )
    import torch.distributed as dist

    dist.init_process_group("gloo")
    try:
        for run in runs:
            out.put((rank, run, record_run(run, world)))
    finally:
        dist.destroy_process_group()


def record_run(run: dict[str, Any], world: int) -> dict[str, Any]:
    """One Lightning fit; this rank's events of engine step ``run["step"]`` and its plan."""
    strategy, plan = fit_with_timeline(run["workload"], SCHEMES[run["scheme"]], run["step"] + 2, world)
    events = [asdict(e) for e in strategy.timeline.events(step=run["step"])]
    return {"plan": plan, "events": events}


def fit_with_timeline(workload: str, options: dict[str, Any], steps: int, world: int) -> tuple[Any, dict[str, Any]]:
    """One Lightning fit of e2e_worker's ``workload`` with ``SSFusionStrategy(timeline=True, **options)``
    for ``steps`` steps: the strategy (its timeline holds the events) and the final plan's summary."""
    import lightning as L

    from experiments.e2e_worker import build_workload, make_strategy, plan_summary

    L.seed_everything(0, verbose=False)
    spec, _, task, datamodule = build_workload(workload, quick=False, seed=0)
    strategy = make_strategy("ssfusion", {**options, "timeline": True})
    trainer = L.Trainer(
        accelerator="cpu", devices=1, num_nodes=world, strategy=strategy, max_steps=steps,
        limit_val_batches=0, num_sanity_val_steps=0, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
        gradient_clip_val=1.0 if spec["kind"] == "lm" else None,
    )
    plan: dict[str, Any] = {}

    class KeepPlan(L.Callback):  # the engine is gone after fit
        def on_train_end(self, trainer, pl_module) -> None:
            plan.update(plan_summary(trainer.strategy.engine))

    trainer.callbacks.append(KeepPlan())
    trainer.fit(task, datamodule=datamodule)
    return strategy, plan


def run_ranks(runs: list[dict[str, Any]], world: int, timeout: float) -> list[dict[str, Any]]:
    """Start ``world`` rank processes for the runs; returns one record per (run, rank)."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, runs, out), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    records, deadline = [], time.monotonic() + timeout
    try:
        while len(records) < len(runs) * world:
            try:
                rank, run, result = out.get(timeout=1.0)
            except queue.Empty:
                if time.monotonic() > deadline or any(not p.is_alive() and p.exitcode for p in procs):
                    raise RuntimeError(f"ranks failed or timed out after {len(records)} of {len(runs) * world} records") from None
                continue
            records.append({**run, "rank": rank, **result})
            print(f"[timeline] {run['workload']} {run['scheme']} rank {rank}: {len(result['events'])} events", flush=True)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return records


# =========================================================================== analysis
def _ms(ns: float, origin: float) -> float:
    return (ns - origin) / 1e6


def marks(events: list[dict[str, Any]]) -> tuple[int, int]:
    """The backward's begin and end of one rank's step (the last begin: accumulation has several)."""
    begin = max(e["start_ns"] for e in events if e["name"] == "backward.begin")
    end = next(e["start_ns"] for e in events if e["name"] == "backward.end")
    return begin, end


def overlap_summary(events: list[dict[str, Any]]) -> dict[str, Any]:
    """Per buffer the launch and collective times relative to the backward end (ms), and the
    communication overlapped with the backward and exposed after it."""
    _, end = marks(events)
    comms = [e for e in events if e["name"] == "comm"]
    buffers = sorted({e["buffer"] for e in events if e["name"] == "launch"})
    rows = []
    for b in buffers:
        launch = next(e for e in events if e["name"] == "launch" and e["buffer"] == b)
        mine = [e for e in comms if e["buffer"] == b]
        rows.append({
            "buffer": b,
            "tensors": sum(1 for e in events if e["name"] == "select" and e["buffer"] == b and e["detail"]),
            "launch_ms": _ms(launch["start_ns"], end),
            "comm_start_ms": _ms(min(e["start_ns"] for e in mine), end),
            "comm_end_ms": _ms(max(e["end_ns"] for e in mine), end),
        })
    busy = _union([(e["start_ns"], e["end_ns"]) for e in comms])
    overlapped = sum(max(0, min(b, end) - a) for a, b in busy) / 1e6
    last = max(e["end_ns"] for e in comms)
    return {"buffers": rows, "overlapped_ms": overlapped, "exposed_ms": max(0.0, _ms(last, end)),
            "backward_ms": _ms(end, marks(events)[0])}


def _union(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[list[int]] = []
    for a, b in sorted(spans):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def markdown(records: list[dict[str, Any]], step: int, cores: int | None) -> str:
    summaries = [overlap_summary(r["events"]) for r in records]
    lines = [
        f"Engine step {step}, P={len({r['rank'] for r in records})}, CPU gloo over loopback, {cores} cores (the ranks "
        "drift apart when other work shares them: a collective then waits for the later rank). Times in ms relative to the rank's backward end (finish() entered; negative: before it). Overlapped: "
        "collective time (union over the process groups) before the backward's end; exposed: backward end to "
        "the last collective's end.",
        "",
        "| workload | scheme | rank | buffers | backward | buffer 0 comm start | overlapped | exposed |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {r['workload']} | {r['scheme']} | {r['rank']} | {len(s['buffers'])} | {s['backward_ms']:.1f} | "
        f"{s['buffers'][0]['comm_start_ms']:.1f} | {s['overlapped_ms']:.1f} | {s['exposed_ms']:.1f} |"
        for r, s in zip(records, summaries)
    ]
    lines.append("")
    for r, s in zip(records, summaries):
        lines += [
            f"### {r['workload']} / {r['scheme']} / rank {r['rank']}",
            "",
            "| buffer | tensors | launch | comm start | comm end |",
            "|---:|---:|---:|---:|---:|",
        ]
        lines += [
            f"| {b['buffer']} | {b['tensors']} | {b['launch_ms']:.1f} | {b['comm_start_ms']:.1f} | {b['comm_end_ms']:.1f} |"
            for b in s["buffers"]
        ]
        lines.append("")
    return "\n".join(lines)


# =========================================================================== the chart
#: a rank's rows, top to bottom (one comm row per process group)
ROW_ORDER = ("backward", "compress (main)", "compress (offload)", "comm", "wait / write")


def _row(event: dict[str, Any]) -> str | None:
    name, thread = event["name"], event["thread"]
    if name in ("select", "pack", "launch"):
        return "compress (offload)" if thread.startswith("ssfusion-offload") else "compress (main)"
    if name in ("comm", "control"):
        return f"comm (group {thread.removeprefix('ssfusion-comm').split('_')[0]})"
    if name in ("wait", "write"):
        return "wait / write"
    return None


def plot(records: list[dict[str, Any]], scheme: str, path: Path) -> None:
    plt = pyplot()
    from matplotlib.patches import Patch

    workloads = [w for w in WORKLOADS if any(r["workload"] == w for r in records)]
    layout = {}
    for w in workloads:
        ranks = sorted((r for r in records if r["workload"] == w), key=lambda r: r["rank"])
        rows = [["backward", *sorted({_row(e) for e in r["events"]} - {None}, key=_row_key)] for r in ranks]
        layout[w] = (ranks, rows)
    heights = [sum(len(rows) for rows in layout[w][1]) + 1 for w in workloads]
    fig, axes = plt.subplots(len(workloads), 1, figsize=(12, 0.32 * sum(heights) + 1.6 * len(workloads)),
                             gridspec_kw={"height_ratios": heights}, squeeze=False)
    colours = plt.get_cmap("tab10")
    for ax, w in zip(axes[:, 0], workloads):
        ranks, rows = layout[w]
        origin = min(marks(r["events"])[0] for r in ranks)
        labels, y = [], 0
        for record, rank_rows in zip(ranks, rows):
            events = record["events"]
            begin, end = marks(events)
            where = {name: y + i for i, name in enumerate(rank_rows)}
            ax.barh(where["backward"], _ms(end, begin), left=_ms(begin, origin), color="0.75", height=0.7)
            for e in events:
                row = _row(e)
                if row is None:
                    continue
                colour = "0.35" if e["buffer"] is None else colours(e["buffer"] % 10)
                ax.barh(where[row], max(_ms(e["end_ns"], e["start_ns"]), 0.02), left=_ms(e["start_ns"], origin),
                        color=colour, height=0.7, hatch="//" if e["name"] in ("write", "launch") else None,
                        edgecolor="white" if e["name"] == "select" else colour, linewidth=0.3)
            ax.plot([_ms(end, origin)] * 2, [y - 0.5, y + len(rank_rows) - 0.5], color="k", linestyle="--", linewidth=0.8)
            labels += [f"rank {record['rank']}: {name}" for name in rank_rows]
            y += len(rank_rows)
        ax.set_yticks(range(y), labels, fontsize=7)
        ax.set_ylim(y - 0.5, -0.5)
        ax.set_xlabel("ms from the backward's begin (earliest rank); dashed: the rank's backward end", fontsize=8)
        plan = ranks[0]["plan"].get("plan_buffers", "?")
        ax.set_title(f"{w}, {scheme}, engine step {ranks[0]['step']}: {plan} buffer(s)", fontsize=9)
        buffers = sorted({e["buffer"] for r in ranks for e in r["events"] if e["buffer"] is not None})
        handles = [Patch(color=colours(b % 10), label=f"buffer {b}") for b in buffers[:10]]
        handles += [Patch(color="0.75", label="backward"), Patch(color="0.35", label="control collective"),
                    Patch(facecolor="white", edgecolor="k", hatch="//", label="launch / write")]
        ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
        ax.grid(axis="x", alpha=0.3)
    save_figure(fig, path)


def _row_key(row: str) -> tuple[int, str]:
    return ROW_ORDER.index(row.split(" (group")[0]), row


# =========================================================================== main
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--schemes", nargs="+", default=list(SCHEMES), choices=list(SCHEMES))
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--step", type=int, default=6, help="engine step to record (steady state from 5)")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=1200)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--from-json", action="store_true", help="redraw from the JSONs under --out, run nothing")
    args = parser.parse_args(argv)
    if args.from_json:
        saved = [json.loads((args.out / f"timeline_{scheme}.json").read_text()) for scheme in args.schemes]
        records = [r for payload in saved for r in payload["runs"] if r["workload"] in args.workloads]
        cores = saved[0]["cores"]
    else:
        runs = [{"workload": w, "scheme": s, "step": args.step} for s in args.schemes for w in args.workloads]
        records = run_ranks(runs, args.world, args.timeout)
        order = {(r["workload"], r["scheme"]): i for i, r in enumerate(runs)}
        records.sort(key=lambda r: (order[(r["workload"], r["scheme"])], r["rank"]))
        cores = os.cpu_count()
    args.out.mkdir(parents=True, exist_ok=True)
    for scheme in args.schemes:
        mine = [r for r in records if r["scheme"] == scheme]
        if not args.from_json:
            payload = {"scheme": scheme, "cores": cores, "runs": mine}
            (args.out / f"timeline_{scheme}.json").write_text(json.dumps(payload, indent=1))
        plot(mine, scheme, args.out / f"timeline_{scheme}.png")
    (args.out / "timeline.md").write_text(markdown(records, records[0]["step"], cores))
    print(f"[timeline] wrote {args.out}/timeline_*.png, timeline_*.json and timeline.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
