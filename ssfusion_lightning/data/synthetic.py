"""Learnable synthetic data, generated on the fly: no download, O(1) memory, identical on every rank.

Item ``i`` of a split is drawn from a generator seeded by a hash of ``(seed, split, i)``, so the data
does not depend on the rank, the worker, or the order in which items are read.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.data import Dataset

from ssfusion_lightning.data.base import ImageDataModule, Split, TokenDataModule
from ssfusion_lightning.data.factory import DATASETS

_SPLIT_IDS = {"train": 0, "val": 1, "test": 2}
_PATTERN_RESOLUTION = 4


_MASK64 = 2**64 - 1


def item_generator(seed: int, split: Split, index: int) -> torch.Generator:
    """A generator for one item, seeded by a hash of ``(seed, split, index)``.

    The CPU generator keeps only the low 32 bits of its seed, so the triple is hashed (SplitMix64's
    finalizer) rather than packed into bit fields: packing would give every split the same items.
    """
    state = (((seed * 3 + _SPLIT_IDS[split]) << 32) + index + 0x9E3779B97F4A7C15) & _MASK64
    state = ((state ^ (state >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    state = ((state ^ (state >> 27)) * 0x94D049BB133111EB) & _MASK64
    return torch.Generator().manual_seed(state ^ (state >> 31))


class ClassPatterns(Dataset[tuple[Tensor, int]]):
    """Images ``pattern[label] + noise``: each class has a fixed smooth random pattern (a random
    low-resolution image upsampled), hidden under i.i.d. Gaussian noise of std ``noise_std``."""

    def __init__(
        self, patterns: Tensor, image_size: int, num_samples: int, noise_std: float, seed: int, split: Split
    ) -> None:
        self.patterns = patterns
        self.image_size = image_size
        self.num_samples = num_samples
        self.noise_std = noise_std
        self.seed = seed
        self.split = split

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> tuple[Tensor, int]:
        generator = item_generator(self.seed, self.split, index)
        label = int(torch.randint(len(self.patterns), (), generator=generator))
        size = (self.image_size, self.image_size)
        pattern = F.interpolate(self.patterns[label][None], size=size, mode="bilinear", align_corners=False)[0]
        return pattern + self.noise_std * torch.randn(pattern.shape, generator=generator), label


@DATASETS.register("synthetic_images")
class SyntheticImages(ImageDataModule):
    """Class-conditional images (float32, roughly standardized) of ``channels x image_size x image_size``."""

    def __init__(
        self,
        num_classes: int = 10,
        image_size: int = 32,
        channels: int = 3,
        noise_std: float = 1.0,
        train_samples: int = 10_000,
        val_samples: int = 1_000,
        test_samples: int = 1_000,
        seed: int = 0,
        batch_size: int = 128,
        num_workers: int = 0,
        pin_memory: bool = False,
        drop_last: bool = True,
    ) -> None:
        image_shape = (channels, image_size, image_size)
        super().__init__(num_classes, image_shape, batch_size, num_workers, pin_memory, drop_last)
        self.noise_std = noise_std
        self.samples = {"train": train_samples, "val": val_samples, "test": test_samples}
        self.seed = seed
        shape = (num_classes, channels, _PATTERN_RESOLUTION, _PATTERN_RESOLUTION)
        self.patterns = torch.randn(shape, generator=torch.Generator().manual_seed(seed))

    def build_dataset(self, split: Split) -> ClassPatterns:
        return ClassPatterns(self.patterns, self.image_shape[-1], self.samples[split], self.noise_std, self.seed, split)


class MarkovChain:
    """A fixed random first-order chain over ``num_tokens`` tokens: each token is followed by one of
    ``branching`` successors (drawn once from ``seed``), uniformly. The best achievable next-token loss
    is therefore at most log(branching), far below the log(num_tokens) of a uniform guess."""

    def __init__(self, num_tokens: int, branching: int, seed: int) -> None:
        if num_tokens < 1 or branching < 1:
            raise ValueError(f"num_tokens and branching must be >= 1, got {num_tokens} and {branching}")
        generator = torch.Generator().manual_seed(seed)
        self.num_tokens = num_tokens
        self.branching = branching
        # Plain lists: the walk is sequential, and Python list indexing is far cheaper than tensor indexing.
        self.successors: list[list[int]] = torch.randint(
            num_tokens, (num_tokens, branching), generator=generator
        ).tolist()

    def sample(self, length: int, generator: torch.Generator) -> Tensor:
        token = int(torch.randint(self.num_tokens, (), generator=generator))
        choices = torch.randint(self.branching, (length - 1,), generator=generator).tolist()
        walk = [token]
        for choice in choices:
            token = self.successors[token][choice]
            walk.append(token)
        return torch.tensor(walk, dtype=torch.long)


class ChainSequences(Dataset[Tensor]):
    """Independent walks of ``length`` tokens on ``chain``."""

    def __init__(self, chain: MarkovChain, length: int, num_samples: int, seed: int, split: Split) -> None:
        self.chain = chain
        self.length = length
        self.num_samples = num_samples
        self.seed = seed
        self.split = split

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> Tensor:
        return self.chain.sample(self.length, item_generator(self.seed, self.split, index))


@DATASETS.register("synthetic_tokens")
class SyntheticTokens(TokenDataModule):
    """Token sequences from a fixed random Markov chain (see ``MarkovChain``).

    Under ``objective="mlm"`` the chain uses ids ``0 .. vocab_size - 2`` and ``vocab_size - 1`` is the mask.
    """

    def __init__(
        self,
        vocab_size: int = 256,
        seq_len: int = 64,
        branching: int = 4,
        objective: str = "causal",
        mask_prob: float = 0.15,
        train_samples: int = 10_000,
        val_samples: int = 1_000,
        test_samples: int = 1_000,
        seed: int = 0,
        batch_size: int = 32,
        num_workers: int = 0,
        pin_memory: bool = False,
        drop_last: bool = True,
    ) -> None:
        super().__init__(seq_len, objective, mask_prob, batch_size, num_workers, pin_memory, drop_last)
        self._vocab_size = vocab_size
        self.samples = {"train": train_samples, "val": val_samples, "test": test_samples}
        self.seed = seed
        emitted = vocab_size - 1 if objective == "mlm" else vocab_size
        self.chain = MarkovChain(emitted, branching, seed)

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def build_dataset(self, split: Split) -> ChainSequences:
        return ChainSequences(self.chain, self.chunk_length, self.samples[split], self.seed, split)
