"""Issue 14's overlap targets for one bench_e2e launch, as the REPORT's "Run N of the overlap cells" tables.

Per link and workload, from ``results/<name>.csv``: ssfusion's share of the compute-only step (target
>= 0.90), PowerSGD rank 1's step over ssfusion's (>= 1.0), the exposed communication plus compression
as a share of ssfusion's step (<= 0.10), and ssfusion's CPU time per step over compute-only's of the
same phase (<= 1.15). Bold: met.

    python -m experiments.overlap_targets e2e_overlap21
"""

from __future__ import annotations

import argparse

from experiments.common import RESULTS, read_csv

WORKLOADS = ("resnet18", "gpt2", "gpt2_10m")


def bold(value: float, met: bool) -> str:
    return f"**{value:.2f}**" if met else f"{value:.2f}"


def table(rows: list[dict[str, str]]) -> str:
    def row(rate: str, workload: str, scheme: str) -> dict[str, str] | None:
        return next((r for r in rows if (r["rate"], r["workload"], r["scheme"]) == (rate, workload, scheme)), None)

    rates = list(dict.fromkeys(r["rate"] for r in rows))
    lines = [
        "| link | workload | of compute-only | x PowerSGD rank 1 | exposed + compress, share of the step "
        "| CPU / compute-only's | compress ms | step ms |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for rate in rates:
        for workload in WORKLOADS:
            mine, hook, compute = (row(rate, workload, s) for s in ("ssfusion", "ddp_powersgd", "compute_only"))
            if mine is None or hook is None or compute is None:
                continue
            step = float(mine["step_ms"])
            of_compute = float(mine["of_compute"])
            x_hook = float(hook["step_ms"]) / step
            share = (float(mine["compress_ms"]) + float(mine["exposed_comm_ms"])) / step
            cpu = float(mine["step_cpu_ms"]) / float(compute["step_cpu_ms"])
            lines.append(
                f"| {rate} | {workload} | {bold(of_compute, round(of_compute, 2) >= 0.90)} | "
                f"{bold(x_hook, round(x_hook, 2) >= 1.0)} | {bold(share, round(share, 2) <= 0.10)} | "
                f"{bold(cpu, round(cpu, 2) <= 1.15)} | {float(mine['compress_ms']):.1f} | {step:.0f} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("name", help="the launch's --name (reads experiments/results/NAME.csv)")
    args = parser.parse_args(argv)
    print(table(read_csv(RESULTS / f"{args.name}.csv")), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
