"""The UCI handwritten digits: 8x8 images of 10 classes from a CSV file, plain or gzipped.

Each row holds 64 pixel values, row by row, then the label. A pixel value (0..16) counts the set
bits of one 4x4 block of the original 32x32 bitmap. The default file is the copy that scikit-learn
ships (``sklearn/datasets/data/digits.csv.gz``, 1797 images); UCI's ``optdigits.tra`` and
``optdigits.tes`` have the same format. There is no official split: a seeded permutation holds out
``val_fraction`` of the rows, the same on every rank; the test split is the validation split.
"""

from __future__ import annotations

import io
from pathlib import Path

import torch
from torch import Tensor
from torch.utils.data import TensorDataset

from ssfusion_lightning.data.base import ImageDataModule, Split
from ssfusion_lightning.data.factory import DATASETS
from ssfusion_lightning.data.files import PackagedFile, locate_file, open_binary

SIDE = 8
PIXELS = SIDE * SIDE
MAX_PIXEL = 16
NUM_CLASSES = 10
PACKAGED = PackagedFile("sklearn", "scikit-learn", "datasets/data/digits.csv.gz")
FORMAT = (
    f"a digits CSV file ({PIXELS} pixel values 0..{MAX_PIXEL} and a label 0..{NUM_CLASSES - 1} per row, plain or .gz)"
)


def read_digits(path: Path) -> tuple[Tensor, Tensor]:
    """A digits CSV file -> images float32 (N, 1, 8, 8) scaled to [0, 1], and labels int64 (N,).

    Raises ValueError naming the file, the line, the column and the value of the first malformed row.
    """
    rows = []
    with open_binary(path) as handle:
        for number, line in enumerate(io.TextIOWrapper(handle, encoding="utf-8"), start=1):
            if line.strip():
                rows.append(_parse_row(line, path, number))
    if not rows:
        raise ValueError(f"{path} holds no rows; expected {FORMAT}")
    table = torch.tensor(rows, dtype=torch.float32)
    images = (table[:, :PIXELS] / MAX_PIXEL).reshape(-1, 1, SIDE, SIDE)
    return images, table[:, PIXELS].long()


def _parse_row(line: str, path: Path, number: int) -> list[float]:
    fields = line.strip().split(",")
    if len(fields) != PIXELS + 1:
        raise ValueError(f"{path}, line {number}: {len(fields)} columns; expected {PIXELS} pixel values and a label")
    values = []
    for column, field in enumerate(fields, start=1):
        where = f"{path}, line {number}, column {column}"
        try:
            value = float(field)
        except ValueError:
            raise ValueError(f"{where}: {field!r} is not a number") from None
        if column <= PIXELS and not 0 <= value <= MAX_PIXEL:  # NaN fails this too
            raise ValueError(f"{where}: pixel value {field!r} is outside 0..{MAX_PIXEL}")
        if column > PIXELS and not (value.is_integer() and 0 <= value < NUM_CLASSES):
            raise ValueError(f"{where}: label {field!r} is not an integer in 0..{NUM_CLASSES - 1}")
        values.append(value)
    return values


@DATASETS.register("digits")
class Digits(ImageDataModule):
    """UCI handwritten digits, 10 classes of 1x8x8 in [0, 1], from ``path`` (None: scikit-learn's copy).

    Validation (and test) is a ``val_fraction`` of the rows drawn by ``split_seed``; training is the rest.
    """

    def __init__(
        self,
        path: str | None = None,
        val_fraction: float = 0.2,
        split_seed: int = 0,
        batch_size: int = 32,
        num_workers: int = 0,
        pin_memory: bool = False,
        drop_last: bool = True,
    ) -> None:
        super().__init__(NUM_CLASSES, (1, SIDE, SIDE), batch_size, num_workers, pin_memory, drop_last)
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
        self.val_fraction = val_fraction
        self.split_seed = split_seed
        self.path = locate_file(path, "UCI digits", PACKAGED, FORMAT)
        self._splits: dict[str, TensorDataset] = {}

    def build_dataset(self, split: Split) -> TensorDataset:
        if not self._splits:
            self._splits = self._split(*read_digits(self.path))
        return self._splits["train" if split == "train" else "val"]

    def _split(self, images: Tensor, labels: Tensor) -> dict[str, TensorDataset]:
        held_out = round(len(labels) * self.val_fraction)
        if not 0 < held_out < len(labels):
            raise ValueError(
                f"{self.path}: val_fraction={self.val_fraction} of {len(labels)} rows leaves "
                f"{held_out} for validation and {len(labels) - held_out} for training; both need at least one"
            )
        # A generator of its own: the split must not depend on (or disturb) the global seed.
        order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(self.split_seed))
        val, train = order[:held_out], order[held_out:]
        return {"train": TensorDataset(images[train], labels[train]), "val": TensorDataset(images[val], labels[val])}
