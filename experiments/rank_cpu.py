"""Where a rank's CPU goes: the CPU time of every thread of every rank over the steady part of one
training run on the emulated cluster, per step, and with ``--perf`` rank 1's CPU by shared library.

    python -m experiments.rank_cpu --scheme compute_sync --name rank_cpu_floor
    python -m experiments.rank_cpu --scheme ssfusion --overrides '{"density": 0.01, "memory": "dgc"}' --perf \\
        --name rank_cpu_ssfusion_dgc

A step-time ratio says that a scheme costs more; this says on which thread, in which library
(the interpreter, torch's operators, the allocator, the kernel) and, with ``--pyspy``, in which of the
engine's steps (rank 1 sampled with py-spy, ``pip install py-spy``: the share of its samples inside each
of the engine's functions, its hooks' work in the backward and its ``finish`` after it). Four ranks on two cores make every
millisecond of a rank's CPU about two of the step, so this is where the step goes there.

The run is one bench_e2e world (experiments/e2e_worker.py, the time-to-accuracy workloads
included); the threads are read from /proc over ``--span`` seconds once ``--settle`` seconds have
passed since the ranks started. Threads: the main thread (forward, backward with its hooks, the
engine's work at the launch and the wait, the optimizer), gloo's (its TCP loop and its async-work
loops), and any other (the engine's channel and offload workers).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from experiments.bench_e2e import run_world
from experiments.common import publish_md

GLOO_THREADS = ("gloo_tcp_loop", "pt_gloo_runloop")


def thread_cpu(pids: list[int]) -> dict[tuple[int, int], tuple[str, float]]:
    """(pid, tid) -> (thread name, CPU seconds so far) of every thread of ``pids``."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for pid in pids:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
            except OSError:
                continue
            name = stat[stat.index("(") + 1 : stat.rindex(")")]
            fields = stat[stat.rindex(")") + 2 :].split()
            out[(pid, int(tid))] = (name, (int(fields[11]) + int(fields[12])) / tick)
    return out


def thread_kind(pid: int, tid: int, name: str) -> str:
    if tid == pid:
        return "main thread"
    return "gloo threads" if name in GLOO_THREADS else "other threads (engine workers)"


def perf_by_library(pid: int, seconds: float, workdir: Path) -> dict[str, float] | None:
    """CPU seconds per wall second of ``pid`` by shared library, from ``perf record``; None without perf."""
    if shutil.which("perf") is None:
        return None
    data = workdir / "rank.perf"
    subprocess.run(["perf", "record", "-F", "499", "-p", str(pid), "-o", str(data), "--", "sleep", str(seconds)],
                   capture_output=True, check=False)
    report = subprocess.run(["perf", "report", "-i", str(data), "-n", "--sort", "dso", "--stdio"],
                            capture_output=True, text=True, check=False).stdout
    samples = {}
    for line in report.splitlines():
        parts = line.split()
        if len(parts) >= 3 and parts[0].endswith("%") and parts[1].isdigit():
            library = " ".join(parts[2:])
            if library.startswith("[JIT]"):
                library = "[JIT] (generated code: oneDNN's kernels)"
            samples[library] = samples.get(library, 0.0) + int(parts[1]) / 499 / seconds
    return samples


#: where a function's samples count: the engine's, the memories', the sparsifiers' and the policies' own
ENGINE_MODULES = ("ssfusion_lightning/engine/", "ssfusion_lightning/sparsifiers/", "ssfusion_lightning/fusion/",
                  "ssfusion_lightning/comm/", "ssfusion_lightning/strategy.py")


def _counted(name: str, where: str) -> bool:
    """A frame the table lists: the engine's (and the strategy's, whose ``training_step`` holds the
    forward), autograd's backward, and the optimizer's arithmetic (not its ``step``, inside which
    Lightning runs the whole closure)."""
    if any(module in where for module in ENGINE_MODULES) or name == "_engine_run_backward":
        return True
    wrappers = ("/optimizer.py", "lr_scheduler.py")
    return "torch/optim/" in where and not any(w in where for w in wrappers) and not name.endswith("step")


def pyspy_by_function(pid: int, seconds: float, workdir: Path, rate: int = 250, keep: Path | None = None) -> dict[str, float] | None:
    """Share of ``pid``'s samples (every thread) inside each engine function, inclusive, from
    ``py-spy record``; None without py-spy. ``keep``: where py-spy's raw stacks are copied (for line-level reading)."""
    if shutil.which("py-spy") is None:
        return None
    raw = workdir / "rank.pyspy"
    subprocess.run(["py-spy", "record", "-d", str(int(seconds)), "-r", str(rate), "-p", str(pid), "-f", "raw", "-o", str(raw),
                    "--nonblocking", "--full-filenames"], capture_output=True, check=False)
    if keep is not None and raw.exists():
        shutil.copyfile(raw, keep)
    return shares_by_function(raw.read_text()) if raw.exists() else None


def shares_by_function(raw: str) -> dict[str, float] | None:
    """py-spy's raw output (a stack of frames and its sample count a line) -> the share of the samples
    inside each listed function (``_counted``), a stack counting once per function however deep it nests."""
    inside: dict[str, int] = defaultdict(int)
    total = 0
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        total += int(count)
        names = set()
        for frame in stack.split(";"):
            name, _, where = frame.partition(" (")
            if _counted(name, where):
                names.add(name)
        for name in names:
            inside[name] += int(count)
    return {name: count / total for name, count in inside.items()} if total else None


def sample(spec: Path, settle: float, span: float, with_perf: bool, workdir: Path, box: dict[str, Any],
           with_pyspy: bool = False, keep: Path | None = None) -> None:
    """Find the ranks of ``spec``, wait ``settle`` s, then read their threads over ``span`` s."""
    pids: list[int] = []
    deadline = time.monotonic() + 120
    while len(pids) < box["world"] and time.monotonic() < deadline:
        found = subprocess.run(["pgrep", "-f", f"experiments.e2e_worker {spec}"], capture_output=True, text=True).stdout
        pids = sorted(int(p) for p in found.split())
        time.sleep(0.5)
    time.sleep(settle)
    before, started = thread_cpu(pids), time.monotonic()
    perf = pyspy = None
    if with_perf and len(pids) > 1:
        perf = perf_by_library(pids[1], span, workdir)
    if with_pyspy and len(pids) > 1:
        pyspy = pyspy_by_function(pids[1], max(1.0, span - (time.monotonic() - started)), workdir, keep=keep)  # after --perf's share
    time.sleep(max(0.0, span - (time.monotonic() - started)))
    after, wall = thread_cpu(pids), time.monotonic() - started
    per_kind: dict[str, float] = defaultdict(float)
    for key, (name, seconds) in after.items():
        if key in before:
            per_kind[thread_kind(key[0], key[1], name)] += (seconds - before[key][1]) / wall / len(pids)
    box.update(per_kind=dict(per_kind), perf=perf, pyspy=pyspy, ranks=len(pids))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scheme", default="ssfusion", help="an e2e_worker scheme (compute_sync, ddp, ddp_powersgd4, ssfusion, ...)")
    parser.add_argument("--overrides", type=json.loads, default={}, help="engine options of an engine scheme, as JSON")
    parser.add_argument("--workload", default="digits")
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--rate", default="40mbit")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--settle", type=float, default=30.0, help="seconds after the ranks start before reading")
    parser.add_argument("--span", type=float, default=12.0, help="seconds the threads are read over")
    parser.add_argument("--perf", action="store_true", help="also rank 1's CPU by shared library (perf record)")
    parser.add_argument("--pyspy", action="store_true", help="also rank 1's samples by engine function (py-spy record)")
    parser.add_argument("--pyspy-raw", type=Path, default=None, help="with --pyspy: copy py-spy's raw stacks (with line numbers) here")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--nice", type=int, default=-5)
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--name", default=None, help="write results/<name>.md")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    args.quick, args.delay = False, None

    run = {"workload": args.workload, "rep": 0, "seed": args.seed, "steps": args.steps, "equal_steps": args.steps,
           "warmup": 0, "eval": False, "eval_at": [], "scheme": args.scheme, "label": args.scheme,
           "density": args.overrides.get("density")}
    if args.overrides:
        run["overrides"] = args.overrides
    with tempfile.TemporaryDirectory(prefix="rank_cpu_") as tmp:
        workdir = Path(tmp)
        box: dict[str, Any] = {"world": args.world}
        sampler = threading.Thread(target=sample, args=(workdir / f"P{args.world}" / "spec.json", args.settle, args.span,
                                                        args.perf, workdir, box, args.pyspy, args.pyspy_raw), daemon=True)
        sampler.start()
        runs = run_world(args.world, [{"label": args.rate, "runs": [run]}], args, workdir)
        sampler.join(timeout=60)
    if not runs or "per_kind" not in box:
        print("no run or no thread reading (is --settle + --span shorter than the run?)")
        return 1
    record = runs[0]
    skip = min(30, len(record["step_seconds"]) // 3)
    step = statistics.median(record["step_seconds"][skip:])
    cpu = statistics.median(record["step_cpu_seconds"][skip:])
    lines = [f"{args.scheme} {json.dumps(args.overrides) if args.overrides else ''}, {args.workload}, P = {args.world}, "
             f"{args.rate}: step {step * 1e3:.1f} ms, rank 0's CPU {cpu * 1e3:.1f} ms a step (medians after step {skip})",
             "", "| threads (mean over ranks) | CPU ms a step |", "|---|---:|"]
    for kind, share in sorted(box["per_kind"].items(), key=lambda item: -item[1]):
        lines.append(f"| {kind} | {share * step * 1e3:.1f} |")
    if box.get("perf"):
        lines += ["", "| rank 1, by library | CPU ms a step |", "|---|---:|"]
        for library, share in sorted(box["perf"].items(), key=lambda item: -item[1]):
            if share * step * 1e3 >= 0.1:
                lines.append(f"| {library} | {share * step * 1e3:.1f} |")
    if box.get("pyspy"):
        lines += ["", "| rank 1, inside (py-spy samples, every thread; nested functions count in each) | share | ms a step |",
                  "|---|---:|---:|"]
        for name, share in sorted(box["pyspy"].items(), key=lambda item: -item[1]):
            if share >= 0.005:
                lines.append(f"| {name} | {100 * share:.1f}% | {share * step * 1e3:.1f} |")
    text = "\n".join(lines)
    if args.name:
        publish_md(text, args.name, args.out)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
