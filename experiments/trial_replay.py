"""The plan trial's decision replayed on measured step times: how often does it keep dense?

    python -m experiments.trial_replay

The trial (ssfusion_lightning/engine/trial.py) compares the medians of a few steps of each plan. On
ranks that share cores single steps spread widely, so the decision is a draw. This replays it on the
steady-state step times of the time-to-accuracy run (results/tta_raw.jsonl, rank 0): for a cell where
that run has long stretches of both plans, it draws windows of ``steps + 1`` consecutive steps from
each (the first left out, as the trial does) and applies the decision rules:

- one window each: dense kept where its median is at most the sparse window's (the rule before the
  confirm phase);
- a second sparse window after a dense one that measured no slower: dense kept where its median is
  at most the mean of the two sparse windows (the rule now).

Each cell is replayed twice: as measured (dense slower there), and with the roles swapped, a stand-in
for a cell where dense is faster by the same ratio, where keeping dense is right.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from pathlib import Path

from experiments.common import RESULTS, publish_md, read_jsonl
from ssfusion_lightning.engine.trial import CONFIRM, DENSE, PlanTrial

#: (workload, world, link) -> (label of the run with long sparse stretches, first step), (label of
#: the run that kept dense, first step): steps after the density warm-up and after the trial
CELLS = {
    ("digits", 4, "300mbit"): (("ssfusion@0.1%", 62), ("ssfusion@1%", 22)),
    ("text", 2, "300mbit"): (("ssfusion@0.1%", 150), ("ssfusion@1%", 22)),
}


def stretch(runs: list[dict], cell: tuple[str, int, str], label: str, first: int, dense: bool) -> list[float]:
    """The run's step times from ``first`` on where its plan was dense (or sparse) throughout."""
    workload, world, link = cell
    run = next(r for r in runs if (r["workload"], r["world"], r["phase"], r["label"]) == (workload, world, link, label))
    return [
        seconds for seconds, metrics in zip(run["step_seconds"][first:], run["engine"][first:])
        if (metrics.get("sparse_tensors") == 0) == dense
    ]


def window(trace: list[float], steps: int, rng: random.Random) -> list[float]:
    start = rng.randrange(len(trace) - steps)
    return trace[start : start + steps + 1]


def keeps_dense(sparse: list[float], dense: list[float], steps: int, rng: random.Random, confirm: bool) -> bool:
    trial = PlanTrial(steps, phase=DENSE, sparse_seconds=statistics.median(window(sparse, steps, rng)[1:]))
    for seconds in window(dense, steps, rng):
        trial.record(seconds)
    if trial.end_dense(lambda local: local) != CONFIRM:
        return False
    if not confirm:
        return True
    for seconds in window(sparse, steps, rng):
        trial.record(seconds)
    return trial.end_confirm(lambda local: local)


def replay(runs: list[dict], steps: int, draws: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for cell, ((sparse_label, sparse_from), (dense_label, dense_from)) in CELLS.items():
        sparse = stretch(runs, cell, sparse_label, sparse_from, dense=False)
        dense = stretch(runs, cell, dense_label, dense_from, dense=True)
        for swapped in (False, True):
            s, d = (dense, sparse) if swapped else (sparse, dense)
            row = {
                "cell": f"{cell[0]}, P = {cell[1]}, {cell[2]}" + (" (roles swapped)" if swapped else ""),
                "sparse ms": 1e3 * statistics.median(s), "dense ms": 1e3 * statistics.median(d),
                "steps": f"{len(s)}, {len(d)}",
            }
            for name, confirm in (("one window", False), ("confirm", True)):
                row[name] = sum(keeps_dense(s, d, steps, rng, confirm) for _ in range(draws)) / draws
            rows.append(row)
    return rows


def markdown(rows: list[dict], steps: int, draws: int) -> str:
    lines = [
        f"Plan trial replayed on results/tta_raw.jsonl ({steps} steps a window after one left out, {draws} draws a cell "
        "and rule): the share of trials that keep dense.",
        "",
        "| cell | sparse ms (median) | dense ms (median) | steps in the stretches | keeps dense: one window | keeps dense: confirm |",
        "|---|---:|---:|---|---:|---:|",
    ]
    for r in rows:
        lines.append(f"| {r['cell']} | {r['sparse ms']:.1f} | {r['dense ms']:.1f} | {r['steps']} | "
                     f"{r['one window']:.2f} | {r['confirm']:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--raw", type=Path, default=RESULTS / "tta_raw.jsonl")
    parser.add_argument("--steps", type=int, default=8, help="the trial's steps a phase (comm=auto's default)")
    parser.add_argument("--draws", type=int, default=4000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    rows = replay(read_jsonl(args.raw), args.steps, args.draws, args.seed)
    publish_md(markdown(rows, args.steps, args.draws), "trial_replay", args.out)
    (Path(args.out) if args.out else RESULTS).joinpath("trial_replay.json").write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
