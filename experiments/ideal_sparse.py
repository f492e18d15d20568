"""The compression algorithms without the engine: how many steps top-k with error feedback needs.

Time to accuracy is steps x step time. The engine decides the step time; the steps are decided by
the algorithm (which elements are sent, how error feedback and momentum treat the rest). This script
measures the steps alone: P workers simulated in one process, each computing its gradient on its own
shard (as ``DistributedSampler`` gives a rank), combined exactly as the schemes define it, on the
digits CNN of ``bench_tta`` with its optimizer. Nothing is communicated and nothing is timed, so the
numbers do not depend on the host's load, and no engine detail (sampled thresholds, fusion plans,
the selective policy's measured choices) can move them:

- ``dense``: the mean gradient (DDP);
- ``topk``: exact top-k per tensor at ``density`` of (gradient + residual), residual error feedback,
  the optimizer's momentum on the mean sparse gradient (``memory="residual"``); tensors of at most
  ``--dense-below`` elements go whole (the ``selective`` policy's small tensors);
- ``topk_mc``: the same selection with DGC's momentum correction and factor masking
  (``memory="dgc"``: u = m u + g, v = v + u, select from v, zero u and v where sent; the optimizer's
  momentum moves into u, dense tensors send u: momentum SGD);
- ``global`` and ``global_mc``: the same two memories with one top-k over all the sparse tensors
  together (k = density x their elements, as ``fusion="behind"`` selects over a whole buffer), so a
  layer whose gradients are larger gets more of the budget;
- ``--feedback f`` (default 1) keeps only f of the unsent part (e, or v under momentum correction),
  as ``memory="adam"``'s option does for Adam's update;
- ``powersgd``: PowerSGD with error feedback and warm start at rank ``--rank`` (matrices whose
  compression would not halve them, and 1-D tensors, go whole, as in PyTorch's hook; compression
  starts at step 2 as in the benchmark).

Per seed, the target is the ``dense`` run's accuracy after ``--steps``, as in ``bench_tta``; every
scheme runs up to ``--budget-factor`` times as many steps. BatchNorm statistics follow worker 0
(DDP broadcasts rank 0's buffers before every forward).

    python -m experiments.ideal_sparse --seeds 0 1 2 3 4 5 --name ideal_sparse
"""

from __future__ import annotations

import argparse
import math
import statistics
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.data import DataLoader, DistributedSampler

from experiments.common import RESULTS, pyplot, read_csv, read_jsonl, save_figure, write_csv, write_jsonl

SCHEMES = ("dense", "topk", "topk_mc", "global", "global_mc", "powersgd")


def build(seed: int, batch_size: int) -> tuple[torch.nn.Module, Any, torch.optim.Optimizer]:
    import lightning as L

    from experiments.e2e_worker import build_workload
    from ssfusion_lightning.models.tasks.optim import build_optimizer

    L.seed_everything(seed, verbose=False)
    spec, model, _task, datamodule = build_workload("digits", False, seed)
    datamodule.batch_size = batch_size
    datamodule.setup("fit")
    task = spec["task"]
    optimizer = build_optimizer(model, task["optimizer"], task["lr"], task["weight_decay"], task["momentum"])
    return model, datamodule, optimizer


def shard_batches(datamodule: Any, workers: int, seed: int) -> list[Callable[[], tuple[Tensor, Tensor]]]:
    """Per worker, an endless stream of its shard's batches (a new shuffle each epoch)."""
    dataset = datamodule.build_dataset("train")
    streams = []
    for rank in range(workers):
        sampler = DistributedSampler(dataset, num_replicas=workers, rank=rank, shuffle=True, seed=seed, drop_last=False)
        loader = DataLoader(dataset, batch_size=datamodule.batch_size, sampler=sampler, drop_last=True)
        streams.append(_endless(loader, sampler))
    return [lambda it=it: next(it) for it in streams]


def _endless(loader: DataLoader, sampler: DistributedSampler):
    epoch = 0
    while True:
        sampler.set_epoch(epoch)
        yield from loader
        epoch += 1


@torch.no_grad()
def evaluate(model: torch.nn.Module, datamodule: Any) -> float:
    model.eval()
    correct = count = 0
    for inputs, targets in datamodule.val_dataloader():
        correct += int((model(inputs).argmax(-1) == targets).sum())
        count += int(targets.numel())
    model.train()
    return correct / count


class Combiner:
    """One scheme's rule: the P workers' gradients of every parameter -> the gradients the optimizer sees."""

    def __init__(self, scheme: str, density: float, dense_below: int, rank: int, momentum: float, feedback: float = 1.0) -> None:
        self.scheme, self.density, self.dense_below, self.rank, self.momentum = scheme, density, dense_below, rank, momentum
        self.feedback = feedback
        self.corrected = scheme.endswith("_mc")
        self.state: dict[tuple[int, int], dict[str, Tensor]] = {}
        self.sent = 0
        self.elements = 0

    def __call__(self, per_worker: list[list[Tensor]], step: int) -> list[Tensor]:
        if self.scheme == "dense":
            return [torch.stack(grads).mean(0) for grads in zip(*per_worker)]
        if self.scheme == "powersgd":
            return [self._powersgd(index, list(grads), step) for index, grads in enumerate(zip(*per_worker))]
        totals = [torch.zeros(g.numel(), dtype=g.dtype) for g in per_worker[0]]
        for worker, grads in enumerate(per_worker):
            compensated = [self._compensate(index, worker, g.reshape(-1)) for index, g in enumerate(grads)]
            sparse = [i for i, c in enumerate(compensated) if c.numel() > self.dense_below]
            for i, c in enumerate(compensated):
                if i not in sparse:
                    totals[i] += c
                    self._settle_dense(i, worker, c)
            for i, positions in self._select([compensated[i] for i in sparse], sparse).items():
                totals[i][positions] += compensated[i][positions]
                self._settle_sparse(i, worker, compensated[i], positions)
                self.sent += positions.numel()
            self.elements += sum(compensated[i].numel() for i in sparse)
        return [(t / len(per_worker)).view_as(g) for t, g in zip(totals, per_worker[0])]

    def _compensate(self, index: int, worker: int, flat: Tensor) -> Tensor:
        state = self.state.setdefault((index, worker), {})
        if self.corrected:  # u = m u + g; v = v + u
            state["u"] = state.get("u", torch.zeros_like(flat)).mul(self.momentum).add_(flat)
            return state.get("v", torch.zeros_like(flat)).add(state["u"])
        return state.get("e", torch.zeros_like(flat)).add(flat)

    def _settle_dense(self, index: int, worker: int, sent: Tensor) -> None:
        state = self.state[(index, worker)]
        state["v" if self.corrected else "e"] = torch.zeros_like(sent)  # u goes on unmasked: momentum SGD

    def _settle_sparse(self, index: int, worker: int, compensated: Tensor, positions: Tensor) -> None:
        state = self.state[(index, worker)]
        compensated[positions] = 0
        if self.feedback != 1.0:
            compensated.mul_(self.feedback)
        if self.corrected:  # momentum factor masking
            state["u"][positions] = 0
            state["v"] = compensated
        else:
            state["e"] = compensated

    def _select(self, tensors: list[Tensor], indices: list[int]) -> dict[int, Tensor]:
        """Per tensor its own k = floor(density n) largest; ``global*``: the k largest of all of them
        together, k = floor(density x their elements), wherever they fall."""
        if not self.scheme.startswith("global"):
            return {i: t.abs().topk(max(1, math.floor(self.density * t.numel())), sorted=False).indices
                    for i, t in zip(indices, tensors)}
        flat = torch.cat(tensors)
        chosen = flat.abs().topk(max(1, math.floor(self.density * flat.numel())), sorted=False).indices.sort().values
        bounds = torch.tensor([0] + [t.numel() for t in tensors]).cumsum(0)
        cuts = torch.searchsorted(chosen, bounds).tolist()
        return {i: chosen[cuts[j] : cuts[j + 1]] - bounds[j] for j, i in enumerate(indices)}

    def _powersgd(self, index: int, grads: list[Tensor], step: int) -> Tensor:
        shape = grads[0].shape
        rows, cols = shape[0], grads[0].numel() // max(1, shape[0])
        rank = min(self.rank, rows, cols)
        if grads[0].dim() < 2 or step < 2 or (rows + cols) * rank * 2 > rows * cols:
            return torch.stack(grads).mean(0)
        matrices = []
        for worker, grad in enumerate(grads):
            state = self.state.setdefault((index, worker), {})
            matrices.append(grad.reshape(rows, cols) + state.get("e", torch.zeros(rows, cols, dtype=grad.dtype)))
        shared = self.state.setdefault((index, -1), {})
        if "q" not in shared:
            generator = torch.Generator().manual_seed(index)
            shared["q"] = torch.randn(cols, rank, generator=generator).to(grads[0].dtype)
        q = shared["q"]
        p = torch.stack([m @ q for m in matrices]).mean(0)
        p, _ = torch.linalg.qr(p)
        q = torch.stack([m.T @ p for m in matrices]).mean(0)
        shared["q"] = q
        approx = p @ q.T
        for worker, matrix in enumerate(matrices):
            self.state[(index, worker)]["e"] = matrix - approx
        return approx.view(shape)


def run(scheme: str, seed: int, args: argparse.Namespace, steps: int) -> list[dict[str, Any]]:
    model, datamodule, optimizer = build(seed, args.batch_size)
    momentum = optimizer.param_groups[0]["momentum"]
    if scheme == "topk_mc":
        for group in optimizer.param_groups:
            group["momentum"] = 0.0
    combine = Combiner(scheme, args.density, args.dense_below, args.rank, momentum, args.feedback)
    batches = shard_batches(datamodule, args.workers, seed)
    params = [p for p in model.parameters() if p.requires_grad]
    buffers = [b for b in model.buffers()]
    curve = []
    for step in range(1, steps + 1):
        start = [b.clone() for b in buffers]
        per_worker, kept = [], None
        for worker, next_batch in enumerate(batches):
            for b, s in zip(buffers, start):
                b.copy_(s)
            inputs, targets = next_batch()
            model.zero_grad(set_to_none=True)
            F.cross_entropy(model(inputs), targets).backward()
            per_worker.append([p.grad.detach().clone() for p in params])
            if worker == 0:
                kept = [b.clone() for b in buffers]
        for b, k in zip(buffers, kept):
            b.copy_(k)
        for p, grad in zip(params, combine(per_worker, step - 1)):
            p.grad = grad
        optimizer.step()
        if step % args.eval_every == 0 or step == steps:
            curve.append({"scheme": scheme, "seed": seed, "step": step, "val_acc": evaluate(model, datamodule),
                          "effective_density": combine.sent / combine.elements if combine.elements else 1.0})
    return curve


def steps_to(curve: list[dict[str, Any]], target: float) -> int | None:
    return next((point["step"] for point in curve if point["val_acc"] >= target), None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--schemes", nargs="+", default=list(SCHEMES), choices=SCHEMES)
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument("--dense-below", type=int, default=256, help="tensors of at most this many elements go whole")
    parser.add_argument("--rank", type=int, default=4, help="PowerSGD's matrix rank")
    parser.add_argument("--steps", type=int, default=150, help="dense steps; the target is its final accuracy")
    parser.add_argument("--budget-factor", type=float, default=2.0)
    parser.add_argument("--feedback", type=float, default=1.0,
                        help="fraction of the unsent part the top-k schemes keep (e, or v with momentum correction)")
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--name", default="ideal_sparse")
    parser.add_argument("--merge", nargs="+", help="instead of running: merge these launches' records into --name")
    args = parser.parse_args(argv)
    if args.merge:
        return merge(args)
    torch.set_num_threads(1)

    curves: list[dict[str, Any]] = []
    rows = []
    for seed in args.seeds:
        dense = run("dense", seed, args, args.steps)
        target = dense[-1]["val_acc"]
        curves += dense
        for scheme in args.schemes:
            curve = dense if scheme == "dense" else run(scheme, seed, args, round(args.steps * args.budget_factor))
            if scheme != "dense":
                curves += curve
            at_equal = next(p["val_acc"] for p in curve if p["step"] == args.steps)
            rows.append({"seed": seed, "scheme": scheme, "target": target, "steps_to_target": steps_to(curve, target),
                         "acc_at_equal_steps": at_equal, "effective_density": curve[-1]["effective_density"]})
            print(rows[-1], flush=True)

    write_jsonl(RESULTS / f"{args.name}_curve.jsonl", curves)
    write_csv(RESULTS / f"{args.name}.csv", list(rows[0]), rows)
    summarize(rows, curves, args)
    return 0


def summarize(rows: list[dict[str, Any]], curves: list[dict[str, Any]], args: argparse.Namespace) -> None:
    seeds = sorted({r["seed"] for r in rows})
    kept = f", {args.feedback:g} of the unsent part kept" if args.feedback != 1.0 else ""
    lines = [f"P = {args.workers} simulated workers, density {args.density:g}{kept}, PowerSGD rank {args.rank}, "
             f"target: dense's accuracy after {args.steps} steps; seeds {seeds}", "",
             "| scheme | steps to target (per seed) | median | reached | accuracy - dense's at equal steps, median |",
             "|---|---|---:|---:|---:|"]
    for scheme in args.schemes:
        mine = sorted((r for r in rows if r["scheme"] == scheme), key=lambda r: r["seed"])
        reached = [r["steps_to_target"] for r in mine if r["steps_to_target"] is not None]
        # a seed that never reaches the target counts as the budget's end plus one evaluation
        padded = [r["steps_to_target"] or round(args.steps * args.budget_factor) + args.eval_every for r in mine]
        gaps = [100 * (r["acc_at_equal_steps"] - r["target"]) for r in mine]
        lines.append(f"| {scheme} | {', '.join(str(r['steps_to_target'] or '-') for r in mine)} | "
                     f"{statistics.median(padded):g} | {len(reached)} of {len(mine)} | {statistics.median(gaps):+.2f} |")
    (RESULTS / f"{args.name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    plot(curves, args)


def merge(args: argparse.Namespace) -> int:
    """One table and plot from the records of several launches (``--merge NAME ...``: seeds run apart)."""
    rows, curves, seen = [], [], set()
    for name in args.merge:
        for row in read_csv(RESULTS / f"{name}.csv"):
            if (row["seed"], row["scheme"]) not in seen:  # each launch runs its own dense reference
                rows.append({**row, "seed": int(row["seed"]), "target": float(row["target"]),
                             "steps_to_target": int(row["steps_to_target"]) if row["steps_to_target"] else None,
                             "acc_at_equal_steps": float(row["acc_at_equal_steps"])})
        seen |= {(str(r["seed"]), r["scheme"]) for r in rows}
        points = {(c["scheme"], c["seed"], c["step"]) for c in curves}
        curves += [c for c in read_jsonl(RESULTS / f"{name}_curve.jsonl") if (c["scheme"], c["seed"], c["step"]) not in points]
    write_jsonl(RESULTS / f"{args.name}_curve.jsonl", curves)
    write_csv(RESULTS / f"{args.name}.csv", list(rows[0]), rows)
    summarize(rows, curves, args)
    return 0


def plot(curves: list[dict[str, Any]], args: argparse.Namespace) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for scheme in args.schemes:
        points: dict[int, list[float]] = {}
        for point in curves:
            if point["scheme"] == scheme:
                points.setdefault(point["step"], []).append(100 * point["val_acc"])
        steps = sorted(points)
        ax.plot(steps, [statistics.median(points[s]) for s in steps], label=scheme, marker=".")
    ax.set_xlabel("step")
    ax.set_ylabel("validation accuracy, median over seeds (%)")
    ax.set_ylim(0, 100)
    ax.grid(alpha=0.3)
    ax.legend()
    kept = f", top-k keeps {args.feedback:g} of the unsent part" if args.feedback != 1.0 else ""
    ax.set_title(f"digits CNN, {args.workers} simulated workers, no engine{kept}")
    save_figure(fig, RESULTS / f"{args.name}.png")


if __name__ == "__main__":
    raise SystemExit(main())
