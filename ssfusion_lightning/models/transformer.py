"""Transformer building blocks shared by ViT and GPT-2 (whose reference layouts fuse query/key/value; BERT has its own)."""

from __future__ import annotations

from typing import Literal

import torch.nn.functional as F
from torch import Tensor, nn


class SelfAttention(nn.Module):
    """Multi-head self-attention over (N, T, dim), with a fused query/key/value projection."""

    def __init__(self, dim: int, num_heads: int, dropout: float = 0.0, causal: bool = False) -> None:
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"dim {dim} is not divisible by num_heads {num_heads}")
        self.num_heads = num_heads
        self.causal = causal
        self.dropout = dropout
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.proj_dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        batch, length, dim = x.shape
        q, k, v = self.qkv(x).view(batch, length, 3, self.num_heads, dim // self.num_heads).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=self.causal
        )
        return self.proj_dropout(self.proj(attended.transpose(1, 2).reshape(batch, length, dim)))


class MLP(nn.Module):
    def __init__(self, dim: int, hidden_dim: int, dropout: float = 0.0, approximate: Literal["none", "tanh"] = "none"):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden_dim)
        self.act = nn.GELU(approximate=approximate)
        self.fc2 = nn.Linear(hidden_dim, dim)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.fc2(self.act(self.fc1(x))))


class TransformerBlock(nn.Module):
    """Attention + MLP with residuals; ``norm_first`` selects pre-norm (ViT, GPT-2) or post-norm."""

    def __init__(
        self,
        dim: int,
        num_heads: int,
        mlp_dim: int,
        dropout: float = 0.0,
        causal: bool = False,
        norm_first: bool = True,
        eps: float = 1e-5,
        approximate: Literal["none", "tanh"] = "none",
    ) -> None:
        super().__init__()
        self.norm_first = norm_first
        self.norm1 = nn.LayerNorm(dim, eps=eps)
        self.attn = SelfAttention(dim, num_heads, dropout, causal)
        self.norm2 = nn.LayerNorm(dim, eps=eps)
        self.mlp = MLP(dim, mlp_dim, dropout, approximate)

    def forward(self, x: Tensor) -> Tensor:
        if self.norm_first:
            x = x + self.attn(self.norm1(x))
            return x + self.mlp(self.norm2(x))
        x = self.norm1(x + self.attn(x))
        return self.norm2(x + self.mlp(x))


def init_transformer_weights(module: nn.Module, std: float = 0.02) -> None:
    """Normal(0, std) linear and embedding weights, zero biases: the initialization of GPT-2, BERT and ViT."""
    for child in module.modules():
        if isinstance(child, (nn.Linear, nn.Embedding)):
            nn.init.normal_(child.weight, std=std)
        if isinstance(child, nn.Linear) and child.bias is not None:
            nn.init.zeros_(child.bias)
