"""CIFAR-10 and CIFAR-100 from the official python-pickle batches.

The validation and test splits are both the official test set (CIFAR ships no validation split).
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch
from torch import Tensor

from ssfusion_lightning.data.base import ImageDataModule, Split
from ssfusion_lightning.data.factory import DATASETS
from ssfusion_lightning.data.files import locate
from ssfusion_lightning.data.labeled_images import LabeledImages
from ssfusion_lightning.data.transforms import CIFAR10_STATS, CIFAR100_STATS, SmallImageTransform


def read_batches(paths: list[Path], label_key: bytes) -> tuple[Tensor, Tensor]:
    """Concatenate pickled batches into uint8 images (N, 3, 32, 32) and int64 labels (N,).

    The batches are pickles: only read files from a trusted source (the official archive).
    """
    images, labels = [], []
    for path in paths:
        with open(path, "rb") as handle:
            batch = pickle.load(handle, encoding="bytes")
        images.append(np.asarray(batch[b"data"], dtype=np.uint8).reshape(-1, 3, 32, 32))
        labels.append(np.asarray(batch[label_key], dtype=np.int64))
    return torch.from_numpy(np.concatenate(images)), torch.from_numpy(np.concatenate(labels))


class _CIFAR(ImageDataModule):
    title: ClassVar[str]
    folder: ClassVar[str]
    train_files: ClassVar[tuple[str, ...]]
    test_files: ClassVar[tuple[str, ...]]
    label_key: ClassVar[bytes]
    classes: ClassVar[int]
    stats: ClassVar[tuple[tuple[float, ...], tuple[float, ...]]]

    def __init__(
        self,
        root: str,
        augment: bool = True,
        batch_size: int = 128,
        num_workers: int = 0,
        pin_memory: bool = False,
        drop_last: bool = True,
    ) -> None:
        super().__init__(self.classes, (3, 32, 32), batch_size, num_workers, pin_memory, drop_last)
        self.augment = augment
        names = self.train_files + self.test_files
        hint = (
            f"Download the python version from https://www.cs.toronto.edu/~kriz/cifar.html and extract it into "
            f"{root}, or point paths.data_dir (or data.root) at the directory that already holds {self.folder}/"
        )
        paths = locate(root, self.title, names, subdirs=(self.folder, ""), hint=hint)
        self.train_paths = paths[: len(self.train_files)]
        self.test_paths = paths[len(self.train_files) :]

    def build_dataset(self, split: Split) -> LabeledImages:
        images, labels = read_batches(self.train_paths if split == "train" else self.test_paths, self.label_key)
        transform = SmallImageTransform(*self.stats, augment=self.augment and split == "train")
        return LabeledImages(images, labels, transform)


@DATASETS.register("cifar10")
class CIFAR10(_CIFAR):
    """CIFAR-10: ``root/cifar-10-batches-py/{data_batch_1..5, test_batch}``; 10 classes of 3x32x32."""

    title = "CIFAR-10"
    folder = "cifar-10-batches-py"
    train_files = tuple(f"data_batch_{i}" for i in range(1, 6))
    test_files = ("test_batch",)
    label_key = b"labels"
    classes = 10
    stats = CIFAR10_STATS


@DATASETS.register("cifar100")
class CIFAR100(_CIFAR):
    """CIFAR-100: ``root/cifar-100-python/{train, test}``, fine labels; 100 classes of 3x32x32."""

    title = "CIFAR-100"
    folder = "cifar-100-python"
    train_files = ("train",)
    test_files = ("test",)
    label_key = b"fine_labels"
    classes = 100
    stats = CIFAR100_STATS
