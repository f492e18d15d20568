"""Error-feedback top-k under AdamW and under SGD with momentum, on one process (issue 15's diagnosis).

    python -m experiments.ef_optimizers                 # byte-level GPT-2 tiny on the Lee corpus (realdata extra)

With P = 1 the engine's data path is: compensate (g + residual), select the top density of every
tensor, send it, keep the rest as the residual. This script runs exactly that per parameter on one
process, so that the optimizer is the only thing that changes between rows: dense and sparse, each
under AdamW and under SGD with momentum. A coordinate selected once every T steps arrives with
about T steps of gradient; SGD applies it in full, while Adam divides it by the root of its second
moment, which such bursts raise by about T, so the coordinate moves about sqrt(T) less than under
dense AdamW. The rows show whether the gap to dense follows the optimizer.

Writes results/<name>.md and .csv (validation loss after each evaluation point).
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from experiments.common import RESULTS, write_csv


def topk_with_feedback(params: list[torch.nn.Parameter], residuals: dict[int, torch.Tensor], density: float) -> None:
    """Replace every ``.grad`` by its top-``density`` after adding the residual; keep the rest."""
    for i, p in enumerate(params):
        compensated = p.grad + residuals.get(i, 0.0)
        flat = compensated.reshape(-1)
        k = max(1, math.floor(density * flat.numel()))
        keep = torch.zeros_like(flat)
        index = flat.abs().topk(k, sorted=False).indices
        keep[index] = flat[index]
        residuals[i] = (flat - keep).view_as(p.grad)
        p.grad = keep.view_as(p.grad)


def run(optimizer: str, density: float | None, steps: int, eval_every: int, lr: float, seed: int) -> list[tuple[int, float]]:
    from ssfusion_lightning.app.builders import wire_model_kwargs
    from ssfusion_lightning.data import build_datamodule
    from ssfusion_lightning.models import build_model

    torch.manual_seed(seed)
    data = build_datamodule("text", batch_size=32, seq_len=64)
    data.setup("fit")
    model = build_model("gpt2", "tiny", **wire_model_kwargs("gpt2", "tiny", {}, data))
    params = [p for p in model.parameters() if p.requires_grad]
    if optimizer == "adamw":
        opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    else:
        opt = torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=0.01)
    residuals: dict[int, torch.Tensor] = {}
    curve, step = [], 0
    while step < steps:
        for inputs, targets in data.train_dataloader():
            logits = model(inputs)
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)  # the e2e workloads' LM setting, before selection as Lightning does
            if density is not None:
                topk_with_feedback(params, residuals, density)
            opt.step()
            step += 1
            if step % eval_every == 0 or step == steps:
                curve.append((step, evaluate(model, data)))
            if step == steps:
                break
    return curve


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
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    for optimizer, lr in (("adamw", args.adamw_lr), ("sgd", args.sgd_lr)):
        for density in (None, args.density):
            started = time.perf_counter()
            curve = run(optimizer, density, args.steps, args.eval_every, lr, args.seed)
            label = "dense" if density is None else f"top-k {density * 100:g}% + error feedback"
            print(f"{optimizer:5} {label:28} " + " ".join(f"{loss:.3f}" for _, loss in curve)
                  + f"  ({time.perf_counter() - started:.0f} s)", flush=True)
            rows += [{"optimizer": optimizer, "lr": lr, "density": density or 1.0, "step": s, "val_loss": v} for s, v in curve]
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(args.out / f"{args.name}.csv", list(rows[0]), rows)
    points = sorted({r["step"] for r in rows})
    lines = [
        f"Validation loss (nats per byte) of the byte-level GPT-2 tiny on the Lee corpus, one process, "
        f"`python -m experiments.ef_optimizers --steps {args.steps} --adamw-lr {args.adamw_lr:g} --sgd-lr {args.sgd_lr:g}`.",
        "",
        "| optimizer | lr | gradient | " + " | ".join(f"step {s}" for s in points) + " |",
        "|---|---|---|" + "---|" * len(points),
    ]
    for optimizer in ("adamw", "sgd"):
        for density in (1.0, args.density):
            cells = {r["step"]: r["val_loss"] for r in rows if r["optimizer"] == optimizer and r["density"] == density}
            label = "dense" if density == 1.0 else f"top-k {density * 100:g}% + error feedback"
            lr = args.adamw_lr if optimizer == "adamw" else args.sgd_lr
            lines.append(f"| {optimizer} | {lr:g} | {label} | " + " | ".join(f"{cells[s]:.3f}" for s in points) + " |")
    (args.out / f"{args.name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
