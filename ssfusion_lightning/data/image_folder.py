"""ImageNet-style image folders: ``root/train/<class>/<image>`` and ``root/val/<class>/<image>``.

Images are decoded with PIL and cropped/resized with torch ops. The validation and test splits are
both ``root/val`` (ImageNet's labelled evaluation set).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch import Tensor
from torch.utils.data import Dataset

from ssfusion_lightning.data.base import ImageDataModule, Split
from ssfusion_lightning.data.factory import DATASETS
from ssfusion_lightning.data.transforms import ImageNetTransform

IMAGE_EXTENSIONS = frozenset({".jpg", ".jpeg", ".png", ".bmp", ".ppm", ".gif", ".tif", ".tiff", ".webp"})


def load_rgb(path: Path) -> Tensor:
    """Decode an image file to uint8 (3, H, W)."""
    with Image.open(path) as image:
        pixels = np.array(image.convert("RGB"))
    return torch.from_numpy(pixels).permute(2, 0, 1)


class ImageFiles(Dataset[tuple[Tensor, int]]):
    """The images under ``directory/<class>/`` (any depth), labelled by the class's index in ``classes``."""

    def __init__(self, directory: Path, classes: list[str], transform: ImageNetTransform) -> None:
        self.transform = transform
        self.samples: list[tuple[Path, int]] = []
        for label, name in enumerate(classes):
            files = sorted(p for p in (directory / name).rglob("*") if p.suffix.lower() in IMAGE_EXTENSIONS)
            self.samples.extend((path, label) for path in files)
        if not self.samples:
            raise FileNotFoundError(f"no images ({', '.join(sorted(IMAGE_EXTENSIONS))}) under {directory}/<class>/")

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[Tensor, int]:
        path, label = self.samples[index]
        return self.transform(load_rgb(path)), label


@DATASETS.register("imagenet")
class ImageFolder(ImageDataModule):
    """An ImageNet-style folder; classes are the sorted subdirectories of ``root/train``."""

    def __init__(
        self,
        root: str,
        image_size: int = 224,
        batch_size: int = 64,
        num_workers: int = 0,
        pin_memory: bool = False,
        drop_last: bool = True,
    ) -> None:
        base = Path(root).expanduser()
        directories = {"train": base / "train", "val": base / "val"}
        missing = [str(d) for d in directories.values() if not d.is_dir()]
        classes = sorted(d.name for d in directories["train"].iterdir() if d.is_dir()) if not missing else []
        if missing or not classes:
            raise FileNotFoundError(
                f"image folder not found: expected {base}/train/<class>/<image> and {base}/val/<class>/<image> "
                f"(missing: {', '.join(missing) or base / 'train' / '<class>'}). "
                "Lay the dataset out this way, or point data.root at the directory that already holds train/ and val/"
            )
        super().__init__(len(classes), (3, image_size, image_size), batch_size, num_workers, pin_memory, drop_last)
        self.directories = directories
        self.classes = classes
        self.image_size = image_size

    def build_dataset(self, split: Split) -> ImageFiles:
        directory = self.directories["train" if split == "train" else "val"]
        return ImageFiles(directory, self.classes, ImageNetTransform(self.image_size, train=split == "train"))
