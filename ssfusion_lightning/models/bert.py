"""BERT (Devlin et al. 2019) with its masked-LM head, whose output projection is tied to the word embedding.

The parameter layout is the reference one (Hugging Face ``BertForMaskedLM`` without the pooler), in its
order: embeddings (word, position, token type, LayerNorm), then per layer separate query, key and value
projections, the attention output dense + LayerNorm, the intermediate dense and the output dense +
LayerNorm, then the head's bias, transform dense and transform LayerNorm (the decoder weight is the word
embedding). That is 5 + 16 * depth + 5 tensors: 202 for bert-base, 394 for bert-large. Fusion plans
depend on tensor count and shapes, so q/k/v are not fused as in GPT-2 and ViT.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ssfusion_lightning.models.factory import register_model
from ssfusion_lightning.models.transformer import init_transformer_weights

_EPS = 1e-12  # BERT's LayerNorm epsilon


class BertSelfAttention(nn.Module):
    """Bidirectional multi-head self-attention over (N, T, dim) with separate query/key/value projections."""

    def __init__(self, dim: int, num_heads: int, dropout: float = 0.0) -> None:
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"dim {dim} is not divisible by num_heads {num_heads}")
        self.num_heads = num_heads
        self.dropout = dropout
        self.query = nn.Linear(dim, dim)
        self.key = nn.Linear(dim, dim)
        self.value = nn.Linear(dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        batch, length, dim = x.shape

        def heads(t: Tensor) -> Tensor:
            return t.view(batch, length, self.num_heads, dim // self.num_heads).transpose(1, 2)

        attended = F.scaled_dot_product_attention(
            heads(self.query(x)), heads(self.key(x)), heads(self.value(x)), dropout_p=self.dropout if self.training else 0.0
        )
        return attended.transpose(1, 2).reshape(batch, length, dim)


class BertLayer(nn.Module):
    """Post-norm encoder layer: LayerNorm(x + attention), then LayerNorm(x + feed-forward)."""

    def __init__(self, dim: int, num_heads: int, mlp_dim: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.attention = BertSelfAttention(dim, num_heads, dropout)
        self.attention_output = nn.Linear(dim, dim)
        self.attention_norm = nn.LayerNorm(dim, eps=_EPS)
        self.intermediate = nn.Linear(dim, mlp_dim)
        self.output = nn.Linear(mlp_dim, dim)
        self.output_norm = nn.LayerNorm(dim, eps=_EPS)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        x = self.attention_norm(x + self.dropout(self.attention_output(self.attention(x))))
        return self.output_norm(x + self.dropout(self.output(F.gelu(self.intermediate(x)))))


class MaskedLMHead(nn.Module):
    """Transform (dense, GELU, LayerNorm), then the decoder: the word embedding (tied) and a bias."""

    def __init__(self, dim: int, vocab_size: int) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(vocab_size))
        self.transform = nn.Sequential(nn.Linear(dim, dim), nn.GELU(), nn.LayerNorm(dim, eps=_EPS))

    def forward(self, hidden: Tensor, decoder_weight: Tensor) -> Tensor:
        return F.linear(self.transform(hidden), decoder_weight, self.bias)


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
        self.blocks = nn.Sequential(*(BertLayer(dim, num_heads, mlp_dim, dropout) for _ in range(depth)))
        self.head = MaskedLMHead(dim, vocab_size)
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
        return self.head(hidden, self.word_embed.weight)


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
