"""BERT (Devlin et al. 2019) with its masked-LM head, whose output projection is tied to the word embedding."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ssfusion_lightning.models.factory import register_model
from ssfusion_lightning.models.transformer import TransformerBlock, init_transformer_weights

_EPS = 1e-12  # BERT's LayerNorm epsilon


class BertForMaskedLM(nn.Module):
    """Token ids (N, T) -> masked-LM logits (N, T, vocab_size) at every position, T <= max_positions.

    Sequences are fixed-length and unpadded, so there is no attention mask.
    """

    def __init__(
        self,
        vocab_size: int = 30522,
        max_positions: int = 512,
        dim: int = 768,
        depth: int = 12,
        num_heads: int = 12,
        mlp_dim: int = 3072,
        type_vocab_size: int = 2,
        dropout: float = 0.1,
    ) -> None:
        super().__init__()
        self.max_positions = max_positions
        self.word_embed = nn.Embedding(vocab_size, dim)
        self.pos_embed = nn.Embedding(max_positions, dim)
        self.type_embed = nn.Embedding(type_vocab_size, dim)
        self.embed_norm = nn.LayerNorm(dim, eps=_EPS)
        self.dropout = nn.Dropout(dropout)
        self.blocks = nn.Sequential(
            *(TransformerBlock(dim, num_heads, mlp_dim, dropout, norm_first=False, eps=_EPS) for _ in range(depth))
        )
        self.head_transform = nn.Sequential(nn.Linear(dim, dim), nn.GELU(), nn.LayerNorm(dim, eps=_EPS))
        self.head_bias = nn.Parameter(torch.zeros(vocab_size))
        init_transformer_weights(self)

    def forward(self, input_ids: Tensor, token_type_ids: Tensor | None = None) -> Tensor:
        length = input_ids.shape[1]
        if length > self.max_positions:
            raise ValueError(f"sequence length {length} exceeds max_positions {self.max_positions}")
        positions = torch.arange(length, device=input_ids.device)
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        embedded = self.word_embed(input_ids) + self.pos_embed(positions) + self.type_embed(token_type_ids)
        hidden = self.blocks(self.dropout(self.embed_norm(embedded)))
        return F.linear(self.head_transform(hidden), self.word_embed.weight, self.head_bias)


def _paper(dim: int, depth: int, num_heads: int) -> dict[str, object]:
    return {"dim": dim, "depth": depth, "num_heads": num_heads, "mlp_dim": 4 * dim}


register_model(
    "bert",
    BertForMaskedLM,
    {
        "tiny": {"vocab_size": 256, "max_positions": 128, "dim": 64, "depth": 2, "num_heads": 2, "mlp_dim": 128},
        "base": _paper(768, 12, 12),
        "large": _paper(1024, 24, 16),
    },
)
