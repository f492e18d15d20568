"""Error-feedback top-k under AdamW and under SGD with momentum, on one process (issue 15's diagnosis).

    python -m experiments.ef_optimizers                 # byte-level GPT-2 tiny on the Lee corpus (realdata extra)

With P = 1 the engine's data path is: compensate (g + residual), select the top density of every
tensor, send it, keep the rest as the residual. This script runs exactly that per parameter on one
process, so that the optimizer is the only thing that changes between rows: dense and sparse, each
under AdamW and under SGD with momentum. A coordinate selected once every T steps arrives with
about T steps of gradient; SGD applies it in full, while Adam divides it by the root of its second
moment, which such bursts raise by about T, so the coordinate moves about sqrt(T) less than under
dense AdamW. The rows show whether the gap to dense follows the optimizer.

``--recipes`` adds AdamW rows that change one part of the sparse recipe at a time: dense steps
before selection starts (the engine's ``warmup_steps``), and some tensors sent whole every step
(by parameter name: the tied byte embedding, which is also the output layer; the LayerNorms and
biases), so that the rows show which part of the model the selection starves.

``--update-rows`` adds rows that move the selection behind the optimizer: each step AdamW's update
(its moments kept from the local dense gradient) is computed first, and the top density of update
plus residual is applied, the rest kept as the residual. Every coordinate then moves by its whole
update, late, instead of by a burst that Adam's second moment shrinks.

Writes results/<name>.md and .csv (validation loss after each evaluation point).
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from experiments.common import RESULTS, write_csv

#: the --recipes rows: label -> (dense steps before selection starts, name fragments of tensors sent whole)
RECIPES: dict[str, tuple[int, tuple[str, ...]]] = {
    "dense warm-up 30 steps": (30, ()),
    "dense warm-up 100 steps": (100, ()),
    "embedding sent dense": (0, ("embed",)),
    "LayerNorms and biases sent dense": (0, ("norm", "bias")),
    "embedding, LayerNorms and biases sent dense": (0, ("embed", "norm", "bias")),
    "dense warm-up 30 steps + embedding, LayerNorms and biases dense": (30, ("embed", "norm", "bias")),
}


def topk_with_feedback(params: list[torch.nn.Parameter], residuals: dict[int, torch.Tensor], density: float,
                       dense: frozenset[int] = frozenset()) -> None:
    """Replace every ``.grad`` by its top-``density`` after adding the residual; keep the rest.
    The tensors in ``dense`` are sent whole (they keep no residual)."""
    for i, p in enumerate(params):
        if i in dense:
            continue
        compensated = p.grad + residuals.get(i, 0.0)
        flat = compensated.reshape(-1)
        k = max(1, math.floor(density * flat.numel()))
        keep = torch.zeros_like(flat)
        index = flat.abs().topk(k, sorted=False).indices
        keep[index] = flat[index]
        residuals[i] = (flat - keep).view_as(p.grad)
        p.grad = keep.view_as(p.grad)


class SparseAdamWUpdate:
    """AdamW whose update, not the gradient, goes through top-k with error feedback."""

    def __init__(self, params: list[torch.nn.Parameter], lr: float, density: float, weight_decay: float = 0.01,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8) -> None:
        self.params, self.lr, self.density, self.weight_decay, self.betas, self.eps = params, lr, density, weight_decay, betas, eps
        self.moments = [(torch.zeros_like(p), torch.zeros_like(p)) for p in params]
        self.residuals = [torch.zeros_like(p) for p in params]
        self.steps = 0

    @torch.no_grad()
    def step(self, dense: bool = False) -> None:
        self.steps += 1
        beta1, beta2 = self.betas
        for p, (m, v), residual in zip(self.params, self.moments, self.residuals):
            m.mul_(beta1).add_(p.grad, alpha=1 - beta1)
            v.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
            update = self.lr * (m / (1 - beta1**self.steps)) / ((v / (1 - beta2**self.steps)).sqrt() + self.eps)
            p.mul_(1 - self.lr * self.weight_decay)
            if dense:
                p.sub_(update)
                continue
            compensated = (update + residual).reshape(-1)
            index = compensated.abs().topk(max(1, math.floor(self.density * compensated.numel())), sorted=False).indices
            kept = torch.zeros_like(compensated)
            kept[index] = compensated[index]
            residual.copy_((compensated - kept).view_as(p))
            p.sub_(kept.view_as(p))


def train_lm(seed: int, steps: int, eval_every: int,
             stepper: Callable[[list[tuple[str, torch.nn.Parameter]]], Callable[[int], None]]) -> list[tuple[int, float]]:
    """Train the byte-level GPT-2 tiny on the Lee corpus and return its validation curve.
    ``stepper(named parameters)`` gives the function that applies step ``i`` (from 0) once the
    gradients are computed and clipped."""
    from ssfusion_lightning.app.builders import wire_model_kwargs
    from ssfusion_lightning.data import build_datamodule
    from ssfusion_lightning.models import build_model

    torch.manual_seed(seed)
    data = build_datamodule("text", batch_size=32, seq_len=64)
    data.setup("fit")
    model = build_model("gpt2", "tiny", **wire_model_kwargs("gpt2", "tiny", {}, data))
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    apply_step = stepper(named)
    curve, step = [], 0
    while step < steps:
        for inputs, targets in data.train_dataloader():
            logits = model(inputs)
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
            for p in params:
                p.grad = None
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)  # the e2e workloads' LM setting, before selection as Lightning does
            apply_step(step)
            step += 1
            if step % eval_every == 0 or step == steps:
                curve.append((step, evaluate(model, data)))
            if step == steps:
                break
    return curve


def run(optimizer: str, density: float | None, steps: int, eval_every: int, lr: float, seed: int,
        dense_steps: int = 0, dense_names: tuple[str, ...] = ()) -> list[tuple[int, float]]:
    def stepper(named: list[tuple[str, torch.nn.Parameter]]) -> Callable[[int], None]:
        params = [p for _, p in named]
        dense = frozenset(i for i, (n, _) in enumerate(named) if any(part in n for part in dense_names))
        if optimizer == "adamw-update":
            opt = SparseAdamWUpdate(params, lr, density)
            return lambda step: opt.step(dense=step < dense_steps)
        if optimizer == "adamw":
            opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
        else:
            opt = torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=0.01)
        residuals: dict[int, torch.Tensor] = {}

        def apply_step(step: int) -> None:
            if density is not None and step >= dense_steps:
                topk_with_feedback(params, residuals, density, dense)
            opt.step()

        return apply_step

    return train_lm(seed, steps, eval_every, stepper)


@torch.no_grad()
def evaluate(model: torch.nn.Module, data) -> float:
    model.eval()
    total, count = 0.0, 0
    for inputs, targets in data.val_dataloader():
        logits = model(inputs)
        total += float(F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="sum"))
        count += int((targets != -100).sum())
    model.train()
    return total / max(1, count)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument("--adamw-lr", type=float, default=3e-3)
    parser.add_argument("--sgd-lr", type=float, default=0.3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--name", default="ef_optimizers", help="file stem")
    parser.add_argument("--recipes", action="store_true", help="add the AdamW rows of RECIPES")
    parser.add_argument("--update-rows", action="store_true",
                        help="add rows that select AdamW's update instead of the gradient (no warm-up, 30 and 100 dense steps)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    sparse = f"top-k {args.density * 100:g}% + error feedback"
    cases = [(optimizer, lr, density, "dense" if density is None else sparse, 0, ())
             for optimizer, lr in (("adamw", args.adamw_lr), ("sgd", args.sgd_lr)) for density in (None, args.density)]
    if args.recipes:
        cases[2:2] = [("adamw", args.adamw_lr, args.density, f"{sparse}, {label}", steps, names)
                      for label, (steps, names) in RECIPES.items()]
    if args.update_rows:
        update = f"AdamW's update: top-k {args.density * 100:g}% + error feedback"
        cases[2:2] = [("adamw-update", args.adamw_lr, args.density, update + (f", dense warm-up {steps} steps" if steps else ""),
                       steps, ()) for steps in (0, 30, 100)]
    rows = []
    for optimizer, lr, density, label, dense_steps, dense_names in cases:
        started = time.perf_counter()
        curve = run(optimizer, density, args.steps, args.eval_every, lr, args.seed, dense_steps, dense_names)
        print(f"{optimizer:5} {label:40} " + " ".join(f"{loss:.3f}" for _, loss in curve)
              + f"  ({time.perf_counter() - started:.0f} s)", flush=True)
        rows += [{"optimizer": optimizer, "lr": lr, "density": density or 1.0, "gradient": label, "step": s, "val_loss": v}
                 for s, v in curve]
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(args.out / f"{args.name}.csv", list(rows[0]), rows)
    points = sorted({r["step"] for r in rows})
    lines = [
        f"Validation loss (nats per byte) of the byte-level GPT-2 tiny on the Lee corpus, one process, "
        f"`python -m experiments.ef_optimizers --steps {args.steps} --adamw-lr {args.adamw_lr:g} --sgd-lr {args.sgd_lr:g}"
        + (" --recipes" if args.recipes else "") + (" --update-rows" if args.update_rows else "")
        + (f" --name {args.name}" if args.name != "ef_optimizers" else "") + "`.",
        "",
        "| optimizer | lr | gradient | " + " | ".join(f"step {s}" for s in points) + " |",
        "|---|---|---|" + "---|" * len(points),
    ]
    for optimizer, lr, _, label, _, _ in cases:
        cells = {r["step"]: r["val_loss"] for r in rows if r["optimizer"] == optimizer and r["gradient"] == label}
        lines.append(f"| {optimizer} | {lr:g} | {label} | " + " | ".join(f"{cells[s]:.3f}" for s in points) + " |")
    (args.out / f"{args.name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
