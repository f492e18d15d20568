"""DataModule plumbing shared by every dataset: splits built on demand, standard DataLoaders.

The loaders are plain ``DataLoader``s without a sampler, so under DDP Lightning injects its
``DistributedSampler`` and each rank reads its own shard.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Callable, Literal

from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader, Dataset

from ssfusion_lightning.data.sequences import MLMCollator, causal_collate

Split = Literal["train", "val", "test"]
OBJECTIVES = ("causal", "mlm")

_STAGE_SPLITS: dict[str | None, tuple[Split, ...]] = {
    "fit": ("train", "val"),
    "validate": ("val",),
    "test": ("test",),
    "predict": (),  # no predict_dataloader: nothing to prepare
    None: ("train", "val", "test"),
}


class BaseDataModule(LightningDataModule, ABC):
    def __init__(self, batch_size: int, num_workers: int, pin_memory: bool, drop_last: bool) -> None:
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.pin_memory = pin_memory
        self.drop_last = drop_last
        self._datasets: dict[str, Dataset[Any]] = {}

    @abstractmethod
    def build_dataset(self, split: Split) -> Dataset[Any]:
        """The dataset of one split; called at most once per split."""

    def collate_fn(self) -> Callable[[list[Any]], Any] | None:
        """A custom batch collation, or None for the default stacking."""
        return None

    def setup(self, stage: str | None = None) -> None:
        for split in _STAGE_SPLITS[stage]:
            self.dataset(split)

    def dataset(self, split: Split) -> Dataset[Any]:
        """The dataset of ``split``, built on first use (so it also works outside a Trainer)."""
        if split not in self._datasets:
            self._datasets[split] = self.build_dataset(split)
        return self._datasets[split]

    def train_dataloader(self) -> DataLoader[Any]:
        # drop_last keeps every step's batch shape identical, which keeps per-step timings comparable.
        return self._loader("train", shuffle=True, drop_last=self.drop_last)

    def val_dataloader(self) -> DataLoader[Any]:
        return self._loader("val", shuffle=False, drop_last=False)

    def test_dataloader(self) -> DataLoader[Any]:
        return self._loader("test", shuffle=False, drop_last=False)

    def _loader(self, split: Split, shuffle: bool, drop_last: bool) -> DataLoader[Any]:
        return DataLoader(
            self.dataset(split),
            batch_size=self.batch_size,
            shuffle=shuffle,
            drop_last=drop_last,
            num_workers=self.num_workers,
            pin_memory=self.pin_memory,
            persistent_workers=self.num_workers > 0,
            collate_fn=self.collate_fn(),
        )


class ImageDataModule(BaseDataModule):
    """Batches ``(images (N, C, H, W) float32, labels (N,) int64)``; images are normalized."""

    def __init__(
        self,
        num_classes: int,
        image_shape: tuple[int, int, int],
        batch_size: int,
        num_workers: int,
        pin_memory: bool,
        drop_last: bool,
    ) -> None:
        super().__init__(batch_size, num_workers, pin_memory, drop_last)
        self.num_classes = num_classes
        self.image_shape = image_shape


class TokenDataModule(BaseDataModule):
    """Batches ``(inputs (N, seq_len) int64, targets (N, seq_len) int64)`` for a causal or masked LM.

    ``objective="causal"``: targets are the inputs shifted by one token.
    ``objective="mlm"``: BERT masking (see ``MLMCollator``); the vocabulary's last id is the mask token.
    Subclasses provide ``vocab_size`` and datasets of 1-d chunks of ``chunk_length`` tokens.
    """

    def __init__(
        self,
        seq_len: int,
        objective: str,
        mask_prob: float,
        batch_size: int,
        num_workers: int,
        pin_memory: bool,
        drop_last: bool,
    ) -> None:
        super().__init__(batch_size, num_workers, pin_memory, drop_last)
        if objective not in OBJECTIVES:
            raise ValueError(f"unknown objective {objective!r}; valid choices: {', '.join(OBJECTIVES)}")
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        self.seq_len = seq_len
        self.objective = objective
        self.mask_prob = mask_prob

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Number of token ids, including the mask token under ``objective="mlm"``."""

    @property
    def mask_token_id(self) -> int | None:
        return self.vocab_size - 1 if self.objective == "mlm" else None

    @property
    def chunk_length(self) -> int:
        """Tokens per dataset item: a causal sequence needs one more token for its last target."""
        return self.seq_len + 1 if self.objective == "causal" else self.seq_len

    def collate_fn(self) -> Callable[[list[Any]], Any]:
        if self.objective == "causal":
            return causal_collate
        return MLMCollator(self.vocab_size - 1, self.mask_prob)
