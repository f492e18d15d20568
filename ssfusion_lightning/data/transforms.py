"""Image preprocessing and augmentation with plain torch ops, on single (C, H, W) images.

Randomness comes from torch's global generator: seed it per rank and worker, e.g. with Lightning's
``seed_everything(seed, workers=True)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

CIFAR10_STATS = ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))
CIFAR100_STATS = ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762))
MNIST_STATS = ((0.1307,), (0.3081,))
IMAGENET_STATS = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))


def normalize(image: Tensor, mean: tuple[float, ...], std: tuple[float, ...]) -> Tensor:
    """uint8 or [0, 1] float (C, H, W) -> float32 standardized per channel."""
    if image.dtype == torch.uint8:
        image = image.float().div_(255)
    mean_t = torch.tensor(mean).view(-1, 1, 1)
    std_t = torch.tensor(std).view(-1, 1, 1)
    return (image - mean_t) / std_t


def random_crop(image: Tensor, padding: int) -> Tensor:
    """Zero-pad by ``padding`` on every side, then crop back to the original size at a random offset."""
    height, width = image.shape[-2:]
    padded = F.pad(image, (padding, padding, padding, padding))
    top, left = torch.randint(2 * padding + 1, (2,)).tolist()
    return padded[:, top : top + height, left : left + width]


def random_flip(image: Tensor) -> Tensor:
    return image.flip(-1) if torch.rand(()) < 0.5 else image


def resize(image: Tensor, size: int) -> Tensor:
    """(C, h, w) -> float32 (C, size, size) in [0, 1], antialiased bilinear."""
    image = image.float().div_(255) if image.dtype == torch.uint8 else image.float()
    return F.interpolate(image[None], size=(size, size), mode="bilinear", antialias=True, align_corners=False)[0]


def random_resized_crop(
    image: Tensor, size: int, scale: tuple[float, float] = (0.08, 1.0), ratio: tuple[float, float] = (3 / 4, 4 / 3)
) -> Tensor:
    """Inception-style crop: a random area fraction in ``scale``, aspect ratio in ``ratio``, resized to ``size``."""
    height, width = image.shape[-2:]
    area = height * width
    for _ in range(10):
        target_area = area * torch.empty(()).uniform_(*scale).item()
        aspect = math.exp(torch.empty(()).uniform_(math.log(ratio[0]), math.log(ratio[1])).item())
        crop_w = round(math.sqrt(target_area * aspect))
        crop_h = round(math.sqrt(target_area / aspect))
        if 0 < crop_w <= width and 0 < crop_h <= height:
            top = int(torch.randint(height - crop_h + 1, ()))
            left = int(torch.randint(width - crop_w + 1, ()))
            return resize(image[:, top : top + crop_h, left : left + crop_w], size)
    # Rarely no sample fits (very elongated images): fall back to the central crop.
    return center_crop(image, size, fraction=1.0)


def center_crop(image: Tensor, size: int, fraction: float = 0.875) -> Tensor:
    """The central square of side ``fraction * min(H, W)``, resized to ``size``.

    Equivalent to resizing the short side to ``size / fraction`` and cropping ``size`` (the standard
    ImageNet evaluation), but resizes only the pixels that are kept.
    """
    height, width = image.shape[-2:]
    side = max(1, round(min(height, width) * fraction))
    top, left = (height - side) // 2, (width - side) // 2
    return resize(image[:, top : top + side, left : left + side], size)


@dataclass(frozen=True)
class SmallImageTransform:
    """CIFAR/MNIST-style: optional pad-4 random crop and horizontal flip, then per-channel normalization."""

    mean: tuple[float, ...]
    std: tuple[float, ...]
    augment: bool = False

    def __call__(self, image: Tensor) -> Tensor:
        if self.augment:
            image = random_flip(random_crop(image, padding=4))
        return normalize(image, self.mean, self.std)


@dataclass(frozen=True)
class ImageNetTransform:
    """Training: random resized crop and flip; evaluation: center crop. Both give (C, size, size)."""

    size: int
    train: bool
    mean: tuple[float, ...] = IMAGENET_STATS[0]
    std: tuple[float, ...] = IMAGENET_STATS[1]

    def __call__(self, image: Tensor) -> Tensor:
        if self.train:
            image = random_flip(random_resized_crop(image, self.size))
        else:
            image = center_crop(image, self.size)
        return normalize(image, self.mean, self.std)
