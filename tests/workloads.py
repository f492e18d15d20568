"""Small LightningModules and training helpers shared by the multi-rank tests (run inside pool ranks)."""

from __future__ import annotations

from typing import Any, Callable

import lightning as L
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Regressor(L.LightningModule):
    """A small MLP on a learnable regression task; ``kind`` adds BatchNorm or a rank-0-only branch."""

    def __init__(self, kind: str = "plain", lr: float = 0.05, width: int = 32, optimizer: str = "sgd") -> None:
        super().__init__()
        self.kind = kind
        self.lr = lr
        self.optimizer = optimizer
        layers: list[nn.Module] = [nn.Linear(8, width)]
        if kind == "batchnorm":
            layers.append(nn.BatchNorm1d(width))
        layers += [nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 1)]
        self.net = nn.Sequential(*layers)
        if kind == "unused_on_one_rank":
            self.side = nn.Linear(8, 1)  # rank 0 uses it, rank 1 does not
        self.frozen = nn.Linear(8, 8)
        self.frozen.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.net(x + self.frozen(x) * 0.1)
        if self.kind == "unused_on_one_rank" and dist.get_rank() == 0:
            out = out + self.side(x)
        return out

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self(x), y), sync_dist=True)

    def configure_optimizers(self):
        if self.optimizer == "sgd":
            return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        # "adamw": decayed matrices, undecayed vectors, and a schedule that changes the rate every step
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.1}, {"params": [p for p in params if p.ndim < 2]}]
        optimizer = torch.optim.AdamW(groups, lr=self.lr, weight_decay=0.0)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def regression_data(n: int = 256, seed: int = 1234) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    w = torch.randn(8, 1, generator=g)
    return TensorDataset(x, torch.tanh(x @ w) + 0.05 * torch.randn(n, 1, generator=g))


def make_trainer(strategy: Any, steps: int, **kwargs: Any) -> L.Trainer:
    options = dict(
        accelerator="cpu",
        devices=dist.get_world_size() if dist.is_initialized() else 2,
        strategy=strategy,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    options.update(kwargs)
    return L.Trainer(**options)


def fit_and_get_params(strategy: Any, kind: str = "plain", steps: int = 6, seed: int = 0, **trainer_kwargs: Any):
    L.seed_everything(seed, verbose=False)
    model = Regressor(kind)
    loader = DataLoader(regression_data(), batch_size=16)
    make_trainer(strategy, steps, **trainer_kwargs).fit(model, loader)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def checkpoint_and_resume(
    make_strategy: Callable[[], Any], path: str, steps: int, resumed_steps: int, peek: Callable[[Any], dict], width: int = 32
) -> tuple[Any, Any, dict]:
    """Train ``steps`` steps and checkpoint to ``path``, then resume a new strategy from it to
    ``resumed_steps``. Returns both strategies and ``peek(engine)`` of the resumed engine, taken
    when its training starts (after the restore, before any step)."""
    first = make_strategy()
    trainer = make_trainer(first, steps)
    trainer.fit(Regressor(width=width), DataLoader(regression_data(), batch_size=16))
    trainer.save_checkpoint(path)
    dist.barrier()
    second = make_strategy()
    peeked: dict = {}

    class Peek(L.Callback):
        def on_train_start(self, trainer, module):
            peeked.update(peek(second.engine))

    make_trainer(second, resumed_steps, callbacks=[Peek()]).fit(
        Regressor(width=width), DataLoader(regression_data(), batch_size=16), ckpt_path=path
    )
    return first, second, peeked
