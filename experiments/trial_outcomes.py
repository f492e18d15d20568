"""What the plan trial decided in a time-to-accuracy launch, and what the decision cost, per seed.

    python -m experiments.trial_outcomes tta_mean16_a [tta_mean16_b ...]

Reads results/<name>_raw.jsonl of ``bench_tta`` launches (each with DDP and comm=auto presets over
several seeds). Per sparse run: the trial's agreed medians (``dense_trial`` in the record), the plan
it kept (from the engine's metrics after the trial: a step with no sparse tensor is dense), the
median step from ``--from`` on, and DDP's median step in the same launch and seed. A run is slower
than DDP where its step after the trial is above DDP's; the summary counts the seeds that kept
dense and the seeds that ended slower than DDP, and the median step of each kept plan.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from experiments.common import RESULTS, publish_md, read_jsonl


def outcomes(runs: list[dict], first: int) -> list[dict]:
    """One row per sparse run that ran the trial."""
    def cell(run: dict) -> tuple:
        return run["launch"], run["world"], run["phase"], run["workload"], run["seed"]

    ddp = {cell(r): statistics.median(r["step_seconds"][first:]) for r in runs if r["scheme"] == "ddp"}
    rows = []
    for run in runs:
        trial = run.get("dense_trial")
        if run["scheme"] == "ddp" or not trial:
            continue
        kept_dense = all(metrics.get("sparse_tensors") == 0 for metrics in run["engine"][first:])
        rows.append({
            "launch": run["launch"], "label": run["label"], "seed": run["seed"],
            **{key: trial.get(f"{key}_seconds") for key in ("sparse", "fused", "recut", "dense", "confirmed")},
            "discarded": trial.get("discarded"),
            "kept": "dense" if kept_dense else "sparse",
            "step": statistics.median(run["step_seconds"][first:]),
            "ddp step": ddp[cell(run)],
        })
    return rows


def summary(rows: list[dict]) -> dict:
    by_plan = {plan: [r["step"] for r in rows if r["kept"] == plan] for plan in ("sparse", "dense")}
    return {
        "seeds": len(rows),
        "kept dense": len(by_plan["dense"]),
        "slower than DDP": sum(r["step"] > r["ddp step"] for r in rows),
        **{f"{plan} step": statistics.median(steps) if steps else None for plan, steps in by_plan.items()},
        "ddp step": statistics.median(r["ddp step"] for r in rows) if rows else None,
    }


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{1e3 * seconds:.1f}"


def _discarded(medians: list[float] | None) -> str:
    """The first comparison's dense and sparse-again medians where the trial measured them again."""
    return "-" if not medians else f"{_ms(medians[0])}, {_ms(medians[1])}"


def markdown(rows: list[dict], total: dict, first: int) -> str:
    lines = [
        f"The plan trial per seed: the ranks' agreed medians, the plan kept, and the median step from step {first} on "
        "against DDP's in the same launch and seed (ms).",
        "",
        "| launch | scheme | seed | sparse | one buffer | sparse after one buffer | drifted: dense, sparse again | dense | sparse again "
        "| kept | step | DDP's step | step / DDP's |",
        "|---|---|---:|---:|---:|---:|---|---:|---:|---|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['launch']} | {r['label']} | {r['seed']} | {_ms(r['sparse'])} | {_ms(r['fused'])} | {_ms(r['recut'])} | {_discarded(r['discarded'])} | "
            f"{_ms(r['dense'])} | "
            f"{_ms(r['confirmed'])} | {r['kept']} | {_ms(r['step'])} | {_ms(r['ddp step'])} | {r['step'] / r['ddp step']:.2f} |"
        )
    lines += [
        "",
        f"{total['seeds']} seeds: dense kept in {total['kept dense']}, a step slower than DDP's in {total['slower than DDP']}; "
        f"median step {_ms(total['sparse step'])} where sparse was kept, {_ms(total['dense step'])} where dense was, "
        f"DDP {_ms(total['ddp step'])}.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("launches", nargs="+", help="bench_tta --name of each launch (reads results/<name>_raw.jsonl)")
    parser.add_argument("--from", dest="first", type=int, default=60, help="first step counted (after the trial)")
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--name", default="trial_outcomes", help="the table's file name under --out")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    runs = [
        dict(run, launch=launch) for launch in args.launches for run in read_jsonl(args.results / f"{launch}_raw.jsonl")
    ]
    rows = outcomes(runs, args.first)
    publish_md(markdown(rows, summary(rows), args.first), args.name, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
