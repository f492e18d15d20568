"""End-to-end benchmark on the emulated cluster: DDP (dense, fp16 hook, PowerSGD hook) versus the
fusion-engine schemes (ssfusion, safusion, adtopk, zen, oktopk, layerwise, behind), per link rate.

    python -m experiments.bench_e2e                 # full run (~20-25 min on 2 cores): P = 2, 4
    python -m experiments.bench_e2e --quick         # smoke run (~2-3 min): P = 2, smaller models
    python -m experiments.bench_e2e --from-csv      # tables, plots and REPORT.md block from the CSVs

For each world size P one process per emulated node is started once (experiments/e2e_worker.py);
the link rate changes between phases (unshaped first, then slower and slower links) and every
phase runs every workload x scheme as a fresh Lightning fit, side by side under the same load.

Per (P, rate, workload, scheme) it reports the median step time over the measured steps (the
first ``--warmup`` steps are dropped: the engine rebuilds its plan after step 0 and profiles
steps 1-3), samples/s, the time split (compute = the ``compute_only`` run of the same phase;
compression and exposed communication from ``strategy.last_metrics``; for the DDP variants the
exposed communication is step - compute), bytes per step, and after the long runs of the first
(unshaped) phase of the largest P the validation loss / accuracy reached after the same steps.

Outputs under --out (default experiments/results): e2e_steps.csv (every step of every run),
e2e_runs.csv (one row per run), e2e.csv/e2e.md (summary), e2e_targets.csv/md (targets),
e2e_throughput.png, e2e_breakdown.png, and the block between the e2e markers in
experiments/REPORT.md. ``--from-csv`` rebuilds all but the first two from the first two.

This module runs the benchmark and holds its command line; e2e_analyze.py turns the raw records into
CSV rows, the summary and the target checks; e2e_report.py writes the tables, plots and REPORT.md blocks.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from experiments.common import REPO, rate_label, rate_mbit, read_jsonl, results_dir, write_csv, write_jsonl
from experiments.e2e_analyze import (
    ACCURACY_SCHEMES,
    CURVE_FIELDS,
    DDP_SCHEMES,
    ENGINE_SCHEMES,
    RUN_FIELDS,
    SCHEMES,
    STEP_FIELDS,
    WORKLOADS,
    curve_rows,
    raw_rows,
)
from experiments.e2e_report import targets_markdown, write_all

# =========================================================================== running
DEFAULT_RATES = ["none", "150mbit", "40mbit"]
#: warm-up steps of the DDP variants (DDP rebuilds its buckets after step 0; PowerSGD starts at step 2)
DDP_WARMUP = 3
#: schemes of the target checks: run --key-repeats times (interleaved) on the slowest link and,
#: for the engine-overhead check (ssfusion_dense vs ddp), on the unshaped one
KEY_SCHEMES = ("compute_only", "compute_sync", "ddp", "ddp_fp16", "ddp_powersgd", "ddp_powersgd4", "ssfusion", "ssfusion_dense")


def build_phases(world: int, args: argparse.Namespace, accuracy_world: int) -> list[dict[str, Any]]:
    rates = args.rates if world == accuracy_world else (args.small_rates or args.rates)
    slowest = min(rates, key=rate_mbit)
    phases = []
    for index, rate in enumerate(rates):
        accuracy = index == 0 and world == accuracy_world and args.acc_steps > 0
        runs = []
        for workload in args.workloads:
            keyed = rate == slowest or rate_mbit(rate) == math.inf
            repeats = max(args.repeats, args.key_repeats if keyed else 1)
            for rep in range(repeats):
                for scheme in args.schemes:
                    if rep >= args.repeats and scheme not in KEY_SCHEMES:
                        continue
                    if scheme == "ssfusion_dense" and rate_mbit(rate) != math.inf:
                        continue  # the engine-overhead check runs on the unshaped link only
                    long = accuracy and scheme in ACCURACY_SCHEMES and rep == 0
                    # DDP needs fewer warm-up steps than the engine (bucket rebuild after step 0,
                    # PowerSGD from step 2): the same number of measured steps, fewer slow steps
                    warmup = min(args.warmup, DDP_WARMUP) if scheme in DDP_SCHEMES else args.warmup
                    steps = args.acc_steps if long else args.steps - (args.warmup - warmup)
                    run = {
                        "workload": workload, "scheme": scheme, "rep": rep, "seed": args.seed,
                        "steps": steps, "warmup": warmup, "eval": long,
                    }
                    if long:
                        run["eval_at"] = eval_points(args.acc_steps, args.eval_every)
                    if scheme in ENGINE_SCHEMES and args.engine_options:
                        run["overrides"] = args.engine_options
                    runs.append(run)
        phases.append({"label": rate, "runs": runs})
    return phases


def eval_points(steps: int, every: int) -> list[int]:
    """Steps after which the accuracy runs evaluate: every ``every`` steps and the last one."""
    return sorted({*range(every, steps, every), steps}) if every > 0 else [steps]


def run_world(world: int, phases: list[dict[str, Any]], args: argparse.Namespace, workdir: Path,
              ranks_per_node: int = 1) -> list[dict[str, Any]]:
    """One launch of P ranks on the emulated cluster; the host sets each phase's rate.
    ``ranks_per_node``: P / that many emulated nodes, each hosting that many ranks (a fast
    unshaped path between them, one shaped link per node)."""
    from experiments.cluster import EmulatedCluster

    ctl = workdir / (f"P{world}" if ranks_per_node == 1 else f"P{world}x{ranks_per_node}")
    ctl.mkdir(parents=True, exist_ok=True)
    out = ctl / "runs.jsonl"
    spec = {"ctl": str(ctl), "out": str(out), "quick": args.quick, "phases": phases, "phase_timeout": args.timeout,
            "nice": args.nice}
    (ctl / "spec.json").write_text(json.dumps(spec, indent=1))
    env = {
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
    }
    cmd = [sys.executable, "-m", "experiments.e2e_worker", str(ctl / "spec.json")]
    total = sum(len(p["runs"]) for p in phases)
    print(f"== P={world}: {len(phases)} phases, {total} runs (logs: {ctl / 'logs'})", flush=True)
    started = time.monotonic()
    with EmulatedCluster(nodes=world // ranks_per_node, rate=phases[0]["label"], delay=args.delay,
                         ranks_per_node=ranks_per_node) as cluster:
        box: dict[str, Any] = {}
        thread = threading.Thread(
            target=lambda: box.setdefault(
                "result", cluster.run(cmd, env=env, timeout=args.timeout, log_dir=ctl / "logs", stream=False)
            ),
            daemon=True,
        )
        thread.start()
        seen = 0
        for index, phase in enumerate(phases):
            cluster.set_rate(phase["label"])
            (ctl / f"go_{index}").write_text("go")
            while not (ctl / f"done_{index}").exists():
                seen = _progress(out, seen, started)
                if not thread.is_alive() or (ctl / "failed").exists():
                    break
                time.sleep(0.25)
            else:
                continue
            break
        thread.join()
        _progress(out, seen, started)
    result = box.get("result")
    runs = read_jsonl(out) if out.exists() else []
    if result is None or result.returncode != 0 or len(runs) < total:
        tail = result.log(0)[-3000:] if result is not None else ""
        print(f"!! P={world}: rc={getattr(result, 'returncode', None)}, {len(runs)}/{total} runs recorded\n{tail}", flush=True)
    return runs


def _progress(out: Path, seen: int, started: float) -> int:
    if not out.exists():
        return seen
    text = out.read_text()
    # the worker may be writing a line right now: only lines already ended are read
    lines = text[: text.rfind("\n") + 1].splitlines()
    for line in lines[seen:]:
        run = json.loads(line)
        if "error" in run:
            print(f"  [{time.monotonic() - started:6.0f}s] {run['phase']:>9} {run['workload']:<9} {run['scheme']:<15} "
                  f"FAILED\n{run['error'][-1500:]}", flush=True)
            continue
        measured = run["step_seconds"][run["warmup"]:] or run["step_seconds"]
        print(f"  [{time.monotonic() - started:6.0f}s] {rate_label(run['phase']):>9} {run['workload']:<9} "
              f"{run['scheme']:<15} {statistics.median(measured) * 1e3:8.1f} ms/step", flush=True)
    return len(lines)


# =========================================================================== main
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: P=2, small models, 2 rates, few steps")
    parser.add_argument("--from-csv", action="store_true", help="only rebuild summary, tables, plots, REPORT block")
    parser.add_argument("--from-raw", action="store_true", help="rebuild the CSVs too, from <stem>_raw.jsonl")
    parser.add_argument("--worlds", type=int, nargs="+", default=None)
    parser.add_argument("--rates", nargs="+", default=None, help="tc rates; 'none' = unshaped (put it first)")
    parser.add_argument("--workloads", nargs="+", default=["resnet18", "gpt2"], choices=WORKLOADS)
    parser.add_argument("--schemes", nargs="+", default=list(SCHEMES), choices=SCHEMES)
    parser.add_argument("--steps", type=int, default=None, help="steps per throughput run")
    parser.add_argument("--warmup", type=int, default=None, help="first steps of a run left out of the medians")
    parser.add_argument("--acc-steps", type=int, default=None, help="steps of the accuracy runs (first phase, largest P; default 240, quick 10)")
    parser.add_argument("--eval-every", type=int, default=None,
                        help="the accuracy runs also evaluate every this many steps (default 40; quick 5)")
    parser.add_argument("--repeats", type=int, default=1, help="runs per scheme and phase, interleaved")
    parser.add_argument("--key-repeats", type=int, default=None,
                        help="runs of the target schemes on the slowest link, interleaved (default 2; quick 1)")
    parser.add_argument("--small-rates", nargs="+", default=None,
                        help="rates for world sizes below the largest (default: --rates)")
    parser.add_argument("--delay", default=None, help="one-way delay per node (e.g. 0.1ms); default none")
    parser.add_argument("--engine-options", type=json.loads, default=None,
                        help='SSFusionStrategy keyword arguments for every engine scheme, as JSON (e.g. \'{"buffer_mb": 1}\')')
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--nice", type=int, default=-5,
                        help="niceness of the rank processes (default -5: ahead of other jobs on a shared host)")
    parser.add_argument("--timeout", type=float, default=2400, help="seconds per world size")
    parser.add_argument("--out", type=Path, default=None, help="results directory")
    parser.add_argument("--name", default=None, help="file stem (default e2e, quick: e2e_quick)")
    parser.add_argument("--no-report", action="store_true", help="do not update experiments/REPORT.md")
    args = parser.parse_args(argv)

    stem = args.name or ("e2e_quick" if args.quick else "e2e")
    out, update = results_dir(args, "ssf_e2e_quick")
    if args.from_csv:
        summary, target_rows = write_all(out, stem, update)
        print(targets_markdown(target_rows))
        return 0
    if args.from_raw:
        runs = read_jsonl(out / f"{stem}_raw.jsonl")
        meta = json.loads((out / f"{stem}_meta.json").read_text()) if (out / f"{stem}_meta.json").exists() else {}
        for key, value in meta.items():
            if getattr(args, key, None) is None and key in vars(args):
                setattr(args, key, value)
        return finish(runs, out, stem, args, argv, time.monotonic(), update, write_meta=False)

    args.worlds = args.worlds or ([2] if args.quick else [2, 4])
    args.rates = args.rates or (["none", "50mbit"] if args.quick else DEFAULT_RATES)
    args.key_repeats = args.key_repeats if args.key_repeats is not None else (1 if args.quick else 2)
    args.steps = args.steps or (8 if args.quick else 14)
    args.warmup = args.warmup if args.warmup is not None else (5 if args.quick else 6)
    args.acc_steps = args.acc_steps if args.acc_steps is not None else (10 if args.quick else 240)
    args.eval_every = args.eval_every if args.eval_every is not None else (5 if args.quick else 40)
    if args.steps <= args.warmup:
        parser.error("--steps must exceed --warmup")

    from experiments.cluster import probe_support

    support = probe_support()
    if not support.get("usable"):
        print(f"the emulated cluster cannot run here: {support.get('reason', support)}", file=sys.stderr)
        return 2
    started = time.monotonic()
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="ssf_e2e_") as tmp:
        for world in args.worlds:
            runs += run_world(world, build_phases(world, args, max(args.worlds)), args, Path(tmp))
            # keep the raw records (every step's metrics) before anything else can fail
            write_jsonl(out / f"{stem}_raw.jsonl", runs)
    return finish(runs, out, stem, args, argv, started, update)


def finish(runs: list[dict[str, Any]], out: Path, stem: str, args: argparse.Namespace, argv, started: float,
           update: bool, write_meta: bool = True) -> int:
    steps, rows = raw_rows(runs)
    write_csv(out / f"{stem}_steps.csv", STEP_FIELDS, steps)
    write_csv(out / f"{stem}_runs.csv", RUN_FIELDS, rows)
    write_csv(out / f"{stem}_curve.csv", CURVE_FIELDS, curve_rows(runs))
    meta = {"argv": sys.argv[1:] if argv is None else argv, "cpus": os.cpu_count(), "wall_seconds": time.monotonic() - started,
            "worlds": args.worlds, "rates": args.rates, "steps": args.steps, "warmup": args.warmup,
            "acc_steps": args.acc_steps, "eval_every": args.eval_every, "repeats": args.repeats, "key_repeats": args.key_repeats,
            "small_rates": args.small_rates, "delay": args.delay, "nice": args.nice,
            "engine_options": args.engine_options}
    if write_meta:
        (out / f"{stem}_meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    summary, target_rows = write_all(out, stem, update)
    print(targets_markdown(target_rows))
    print(f"wrote {out}/{stem}*.{{csv,md,png}} in {time.monotonic() - started:.0f} s")
    failed = [r for r in rows if r["error"]]
    return 1 if failed or not runs else 0


if __name__ == "__main__":
    sys.exit(main())
