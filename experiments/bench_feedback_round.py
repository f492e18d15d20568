"""Micro-benchmark of one error-feedback round per memory: ``compensate_many`` and ``update_many``
over a workload's large tensors (those of at least 4096 elements, what a selective plan sparsifies),
1% of each tensor's positions sent, one intra-op thread, random gradients. ``--slots dense``: the
dense round of its small tensors instead (``compensate_dense_many`` and ``settle_dense_many``, what a
plan does with the tensors it sends whole).

    python -m experiments.bench_feedback_round --workload gpt2_10m
    python -m experiments.bench_feedback_round --workload text --slots dense
    python -m experiments.bench_feedback_round --workload gpt2 --rounds 5      # smoke run
    python -m experiments.bench_feedback_round --workload resnet18 --memories dgc --compensate engine

``--compensate engine`` compensates the sparse tensors as the engine's hooks do on the host (one at a
time from ``HOST_BATCH_BELOW`` elements, a batch of those from ``BATCH_BELOW``, a batch of the
smaller ones) and commits them in one call, as the engine commits a buffer; ``whole`` (the default)
compensates them in one call.

Per memory, interleaved round by round: the median time of the compensation and of the commit, and
the minor page faults of the round (a fresh tensor the size of a transformer's weights comes as
fresh pages, which glibc's allocator returns to the kernel when it is freed). To compare two
revisions, run it in a checkout of each (``git worktree add``) alternately: results/<name>.md.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time

import torch

from experiments.common import publish_md
from experiments.e2e_worker import WORKLOADS, build_workload
from ssfusion_lightning.engine.engine import BATCH_BELOW, HOST_BATCH_BELOW
from ssfusion_lightning.sparsifiers import MEMORIES

#: the smallest tensor the ssfusion preset's selective plans sparsify on these workloads
LARGE = 4096


def build_memory(name: str, feedback: float, clip_norm: float | None):
    """``name`` with the options a run gives it: ``feedback`` for every memory that keeps a residual,
    ``clip_norm`` (DGC's local clipping) for those that clip."""
    options = {} if name == "none" else {"feedback": feedback}
    if clip_norm and name in ("adam", "dgc"):
        options["clip_norm"] = clip_norm
    return MEMORIES.build(name, **options)


def compensation_batches(grads: list[torch.Tensor], how: str) -> list[list[int]]:
    """Positions of the tensors each ``compensate_many`` call takes: all at once (``whole``), or as
    the engine's hooks on the host (``engine``)."""
    if how == "whole":
        return [list(range(len(grads)))]
    sizes = [g.numel() for g in grads]
    own = [[i] for i, n in enumerate(sizes) if n >= HOST_BATCH_BELOW]
    larger = [i for i, n in enumerate(sizes) if BATCH_BELOW <= n < HOST_BATCH_BELOW]
    small = [i for i, n in enumerate(sizes) if n < BATCH_BELOW]
    return own + [batch for batch in (larger, small) if batch]


def measure(
    workload: str,
    memories: list[str],
    rounds: int,
    slots: str = "sparse",
    feedback: float = 1.0,
    clip_norm: float | None = None,
    compensate: str = "whole",
) -> list[dict[str, float | str]]:
    torch.manual_seed(0)
    _, model, _, _ = build_workload(workload, False, 0)
    params = [(name, p) for name, p in model.named_parameters() if (p.numel() >= LARGE) == (slots == "sparse")]
    keys = [name for name, _ in params]
    grads = [torch.randn_like(p) for _, p in params]
    sent = [torch.randperm(g.numel())[: max(1, g.numel() // 100)] for g in grads]
    batches = compensation_batches(grads, compensate)
    built = {name: build_memory(name, feedback, clip_norm) for name in memories}
    for memory in built.values():  # every state exists from here on, as after a plan's first round
        memory.update_many(keys, grads, sent, verified=True)
    samples: dict[str, dict[str, list[float]]] = {name: {"compensate": [], "commit": [], "faults": []} for name in built}
    for _ in range(rounds):
        for name, memory in built.items():
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            started = time.perf_counter()
            if slots == "sparse":
                compensated = [memory.compensate_many([keys[i] for i in batch], [grads[i] for i in batch]) for batch in batches]
                compensated_at = time.perf_counter()
                memory.update_many(keys, grads, sent, verified=True)
            else:
                compensated = memory.compensate_dense_many(keys, grads)
                compensated_at = time.perf_counter()
                memory.settle_dense_many(keys, grads)
            committed_at = time.perf_counter()
            del compensated
            samples[name]["compensate"].append(compensated_at - started)
            samples[name]["commit"].append(committed_at - compensated_at)
            samples[name]["faults"].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults)
    elements = sum(g.numel() for g in grads)
    return [
        {"memory": name, "tensors": len(keys), "elements": elements,
         "compensate_ms": 1e3 * statistics.median(s["compensate"]), "commit_ms": 1e3 * statistics.median(s["commit"]),
         "faults": statistics.median(s["faults"])}
        for name, s in samples.items()
    ]


def table(rows: list[dict[str, float | str]]) -> list[str]:
    lines = ["| memory | tensors | elements | compensate ms | commit ms | round ms | minor page faults a round |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['memory']} | {r['tensors']} | {r['elements']} | {r['compensate_ms']:.2f} | {r['commit_ms']:.2f} "
                     f"| {r['compensate_ms'] + r['commit_ms']:.2f} | {r['faults']:.0f} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default="gpt2_10m", choices=sorted(WORKLOADS))
    parser.add_argument("--memories", nargs="+", default=["residual", "adam"], choices=sorted(MEMORIES.names()))
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--slots", default="sparse", choices=["sparse", "dense"],
                        help="sparse: the large tensors' sparse round; dense: the small tensors' dense round")
    parser.add_argument("--feedback", type=float, default=1.0, help="the memories' feedback (memory='auto' gives 0.9)")
    parser.add_argument("--clip-norm", type=float, default=None,
                        help="adam's and dgc's local clipping (the LM workloads' recipe clips at 1.0)")
    parser.add_argument("--compensate", default="whole", choices=["whole", "engine"],
                        help="whole: one compensate_many call; engine: the calls the engine's hooks make on the host")
    parser.add_argument("--name", default="feedback_round")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    lines = table(measure(args.workload, args.memories, args.rounds, args.slots, args.feedback, args.clip_norm, args.compensate))
    options = (f" --feedback {args.feedback}" if args.feedback != 1.0 else "") + (f" --clip-norm {args.clip_norm}" if args.clip_norm else "")
    options += f" --compensate {args.compensate}" if args.compensate != "whole" else ""
    command = (f"`python -m experiments.bench_feedback_round --workload {args.workload} --memories {' '.join(args.memories)} "
               f"--rounds {args.rounds} --slots {args.slots}{options}` (one thread; medians over the rounds, memories interleaved)")
    publish_md("\n".join([command, "", *lines]), args.name, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
