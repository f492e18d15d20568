"""MNIST from the official idx files, plain or gzipped.

The validation and test splits are both the official test set.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from ssfusion_lightning.data.base import ImageDataModule, Split
from ssfusion_lightning.data.factory import DATASETS
from ssfusion_lightning.data.files import locate, open_binary
from ssfusion_lightning.data.labeled_images import LabeledImages
from ssfusion_lightning.data.transforms import MNIST_STATS, SmallImageTransform

_FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")
_UBYTE = 0x08


def read_idx(path: Path) -> Tensor:
    """An idx file of unsigned bytes as a uint8 tensor of the shape its header declares."""
    with open_binary(path) as handle:
        data = handle.read()
    if len(data) < 4 or data[0] != 0 or data[1] != 0 or data[2] != _UBYTE:
        raise ValueError(f"{path} is not an idx file of unsigned bytes")
    ndim = data[3]
    shape = tuple(int(d) for d in np.frombuffer(data, dtype=">u4", count=ndim, offset=4))
    offset = 4 + 4 * ndim
    expected = int(np.prod(shape))
    if len(data) - offset != expected:
        raise ValueError(f"{path}: header declares {shape} ({expected} bytes) but holds {len(data) - offset}")
    return torch.frombuffer(bytearray(data[offset:]), dtype=torch.uint8).reshape(shape)


@DATASETS.register("mnist")
class MNIST(ImageDataModule):
    """MNIST, 10 classes of 1x28x28: ``root/{train,t10k}-{images-idx3,labels-idx1}-ubyte[.gz]``.

    The torchvision layout (the files under ``root/MNIST/raw``) is accepted too.
    """

    def __init__(
        self,
        root: str,
        batch_size: int = 128,
        num_workers: int = 0,
        pin_memory: bool = False,
        drop_last: bool = True,
    ) -> None:
        super().__init__(10, (1, 28, 28), batch_size, num_workers, pin_memory, drop_last)
        hint = (
            f"Put the four official idx files (gzipped or not) in {root}, or point paths.data_dir "
            "(or data.root) at the directory that already holds them"
        )
        self.paths = locate(root, "MNIST", _FILES, subdirs=("", "MNIST/raw"), suffixes=("", ".gz"), hint=hint)

    def build_dataset(self, split: Split) -> LabeledImages:
        image_path, label_path = self.paths[:2] if split == "train" else self.paths[2:]
        images = read_idx(image_path).unsqueeze(1)
        labels = read_idx(label_path).long()
        return LabeledImages(images, labels, SmallImageTransform(*MNIST_STATS))
