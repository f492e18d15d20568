"""What holds the byte-level LM on its plateau under sparse updates (issue 15's open question).

    python -m experiments.lm_plateau --density 0.01 --steps 300    # realdata extra; one process, ~30 s a row

One process, AdamW whose update (moments from the dense gradient) goes through a selection with
error feedback, as ``memory="adam"`` does at P = 1; the rows marked "gradient" select the gradient
before AdamW instead, as the default ``memory="residual"`` does. Each row changes one thing, so that the rows
separate the candidate causes:

- which coordinates are sent: the largest (top-k) or a uniform random draw of the same count;
- how much of the unsent part is kept: all of it (error feedback), a fraction, or none;
- the backlog of the first steps: the residual dropped once at a given step;
- the size of the first updates: a linear learning-rate warm-up, on the dense and the sparse run;
- the size of what a selected entry carries: a cap on each sent entry (the rest stays in the
  residual, so nothing is lost).

The last column is the mean size of a sent entry of the update, in steps of learning rate: dense
AdamW moves each entry by about one a step.

Writes results/<name>.md, .csv (validation loss after each evaluation point) and .png.
"""

from __future__ import annotations

import argparse
import csv
import math
import multiprocessing
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from experiments.common import RESULTS, pyplot, save_figure, write_csv
from experiments.ef_optimizers import train_lm


@dataclass(frozen=True)
class Variant:
    """One row: how the update is selected and what happens to the rest."""

    label: str
    density: float | None = None
    selection: str = "topk"
    feedback: float = 1.0
    domain: str = "update"
    dense_steps: int = 0
    drop_residual_at: int | None = None
    lr_warmup: int = 0
    send_cap: float | None = None


class SelectedAdamW:
    """AdamW whose bias-corrected update plus residual is selected per tensor before it is applied."""

    def __init__(self, params: list[torch.nn.Parameter], lr: float, variant: Variant, seed: int,
                 weight_decay: float = 0.01, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8) -> None:
        self.params, self.lr, self.variant = params, lr, variant
        self.weight_decay, self.betas, self.eps = weight_decay, betas, eps
        self.moments = [(torch.zeros_like(p), torch.zeros_like(p)) for p in params]
        self.residuals = [torch.zeros_like(p) for p in params]
        self.generator = torch.Generator().manual_seed(seed + 1)
        self.steps = 0
        self.sent_sizes: list[float] = []

    def _lr(self) -> float:
        warmup = self.variant.lr_warmup
        return self.lr * min(1.0, self.steps / warmup) if warmup else self.lr

    def _chosen(self, compensated: torch.Tensor, k: int) -> torch.Tensor:
        if self.variant.selection == "topk":
            return compensated.abs().topk(k, sorted=False).indices
        return torch.randperm(compensated.numel(), generator=self.generator)[:k]

    @torch.no_grad()
    def step(self) -> None:
        self.steps += 1
        variant, beta1, beta2, lr = self.variant, *self.betas, self._lr()
        dense = variant.density is None or self.steps <= variant.dense_steps
        if variant.drop_residual_at == self.steps:
            for residual in self.residuals:
                residual.zero_()
        for p, (m, v), residual in zip(self.params, self.moments, self.residuals):
            grad = p.grad if dense or variant.domain == "update" else self._selected(p.grad, residual, lr)
            m.mul_(beta1).add_(grad, alpha=1 - beta1)
            v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            update = lr * (m / (1 - beta1**self.steps)) / ((v / (1 - beta2**self.steps)).sqrt() + self.eps)
            p.mul_(1 - lr * self.weight_decay)
            p.sub_(update if dense or variant.domain == "gradient" else self._selected(update, residual, lr))

    def _selected(self, value: torch.Tensor, residual: torch.Tensor, lr: float) -> torch.Tensor:
        """The selected part of value + residual; the rest, times ``feedback``, becomes the residual."""
        compensated = (value + residual).reshape(-1)
        index = self._chosen(compensated, max(1, math.floor(self.variant.density * compensated.numel())))
        cap = self.variant.send_cap
        sent = compensated[index] if cap is None else compensated[index].clamp(-cap * lr, cap * lr)
        kept = torch.zeros_like(compensated)
        kept[index] = sent
        if self.variant.domain == "update":
            self.sent_sizes.append(float(sent.abs().mean()) / lr)
        residual.copy_((compensated - kept).view_as(residual)).mul_(self.variant.feedback)
        return kept.view_as(value)


def run(variant: Variant, steps: int, eval_every: int, lr: float, seed: int) -> tuple[list[tuple[int, float]], float | None]:
    """The validation curve, and the mean size of a sent entry of the update in units of lr (None if none)."""
    optimizers: list[SelectedAdamW] = []

    def stepper(named: list[tuple[str, torch.nn.Parameter]]) -> Callable[[int], None]:
        optimizers.append(SelectedAdamW([p for _, p in named], lr, variant, seed))
        return lambda _: optimizers[0].step()

    curve = train_lm(seed, steps, eval_every, stepper)
    sizes = optimizers[0].sent_sizes
    return curve, (sum(sizes) / len(sizes) if sizes else None)


def variants(density: float) -> list[Variant]:
    pct = f"{density * 100:g}%"
    return [
        Variant("dense"),
        Variant(f"top-k {pct} + error feedback", density),
        Variant(f"random-k {pct} + error feedback", density, selection="randk"),
        Variant(f"top-k {pct}, no error feedback", density, feedback=0.0),
        Variant(f"top-k {pct} + error feedback, residual dropped at step 30", density, drop_residual_at=30),
        Variant(f"top-k {pct} + error feedback, lr warm-up 30 steps", density, lr_warmup=30),
        Variant(f"top-k {pct} + error feedback, first 30 steps dense", density, dense_steps=30),
        Variant(f"top-k {pct} + 80% of the residual kept", density, feedback=0.8),
        Variant(f"top-k {pct} + 90% of the residual kept", density, feedback=0.9),
        Variant(f"top-k {pct} + 95% of the residual kept", density, feedback=0.95),
        Variant(f"top-k {pct} + 90% of the residual kept, first 10 steps dense", density, feedback=0.9, dense_steps=10),
        Variant(f"top-k {pct} + error feedback, no entry sent above 10 lr", density, send_cap=10.0),
        Variant(f"top-k {pct} + error feedback, no entry sent above 3 lr", density, send_cap=3.0),
        Variant(f"gradient: top-k {pct} + error feedback", density, domain="gradient"),
        Variant(f"gradient: top-k {pct}, no error feedback", density, feedback=0.0, domain="gradient"),
        Variant(f"gradient: top-k {pct} + 90% of the residual kept", density, feedback=0.9, domain="gradient"),
    ]


#: the rows drawn as curves (the scatter has every row of the update)
CURVES = ("dense", "top-k 1% + error feedback", "top-k 1%, no error feedback", "top-k 1% + 90% of the residual kept",
          "top-k 1% + error feedback, no entry sent above 3 lr", "top-k 1% + error feedback, no entry sent above 10 lr")


def plot(rows: list[dict], path: Path) -> Path:
    """Left: validation loss against step for CURVES (mean over seeds); right: the loss at the last
    step against the mean size of a sent entry, one point per selection of the update."""
    plt = pyplot()
    fig, (curves, scatter) = plt.subplots(1, 2, figsize=(11, 4.2))
    by_label: dict[str, dict[int, list[float]]] = {}
    sizes: dict[str, list[float]] = {}
    for r in rows:
        by_label.setdefault(r["variant"], {}).setdefault(int(r["step"]), []).append(float(r["val_loss"]))
        if r["sent_entry_over_lr"] not in (None, ""):
            sizes.setdefault(r["variant"], []).append(float(r["sent_entry_over_lr"]))
    for label in CURVES:
        if label in by_label:
            points = sorted(by_label[label].items())
            curves.plot([s for s, _ in points], [sum(v) / len(v) for _, v in points], marker="o", ms=3, label=label)
    curves.set(xlabel="step", ylabel="validation loss (nats per byte)", title="AdamW's update selected at 1% (mean of seeds)")
    curves.legend(fontsize=7)
    for label, size in sizes.items():
        last = by_label[label][max(by_label[label])]
        scatter.scatter(sum(size) / len(size), sum(last) / len(last), color="tab:blue")
        scatter.annotate(label.replace("top-k 1%", "").strip(" ,+") or label, (sum(size) / len(size), sum(last) / len(last)),
                         fontsize=6, xytext=(3, 3), textcoords="offset points")
    dense = by_label.get("dense")
    if dense:
        scatter.axhline(sum(dense[max(dense)]) / len(dense[max(dense)]), color="gray", ls="--", lw=1, label="dense")
        scatter.legend(fontsize=7)
    scatter.set(xlabel="mean size of a sent entry (steps of lr)", ylabel="validation loss at the last step",
                title="what a sent entry carries")
    return save_figure(fig, path)


def _row(job: tuple[Variant, int, int, float, int]) -> tuple[list[tuple[int, float]], float | None, float]:
    torch.set_num_threads(1)
    started = time.perf_counter()
    variant, steps, eval_every, lr, seed = job
    return (*run(variant, steps, eval_every, lr, seed), time.perf_counter() - started)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--rows", type=int, nargs="*", help="indices of the rows to run (default: all)")
    parser.add_argument("--jobs", type=int, default=1, help="rows run at once, one core each")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--name", default="lm_plateau", help="file stem")
    parser.add_argument("--plot-only", action="store_true", help="only redraw <name>.png from <name>.csv")
    args = parser.parse_args(argv)
    if args.plot_only:
        with open(args.out / f"{args.name}.csv", newline="") as f:
            print(plot(list(csv.DictReader(f)), args.out / f"{args.name}.png"))
        return 0
    chosen = [v for i, v in enumerate(variants(args.density)) if args.rows is None or i in args.rows]
    jobs = [(variant, args.steps, args.eval_every, args.lr, seed) for variant in chosen for seed in args.seeds]
    with multiprocessing.get_context("spawn").Pool(args.jobs) as pool:
        results = pool.map(_row, jobs, chunksize=1)
    rows, sizes = [], {}
    for (variant, *_, seed), (curve, size, seconds) in zip(jobs, results):
        sizes[variant.label, seed] = size
        print(f"{variant.label:60} seed {seed} " + " ".join(f"{loss:.3f}" for _, loss in curve)
              + f" |sent|/lr {size}  ({seconds:.0f} s)", flush=True)
        rows += [{"variant": variant.label, "seed": seed, "step": s, "val_loss": v, "sent_entry_over_lr": size} for s, v in curve]
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(args.out / f"{args.name}.csv", list(rows[0]), rows)
    points = sorted({r["step"] for r in rows})
    lines = [
        f"Validation loss (nats per byte), byte-level GPT-2 tiny on the Lee corpus, one process, AdamW lr {args.lr:g}, "
        f"each cell seed {' / '.join(map(str, args.seeds))}: `python -m experiments.lm_plateau --density {args.density:g} "
        f"--steps {args.steps} --seeds {' '.join(map(str, args.seeds))}"
        + (f" --rows {' '.join(map(str, args.rows))}" if args.rows is not None else "") + f" --name {args.name}`.",
        "",
        "| update | " + " | ".join(f"step {s}" for s in points) + " | mean sent entry / lr |",
        "|---|" + "---|" * len(points) + "---:|",
    ]
    for variant in chosen:
        cells = {(r["step"], r["seed"]): r["val_loss"] for r in rows if r["variant"] == variant.label}
        steps = [" / ".join(f"{cells[s, seed]:.3f}" for seed in args.seeds) for s in points]
        size = " / ".join("" if sizes[variant.label, seed] is None else f"{sizes[variant.label, seed]:.1f}" for seed in args.seeds)
        lines.append(f"| {variant.label} | " + " | ".join(steps) + f" | {size.strip(' /')} |")
    (args.out / f"{args.name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    plot(rows, args.out / f"{args.name}.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
