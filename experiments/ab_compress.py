"""A/B of two commits' compression on the emulated cluster, with no DDP run beside them.

    python -m experiments.ab_compress --name ab_finite_sum --a-rev 8adbf48 --b-rev aef16c4 \\
        --world 2 --rate 40mbit --workload gpt2_10m --repeats 3

``ab_engine_options`` compares step times as ratios to a Lightning ddp run of the same launch,
which cancels the host's drift. A change to the engine's CPU work is read more directly from the
engine's own ``compress_seconds`` (the main thread's compensation, selection and packing per step),
which needs no reference, and on a slow link a ddp run of a large model takes most of the time
(gpt2_10m at 40 Mbit/s: about 9 s a step). So this runs bench_e2e with the engine scheme alone, A
and B alternated (A, B, A, B, ...) so both see the same drift, and reports per run the median step
and the median compression over the steps after the warm-up.

Writes <out>/<name>.csv (one row per variant and repeat) and <name>.md.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from experiments.ab_engine_options import checked_out
from experiments.common import RESULTS, read_csv, write_csv
from experiments.e2e_analyze import ENGINE_SCHEMES

FIELDS = ("variant", "revision", "repeat", "world", "workload", "rate", "scheme", "step_ms", "compress_ms")


def run_variant(args: argparse.Namespace, variant: str, checkout: Path, revision: str, repeat: int, scratch: Path) -> dict:
    name = f"{variant}_{repeat}"
    command = [
        sys.executable, "-m", "experiments.bench_e2e", "--worlds", str(args.world), "--rates", args.rate,
        "--workloads", args.workload, "--schemes", args.scheme, "--acc-steps", "0", "--key-repeats", "1",
        "--steps", str(args.steps), "--warmup", str(args.warmup), "--out", str(scratch), "--name", name, "--no-report",
    ]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, cwd=checkout)
    (row,) = [r for r in read_csv(scratch / f"{name}.csv") if r["scheme"] == args.scheme]
    return dict(variant=variant, revision=revision, repeat=repeat, world=args.world, workload=args.workload, rate=args.rate,
                scheme=args.scheme, step_ms=row["step_ms"], compress_ms=row["compress_ms"])


def markdown(rows: list[dict], command: str) -> str:
    def column(variant: str, field: str) -> list[float]:
        return [float(r[field]) for r in rows if r["variant"] == variant]

    first = rows[0]
    lines = [
        f"Command: `{command}`",
        "",
        f"P = {first['world']}, {first['workload']}, {first['rate']}, {first['scheme']}: per run (A and B alternated) the "
        "median step and the median of the engine's compress_seconds over the steps after the warm-up, then their medians.",
        "",
        "| variant | revision | step ms per run | compress ms per run | median step ms | median compress ms |",
        "|---|---|---|---|---:|---:|",
    ]
    for variant in ("A", "B"):
        steps, compress = column(variant, "step_ms"), column(variant, "compress_ms")
        revision = next(r["revision"] for r in rows if r["variant"] == variant)
        lines.append(
            f"| {variant} | {revision} | {', '.join(f'{v:.1f}' for v in steps)} | {', '.join(f'{v:.1f}' for v in compress)} "
            f"| {statistics.median(steps):.1f} | {statistics.median(compress):.1f} |"
        )
    ratio = statistics.median(column("B", "compress_ms")) / statistics.median(column("A", "compress_ms"))
    lines += ["", f"B / A, median compression: {ratio:.2f}."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--a-rev", required=True, help="the git revision of variant A")
    parser.add_argument("--b-rev", default=None, help="the git revision of variant B (default: the working tree)")
    parser.add_argument("--name", required=True, help="file stem of the results")
    parser.add_argument("--repeats", type=int, default=3, help="runs per variant, alternated")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--rate", default="40mbit")
    parser.add_argument("--workload", default="gpt2_10m")
    parser.add_argument("--scheme", default="ssfusion", choices=ENGINE_SCHEMES)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=30, help="first steps of a run left out of its medians")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="ab_compress_") as tmp, checked_out((args.a_rev, args.b_rev), Path(tmp)) as checkouts:
        for repeat in range(args.repeats):
            for variant, (checkout, revision) in zip("AB", checkouts):
                rows.append(run_variant(args, variant, checkout, revision, repeat, Path(tmp)))
                print(f"repeat {repeat} variant {variant}: step {rows[-1]['step_ms']} ms, compress {rows[-1]['compress_ms']} ms", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(args.out / f"{args.name}.csv", FIELDS, rows)
    text = markdown(rows, "python -m experiments.ab_compress " + " ".join(sys.argv[1:] if argv is None else argv))
    (args.out / f"{args.name}.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
