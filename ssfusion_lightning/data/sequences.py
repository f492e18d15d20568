"""Token sequences for language modelling: chunking a token stream, causal and masked-LM collation.

Every collated batch is ``(inputs (N, T) int64, targets (N, T) int64)`` with ``targets`` aligned to
the model's output positions and ``IGNORE_INDEX`` where nothing is predicted.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from torch.utils.data import Dataset

#: Target value that the loss skips; PyTorch's cross-entropy default.
IGNORE_INDEX = -100


class StreamChunks(Dataset[Tensor]):
    """Chunks of ``length`` tokens starting every ``stride`` tokens of a 1-d token stream."""

    def __init__(self, tokens: Tensor, length: int, stride: int) -> None:
        if tokens.ndim != 1:
            raise ValueError(f"tokens must be 1-d, got shape {tuple(tokens.shape)}")
        if length < 1 or stride < 1:
            raise ValueError(f"length and stride must be >= 1, got {length} and {stride}")
        self.tokens = tokens
        self.length = length
        self.stride = stride

    def __len__(self) -> int:
        return max(0, (len(self.tokens) - self.length) // self.stride + 1)

    def __getitem__(self, index: int) -> Tensor:
        if not 0 <= index < len(self):
            raise IndexError(f"index {index} out of range for {len(self)} chunks")
        start = index * self.stride
        return self.tokens[start : start + self.length].long()


def causal_collate(chunks: list[Tensor]) -> tuple[Tensor, Tensor]:
    """Chunks of T + 1 tokens -> (tokens 0..T-1, tokens 1..T): each position predicts the next token."""
    batch = torch.stack(chunks)
    return batch[:, :-1].contiguous(), batch[:, 1:].contiguous()


@dataclass(frozen=True)
class MLMCollator:
    """BERT masking of chunks of T tokens: each position is selected with ``mask_prob``; a selected
    position becomes ``mask_token_id`` (80%), a random token (10%) or stays (10%), and only selected
    positions have targets.

    ``mask_token_id`` must be the highest id of the vocabulary: random replacements are drawn below it.
    Draws from torch's global generator: seed it per rank and worker, e.g. ``seed_everything(s, workers=True)``.
    """

    mask_token_id: int
    mask_prob: float = 0.15

    def __post_init__(self) -> None:
        if not 0.0 < self.mask_prob <= 1.0:
            raise ValueError(f"mask_prob must be in (0, 1], got {self.mask_prob}")

    def __call__(self, chunks: list[Tensor]) -> tuple[Tensor, Tensor]:
        tokens = torch.stack(chunks)
        selected = torch.rand(tokens.shape) < self.mask_prob
        # A sequence without any target would make a batch of short sequences yield a NaN loss.
        empty = ~selected.any(dim=1)
        selected[empty, torch.randint(tokens.shape[1], (int(empty.sum()),))] = True
        targets = torch.where(selected, tokens, IGNORE_INDEX)

        roll = torch.rand(tokens.shape)
        inputs = tokens.clone()
        inputs[selected & (roll < 0.8)] = self.mask_token_id
        randomized = selected & (roll >= 0.8) & (roll < 0.9)
        inputs[randomized] = torch.randint(self.mask_token_id, (int(randomized.sum()),))
        return inputs, targets
