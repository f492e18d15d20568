"""GPT-2 (Radford et al. 2019): causal decoder, learned positions, output projection tied to the input embedding."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ssfusion_lightning.models.factory import register_model
from ssfusion_lightning.models.transformer import TransformerBlock, init_transformer_weights


class GPT2(nn.Module):
    """Token ids (N, T) -> next-token logits (N, T, vocab_size), T <= max_positions."""

    def __init__(
        self,
        vocab_size: int = 50257,
        max_positions: int = 1024,
        dim: int = 768,
        depth: int = 12,
        num_heads: int = 12,
        dropout: float = 0.1,
    ) -> None:
        super().__init__()
        self.max_positions = max_positions
        self.token_embed = nn.Embedding(vocab_size, dim)
        self.pos_embed = nn.Embedding(max_positions, dim)
        self.dropout = nn.Dropout(dropout)
        self.blocks = nn.Sequential(
            *(
                TransformerBlock(dim, num_heads, 4 * dim, dropout, causal=True, norm_first=True, approximate="tanh")
                for _ in range(depth)
            )
        )
        self.norm = nn.LayerNorm(dim)
        init_transformer_weights(self)
        # GPT-2 scales the projections that write into the residual stream by 1/sqrt(2 * depth), one per
        # residual addition, so the stream's variance does not grow with depth.
        for block in self.blocks:
            for proj in (block.attn.proj, block.mlp.fc2):
                nn.init.normal_(proj.weight, std=0.02 / math.sqrt(2 * depth))

    def forward(self, input_ids: Tensor) -> Tensor:
        length = input_ids.shape[1]
        if length > self.max_positions:
            raise ValueError(f"sequence length {length} exceeds max_positions {self.max_positions}")
        positions = torch.arange(length, device=input_ids.device)
        hidden = self.dropout(self.token_embed(input_ids) + self.pos_embed(positions))
        return F.linear(self.norm(self.blocks(hidden)), self.token_embed.weight)


def _paper(dim: int, depth: int, num_heads: int) -> dict[str, object]:
    return {"dim": dim, "depth": depth, "num_heads": num_heads}


register_model(
    "gpt2",
    GPT2,
    {
        "tiny": {"vocab_size": 256, "max_positions": 128, "dim": 64, "depth": 2, "num_heads": 2},
        "small": _paper(768, 12, 12),
        "medium": _paper(1024, 24, 16),
        "large": _paper(1280, 36, 20),
    },
)
