"""LightningDataModules: learnable synthetic data, and real datasets read from a local path (or, for
``digits`` and ``text``, by default from a file that an installed package ships).

Importing a dataset module registers it with ``build_datamodule``; this package imports them all.
Image modules yield ``(images (N, C, H, W) float32, labels (N,) int64)`` and expose ``num_classes``
and ``image_shape``; token modules yield ``(inputs (N, T) int64, targets (N, T) int64)`` and expose
``vocab_size``, ``seq_len`` and ``mask_token_id``.
"""

from ssfusion_lightning.data.base import BaseDataModule, ImageDataModule, TokenDataModule
from ssfusion_lightning.data.cifar import CIFAR10, CIFAR100
from ssfusion_lightning.data.digits import Digits
from ssfusion_lightning.data.factory import available_datasets, build_datamodule
from ssfusion_lightning.data.image_folder import ImageFolder
from ssfusion_lightning.data.mnist import MNIST
from ssfusion_lightning.data.resumable import ResumableDataLoader
from ssfusion_lightning.data.sequences import IGNORE_INDEX, MLMCollator, causal_collate
from ssfusion_lightning.data.synthetic import SyntheticImages, SyntheticTokens
from ssfusion_lightning.data.text import TextFile
from ssfusion_lightning.data.wikitext import WikiText2, WikiText103

__all__ = [
    "ResumableDataLoader",
    "CIFAR10",
    "CIFAR100",
    "IGNORE_INDEX",
    "MNIST",
    "BaseDataModule",
    "Digits",
    "ImageDataModule",
    "ImageFolder",
    "MLMCollator",
    "SyntheticImages",
    "SyntheticTokens",
    "TextFile",
    "TokenDataModule",
    "WikiText103",
    "WikiText2",
    "available_datasets",
    "build_datamodule",
    "causal_collate",
]
