"""A/B test of one engine option, or of two commits, on the emulated cluster: bench_e2e runs with
options (or code) A and B, alternated (A, B, A, B, ...) so both see the same drift in outside load,
each run with Lightning ``ddp`` beside the engine schemes. Every engine step time is compared as its
ratio to the ddp of the same run, which cancels most of the load the run saw.

    python -m experiments.ab_engine_options --name ab_first_buffer --b '{"first_buffer_mb": 1}'
    python -m experiments.ab_engine_options --name ab_vote --a-rev HEAD~1   # code A/B

    python -m experiments.ab_engine_options --name ab_first_buffer --from-csv   # table and plot only

Writes <out>/<name>.csv (one row per variant, repeat, workload, link and scheme), <name>.md (the
per-repeat ratios, their medians and B's median over A's) and <name>.png (the same as bars).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Sequence

from experiments.common import REPO, RESULTS, pyplot, read_csv, save_figure, write_csv
from experiments.e2e_analyze import ENGINE_SCHEMES

FIELDS = ("variant", "options", "revision", "repeat", "world", "workload", "rate", "scheme", "step_ms", "ddp_step_ms", "x_ddp_step",
          "kb_sent_step", "compress_ms", "x_ddp_cpu", "buffers")


def run_variant(
    args: argparse.Namespace, variant: str, options: str, checkout: Path, revision: str, repeat: int, scratch: Path,
    schemes: list[str] | None = None,
) -> list[dict]:
    """One bench_e2e run of ``schemes`` (default ``args.schemes``) beside Lightning ddp, the engine's
    with ``options``: a row per scheme, world, workload and link, its step time also as a ratio to
    the ddp of the same run."""
    name = f"{variant}_{repeat}"
    schemes = list(schemes or args.schemes)
    command = [
        sys.executable, "-m", "experiments.bench_e2e", "--worlds", *map(str, args.worlds), "--rates", *args.rates,
        "--workloads", *args.workloads, "--schemes", "ddp", *schemes, "--acc-steps", "0", "--key-repeats", "1",
        "--engine-options", options, "--out", str(scratch), "--name", name, "--no-report",
    ]
    for flag, value in (("--steps", args.steps), ("--warmup", args.warmup)):
        if value is not None:
            command += [flag, str(value)]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, cwd=checkout)
    summary = read_csv(scratch / f"{name}.csv")
    ddp = {(r["world"], r["workload"], r["rate"]): float(r["step_ms"]) for r in summary if r["scheme"] == "ddp"}
    cpu = {(r["world"], r["workload"], r["rate"]): float(r["step_cpu_ms"]) for r in summary if r["scheme"] == "ddp" and r.get("step_cpu_ms")}
    # the final plan's buffer count: the auto cut's, from the costs this run measured
    buffers = {(r["world"], r["workload"], r["rate"], r["scheme"]): r["plan_buffers"] for r in read_csv(scratch / f"{name}_runs.csv")}
    rows = []
    for r in summary:
        if r["scheme"] not in schemes or not r["step_ms"]:
            continue
        key = (r["world"], r["workload"], r["rate"])
        reference = ddp[key]
        step = float(r["step_ms"])
        rows.append(
            dict(variant=variant, options=options, revision=revision, repeat=repeat, world=r["world"], workload=r["workload"], rate=r["rate"],
                 scheme=r["scheme"], step_ms=f"{step:.1f}", ddp_step_ms=f"{reference:.1f}", x_ddp_step=f"{step / reference:.3f}",
                 kb_sent_step=f"{float(r['bytes_per_step']) / 1e3:.1f}" if r.get("bytes_per_step") else "",
                 compress_ms=r.get("compress_ms", ""),
                 x_ddp_cpu=f"{float(r['step_cpu_ms']) / cpu[key]:.3f}" if r.get("step_cpu_ms") and cpu.get(key) else "",
                 buffers=buffers.get((r["world"], r["workload"], r["rate"], r["scheme"]), ""))
        )
    return rows


def _runs(values: list[float], median: float) -> str:
    return ", ".join(f"{v:.2f}" for v in values) + f" (**{median:.2f}**)"


def checkout_of(revision: str | None, scratch: Path) -> tuple[Path, str]:
    """The repository itself (the working tree) or a detached worktree of ``revision``."""
    if revision is None:
        return REPO, "working tree"
    commit = subprocess.run(["git", "rev-parse", "--short", revision], cwd=REPO, check=True, capture_output=True, text=True).stdout.strip()
    path = scratch / f"rev_{commit}"
    subprocess.run(["git", "worktree", "add", "--detach", str(path), commit], cwd=REPO, check=True, capture_output=True)
    return path, commit


@contextmanager
def checked_out(revisions: Sequence[str | None], scratch: Path) -> Iterator[list[tuple[Path, str]]]:
    """``checkout_of`` each revision, in order; the worktrees are removed on the way out, also when
    a later checkout or a run fails."""
    checkouts: list[tuple[Path, str]] = []
    try:
        for revision in revisions:
            checkouts.append(checkout_of(revision, scratch))
        yield checkouts
    finally:
        for checkout, _ in checkouts:
            if checkout != REPO:
                subprocess.run(["git", "worktree", "remove", "--force", str(checkout)], cwd=REPO, capture_output=True)


def variant_label(options: str, revision: str) -> str:
    return options if revision in ("", "working tree") else f"{options} at {revision}"


def markdown(rows: list[dict], a: str, b: str) -> str:
    ratios: dict[tuple, dict[str, list[float]]] = defaultdict(lambda: {"A": [], "B": []})
    for r in rows:
        ratios[(r["world"], r["workload"], r["rate"], r["scheme"])][r["variant"]].append(float(r["x_ddp_step"]))
    lines = [
        f"A = `{a}`, B = `{b}`. Each cell: the scheme's median step time over Lightning ddp's in the same run "
        "(lower is faster), one value per run, then the median.",
        "",
        "| P | workload | link | scheme | A: step / ddp | B: step / ddp | B / A |",
        "|---|---|---|---|---|---|---:|",
    ]
    for (world, workload, rate, scheme), by in sorted(ratios.items()):
        med_a, med_b = statistics.median(by["A"]), statistics.median(by["B"])
        lines.append(
            f"| {world} | {workload} | {rate} | {scheme} | {_runs(by['A'], med_a)} | {_runs(by['B'], med_b)} | {med_b / med_a:.2f} |"
        )
    cost = [r for r in rows if r.get("compress_ms") and r.get("x_ddp_cpu")]
    if cost:  # CSVs written before these columns have none
        lines += [
            "",
            "Compression (the engine's `compress_seconds` a step, ms) and the CPU time of a step over ddp's in the same "
            "run, medians over the runs; the plan's buffers in each run:",
            "",
            "| P | workload | link | scheme | A: compress ms | B: compress ms | B / A | A: CPU / ddp | B: CPU / ddp | B / A | buffers A; B |",
            "|---|---|---|---|---:|---:|---:|---:|---:|---:|---|",
        ]
        for key in sorted(ratios):
            of = {v: [r for r in cost if (r["world"], r["workload"], r["rate"], r["scheme"]) == key and r["variant"] == v] for v in "AB"}
            if not of["A"] or not of["B"]:
                continue
            ms = {v: statistics.median(float(r["compress_ms"]) for r in of[v]) for v in "AB"}
            x_cpu = {v: statistics.median(float(r["x_ddp_cpu"]) for r in of[v]) for v in "AB"}
            buffers = {v: ", ".join(str(r.get("buffers") or "?") for r in of[v]) for v in "AB"}
            compress_ratio = f"{ms['B'] / ms['A']:.2f}" if ms["A"] else "-"  # a dense scheme compresses nothing
            lines.append(
                f"| {' | '.join(key)} | {ms['A']:.1f} | {ms['B']:.1f} | {compress_ratio} | "
                f"{x_cpu['A']:.3f} | {x_cpu['B']:.3f} | {x_cpu['B'] / x_cpu['A']:.2f} | {buffers['A']}; {buffers['B']} |"
            )
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], a: str, b: str, path: Path) -> None:
    plt = pyplot()
    keys = sorted({(r["world"], r["workload"], r["rate"], r["scheme"]) for r in rows})
    fig, ax = plt.subplots(figsize=(1.6 + 1.5 * len(keys), 3.6))
    for offset, variant, label, colour in ((-0.18, "A", a, "tab:gray"), (0.18, "B", b, "tab:blue")):
        for x, key in enumerate(keys):
            values = [float(r["x_ddp_step"]) for r in rows if (r["world"], r["workload"], r["rate"], r["scheme"]) == key and r["variant"] == variant]
            ax.bar(x + offset, statistics.median(values), width=0.34, color=colour, alpha=0.6, label=f"{variant}: {label}" if x == 0 else None)
            ax.plot([x + offset] * len(values), values, "k.", markersize=4)
    ax.set_xticks(range(len(keys)), [f"P={w} {wl}\n{rate}\n{scheme}" for w, wl, rate, scheme in keys], fontsize=8)
    ax.set_ylabel("step time / ddp's (same run)")
    ax.set_title("A/B of an engine option: median (bar) and each run (dot); lower is faster", fontsize=9)
    ax.legend(fontsize=8)
    save_figure(fig, path)


def write_outputs(rows: list[dict], out: Path, name: str) -> None:
    labels = {r["variant"]: variant_label(r["options"], r.get("revision", "")) for r in rows}
    (out / f"{name}.md").write_text(markdown(rows, labels["A"], labels["B"]))
    plot(rows, labels["A"], labels["B"], out / f"{name}.png")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--a", default="{}", help="engine options of variant A, as JSON (default: the defaults)")
    parser.add_argument("--b", default="{}", help="engine options of variant B, as JSON (default: the defaults)")
    parser.add_argument("--a-rev", help="run variant A from this git revision (default: the working tree)")
    parser.add_argument("--b-rev", help="run variant B from this git revision (default: the working tree)")
    parser.add_argument("--name", required=True, help="file stem of the results")
    parser.add_argument("--repeats", type=int, default=3, help="runs per variant, alternated")
    parser.add_argument("--worlds", type=int, nargs="+", default=[4])
    parser.add_argument("--rates", nargs="+", default=["none", "40mbit"])
    parser.add_argument("--workloads", nargs="+", default=["resnet18", "gpt2"])
    parser.add_argument("--schemes", nargs="+", default=["ssfusion", "ssfusion_dense"], choices=ENGINE_SCHEMES)
    parser.add_argument("--steps", type=int, help="steps per run (bench_e2e's default: 14)")
    parser.add_argument("--warmup", type=int, help="first steps of a run left out of its median (bench_e2e's default: 6)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--from-csv", action="store_true", help="only rebuild the table and plot from <out>/<name>.csv")
    args = parser.parse_args(argv)
    if args.from_csv:
        write_outputs(read_csv(args.out / f"{args.name}.csv"), args.out, args.name)
        return
    if args.a == args.b and args.a_rev == args.b_rev:
        parser.error("A and B are the same: give --b (options) or --a-rev/--b-rev (code) that differ")
    for flag, options in (("--a", args.a), ("--b", args.b)):
        if not isinstance(json.loads(options), dict):
            raise SystemExit(f"{flag} must be a JSON object of SSFusionStrategy keyword arguments, got {options!r}")
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as scratch, checked_out((args.a_rev, args.b_rev), Path(scratch)) as checkouts:
        variants = [("A", args.a, *checkouts[0]), ("B", args.b, *checkouts[1])]
        for repeat in range(args.repeats):
            for variant, options, checkout, revision in variants:
                rows += run_variant(args, variant, options, checkout, revision, repeat, Path(scratch))
                print(f"repeat {repeat} variant {variant} done", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(args.out / f"{args.name}.csv", FIELDS, rows)
    write_outputs(rows, args.out, args.name)
    print((args.out / f"{args.name}.md").read_text())


if __name__ == "__main__":
    main()
