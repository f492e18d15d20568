"""How long ``ssfusion-train`` takes to answer ``--help`` and a bad value (target: under 2 s).

    python -m experiments.bench_cli_latency              # 5 repetitions of each case
    python -m experiments.bench_cli_latency --repeat 1   # smoke run

Each case runs ``python -m ssfusion_lightning.cli ARGS`` (what the ``ssfusion-train`` script runs)
in a fresh process from an empty temporary directory. Reported per case: the exit status, the
median wall time, and the median CPU time (user + system of the process; it varies much less than
the wall time on a machine others are using, so the load average is recorded too). For reference,
the same for ``import torch`` and ``import lightning``: what the command line used to load before it
checked anything. ``trainer=gpu`` on a machine without a GPU driver is answered without torch (no
driver device node); where a driver exists it asks ``torch.cuda.is_available()``.

Writes experiments/results/cli_latency.md (or --out FILE) and prints it.
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "experiments" / "results"
TARGET_S = 2.0
#: (label, command-line arguments, held to the target)
CASES = [
    ("--help", ["--help"], True),
    ("strategy.density=0", ["strategy.density=0"], True),
    ("strategy.buffer_mb=-1", ["strategy.buffer_mb=-1"], True),
    ("strategy.offload=bogus", ["strategy.offload=bogus"], True),
    ("trainer.devices=0", ["trainer.devices=0"], True),
    ("strategy.densty=0.1 (misspelled key)", ["strategy.densty=0.1"], True),
    ("sparsifier=topkk (misspelled option)", ["sparsifier=topkk"], True),
    ("trainer=gpu (no GPU driver here)", ["trainer=gpu"], True),
]
REFERENCES = [("import torch", "import torch"), ("import lightning", "import lightning")]


def timed(command: list[str], cwd: str) -> tuple[int, float, float]:
    """Exit status, wall seconds and CPU seconds (user + system) of one run of ``command``."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return done.returncode, wall, cpu


def measure(command: list[str], repeat: int) -> tuple[int, float, float]:
    """Exit status (of the last run), median wall and median CPU seconds over ``repeat`` runs."""
    walls, cpus, status = [], [], 0
    for _ in range(repeat):
        with tempfile.TemporaryDirectory() as cwd:
            status, wall, cpu = timed(command, cwd)
        walls.append(wall)
        cpus.append(cpu)
    return status, statistics.median(walls), statistics.median(cpus)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--out", type=Path, default=RESULTS / "cli_latency.md")
    args = parser.parse_args(argv)

    load_before = os.getloadavg()[0]
    rows = []
    for label, cli_args, held in CASES:
        status, wall, cpu = measure([sys.executable, "-m", "ssfusion_lightning.cli", *cli_args], args.repeat)
        verdict = ("yes" if wall < TARGET_S else "NO") if held else "-"
        rows.append(f"| `ssfusion-train {label}` | {status} | {wall:.2f} | {cpu:.2f} | {verdict} |")
    for label, code in REFERENCES:
        status, wall, cpu = measure([sys.executable, "-c", code], args.repeat)
        rows.append(f"| reference: `python -c '{label}'` | {status} | {wall:.2f} | {cpu:.2f} | - |")
    load_after = os.getloadavg()[0]

    lines = [
        "# ssfusion-train: time to answer --help and a bad value",
        "",
        f"Produced by `python -m experiments.bench_cli_latency --repeat {args.repeat}`: median of {args.repeat} fresh "
        f"processes per row; target: under {TARGET_S:g} s wall.",
        f"Machine: {os.cpu_count()} CPUs, Python {platform.python_version()}, "
        f"1-minute load average {load_before:.1f} before and {load_after:.1f} after "
        "(a load above the CPU count stretches the wall times; the CPU times stay put).",
        "",
        "| command | exit status | wall s | CPU s | under target |",
        "|---|---|---|---|---|",
        *rows,
        "",
    ]
    text = "\n".join(lines)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
