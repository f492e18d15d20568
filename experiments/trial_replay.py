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

A second table replays the ranks' agreement on every rank's step times (results/
tta_confirm_ranks_raw.jsonl, P = 4, 300 Mbit/s, digits, 4 seeds): each rank takes its window's
median and the ranks agree on their max (the rule before) or their mean (the rule now), at 8 and
16 steps a window. The sparse stretch is ssfusion@1%'s steps after its trial (sparse kept in every
seed), the dense one DDP's steps after step 20 (a stand-in for the engine's dense plan: DDP's
buckets); both windows of one trial come from the same seed's runs, which ran back to back.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from pathlib import Path
from typing import Callable

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


def rank_windows(ranks: list[list[float]], steps: int, rng: random.Random) -> list[list[float]]:
    """One window of ``steps + 1`` consecutive steps, the same steps on every rank."""
    start = rng.randrange(len(ranks[0]) - steps)
    return [trace[start : start + steps + 1] for trace in ranks]


def keeps_dense(
    sparse: list[list[float]], dense: list[list[float]], steps: int, rng: random.Random, confirm: bool,
    combine: Callable[[list[float]], float] = max,
) -> bool:
    """One trial's decision on windows drawn from every rank's ``sparse`` and ``dense`` step times;
    the ranks agree on ``combine`` of their medians."""

    def agreed(windows: list[list[float]]) -> float:
        return combine([statistics.median(w[1:]) for w in windows])

    trial = PlanTrial(steps, phase=DENSE, sparse_seconds=agreed(rank_windows(sparse, steps, rng)))
    while trial.phase == DENSE:  # twice where the sparse windows drifted apart (trial.DRIFT_LIMIT)
        windows = rank_windows(dense, steps, rng)
        for seconds in windows[0]:
            trial.record(seconds)
        if trial.end_dense(lambda local: agreed(windows)) != CONFIRM:
            return False
        if not confirm:
            return True
        windows = rank_windows(sparse, steps, rng)
        for seconds in windows[0]:
            trial.record(seconds)
        trial.end_confirm(lambda local: agreed(windows))
    return trial.dense_kept


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
                row[name] = sum(keeps_dense([s], [d], steps, rng, confirm) for _ in range(draws)) / draws
            rows.append(row)
    return rows


#: how the ranks agree on their window medians
AGREEMENTS = {"max": max, "mean": statistics.mean}


def replay_ranks(runs: list[dict], steps: tuple[int, ...], draws: int, seed: int) -> list[dict]:
    """The confirm rule on every rank's step times, per agreement and window length: the share of
    trials that keep dense, as measured (dense slower) and with the roles swapped."""
    rng = random.Random(seed)
    seeds = sorted({r["seed"] for r in runs})
    sparse = {r["seed"]: [t[40:] for t in r["rank_step_seconds"]] for r in runs if r["scheme"] != "ddp"}
    dense = {r["seed"]: [t[20:] for t in r["rank_step_seconds"]] for r in runs if r["scheme"] == "ddp"}
    rows = []
    for window_steps in steps:
        for name, combine in AGREEMENTS.items():
            row = {"agreement": name, "steps": window_steps}
            for key, swapped in (("dense slower", False), ("dense faster", True)):
                kept = 0
                for _ in range(draws):
                    run = rng.choice(seeds)
                    s, d = (dense[run], sparse[run]) if swapped else (sparse[run], dense[run])
                    kept += keeps_dense(s, d, window_steps, rng, True, combine)
                row[key] = kept / draws
            rows.append(row)
    medians = {
        key: 1e3 * statistics.median([x for ranks in by_seed.values() for trace in ranks for x in trace])
        for key, by_seed in (("sparse ms", sparse), ("dense ms", dense))
    }
    return [dict(row, **medians) for row in rows]


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


def markdown_ranks(rows: list[dict], draws: int) -> str:
    lines = [
        f"The ranks' agreement replayed on every rank's step times (results/tta_confirm_ranks_raw.jsonl, digits, "
        f"P = 4, 300 Mbit/s; sparse: ssfusion@1% after its trial, median {rows[0]['sparse ms']:.1f} ms; dense: DDP, "
        f"median {rows[0]['dense ms']:.1f} ms; {draws} draws a row, confirm rule): the share of trials that keep dense.",
        "",
        "| ranks agree on their medians' | steps a window | keeps dense where it is slower (wrong) | "
        "keeps dense, roles swapped (right) |",
        "|---|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(f"| {r['agreement']} | {r['steps']} | {r['dense slower']:.3f} | {r['dense faster']:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--raw", type=Path, default=RESULTS / "tta_raw.jsonl")
    parser.add_argument("--ranks-raw", type=Path, default=RESULTS / "tta_confirm_ranks_raw.jsonl")
    parser.add_argument("--steps", type=int, default=16, help="the trial's steps a phase (comm=auto's default)")
    parser.add_argument("--draws", type=int, default=4000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    rows = replay(read_jsonl(args.raw), args.steps, args.draws, args.seed)
    rank_rows = replay_ranks(read_jsonl(args.ranks_raw), (8, 16), args.draws, args.seed)
    publish_md(markdown(rows, args.steps, args.draws) + "\n\n" + markdown_ranks(rank_rows, args.draws), "trial_replay", args.out)
    (Path(args.out) if args.out else RESULTS).joinpath("trial_replay.json").write_text(
        json.dumps({"rank_0": rows, "ranks": rank_rows}, indent=1) + "\n"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
