"""LSTM language model (Zaremba et al. 2014 style).

Its large embedding table is the naturally sparse gradient case: a batch touches only the rows of the
tokens it contains, so most of the table's gradient is exactly zero.
"""

from __future__ import annotations

from torch import Tensor, nn

from ssfusion_lightning.models.factory import register_model


class LSTMLanguageModel(nn.Module):
    """Token ids (N, T) -> next-token logits (N, T, vocab_size).

    Every batch starts from a zero hidden state, so batches are independent (no state carried across
    batches, which would tie a rank's batches to a fixed order).
    """

    def __init__(
        self,
        vocab_size: int = 33278,
        embedding_dim: int = 1500,
        hidden_dim: int = 1500,
        num_layers: int = 2,
        dropout: float = 0.65,
        tie_weights: bool = False,
    ) -> None:
        super().__init__()
        if tie_weights and embedding_dim != hidden_dim:
            raise ValueError(f"tie_weights needs embedding_dim == hidden_dim, got {embedding_dim} != {hidden_dim}")
        self.embedding = nn.Embedding(vocab_size, embedding_dim)
        self.dropout = nn.Dropout(dropout)
        self.lstm = nn.LSTM(
            embedding_dim, hidden_dim, num_layers, dropout=dropout if num_layers > 1 else 0.0, batch_first=True
        )
        self.decoder = nn.Linear(hidden_dim, vocab_size)
        nn.init.uniform_(self.embedding.weight, -0.1, 0.1)
        nn.init.uniform_(self.decoder.weight, -0.1, 0.1)
        nn.init.zeros_(self.decoder.bias)
        if tie_weights:
            self.decoder.weight = self.embedding.weight

    def forward(self, input_ids: Tensor) -> Tensor:
        hidden, _ = self.lstm(self.dropout(self.embedding(input_ids)))
        return self.decoder(self.dropout(hidden))


register_model(
    "lstm",
    LSTMLanguageModel,
    {
        "tiny": {"vocab_size": 256, "embedding_dim": 32, "hidden_dim": 32, "num_layers": 2, "dropout": 0.0},
        # Zaremba et al.'s medium and large configurations at the WikiText-2 word-level vocabulary.
        "medium": {"embedding_dim": 650, "hidden_dim": 650, "dropout": 0.5},
        "large": {"embedding_dim": 1500, "hidden_dim": 1500, "dropout": 0.65},
    },
)
