"""How far the ranks' backward passes drift apart, against the number of buffers: timelines of
many steps of one workload, both ranks on one clock, for several ``buffer_mb`` settings.

    python -m experiments.timeline_spread                     # gpt2_10m, P = 2, 150 Mbit/s, auto and 16 MB
    python -m experiments.timeline_spread --caps auto 16 4 2 --rate 40mbit --name timeline_spread_40mbit

Each setting is one Lightning fit of experiments/e2e_worker.py's workload on the emulated cluster
(root: network namespaces) with ``SSFusionStrategy(timeline=True)``; every rank writes the events of
all its steps, and the steps from ``--skip`` on are summarised. The ranks share the host, so their
``perf_counter_ns`` clocks are one clock. Per setting: the plan's buffers, the median backward of
each rank, the absolute difference of the ranks' backward ends (median, 75th percentile), and how
long after its own backward's end a rank's last collective ended (the larger of the two ranks).

Writes <out>/<name>.{md,json} (default experiments/results/timeline_spread) and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from experiments.common import REPO, RESULTS


def worker(workload: str, cap: str, steps: int, out: Path) -> None:
    """One rank of one fit: its events of every step, as JSON."""
    from dataclasses import asdict

    import torch

    torch.set_num_threads(1)
    import torch.distributed as dist

    from experiments.timeline import fit_with_timeline

    dist.init_process_group("gloo")
    options: dict[str, Any] = {} if cap == "auto" else {"buffer_mb": float(cap)}
    strategy, plan = fit_with_timeline(workload, options, steps, dist.get_world_size())
    events = [asdict(e) for e in strategy.timeline.events()]
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps({"plan_buffers": plan.get("plan_buffers"), "events": events}))
    dist.destroy_process_group()


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[round(q * (len(ordered) - 1))]


def summarise(ranks: list[dict[str, Any]], skip: int) -> dict[str, Any]:
    """The spread of one setting from its ranks' events (steps ``skip`` on, where both ranks have
    a backward begin and end)."""
    backward: list[list[float]] = [[] for _ in ranks]
    end_gap, tail = [], []
    steps = sorted({e["step"] for e in ranks[0]["events"] if e["step"] >= skip})
    for step in steps:
        marks = []
        for rank in ranks:
            events = [e for e in rank["events"] if e["step"] == step]
            named = {e["name"]: e["start_ns"] for e in events if e["name"] in ("backward.begin", "backward.end")}
            if len(named) < 2:
                break
            comm_end = max((e["end_ns"] for e in events if e["name"] == "comm"), default=named["backward.end"])
            marks.append((named["backward.begin"], named["backward.end"], comm_end))
        if len(marks) < len(ranks):
            continue
        for r, (begin, end, _) in enumerate(marks):
            backward[r].append((end - begin) / 1e6)
        ends = [end for _, end, _ in marks]
        end_gap.append((max(ends) - min(ends)) / 1e6)
        tail.append(max((comm_end - end) / 1e6 for _, end, comm_end in marks))
    return {
        "buffers": ranks[0]["plan_buffers"],
        "steps": len(end_gap),
        "backward_ms": [round(statistics.median(b), 1) for b in backward],
        "end_gap_ms": [round(statistics.median(end_gap), 1), round(_quantile(end_gap, 0.75), 1)],
        "tail_ms": [round(statistics.median(tail), 1), round(_quantile(tail, 0.75), 1)],
    }


def markdown(rows: dict[str, dict[str, Any]], args: argparse.Namespace) -> str:
    lines = [
        f"Timeline spread: {args.workload}, P = 2, {args.rate}, steps {args.skip}-{args.steps - 1} "
        "(`python -m experiments.timeline_spread`).",
        "",
        "| buffer_mb | buffers | steps | backward ms, median (rank 0; rank 1) | ranks' backward ends apart, ms: median; p75 "
        "| last collective after own backward end, ms (larger rank): median; p75 |",
        "|---|---:|---:|---|---|---|",
    ]
    for cap, r in rows.items():
        lines.append(
            f"| {cap} | {r['buffers']} | {r['steps']} | {'; '.join(map(str, r['backward_ms']))} | "
            f"{'; '.join(map(str, r['end_gap_ms']))} | {'; '.join(map(str, r['tail_ms']))} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="gpt2_10m")
    parser.add_argument("--rate", default="150mbit")
    parser.add_argument("--caps", nargs="+", default=["auto", "16"], help='buffer_mb settings: "auto" or MB')
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--skip", type=int, default=8, help="first steps left out (profiling and re-plans)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--name", default="timeline_spread", help="file stem of the results")
    parser.add_argument("--worker", nargs=3, metavar=("CAP", "STEPS", "DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        cap, steps, out = args.worker
        worker(args.workload, cap, int(steps), Path(out))
        return 0
    from experiments.cluster import EmulatedCluster

    rows = {}
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])), "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory() as scratch:
        for cap in args.caps:
            out = Path(scratch) / cap
            out.mkdir()
            cmd = [sys.executable, "-m", "experiments.timeline_spread", "--workload", args.workload,
                   "--worker", cap, str(args.steps), str(out)]
            with EmulatedCluster(nodes=2, rate=args.rate) as cluster:
                result = cluster.run(cmd, env=env, timeout=900, log_dir=out / "logs", stream=False)
            if result.returncode != 0:
                print(result.log(0)[-3000:], file=sys.stderr)
                return 1
            rows[cap] = summarise([json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)], args.skip)
            print(f"buffer_mb={cap}: {rows[cap]}", flush=True)
    table = markdown(rows, args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.md").write_text(table)
    (args.out / f"{args.name}.json").write_text(json.dumps({"args": vars(args) | {"out": str(args.out)}, "rows": rows}, indent=1))
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
