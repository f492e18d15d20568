"""An in-memory image dataset: uint8 images transformed one at a time as they are read."""

from __future__ import annotations

from typing import Callable

from torch import Tensor
from torch.utils.data import Dataset


class LabeledImages(Dataset[tuple[Tensor, int]]):
    """``images`` uint8 (N, C, H, W) and ``labels`` int (N,) -> items ``(transform(image), label)``.

    Images stay uint8 in memory (a quarter of float32) until an item is read.
    """

    def __init__(self, images: Tensor, labels: Tensor, transform: Callable[[Tensor], Tensor]) -> None:
        if len(images) != len(labels):
            raise ValueError(f"{len(images)} images but {len(labels)} labels")
        self.images = images
        self.labels = labels
        self.transform = transform

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int) -> tuple[Tensor, int]:
        return self.transform(self.images[index]), int(self.labels[index])
